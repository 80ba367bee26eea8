"""The Qwen2 / Qwen2.5 backbone against transformers' Qwen2ForCausalLM on tiny random configs (bias on
q/k/v only): full-sequence logits, prefill in pieces and token-by-token cached decoding, and the
config's defaults and refusals."""

import json

import pytest
import torch

from clover.checkpoint import load_model
from clover.config import ConfigError
from clover.models import config_from_dict

from hf_reference import assert_cached_logits, randomise

BASE = dict(vocab_size=300, hidden_size=48, num_hidden_layers=3, max_position_embeddings=256, rms_norm_eps=1e-6)
CASES = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=80),
    "mha_tied_theta": dict(num_attention_heads=3, num_key_value_heads=3, intermediate_size=64, tie_word_embeddings=True,
                           rope_theta=1e6),
}


def _hf(name, tmp_path, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**BASE, **CASES[name], pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    ref = Qwen2ForCausalLM(cfg).eval()
    randomise(ref, seed)
    ref.save_pretrained(tmp_path / name)
    return ref, tmp_path / name


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    ref, path = _hf(name, tmp_path)
    ours = load_model(path)
    assert type(ours).__name__ == "Qwen2ForCausalLM"
    attn = ours.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.v_proj.bias is not None and attn.o_proj.bias is None
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-5, rtol=1e-5)
    assert_cached_logits(ours, ids, expected, split=20, tol=1e-5)  # prefill in pieces, then token by token


def test_config_defaults_round_trip_and_refusals():
    raw = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 4096, "max_window_layers": 21}
    c = config_from_dict(raw)
    assert type(c).__name__ == "Qwen2Config" and c.head_dim == 4 and c.max_position_embeddings == 32768
    assert c.qkv_bias and not c.attention_bias
    d = c.to_dict()
    assert config_from_dict(json.loads(json.dumps(d))) == c
    assert "attention_bias" not in d and "mlp_bias" not in d and d["sliding_window"] == 4096
    with pytest.raises(ConfigError, match="use_sliding_window"):
        config_from_dict({**raw, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_dict({**raw, "attention_bias": True})
