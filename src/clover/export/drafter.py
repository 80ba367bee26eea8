"""A clover DFlash drafter as the Hugging Face directory stock llama.cpp's `convert_hf_to_gguf.py`
converts (`--target-model-dir TARGET_HF_DIR`; then `llama-speculative-simple -md DRAFT.gguf
--spec-type draft-dflash`).

What the stock converter reads (llama-cpp-python 0.3.36's vendored tree, `conversion/qwen.py`):
- `DFlashDraftModel` / `DFlash2DraftModel`: z-lab's layout (`clover.models.dflash`) as published, a
  full-vocabulary drafter over the target's head. It has no reduced draft vocabulary: a `d2t` tensor
  stops it ("Can not map tensor 'model.d2t'").
- `DSparkDraftModel` (DFlash plus an optional Markov head): top-level `draft_vocab_size`, `d2t` as
  EAGLE-3 offsets (draft index d is token d + d2t[d]; written to the GGUF as absolute ids) and the
  drafter's own `lm_head.weight` [V_d, H]. Without Markov-head tensors llama.cpp runs it as a plain
  `draft-dflash` drafter whose logits are scattered back to the target's vocabulary through `d2t`
  (`src/models/dflash.cpp`). A reduced-vocabulary clover drafter is written this way, its head the
  target's rows for the draft tokens.
Both: `embed_tokens.weight`, when written, is the drafter's own input embedding (else llama.cpp uses the
target's). It is written when the target embeds its mask token with a vector of its own (clover's
denoise adapter keeps one apart from the embedding row): the drafter was trained on that vector, and
the target's GGUF, an AR model, carries only the plain row.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.dflash import mask_embedding

DSPARK = "DSparkDraftModel"  # the stock converter's class that reads `draft_vocab_size` + `d2t`


def export_drafter_for_llama_cpp(drafter, target, dst: str | Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write `drafter` (for `target`) to `dst` as stock llama.cpp's converter reads it (module doc)."""
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    config = c.to_dict()
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    cast = lambda t: t.detach().to(dtype).contiguous() if t.is_floating_point() else t.detach().contiguous()
    tensors = {drafter.key_layout.stored(k): cast(v) for k, v in drafter.state_dict().items()}
    if c.draft_vocab_size is not None:
        if c.architecture != "DFlashDraftModel":
            raise ValueError(f"drafter: a reduced draft vocabulary on {c.architecture} has no stock llama.cpp layout")
        config.update(architectures=[DSPARK], draft_vocab_size=c.draft_vocab_size, sample_from_anchor=False)
        tensors["lm_head.weight"] = cast(drafter._head(target))
    embed = target.model.embed_tokens.weight
    mask = mask_embedding(target, c.mask_token_id).to(embed.dtype)
    if not torch.equal(mask, embed[c.mask_token_id]):
        own = embed.detach().clone()
        own[c.mask_token_id] = mask
        tensors["embed_tokens.weight"] = cast(own)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
