"""What a new user meets first: the checkpoint's own default mode in every front end, a chat model
answered through its chat template (`LLM.chat`, `clover generate`, `clover chat`), and torch's
thread count (`--threads`, and a default that leaves busy cores alone)."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from clover import cli
from clover.tiny import build_tiny_checkpoint

CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _set_config(d, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def ar_default(tmp_path_factory):
    """A Clover checkpoint whose config states `default_mode: ar` (as clover-smol's does)."""
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("fh") / "ar-default", seed=0)
    _set_config(d, default_mode="ar")
    return d


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny checkpoint with a chat template of its own (an instruct model's)."""
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("fh") / "chat", seed=1)
    (d / "chat_template.jinja").write_text(CHAT)
    return d


# ------------------------------------------------------------------------------- default mode
def test_the_checkpoint_states_its_default_mode_and_every_front_end_reads_it(capsys, ar_default):
    from fastapi.testclient import TestClient

    import clover
    from clover.serve.app import create_app

    llm = clover.load(ar_default)
    assert llm.default_mode == "ar" and llm.mode().name == "ar"
    kw = dict(max_new_tokens=8)
    assert llm.generate("hello", **kw).token_ids == llm.generate("hello", mode="ar", **kw).token_ids
    rc, out, err = run(capsys, "generate", "hello", "--model", ar_default, "-n", "8", "--json")
    assert rc == 0, err
    assert json.loads(out)["mode"] == "ar"
    with TestClient(create_app(llm)) as client:
        assert client.get("/v1/clover/modes").json()["default"] == "ar"
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == llm.generate("hello", mode="ar", **kw).text


def test_a_stated_mode_that_needs_a_missing_drafter_falls_back_to_ar(tmp_path):
    import clover

    d = build_tiny_checkpoint(tmp_path / "m", seed=0)
    _set_config(d, default_mode="dflash")
    assert clover.load(d, drafter=False).default_mode == "ar"
    _set_config(d, default_mode="nonesuch")
    with pytest.raises(ValueError, match="default_mode"):
        clover.load(d)


def test_an_unstated_default_stays_diffusion_for_clover_and_ar_for_ar(tiny_llm):
    assert tiny_llm.config.default_mode is None and tiny_llm.default_mode == "diffusion"
    assert "default_mode" not in tiny_llm.config.to_dict()  # not written when unset


# ----------------------------------------------------------------------------------------- chat
def test_llm_chat_is_generate_through_the_template_ending_at_the_turn(chat_model):
    import clover

    llm = clover.load(chat_model)
    assert llm.is_chat
    msgs = [{"role": "user", "content": "hi"}]
    ids = llm.chat_prompt(msgs)
    assert ids == llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    opts = llm.chat_options({"max_new_tokens": 6})
    assert "<|im_end|>" in opts["stop"] and opts["stop_token_ids"] == [llm.tokenizer.end_of_turn_id()]
    gen = llm.chat(msgs, mode="ar", max_new_tokens=6)
    assert gen.token_ids == llm.generate(ids, mode="ar", **opts).token_ids
    done = [e for e in llm.chat_stream(msgs, mode="ar", max_new_tokens=6) if e.kind == "done"][0]
    assert done.generation.token_ids == gen.token_ids
    for bad in ([], [{"role": "user"}], "hi", [{"role": "user", "content": 3}]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad)


def test_a_model_with_clovers_generic_template_is_not_a_chat_model(tiny_llm):
    assert not tiny_llm.is_chat


def test_generate_on_a_chat_model_applies_its_template_unless_raw(capsys, chat_model):
    import clover

    llm = clover.load(chat_model)
    msgs = [{"role": "user", "content": "hi"}]
    rc, out, err = run(capsys, "generate", "hi", "--model", chat_model, "--mode", "ar", "-n", "6", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["chat_template"] is True and d["token_ids"] == llm.chat(msgs, mode="ar", max_new_tokens=6).token_ids
    rc, out, err = run(capsys, "generate", "hi", "--model", chat_model, "--mode", "ar", "-n", "6", "--json", "--raw")
    d = json.loads(out)
    assert d["chat_template"] is False and d["token_ids"] == llm.generate("hi", mode="ar", max_new_tokens=6).token_ids
    rc, out, err = run(capsys, "generate", "hi", "--model", chat_model, "--mode", "ar", "-n", "6")
    assert rc == 0 and "chat template" in err and "--raw" in err


def test_chat_prints_the_speed_of_every_answer(capsys, chat_model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nand again\n"))
    rc, out, err = run(capsys, "chat", "--model", chat_model, "--mode", "ar", "-n", "4")
    assert rc == 0, err
    assert err.count("tokens/s") == 2 and "tokens/s" not in out


# -------------------------------------------------------------------------------------- threads
def test_default_threads_leave_busy_cores_alone(monkeypatch):
    import os

    from clover.cli.common import default_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.0, 6.0))  # a busy box
    assert default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting is torch's
    assert default_threads() == torch.get_num_threads()


def test_threads_is_torchs_in_every_model_command_and_the_port_has_its_own(capsys, ar_default):
    from clover.cli.common import llama_threads

    before = torch.get_num_threads()
    try:
        rc, _, err = run(capsys, "generate", "hi", "--model", ar_default, "-n", "2", "--threads", "2")
        assert rc == 0, err
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for name in ("generate", "chat", "serve", "demo", "eval", "bench"):
        parser = cli.build_parser(name)
        argv = [name, "decode"] if name == "bench" else [name]
        assert parser.parse_args([*argv, "--threads", "3"]).threads == 3
    for argv, want in ((["--threads", "3"], 3), (["--llama-threads", "2", "--threads", "3"], 2), ([], 1)):
        assert llama_threads(cli.build_parser("generate").parse_args(["generate", "x", *argv])) == want
    rc, _, err = run(capsys, "generate", "hi", "--model", ar_default, "--threads", "0")
    assert rc == 2 and "--threads" in err


# ----------------------------------------------------------------------------------- serving
def test_the_playground_opens_on_chat_for_a_chat_model_and_serve_says_where(chat_model, tiny_llm):
    from fastapi.testclient import TestClient

    import clover
    from clover.serve.app import banner, create_app

    llm = clover.load(chat_model)
    with TestClient(create_app(llm)) as client:
        assert client.get("/v1/clover/modes").json()["chat"] is True
    with TestClient(create_app(tiny_llm)) as client:
        assert client.get("/v1/clover/modes").json()["chat"] is False
    line = banner(llm, "m", "0.0.0.0", 8123)
    assert "http://127.0.0.1:8123/v1" in line and "playground http://127.0.0.1:8123/" in line and "\n" not in line


def test_the_serve_extra_hint_names_an_install_that_works():
    from clover.cli.common import extra_hint

    assert "pip install -e '.[serve]'" in extra_hint("serve")


# --------------------------------------------------------------------------------- GGUF, cache
def test_a_gguf_file_is_a_model_imported_once_and_the_cache_lists_and_removes_it(tmp_path, monkeypatch, capsys):
    import os
    import stat

    from test_gguf_import import hf_llama, write_gguf

    import clover
    from clover import named

    monkeypatch.setenv("CLOVER_MODELS", str(tmp_path / "models"))
    ref, tok_dir, ids = hf_llama(tmp_path, tied=True)
    gguf = write_gguf(tmp_path / "tiny.gguf", ref, tok_dir, ids)
    llm = clover.load(gguf)
    assert llm.path.parent == named.models_root() / named.GGUF_DIR and "importing tiny.gguf" in capsys.readouterr().err
    weights = llm.path / "model.safetensors"
    assert stat.S_IMODE(os.stat(weights).st_mode) == 0o666 & ~_umask()  # readable by others, as any new file
    mtime = weights.stat().st_mtime_ns
    rc, out, err = run(capsys, "generate", "hi", "--model", gguf, "--mode", "ar", "-n", "3", "--raw")
    assert rc == 0, err
    assert "importing" not in err and weights.stat().st_mtime_ns == mtime  # once
    rc, out, _ = run(capsys, "list")
    assert rc == 0 and llm.path.name in out and "total" in out
    rc, out, _ = run(capsys, "rm", llm.path.name)
    assert rc == 0 and not llm.path.exists()
    rc, _, err = run(capsys, "rm", "nothing-such")
    assert rc == 2 and "not in the model cache" in err


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_server_names_max_tokens_as_sent_and_refuses_content_less_messages(tiny_llm):
    from fastapi.testclient import TestClient

    from clover.serve.app import create_app

    with TestClient(create_app(tiny_llm)) as client:
        too_long = tiny_llm.context_length
        for field in ("max_tokens", "max_completion_tokens"):
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], field: too_long})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == field and err["code"] == "context_length_exceeded"
            assert err["message"].startswith(f"{field}: ") and "max_new_tokens" not in err["message"]
        for msg in ({"role": "user"}, {"role": "user", "content": None}, {"role": "system", "content": None}):
            r = client.post("/v1/chat/completions", json={"messages": [msg, {"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200


def test_generate_says_so_when_a_chat_model_ends_a_plain_prompt_at_once(chat_model):
    import warnings

    import clover

    llm = clover.load(chat_model)
    eos = llm.config.eos_token_ids[0]
    with pytest.warns(UserWarning, match="llm.chat"):
        assert llm.generate("hi", mode="ar", max_new_tokens=4, logit_bias={eos: 100.0}).token_ids == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.generate("hi", mode="ar", max_new_tokens=2, ignore_eos=True)  # tokens: no warning
        llm.chat([{"role": "user", "content": "hi"}], mode="ar", max_new_tokens=4, logit_bias={eos: 100.0})


def test_a_q4_1_gguf_stays_4_bit_on_the_same_grid(tmp_path, monkeypatch):
    """Q4_1 puts each block's min and max at its codes 0 and 15: clover's INT4 with group 32 of the
    imported weights has the same 16 levels per block, up to bfloat16 rounding of scale and offset."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from safetensors import safe_open
    from test_gguf_import import hf_llama, write_gguf

    import clover
    from clover.export.gguf_quant import planes_from_parts

    monkeypatch.setenv("CLOVER_MODELS", str(tmp_path / "models"))
    ref, tok_dir, ids = hf_llama(tmp_path, tied=True)
    src = write_gguf(tmp_path / "q41.gguf", ref, tok_dir, ids, matrix_type=T.Q4_1)
    llm = clover.load(src)
    qc = llm.config.quantization_config
    assert qc["bits"] == 4 and qc["group_size"] == 32
    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == "blk.0.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).copy()).float()
    with safe_open(str(llm.path / "model.safetensors"), "pt") as f:
        parts = {k: f.get_tensor(f"model.layers.0.mlp.down_proj.{k}") for k in ("qweight", "scales", "zeros")}
    got = planes_from_parts(parts, 4, 32, want.shape[-1]).dequantize()
    blocks = want.reshape(want.shape[0], -1, 32)
    step = ((blocks.amax(-1) - blocks.amin(-1)) / 15).repeat_interleave(32, -1)
    assert float(((got - want).abs() / step).max()) < 0.05
    assert len(llm.generate("hi", mode="ar", max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_frequency_penalty_has_openais_meaning():
    """frequency_penalty subtracts penalty x (times seen) from a seen token's logit, beside presence_penalty's
    once-if-seen; the server takes it in OpenAI's range [-2, 2]; speculative (lossless) refuses it, as it does
    every history-dependent penalty."""
    from clover.decoding.sampling import SamplingParams, process_logits

    logits = torch.zeros(1, 6)
    seen = [[1, 1, 1, 2, None]]
    out = process_logits(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25).validate(), seen, [])
    assert out[0].tolist() == [0.0, -1.75, -0.75, 0.0, 0.0, 0.0]
    neg = process_logits(logits, SamplingParams(frequency_penalty=-1.0).validate(), seen, [])
    assert neg[0, 1].item() == 3.0 and neg[0, 2].item() == 1.0
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=2.5).validate()


def test_the_server_takes_frequency_penalty(tiny_llm):
    from fastapi.testclient import TestClient

    from clover.serve.app import create_app

    with TestClient(create_app(tiny_llm)) as client:
        body = {"prompt": "x", "max_tokens": 4, "mode": "ar", "frequency_penalty": 1.5}
        assert client.post("/v1/completions", json=body).status_code == 200
        r = client.post("/v1/completions", json=dict(body, frequency_penalty=3))
        assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty"
        r = client.post("/v1/completions", json=dict(body, mode="speculative"))
        assert r.status_code == 400 and "penalt" in r.json()["error"]["message"]
