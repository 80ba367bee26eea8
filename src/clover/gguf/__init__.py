"""GGUF, both directions: llama.cpp's file format for clover's checkpoints.

- `names`: one table per llama.cpp architecture (our tensor names, GGUF names, each transform and
  its inverse), reached from the architecture's registration (`Architecture.gguf_arch`);
- `write`: a model directory (or a DFlash drafter) -> GGUF (`clover export-gguf`);
- `read`: a GGUF -> a model directory (`clover import-gguf`, `clover.load("x.gguf")`);
- `tokenizer`: the tokenizer's GGUF form (the llama.cpp pre-tokenizer types);
- `quant`: clover's INT8 / INT4 codes as Q8_0 / Q4_1 blocks.
Nothing heavy is imported here; the `gguf` package is imported where a file is read or written."""
