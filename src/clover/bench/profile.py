"""Where a forward's time goes: torch.profiler (top aten ops by self time) and cProfile (top Python
functions by own time) over AR decode steps and diffusion denoise steps of a small model.

    clover bench profile [--model DIR] [--ar-steps 50] [--denoise-steps 20] [--block-size 32]

Without --model: random weights in the shape of the clover-tiny recipe (hidden 256, 8 layers,
8 experts top-2, vocab 4096). The numbers in docs/benchmarks.md come from this benchmark.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Iterator

import torch


def recipe_model(seed: int = 0):
    from ..models import build_model
    from ..tiny import tiny_config

    cfg = tiny_config(vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                      max_position_embeddings=2048, mask_token_id=2)
    model = build_model(cfg, device="cpu")
    model.init_weights(seed=seed)
    return model.eval()


def step_functions(model, prefix: int = 128, ar_steps: int = 50, denoise_steps: int = 20, block_size: int = 32):
    """Two closures: n AR steps after a prefill, n denoise steps of an all-masked block."""
    V = model.config.vocab_size
    prompt = torch.randint(3, V - 1, (1, prefix), generator=torch.Generator().manual_seed(0))
    mask = model.config.mask_token_id

    def ar():
        cache = model.make_cache(1, prefix + ar_steps + 1)
        model.step(cache, commit_ids=prompt)
        tok = prompt[:, -1:]
        for _ in range(ar_steps):
            model.step(cache, commit_ids=tok, track_experts=True)

    def denoise():
        cache = model.make_cache(1, prefix + 2 * block_size)
        model.step(cache, commit_ids=prompt)
        block = torch.full((1, block_size), mask)
        for _ in range(denoise_steps):
            model.step(cache, denoise_ids=block, track_experts=True)

    return ar, denoise


def profile(fn, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(rows)
    return ops + "\n" + s.getvalue()


def profile_steps(model, *, ar_steps: int = 50, denoise_steps: int = 20, block_size: int = 32) -> Iterator[str]:
    """After one warm-up of each: per kind (AR, denoise), a line with the time per step, then its profile."""
    ar, denoise = step_functions(model, ar_steps=ar_steps, denoise_steps=denoise_steps, block_size=block_size)
    with torch.inference_mode():
        ar(), denoise()  # warm-up
        for name, fn, n in (("AR step", ar, ar_steps), (f"denoise step (block {block_size})", denoise, denoise_steps)):
            t0 = time.perf_counter()
            fn()
            yield f"== {name}: {1e3 * (time.perf_counter() - t0) / n:.2f} ms per step (incl. one prefill / {n} steps)"
            yield profile(fn)
