"""`clover tiny DIR`: a tiny random checkpoint (demos, bug reports, tests)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import DTYPE_CHOICES, UsageError, human

SHAPE_NAMES = ("tiny", "0.7b")  # clover.tiny.SHAPES, named here so that `--help` does not import torch


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="where to write the checkpoint")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--clover", dest="clover", action="store_true", default=True, help="a Clover (diffusion) checkpoint (default)")
    kind.add_argument("--ar", dest="clover", action="store_false", help="a plain AR (Qwen3.5-MoE) checkpoint, no mask token")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    p.add_argument("--shape", choices=SHAPE_NAMES, default="tiny",
                   help="tiny (default: ~0.2M parameters, for tests and bug reports) or 0.7b (Clover-35B-A3B's "
                        "layer shapes with 8 layers and 16 experts, ~0.75B parameters, for benchmarks: `clover bench peers`)")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import parse_dtype
    from ..tiny import build_tiny_checkpoint
    from .info import model_info

    d = Path(args.directory)
    if d.exists() and (not d.is_dir() or (any(d.iterdir()) and not (d / "config.json").exists())):
        raise UsageError(f"{d}: exists and is not a model directory; choose a new or empty folder")
    build_tiny_checkpoint(d, seed=args.seed, clover=args.clover, dtype=parse_dtype(args.dtype), shape=args.shape)
    info = model_info(d)
    kind = "clover (diffusion)" if args.clover else "AR"
    print(f"wrote a {'tiny' if args.shape == 'tiny' else args.shape} random {kind} checkpoint to {d} ({human(info['parameters']['total'])} parameters, "
          f"{human(info['disk_bytes'], 'B')}); its output is noise")
    return 0
