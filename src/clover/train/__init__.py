"""Training: recipes, the AR / block-diffusion trainer, checkpoints, export.

CLI (also `python -m clover.train`)::

    clover train RECIPE [--out DIR] [--steps N] [--resume | --no-resume] [--reset-data] [--set KEY=VALUE ...]
    clover train RUN_DIR                      # continue a run from its recipe.json
    clover train export CKPT OUT [--dtype bfloat16] [--tokenizer DIR]
    clover train plot RUN_DIR [RUN_DIR ...] [--out curves.png] [--chain]   # loss / held-out curves
    clover train plan RECIPE --gpus N [--gpu-mem 80] [--mfu 0.25] [--tokens 1e9] [--model CONFIG|qwen3.6-35b-a3b]
                      [--micro-batch B] [--set K=V] [--json]           # memory, speed and days, on paper

Multi-process: `torchrun --nproc_per_node N -m clover.train RECIPE` (gloo on CPU, nccl with one GPU
per rank when `run.device` / `--device` resolves to CUDA); `--parallel ddp` (full replicas) or
`--parallel fsdp` (FSDP2 shards and distributed checkpoints).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .recipes import DEVICES, PARALLEL, Recipe, RecipeError, load_recipe, recipe_from_dict

__all__ = ["main", "Recipe", "RecipeError", "load_recipe", "recipe_from_dict"]


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        from .plot import main as plot_main

        try:
            return plot_main(argv[1:])
        except (OSError, ValueError) as e:
            print(f"clover train plot: {e}", file=sys.stderr)
            return 2
    if argv and argv[0] == "export":
        p = argparse.ArgumentParser(prog="clover train export", description="checkpoint -> model directory (bf16 by default)")
        p.add_argument("ckpt")
        p.add_argument("out")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--tokenizer", default=None)
        a = p.parse_args(argv[1:])
        from .trainer import export_model

        out = export_model(a.ckpt, a.out, dtype=a.dtype, tokenizer=a.tokenizer)
        print(out)
        return 0
    if argv and argv[0] == "plan":
        from . import plan

        p = argparse.ArgumentParser(prog="clover train plan", description="memory, speed and days of a training run, on paper")
        plan.add_arguments(p)
        return plan.run(p.parse_args(argv[1:]))
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
    if a.out:
        overrides["run.out"] = a.out
    if a.steps:
        overrides["optim.steps"] = a.steps
    if a.threads:
        overrides["run.threads"] = a.threads
    if a.device:
        overrides["run.device"] = a.device
    if a.parallel:
        overrides["run.parallel"] = a.parallel
    src = Path(a.recipe)
    try:
        if src.is_dir():
            raw = json.loads((src / "recipe.json").read_text())
            raw.setdefault("run", {})["out"] = raw.get("run", {}).get("out") or str(src)
            from .recipes import apply_override

            for k, v in overrides.items():
                apply_override(raw, k, v)
            recipe = recipe_from_dict(raw, source=str(src / "recipe.json"))
        else:
            recipe = load_recipe(src, overrides)
    except (RecipeError, OSError, json.JSONDecodeError) as e:
        print(f"clover train: {e}", file=sys.stderr)
        return 2
    from .trainer import Trainer

    trainer = Trainer(recipe, resume=a.resume, quiet=a.quiet, reset_data=a.reset_data)
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0
