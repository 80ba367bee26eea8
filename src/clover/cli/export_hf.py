"""`clover export-hf SRC DST [--overwrite]`: a Clover checkpoint as a transformers directory
(`trust_remote_code`); docs/transformers.md."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Clover model directory (config.json, safetensors, tokenizer files); an INT8 `clover quantize` directory is written as torchao tensors (needs torchao)")
    p.add_argument("dst", help="the directory to write (loads with AutoModelForCausalLM.from_pretrained(DST, trust_remote_code=True))")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists and is not empty")


def run(args: argparse.Namespace) -> int:
    from ..export.hf import export_hf

    r = export_hf(args.src, args.dst, overwrite=args.overwrite)
    print(f"wrote {r.path}: {len(r.code_files)} remote-code files (generated from clover's modules), "
          f"weights {', '.join(r.weight_files)}, tokenizer {', '.join(r.tokenizer_files) or 'none'}")
    for note in r.notes:
        print(f"note: {note}")
    print(f"load it: AutoModelForCausalLM.from_pretrained({str(r.path)!r}, trust_remote_code=True)")
    return 0
