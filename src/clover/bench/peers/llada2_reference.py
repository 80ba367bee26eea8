"""LLaDA2's reference decoding (`LLaDA2MoeModelLM.generate` in its checkpoints' remote code,
`modeling_llada2_moe.py` + `configuration_llada2_moe.py`) from a user's directory holding those two
files, the code the `llada2` row of `clover bench peers` and scripts/llada2-golden.py run. Its code
cannot ship with clover: this file loads it from that directory, in an interpreter with the transformers
it imports (>= 4.56), and imports nothing of clover (the peers worker and the golden script load it by
path).

Shims (each forced by the CPU or by greedy decoding): 1. `_sample_with_temperature_topk_topp`, which
samples even at temperature 0, -> the argmax token and its softmax probability (greedy); 2. its
attention mask, built in bfloat16 (`.log()` of a 0/1 mask: 0 and -inf, exact), cast to the model's
float32, which torch's CPU attention requires of a float mask.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import torch

FILES = ("modeling_llada2_moe.py", "configuration_llada2_moe.py")


def check_checkout(src: Path) -> str | None:
    """Why `src` does not hold LLaDA2's remote code (one line), or None."""
    missing = [f for f in FILES if not (src / f).is_file()]
    return f"{src}: no {', '.join(missing)} (LLaDA2's remote code)" if missing else None


def load_reference(src: Path, work: Path):
    """The reference's modeling and configuration modules, with shim 1."""
    pkg = work / "llada2_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in FILES:
        shutil.copy(src / name, pkg / name)
    sys.path.insert(0, str(work))
    modeling = importlib.import_module("llada2_ref.modeling_llada2_moe")
    config = importlib.import_module("llada2_ref.configuration_llada2_moe")

    def greedy(self, logits, temperature=1.0, top_k=0, top_p=1.0):  # shim 1
        probs = torch.softmax(logits.float(), dim=-1)
        p, tok = probs.max(dim=-1)
        return tok, p

    modeling.LLaDA2MoeModelLM._sample_with_temperature_topk_topp = greedy
    return modeling, config


def cast_mask(model) -> None:
    """Shim 2 on `model`: its forward casts the attention mask to the model's dtype."""
    forward = model.forward

    def cast(ids, **kw):
        if kw.get("attention_mask") is not None:
            kw["attention_mask"] = kw["attention_mask"].to(model.dtype)
        return forward(ids, **kw)

    model.forward = cast


def load(src: Path, model_dir: Path, work: Path):
    """The reference's LLaDA2MoeModelLM holding `model_dir`'s weights (float32, SDPA), shimmed."""
    from safetensors.torch import load_file

    modeling, config_mod = load_reference(src, work)
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = config_mod.LLaDA2MoeConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map")})
    cfg._attn_implementation = "sdpa"
    model = modeling.LLaDA2MoeModelLM(cfg).eval()
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or [k for k in missing if "rotary_emb" not in k]:
        raise ValueError(f"{model_dir}: weights do not fit the reference model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    cast_mask(model)
    return model


def decode(model, ids: list[int], n: int, *, block: int, steps: int, threshold: float, mask_id: int) -> list[int]:
    """`generate` on one prompt, greedy, with no EOS (no early stop, no cut): its `n` tokens."""
    out = model.generate(torch.tensor([ids]), temperature=0.0, block_length=block, steps=steps, gen_length=n,
                         threshold=threshold, eos_id=-1, mask_id=mask_id)
    return out[0].tolist()
