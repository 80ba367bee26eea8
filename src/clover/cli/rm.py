"""`clover rm NAME`: delete a model from the user cache (`clover list` names them)."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="what `clover list` shows: a named model (with its base), an imported GGUF, downloads")


def run(args: argparse.Namespace) -> int:
    from ..named import PullError, remove_cached

    try:
        removed = remove_cached(args.name)
    except PullError as e:
        raise ValueError(str(e)) from None
    for p in removed:
        print(f"removed {p}")
    return 0
