"""The Qwen3 and Qwen3-MoE backbones against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on tiny
random configs: full-sequence logits, prefill in pieces and token-by-token cached decoding, the
per-expert checkpoint layout of the released MoE checkpoints, and the config's refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover.checkpoint import load_model
from clover.config import ConfigError
from clover.models import config_from_dict
from hf_reference import assert_cached_logits, randomise

BASE = dict(vocab_size=300, hidden_size=48, num_hidden_layers=3, max_position_embeddings=256, rms_norm_eps=1e-6)
DENSE = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80),
    "mha_tied_bias": dict(num_attention_heads=3, num_key_value_heads=3, head_dim=8, intermediate_size=64,
                          tie_word_embeddings=True, attention_bias=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}
MOE = {
    "top2_norm": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True),
    "top3_raw": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8, num_experts=6, num_experts_per_tok=3,
                     moe_intermediate_size=16, norm_topk_prob=False),
}


def _hf(kind, name, tmp_path, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg_cls, cls, fields = (Qwen3Config, Qwen3ForCausalLM, DENSE) if kind == "dense" else (Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE)
    cfg = cfg_cls(**BASE, **fields[name], pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    ref = cls(cfg).eval()
    randomise(ref, seed)  # norms off their identity and every weight drawn (no ties in routing)
    ref.save_pretrained(tmp_path / name)
    return ref, tmp_path / name


CASES = [("dense", n) for n in DENSE] + [("moe", n) for n in MOE]


@pytest.mark.parametrize("kind,name", CASES)
def test_logits_match_transformers(kind, name, tmp_path):
    ref, path = _hf(kind, name, tmp_path)
    ours = load_model(path)
    assert type(ours).__name__ == ("Qwen3ForCausalLM" if kind == "dense" else "Qwen3MoeForCausalLM")
    assert ours.config.tie_word_embeddings == ref.config.tie_word_embeddings
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-5, rtol=1e-5)
    assert_cached_logits(ours, ids, expected, split=20, tol=1e-5)  # prefill in pieces, then token by token


def test_per_expert_layout(tmp_path):
    """The released Qwen3-MoE checkpoints store one tensor per expert; they are stacked at load."""
    ref, path = _hf("moe", "top2_norm", tmp_path)
    split = {}
    for k, v in load_file(str(path / "model.safetensors")).items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = k[: -len(".gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                split[f"{prefix}.{e}.gate_proj.weight"] = v[e, :inter].clone()
                split[f"{prefix}.{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                split[f"{k[: -len('.down_proj')]}.{e}.down_proj.weight"] = v[e].clone()
        else:
            split[k] = v
    out = tmp_path / "per_expert"
    out.mkdir()
    save_file(split, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((path / "config.json").read_text())
    ids = torch.randint(0, 300, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_config_defaults_round_trip_and_refusals(tmp_path):
    raw = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1}
    c = config_from_dict(raw)
    assert type(c).__name__ == "Qwen3Config" and c.head_dim == 128 and c.max_position_embeddings == 32768
    again = config_from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and "mlp_bias" not in c.to_dict()
    with pytest.raises(ConfigError, match="use_sliding_window"):
        config_from_dict({**raw, "use_sliding_window": True})
    moe = {**raw, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    m = config_from_dict(moe)
    assert m.has_experts and m.norm_topk_prob is False and m.shared_expert_intermediate_size == 0
    assert config_from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        config_from_dict({**moe, "mlp_only_layers": [0]})
