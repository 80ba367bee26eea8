"""SDAR's reference decoding from a user's checkout of github.com/JetAstra/SDAR (`generate.py`'s
`block_diffusion_generate` and `training/model/SDAR-4B-Chat/modeling_sdar.py`), the code the `sdar`
row of `clover bench peers` and scripts/sdar-golden.py run. Its code cannot ship with clover: this file
loads it from the checkout, in an interpreter with the transformers it was written for (4.52.x), and
imports nothing of clover (the peers worker and the golden script load it by path).

Shims, each forced by running on a CPU or by asking for greedy decoding (nothing else is changed):
1. `flash_attn.ops.triton.layer_norm.rms_norm_fn` (a Triton kernel) -> the same RMSNorm in torch, in
   fp32 (the body modeling_sdar.py keeps commented out under its call).
2. `flash_attn.flash_attn_func(q, k, v, causal=False, softmax_scale=s)` (the decode-time attention)
   -> `torch.nn.functional.scaled_dot_product_attention` with the same scale, no mask, GQA.
3. `fused_linear_diffusion_cross_entropy` (the training loss; imports Triton) -> an empty stand-in,
   never called at inference.
4. `sample_with_temperature_topk_topp` (generate.py samples; it has no greedy path) -> the argmax
   token and its softmax probability, which is what greedy unmasking scores (lmdeploy's SDAR path with
   `do_sample=False`); the acceptance rule itself (`low_confidence_dynamic`) is the reference's.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

MODEL_DIR = "training/model/SDAR-4B-Chat"
MODEL_FILES = ("configuration_sdar.py", "modeling_sdar.py")


def check_checkout(checkout: Path) -> str | None:
    """Why `checkout` is not an SDAR checkout (one line), or None."""
    if not (checkout / MODEL_DIR / "modeling_sdar.py").is_file() or not (checkout / "generate.py").is_file():
        return f"{checkout}: not an SDAR checkout (needs generate.py and {MODEL_DIR}/modeling_sdar.py)"
    return None


def install_shims() -> None:
    """Shims 1-3, as modules the reference imports."""

    def rms_norm_fn(x, weight, bias=None, eps=1e-6, **_):  # shim 1
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def flash_attn_func(q, k, v, causal=False, softmax_scale=None, **_):  # shim 2: [B, L, H, D] in and out
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2)

    flash = types.ModuleType("flash_attn")
    flash.flash_attn_func = flash_attn_func
    flash.flash_attn_varlen_func = None
    ops, trit, ln = (types.ModuleType(n) for n in ("flash_attn.ops", "flash_attn.ops.triton",
                                                   "flash_attn.ops.triton.layer_norm"))
    ln.rms_norm_fn = rms_norm_fn
    sys.modules.update({"flash_attn": flash, "flash_attn.ops": ops, "flash_attn.ops.triton": trit,
                        "flash_attn.ops.triton.layer_norm": ln})


def load_reference(checkout: Path, work: Path):
    """The reference's modeling package (config + model classes) and generate module, shimmed."""
    pkg = work / "sdar_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in MODEL_FILES:
        shutil.copy(checkout / MODEL_DIR / name, pkg / name)
    (pkg / "fused_linear_diffusion_cross_entropy.py").write_text(  # shim 3
        "class FusedLinearDiffusionCrossEntropyLoss:\n    pass\n")
    shutil.copy(checkout / "generate.py", work / "sdar_generate.py")
    sys.path.insert(0, str(work))
    import transformers.modeling_flash_attention_utils  # noqa: F401  (reads flash_attn's absence before the shims exist)
    import transformers.modeling_utils  # noqa: F401
    install_shims()
    modeling = importlib.import_module("sdar_ref.modeling_sdar")
    generate = importlib.import_module("sdar_generate")

    def greedy(logits, temperature=1.0, top_k=0, top_p=1.0):  # shim 4
        probs = torch.softmax(logits.float(), dim=-1)
        p, tok = probs.max(dim=-1)
        return tok, p

    generate.sample_with_temperature_topk_topp = greedy
    return modeling, generate


def load(checkout: Path, model_dir: Path, work: Path):
    """(the reference's generate module, its SDARForCausalLM holding `model_dir`'s weights, float32)."""
    from safetensors.torch import load_file

    modeling, generate = load_reference(checkout, work)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(torch_dtype="float32", attn_implementation="sdpa")  # the inference path never reads the latter
    model = modeling.SDARForCausalLM(modeling.SDARConfig(**raw)).eval()
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=not raw.get("tie_word_embeddings"))
    return generate, model


def decode(handle, ids: list[int], n: int, *, block: int, steps: int, threshold: float, mask_id: int) -> list[int]:
    """`block_diffusion_generate` on one prompt, greedy, no stop: its first `n` tokens (it decodes whole
    blocks of the absolute grid)."""
    generate, model = handle
    x = generate.block_diffusion_generate(model, {"input_ids": torch.tensor([ids])}, mask_id=mask_id, gen_length=n,
                                          block_length=block, denoising_steps=steps, temperature=1.0, top_k=0,
                                          top_p=1.0, remasking_strategy="low_confidence_dynamic",
                                          confidence_threshold=threshold, stopping_criteria_idx=None)
    return x[0, len(ids):len(ids) + n].tolist()
