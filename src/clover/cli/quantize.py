"""`clover quantize SRC DST --bits {8,4} [--group-size 32|64|128] [--skip PATTERN]... [--include-embeddings]`."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_GROUP_SIZE = 64


def configure(p: argparse.ArgumentParser) -> None:
    from ..quant.ops import GROUP_SIZES

    p.add_argument("src", metavar="SRC", help="a float model directory (config.json + safetensors + tokenizer)")
    p.add_argument("dst", metavar="DST", help="where to write the quantized model directory")
    p.add_argument("--bits", type=int, choices=[8, 4], required=True,
                   help="8: symmetric per-output-channel int8; 4: group-wise asymmetric int4")
    p.add_argument("--group-size", type=int, choices=list(GROUP_SIZES), default=None,
                   metavar="{" + ",".join(map(str, GROUP_SIZES)) + "}",
                   help=f"int4 only: inputs per scale/zero group (default: {DEFAULT_GROUP_SIZE})")
    p.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="keep modules matching this shell-style pattern in high precision, e.g. '*.self_attn.*' "
                        "or 'model.layers.0.*' (repeatable)")
    p.add_argument("--include-embeddings", action="store_true",
                   help="also quantize the token embedding and lm_head (kept in high precision by default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _human(n: float) -> str:
    for scale, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"


def run(args: argparse.Namespace) -> int:
    from ..quant.writer import quantize_checkpoint

    if args.bits == 8 and args.group_size is not None:
        raise ValueError("--group-size: only for --bits 4 (int8 uses one scale per output channel)")
    group = args.group_size or DEFAULT_GROUP_SIZE
    src, dst = Path(args.src), Path(args.dst)
    qc = quantize_checkpoint(src, dst, bits=args.bits, group_size=group, skip=args.skip,
                             include_embeddings=args.include_embeddings, progress=not args.no_progress)
    scheme = "int8 per channel" if args.bits == 8 else f"int4 group {group}"
    before, after = _size(src), _size(dst)
    print(f"wrote {dst}: {scheme}, {len(qc['modules'])} modules quantized, "
          f"weights {_human(before)} -> {_human(after)} ({after / max(before, 1):.0%})")
    return 0
