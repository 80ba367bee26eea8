"""Config parsing and checkpoint errors: every failure names the file and what to do."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover
from clover.checkpoint import CheckpointError, load_model
from clover.config import CloverConfig, ConfigError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors_names_file(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "model.safetensors" in str(e.value) and ("truncated" in str(e.value) or "corrupt" in str(e.value))


def test_garbage_header(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)


def test_missing_key_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    del state["model.layers.1.mlp.gate.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "model.layers.1.mlp.gate.weight" in str(e.value) and "missing" in str(e.value)


def test_wrong_shape_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    state["model.norm.weight"] = torch.zeros(7)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.norm.weight" in msg and "(7,)" in msg


def test_unexpected_key_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.bogus.weight"] = torch.zeros(3)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="bogus"):
        load_model(d)


def test_missing_directory_and_pickle_only(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nope")
    d = tmp_path / "pkl"
    d.mkdir()
    from clover.tiny import tiny_config

    (d / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(d)


def test_index_listing_missing_shard(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_model(d)


def test_config_variants():
    base = dict(vocab_size=100, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    c = CloverConfig.from_dict({**base, "model_type": "qwen3_5_moe_text", "full_attention_interval": 2, "unknown_key": 1})
    assert c.layer_types == ["linear_attention", "full_attention"] * 4
    assert c.head_dim == 8
    nested = CloverConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": base, "eos_token_id": 7})
    assert nested.eos_token_id == 7 and nested.layer_types[3] == "full_attention"
    cl = CloverConfig.from_dict({**base, "model_type": "clover", "mask_token_id": 5, "block_size": 16, "threshold": 0.9,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}})
    assert cl.is_clover and cl.block_size == 16 and cl.rope_theta == 1e6 and cl.partial_rotary_factor == 0.5
    assert CloverConfig.from_dict(cl.to_dict()) == cl


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"model_type": "llama"}, "not supported"),
        ({"model_type": "qwen3_5_moe"}, "text_config"),
        ({"model_type": "qwen3_5_moe_text", "hidden_size": 8}, "missing required"),
    ],
)
def test_config_errors(raw, match):
    with pytest.raises(ConfigError, match=match):
        CloverConfig.from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        CloverConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        CloverConfig.from_file(tmp_path)


def test_dtype_choice(tiny_dir):
    for name, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
        llm = clover.load(tiny_dir, dtype=name)
        assert llm.model.dtype == dt
        g = llm.generate("ab", max_new_tokens=4, ignore_eos=True)
        assert len(g.token_ids) == 4
    with pytest.raises(ValueError, match="unknown dtype"):
        clover.load(tiny_dir, dtype="int3")


def test_cache_snapshot_restore_and_rows(tiny_llm):
    m = tiny_llm.model
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        cache = m.make_cache(2, 32)
        m.step(cache, commit_ids=ids[:, :8])
        snap = cache.snapshot()
        a = m.step(cache, commit_ids=ids[:, 8:12]).commit_logits
        cache.restore(snap)
        b = m.step(cache, commit_ids=ids[:, 8:12]).commit_logits
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        one = cache.select_rows([1])
        assert int(one.lengths[0]) == 12
        c = m.step(one, commit_ids=ids[1:, :1]).commit_logits
        d = m.step(cache, commit_ids=ids[:, :1]).commit_logits[1:]
        torch.testing.assert_close(c, d, atol=1e-5, rtol=1e-5)
