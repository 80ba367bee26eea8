"""CPU benchmark: our chunked gated delta rule vs the transformers reference.

    PYTHONPATH=src python -m clover.kernels.bench [--T 2048 --H 8 --K 128 --V 128 --repeat 5]

Both implementations get the same inputs; runs are interleaved (ours, theirs,
ours, ...) so that background load on a shared machine hits both alike, and
the median of each is reported.  Also times one T=1 decode step of the
recurrent kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from .gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _reference():
    try:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            torch_chunk_gated_delta_rule,
            torch_recurrent_gated_delta_rule,
        )
    except Exception as exc:  # pragma: no cover - depends on the environment
        print(f"transformers reference unavailable ({exc}); timing ours only")
        return None, None
    return torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule


def _inputs(B, T, H, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, generator=gen).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(dtype)
    g = -torch.rand(B, T, H, generator=gen) * 0.5 - 0.01
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def _time_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads if args.threads > 0 else (os.cpu_count() or 1))
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    warnings.filterwarnings("ignore")
    ref_chunk, ref_rec = _reference()

    q, k, v, g, beta = _inputs(args.B, args.T, args.H, args.K, args.V, dtype)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)

    def ours():
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=args.chunk, **kw)

    def theirs():
        return ref_chunk(q, k, v, g, beta, chunk_size=args.chunk, **kw)

    # one decode step on top of a state
    B, H, K, V = args.B, args.H, args.K, args.V
    dq, dk, dv, dg, db = _inputs(B, 1, H, K, V, dtype, seed=1)
    state = torch.randn(B, H, K, V) * 0.1

    def ours_step():
        return recurrent_gated_delta_rule(dq, dk, dv, dg, db, initial_state=state, **kw)

    def theirs_step():
        return ref_rec(dq, dk, dv, dg, db, initial_state=state, **kw)

    rows = []
    with torch.inference_mode():
        max_err = None
        if ref_chunk is not None:
            o1, s1 = ours()
            o2, s2 = theirs()
            max_err = max((o1.float() - o2.float()).abs().max().item(), (s1 - s2).abs().max().item())
        else:
            ours()
        t_ours, t_ref = [], []
        for _ in range(args.repeat):
            t_ours.append(_time_ms(ours))
            if ref_chunk is not None:
                t_ref.append(_time_ms(theirs))
        rows.append(("chunk (prefill)", t_ours, t_ref))

        n_step = 200
        for _ in range(20):
            ours_step()
            if ref_rec is not None:
                theirs_step()
        s_ours, s_ref = [], []
        for _ in range(max(args.repeat, 5)):
            s_ours.append(_time_ms(lambda: [ours_step() for _ in range(n_step)]) / n_step)
            if ref_rec is not None:
                s_ref.append(_time_ms(lambda: [theirs_step() for _ in range(n_step)]) / n_step)
        rows.append(("recurrent T=1 step", s_ours, s_ref))

    print(
        f"gated delta rule  B={args.B} T={args.T} H={args.H} K={args.K} V={args.V} "
        f"chunk={args.chunk} dtype={args.dtype} threads={torch.get_num_threads()} repeat={args.repeat}"
    )
    if max_err is not None:
        print(f"max |ours - transformers| (output, final state): {max_err:.2e}")
    print(f"{'kernel':<22}{'ours ms':>12}{'transformers ms':>18}{'speed-up':>10}")
    for name, a, b in rows:
        ma = statistics.median(a)
        if b:
            mb = statistics.median(b)
            print(f"{name:<22}{ma:>12.3f}{mb:>18.3f}{mb / ma:>9.2f}x")
        else:
            print(f"{name:<22}{ma:>12.3f}{'-':>18}{'-':>10}")


if __name__ == "__main__":
    main()
