"""What the DFlash peers share: the model's drafter, the target as a transformers directory, the
drafter in z-lab's layout, and the vector the target embeds its mask token with.

The target directory is the AR model alone (clover's own tensors and the denoise adapter left out,
the tied head not stored twice). A clover target may embed its mask token with a vector of its own
(the denoise adapter's `mask_embedding`); the drafter was trained reading it for a block's masks, so
each peer gives its drafter that vector: llama.cpp through the drafter's own `embed_tokens`
(`clover.export.drafter`), transformers and z-lab's package by setting that one input-embedding row of
their target after untying its head (`dflash_worker.set_mask_row`; the head, and so AR, is unchanged)."""

from __future__ import annotations

from pathlib import Path

import torch

from .base import write_hf_head
from .dflash_worker import MASK_FILE


def drafter_of(setup):
    """The run model's DFlash drafter, or RuntimeError (the engine is skipped with it)."""
    drafter = getattr(setup.llm, "drafter", None)
    if drafter is None:
        raise RuntimeError("the model has no DFlash drafter (a `dflash` directory beside it; `clover pull` installs one)")
    return drafter


def target_hf_dir(setup) -> Path:
    """The target as a transformers directory in `setup.work` (written once per run), with
    `MASK_FILE` (the mask token's embedding vector, `mask_token_id` in its metadata) beside it."""
    from safetensors.torch import save_file

    from ...models.dflash import mask_embedding
    from ...models.layers import is_clover_parameter
    from ...models.llama import is_adapter_parameter

    st = setup
    dst = st.work / "hf-dflash-target"
    if (dst / "model.safetensors").is_file():
        return dst
    cfg = st.config
    write_hf_head(st.src, dst, cfg, dtype=st.dtype)
    model = st.llm.model
    want = getattr(torch, st.dtype)
    tied = cfg.tie_word_embeddings
    sd = {k: v.detach().to(want).contiguous() for k, v in model.state_dict().items()
          if not (is_clover_parameter(k) or is_adapter_parameter(k) or (tied and k == "lm_head.weight"))}
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    m = cfg.mask_token_id
    if m is not None:
        save_file({"embedding": mask_embedding(model, m).to(want).contiguous()}, str(dst / MASK_FILE),
                  metadata={"mask_token_id": str(m)})
    return dst


def zlab_drafter_dir(setup) -> Path:
    """The drafter in z-lab's layout (`save_drafter`, in the run's dtype) in `setup.work`."""
    from ...checkpoint import save_drafter

    dst = setup.work / "dflash-drafter"
    if not (dst / "model.safetensors").is_file():
        save_drafter(drafter_of(setup), dst, dtype=getattr(torch, setup.dtype))
    return dst
