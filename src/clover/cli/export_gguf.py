"""`clover export-gguf SRC DST.gguf [--dtype f32|bf16|f16|q8_0]` (SRC may be a `clover quantize` directory, or a
DFlash drafter directory: its own GGUF for the llama.cpp port's `--drafter`)."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    from ..gguf.write import CLOVER_TENSOR_MODES, DTYPES

    p.add_argument("src", help="a model directory (clover or Qwen3.5-MoE: config.json, safetensors, tokenizer.json), "
                               "or a DFlash drafter directory (written as arch dflash, for the llama.cpp port's --drafter)")
    p.add_argument("dst", help="the GGUF file to write (e.g. model.gguf)")
    p.add_argument("--dtype", choices=DTYPES, default="f32",
                   help="type of the weight matrices (default f32); norms, router, conv and per-head vectors stay f32. "
                        "From a `clover quantize` directory its INT8 / INT4 matrices go out as Q8_0 / Q4_1 (codes carried "
                        "over, see docs/gguf.md) and --dtype sets the others")
    p.add_argument("--clover-tensors", choices=CLOVER_TENSOR_MODES, default="sidecar",
                   help="where Clover's denoise-mode tensors go: a sidecar DST.clover.gguf (default; DST stays loadable "
                        "by stock llama.cpp), inline in DST (for a llama.cpp port; stock llama.cpp refuses it), or none")
    p.add_argument("--pre-tokenizer", default=None, metavar="NAME",
                   help="force llama.cpp's pre-tokenizer type (default: detected from tokenizer.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..gguf.write import export_gguf

    r = export_gguf(args.src, args.dst, dtype=args.dtype, clover_tensors=args.clover_tensors,
                    pre_tokenizer=args.pre_tokenizer, progress=not args.no_progress)
    size = r.path.stat().st_size
    print(f"wrote {r.path}: {r.tensors} tensors, {size / 2**20:.1f} MiB, arch {r.arch}, {r.types}"
          + (f", pre-tokenizer {r.pre_tokenizer}{'' if r.pre_tokenizer_exact else ' (closest match)'}" if r.pre_tokenizer else ""))
    if r.sidecar is not None:
        print(f"wrote {r.sidecar}: {r.clover_tensors} Clover tensors (denoise mode)")
    for note in r.notes:
        print(f"note: {note}")
    return 0
