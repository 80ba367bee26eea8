"""`clover convert SRC DST`: a Qwen3.5-MoE checkpoint -> a Clover one."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    import dataclasses

    from ..config import CloverConfig

    defaults = {f.name: f.default for f in dataclasses.fields(CloverConfig)}  # the config's own defaults
    block, threshold = defaults["block_size"], defaults["threshold"]
    p.add_argument("src", help="a Qwen3.5/3.6-MoE checkpoint directory (safetensors + tokenizer)")
    p.add_argument("dst", help="where to write the Clover checkpoint")
    p.add_argument("--block-size", type=int, default=block, help=f"default block size stored in the config ({block})")
    p.add_argument("--threshold", type=float, default=threshold,
                   help=f"default confidence threshold stored in the config ({threshold})")


def run(args: argparse.Namespace) -> int:
    from ..convert import convert_to_clover

    cfg = convert_to_clover(args.src, args.dst, block_size=args.block_size, threshold=args.threshold)
    print(f"wrote {args.dst}: model_type clover, mask token id {cfg.mask_token_id}, vocab {cfg.vocab_size}")
    return 0
