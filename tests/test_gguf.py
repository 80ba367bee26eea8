"""GGUF export (`clover export-gguf`, clover.export.gguf).

Fast: the round trip — read the GGUF back with the `gguf` package, undo the documented transforms
(docs/gguf.md) with code written here independently of the exporter, and compare with the source
weights; the metadata and tokenizer are checked too.

Slow (CLOVER_SLOW=1, and a llama.cpp build from scripts/build-llama-cpp.sh; skipped with the reason
otherwise): llama.cpp against clover on the bundled model and on a random checkpoint in the
multimodal layout — tokenization, greedy tokens (20 held-out prompts x 64 tokens, f32) and the
next-token logits at every position of a 256-token text.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from clover.checkpoint import load_model, save_state_dict  # noqa: E402
from clover.config import CloverConfig  # noqa: E402
from clover.models import read_config
from clover.integrations.llama_port import llama_cache_dir  # noqa: E402
from clover.export.gguf import (  # noqa: E402
    GGUFExportError,
    detect_pre_tokenizer,
    export_gguf,
    mrope_sections,
    sidecar_path,
)
from heldout import held_out_prompts, held_out_text  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[1] / "src" / "clover" / "assets" / "clover-tiny"


# ----------------------------------------------------------------------- reading GGUF back
def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    r = gguf.GGUFReader(str(path))
    fields = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        fields[k] = f.contents()
    tensors, types = {}, {}
    for t in r.tensors:
        a = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne (fastest first); numpy order is reversed
        tensors[t.name] = np.asarray(a, dtype=np.float32).reshape(shape)
        types[t.name] = t.tensor_type.name
    return fields, tensors, types


def _untile(t: torch.Tensor, dim: int, n_k: int, per_k: int, hd: int) -> torch.Tensor:
    """Tiled value heads ([k0 v0, k1 v0, k0 v1, ...]) back to grouped ([k0: v0 v1, k1: v0 v1])."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, n_k, hd, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def to_clover(tensors: dict[str, np.ndarray], cfg: CloverConfig) -> dict[str, torch.Tensor]:
    """Undo docs/gguf.md's mapping: GGUF tensors -> our parameter names and layouts."""
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per = hv // hk
    qk = 2 * hk * dk
    out: dict[str, torch.Tensor] = {}
    plain = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output.weight": "lm_head.weight",
    }
    for name, a in tensors.items():
        t = torch.from_numpy(a.copy())
        if name in plain:
            out[plain[name]] = t
            continue
        if name == "output_norm.weight":
            out["model.norm.weight"] = t - 1
            continue
        _, bid, rest = name.split(".", 2)
        p = f"model.layers.{bid}."
        vrows = lambda x: torch.cat([x[:qk], _untile(x[qk:], 0, hk, per, dv)])  # noqa: E731
        heads = lambda x: _untile(x, 0, hk, per, 1)  # noqa: E731
        if rest == "attn_norm.weight":
            out[p + "input_layernorm.weight"] = t - 1
        elif rest == "post_attention_norm.weight":
            out[p + "post_attention_layernorm.weight"] = t - 1
        elif rest in ("attn_q.weight", "attn_k.weight", "attn_v.weight"):
            out[p + f"self_attn.{rest[5]}_proj.weight"] = t
        elif rest == "attn_output.weight":
            out[p + "self_attn.o_proj.weight"] = t
        elif rest in ("attn_q_norm.weight", "attn_k_norm.weight"):
            out[p + f"self_attn.{rest[5]}_norm.weight"] = t - 1
        elif rest == "attn_qkv.weight":
            out[p + "linear_attn.in_proj_qkv.weight"] = vrows(t)
        elif rest == "attn_gate.weight":
            out[p + "linear_attn.in_proj_z.weight"] = _untile(t, 0, hk, per, dv)
        elif rest == "ssm_alpha.weight":
            out[p + "linear_attn.in_proj_a.weight"] = heads(t)
        elif rest == "ssm_beta.weight":
            out[p + "linear_attn.in_proj_b.weight"] = heads(t)
        elif rest == "ssm_a":
            out[p + "linear_attn.A_log"] = torch.log(-heads(t))
        elif rest == "ssm_dt.bias":
            out[p + "linear_attn.dt_bias"] = heads(t)
        elif rest == "ssm_conv1d.weight":
            out[p + "linear_attn.conv1d.weight"] = vrows(t).unsqueeze(1)
        elif rest == "ssm_norm.weight":
            out[p + "linear_attn.norm.weight"] = t
        elif rest == "ssm_out.weight":
            out[p + "linear_attn.out_proj.weight"] = _untile(t, 1, hk, per, dv)
        elif rest == "ffn_gate_inp.weight":
            out[p + "mlp.gate.weight"] = t
        elif rest == "ffn_gate_exps.weight":
            out.setdefault(p + "mlp.experts.gate_up_proj", {})["gate"] = t
        elif rest == "ffn_up_exps.weight":
            out.setdefault(p + "mlp.experts.gate_up_proj", {})["up"] = t
        elif rest == "ffn_down_exps.weight":
            out[p + "mlp.experts.down_proj"] = t
        elif rest in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"):
            out[p + f"mlp.shared_expert.{rest.split('_')[1]}_proj.weight"] = t
        elif rest == "ffn_gate_inp_shexp.weight":
            out[p + "mlp.shared_expert_gate.weight"] = t.reshape(1, -1)
        elif rest == "clover_conv1d_right.weight":
            out[p + "linear_attn.conv1d_right.weight"] = vrows(t).unsqueeze(1)
        elif rest in ("clover_intra_scale", "clover_block_gain_a", "clover_block_gain_b"):
            out[p + "linear_attn." + rest[len("clover_"):]] = heads(t)
        else:
            raise AssertionError(f"unmapped GGUF tensor {name}")
    for k, v in list(out.items()):
        if isinstance(v, dict):
            out[k] = torch.cat([v["gate"], v["up"]], dim=1)
    return out


def assert_roundtrip(src: Path, files: list[Path], *, atol: float = 1e-6, rtol: float = 1e-6) -> dict:
    cfg = read_config(src)
    fields, tensors = {}, {}
    for f in files:
        fl, ts, _ = read_gguf(f)
        fields.update(fl)
        assert not set(ts) & set(tensors)
        tensors.update(ts)
    ours = to_clover(tensors, cfg)
    source = {k: v.float() for k, v in load_model(src, dtype=torch.float32).state_dict().items()}
    assert set(ours) == set(source), (set(ours) ^ set(source))
    for k, v in source.items():
        torch.testing.assert_close(ours[k], v, atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
    return fields


# ------------------------------------------------------------------------------ fixtures
def multimodal_checkpoint(src: Path, dst: Path, *, per_expert: bool = False, max_shard_bytes: int | None = None) -> Path:
    """`src` rewritten as the multimodal Qwen3_5MoeForConditionalGeneration layout: text weights
    under model.language_model.*, config nested in text_config, plus vision / MTP keys to skip."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    mm = {}
    for k, v in state.items():
        k2 = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        if per_expert and k.endswith("mlp.experts.gate_up_proj"):
            base, inter = k2[: -len(".gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                mm[f"{base}.{e}.gate_proj.weight"] = v[e, :inter].clone()
                mm[f"{base}.{e}.up_proj.weight"] = v[e, inter:].clone()
        elif per_expert and k.endswith("mlp.experts.down_proj"):
            base = k2[: -len(".down_proj")]
            for e in range(v.shape[0]):
                mm[f"{base}.{e}.down_proj.weight"] = v[e].clone()
        else:
            mm[k2] = v
    mm["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    mm["mtp.layers.0.mlp.gate.weight"] = torch.zeros(4, 4)
    save_state_dict(mm, dst, max_shard_bytes=max_shard_bytes or 4 * 1024**3)
    text = json.loads((src / "config.json").read_text())
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text,
           "vision_config": {"depth": 1}, "image_token_id": 5}
    if text.get("model_type") == "clover":  # a Clover checkpoint stays Clover: keep its fields at the top level
        cfg = dict(text)
    (dst / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            (dst / name).write_text((src / name).read_text())
    return dst


# ------------------------------------------------------------------------------ fast tests
def test_roundtrip_bundled_f32(bundled_f32):
    side = sidecar_path(bundled_f32)
    assert side.exists()
    _, main_tensors, types = read_gguf(bundled_f32)
    assert not any(".clover_" in n for n in main_tensors)  # the main file stays loadable by stock llama.cpp
    assert set(types.values()) == {"F32"}
    fields = assert_roundtrip(BUNDLED, [bundled_f32, side])
    cfg = read_config(BUNDLED)
    assert fields["general.architecture"] == "qwen35moe"
    assert fields["qwen35moe.block_count"] == cfg.num_hidden_layers
    assert fields["qwen35moe.embedding_length"] == cfg.hidden_size
    assert fields["qwen35moe.attention.head_count_kv"] == cfg.num_key_value_heads
    assert fields["qwen35moe.rope.dimension_count"] == cfg.rotary_dim
    assert fields["qwen35moe.ssm.time_step_rank"] == cfg.linear_num_value_heads
    assert fields["qwen35moe.ssm.group_count"] == cfg.linear_num_key_heads
    assert fields["qwen35moe.expert_used_count"] == cfg.num_experts_per_tok
    assert fields["qwen35moe.attention.recurrent_layers"] == [t == "linear_attention" for t in cfg.layer_types]
    assert fields["clover.format_version"] == 1
    assert fields["clover.block_size"] == cfg.block_size
    assert fields["clover.threshold"] == pytest.approx(cfg.threshold)
    assert fields["clover.tensors"] == "sidecar" and fields["clover.tensors_file"] == side.name
    assert fields["tokenizer.ggml.mask_token_id"] == cfg.mask_token_id == fields["clover.mask_token_id"]


def test_tokenizer_metadata_bundled(bundled_f32):
    fields, _, _ = read_gguf(bundled_f32)
    tj = json.loads((BUNDLED / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tj["model"]["vocab"].items()}
    vocab.update({a["id"]: a["content"] for a in tj["added_tokens"]})
    tokens = fields["tokenizer.ggml.tokens"]
    assert tokens == [vocab[i] for i in range(len(tokens))]
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    types = fields["tokenizer.ggml.token_type"]
    assert [types[a["id"]] for a in tj["added_tokens"]] == [int(gguf.TokenType.CONTROL)] * len(tj["added_tokens"])
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "smollm"
    assert fields["tokenizer.ggml.eos_token_id"] == 0
    assert "<|im_start|>" in fields["tokenizer.chat_template"]


def test_roundtrip_multimodal_per_expert_sharded(tmp_path, tiny_dir):
    mm = multimodal_checkpoint(tiny_dir, tmp_path / "mm", per_expert=True, max_shard_bytes=100_000)
    assert (mm / "model.safetensors.index.json").exists()
    out = tmp_path / "mm.gguf"
    r = export_gguf(mm, out, clover_tensors="inline", progress=False)
    assert r.sidecar is None and not sidecar_path(out).exists()
    fields = assert_roundtrip(mm, [out])
    assert fields["clover.tensors"] == "inline"
    # the byte tokenizer: vocab padded with unused tokens, one inert placeholder merge
    cfg = read_config(mm)
    assert len(fields["tokenizer.ggml.tokens"]) == cfg.vocab_size
    assert fields["tokenizer.ggml.token_type"][-1] == int(gguf.TokenType.UNUSED)
    assert any("placeholder merge" in n for n in r.notes)


def test_ar_checkpoint_has_no_clover_tensors(tmp_path):
    from clover.tiny import build_tiny_checkpoint

    src = build_tiny_checkpoint(tmp_path / "ar", seed=1, clover=False, dtype=torch.bfloat16)
    mm = multimodal_checkpoint(src, tmp_path / "ar-mm")
    out = tmp_path / "ar.gguf"
    r = export_gguf(mm, out, progress=False)
    assert r.sidecar is None and r.clover_tensors == 0
    fields = assert_roundtrip(mm, [out])
    assert fields["clover.model_type"] == "qwen3_5_moe_text" and "clover.block_size" not in fields


@pytest.mark.parametrize("dtype,matrix_type,atol", [("bf16", "BF16", 2e-2), ("f16", "F16", 2e-3), ("q8_0", "Q8_0", 2e-2)])
def test_dtypes(tmp_path, dtype, matrix_type, atol):
    out = tmp_path / f"m-{dtype}.gguf"
    export_gguf(BUNDLED, out, dtype=dtype, clover_tensors="inline", progress=False)
    _, _, types = read_gguf(out)
    assert types["blk.0.attn_qkv.weight"] == matrix_type
    assert types["blk.0.ffn_gate_exps.weight"] == matrix_type
    for always_f32 in ("blk.0.attn_norm.weight", "blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.0.ffn_gate_inp.weight",
                       "blk.0.ffn_gate_inp_shexp.weight", "blk.0.clover_intra_scale", "output_norm.weight"):
        assert types[always_f32] == "F32", always_f32
    assert_roundtrip(BUNDLED, [out], atol=atol, rtol=2e-2)


def test_mrope_sections_cover_every_rotary_pair():
    assert mrope_sections(64) == [11, 11, 10, 0]  # Qwen3.5's own
    assert mrope_sections(16) == [3, 3, 2, 0]
    for rot in range(4, 258, 2):
        assert sum(mrope_sections(rot)) == rot // 2


def test_check_supported_names_every_problem_in_one_line(tmp_path):
    """Each architecture's checks (write._PER_ARCH): all of a model's problems in one refusal, prefixed by the
    source, the M-RoPE sections among them; a Llama model's rope_scaling is refused the same way."""
    from clover.export.gguf import check_supported
    from clover.models import config_from_dict
    from clover.models.qwen3_5_moe import full_size_config

    c = full_size_config().replace(model_type="clover", mask_token_id=5)
    check_supported(c, tmp_path)
    bad = c.replace(attention_bias=True, partial_rotary_factor=2 / c.head_dim)  # rotary dim 2: no sections
    with pytest.raises(GGUFExportError, match=r"^\S+: cannot export to GGUF: attention_bias=true is not supported by "
                                              r"llama.cpp's qwen35moe; rotary dim 2 cannot be expressed as llama.cpp"):
        check_supported(bad, tmp_path)
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1}
    check_supported(config_from_dict(raw), tmp_path)
    scaled = config_from_dict({**raw, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(GGUFExportError, match=r"^\S+: cannot export to GGUF: rope_scaling .* is not written yet"):
        check_supported(scaled, tmp_path)


def test_every_table_row_reads_back_what_it_writes():
    """clover.gguf.names: export and import read one table; each row's inverse undoes its transform,
    with value heads that the export really reorders (2 key heads, 3 value heads each)."""
    from clover.gguf.names import INVERSE, QWEN35MOE, Heads

    h = Heads(n_k=2, n_v=6, dk=4, dv=4)
    qkv, v = 2 * h.n_k * h.dk + h.n_v * h.dv, h.n_v * h.dv
    shapes = {"qkv_rows": (qkv, 5), "v_rows": (v, 5), "head_rows": (h.n_v,), "neg_exp_heads": (h.n_v,),
              "conv": (qkv, 1, 4), "v_cols": (5, v), "squeeze0": (1, 5), "norm_offset": (5,), "same": (3, 5)}
    g = torch.Generator().manual_seed(0)
    rows = {**QWEN35MOE.layer, **QWEN35MOE.globals}
    for ours, (gguf_name, fn) in rows.items():
        t = torch.randn(shapes[fn.__name__], generator=g)
        out = fn(t, h)
        if fn.__name__ in ("qkv_rows", "v_rows", "head_rows", "conv", "v_cols"):
            assert not torch.equal(out.reshape(t.shape), t), ours  # the heads really move
        torch.testing.assert_close(INVERSE[fn](out, h), t, rtol=1e-6, atol=1e-6, msg=ours)
        assert QWEN35MOE.read_layer().get(gguf_name, QWEN35MOE.read_globals().get(gguf_name))[0] == ours


def test_pre_tokenizer_detection():
    tj = json.loads((BUNDLED / "tokenizer.json").read_text())
    assert detect_pre_tokenizer(tj) == ("smollm", False)
    tj["pre_tokenizer"]["pretokenizers"] = tj["pre_tokenizer"]["pretokenizers"][1:]
    assert detect_pre_tokenizer(tj) == ("smollm", True)
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    with pytest.raises(GGUFExportError, match="pre-tokenizer"):
        detect_pre_tokenizer(tj)


def test_clear_errors(tmp_path, tiny_dir):
    with pytest.raises(GGUFExportError, match="unknown dtype"):
        export_gguf(tiny_dir, tmp_path / "x.gguf", dtype="q4_0", progress=False)
    with pytest.raises(GGUFExportError, match="is a directory"):
        export_gguf(tiny_dir, tmp_path, progress=False)
    # a GDN with different key and value head dims: llama.cpp's qwen35moe cannot hold it
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "linear_value_head_dim": 8}))
    with pytest.raises(GGUFExportError, match="linear_key_head_dim == linear_value_head_dim"):
        export_gguf(bad, tmp_path / "x.gguf", progress=False)
    # a missing tensor names the key; nothing is left behind
    from safetensors.torch import load_file, save_file

    (bad / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(tiny_dir / "model.safetensors"))
    state.pop("model.layers.1.linear_attn.A_log")
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(GGUFExportError, match="model.layers.1.linear_attn.A_log"):
        export_gguf(bad, tmp_path / "x.gguf", progress=False)
    state["model.layers.1.linear_attn.A_log"] = torch.zeros(3)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(GGUFExportError, match="has shape"):
        export_gguf(bad, tmp_path / "x.gguf", progress=False)
    assert not list(tmp_path.glob("x.gguf*"))


def test_cli(tmp_path, tiny_dir, capsys):
    from clover.cli import main

    out = tmp_path / "cli.gguf"
    assert main(["export-gguf", str(tiny_dir), str(out), "--dtype", "bf16", "--no-progress"]) == 0
    assert out.exists() and sidecar_path(out).exists()
    assert "arch qwen35moe" in capsys.readouterr().out
    assert main(["export-gguf", str(tmp_path / "nope"), str(out)]) == 2
    assert "not a directory" in capsys.readouterr().err


# ------------------------------------------------------------- slow: against llama.cpp itself
LLAMA_CACHE = llama_cache_dir()
PROBE = LLAMA_CACHE / "bin" / "clover-llama-probe"
GREEDY_PROMPTS, GREEDY_TOKENS, LOGIT_TOKENS = 20, 64, 256
# next-token logits, llama.cpp vs clover, f32: |difference| <= LOGIT_ATOL + LOGIT_RTOL * max|logit| of that position
LOGIT_ATOL, LOGIT_RTOL = 1e-3, 1e-3


@pytest.fixture(scope="module")
def probe():
    if not PROBE.exists():
        pytest.skip(f"llama.cpp build absent ({PROBE} not found): run scripts/build-llama-cpp.sh (about 5 minutes on 2 cores)")
    return PROBE


def llama(probe: Path, model: Path, mode: str, stdin: str, *args: str) -> str:
    r = subprocess.run([str(probe), str(model), mode, *args], input=stdin.encode(), capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r.stdout.decode()


def llama_greedy(probe, model, ids: list[int], n: int, banned: list[int] = ()) -> list[int]:
    return [int(x) for x in llama(probe, model, "greedy", " ".join(map(str, ids)), str(n), *map(str, banned)).split()]


def llama_logits(probe, model, ids: list[int], tmp: Path, n_vocab: int) -> np.ndarray:
    out = tmp / "logits.f32"
    llama(probe, model, "logits", " ".join(map(str, ids)), str(out))
    return np.fromfile(out, dtype=np.float32).reshape(len(ids), n_vocab)




def compare_with_llama(probe, src: Path, gguf_path: Path, tmp: Path, prompts: list[list[int]], text_ids: list[int]) -> dict:
    import clover

    llm = clover.load(src, dtype="float32")
    n_vocab = llm.config.vocab_size
    same, first_diff = 0, []
    for ids in prompts:
        ours = llm.generate(ids, mode="ar", max_new_tokens=GREEDY_TOKENS, ignore_eos=True, temperature=0.0).token_ids
        theirs = llama_greedy(probe, gguf_path, ids, GREEDY_TOKENS, banned=llm.config.eos_token_ids)  # as ignore_eos
        same += ours == theirs
        if ours != theirs:
            first_diff.append(next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b))
    theirs = llama_logits(probe, gguf_path, text_ids, tmp, n_vocab)
    with torch.no_grad():
        ours = llm.model(torch.tensor([text_ids]))[0].float().numpy()
    diff = np.abs(ours - theirs)
    scale = np.abs(ours).max(axis=1, keepdims=True)
    stats = {
        "greedy_equal": same, "prompts": len(prompts), "first_diff": first_diff,
        "logits_max_abs": float(diff.max()), "logits_max_rel": float((diff / scale).max()),
        "logit_scale": float(scale.max()),
        "argmax_equal": int((ours.argmax(1) == theirs.argmax(1)).sum()), "positions": len(text_ids),
        "within_tolerance": bool((diff <= LOGIT_ATOL + LOGIT_RTOL * scale).all()),
    }
    print(f"\n{src.name}: {stats}")
    return stats


@pytest.mark.slow
def test_llama_cpp_tokenization_matches(probe, bundled_f32):
    from clover.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED)
    snippets = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "assert sorted([9, 2, 5]) == ",
        "x = 1234567890 + 3.14159e-10 * 0x1F",
        "for i in range(10):\n\tprint(i, 'done', \"ok\")\n\n\n",
        "<|im_start|>user\nhello 42<|im_end|>\n<|im_start|>assistant\n",
        "naïve café — ünïcödé 日本語 🙂 done",
        "    # comment with it's and we're\n        pass\n",
        "    ",
        "\n",
    ]
    snippets += held_out_prompts(40)
    bad = [s for s in snippets if llama(probe, bundled_f32, "tokenize", s).split() != [str(i) for i in tok.encode(s)]]
    assert not bad, f"{len(bad)} of {len(snippets)} snippets tokenize differently, e.g. {bad[:3]!r}"


@pytest.mark.slow
@pytest.mark.parametrize("source", ["bundled", "random-multimodal"])
def test_llama_cpp_matches_clover(probe, bundled_f32, tmp_path, source):
    """The bundled model, and a random checkpoint in the multimodal layout (fused experts)."""
    from clover.tokenizer import Tokenizer

    src, gguf_path = BUNDLED, bundled_f32
    if source == "random-multimodal":
        from clover.tiny import build_tiny_checkpoint

        src = multimodal_checkpoint(build_tiny_checkpoint(tmp_path / "tiny", seed=3, init_std=0.2), tmp_path / "tiny-mm")
        gguf_path = tmp_path / "tiny-mm.gguf"
        export_gguf(src, gguf_path, progress=False)
    tok = Tokenizer.from_dir(src)
    prompts = [tok.encode(p) for p in held_out_prompts(GREEDY_PROMPTS)]
    s = compare_with_llama(probe, src, gguf_path, tmp_path, prompts, held_out_text(tok, LOGIT_TOKENS))
    assert s["greedy_equal"] == GREEDY_PROMPTS, s
    assert s["within_tolerance"], s


@pytest.mark.slow
def test_llama_cpp_tokenization_known_gap(probe, bundled_f32):
    """docs/gguf.md: llama.cpp's "smollm" joins the space after `== ` to a following letter or
    bracket, ours keeps it alone. If this starts to pass, update the docs."""
    from clover.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED)
    for s in ("x == y", "assert f(1) == [1, 2]"):
        ours = tok.encode(s)
        theirs = [int(x) for x in llama(probe, bundled_f32, "tokenize", s).split()]
        assert ours != theirs and len(theirs) == len(ours) - 1, (s, ours, theirs)
