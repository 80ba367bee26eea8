"""`clover train ...`: hands its arguments to the trainer's own command line (`clover.train.main`,
also `python -m clover.train` for torchrun), which parses recipes, run directories, `export` and
`plot`."""

from __future__ import annotations

import argparse

from .common import UsageError


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="RECIPE [--out DIR] [--steps N] [--resume|--no-resume] [--set KEY=VALUE]... | RUN_DIR | export CKPT OUT | plot RUN_DIR... "
                        "(see docs/training.md; `clover train -- --help` for all options)")


def run(args: argparse.Namespace) -> int:
    from ..train import main as train_main

    argv = [a for a in args.train_args if a != "--"] if args.train_args[:1] == ["--"] else list(args.train_args)
    if not argv:
        raise UsageError("train: give a recipe file (e.g. recipes/clover-tiny-ar.toml) or a run directory")
    return train_main(argv)
