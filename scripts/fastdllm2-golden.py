"""Regenerate tests/golden/fastdllm2/ from Fast-dLLM v2's reference code (its Hugging Face remote code).

    python scripts/fastdllm2-golden.py PATH/TO/SNAPSHOT [--out tests/golden/fastdllm2]

PATH/TO/SNAPSHOT holds the remote code of Efficient-Large-Model/Fast_dLLM_v2_1.5B or _7B as published
on the Hub (modeling.py, configuration.py, config.json; no weights needed), loaded by
src/clover/bench/peers/fastdllm2_reference.py (shared with `clover bench peers`). Run it in a scratch
environment with the transformers the checkpoints were saved with (4.53.1, their
`transformers_version` and NVlabs/Fast-dLLM v2/requirements.txt), torch and einops; nothing of clover
is imported. It builds a tiny random checkpoint in the family's real layout (config.json with
`model_type` "Fast_dLLM_Qwen", `bd_size` and the `auto_map`; model.safetensors with Qwen2's tensor
names), loads it with the reference's own `Fast_dLLM_QwenForCausalLM` and runs its `generate` (greedy:
temperature 0, its default, with the model card's threshold 0.9). It writes

- `checkpoint/`: the tiny checkpoint (config.json, model.safetensors),
- `golden.safetensors`: the full-sequence logits (the block-causal prefill of `generate`, per block
  size; float32, and float64 from the same weights) and, for one prompt per block size, the logits
  of every forward `generate` ran that it reads (a denoising forward's rows predicting its sub-block;
  a commit's last position),
- `cases.json`: per case the prompt, the block and sub-block sizes, the tokens `generate` returns
  after the prompt (its stop token included, as it returns it), its forwards (all of them, and the
  denoising forwards per block: the forwards between two commits), and the inputs of the recorded
  forwards.

No shim is needed on a CPU: the inference path attends through transformers' SDPA, and the
flex-attention training path is never called. The one argument set against `generate`'s defaults
is the model card's `threshold=0.9` (the signature's default, 1, accepts one position a step);
`stop_token` is the tiny vocabulary's EOS (the default is Qwen's `<|im_end|>`, 151645).
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

HERE = Path(__file__).resolve().parent
THRESHOLD = 0.9  # the model card's and NVlabs' run_chatbot.py's (generate's own default is 1)
EOS = 50  # a token the tiny model decodes inside a block in two cases (the others run to their length)
# the LM head's scale (sdar-golden.py's draw, 10 there): peaked enough that confidences cross 0.9, flat
# enough that the logits stay below ~16, where float32 rounds to 1e-6
HEAD_STD = 5

# the tiny config: the real config.json with the sizes shrunk (every other key kept)
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, max_window_layers=2,
            bos_token_id=2, eos_token_id=EOS, pad_token_id=EOS, bd_size=32, mask_token_id=127)
# generate's `mask_id` argument. The real config.json names no mask (generate's default is 151665, the
# tokenizer's added "|<MASK>|"), which is outside the tiny vocabulary: the tiny config.json states it
# as `mask_token_id` (a key the reference ignores; clover reads it, else 151665)
MASK = TINY["mask_token_id"]
# (block_size, small_block_size): the checkpoints' default (32, 8) and a smaller grid with 2 sub-blocks
SCHEDULES = [(32, 8), (8, 4)]
BLOCKS_OUT = 2  # max_new_tokens = this many blocks (generate decodes max_new_tokens // block_size blocks)
# prompt lengths per block size: inside the first block (no prefill), at the end of the second (the
# prefill's argmax opens the first block), inside the second (the prompt's tail opens it). A prompt of
# exactly one block is left out: `generate` prefills only a prompt longer than one block, so it then
# denoises the first block without the prompt (clover commits the prompt; docs/checkpoints.md)
LENGTHS = {32: (5, 64, 41), 8: (5, 16, 11)}
REPLAYED = {32: 41, 8: 11}  # the prompt length whose every forward is recorded (the cached steps)
FULL_LEN = 44  # the full-sequence logits: one sequence of this length (ends inside a block of either size)


def _sdar_golden():
    """scripts/sdar-golden.py, for its seeded weight draw and golden writer (shared, not copied)."""
    spec = importlib.util.spec_from_file_location("sdar_golden", HERE / "sdar-golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


G = _sdar_golden()
REFERENCE = G.reference_module("fastdllm2_reference")  # its loader and generate (shared with bench peers)


def prompts() -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(7)
    longest = max(max(v) for v in LENGTHS.values())
    base = torch.randint(3, MASK, (max(longest, FULL_LEN),), generator=gen).tolist()
    return {n: base[:n] for n in sorted({n for v in LENGTHS.values() for n in v} | {FULL_LEN})}


def tiny_checkpoint(snapshot: Path, configuration, modeling, out: Path, g):
    """config.json (the real one, shrunk) and model.safetensors of a seeded random model."""
    raw = json.loads((snapshot / "config.json").read_text())
    raw.update(TINY)
    raw["layer_types"] = ["full_attention"] * TINY["num_hidden_layers"]
    raw["torch_dtype"] = "float32"
    torch.manual_seed(0)
    model = REFERENCE.build(configuration, modeling, raw)
    g.randomise(model, [MASK])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return model


def record(model):
    """Wraps the model's forward (generate calls self.forward): each call's kind (a commit writes the
    cache: update_past_key_values), input ids and logits."""
    calls = []
    inner = model.forward

    def forward(*a, **kw):
        out = inner(*a, **kw)
        calls.append((bool(kw.get("update_past_key_values")), kw["input_ids"][0].tolist(), out.logits[0]))
        return out

    model.forward = forward
    return calls


def run_case(model, prompt, block, small):
    calls = record(model)
    try:
        tokens = REFERENCE.generate(model, prompt, BLOCKS_OUT * block, block=block, sub_block=small, threshold=THRESHOLD,
                                    mask_id=MASK, stop_token=EOS)
    finally:
        del model.forward
    assert MASK not in tokens, "a golden case left a mask in its output"
    # denoising forwards per block: those after the prefill (a commit of the prompt's whole blocks) or
    # a block's commit, up to the next commit; the last block holds that commit's argmax alone (0
    # forwards) unless a stop token ended a block before its commit
    per_block, n = [], 0
    for commit, _, _ in calls[1:] if calls[0][0] else calls:
        if commit:
            per_block.append(n)
            n = 0
        else:
            n += 1
    per_block.append(n)
    return tokens, per_block, calls


def read_rows(block_ids: list[int], small: int) -> list[int]:
    """[lo, hi): the rows of a denoising forward's logits that generate reads, shifted by one: those
    predicting the sub-block it decodes (the leftmost with a mask), the first row predicting itself."""
    lo = block_ids.index(MASK) // small * small
    return [max(lo - 1, 0), lo + small - 1]


def full_logits(model, ids, block):
    """The logits of generate's prefill over `ids` (block-causal on the absolute grid of `block`)."""
    return model(input_ids=ids, use_cache=True, update_past_key_values=True, block_size=block).logits[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot", type=Path, help="the remote code of Efficient-Large-Model/Fast_dLLM_v2_1.5B or _7B")
    ap.add_argument("--out", type=Path, default=HERE.parent / "tests/golden/fastdllm2")
    args = ap.parse_args()
    why = REFERENCE.check_checkout(args.snapshot) or (None if (args.snapshot / "config.json").is_file() else
                                                      f"{args.snapshot}: no config.json")
    if why:
        sys.exit(why)
    torch.set_num_threads(1)
    g = G
    g.HEAD_STD = HEAD_STD
    work = Path(tempfile.mkdtemp(prefix="fastdllm2-golden-"))
    try:
        configuration, modeling = REFERENCE.load_reference(args.snapshot, work)
        model = tiny_checkpoint(args.snapshot, configuration, modeling, args.out / "checkpoint", g)
        ps = prompts()
        tensors, cases = {}, []
        with torch.no_grad():
            model64 = copy.deepcopy(model).double()  # clover's float64 must agree to ~1e-12
            for block, _ in SCHEDULES:
                ids = torch.tensor([ps[FULL_LEN]])
                tensors[f"full_b{block}"] = full_logits(model, ids, block)
                tensors[f"full64_b{block}"] = full_logits(model64, ids, block)
            for block, small in SCHEDULES:
                for n in LENGTHS[block]:
                    tokens, per_block, calls = run_case(model, ps[n], block, small)
                    case = {"name": f"p{n}_b{block}", "prompt": ps[n], "block_length": block, "sub_block": small,
                            "threshold": THRESHOLD, "max_new_tokens": BLOCKS_OUT * block, "tokens": tokens,
                            "forwards": len(calls), "denoise_forwards_per_block": per_block}
                    if n == REPLAYED[block]:  # the cached steps: every forward's kind, input and logits
                        case["replay"] = []
                        for j, (commit, ids, logits) in enumerate(calls):
                            rows = [len(ids) - 1, len(ids)] if commit else read_rows(ids, small)
                            case["replay"].append({"commit": commit, "ids": ids, "rows": rows})
                            tensors[f"step_{case['name']}_{j}"] = logits[rows[0]:rows[1]]
                    cases.append(case)
        head = {"reference": "Fast_dLLM_QwenForCausalLM.generate (Efficient-Large-Model/Fast_dLLM_v2 remote code)",
                "mask_token_id": MASK, "eos_token_id": EOS, "full_sequence": ps[FULL_LEN]}
        g.write_golden(args.out, head, cases, tensors)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
