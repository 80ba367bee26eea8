"""Config parsing and checkpoint errors: every failure names the file and what to do."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover
from clover.checkpoint import CheckpointError, load_model
from clover.config import ConfigError
from clover.models import config_from_dict, read_config


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
    c = config_from_dict({**base, "model_type": "qwen3_5_moe_text", "full_attention_interval": 2, "unknown_key": 1})
    assert c.layer_types == ["linear_attention", "full_attention"] * 4
    assert c.head_dim == 8
    nested = config_from_dict({"model_type": "qwen3_5_moe", "text_config": base, "eos_token_id": 7})
    assert nested.eos_token_id == 7 and nested.layer_types[3] == "full_attention"
    cl = config_from_dict({**base, "model_type": "clover", "mask_token_id": 5, "block_size": 16, "threshold": 0.9,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}})
    assert cl.is_clover and cl.block_size == 16 and cl.rope_theta == 1e6 and cl.partial_rotary_factor == 0.5
    assert config_from_dict(cl.to_dict()) == cl


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"model_type": "gpt2"}, "not supported"),
        ({"model_type": "qwen3_5_moe"}, "text_config"),
        ({"model_type": "qwen3_5_moe_text", "hidden_size": 8}, "missing required"),
    ],
)
def test_config_errors(raw, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(tmp_path)


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


# ------------------------------------------------------------------ corrupted checkpoints (issue 16)
def _rewrite(d, **changes):
    """Rewrite d/model.safetensors with some tensors changed (None deletes)."""
    state = load_file(str(d / "model.safetensors"))
    for k, v in changes.items():
        if v is None:
            del state[k]
        else:
            state[k] = v
    save_file(state, str(d / "model.safetensors"))


def _poison(state_key, fn):
    def apply(d):
        t = load_file(str(d / "model.safetensors"))[state_key].clone()
        fn(t)
        _rewrite(d, **{state_key: t})
    return apply


NON_FINITE = {
    "nan-embedding": ("model.embed_tokens.weight", _poison("model.embed_tokens.weight", lambda t: t[5].__setitem__(3, float("nan")))),
    "nan-lm-head-row": ("lm_head.weight", _poison("lm_head.weight", lambda t: t[7].fill_(float("nan")))),
    "inf-final-norm": ("model.norm.weight", _poison("model.norm.weight", lambda t: t.__setitem__(0, float("inf")))),
}


@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_non_finite_weights_refused_with_opt_out(tiny_dir, tmp_path, case):
    key, corrupt = NON_FINITE[case]
    d = _copy(tiny_dir, tmp_path / "m")
    corrupt(d)
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert key in msg and "model.safetensors" in msg and "non-finite" in msg and "check_finite" in msg
    with pytest.raises(CheckpointError, match="non-finite"):
        clover.load(d)
    m = load_model(d, check_finite=False)  # the opt-out loads it as it is
    assert not torch.isfinite(m.state_dict()[key]).all()
    from clover.checkpoint import finite_check

    with finite_check(False):  # the default for callers that do not pass check_finite (clover.load)
        assert clover.load(d).model is not None


def test_non_finite_after_dtype_conversion(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    _poison("model.norm.weight", lambda t: t.__setitem__(1, 1e6))(d)  # finite in float32, inf in float16
    load_model(d)
    with pytest.raises(CheckpointError, match="float16") as e:
        load_model(d, dtype="float16")
    assert "model.norm.weight" in str(e.value)


def test_finite_scan_is_chunked_and_exact():
    from clover.checkpoint import first_non_finite

    t = torch.zeros(3, 1000)
    assert first_non_finite(t, chunk=257) is None
    t[2, 999] = float("-inf")
    assert first_non_finite(t, chunk=257) == (2, 999)
    assert first_non_finite(torch.zeros(4, dtype=torch.int32)) is None


def test_non_float_weight_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    emb = load_file(str(d / "model.safetensors"))["model.embed_tokens.weight"]
    _rewrite(d, **{"model.embed_tokens.weight": emb.to(torch.int32)})
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "model.embed_tokens.weight" in str(e.value) and "int32" in str(e.value)


@contextlib.contextmanager
def fifo_watchdog(fifo, after=8.0):
    """Opening a FIFO blocks the reader until a writer comes, and safetensors holds the GIL while it
    waits, so no thread of this process could help: a separate process opens `fifo` for writing
    after `after` seconds (and again every 0.2 s), which lets a blocked reader go. Yields a function: True if no blocking happened."""
    code = ("import os, sys, time\ntime.sleep(float(sys.argv[2]))\nwhile True:\n"
            "    try:\n        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))\n"
            "    except OSError:\n        pass\n    time.sleep(0.2)\n")
    watchdog = subprocess.Popen([sys.executable, "-c", code, str(fifo), str(after)])
    t0 = time.monotonic()
    try:
        yield lambda: time.monotonic() - t0 < after
    finally:
        watchdog.kill()
        watchdog.wait()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_fifo_in_model_dir_refused(tiny_dir, tmp_path, name):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / name).unlink()
    os.mkfifo(d / name)
    with fifo_watchdog(d / name) as never_blocked:
        with pytest.raises((CheckpointError, ConfigError, FileNotFoundError, ValueError)) as e:
            clover.load(d)
        assert never_blocked(), f"clover.load blocked on a FIFO named {name}"
    assert name in str(e.value) and "not a regular file" in str(e.value)


@pytest.mark.parametrize("shard", ["../../etc/hostname", "/dev/zero", "sub/../../outside.safetensors"])
def test_index_shard_outside_model_dir_refused(tiny_dir, tmp_path, shard):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    weight_map = {k: "model-00001-of-00001.safetensors" for k in load_file(str(d / "model-00001-of-00001.safetensors"))}
    weight_map["model.norm.weight"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "model.norm.weight" in msg and shard in msg and "outside" in msg


def test_index_shard_in_subfolder_loads(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "shards").mkdir()
    (d / "model.safetensors").rename(d / "shards" / "a.safetensors")
    weight_map = {k: "shards/a.safetensors" for k in load_file(str(d / "shards" / "a.safetensors"))}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_model(d) is not None


def test_sharded_missing_tensor_names_its_shard(tiny_dir, tmp_path):
    from clover.checkpoint import save_state_dict

    d = _copy(tiny_dir, tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    save_state_dict(state, d, max_shard_bytes=200_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.norm.weight"]
    part = load_file(str(d / shard))
    del part["model.norm.weight"]
    save_file(part, str(d / shard))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "model.norm.weight" in str(e.value) and shard in str(e.value)


CONFIG_TYPES = [
    ("rms_norm_eps", "small", "a number"),
    ("max_position_embeddings", "big", "an integer"),
    ("hidden_size", "256", "an integer"),
    ("threshold", "high", "a number"),
    ("num_experts", 8.0, "an integer"),
    ("tie_word_embeddings", "false", "true or false"),
    ("attention_bias", 0, "true or false"),
    ("layer_types", "linear_attention", "a list"),
    ("eos_token_id", "<|endoftext|>", "an integer"),
    ("mask_token_id", True, "an integer"),
    ("head_dim", [16], "an integer"),
    ("quantization_config", "int4", "an object"),
    ("hidden_act", 3, "a string"),
    ("rope_theta", None, "a number"),
    ("rms_norm_eps", float("nan"), "finite"),
    ("rope_theta", float("inf"), "finite"),
]


@pytest.mark.parametrize("key, value, expected", CONFIG_TYPES, ids=[f"{k}={v!r}" for k, v, _ in CONFIG_TYPES])
def test_config_types_checked_at_load(tiny_dir, tmp_path, key, value, expected):
    d = _copy(tiny_dir, tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters", None) if key == "rope_theta" else None
    raw[key] = value
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        clover.load(d)
    msg = str(e.value)
    assert "config.json" in msg and repr(key) in msg and expected in msg and repr(value) in msg, msg


def test_config_types_in_text_config_name_the_nested_key():
    base = dict(vocab_size=100, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ConfigError, match=r"x/config.json: 'text_config.hidden_size'"):
        config_from_dict({"model_type": "qwen3_5_moe", "text_config": {**base, "hidden_size": "32"}},
                               source="x/config.json")
    ok = config_from_dict({**base, "rope_theta": 10000, "rms_norm_eps": 1e-6})  # an int where a float goes
    assert ok.rope_theta == 10000


@pytest.mark.parametrize("raw, match", [
    ({"full_attention_interval": 0}, "full_attention_interval"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"max_position_embeddings": -1}, "max_position_embeddings"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"linear_key_head_dim": -4}, "linear_key_head_dim"),
])
def test_config_values_checked(raw, match):
    base = dict(vocab_size=100, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ConfigError, match=match):
        config_from_dict({**base, **raw}, source="config.json")


def test_unknown_torch_dtype_names_the_key(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "torch_dtype": "float8"}))
    with pytest.raises(ConfigError, match=r"config.json: 'torch_dtype' is 'float8'"):
        load_model(d)
    assert load_model(d, dtype="float32") is not None  # an explicit dtype does not need it


def test_missing_tokenizer_json_says_what_to_do(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as e:
        clover.load(d)
    msg = str(e.value)
    assert "tokenizer.json" in msg and str(d) in msg and "sentencepiece" not in msg and "copy" in msg


def test_broken_tokenizer_json_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError) as e:
        clover.load(d)
    assert "tokenizer.json" in str(e.value)


def test_quantized_checkpoint_gets_the_same_scan(tiny_dir, tmp_path):
    from clover.quant import quantize_checkpoint

    q = tmp_path / "q8"
    quantize_checkpoint(tiny_dir, q, bits=8)
    state = load_file(str(q / "model.safetensors"))
    state["model.norm.weight"][2] = float("nan")  # a tensor kept in float
    save_file(state, str(q / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' holds non-finite"):
        load_model(q)
    assert load_model(q, check_finite=False) is not None
