"""`clover bench roofline`: how close a forward comes to the memory-bandwidth limit.

Batch-1 decoding is bound by reading weights: a forward cannot run faster than
(bytes it must read) / (memory bandwidth). This builds a Clover-shaped model with random weights
directly in memory (no checkpoint) — the 35B-A3B layer pattern and head shapes, scaled down to about
1B parameters (hidden 2048, 8 layers, 32 experts top-8, vocab 32k) — and in the same run measures
1. the machine's memory bandwidth (a large tensor sum = read, and a copy = read + write), and
2. forwards/s of AR decode steps (1 token) and of diffusion denoise steps (one block, default 32),
then reports achieved bytes/s = forwards/s × bytes read per forward as a percentage of the measured
bandwidth. Bytes per forward = every weight a forward reads: attention / GDN / norms / router /
shared expert of each layer, the routed experts it touched (counted per layer from the forward's
own routing), the lm_head, one embedding row per token; plus the cache state it reads (K/V of the
prefix, GDN recurrent state, conv state), reported separately.

`quick=True` is a tiny variant that runs in seconds (for tests).
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import machine, shape_summary, synchronize

SCHEMA = "clover.bench.roofline/1"


def roofline_config(quick: bool = False):
    from ..models import make_config

    if quick:
        return make_config(
            vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, max_position_embeddings=4096, model_type="clover",
            mask_token_id=4095, rope_theta=10_000_000.0,
        )
    # the 35B-A3B text config with fewer layers (same 3:1 GDN/attention pattern), experts and vocab
    return make_config(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, max_position_embeddings=32768, model_type="clover",
        mask_token_id=32767, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
    )


def build_random_model(config, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0,
                       on_device: bool = False):
    """Random weights (`init_weights`: normal(0, σ) matrices, the GDN decay/step, Clover's initial
    values), allocated directly in the target dtype on the device (no fp32 copy of the whole model).
    `on_device`: drawn there too (the plain-weight families' `init_weights`), not on the host."""
    from ..models import build_model

    model = build_model(config, device="meta").to(dtype)
    model = model.to_empty(device=device)
    model.tie_head()  # to_empty gave each module its own tensor
    model.init_weights(seed=seed, **({"on_device": True} if on_device else {}))
    return model.eval()


# ----------------------------------------------------------------------------- bandwidth
def measure_bandwidth(nbytes: int, repeat: int = 5, device: str = "cpu") -> dict:
    """GB/s (1e9) of a full read (sum of an fp32 tensor) and of a copy (read + write counted)."""
    n = nbytes // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    src.sum()
    dst.copy_(src)
    read, copy = [], []
    for _ in range(repeat):
        synchronize(device)
        t0 = time.perf_counter()
        src.sum()
        synchronize(device)
        t1 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        t2 = time.perf_counter()
        read.append(src.numel() * 4 / (t1 - t0) / 1e9)
        copy.append(2 * src.numel() * 4 / (t2 - t1) / 1e9)
    return {"bytes": n * 4, "read_gbps": statistics.median(read), "copy_gbps": statistics.median(copy),
            "read_gbps_max": max(read), "copy_gbps_max": max(copy)}


# ---------------------------------------------------------------------------- accounting
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes(model) -> dict:
    """Bytes of the weights by role: 'dense' (read by every forward), 'expert' (one routed expert
    of one layer), 'lm_head', 'embedding_row'."""
    dense = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name or name.startswith("lm_head") or "embed_tokens" in name:
            continue
        dense += _nbytes(p)
    ex = model.model.layers[0].mlp.experts
    expert = (_nbytes(ex.gate_up_proj) + _nbytes(ex.down_proj)) // ex.num_experts
    emb = model.model.embed_tokens.weight
    return {"dense": dense, "expert": expert, "lm_head": _nbytes(model.lm_head.weight),
            "embedding_row": emb.shape[1] * emb.element_size()}


def state_bytes(cache, prefix_len: int) -> int:
    """Cache bytes a forward reads: K/V up to the prefix, the GDN recurrent and conv states."""
    total = 0
    for store in (cache.keys, cache.values):
        for t in store.values():
            total += _nbytes(t[:, :, :prefix_len])
    for store in (cache.conv, cache.recurrent):
        for t in store.values():
            total += _nbytes(t)
    return total


# ------------------------------------------------------------------------------ measuring
def _time_steps(fn, n: int, device) -> tuple[float, list[list[int]]]:
    """Seconds per call (median over n calls, after one warm-up) and the experts touched per call."""
    fn()
    times, touched = [], []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        touched.append(list(out.experts_touched))
    return statistics.median(times), touched


def run_roofline(*, quick: bool = False, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 prefix: int | None = None, block_size: int = 32, ar_steps: int | None = None,
                 denoise_steps: int | None = None, bandwidth_bytes: int | None = None, seed: int = 0) -> dict:
    config = roofline_config(quick)
    prefix = prefix or (16 if quick else 128)
    ar_steps = ar_steps or (4 if quick else 12)
    denoise_steps = denoise_steps or (2 if quick else 6)
    bandwidth_bytes = bandwidth_bytes or (32 if quick else 1024) * 2**20

    t0 = time.perf_counter()
    bw = measure_bandwidth(bandwidth_bytes, device=device)
    model = build_random_model(config, dtype=dtype, device=device, seed=seed)
    build_s = time.perf_counter() - t0
    wb = weight_bytes(model)
    from ..models import parameter_counts

    counts = parameter_counts(config)
    gen = torch.Generator().manual_seed(seed + 1)
    V = config.vocab_size
    prompt = torch.randint(0, V - 1, (1, prefix), generator=gen).to(device)
    n_layers = config.num_hidden_layers

    results = {}
    with torch.inference_mode():
        # AR: each call appends one token; the prefix grows by ar_steps+1 over the run (reported)
        cache = model.make_cache(1, prefix + ar_steps + block_size + 8)
        model.step(cache, commit_ids=prompt)
        tok = torch.randint(0, V - 1, (1, 1), generator=gen).to(device)
        ar_s, ar_touched = _time_steps(lambda: model.step(cache, commit_ids=tok, track_experts=True), ar_steps, device)
        ar_state = state_bytes(cache, int(cache.lengths.max()))
        # diffusion: one all-masked block denoised against the prefix (the cache is not written)
        block = torch.full((1, block_size), config.mask_token_id, dtype=torch.long, device=device)
        dn_s, dn_touched = _time_steps(lambda: model.step(cache, denoise_ids=block, track_experts=True), denoise_steps, device)
        dn_state = state_bytes(cache, int(cache.lengths.max()))

    for name, seconds, touched, tokens, state in (
        ("ar_step", ar_s, ar_touched, 1, ar_state),
        (f"denoise_step_B{block_size}", dn_s, dn_touched, block_size, dn_state),
    ):
        mean_touched = sum(sum(t) for t in touched) / len(touched)  # experts summed over layers, per forward
        weights = wb["dense"] + wb["lm_head"] + tokens * wb["embedding_row"] + mean_touched * wb["expert"]
        fps = 1.0 / seconds
        achieved = fps * (weights + state) / 1e9
        # matmul FLOPs: every token through its top-k experts and the dense weights (embedding = lookup)
        flops = 2 * tokens * (counts["active"] - config.vocab_size * config.hidden_size)
        results[name] = {
            "tokens": tokens,
            "seconds_per_forward": seconds,
            "forwards_per_second": fps,
            "tokens_per_second": fps * tokens,
            "experts_touched_per_layer": mean_touched / n_layers,
            "weight_bytes": int(weights),
            "state_bytes": int(state),
            "achieved_gbps": achieved,
            "pct_of_read_bandwidth": 100 * achieved / bw["read_gbps"],
            "bound_forwards_per_second": bw["read_gbps"] * 1e9 / (weights + state),
            "achieved_gflops": fps * flops / 1e9,
        }
    return {
        "schema": SCHEMA,
        "quick": quick,
        "dtype": str(dtype).replace("torch.", ""),
        "config": shape_summary(config),
        "parameters": counts,
        "weight_bytes": wb,
        "prefix": prefix,
        "block_size": block_size,
        "bandwidth": bw,
        "build_seconds": build_s,
        "machine": machine(device),
        "steps": results,
    }


def roofline_table(result: dict):
    from rich.table import Table

    bw = result["bandwidth"]
    p = result["parameters"]
    t = Table(title=(f"clover bench roofline · {p['total'] / 1e9:.2f}B params ({p['active'] / 1e9:.2f}B active) · "
                     f"{result['dtype']} · {result['machine']['torch_threads']} threads · read {bw['read_gbps']:.1f} GB/s, "
                     f"copy {bw['copy_gbps']:.1f} GB/s"), title_justify="left")
    for col in ("step", "ms/fwd", "fwd/s", "tok/s", "experts/layer", "MB read/fwd", "GB/s", "% of read BW", "bound fwd/s", "GFLOP/s"):
        t.add_column(col, justify="left" if col == "step" else "right")
    for name, s in result["steps"].items():
        t.add_row(name, f"{1e3 * s['seconds_per_forward']:.1f}", f"{s['forwards_per_second']:.2f}", f"{s['tokens_per_second']:.1f}",
                  f"{s['experts_touched_per_layer']:.1f}", f"{(s['weight_bytes'] + s['state_bytes']) / 1e6:.0f}",
                  f"{s['achieved_gbps']:.2f}", f"{s['pct_of_read_bandwidth']:.0f}%", f"{s['bound_forwards_per_second']:.1f}",
                  f"{s['achieved_gflops']:.1f}")
    return t
