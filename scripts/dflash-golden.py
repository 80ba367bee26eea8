"""Regenerate tests/golden/dflash/: tiny random drafters in z-lab's layouts (DFlash and DFlash2) for a
tiny random Qwen3 target, and the tokens z-lab's reference decoding (`dflash.model.dflash_generate`,
greedy) gives with them, with every draft it proposed.

Run it with z-lab's `dflash` package (PyPI `dflash`, its transformers backend) and transformers
installed -- not clover's environment: `pip install dflash transformers torch` in a scratch venv,
then `python scripts/dflash-golden.py`. The vocabulary (264) holds clover's byte tokenizer, which the
test writes beside the target (no tokenizer is stored here). Weights are drawn from a seed, rounded to float16 and stored
as float16 safetensors (tens of KB), so clover reads exactly the values the reference ran with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "dflash"
TARGET = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              max_position_embeddings=256)
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 7,
           "use_sliding_window": True}  # without it transformers' Qwen3Config drops the window (and its cache fails)  # z-lab's current drafters
DRAFTERS = {  # name -> (class, dflash_config beyond the common keys, top-level config keys)
    "dflash": (DFlashDraftModel, {}, {}),
    "dflash-sliding": (DFlashDraftModel, {}, SLIDING),
    "dflash2": (DFlash2DraftModel, {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8,
                                    "selector_top_k": 4}, SLIDING),
}
PROMPTS = [[5, 17, 42, 9, 63, 2], [88, 3, 3, 71]]
MAX_NEW = 24
SEED = 1234


def randomise(model: torch.nn.Module, seed: int, std: float) -> None:
    """normal(0, std) for every matrix and kernel, 1 + normal(0, 0.1) for norms, rounded to float16."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen)
            p.copy_((1 + 0.1 * r if "norm" in name else std * r).half().float())


def save(model: torch.nn.Module, config: dict, directory: Path, rename=lambda k: k) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {rename(k): v.detach().half().contiguous() for k, v in model.state_dict().items()
             if not k.endswith("inv_freq")}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(SEED)
    tcfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **TARGET}
    target = Qwen3ForCausalLM(Qwen3Config(**TARGET)).eval()
    randomise(target, SEED, 0.5)
    save(target, tcfg, args.out / "target")
    golden = {"target": "target", "max_new_tokens": MAX_NEW, "prompts": PROMPTS, "drafters": {}}
    for i, (name, (cls, extra, top)) in enumerate(DRAFTERS.items()):
        dcfg = {**{k: v for k, v in TARGET.items() if k != "tie_word_embeddings"}, "num_hidden_layers": 2,
                "architectures": [cls.__name__], "model_type": "qwen3", "num_target_layers": 4, **top,
                "dflash_config": {"block_size": 6, "target_layer_ids": [0, 2], "mask_token_id": 258, **extra}}
        draft = cls(Qwen3Config(**dcfg)).eval()
        randomise(draft, SEED + 1 + i, 0.3)
        # DFlash2's stored layout: the selector's codebooks without ".weight" (its from_pretrained maps them back)
        save(draft, dcfg, args.out / name, lambda k: k.removesuffix(".weight") if "codebook" in k else k)
        drafts: list[list[int]] = []  # every draft it proposes: the selector's path, or the argmax
        hook = "propose" if cls is DFlash2DraftModel else "compute_logits"
        inner = getattr(draft, hook)

        def spy(*a, inner=inner, hook=hook, **kw):
            out = inner(*a, **kw)
            drafts.append((out[0] if hook == "propose" else out.argmax(-1))[0].tolist())
            return out
        setattr(draft, hook, spy)
        runs = []
        for prompt in PROMPTS:
            drafts.clear()
            stats = dflash_generate(draft, target, torch.tensor([prompt]), MAX_NEW, None, return_stats=False)
            ar = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
            runs.append({"tokens": stats[0, len(prompt):].tolist(), "ar": ar[0, len(prompt):].tolist(),
                         "drafts": list(drafts)})
        golden["drafters"][name] = runs
    (args.out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
