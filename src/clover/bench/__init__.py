"""Benchmarks: speed and quality of the decoding modes, kernels, and the memory-bandwidth roofline.

- `decode`: AR / diffusion / naive / speculative on the same held-out prompts, interleaved, one run.
- `sweep`: diffusion threshold and block-size sweeps -> speed/quality curves.
- `kernels`: GDN chunk kernel, cached attention and MoE dispatch micro-benchmarks on identical inputs.
- `roofline`: a ~1B-parameter Clover-shaped model with random weights; forwards/s against the
  bandwidth limit measured in the same run.

`clover bench {decode,sweep,kernels,roofline}` runs them (`clover.bench.cli`); each entry point
(`run_decode`, `run_sweep`, `run_kernels`, `run_roofline`) returns a JSON-ready dict, so tests and
docs read the same numbers the tables show. Nothing heavy is imported here.
"""
