"""`clover import-gguf FILE.gguf OUT_DIR`: a GGUF (llama, or qwen35moe as `clover export-gguf` writes it) -> a model directory (clover.gguf.read)."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a GGUF file of the llama architecture (F32/F16/BF16/Q4_0/Q4_1/Q8_0/K-quants)")
    p.add_argument("dst", help="where to write config.json, model.safetensors and the tokenizer")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the written weights (default float32)")


def run(args: argparse.Namespace) -> int:
    from ..gguf.read import import_gguf

    cfg = import_gguf(args.src, args.dst, dtype=args.dtype)
    print(f"wrote {args.dst}: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, {'tied' if cfg.tie_word_embeddings else 'untied'} embeddings")
    return 0
