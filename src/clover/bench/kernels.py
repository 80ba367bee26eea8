"""`clover bench kernels`: micro-benchmarks of the three hot kernels, each against a reference on
identical inputs (max |difference| reported next to the timing).

- GDN: our chunked gated delta rule (prefill) and the T=1 recurrent step (on a random state) vs the
  transformers torch fallback, on random inputs (`gdn_inputs`; shape and chunk size adjustable).
- Attention: our cached path (`GatedAttention._cached`: write K/V into the preallocated cache, build
  the prefix/block mask, SDPA with the mask) vs a bare SDPA over the same keys (no mask; the lower
  bound of what the cached path can cost) vs the eager softmax(QKᵀ)V definition, for an AR step
  (1 query) and a denoise block (B queries) at a few prefix lengths.
- MoE dispatch: `grouped_expert_forward` (sort by expert, one matmul pair per touched expert) vs a
  per-expert loop over all experts (mask, gather, scatter) vs `reference_expert_forward` (per token,
  per chosen expert) at 1, 32 and 512 tokens.

Implementations run interleaved (a, b, c, a, b, c, ...) so that background load on a shared machine
hits all alike; the median per call is reported.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from .common import machine

SCHEMA = "clover.bench.kernels/1"


def interleaved(fns: dict[str, Callable[[], object]], *, repeat: int, inner: int = 1) -> dict[str, float]:
    """Median milliseconds per call of each function, timed round-robin after one warm-up call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) * 1e3 / inner)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _row(group: str, case: str, times: dict[str, float], baseline: str, err: dict[str, float] | None = None, **extra) -> dict:
    return {
        "group": group,
        "case": case,
        "ms": times,
        "baseline": baseline,
        "speedup_vs": {k: (v / times[baseline] if times[baseline] > 0 else None) for k, v in times.items() if k != baseline},
        "max_abs_diff": err or {},
        **extra,
    }


# ------------------------------------------------------------------------------------ GDN
def _quiet_transformers() -> int | None:
    """The reference's "flash-linear-attention is not installed" notice is expected here; returns the
    previous verbosity for `bench_gdn` to restore."""
    try:
        from transformers.utils import logging as hf_logging

        prev = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        return prev
    except Exception:  # pragma: no cover - transformers missing: the reference is skipped anyway
        return None


def gdn_reference():
    """transformers' torch chunk and recurrent gated delta rule, or (None, None) where this
    transformers has none (the GDN rows then time ours alone)."""
    try:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            torch_chunk_gated_delta_rule,
            torch_recurrent_gated_delta_rule,
        )
    except Exception:  # pragma: no cover - depends on the environment
        return None, None
    return torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule


def gdn_inputs(B: int, T: int, H: int, K: int, V: int, dtype, seed: int = 0):
    """Random q, k, v [B, T, H, K|V], log-decay g in (-0.51, -0.01) and beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, generator=gen).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(dtype)
    g = -torch.rand(B, T, H, generator=gen) * 0.5 - 0.01
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def bench_gdn(*, T: int, H: int, K: int, V: int, repeat: int, B: int = 1, chunk: int = 64, dtype=torch.float32) -> list[dict]:
    prev = _quiet_transformers()
    try:
        return _bench_gdn(B=B, T=T, H=H, K=K, V=V, chunk=chunk, repeat=repeat, dtype=dtype)
    finally:
        if prev is not None:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity(prev)


def _against_transformers(ours: Callable, reference: Callable | None) -> tuple[dict, dict]:
    """The functions to time ({"ours"}, and "transformers" when there is a reference) and the max
    |difference| of the reference's output and final state from ours."""
    if reference is None:
        return {"ours": ours}, {}
    (o1, s1), (o2, s2) = ours(), reference()
    return {"ours": ours, "transformers": reference}, {"transformers": max(_maxdiff(o1, o2), _maxdiff(s1, s2))}


def _bench_gdn(*, B: int, T: int, H: int, K: int, V: int, chunk: int, repeat: int, dtype) -> list[dict]:
    from ..kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_chunk, ref_rec = gdn_reference()
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k, v, g, beta = gdn_inputs(B, T, H, K, V, dtype)
    fns, err = _against_transformers(lambda: chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, **kw),
                                     ref_chunk and (lambda: ref_chunk(q, k, v, g, beta, chunk_size=chunk, **kw)))
    batch = f"B={B} " if B != 1 else ""
    rows = [_row("gdn", f"chunk prefill {batch}T={T} H={H} K={K} V={V} chunk={chunk}", interleaved(fns, repeat=repeat),
                 "ours", err)]

    dq, dk, dv, dg, db = gdn_inputs(B, 1, H, K, V, dtype, seed=1)
    state = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(2)) * 0.1
    fns, err = _against_transformers(lambda: recurrent_gated_delta_rule(dq, dk, dv, dg, db, initial_state=state, **kw),
                                     ref_rec and (lambda: ref_rec(dq, dk, dv, dg, db, initial_state=state, **kw)))
    rows.append(_row("gdn", f"recurrent step {batch}T=1 H={H} K={K} V={V}", interleaved(fns, repeat=repeat, inner=20), "ours", err))
    return rows


# ------------------------------------------------------------------------------ attention
def bench_attention(*, prefixes: list[int], block: int, heads: int, kv_heads: int, head_dim: int, repeat: int,
                    dtype=torch.float32) -> list[dict]:
    from ..cache import HybridCache
    from ..models import make_config
    from ..models.layers import GatedAttention, Segments, cached_attention_mask

    hidden = heads * head_dim
    cfg = make_config(vocab_size=8, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=1, num_experts_per_tok=1,
                       moe_intermediate_size=1, layer_types=["full_attention"])
    attn = GatedAttention(cfg)
    gen = torch.Generator().manual_seed(0)
    rep = heads // kv_heads
    scale = head_dim**-0.5
    rows = []
    for L in prefixes:
        cache = HybridCache([attn.make_state(1, L + block + 1, dtype=dtype, device="cpu")], 1, L + block + 1)
        cache.keys[0][:, :, :L] = torch.randn(1, kv_heads, L, head_dim, generator=gen).to(dtype)
        cache.values[0][:, :, :L] = torch.randn(1, kv_heads, L, head_dim, generator=gen).to(dtype)
        cache.lengths.fill_(L)
        for case, T, commit in (("AR step", 1, True), (f"denoise block {block}", block, False)):
            q = torch.randn(1, heads, T, head_dim, generator=gen).to(dtype)
            k = torch.randn(1, kv_heads, T, head_dim, generator=gen).to(dtype)
            v = torch.randn(1, kv_heads, T, head_dim, generator=gen).to(dtype)
            Tc = T if commit else 0
            mask = cached_attention_mask(cache.lengths, Segments(commit_len=Tc, denoise_len=T - Tc))
            keys = torch.cat([cache.keys[0][:, :, :L], k], dim=2)
            vals = torch.cat([cache.values[0][:, :, :L], v], dim=2)

            def ours():
                # rewrites the same slots each call when committing
                return attn.attend_cached(q, k, v, cache.layers[0].tensors(), cache.lengths, Tc, mask)

            def bare():
                return F.scaled_dot_product_attention(q, keys, vals, enable_gqa=rep > 1)

            def eager():
                kk, vv = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
                w = torch.softmax((q.float() @ kk.float().transpose(-1, -2)) * scale, dim=-1)
                return (w @ vv.float()).to(dtype)

            fns = {"ours (cached+mask)": ours, "sdpa bare": bare, "eager": eager}
            with torch.inference_mode():
                ref = eager()
                err = {"sdpa bare": _maxdiff(bare(), ref), "ours (cached+mask)": _maxdiff(ours(), ref)}
                times = interleaved(fns, repeat=repeat, inner=10)
            rows.append(_row("attention", f"{case}, prefix {L}", times, "ours (cached+mask)", err,
                             reference="eager"))
    return rows


# ------------------------------------------------------------------------------------ MoE
def per_expert_loop(experts, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """Loop over every expert: find its tokens by mask, run it, scatter-add back."""
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        tok, slot = (top_idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y = experts.expert_forward(e, x[tok]) * top_w[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def bench_moe(*, tokens: list[int], hidden: int, inter: int, experts: int, top_k: int, repeat: int,
              reference_max_tokens: int = 512, dtype=torch.float32) -> list[dict]:
    from ..models.layers import Experts
    from ..moe import grouped_expert_forward, reference_expert_forward, route

    gen = torch.Generator().manual_seed(0)
    ex = Experts(experts, hidden, inter)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=gen) / math.sqrt(hidden))
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=gen) / math.sqrt(inter))
    ex.to(dtype)
    rows = []
    for n in tokens:
        x = torch.randn(n, hidden, generator=gen).to(dtype)
        w, idx = route(torch.randn(n, experts, generator=gen), top_k)
        w = w.to(dtype)
        fns = {
            "grouped": lambda: grouped_expert_forward(ex, x, idx, w),
            "per-expert loop": lambda: per_expert_loop(ex, x, idx, w),
        }
        if n <= reference_max_tokens:
            fns["reference"] = lambda: reference_expert_forward(ex, x, idx, w)
        with torch.inference_mode():
            base = fns["grouped"]()
            err = {k: _maxdiff(f(), base) for k, f in fns.items() if k != "grouped"}
            inner = 10 if n <= 32 else 1
            times = interleaved(fns, repeat=repeat if n <= 32 else max(3, repeat // 2), inner=inner)
        rows.append(_row("moe", f"{n} tokens", times, "grouped", err, experts_touched=int(torch.unique(idx).numel())))
    return rows


# ---------------------------------------------------------------------------------- driver
def run_kernels(*, quick: bool = False, repeat: int | None = None, dtype: torch.dtype = torch.float32,
                only: tuple[str, ...] = ("gdn", "attention", "moe"), gdn: dict | None = None) -> dict:
    """`quick`: small shapes (seconds, for tests); default: Clover-shaped (35B-A3B head shapes).
    `gdn`: the GDN shape to time instead (keys of `bench_gdn`: B, T, H, K, V, chunk)."""
    if quick:
        shapes = {
            "gdn": dict(T=128, H=2, K=32, V=32),
            "attention": dict(prefixes=[64], block=8, heads=4, kv_heads=2, head_dim=32),
            "moe": dict(tokens=[1, 32, 128], hidden=64, inter=32, experts=8, top_k=2, reference_max_tokens=32),
        }
        repeat = repeat or 3
    else:
        shapes = {
            "gdn": dict(T=2048, H=8, K=128, V=128),
            "attention": dict(prefixes=[256, 2048], block=32, heads=16, kv_heads=2, head_dim=256),
            "moe": dict(tokens=[1, 32, 512], hidden=2048, inter=512, experts=32, top_k=8),
        }
        repeat = repeat or 7
    if gdn:
        shapes["gdn"] = dict(shapes["gdn"], **gdn)
    rows: list[dict] = []
    if "gdn" in only:
        rows += bench_gdn(repeat=repeat, dtype=dtype, **shapes["gdn"])
    if "attention" in only:
        rows += bench_attention(repeat=repeat, dtype=dtype, **shapes["attention"])
    if "moe" in only:
        rows += bench_moe(repeat=repeat, dtype=dtype, **shapes["moe"])
    return {"schema": SCHEMA, "quick": quick, "dtype": str(dtype).replace("torch.", ""), "repeat": repeat,
            "shapes": shapes, "machine": machine(), "rows": rows}


def kernels_table(result: dict):
    from rich.table import Table

    t = Table(title=f"clover bench kernels · {result['dtype']} · {result['machine']['torch_threads']} threads · "
                    f"median of {result['repeat']} (interleaved)", title_justify="left")
    for col in ("kernel", "case", "implementation", "ms/call", "time ÷ base", "max |diff|"):
        t.add_column(col, justify="left" if col in ("kernel", "case", "implementation") else "right")
    for r in result["rows"]:
        for i, (name, ms) in enumerate(r["ms"].items()):
            ratio = "1.00 (base)" if name == r["baseline"] else f"{r['speedup_vs'][name]:.2f}"
            diff = r["max_abs_diff"].get(name)
            t.add_row(r["group"] if i == 0 else "", r["case"] if i == 0 else "", name, f"{ms:.3f}", ratio,
                      "-" if diff is None else f"{diff:.1e}")
    return t
