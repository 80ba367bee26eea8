"""FSDP2 (`run.parallel = "fsdp"`) on 2 CPU ranks over gloo, micro config.

One torchrun launch (`fsdp_worker.py`) runs every 2-rank job; the checks read its losses and
checkpoints:
- the FSDP loss sequence equals DDP's over 5 steps, both stages (AR with grad_accum 2; stage 2 with
  the separately clipped gains), within rtol 1e-5 (measured: <= ~1e-7 relative);
- activation checkpointing changes nothing (same tolerance);
- resume from a DCP checkpoint equals the uninterrupted FSDP run exactly;
- `clover train export` gathers the shards into a model dir that `clover.load` reads with the same
  logits as the full state gathered from the shards in the run;
- a 2-rank checkpoint on 1 rank is refused (clear error) unless --reset-data, which reshards it.

Opt-in figure (`CLOVER_FSDP_RSS=1`): peak RSS per rank, FSDP vs DDP, on a ~200M-parameter config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

from clover.tiny import tiny_config
from clover.tokenizer import write_byte_tokenizer
from clover.cli.train import main as train_main
from clover.train.recipes import RecipeError, recipe_from_dict
from clover.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import MICRO_MODEL, micro_raw  # noqa: E402

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
RTOL = 1e-5


def launch(spec: dict, tmp: Path, *, nproc: int = 2, timeout: int = 300) -> list:
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), str(tmp / "spec.json"), str(tmp / "out.json")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
        proc.communicate()
        pytest.fail("torchrun launch timed out")
    assert proc.returncode == 0, err[-4000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every 2-rank job in one launch; returns (root, {job name: per-rank results})."""
    root = tmp_path_factory.mktemp("fsdp")
    tok = root / "tok"
    write_byte_tokenizer(tok)
    cache = root / "cache"
    jobs, names = [], []

    def add(name, stage, parallel, steps=5, accum=1, **extra):
        raw = micro_raw(tok, cache, root / extra.pop("dir", name), stage=stage, steps=6, parallel=parallel,
                        **extra.pop("run", {}))
        raw["optim"]["grad_accum"] = accum
        raw["diffusion"]["shared_block_size"] = True  # FSDP implies it; DDP takes it to compare
        jobs.append({"raw": raw, "steps": steps, **extra})
        names.append(name)

    add("ar-ddp", "ar", "ddp", accum=2, resume=False)
    add("ar-fsdp", "ar", "fsdp", accum=2, resume=False)
    add("ar-fsdp-ac", "ar", "fsdp", accum=2, resume=False, run={"activation_checkpointing": True})
    add("diff-ddp", "diffusion", "ddp", resume=False)
    add("diff-fsdp", "diffusion", "fsdp", steps=6, resume=False, gather_to=str(root / "full.safetensors"))
    add("diff-fsdp-part1", "diffusion", "fsdp", steps=3, resume=False, dir="split")
    add("diff-fsdp-part2", "diffusion", "fsdp", steps=None, resume=True, dir="split")
    add("diff-fsdp-bf16", "diffusion", "fsdp", resume=False, run={"fsdp_mixed_precision": "bf16"})
    results = launch({"jobs": jobs}, root)
    return root, dict(zip(names, results)), tok, cache


def losses(res) -> torch.Tensor:
    return torch.tensor([r["losses"] for r in res], dtype=torch.float64)  # [rank, step]


@pytest.mark.parametrize("stage", ["ar", "diff"])
def test_fsdp_losses_equal_ddp(runs, stage):
    _, res, _, _ = runs
    ddp, fsdp = losses(res[f"{stage}-ddp"]), losses(res[f"{stage}-fsdp"])[:, :5]
    assert ddp.shape == (2, 5)
    assert not torch.equal(ddp[0], ddp[1])  # the ranks read different data
    print(f"\n{stage} losses (rank 0) ddp {ddp[0].tolist()}\n{stage} losses (rank 0) fsdp {fsdp[0].tolist()}\n"
          f"max relative difference {float(((fsdp - ddp).abs() / ddp.abs()).max()):.2e}")
    torch.testing.assert_close(fsdp, ddp, rtol=RTOL, atol=0)
    if stage == "diff":  # the gains are clipped on their own, with the global norm of their shards
        g_ddp = torch.tensor([r["gain_grad_norms"] for r in res["diff-ddp"]])
        g_fsdp = torch.tensor([r["gain_grad_norms"][:5] for r in res["diff-fsdp"]])
        torch.testing.assert_close(g_fsdp, g_ddp, rtol=1e-4, atol=0)
        assert torch.equal(g_fsdp[0], g_fsdp[1])  # one global norm, the same on every rank
    else:
        torch.testing.assert_close(losses(res["ar-fsdp-ac"]), losses(res["ar-fsdp"]), rtol=RTOL, atol=0)


def test_fsdp_bf16_mixed_precision_trains(runs):
    _, res, _, _ = runs
    bf16, fp32 = losses(res["diff-fsdp-bf16"]), losses(res["diff-fsdp"])[:, :5]
    assert torch.isfinite(bf16).all()
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=0.05)  # bf16 compute, fp32 master weights and reduction


def test_fsdp_resume_from_dcp_equals_uninterrupted(runs):
    root, res, _, _ = runs
    full = losses(res["diff-fsdp"])
    split = torch.cat([losses(res["diff-fsdp-part1"]), losses(res["diff-fsdp-part2"])], 1)
    torch.testing.assert_close(split, full, rtol=0, atol=0)
    ck = root / "split" / "ckpt" / "step-00000006"
    state = json.loads((ck / "trainer.json").read_text())
    assert state["format"] == "dcp" and state["world_size"] == 2 and len(state["ranks"]) == 2
    assert (ck / "dcp" / ".metadata").is_file() and len(list((ck / "dcp").glob("*.distcp"))) == 2
    assert not (ck / "model.safetensors").exists()  # no rank ever wrote the full model
    assert [d.name for d in sorted((root / "split" / "ckpt").iterdir())] == ["step-00000003", "step-00000006"]


def test_export_gathers_shards(runs, tmp_path):
    import clover

    root, _, _, _ = runs
    ck = root / "diff-fsdp" / "ckpt" / "step-00000006"
    assert train_main(["export", str(ck), str(tmp_path / "m32"), "--dtype", "float32"]) == 0
    llm = clover.load(tmp_path / "m32")
    gathered = load_file(str(root / "full.safetensors"))
    ref = type(llm.model)(llm.model.config)
    ref.load_state_dict(gathered, strict=True)
    ref.eval()
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(llm.model(ids), ref(ids), rtol=0, atol=0)
    assert (tmp_path / "m32" / "tokenizer.json").is_file()
    assert train_main(["export", str(ck), str(tmp_path / "m16")]) == 0  # the default: bf16
    from clover.checkpoint import load_model

    assert load_model(tmp_path / "m16").dtype == torch.bfloat16  # stored in bf16 (clover.load may upcast on a CPU)


def test_other_world_size(runs, tmp_path):
    """2 ranks -> 1: refused with a clear error; --reset-data reshards weights and optimizer (DCP)."""
    root, res, tok, cache = runs
    raw = micro_raw(tok, cache, root / "split", stage="diffusion", steps=7, parallel="fsdp")
    raw["diffusion"]["shared_block_size"] = True
    with pytest.raises(ValueError, match=r"written by 2 ranks; this run has 1.*--reset-data"):
        Trainer(recipe_from_dict(raw), quiet=True)
    t = Trainer(recipe_from_dict(raw), quiet=True, reset_data=True)
    assert t.step == 6
    full = load_file(str(root / "full.safetensors"))  # the uninterrupted run = the split one at step 6
    for n, p in t.model.state_dict().items():
        assert torch.equal(p, full[n]), n
    exp_avg = t.opt.state[t.params[0]]["exp_avg"]
    assert exp_avg.shape == t.params[0].shape and exp_avg.abs().sum() > 0  # optimizer state, resharded to one rank
    assert len(t.train()) == 1
    # the other format is refused, not misread
    raw["run"]["parallel"] = "ddp"
    with pytest.raises(ValueError, match="is a dcp checkpoint.*resume it with run.parallel = fsdp"):
        Trainer(recipe_from_dict(raw), quiet=True)


def test_recipe_parallel_keys():
    assert recipe_from_dict({"model": {"a": 1}}).run.parallel == "ddp"
    r = recipe_from_dict({"model": {"a": 1}, "run": {"parallel": "fsdp", "fsdp_mixed_precision": "bf16"}})
    assert r.run.parallel == "fsdp" and not r.run.fsdp_cpu_offload
    with pytest.raises(RecipeError, match="run.parallel"):
        recipe_from_dict({"model": {"a": 1}, "run": {"parallel": "zero3"}})
    with pytest.raises(RecipeError, match="need run.parallel = 'fsdp'"):
        recipe_from_dict({"model": {"a": 1}, "run": {"fsdp_mixed_precision": "bf16"}})


# ----------------------------------------------------------------------------- opt-in figure
RSS_MODEL = dict(  # ~200M parameters: 12 layers of hidden 768, 8 experts of 768 (top-2)
    vocab_size=264, hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
    shared_expert_intermediate_size=768, max_position_embeddings=512,
)


@pytest.mark.skipif(not os.environ.get("CLOVER_FSDP_RSS"), reason="opt-in figure: CLOVER_FSDP_RSS=1")
def test_peak_rss_fsdp_vs_ddp(tmp_path):
    tok = tmp_path / "tok"
    write_byte_tokenizer(tok)
    cfg = tiny_config(**RSS_MODEL)
    from clover.models import parameter_counts

    params = parameter_counts(cfg)["total"]
    figures = {}
    for parallel in ("ddp", "fsdp"):
        raw = micro_raw(tok, tmp_path / "cache", tmp_path / parallel, steps=3, parallel=parallel)
        raw["model"] = {k: v for k, v in cfg.to_dict().items() if k != "architectures"}
        raw["data"].update(seq_len=64, batch_size=2)
        res = launch({"jobs": [{"raw": raw, "steps": 3, "resume": False}]}, tmp_path, timeout=900)[0]
        figures[parallel] = [round(r["peak_rss_mb"]) for r in res]
    print(f"\nparams {params / 1e6:.1f}M  peak RSS per rank (MB): {figures}")
    assert max(figures["fsdp"]) < max(figures["ddp"])


# ----------------------------------------------------------------------------- plan
def test_plan_figures(tmp_path, capsys):
    from clover.train import plan as plan_mod

    raw = {"name": "big", "stage": "diffusion", "model": {"vocab_size": 264, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "mask_token_id": 3}, "data": {"seq_len": 64, "batch_size": 8}}
    (tmp_path / "r.json").write_text(json.dumps(raw))
    r = recipe_from_dict(raw)
    kw = dict(gpus=8, model="qwen3.6-35b-a3b", micro_batch=1)
    ddp = plan_mod.plan(r, **kw)
    r.run.parallel = "fsdp"
    fsdp = plan_mod.plan(r, **kw)
    assert 34e9 < ddp.params < 36e9 and 3e9 < ddp.active < 4e9  # Qwen3.6-35B-A3B
    assert fsdp.memory_gb["optimizer"] == pytest.approx(ddp.memory_gb["optimizer"] / 8)
    assert ddp.memory_gb["optimizer"] == pytest.approx(8 * ddp.params / 1e9)  # AdamW: 2 fp32 moments
    assert fsdp.tokens_per_s == pytest.approx(ddp.tokens_per_s) and fsdp.days == pytest.approx(1e9 / fsdp.tokens_per_s / 86400)
    r.run.activation_checkpointing = True
    assert plan_mod.plan(r, **kw).memory_gb["activations"] < fsdp.memory_gb["activations"] / 5
    from clover.cli.train import main as train_main

    assert train_main(["plan", str(tmp_path / "r.json"), "--gpus", "2", "--set", "run.parallel=fsdp"]) == 0
    out = capsys.readouterr().out
    assert "per-rank memory" in out and "fits in 80 GB" in out and "tokens/s" in out and "days" in out
    assert train_main(["plan", str(tmp_path / "r.json"), "--gpus", "16"]) == 2  # 8 rows over 16 GPUs
    assert "--micro-batch" in capsys.readouterr().err


def test_train_cli_plan_and_parallel_flag(capsys, tmp_path):
    from clover.cli.train import main as train_main

    rc = train_main(["plan", str(RECIPES / "clover-tiny-diffusion-tasks.toml"), "--model", "qwen3.6-35b-a3b", "--gpus", "16",
                     "--micro-batch", "1", "--set", "data.seq_len=4096", "--set", "run.parallel=fsdp",
                     "--set", "run.activation_checkpointing=true"])
    assert rc == 0 and "per-rank memory" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_main([str(RECIPES / "clover-tiny-ar.toml"), "--parallel", "zero3"])


# ----------------------------------------------------------------------------- start on meta
def test_fsdp_from_a_model_directory_starts_on_meta(tmp_path):
    """FSDP from `init` (a model directory) builds on meta, shards, and each rank reads only its
    shards (`parallel.load_shards`): the same losses as DDP from the same directory, both from a
    Clover directory and from an AR one converted in memory (the Clover parameters at their initial
    values); and from the Clover weights stored per expert over several shard files (as Qwen's releases
    store them: stacked a layer at a time), the same losses as DDP from the fused directory."""
    from clover.checkpoint import save_model
    from clover.models import build_model
    from clover.weights import save_state_dict

    cache = tmp_path / "cache"
    dirs = {}
    for kind in ("clover", "ar"):
        cfg = tiny_config(clover=kind == "clover", **MICRO_MODEL)
        model = build_model(cfg, device="cpu")
        model.init_weights(seed=5)
        d = tmp_path / kind
        save_model(model, d)
        write_byte_tokenizer(d)
        dirs[kind] = d
    per_expert = {}
    for k, v in load_file(str(dirs["clover"] / "model.safetensors")).items():
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                per_expert[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter].clone()
                per_expert[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                per_expert[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            per_expert[k] = v
    pe = tmp_path / "clover-per-expert"
    total = sum(v.numel() * v.element_size() for v in per_expert.values())
    save_state_dict(per_expert, pe, max_shard_bytes=total // 2 + 1)
    assert len(list(pe.glob("*.safetensors"))) >= 2
    for f in dirs["clover"].iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (pe / f.name).write_bytes(f.read_bytes())
    jobs, names = [], []
    for kind, d in [*dirs.items(), ("clover-per-expert", pe)]:
        for parallel in (("ddp", "fsdp") if kind in dirs else ("fsdp",)):
            raw = micro_raw(d, cache, tmp_path / f"{kind}-{parallel}", stage="diffusion", steps=4, parallel=parallel)
            raw.pop("model")
            raw["init"] = str(d)
            raw["diffusion"]["shared_block_size"] = True
            jobs.append({"raw": raw, "steps": 4, "resume": False})
            names.append(f"{kind}-{parallel}")
    res = dict(zip(names, launch({"jobs": jobs}, tmp_path, timeout=600)))
    for kind in dirs:
        assert [r["meta_start"] for r in res[f"{kind}-fsdp"]] == [True, True]
        assert [r["meta_start"] for r in res[f"{kind}-ddp"]] == [False, False]
        torch.testing.assert_close(losses(res[f"{kind}-fsdp"]), losses(res[f"{kind}-ddp"]), rtol=RTOL, atol=0)
    assert [r["meta_start"] for r in res["clover-per-expert-fsdp"]] == [True, True]
    torch.testing.assert_close(losses(res["clover-per-expert-fsdp"]), losses(res["clover-ddp"]), rtol=RTOL, atol=0)


@pytest.mark.skipif(not os.environ.get("CLOVER_FSDP_RSS"), reason="opt-in figure: CLOVER_FSDP_RSS=1")
def test_meta_start_peak_rss(tmp_path):
    """Peak RSS per rank at start (model built, loaded, sharded) and after 2 steps, from a ~200M
    model directory: one process, DDP on 2 ranks, FSDP whole-then-shard, FSDP meta start."""
    from clover.checkpoint import save_model
    from clover.models import build_model, parameter_counts

    cfg = tiny_config(**RSS_MODEL)
    model = build_model(cfg, device="cpu")
    model.init_weights(seed=0)
    init = tmp_path / "init"
    save_model(model, init)
    write_byte_tokenizer(init)
    del model
    figures = {}
    for name, nproc, parallel, extra in (("1 process", 1, "ddp", {}), ("ddp x2", 2, "ddp", {}),
                                         ("fsdp x2, whole then shard", 2, "fsdp", {"no_meta_start": True}),
                                         ("fsdp x2, meta start", 2, "fsdp", {})):
        raw = micro_raw(init, tmp_path / "cache", tmp_path / name.replace(" ", "_").replace(",", ""), stage="diffusion",
                        steps=2, parallel=parallel)
        raw.pop("model")
        raw["init"] = str(init)
        raw["data"].update(seq_len=64, batch_size=2)
        raw["diffusion"].update(block_sizes=[16], shared_block_size=True)
        res = launch({"jobs": [{"raw": raw, "steps": 2, "resume": False, **extra}]}, tmp_path, nproc=nproc, timeout=1800)[0]
        figures[name] = {"start": [round(r["peak_rss_start_mb"]) for r in res], "after 2 steps": [round(r["peak_rss_mb"]) for r in res],
                         "meta_start": res[0]["meta_start"]}
    print(f"\nparams {parameter_counts(cfg)['total'] / 1e6:.1f}M, peak RSS per rank (MB):")
    for k, v in figures.items():
        print(f"  {k}: {v}")
    assert max(figures["fsdp x2, meta start"]["start"]) < max(figures["fsdp x2, whole then shard"]["start"])
