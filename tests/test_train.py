"""Fast tests of clover.train: recipes, losses, the trainer, exact resume, 2-process gloo, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clover.tiny import tiny_config
from clover.tokenizer import write_byte_tokenizer
from clover.cli.train import main as train_main
from clover.train import losses
from clover.train.recipes import RecipeError, load_recipe, recipe_from_dict, runs_root
from clover.train.trainer import Trainer, lr_at, resolve_device

MICRO_MODEL = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("datacache")


def micro_raw(tok, cache, out, *, stage="ar", steps=6, **run) -> dict:
    cfg = tiny_config(**MICRO_MODEL).to_dict()
    cfg.pop("architectures", None)
    return {
        "name": "micro",
        "stage": stage,
        "seed": 3,
        "model": cfg,
        "data": {"tokenizer": str(tok), "seq_len": 32, "batch_size": 4, "task_fraction": 0.5,
                 "cache_dir": str(cache), "max_files": 3},
        "optim": {"lr": 3e-3, "steps": steps, "warmup_steps": 2, "aux_loss_coef": 0.01},
        "diffusion": {"block_sizes": [8, 16]},
        "run": {"out": str(out), "threads": 1, "log_every": 1, "ckpt_every_s": 0, "progress": False, **run},
    }


# ----------------------------------------------------------------------------- recipes
def test_recipe_toml_and_errors(tmp_path, byte_tok):
    p = tmp_path / "r.toml"
    p.write_text(
        'name = "x"\nstage = "ar"\n[model]\nvocab_size = 264\n[data]\nseq_len = 64\n[optim]\nsteps = 5\nbetas = [0.9, 0.99]\n'
    )
    r = load_recipe(p, {"optim.lr": 1e-3})
    assert r.optim.steps == 5 and r.optim.lr == 1e-3 and r.optim.betas == (0.9, 0.99)
    assert r.data.seq_len == 64 and r.run.threads >= 1
    with pytest.raises(RecipeError, match="unknown key"):
        recipe_from_dict({"model": {"a": 1}, "optim": {"lrr": 1}})
    with pytest.raises(RecipeError, match="stage"):
        recipe_from_dict({"model": {"a": 1}, "stage": "foo"})
    with pytest.raises(RecipeError, match="autocast"):
        recipe_from_dict({"model": {"a": 1}, "run": {"autocast": "fp8"}})
    with pytest.raises(RecipeError, match="run.device"):
        recipe_from_dict({"model": {"a": 1}, "run": {"device": "tpu"}})
    with pytest.raises(RecipeError, match="divide"):
        recipe_from_dict({"model": {"a": 1}, "stage": "diffusion", "data": {"seq_len": 40}})


def test_bundled_recipes_parse(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_RUNS", str(tmp_path / "runs"))  # not the user's real runs
    root = Path(__file__).resolve().parents[1] / "recipes"
    found = sorted(root.glob("*.toml")) + sorted(root.glob("*.json"))
    assert found
    for p in found:
        r = load_recipe(p)
        if r.model:
            from clover.models import config_from_dict

            cfg = config_from_dict({**r.model, "model_type": r.model.get("model_type", "clover")})
            from clover.models import parameter_counts

            assert parameter_counts(cfg)["total"] * 2 <= 25 * 2**20


SHIPPED_RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED_RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_has_no_machine_path(path):
    """Shipped recipes name paths relative to the recipe or under the run root (`${runs}`), never a
    path of the machine they were written on."""
    tomllib = pytest.importorskip("tomllib")

    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    text = path.read_text()
    for value in strings(tomllib.loads(text)):
        assert not Path(value).is_absolute() and not value.startswith("~"), f"{path.name}: {value!r}"
    for machine in ("/work/", "/home/", "/root/", "/Users/", "/tmp/"):
        assert machine not in text, f"{path.name} mentions {machine}"


def _fake_checkpoint(run: Path, step: int) -> Path:
    d = run / "ckpt" / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "trainer.json").write_text("{}")
    return d


def test_recipe_run_root_and_init(tmp_path, monkeypatch):
    monkeypatch.delenv("CLOVER_RUNS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert runs_root() == tmp_path / "cache" / "clover" / "runs"
    r = recipe_from_dict({"name": "x", "model": {"a": 1}})
    assert r.out_dir == tmp_path / "cache" / "clover" / "runs" / "x"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert runs_root() == Path.home() / ".cache" / "clover" / "runs"

    runs = tmp_path / "runs"
    monkeypatch.setenv("CLOVER_RUNS", str(runs))
    assert recipe_from_dict({"name": "x", "model": {"a": 1}}).out_dir == runs / "x"
    r = recipe_from_dict({"name": "x", "model": {"a": 1}, "run": {"out": "${runs}/y"},
                          "data": {"tokenizer": "${runs}/a/tokenizer"}})
    assert r.out_dir == runs / "y" and r.data.tokenizer == str(runs / "a" / "tokenizer")

    # init naming a run directory means its newest finished checkpoint; a checkpoint dir is itself
    _fake_checkpoint(runs / "a", 3)
    newest = _fake_checkpoint(runs / "a", 10)
    (runs / "a" / "ckpt" / "step-00000020").mkdir()  # unfinished (no trainer.json): ignored
    assert recipe_from_dict({"init": "${runs}/a"}).init == str(newest)
    assert recipe_from_dict({"init": "${runs}/a/ckpt/step-00000003"}).init == str(runs / "a" / "ckpt" / "step-00000003")
    (runs / "b" / "ckpt").mkdir(parents=True)
    with pytest.raises(RecipeError, match="without a finished checkpoint"):
        recipe_from_dict({"init": "${runs}/b"})
    # the shipped chain: phase 2 starts from phase 1's newest checkpoint, with phase 1's tokenizer
    first = _fake_checkpoint(runs / "clover-tiny-ar", 1572)
    r = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "clover-tiny-diffusion.toml")
    assert r.init == str(first) and r.data.tokenizer == str(runs / "clover-tiny-ar" / "tokenizer")
    assert r.out_dir == runs / "clover-tiny-diffusion"


def test_lr_schedules():
    r = recipe_from_dict({"model": {"a": 1}, "optim": {"lr": 1.0, "steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1}})
    assert lr_at(0, r) == pytest.approx(0.1) and lr_at(9, r) == pytest.approx(1.0)
    assert lr_at(99, r) == pytest.approx(0.1, abs=1e-3)
    r.optim.schedule = "wsd"
    r.optim.decay_fraction = 0.2
    assert lr_at(50, r) == 1.0 and lr_at(79, r) == 1.0 and lr_at(99, r) == pytest.approx(0.1)


def test_device_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu", 3)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", 1) == torch.device("cuda", 1)  # one GPU per torchrun rank
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 has no GPU"):
        resolve_device("cuda", 2)


# ----------------------------------------------------------------------------- losses
def test_router_aux_uniform_is_one():
    assert float(losses.router_aux_loss([torch.zeros(64, 8)], 2)) == pytest.approx(1.0, abs=0.3)
    skewed = torch.zeros(64, 8)
    skewed[:, 0] = 10.0
    skewed[:, 1] = 9.0
    assert float(losses.router_aux_loss([skewed], 2)) > 3.0


def test_masks_complementary_and_shift():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (3, 32))
    db = losses.make_masks(ids, 8, g, mask_token_id=2)
    assert db.clean.shape == (3, 32) and db.noisy.shape == (3, 64) and db.copies == 2
    assert torch.equal(db.mask[:, :32], ~db.mask[:, 32:])  # every token masked exactly once per pair
    assert torch.equal(db.noisy[db.mask], torch.full((int(db.mask.sum()),), 2))
    both = torch.cat([ids, ids], 1)
    assert torch.equal(db.noisy[~db.mask], both[~db.mask])
    # the fast gather equals the definition (loop over copies and masked positions)
    V = 50
    cl, nl = torch.randn(3, 32, V), torch.randn(3, 64, V)
    got, n = losses.masked_diffusion_ce(cl, nl, db.clean, db.mask, 8, reduction="sum")
    ref, m = 0.0, 0
    for b in range(3):
        for c in range(2):
            for j in range(1, 32):
                if db.mask[b, c * 32 + j]:
                    src = cl[b, j - 1] if j % 8 == 0 else nl[b, c * 32 + j - 1]
                    ref += float(torch.nn.functional.cross_entropy(src[None], ids[b, j][None]))
                    m += 1
    assert n == m and float(got) == pytest.approx(ref, rel=1e-5)
    # the packed form: noisy logits only where the loss reads them
    need = losses.noisy_sources(db.mask, 32, 8)
    assert int(need.sum()) == sum(1 for b in range(3) for c in range(2) for j in range(1, 32) if db.mask[b, c * 32 + j] and j % 8)
    got2, n2 = losses.masked_diffusion_ce(cl, nl[need], db.clean, db.mask, 8, reduction="sum")
    assert n2 == n and float(got2) == pytest.approx(float(got), rel=1e-6)


# ----------------------------------------------------------------------------- training
def _fixed_batch_losses(trainer: Trainer, steps: int) -> list[float]:
    ids = trainer.stream.next_batch()
    return [trainer.train_step(ids)["loss"] for _ in range(steps)]


def test_ar_loss_goes_down(tmp_path, byte_tok, cache_dir):
    r = recipe_from_dict(micro_raw(byte_tok, cache_dir, tmp_path / "run", steps=20))
    t = Trainer(r, resume=False, quiet=True)
    ls = _fixed_batch_losses(t, 20)
    assert ls[-1] < ls[0] - 1.0, ls
    # AR stage: the Clover-only parameters are frozen (unused in commit mode)
    frozen = [n for n, p in t.model.named_parameters() if not p.requires_grad]
    assert frozen and all(("conv1d_right" in n or "intra_scale" in n or "block_gain" in n) for n in frozen)


def test_grad_accum_equals_full_batch_for_ar(tmp_path, byte_tok, cache_dir):
    """Two micro-batches of 2 rows give the gradient one batch of 4 rows gives (AR without the router
    loss, which is not additive over micro-batches: mean of equal-size means)."""
    runs = []
    for accum in (1, 2):
        raw = micro_raw(byte_tok, cache_dir, tmp_path / f"run{accum}", steps=2)
        raw["optim"].update(grad_accum=accum, aux_loss_coef=0.0)
        t = Trainer(recipe_from_dict(raw), resume=False, quiet=True)
        ids = t.stream.next_batch()
        assert ids.shape[0] == 4  # the stream is the same whatever the accumulation
        grads = {}
        t.opt.step = lambda: grads.update({t.names[i]: p.grad.clone() for i, p in enumerate(t.params) if p.grad is not None})
        runs.append((t.train_step(ids), grads))
    (st1, g1), (st2, g2) = runs
    assert st1["loss"] == pytest.approx(st2["loss"], rel=1e-5) and st1["grad_norm"] == pytest.approx(st2["grad_norm"], rel=1e-4)
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-4, atol=1e-7, msg=n)
    with pytest.raises(RecipeError, match="grad_accum"):
        recipe_from_dict({"model": {"a": 1}, "data": {"batch_size": 6}, "optim": {"grad_accum": 4}})


@pytest.mark.parametrize("autocast", ["none", "bf16"])
def test_diffusion_loss_goes_down(tmp_path, byte_tok, cache_dir, autocast):
    r = recipe_from_dict(micro_raw(byte_tok, cache_dir, tmp_path / "run", stage="diffusion", steps=20, autocast=autocast))
    t = Trainer(r, resume=False, quiet=True)
    ids = t.stream.next_batch()
    first = last = None
    for i in range(20):
        st = t.train_step(ids)
        first = st if first is None else first
        last = st
    assert last["diff_loss"] < first["diff_loss"] - 0.5 and last["ar_loss"] < first["ar_loss"] - 0.5


@pytest.mark.parametrize("stage", ["ar", "diffusion"])
def test_resume_equals_uninterrupted(tmp_path, byte_tok, cache_dir, stage):
    full = Trainer(recipe_from_dict(micro_raw(byte_tok, cache_dir, tmp_path / "a", stage=stage, steps=6)), quiet=True)
    ref = [s["loss"] for s in full.train()]
    first = Trainer(recipe_from_dict(micro_raw(byte_tok, cache_dir, tmp_path / "b", stage=stage, steps=6)), quiet=True)
    part1 = [s["loss"] for s in first.train(steps=3)]  # stops after step 3 and checkpoints
    del first
    second = Trainer(recipe_from_dict(micro_raw(byte_tok, cache_dir, tmp_path / "b", stage=stage, steps=6)), quiet=True)
    assert second.step == 3
    part2 = [s["loss"] for s in second.train()]
    torch.testing.assert_close(torch.tensor(part1 + part2), torch.tensor(ref), rtol=0, atol=0)
    # checkpoints: safetensors + json only, newest `keep` kept, loadable as a model directory
    ck_root = tmp_path / "b" / "ckpt"
    dirs = sorted(ck_root.iterdir())
    assert [d.name for d in dirs] == ["step-00000003", "step-00000006"]
    for d in dirs:
        for f in d.iterdir():
            assert f.suffix in (".safetensors", ".json"), f
    lines = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, 7))


PHASES = ["micro, stage ar", "loading torch", "tokenizer: ", "model: building", "optimizer: AdamW", "data: "]


def test_cli_announces_each_phase(tmp_path, byte_tok, capsys):
    """`clover train` says what it is doing from its start: a status line per setup phase, a bar while a
    first run tokenises its data into the cache, then the training bar; `--quiet` silences them."""
    raw = micro_raw(byte_tok, tmp_path / "cache", tmp_path / "run", steps=1, progress=True)
    p = tmp_path / "r.json"
    p.write_text(json.dumps(raw))
    assert train_main([str(p), "--no-resume"]) == 0
    err = capsys.readouterr().err
    lines = [x.removeprefix("clover train: ") for x in err.splitlines() if x.startswith("clover train: ")]
    at = [next(i for i, x in enumerate(lines) if x.startswith(ph)) for ph in PHASES]
    assert at == sorted(at), lines
    assert "files into cache/" in err and "micro: 100%" in err  # the data cache's bar, the training bar
    assert train_main([str(p), "--no-resume", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_cli_first_line_comes_before_torch(tmp_path):
    """The first status line is printed before torch is imported (seconds on a CPU machine)."""
    raw = micro_raw(tmp_path / "no-tokenizer", tmp_path / "cache", tmp_path / "run", progress=True)
    p = tmp_path / "r.json"
    p.write_text(json.dumps(raw))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "clover", "train", str(p)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode != 0 and "no-tokenizer not found" in r.stderr  # it stops at the tokenizer
    lines = r.stderr.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("clover train: micro, stage ar"))
    torch_at = next(i for i, x in enumerate(lines) if x.startswith("import time:") and
                    x.rsplit("|", 1)[-1].strip().split(".")[0] == "torch")  # torch's first module
    assert first < torch_at, lines[first - 3 : first + 3]


def test_cli_and_export(tmp_path, byte_tok, cache_dir):
    raw = micro_raw(byte_tok, cache_dir, tmp_path / "run", steps=2, eval_every=2, eval_tasks=8)
    p = tmp_path / "r.json"
    p.write_text(json.dumps(raw))
    assert train_main([str(p), "--quiet"]) == 0
    ck = tmp_path / "run" / "ckpt" / "step-00000002"
    assert ck.is_dir()
    evals = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines() if '"eval"' in x]
    assert evals and evals[0]["eval"]["tasks"] == 8 and 0 <= evals[0]["eval"]["exact_match"] <= 1
    assert train_main([str(tmp_path / "run"), "--steps", "3", "--quiet", "--resume", "--device", "cpu"]) == 0  # continue from the run dir
    assert json.loads((tmp_path / "run" / "recipe.json").read_text())["run"]["device"] == "cpu"
    assert (tmp_path / "run" / "ckpt" / "step-00000003").is_dir()
    # an annealing phase with another data mix: the stream is rebuilt, everything else resumes
    assert train_main([str(tmp_path / "run"), "--steps", "4", "--quiet", "--reset-data",
                       "--set", "data.task_fraction=1.0", "--set", "data.seed=9"]) == 0
    st = json.loads((tmp_path / "run" / "ckpt" / "step-00000004" / "trainer.json").read_text())
    assert st["ranks"][0]["stream"]["config"]["task_fraction"] == 1.0 and st["ranks"][0]["stream"]["config"]["seed"] == 9000
    assert train_main(["export", str(tmp_path / "run" / "ckpt" / "step-00000004"), str(tmp_path / "model")]) == 0
    from clover.checkpoint import load_model

    m = load_model(tmp_path / "model")
    assert m.dtype == torch.bfloat16 and (tmp_path / "model" / "tokenizer.json").is_file()
    # --tokenizer pointing at another model's directory (the shipped model, say) takes its tokenizer
    # files only: the export keeps this checkpoint's weights and config
    ref = load_model(tmp_path / "run" / "ckpt" / "step-00000004", dtype=torch.float32)
    assert train_main(["export", str(tmp_path / "run" / "ckpt" / "step-00000003"), str(tmp_path / "other")]) == 0
    assert train_main(["export", str(tmp_path / "run" / "ckpt" / "step-00000004"), str(tmp_path / "model2"),
                       "--tokenizer", str(tmp_path / "other"), "--dtype", "float32"]) == 0
    got = load_model(tmp_path / "model2")
    for (name, a), (_, b) in zip(ref.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    assert sorted(f.name for f in (tmp_path / "model2").iterdir() if f.name.startswith("tokenizer")) == \
        ["tokenizer.json", "tokenizer_config.json"]


def test_two_process_gloo(tmp_path, byte_tok, cache_dir):
    raw = micro_raw(byte_tok, cache_dir, tmp_path / "run", steps=3)
    p = tmp_path / "r.json"
    p.write_text(json.dumps(raw))
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "clover", "train", str(p), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers
        proc.communicate()
        pytest.fail("2-process gloo run timed out")
    assert proc.returncode == 0, err[-3000:]
    state = json.loads((tmp_path / "run" / "ckpt" / "step-00000003" / "trainer.json").read_text())
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    assert state["ranks"][0]["stream"]["config"]["seed"] != state["ranks"][1]["stream"]["config"]["seed"]
    assert state["ranks"][0]["stream"]["config"]["batch_size"] == 2  # global batch 4 split over 2 ranks
    assert (tmp_path / "run" / "ckpt" / "step-00000003" / "rng-rank1.safetensors").is_file()


def test_plot_training_curves(tmp_path):
    from clover.train.plot import moving_average, read_run_log

    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "tokens": 100 * s, "ar_loss": 3.0 / s, "diff_loss": 4.0 / s} for s in (5, 10, 15)]
    recs.append({"step": 10, "eval": {"tasks": 8, "exact_match": 0.25, "answer_tokens_p>=0.95": 0.5}})
    recs.append({"step": 10, "tokens": 1000, "ar_loss": 0.123, "diff_loss": 0.5})  # re-logged after a resume: wins
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    log = read_run_log(run)
    assert [r["step"] for r in log.train] == [5, 10, 15] and log.train[1]["ar_loss"] == 0.123
    assert log.evals == [{"step": 10, "tokens": 1000, "tasks": 8, "exact_match": 0.25, "answer_tokens_p>=0.95": 0.5}]
    assert moving_average([1.0, 2.0, 3.0, 4.0], 3) == [1.5, 2.0, 3.0, 3.5] and moving_average([1.0, 5.0], 1) == [1.0, 5.0]
    out = tmp_path / "c.png"
    assert train_main(["plot", str(run), str(run), "--chain", "--labels", "a,b", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    assert train_main(["plot", str(tmp_path / "nope"), "--out", str(out)]) == 2  # a clear one-line error
    (run / "log.jsonl").write_text('{"step": 5, "tokens": 1')
    with pytest.raises(ValueError, match="truncated"):
        read_run_log(run)


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    from clover.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    assert main(["train", "plot", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "matplotlib is not installed" in err and "clover-dlm[plot]" in err, err
    assert not (tmp_path / "c.png").exists()


def test_evaluate_finds_the_tokenizer_or_says_so(tmp_path, capsys):
    from clover.cli import main
    from clover.train.evaluate import find_tokenizer

    run = tmp_path / "run"
    ckpt = run / "ckpt" / "step-00000001"
    ckpt.mkdir(parents=True)
    assert find_tokenizer(ckpt) is None
    assert main(["train", "evaluate", str(ckpt)]) == 2
    assert capsys.readouterr().err.strip() == (f"clover train: error: {ckpt}: no tokenizer found (neither in the directory "
                                               "nor, for a checkpoint, in <run>/tokenizer); pass --tokenizer DIR")
    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "tokenizer.json").write_text("{}")
    assert find_tokenizer(ckpt) == str(run / "tokenizer")  # a training checkpoint: its run's tokenizer
    for argv, what in ((["--tasks", "0"], "--tasks"), (["--batches", "0"], "--batches"), (["--threads", "0"], "--threads")):
        assert main(["train", "evaluate", str(ckpt), *argv]) == 2  # a count below 1 is one line, before loading
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and what in err and "positive" in err, err
    assert main(["train", "evaluate", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no such model directory" in err, err
