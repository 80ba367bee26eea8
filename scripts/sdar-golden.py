"""Regenerate tests/golden/sdar/ from a checkout of the SDAR reference (github.com/JetAstra/SDAR).

    python scripts/sdar-golden.py PATH/TO/SDAR [--out tests/golden/sdar]

Run it in a scratch environment with the transformers the reference was written for (4.52.x, its
checkpoints' `transformers_version`) and torch; nothing of clover is imported. It builds a tiny random
SDAR checkpoint in the family's real layout (config.json with `model_type` "sdar", `block_size`,
`mask_token_id`, the `auto_map` to modeling_sdar; model.safetensors with Qwen3's tensor names), loads
it with the reference's own `SDARForCausalLM` (training/model/SDAR-4B-Chat/modeling_sdar.py) and runs
the reference's `block_diffusion_generate` (generate.py) on it. It writes

- `checkpoint/`: the tiny checkpoint (config.json, model.safetensors),
- `golden.safetensors`: the full-sequence logits (the block-causal prefill mask of generate.py over a
  whole sequence; in float32, and in float64 from the same weights) and the logits of every denoising forward of one generation per block size (the
  cached steps),
- `cases.json`: per case the prompt, the block size and steps, the tokens generate.py returns and the
  denoising forwards it ran per block, and the order of the cached-step forwards.

Shims, each forced by running on a CPU or by asking for greedy decoding, are those of
src/clover/bench/peers/sdar_reference.py (named there), which this script loads by path.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 0
HEAD_STD = 10  # the LM head's scale: confidences spread across the 0.9 threshold (tiny random weights are flat otherwise)
GEN_LENGTH = 16
THRESHOLD = 0.9  # the threshold SDAR's README and JetEngine/lmdeploy use (generate.py's CLI default is 0.85)

# the tiny config: the real SDAR-4B-Chat config.json with the sizes shrunk (every other key kept)
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, max_window_layers=2,
            bos_token_id=2, eos_token_id=1, mask_token_id=127, block_size=4)
PROMPTS = {  # lengths: at a block's end for block 4 and 8, inside a block for both, inside the first block
    "p8": [5, 17, 33, 60, 9, 71, 44, 102],
    "p11": [8, 90, 14, 3, 77, 51, 26, 119, 40, 66, 12],
    "p5": [30, 7, 84, 113, 58],
}
# (block_length, denoising_steps): SDAR's default (4, 4) and a second size at one token per step quota
SCHEDULES = [(4, 4), (8, 8)]
FULL_LEN = 14  # the full-sequence logits: one sequence of this length (ends inside a block of either size)


def reference_module(name: str):
    """src/clover/bench/peers/NAME.py, loaded by path: a family's shims and reference loader (shared with
    `clover bench peers`' reference rows; it imports nothing of clover)."""
    path = Path(__file__).resolve().parents[1] / "src/clover/bench/peers" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REFERENCE = reference_module("sdar_reference")
MODEL_DIR = REFERENCE.MODEL_DIR
load_reference = REFERENCE.load_reference


def tiny_checkpoint(checkout: Path, modeling, out: Path):
    """config.json (the real one, shrunk) and model.safetensors of a seeded random SDARForCausalLM."""
    raw = json.loads((checkout / MODEL_DIR / "config.json").read_text())
    raw.update(TINY)
    raw["torch_dtype"] = "float32"
    raw["attn_implementation"] = "sdpa"  # the inference path never reads it; flex_attention is training's
    config = modeling.SDARConfig(**raw)
    torch.manual_seed(SEED)
    model = modeling.SDARForCausalLM(config).eval()
    randomise(model, [TINY["mask_token_id"]])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return model


@torch.no_grad()
def randomise(model, never: list[int]) -> torch.Generator:
    """Every weight drawn from SEED in name order: norms near 1, the LM head scaled by HEAD_STD (a
    peaked head, so confidences spread across the threshold) with the rows of `never` at zero (the
    mask: a trained model never predicts it), biases small, matrices at 1/sqrt(fan-in). Returns the
    generator, for whatever the caller draws next."""
    gen = torch.Generator().manual_seed(SEED)
    for name, p in sorted(model.named_parameters()):
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name == "lm_head.weight":
            p.copy_(torch.randn(p.shape, generator=gen) * HEAD_STD / p.shape[1] ** 0.5)
            p[never] = 0.0
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return gen


class Recorder:
    """Wraps the model: records each forward's kind (store_kv: a commit) and logits."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self.device = model.device

    def eval(self):
        return self

    def __call__(self, ids, **kw):
        out = self.model(ids, **kw)
        self.calls.append((bool(kw.get("store_kv")), ids[0].tolist(), None if out.logits is None else out.logits[0]))
        return out


def run_case(generate, model, prompt, block, steps):
    rec = Recorder(model)
    ids = torch.tensor([prompt])
    x = generate.block_diffusion_generate(
        rec, {"input_ids": ids}, mask_id=TINY["mask_token_id"], gen_length=GEN_LENGTH, block_length=block,
        denoising_steps=steps, temperature=1.0, top_k=0, top_p=1.0, remasking_strategy="low_confidence_dynamic",
        confidence_threshold=THRESHOLD, stopping_criteria_idx=None)
    tokens = x[0, len(prompt):].tolist()
    assert TINY["mask_token_id"] not in tokens, "a golden case left a mask in its output"
    # denoising forwards per decoded block (each block ends with one store_kv forward)
    per_block, n = [], 0
    prefill = len(prompt) >= block
    for i, (store, _, _) in enumerate(rec.calls):
        if prefill and i == 0:
            continue
        if store:
            per_block.append(n)
            n = 0
        else:
            n += 1
    return tokens, per_block, rec.calls


def full_logits(model, ids, block):
    """The logits of one forward over `ids` under generate.py's prefill mask (block-causal)."""
    L = ids.shape[1]
    nb = -(-L // block)
    mask = torch.tril(torch.ones(nb, nb)).repeat_interleave(block, 0).repeat_interleave(block, 1)[None, :L, :L]
    return model(ids, attention_mask=mask.to(model.dtype), position_ids=torch.arange(L)[None]).logits[0]


def write_golden(out: Path, head: dict, cases: list[dict], tensors: dict) -> None:
    """golden.safetensors and cases.json (one case a line: small diffs); each case printed."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "golden.safetensors"), metadata={"format": "pt"})
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    body = ",\n".join("  " + json.dumps(c) for c in cases)
    (out / "cases.json").write_text("{\n" + "\n".join(lines) + '\n "cases": [\n' + body + "\n ]\n}\n")
    for c in cases:
        print(f"{c['name']}: {c['tokens']} forwards/block {c['denoise_forwards_per_block']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="a checkout of github.com/JetAstra/SDAR")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/golden/sdar")
    args = ap.parse_args()
    if REFERENCE.check_checkout(args.checkout):
        sys.exit(REFERENCE.check_checkout(args.checkout))
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="sdar-golden-"))
    try:
        modeling, generate = load_reference(args.checkout, work)
        model = tiny_checkpoint(args.checkout, modeling, args.out / "checkpoint")
        tensors, cases = {}, []
        with torch.no_grad():
            for block, _ in SCHEDULES:  # full-sequence logits under generate.py's block-causal mask
                ids = torch.tensor([(PROMPTS["p11"] + PROMPTS["p8"])[:FULL_LEN]])
                tensors[f"full_b{block}"] = full_logits(model, ids, block)
            for block, steps in SCHEDULES:
                for name, prompt in PROMPTS.items():
                    tokens, per_block, calls = run_case(generate, model, prompt, block, steps)
                    case = {"name": f"{name}_b{block}", "prompt": prompt, "block_length": block, "steps": steps,
                            "threshold": THRESHOLD, "gen_length": GEN_LENGTH, "tokens": tokens,
                            "denoise_forwards_per_block": per_block}
                    if name == "p11":  # the cached steps of this one: every forward's kind, input and logits
                        case["forwards"] = [{"commit": s, "ids": i} for s, i, _ in calls]
                        for j, (commit, _, logits) in enumerate(calls):
                            if not commit:  # a commit's logits are never read by generate.py
                                tensors[f"step_{name}_b{block}_{j}"] = logits
                    cases.append(case)
            model64 = copy.deepcopy(model).double()  # the same in float64: clover's float64 must agree to ~1e-12
            for block, _ in SCHEDULES:
                ids = torch.tensor([(PROMPTS["p11"] + PROMPTS["p8"])[:FULL_LEN]])
                tensors[f"full64_b{block}"] = full_logits(model64, ids, block)
        head = {"reference": "github.com/JetAstra/SDAR generate.py + " + MODEL_DIR + "/modeling_sdar.py",
                "mask_token_id": TINY["mask_token_id"], "full_sequence": (PROMPTS["p11"] + PROMPTS["p8"])[:FULL_LEN]}
        write_golden(args.out, head, cases, tensors)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
