"""Regenerate tests/golden/llada2/ from LLaDA2's reference code (its checkpoints' remote code).

    python scripts/llada2-golden.py DIR [--out tests/golden/llada2]

DIR holds the reference's `modeling_llada2_moe.py` and `configuration_llada2_moe.py` (the files next to
the weights of inclusionAI/LLaDA2.0-mini; the run recorded in docs/checkpoints.md read them from the
copy in github.com/yks23/Information-Gain-Sampler, dllm/dllm/pipelines/llada2/models/). Run it in a
scratch environment with the transformers that code imports (>= 4.56: `TransformersKwargs`) and torch;
nothing of clover is imported. It builds a tiny random LLaDA2 checkpoint in the family's layout
(config.json with `model_type` "llada2_moe", model.safetensors with its tensor names, experts one
by one), and records with the reference's own `LLaDA2MoeModelLM`:

- `checkpoint/`: the tiny checkpoint,
- `golden.safetensors`: the full-sequence logits under the block-causal mask its `generate` builds
  and the logits of every denoising forward of one
  generation per block size (the block's positions),
- `cases.json`: per case the prompt, block size and steps, the tokens its `generate` returns and the
  denoising forwards it ran per block.

Shims (each forced by the CPU or by greedy decoding): 1. `_sample_with_temperature_topk_topp`, which
samples even at temperature 0, -> the argmax token and its softmax probability (greedy); 2. its
attention mask, built in bfloat16 (`.log()` of a 0/1 mask: 0 and -inf, exact), cast to the model's
float32, which torch's CPU attention requires of a float mask.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            partial_rotary_factor=0.5, rope_theta=600000.0, rms_norm_eps=1e-6, use_qkv_bias=False, use_bias=False,
            use_qk_norm=True, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False,
            mask_token_id=127, model_type="llada2_moe", architectures=["LLaDA2MoeModelLM"], torch_dtype="float32",
            auto_map={"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                      "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"})
PROMPTS = {"p8": [5, 17, 33, 60, 9, 71, 44, 102], "p11": [8, 90, 14, 3, 77, 51, 26, 119, 40, 66, 12],
           "p5": [30, 7, 84, 113, 58]}
SCHEDULES = [(4, 4), (8, 8), (8, 4)]  # (block_length, steps); LLaDA2's default is (32, 32)
THRESHOLD = 0.95  # its generate's default
GEN_LENGTH = 14
FULL_LEN = 14
MASK, EOS = TINY["mask_token_id"], TINY["eos_token_id"]


def sdar_golden():
    """scripts/sdar-golden.py as a module: the shared weight draw and golden writer."""
    spec = importlib.util.spec_from_file_location("sdar_golden", Path(__file__).with_name("sdar-golden.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REFERENCE = sdar_golden().reference_module("llada2_reference")  # shim 1 and the loader, shared with bench peers
FILES = REFERENCE.FILES
load_reference = REFERENCE.load_reference


def tiny_checkpoint(modeling, config_mod, out: Path):
    raw = dict(TINY)
    cfg = config_mod.LLaDA2MoeConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map")})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = modeling.LLaDA2MoeModelLM(cfg).eval()
    gen = sdar_golden().randomise(model, [MASK, EOS])  # nor, here, the end: the cases run to their length
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):
            if name.endswith("expert_bias"):  # off zero, so the bias's part in routing shows
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model


def full_logits(model, ids, block):
    L = ids.shape[1]
    nb = -(-L // block)
    mask = torch.tril(torch.ones(nb, nb)).repeat_interleave(block, 0).repeat_interleave(block, 1)
    mask = mask[None, None, :L, :L].log().to(torch.bfloat16).to(model.dtype)  # as generate builds it; shim 2
    return model(ids, attention_mask=mask, position_ids=torch.arange(L)[None]).logits[0]


class Recorder:
    def __init__(self, model):
        self.model, self.calls = model, []
        self.forward = model.forward

    def __call__(self, ids, **kw):
        kw["attention_mask"] = kw["attention_mask"].to(self.model.dtype)  # shim 2
        out = self.forward(ids, **kw)
        self.calls.append((ids.shape[1], ids[0].tolist(), out.logits[0]))
        return out


def run_case(model, prompt, block, steps):
    rec = Recorder(model)
    model.forward = rec
    try:
        out = model.generate(torch.tensor([prompt]), temperature=0.0, block_length=block, steps=steps,
                             gen_length=GEN_LENGTH, threshold=THRESHOLD, eos_id=EOS, mask_id=MASK)
    finally:
        del model.forward
    tokens = out[0].tolist()
    assert MASK not in tokens and EOS not in tokens, tokens
    ends = [n for n, _, _ in rec.calls]  # each forward covers the sequence up to its block's end
    per_block = [ends.count(e) for e in sorted(set(ends))]
    return tokens, per_block, [(n, ids[-block:], logits[-block:]) for n, ids, logits in rec.calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", type=Path, help="a directory holding " + " and ".join(FILES))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/golden/llada2")
    args = ap.parse_args()
    if REFERENCE.check_checkout(args.reference):
        sys.exit(REFERENCE.check_checkout(args.reference))
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="llada2-golden-"))
    try:
        modeling, config_mod = load_reference(args.reference, work)
        model = tiny_checkpoint(modeling, config_mod, args.out / "checkpoint")
        seq = (PROMPTS["p11"] + PROMPTS["p8"])[:FULL_LEN]
        tensors, cases = {}, []
        with torch.no_grad():
            for block in sorted({b for b, _ in SCHEDULES}):
                tensors[f"full_b{block}"] = full_logits(model, torch.tensor([seq]), block)
            for block, steps in SCHEDULES:
                for name, prompt in PROMPTS.items():
                    tokens, per_block, calls = run_case(model, prompt, block, steps)
                    case = {"name": f"{name}_b{block}_s{steps}", "prompt": prompt, "block_length": block, "steps": steps,
                            "threshold": THRESHOLD, "gen_length": GEN_LENGTH, "tokens": tokens,
                            "denoise_forwards_per_block": per_block}
                    if name == "p11":  # each forward: where its window ends and its block's ids
                        case["forwards"] = [{"end": n, "ids": ids} for n, ids, _ in calls]
                        for j, (_, _, logits) in enumerate(calls):
                            tensors[f"step_{case['name']}_{j}"] = logits
                    cases.append(case)
        head = {"reference": "LLaDA2's remote code (modeling_llada2_moe.py: LLaDA2MoeModelLM.generate)",
                "mask_token_id": MASK, "full_sequence": seq}
        sdar_golden().write_golden(args.out, head, cases, tensors)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
