"""Clover: a Qwen3.5 or Qwen3.5-MoE backbone with the block-diffusion (denoise) mode over the same
weights. model_type `clover`; `backbone` in config.json names the text model underneath
(`qwen3_5_moe_text` when absent).

The model class is the backbone's: with `config.is_clover` every GDN layer also holds the
bidirectional additions (`conv1d_right`, `intra_scale`, `block_gain_a/b`), whose initial values
are defined once, in `layers.denoise_parameters`. Conversion of an AR model is defined here once:
`clover_config` (the config change) and `clover_parameters` (the new tensors), used by
`clover convert` on checkpoints and by `convert_model` on a model in memory (training).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import CloverConfig
from ..tokenizer import MASK_TOKEN
from .layers import denoise_parameters

def clover_config(config: CloverConfig, mask_token_id: int, **fields) -> CloverConfig:
    """The Clover config of an AR config: same backbone, plus the mask token and `fields`
    (block_size, threshold, a grown vocab_size, ...)."""
    if config.is_clover:
        raise ValueError("already a Clover config (model_type 'clover'); nothing to convert")
    return config.replace(model_type="clover", backbone=config.model_type, mask_token_id=mask_token_id, **fields)


def clover_parameters(config: CloverConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every Clover-only parameter of a model with this config (its GDN layers), at its initial value."""
    out = {}
    for i, t in enumerate(config.layer_types):
        if t == "linear_attention":
            for name, value in denoise_parameters(config, dtype).items():
                out[f"model.layers.{i}.linear_attn.{name}"] = value
    return out


def convert_model(model: nn.Module, mask_token_id: int | None) -> nn.Module:
    """An AR model in memory -> the Clover model with the same weights (fp32, on the CPU) and the
    Clover parameters at their initial values."""
    from . import build_model

    if mask_token_id is None:
        raise ValueError(f"converting to clover needs a mask token id ({MASK_TOKEN} in the tokenizer)")
    config = clover_config(model.config, mask_token_id)
    new = build_model(config, device="meta")
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    state.update(clover_parameters(config))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = new.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"conversion to clover: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    new.tie_head()
    return new
