"""Full-size configs by name, for the accounting that needs no weights: each builds on the meta device
(`build_model(config, device="meta")`), so `clover info NAME --memory`, `clover info NAME --vllm-memory`
and `clover train plan --model NAME` give a large model's figures on any machine.

The released shapes are written out from their families' public configs: SDAR-30B-A3B and RND1-30B-A3B
are Qwen3-30B-A3B (48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8 of 768, vocab
151936); LLaDA2.0-flash is Ling-flash-2.0 (BailingMoeV2: 32 layers, the first dense 9216, hidden 4096,
32 q / 4 kv heads of 128, 256 experts top-8 of 1024 in 8 groups choosing 4, one shared expert, vocab
157184) and LLaDA2.0-mini Ling-mini-2.0 (20 layers, hidden 2048, 16 q / 4 kv heads, 256 experts top-8 of
512). The dense ones: SDAR-1.7B-Chat is Qwen3-1.7B (28 layers, hidden 2048, 16 q / 8 kv heads of 128,
MLP 6144, tied embeddings, vocab 151936) and Fast_dLLM_v2_1.5B is Qwen2.5-1.5B (28 layers, hidden 1536,
12 q / 2 kv heads, bias on q/k/v, MLP 8960, tied embeddings, vocab 151936, `bd_size` 32). None of
their config.json files was read here (no hub): the parameter counts (30.5B / 3.3B, 100B / 6.1B,
16B / 1.4B, 1.7B, 1.5B) are what pins them (tests/test_released_features.py, tests/test_released_gpu.py);
the dense ones' `max_position_embeddings` (32768) is not pinned by anything."""

from __future__ import annotations

from typing import Callable

from ..config import CloverConfig

_QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1_000_000.0,
                      max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
_LING_2 = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=256, num_experts_per_tok=8,
               n_group=8, topk_group=4, num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
               partial_rotary_factor=0.5, rope_theta=600000.0, vocab_size=157184, max_position_embeddings=32768,
               use_qk_norm=True, use_qkv_bias=False, use_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16",
               mask_token_id=156895, eos_token_id=156892, model_type="llada2_moe")


_QWEN_DENSE = dict(vocab_size=151936, num_hidden_layers=28, rope_theta=1_000_000.0, max_position_embeddings=32768,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="bfloat16")
# the released families at their checkpoints' shapes, as config.json keys (what `config_from_dict` reads)
FIELDS: dict[str, dict] = {
    "sdar-1.7b": dict(_QWEN_DENSE, model_type="sdar", hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=6144, block_size=4, mask_token_id=151669,
                      eos_token_id=[151643, 151645]),
    "fast-dllm-v2-1.5b": dict(_QWEN_DENSE, model_type="Fast_dLLM_Qwen", architectures=["Fast_dLLM_QwenForCausalLM"],
                              hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                              bd_size=32, eos_token_id=151645),
    "sdar-30b-a3b": dict(_QWEN3_30B_A3B, model_type="sdar_moe", block_size=4, mask_token_id=151669,
                         max_position_embeddings=32768),
    "llada2-flash": dict(_LING_2, hidden_size=4096, num_hidden_layers=32, intermediate_size=9216, moe_intermediate_size=1024),
    "llada2-mini": dict(_LING_2, hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, intermediate_size=5120,
                        moe_intermediate_size=512),
}


def _qwen35_35b() -> CloverConfig:
    from .qwen3_5_moe import full_size_config

    return full_size_config()


def _from(fields: dict) -> Callable[[], CloverConfig]:
    def build() -> CloverConfig:
        from . import config_from_dict

        return config_from_dict(dict(fields), source="clover.models.shapes")

    return build


SHAPES: dict[str, Callable[[], CloverConfig]] = {
    "qwen3.6-35b-a3b": _qwen35_35b,
    "qwen3.5-35b-a3b": _qwen35_35b,
    "full": _qwen35_35b,
    **{name: _from(fields) for name, fields in FIELDS.items()},
}


def shape_config(name: str | None) -> CloverConfig | None:
    """The full-size config of that name (case-insensitive); None for any other string (a path)."""
    build = SHAPES.get(str(name).lower()) if name else None
    return build() if build else None
