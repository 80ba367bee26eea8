"""Tiny random checkpoints in the real on-disk layout, for tests and demos."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from .checkpoint import save_model
from .config import CloverConfig
from .models import build_model, config_class
from .tokenizer import MASK_TOKEN, SPECIAL_TOKENS, write_byte_tokenizer

TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    rope_theta=10000.0,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)


# `clover tiny --shape 0.7b`: Clover-35B-A3B's layer shapes (hidden 2048, 16 query / 2 KV heads of 256
# with a quarter rotary, 16/32 GDN heads of 128, experts of 512 with a shared one, 8 routed per token)
# with 8 layers (the same 3:1 GDN/attention pattern), 16 experts and a 16k vocabulary: ~0.75B
# parameters, large enough that the weights, not the per-op overhead, set a CPU forward's cost.
# `init_std` None: the config's initializer_range, so activations stay finite through the stack.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "0.7b": dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=32768,
        vocab_size=16384, init_std=None,
    ),
}


# the dense backbone's MLP in place of TINY_DEFAULTS' experts
TINY_DENSE: dict[str, Any] = dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                  shared_expert_intermediate_size=0, intermediate_size=96)


def tiny_config(*, clover: bool = True, dense: bool = False, vocab_size: int | None = None, **overrides: Any) -> CloverConfig:
    """A small config whose vocabulary holds the byte tokenizer (256 bytes + special tokens);
    `dense` gives the dense Qwen3.5 backbone instead of the MoE one."""
    n_bytes = 256
    ids = {t: n_bytes + i for i, t in enumerate(SPECIAL_TOKENS)}
    fields = dict(TINY_DEFAULTS, **(TINY_DENSE if dense else {}))
    base = "qwen3_5_text" if dense else "qwen3_5_moe_text"
    fields.update(
        vocab_size=vocab_size or n_bytes + len(SPECIAL_TOKENS) + 3,
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|pad|>"],
        model_type="clover" if clover else base,
    )
    if clover:
        fields["mask_token_id"] = ids[MASK_TOKEN]
        fields["backbone"] = base
    fields.update(overrides)
    cls = config_class(fields.get("backbone") or fields["model_type"])
    names = {f.name for f in dataclasses.fields(cls)}  # the shared defaults hold keys other families lack
    return cls(**{k: v for k, v in fields.items() if k in names})


def build_tiny_checkpoint(
    directory: str | Path,
    *,
    seed: int = 0,
    clover: bool = True,
    dense: bool = False,
    init_std: float | None = 0.08,
    dtype: torch.dtype = torch.float32,
    shape: str = "tiny",
    **overrides: Any,
) -> Path:
    """Write config.json, model.safetensors and a byte-level tokenizer with random weights.
    `shape` picks a preset of SHAPES (its fields give way to `overrides`); a large shape is built
    directly in `dtype` (no float32 copy of the whole model)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    preset = dict(SHAPES[shape])
    init_std = preset.pop("init_std", init_std)
    directory = Path(directory)
    config = tiny_config(clover=clover, dense=dense, **dict(preset, **overrides))
    build_dtype = torch.float32 if shape == "tiny" else dtype
    model = build_model(config, device="cpu", dtype=build_dtype)
    model.init_weights(seed=seed, std=init_std)
    model.to(dtype)
    config.torch_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    save_model(model, directory)
    write_byte_tokenizer(directory)
    return directory
