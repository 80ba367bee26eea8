"""Training: recipes, the AR / block-diffusion trainer, checkpoints, export.

The command line is `clover train` (`clover.cli.train`)::

    clover train RECIPE [--out DIR] [--steps N] [--resume | --no-resume] [--reset-data] [--set KEY=VALUE ...]
    clover train RUN_DIR                      # continue a run from its recipe.json
    clover train export CKPT OUT [--dtype bfloat16] [--tokenizer DIR]
    clover train plot RUN_DIR [RUN_DIR ...] [--out curves.png] [--chain]   # loss / held-out curves
    clover train plan RECIPE --gpus N [--gpu-mem 80] [--mfu 0.25] [--tokens 1e9] [--model CONFIG|qwen3.6-35b-a3b]
                      [--micro-batch B] [--set K=V] [--json]           # memory, speed and days, on paper
    clover train evaluate CKPT [--tokenizer DIR] [--tasks 500] [--batches 8]   # quick held-out metrics

Multi-process: `torchrun --nproc_per_node N -m clover train RECIPE` (gloo on CPU, nccl with one GPU
per rank when `run.device` / `--device` resolves to CUDA); `--parallel ddp` (full replicas) or
`--parallel fsdp` (FSDP2 shards and distributed checkpoints).
"""

from __future__ import annotations

from .recipes import Recipe, RecipeError, load_recipe, recipe_from_dict

__all__ = ["Recipe", "RecipeError", "load_recipe", "recipe_from_dict"]
