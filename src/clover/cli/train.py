"""`clover train ...`: a recipe or a run directory (train), `export`, `plot`, `plan`, `evaluate` and `tokenizer`: the
arguments of each and the dispatch to `clover.train` (also `torchrun --nproc_per_node N -m clover train RECIPE`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .common import UsageError


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="RECIPE [--out DIR] [--steps N] [--resume|--no-resume] [--set KEY=VALUE]... | RUN_DIR | export CKPT OUT | plot RUN_DIR... "
                        "| plan RECIPE --gpus N | evaluate CKPT | tokenizer OUT_DIR (see docs/training.md; `clover train -- --help` for all options)")


def run(args: argparse.Namespace) -> int:
    argv = [a for a in args.train_args if a != "--"] if args.train_args[:1] == ["--"] else list(args.train_args)
    if not argv:
        raise UsageError("give a recipe file (e.g. recipes/clover-tiny-ar.toml) or a run directory")
    return main(argv)


def _overrides(p: argparse.ArgumentParser, items: list[str]) -> dict:
    """`--set KEY=VALUE` items -> {dotted key: value} (JSON where it parses, else the string)."""
    out = {}
    for item in items:
        if "=" not in item:
            p.error(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main(argv: list[str]) -> int:
    """The `clover train` arguments (after `train`): a sub-command (export, plot, plan, evaluate, tokenizer) or a run."""
    sub = {"export": _export, "plot": _plot, "plan": _plan, "evaluate": _evaluate, "tokenizer": _tokenizer}.get(argv[0])
    return sub(argv[1:]) if sub else _train(argv)


def _export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clover train export", description="checkpoint -> model directory (bf16 by default)")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokenizer", default=None)
    a = p.parse_args(argv)
    from ..train.trainer import export_model

    print(export_model(a.ckpt, a.out, dtype=a.dtype, tokenizer=a.tokenizer))
    return 0


def _plot(argv: list[str]) -> int:
    from .common import extra_hint

    try:
        import matplotlib  # noqa: F401  (the plot is all this command makes)
    except ModuleNotFoundError:
        raise UsageError(f"train plot: matplotlib is not installed; {extra_hint('plot')}") from None
    p = argparse.ArgumentParser(prog="clover train plot", description="loss and held-out task curves from run directories")
    p.add_argument("runs", nargs="+", help="run directories (holding log.jsonl)")
    p.add_argument("--out", default="training-curves.png", help="image path (PNG/SVG/PDF by suffix)")
    p.add_argument("--chain", action="store_true", help="the runs are consecutive phases of one model: lay them end to end")
    p.add_argument("--labels", default=None, help="comma-separated names for the runs (default: directory names)")
    p.add_argument("--title", default=None)
    p.add_argument("--smooth", type=int, default=5, help="moving-average window over logged records (1 = raw)")
    a = p.parse_args(argv)
    from ..train.plot import plot_runs, read_run_log

    try:
        runs = [read_run_log(r) for r in a.runs]
        if a.labels:
            labels = a.labels.split(",")
            if len(labels) != len(runs):
                p.error(f"--labels has {len(labels)} names for {len(runs)} runs")
            for r, lab in zip(runs, labels):
                r.name = lab
        if not any(r.train or r.evals for r in runs):
            p.error("the logs hold no records yet")
        if a.smooth < 1:
            p.error("--smooth must be >= 1")
        print(plot_runs(runs, a.out, chain=a.chain, title=a.title, smooth=a.smooth))
    except (OSError, ValueError) as e:
        print(f"clover train plot: {e}", file=sys.stderr)
        return 2
    return 0


def _plan(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clover train plan", description="memory, speed and days of a training run, on paper")
    p.add_argument("recipe", help="recipe file (.toml/.json) or a run directory holding recipe.json")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (ranks)")
    p.add_argument("--gpu-mem", type=float, default=80.0, help="memory per GPU in GB (default 80)")
    p.add_argument("--mfu", type=float, default=0.25, help="assumed model-FLOPs utilisation (default 0.25)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak bf16 dense TFLOPS per GPU (default 989: H100 SXM)")
    p.add_argument("--tokens", type=float, default=1e9, help="token budget for the days figure (default 1e9)")
    p.add_argument("--model", default=None,
                   help="a config.json or model dir, or qwen3.6-35b-a3b (clover.models.qwen3_5_moe.full_size_config()); "
                        "default: the recipe's [model] or init")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per rank per forward (default data.batch_size / (gpus x grad_accum))")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. run.parallel=fsdp, data.seq_len=4096")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = p.parse_args(argv)
    overrides = _overrides(p, a.set)
    from ..train.plan import format_plan, plan
    from ..train.recipes import RecipeError, load_run

    try:
        recipe = load_run(a.recipe, overrides)
        if a.gpus < 1 or a.gpu_mem <= 0 or not 0 < a.mfu <= 1:
            raise ValueError("--gpus must be >= 1, --gpu-mem > 0 and --mfu in (0, 1]")
        figures = plan(recipe, gpus=a.gpus, gpu_mem_gb=a.gpu_mem, mfu=a.mfu, peak_tflops=a.peak_tflops,
                       tokens=a.tokens, model=a.model, micro_batch=a.micro_batch)
    except (RecipeError, OSError, ValueError, json.JSONDecodeError) as e:
        print(f"clover train plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(figures.to_dict(), indent=1) if a.json else format_plan(figures, recipe, a.gpu_mem, a.mfu, a.peak_tflops))
    return 0


def _evaluate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clover train evaluate",
                                description="quick held-out metrics of a checkpoint, teacher-forced (one forward per batch)")
    p.add_argument("model", help="model directory or training checkpoint (config.json + model.safetensors)")
    p.add_argument("--tokenizer", default=None, help="default: the model dir, or <run>/tokenizer for a checkpoint")
    p.add_argument("--tasks", type=int, default=500)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    from .common import positive

    for flag, value in (("--tasks", a.tasks), ("--batches", a.batches), ("--threads", a.threads)):
        positive(flag, value)
    if not Path(a.model).is_dir():
        raise FileNotFoundError(f"{a.model}: no such model directory or checkpoint")
    import torch

    from ..train.evaluate import evaluate, find_tokenizer

    tokenizer = a.tokenizer or find_tokenizer(a.model)
    if tokenizer is None:
        raise UsageError(f"{a.model}: no tokenizer found (neither in the directory nor, for a checkpoint, in "
                         "<run>/tokenizer); pass --tokenizer DIR")
    torch.set_num_threads(a.threads)
    print(json.dumps(evaluate(a.model, tokenizer, tasks=a.tasks, batches=a.batches, threshold=a.threshold), indent=1))
    return 0


def _tokenizer(argv: list[str]) -> int:
    from ..data import tokenizer as t

    p = argparse.ArgumentParser(prog="clover train tokenizer",
                                description="train clover's byte-level BPE tokenizer on the stdlib + task lines (deterministic)")
    p.add_argument("out_dir", help="directory to write tokenizer.json and its config into")
    p.add_argument("--vocab-size", type=int, default=t.DEFAULT_VOCAB_SIZE, metavar="N", help=f"(default: {t.DEFAULT_VOCAB_SIZE})")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="shuffles the training texts (default: 0)")
    p.add_argument("--max-chars", type=int, default=t.DEFAULT_MAX_CHARS, metavar="N",
                   help=f"characters of stdlib source to train on (default: {t.DEFAULT_MAX_CHARS})")
    p.add_argument("--task-lines", type=int, default=t.DEFAULT_TASK_LINES, metavar="N",
                   help=f"task lines added to the texts (default: {t.DEFAULT_TASK_LINES})")
    a = p.parse_args(argv)
    if a.vocab_size < len(t.SPECIAL_TOKENS) + 256:
        p.error(f"--vocab-size must hold the {len(t.SPECIAL_TOKENS)} special tokens and the 256 bytes "
                f"(at least {len(t.SPECIAL_TOKENS) + 256}), got {a.vocab_size}")
    tok = t.train_tokenizer(a.out_dir, vocab_size=a.vocab_size, seed=a.seed, max_chars=a.max_chars, n_task_lines=a.task_lines)
    print(json.dumps({"vocab_size": tok.get_vocab_size(), "special_token_ids": t.special_token_ids(tok)}))
    return 0


def _train(argv: list[str]) -> int:
    from ..train.recipes import DEVICES, PARALLEL, RecipeError, load_run

    p = argparse.ArgumentParser(prog="clover train", description="train a clover model from a recipe (.toml/.json) or continue a run directory")
    p.add_argument("recipe", help="recipe file, or a run directory holding recipe.json")
    p.add_argument("--out", default=None, help="run directory (default: [run].out or ${CLOVER_RUNS:-~/.cache/clover/runs}/<name>)")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides optim.steps)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", default=None, help="require a checkpoint to resume from")
    g.add_argument("--no-resume", dest="resume", action="store_false", help="start fresh even if checkpoints exist")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key, e.g. optim.lr=1e-3")
    p.add_argument("--reset-data", action="store_true",
                   help="on resume, start a fresh data stream instead of restoring it (needed after changing [data], "
                        "e.g. --set data.task_fraction=0.9 --set data.seed=7 for an annealing phase)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="run.device: auto (CUDA when available), cpu or cuda (one GPU per torchrun rank)")
    p.add_argument("--parallel", choices=PARALLEL, default=None,
                   help="run.parallel: ddp (full replicas) or fsdp (FSDP2 shards + distributed checkpoints)")
    p.add_argument("--quiet", action="store_true", help="no status lines or progress bars")
    a = p.parse_args(argv)
    overrides = _overrides(p, a.set)
    for key, value in (("run.out", a.out), ("optim.steps", a.steps), ("run.threads", a.threads),
                       ("run.device", a.device), ("run.parallel", a.parallel)):
        if value:
            overrides[key] = value
    try:
        recipe = load_run(a.recipe, overrides)
    except (RecipeError, OSError, json.JSONDecodeError) as e:
        print(f"clover train: {e}", file=sys.stderr)
        return 2
    if recipe.run.progress and not a.quiet and os.environ.get("RANK", "0") == "0":  # before torch's import (seconds)
        print(f"clover train: {recipe.name}, stage {recipe.stage}, {recipe.optim.steps} steps, run directory "
              f"{recipe.out_dir}\nclover train: loading torch", file=sys.stderr, flush=True)
    from ..train.trainer import Trainer

    trainer = Trainer(recipe, resume=a.resume, quiet=a.quiet, reset_data=a.reset_data)
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0
