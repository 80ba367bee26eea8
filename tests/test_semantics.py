"""The block semantics (`clover.config.BlockSemantics`): the four fields on which released
block-diffusion checkpoints differ, as config data with Clover's values as defaults. A config.json
that spells Clover's values out decodes exactly as one that omits them (an older checkpoint); the
fields round-trip through config.json; a bad value is refused in one line naming the key; a value
that no component implements yet is refused in one line naming the field, where it would act."""

import json
from pathlib import Path

import pytest
import torch

import clover
from clover.config import BlockSemantics, ConfigError
from clover.models import config_from_dict, read_config

FIELDS = {"logit_shift": (1, 0), "block_grid": ("prompt", "absolute"), "commit_attention": ("causal", "block"),
          "first_token": ("denoise", "commit_argmax")}  # field -> (Clover's value, another)


def _with_config(src: Path, dst: Path, edit) -> Path:
    """A model directory whose files link to `src`'s, with its config.json passed through `edit(raw)`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    raw = json.loads((src / "config.json").read_text())
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _set(**fields):
    return lambda raw: raw.update(fields)


def _drop(*names):
    def edit(raw):
        for n in names:
            raw.pop(n, None)
    return edit


def test_defaults_are_clovers(tiny_llm):
    assert BlockSemantics() == BlockSemantics(logit_shift=1, block_grid="prompt", commit_attention="causal",
                                              first_token="denoise")
    assert tiny_llm.config.semantics == BlockSemantics()
    assert {k: v[0] for k, v in BlockSemantics.CHOICES.items()} == {k: v[0] for k, v in FIELDS.items()}


@pytest.mark.parametrize("name", list(FIELDS))
def test_spelled_out_default_decodes_as_the_implicit_one(tiny_dir, tmp_path, name):
    """A config.json without the field (an older checkpoint) and one with Clover's value written
    decode to the same tokens, forwards and steps in every cached mode."""
    implicit = clover.load(_with_config(tiny_dir, tmp_path / "implicit", _drop(*FIELDS)))
    explicit = clover.load(_with_config(tiny_dir, tmp_path / "explicit", _set(**{name: FIELDS[name][0]})))
    assert explicit.config == implicit.config and explicit.config.semantics == BlockSemantics()
    kw = dict(max_new_tokens=20, block_size=8, threshold=0.5, ignore_eos=True)
    for mode in ("diffusion", "speculative", "ar"):
        a = implicit.generate([5, 6, 7, 8, 9], mode=mode, **kw)
        b = explicit.generate([5, 6, 7, 8, 9], mode=mode, **kw)
        assert a.token_ids == b.token_ids and a.decode_steps == b.decode_steps, mode
        assert a.stats.forwards == b.stats.forwards, mode


@pytest.mark.parametrize("name", list(FIELDS))
def test_round_trip_through_config_json(tiny_dir, tmp_path, name):
    config = read_config(tiny_dir).replace(**{name: FIELDS[name][1]})
    config.save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw[name] == FIELDS[name][1]
    back = read_config(tmp_path)
    assert back == config and getattr(back.semantics, name) == FIELDS[name][1]
    assert config_from_dict(read_config(tiny_dir).to_dict()).semantics == BlockSemantics()


def test_an_ar_config_json_does_not_carry_them(tiny_dir):
    config = read_config(tiny_dir)
    ar = config.replace(model_type=config.backbone, backbone=None, mask_token_id=None)
    assert not set(FIELDS) & set(ar.to_dict())


@pytest.mark.parametrize("name, value, match", [
    ("logit_shift", 2, "logit_shift must be one of 1, 0, got 2"),
    ("logit_shift", True, "'logit_shift' must be an integer"),
    ("logit_shift", "1", "'logit_shift' must be an integer"),
    ("block_grid", "blocks", "block_grid must be one of 'prompt', 'absolute', got 'blocks'"),
    ("block_grid", None, "'block_grid' must be a string"),
    ("commit_attention", "bidirectional", "commit_attention must be one of 'causal', 'block'"),
    ("first_token", "argmax", "first_token must be one of 'denoise', 'commit_argmax'"),
])
def test_bad_values_refused_in_one_line(tiny_dir, name, value, match):
    raw = {**read_config(tiny_dir).to_dict(), name: value}
    with pytest.raises(ConfigError, match=match) as e:
        config_from_dict(raw, source="m/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("m/config.json: ")
    with pytest.raises(ConfigError, match=name):
        BlockSemantics(**{name: value})


# the other values the diffusion engines decode by now (SDAR's: `DiffusionEngine.semantics_implemented`)
DECODED_BY = {"logit_shift": ("diffusion", "naive"), "block_grid": ("diffusion", "naive"),
              "first_token": ("diffusion", "naive")}  # Fast-dLLM v2's (tests/test_fastdllm2.py)


@pytest.mark.parametrize("name", list(FIELDS))
def test_unimplemented_values_refused_where_they_act(tiny_dir, tmp_path, name):
    """Until a component implements another value, meeting it is one line naming the field: every
    decoding engine at construction (AR runs with any block grid and first token: it has no block),
    the model's masks for `commit_attention`, the training forward for `logit_shift`."""
    other = FIELDS[name][1]
    llm = clover.load(_with_config(tiny_dir, tmp_path / "m", _set(**{name: other})))
    assert getattr(llm.config.semantics, name) == other
    kw = dict(max_new_tokens=8, block_size=4, ignore_eos=True)
    for mode in ("diffusion", "naive", "speculative"):
        if mode in DECODED_BY.get(name, ()):  # implemented there since (tests/test_sdar.py)
            continue
        with pytest.raises(ConfigError, match=f"^{name}={other!r}: not implemented in ") as e:
            llm.generate([5, 6, 7], mode=mode, **kw)
        assert "\n" not in str(e.value)
    m = llm.model
    ids = torch.tensor([[5, 6, 7, 8]])
    if name in ("block_grid", "first_token"):
        default = clover.load(tiny_dir)
        assert llm.generate([5, 6, 7], mode="ar", **kw).token_ids == default.generate([5, 6, 7], mode="ar", **kw).token_ids
    else:
        with pytest.raises(ConfigError, match=f"^{name}="):
            llm.generate([5, 6, 7], mode="ar", **kw)
    if name == "commit_attention":
        for call in (lambda: m(ids), lambda: m.step(m.make_cache(1, 8), commit_ids=ids),
                     lambda: m.forward_block_diffusion(ids, ids, 4)):
            with pytest.raises(ConfigError, match="^commit_attention='block': not implemented in "):
                call()
    if name == "logit_shift":
        with pytest.raises(ConfigError, match="^logit_shift=0: not implemented in block-diffusion training"):
            m.forward_block_diffusion(ids, ids, 4)


def test_gguf_export_refuses_other_semantics(tmp_path):
    from clover.export.gguf import GGUFExportError, check_supported
    from clover.models.qwen3_5_moe import full_size_config

    config = full_size_config().replace(model_type="clover", mask_token_id=5, first_token="commit_argmax")
    with pytest.raises(GGUFExportError, match="first_token='commit_argmax': not implemented in the GGUF export"):
        check_supported(config, tmp_path)
    check_supported(config.replace(first_token="denoise"), tmp_path)
