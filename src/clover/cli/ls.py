"""`clover list`: the models in the user cache with their size on disk (clover.named)."""

from __future__ import annotations

import argparse

from .common import human


def configure(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from ..named import NAMED, cached_models, models_root

    held = cached_models()
    if not held:
        print(f"the model cache ({models_root()}) is empty; `clover pull {next(iter(NAMED))}` fills it")
        return 0
    width = max(len(c.name) for c in held)
    for c in held:
        print(f"{c.name:<{width}}  {human(c.bytes, 'B'):>9}  {c.what}  ({c.path})")
    print(f"{'total':<{width}}  {human(sum(c.bytes for c in held), 'B'):>9}  `clover rm NAME` deletes one")
    return 0
