"""`clover train ...`: a recipe or a run directory (train), `export`, `plot` and `plan`
(`clover.train`; also `torchrun --nproc_per_node N -m clover train RECIPE`)."""

from __future__ import annotations

import argparse
import json
import sys

from .common import UsageError


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="RECIPE [--out DIR] [--steps N] [--resume|--no-resume] [--set KEY=VALUE]... | RUN_DIR | export CKPT OUT | plot RUN_DIR... "
                        "| plan RECIPE --gpus N (see docs/training.md; `clover train -- --help` for all options)")


def run(args: argparse.Namespace) -> int:
    argv = [a for a in args.train_args if a != "--"] if args.train_args[:1] == ["--"] else list(args.train_args)
    if not argv:
        raise UsageError("train: give a recipe file (e.g. recipes/clover-tiny-ar.toml) or a run directory")
    return main(argv)


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str]) -> int:
    """The `clover train` arguments (after `train`): a sub-command (export, plot, plan) or a run."""
    if argv[0] == "plot":
        from ..train.plot import main as plot_main
        from .common import extra_hint

        try:
            import matplotlib  # noqa: F401  (the plot is all this command makes)
        except ModuleNotFoundError:
            raise UsageError(f"train plot: matplotlib is not installed; {extra_hint('plot')}") from None
        try:
            return plot_main(argv[1:])
        except (OSError, ValueError) as e:
            print(f"clover train plot: {e}", file=sys.stderr)
            return 2
    if argv[0] == "export":
        p = argparse.ArgumentParser(prog="clover train export", description="checkpoint -> model directory (bf16 by default)")
        p.add_argument("ckpt")
        p.add_argument("out")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--tokenizer", default=None)
        a = p.parse_args(argv[1:])
        from ..train.trainer import export_model

        print(export_model(a.ckpt, a.out, dtype=a.dtype, tokenizer=a.tokenizer))
        return 0
    if argv[0] == "plan":
        from ..train import plan

        p = argparse.ArgumentParser(prog="clover train plan", description="memory, speed and days of a training run, on paper")
        plan.add_arguments(p)
        return plan.run(p.parse_args(argv[1:]))
    return _train(argv)


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
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    overrides = {}
    for item in a.set:
        if "=" not in item:
            p.error(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        overrides[k] = _parse_value(v)
    for key, value in (("run.out", a.out), ("optim.steps", a.steps), ("run.threads", a.threads),
                       ("run.device", a.device), ("run.parallel", a.parallel)):
        if value:
            overrides[key] = value
    try:
        recipe = load_run(a.recipe, overrides)
    except (RecipeError, OSError, json.JSONDecodeError) as e:
        print(f"clover train: {e}", file=sys.stderr)
        return 2
    from ..train.trainer import Trainer

    trainer = Trainer(recipe, resume=a.resume, quiet=a.quiet, reset_data=a.reset_data)
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0
