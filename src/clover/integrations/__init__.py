"""Clover working with other engines and stacks: `vllm` (a vLLM model plugin, imported only when
vLLM loads it), `hf_modeling` (the transformers model `clover export-hf` ships as remote code) and
`llama_port` (the driver of the llama.cpp port's binary, `ports/llama.cpp`)."""
