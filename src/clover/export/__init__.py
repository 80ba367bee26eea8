"""Exporting checkpoints to other runtimes' formats: transformers' (`hf.py`, `clover export-hf`). GGUF,
both directions, is `clover.gguf`; `gguf.py` and `gguf_quant.py` here keep its former import paths."""
