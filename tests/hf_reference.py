"""Build transformers' Qwen3_5MoeForCausalLM (MoE) and Qwen3_5ForCausalLM (dense) reference models
for parity tests."""

from __future__ import annotations

import math

import torch


def hf_config(**overrides):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    fields = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        eos_token_id=1,
        pad_token_id=0,
    )
    fields.update(overrides)
    return Qwen3_5MoeTextConfig(**fields)


def hf_dense_config(**overrides):
    """A tiny dense Qwen3.5 text config (same hybrid stack, one SwiGLU MLP per layer)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    fields = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        eos_token_id=1,
        pad_token_id=0,
    )
    fields.update(overrides)
    return Qwen3_5TextConfig(**fields)


def hf_model(config, seed: int = 0):
    """A transformers model (MoE or dense, after the config's type) with every weight drawn from a
    seeded generator (no ties in routing)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    cls = Qwen3_5ForCausalLM if config.model_type == "qwen3_5_text" else Qwen3_5MoeForCausalLM
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-4, -1, generator=gen))
            elif "norm" in name:
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    return model


def assert_cached_logits(ours, ids, expected, split: int, tol: float) -> None:
    """`ours`' cached `step` gives `expected` (the reference's full-sequence logits of `ids` [B, T]):
    a prefill of `split` tokens (all their logits), then token by token to the end."""
    import torch

    B, T = ids.shape
    with torch.no_grad():
        cache = ours.make_cache(B, T + 8)
        out = ours.step(cache, commit_ids=ids[:, :split], all_logits=True)
        torch.testing.assert_close(out.commit_logits, expected[:, :split], atol=tol, rtol=tol)
        for t in range(split, T):
            out = ours.step(cache, commit_ids=ids[:, t : t + 1])
            torch.testing.assert_close(out.commit_logits, expected[:, t], atol=tol, rtol=tol)


def randomise(ref, seed: int = 0) -> None:
    """Every weight of a transformers model drawn from `seed`: norms off their identity (1 + 0.2 N),
    biases non-zero (0.1 N), matrices N / sqrt(width)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
