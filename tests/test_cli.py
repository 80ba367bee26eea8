"""The `clover` command line: generate / chat / info / tiny / demo, errors and exit codes, the live
view's non-terminal fallback, and the timeline pictures. Runs `clover.cli.main` in-process on a
tiny random checkpoint, plus real subprocess runs of `python -m clover` and the console script."""

from __future__ import annotations

import html
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover import cli, viz
from clover.cli.chat import fit_history
from clover.cli.common import UsageError, process_escapes, sampling_kwargs
from clover.models import make_config
from clover.models import read_config
from clover.tiny import build_tiny_checkpoint

# short generations in small blocks keep every call well under a second
FAST = ["-n", "8", "--block-size", "8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", seed=0))


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def gen_json(capsys, model, *extra) -> dict:
    rc, out, err = run(capsys, "generate", "hello", "--model", model, *FAST, "--json", *extra)
    assert rc == 0, err
    return json.loads(out)


# ----------------------------------------------------------------------------------- generate
def test_generate_ar_streams_text_and_stats(capsys, model):
    rc, out, err = run(capsys, "generate", "hello", "--model", model, "--mode", "ar", *FAST)
    assert rc == 0, err
    assert out.endswith("\n") and len(out) > 1
    assert "[ar] 8 tokens · 8 forwards · 1.00 tokens/forward" in err
    assert "tokens/s" in err


def test_generate_defaults_to_diffusion_on_a_clover_model(capsys, model):
    rc, out, err = run(capsys, "generate", "hello", "--model", model, *FAST)
    assert rc == 0, err
    assert err.startswith("[diffusion] 8 tokens")
    data = gen_json(capsys, model)
    assert out.rstrip("\n") == data["text"]  # the streamed text is the generation's text


def test_one_default_mode_for_the_api_the_cli_and_the_server(capsys, model):
    """`LLM.generate(prompt)` with no mode decodes exactly as `clover generate` and `clover serve`
    do with none: the model's default (diffusion for a Clover checkpoint), the same tokens."""
    from fastapi.testclient import TestClient

    import clover
    from clover.serve.app import create_app

    llm = clover.load(model)
    assert llm.default_mode == "diffusion" and llm.mode().name == "diffusion"
    kw = dict(max_new_tokens=8, block_size=8)
    api = llm.generate("hello", **kw)
    assert api.token_ids == llm.generate("hello", mode="diffusion", **kw).token_ids
    assert api.token_ids != llm.generate("hello", mode="ar", **kw).token_ids  # the modes differ here
    streamed = [e for e in llm.stream("hello", **kw) if e.kind == "done"][0].generation
    assert streamed.token_ids == api.token_ids
    d = gen_json(capsys, model)
    assert d["mode"] == "diffusion" and d["token_ids"] == api.token_ids
    with TestClient(create_app(llm)) as client:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "block_size": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["clover"]["mode"] == "diffusion" and r.json()["choices"][0]["text"] == api.text


def test_generate_json_schema(capsys, model):
    for mode in ("ar", "diffusion"):
        d = gen_json(capsys, model, "--mode", mode)
        assert set(d) >= {"text", "token_ids", "finish_reason", "stats", "mode", "model"}
        assert d["mode"] == mode and d["model"] == model
        assert isinstance(d["text"], str) and d["finish_reason"] in ("stop", "length")
        assert all(isinstance(t, int) for t in d["token_ids"])
        s = d["stats"]
        assert s["tokens"] == len(d["token_ids"]) == len(d["decode_steps"])
        assert isinstance(s["forwards"], int) and s["forwards"] >= 1
        assert s["tokens_per_forward"] == pytest.approx(s["tokens"] / s["forwards"], abs=1e-4)
        assert s["seconds"] > 0 and s["tokens_per_second"] >= 0
        if mode == "diffusion":
            assert d["block_size"] == 8 and d["threshold"] == pytest.approx(0.95)
            assert sum(s["block_steps"]) == s["forwards"]
        else:
            assert s["forwards"] == s["tokens"]


def test_generate_prompt_from_stdin(capsys, model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    rc, out, err = run(capsys, "generate", "--model", model, *FAST, "--json")
    assert rc == 0, err
    assert json.loads(out)["text"] == gen_json(capsys, model)["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc, out, err = run(capsys, "generate", "-", "--model", model)
    assert rc == 2 and "no prompt" in err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--threshold", "0"], "threshold"),
        (["--block-size", "0"], "block_size"),
        (["--top-p", "1.5"], "top_p"),
        (["--mode", "ar", "--timeline", "x.txt"], "--timeline"),
    ],
)
def test_generate_bad_values_exit_2_with_one_line(capsys, model, flags, needle):
    rc, out, err = run(capsys, "generate", "hello", "--model", model, *flags)
    assert rc == 2 and out == ""
    assert needle in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("clover generate: error:")


def test_missing_and_broken_model_dirs(capsys, tmp_path):
    missing = tmp_path / "nope"
    for argv in (["generate", "hi", "--model", missing], ["info", missing], ["chat", "--model", missing]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and str(missing) in err and err.count("\n") == 1, err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    rc, _, err = run(capsys, "generate", "hi", "--model", broken)
    assert rc == 2 and "not valid JSON" in err and err.count("\n") == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(capsys, "info", empty)
    assert rc == 2 and "config.json" in err
    # config fine, weights missing
    nosafe = tmp_path / "nosafe"
    nosafe.mkdir()
    (nosafe / "config.json").write_text(json.dumps(make_config(**_small_config()).to_dict()))
    rc, _, err = run(capsys, "generate", "hi", "--model", nosafe)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err


def _small_config() -> dict:
    return dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def test_unavailable_device_is_a_usage_error(capsys, model):
    rc, _, err = run(capsys, "generate", "hi", "--model", model, "--device", "nonsense")
    assert rc == 2 and "--device" in err


# ----------------------------------------------------------------------------- live / timeline
def test_live_without_a_terminal_prints_the_final_text(capsys, model):
    rc, out, err = run(capsys, "generate", "hello", "--model", model, *FAST, "--live")
    assert rc == 0, err
    assert out == gen_json(capsys, model)["text"] + "\n"
    assert "\x1b[" not in out  # no terminal control sequences
    assert "tokens/forward" in err


def test_live_view_renders_provisional_blocks(model):
    """Drive the rich view directly with a recording console (no terminal needed)."""
    import clover
    from rich.console import Console

    llm = clover.load(model)
    console = Console(width=100, force_terminal=True, file=io.StringIO())
    view = viz.LiveView(lambda t: llm.tokenizer.decode([t]), 8, console=console)
    frames = []
    with view:
        for ev in llm.stream("hello", mode="diffusion", provisional=True, max_new_tokens=8, block_size=8):
            view.update(ev)
            if ev.kind == "provisional" and any(t is None for t in ev.token_ids):
                frames.append(_render_text(view))
    assert frames and viz.MASK_GLYPH in frames[0] and "block 0 · step 1" in frames[0]
    assert view.final is not None and view.forwards == view.final.stats.forwards


def _render_text(view) -> str:
    from rich.console import Console

    c = Console(width=100, record=True, file=io.StringIO())
    c.print(view._render())
    return c.export_text()


def test_timeline_png(capsys, model, tmp_path):
    import matplotlib.image as mpimg

    path = tmp_path / "t.png"
    rc, _, err = run(capsys, "generate", "hello", "--model", model, "-n", "20", "--block-size", "8", "--timeline", path)
    assert rc == 0, err
    assert f"timeline written to {path}" in err
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 0 and img.shape[1] > 0


def test_timeline_png_without_matplotlib_is_one_line_before_generating(capsys, model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "t.png"
    rc, out, err = run(capsys, "generate", "hello", "--model", model, *FAST, "--timeline", path)
    assert rc == 2 and out == "" and not path.exists()
    assert "pip install 'clover-dlm[plot]'" in err and ".html" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_timeline_html_holds_the_tokens(capsys, model, tmp_path):
    path = tmp_path / "t.html"
    rc, _, err = run(capsys, "generate", "hello", "--model", model, *FAST, "--timeline", path)
    assert rc == 0, err
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "<style>" in page
    import clover

    tok = clover.load(model).tokenizer
    g = gen_json(capsys, model)
    for t in g["token_ids"]:
        assert html.escape(viz.visible(tok.decode([t]))) in page
    assert page.count('class="row"') == 1  # 8 tokens, block size 8
    assert page.count('class="tok forced"') == g["stats"]["forced_steps"]  # the CLI passes the forced tokens


def test_timeline_blocks_and_html_escaping(tmp_path):
    blocks = viz.timeline_blocks(["a", "<b>", "&", " ", "\n"], [1, 2, 2, 1, 1], 2, forwards_per_block=[2, 2])
    assert [len(b.tokens) for b in blocks] == [2, 2, 1]
    assert [b.forwards for b in blocks] == [2, 2, 1]  # the last block falls back to its largest step
    assert blocks[1].tokens_per_forward == 1.0
    page = viz.timeline_html(blocks, 2, title="<x>")
    assert "&lt;b&gt;" in page and "&amp;" in page and "<b>" not in page and "&lt;x&gt;" in page
    assert viz.step_colour(1, 8) == "#440154" and viz.step_colour(8, 8) == "#fde725"
    out = viz.render_timeline(tmp_path / "v.svg", ["x$y$", "é"], [1, 2], 4)  # no mathtext parsing
    assert out.read_text().startswith("<?xml")
    with pytest.raises(ValueError):
        viz.timeline_blocks(["a"], [1, 2], 2)


def test_timeline_outlines_forced_tokens(tmp_path):
    blocks = viz.timeline_blocks(["a", "b", "c"], [1, 2, 1], 2, forced=[1, 2])
    assert [b.forced for b in blocks] == [[False, True], [True]]
    page = viz.timeline_html(blocks, 2)
    assert page.count('class="tok forced"') == 2 and "2 forced (outlined)" in page
    assert "forced" not in viz.timeline_html(viz.timeline_blocks(["a"], [1], 2), 2).split("</style>")[1]
    assert viz.render_timeline(tmp_path / "f.png", ["a", "b", "c"], [1, 2, 1], 2, forced=[1]).stat().st_size > 0


# ---------------------------------------------------------------------------------------- info
def test_info(capsys, model):
    rc, out, err = run(capsys, "info", model)
    assert rc == 0, err
    from clover.models import parameter_counts

    counts = parameter_counts(read_config(model))
    for needle in ("3 GDN", "1 full attention", "8 routed, top-2", f"{counts['total']:,}", f"{counts['active']:,}",
                   "float32", "size on disk", "context length  4,096", "block size", "0.95", "<|mask|>", "quantization    none"):
        assert needle in out, needle
    rc, out, _ = run(capsys, "info", "--model", model, "--json")
    d = json.loads(out)
    assert d["parameters"] == counts and d["disk_bytes"] > 0 and d["layer_pattern"] == "LLLA"


def test_tiny_ar_checkpoint_and_default_mode(capsys, tmp_path):
    d = tmp_path / "ar"
    rc, out, err = run(capsys, "tiny", d, "--ar", "--seed", "3")
    assert rc == 0, err
    assert "tiny random AR checkpoint" in out
    rc, out, _ = run(capsys, "info", d)
    assert "autoregressive only" in out
    rc, out, err = run(capsys, "generate", "hi", "--model", d, "-n", "4")
    assert rc == 0 and err.startswith("[ar] 4 tokens")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    rc, _, err = run(capsys, "tiny", tmp_path / "junk")
    assert rc == 2 and "not a model directory" in err


def test_tiny_shapes():
    """`clover tiny --shape` names exactly the presets, and the 0.7b preset is what it says (checked on
    the meta device: no weights are drawn)."""
    from clover.cli.tiny import SHAPE_NAMES
    from clover.models import build_model
    from clover.tiny import SHAPES, tiny_config

    assert set(SHAPE_NAMES) == set(SHAPES)
    preset = {k: v for k, v in SHAPES["0.7b"].items() if k != "init_std"}
    config = tiny_config(**preset)
    n = sum(p.numel() for p in build_model(config, device="meta").parameters())
    assert 0.6e9 < n < 0.8e9 and config.is_clover and config.layer_types.count("full_attention") == 2
    with pytest.raises(ValueError, match="unknown shape"):
        from clover.tiny import build_tiny_checkpoint
        build_tiny_checkpoint("unused", shape="7b")


# ---------------------------------------------------------------------------------------- chat
def test_chat_piped(capsys, model, monkeypatch):
    script = "hi there\n/stats\n/reset\n/stats\n/bogus\nand again\n/exit\nnever read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    rc, out, err = run(capsys, "chat", "--model", model, "--mode", "ar", "-n", "6")
    assert rc == 0, err
    assert "(turns: 1 · history:" in out
    assert "(last reply: " in out and "tokens/forward" in out
    assert "(conversation cleared)" in out
    assert "(turns: 0 · history: 0" in out
    assert "unknown command '/bogus'" in out
    assert "never read" not in out and "<|im_end|>" not in out


def test_chat_history_drops_oldest_turns(model):
    import clover

    llm = clover.load(model)
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(4):
        msgs += [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": f"answer {i} " * 5}]
    msgs.append({"role": "user", "content": "last"})
    full = len(llm.tokenizer.apply_chat_template(msgs))
    ids, dropped = fit_history(llm, msgs, full - 10)
    assert len(ids) <= full - 10 and dropped == 2
    assert msgs[0]["role"] == "system" and msgs[1]["content"].startswith("question 1") and msgs[-1]["content"] == "last"
    with pytest.raises(ValueError, match="too long"):
        fit_history(llm, msgs, 5)


# ---------------------------------------------------------------------------------------- demo
def test_demo_falls_back_to_a_tiny_model(capsys, monkeypatch, tmp_path):
    import clover.api

    monkeypatch.delenv("CLOVER_MODEL", raising=False)
    import clover.named

    monkeypatch.setattr(clover.api, "BUNDLED_MODEL", tmp_path / "no-bundled-model")
    monkeypatch.setenv("CLOVER_MODELS", str(tmp_path / "models"))

    def offline(*a, **k):
        raise clover.named.PullError("the registry cannot be reached (test)")

    monkeypatch.setattr(clover.named, "pull", offline)  # never the network in the suite
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "demo", "-n", "6")
    assert rc == 0, err
    assert "clover-smol is not available (the registry cannot be reached (test))" in err
    assert "tiny random checkpoint" in err and (tmp_path / "build" / "demo-tiny" / "config.json").exists()
    assert "tokens/forward" in out and out.count("diffusion") >= 2 and out.count("ar ") >= 2
    assert "def fibonacci(n):" in out


# --------------------------------------------------------------------------- registry / signals
def test_registry_lazy_command_and_ctrl_c(capsys, tmp_path, monkeypatch):
    (tmp_path / "clover_cli_plugin.py").write_text(
        "def configure(p):\n    p.add_argument('--what', default='x')\n"
        "def run(args):\n    if args.what == 'int':\n        raise KeyboardInterrupt\n    print('plugin', args.what)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "plugin", cli.Command("plugin", "a test command", "clover_cli_plugin:configure",
                                                            "clover_cli_plugin:run"))
    assert run(capsys, "plugin", "--what", "ok") == (0, "plugin ok\n", "")
    rc, _, err = run(capsys, "plugin", "--what", "int")
    assert rc == 130 and "interrupted" in err
    rc, out, _ = run(capsys)
    assert rc == 2 and "plugin" in out and "generate" in out


# ---------------------------------------------------------------------------------- subprocess
def test_subprocess_module_and_console_script(model):
    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1")  # one thread, as the rest of the suite
    p = subprocess.run([sys.executable, "-m", "clover", "generate", "--model", model, *FAST, "--json"],
                       input="hello\n", capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["mode"] == "diffusion" and d["stats"]["tokens"] == 8
    script = Path(sys.executable).parent / "clover"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "clover"]
    p = subprocess.run(exe + ["info", "/definitely/not/here"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "no such model directory" in p.stderr


# ------------------------------------------------------------------------- issue 16: CLI fixes
def test_serve_without_the_extra_says_what_to_install(capsys, model, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` raises ImportError
    for name in ("clover.serve", "clover.serve.app"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    rc, out, err = run(capsys, "serve", "--model", model)
    assert rc == 2 and out == ""
    assert "pip install 'clover-dlm[serve]'" in err and "fastapi" in err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "written, meant",
    [
        (r"\n", "\n"),
        (r"\t|\r", "\t|\r"),
        (r"a\\nb", "a\\nb"),
        (r"\"q\'", "\"q'"),
        (r"\x41\x7e", "A~"),
        (r"\xe2\x80\x94", "\u2014"),  # bytes, as llama.cpp reads them: UTF-8 of an em dash
        (r"\u00e9\u2014", "\u00e9\u2014"),
        (r"\q\x4", "\\q\\x4"),  # unknown or incomplete escapes stay as written
        ("trailing\\", "trailing\\"),
        ("plain", "plain"),
    ],
)
def test_process_escapes(written, meant):
    assert process_escapes(written) == meant


@pytest.mark.parametrize("bad", [r"\xff", r"\ud800"])
def test_process_escapes_refuses_invalid_text(bad):
    with pytest.raises(UsageError, match="--stop"):
        process_escapes(bad, flag="--stop")


def test_stop_flag_processes_escapes(capsys, model):
    args = cli.build_parser("generate").parse_args(["generate", "x", "--stop", r"\n", "--stop", r"\\n"])
    assert sampling_kwargs(args)["stop"] == ["\n", "\\n"]
    # end to end: an escaped character as the stop string cuts the text where it first appears
    free = gen_json(capsys, model, "--mode", "ar", "-n", "24")
    c = next(ch for ch in free["text"][1:] if 32 <= ord(ch) < 127 and ch != "\\")
    stopped = gen_json(capsys, model, "--mode", "ar", "-n", "24", "--stop", f"\\x{ord(c):02x}")
    assert stopped["text"] == free["text"].split(c)[0] and stopped["finish_reason"] == "stop"


def test_non_finite_weights_and_no_check_finite(capsys, model, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path / "nan"
    shutil.copytree(model, d)
    state = load_file(str(d / "model.safetensors"))
    state["model.embed_tokens.weight"][3, 1] = float("nan")
    save_file(state, str(d / "model.safetensors"))
    rc, out, err = run(capsys, "generate", "hello", "--model", d, *FAST)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "model.embed_tokens.weight" in err and "non-finite" in err and "--no-check-finite" in err
    rc, out, err = run(capsys, "generate", "hello", "--model", d, *FAST, "--no-check-finite", "--json")
    assert rc == 0, err
    assert torch.isnan(load_file(str(d / "model.safetensors"))["model.embed_tokens.weight"]).any()


def test_fifo_weights_do_not_hang_the_cli(capsys, model, tmp_path):
    import shutil

    from test_loading import fifo_watchdog

    d = tmp_path / "fifo"
    shutil.copytree(model, d)
    for name in ("model.safetensors", "tokenizer.json"):
        (d / name).unlink()
        os.mkfifo(d / name)
    with fifo_watchdog(d / "model.safetensors") as never_blocked, fifo_watchdog(d / "tokenizer.json"):
        rc_gen = cli.main(["generate", "hi", "--model", str(d), *FAST])
        rc_info = cli.main(["info", str(d), "--json"])  # reads headers and tokenizer.json, never a FIFO
        assert never_blocked(), "the CLI blocked opening a FIFO"
    out, err = capsys.readouterr()
    assert (rc_gen, rc_info) == (2, 0), err
    assert "model.safetensors" in err and "not a regular file" in err and json.loads(out)["dtype"] == "float32"


def test_info_reads_the_dtype_from_the_safetensors_header(capsys, tmp_path):
    """Without torch_dtype in config.json, info names the stored dtype (safe_open reads the header)."""
    d = build_tiny_checkpoint(tmp_path / "bf16", seed=1, dtype=__import__("torch").bfloat16)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    (d / "config.json").write_text(json.dumps(cfg))
    rc, out, err = run(capsys, "info", d, "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["dtype"] == "bfloat16" and info["mask_token"] == "<|mask|>"
