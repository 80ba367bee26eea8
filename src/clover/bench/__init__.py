"""Benchmarks: speed and quality of the decoding modes, kernels, and the memory-bandwidth roofline.

- `decode`: AR / diffusion / naive / speculative on the same held-out prompts, interleaved, one run.
- `sweep`: diffusion threshold and block-size sweeps -> speed/quality curves.
- `kernels`: GDN chunk kernel, cached attention and MoE dispatch micro-benchmarks on identical inputs.
- `roofline`: a ~1B-parameter Clover-shaped model with random weights; forwards/s against the
  bandwidth limit measured in the same run.
- `experts`: block expert sharing at several budgets against sharing off and AR.
- `quant`: fp32 / bf16 / int8 / int4 of one model, each measured in its own process.
- `eval`: the evaluation of a checkpoint (`clover eval`): held-out tasks and code, every mode.
- `profile`: torch.profiler and cProfile over AR and denoise steps (where a forward's time goes).

`clover bench {decode,sweep,experts,kernels,roofline,quant,profile,...}` runs them (the arguments are parsed in
`clover.cli.bench`); each entry point (`run_decode`, `run_sweep`, `run_experts`, `run_kernels`,
`run_roofline`, `quant.compare`) returns JSON-ready data, so tests and docs read the same numbers the
tables show. Nothing heavy is imported here.
"""
