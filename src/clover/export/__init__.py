"""Exporting checkpoints to other runtimes' formats (`clover export-gguf`: llama.cpp's GGUF)."""
