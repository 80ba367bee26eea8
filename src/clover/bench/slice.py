"""`clover bench slice`: 4 of Qwen3.6-35B-A3B's 40 layers at their real shapes, bf16 and int4.

The roofline benchmark scales the 35B-A3B down to ~1B parameters; this one keeps every shape of the
real model (`clover.models.qwen3_5_moe.full_size_config()`: hidden 2048; 256 experts top-8, moe 512 plus the
shared expert; attention 16/2 heads × 256; GDN 16/32 heads × 128; vocab 248,320) and keeps only
`layers` of its layers (default 4: three GDN and one attention layer, the model's 3:1 pattern).
Weights are random, built in place in bf16 (no fp32 copy of any large tensor: the routed experts,
the embedding and the lm_head are filled from a shared random pool at random offsets, every other
weight as `init_weights` draws it); the int4 model is the same weights quantized by clover's own
modules (`Int4Linear`, `QuantExperts`; the format's default module set: embedding and lm_head stay
bf16), sharing every unquantized tensor with the bf16 model.

Forwards, each on a cache holding a `prefix`-token prompt and restored after every call (so every
call sees the same cache):
- `ar`: one token committed (an AR decode step);
- `denoise`: one block of `block_size` denoised against the cache, every other position still masked
  (diffusion's forward mid-block; with `expert_budget`, the block's tokens share that many experts
  per layer);
- `verify`: the speculative forward — `block_size` drafted tokens committed causally plus the next
  block denoised, every commit position's logits.

Per forward and per layer (timed by forward hooks on each decoder layer and on the lm_head): ms,
experts touched, bytes read (the layer's dense weights, the experts it touched, the cache state it
read) and those bytes per second as a % of the measured read bandwidth (a sum over a large fp32
tensor; `roofline.measure_bandwidth`). The 40-layer figures are an **extrapolation**: 30 × the mean
GDN layer + 10 × the attention layer + the measured lm_head and the step's own overhead. Random
routing spreads a block over more experts than a trained router does, so the denoise/verify
expert counts are an upper end.

Implementations run interleaved (bf16 and int4, every forward kind, round-robin) so that background
load hits all alike; the median per call is reported. `quick=True` shrinks every shape (seconds; tests).
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import machine, shape_summary

SCHEMA = "clover.bench.slice/1"
FULL_LAYERS = 40
POOL = 1 << 22  # random values shared by the large tensors


# ------------------------------------------------------------------------------- the model
def slice_config(layers: int = 4, quick: bool = False):
    """The 35B-A3B text config with `layers` layers (clover model type: GDN layers carry the denoise
    parameters); `quick` shrinks every width for tests."""
    from ..models import make_config
    from ..models.qwen3_5_moe import full_size_config

    if quick:
        c = make_config(
            vocab_size=4096, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, max_position_embeddings=4096, rope_theta=10_000_000.0,
        )
    else:
        c = full_size_config()
    n = c.full_attention_interval
    types = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers)]
    return c.replace(num_hidden_layers=layers, layer_types=types, model_type="clover",
                     mask_token_id=c.vocab_size - 1)


def _is_large(name: str) -> bool:
    return ".mlp.experts." in name or name.startswith("lm_head") or "embed_tokens" in name


@torch.no_grad()
def build_slice_model(config, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Random weights allocated directly in `dtype`. The large tensors (routed experts, embedding,
    lm_head) are filled from one random pool of POOL values, each chunk at a random offset, so
    nothing large passes through fp32; every other weight as `init_weights` draws it."""
    from ..models import build_model

    model = build_model(config, device="meta").to(dtype).to_empty(device="cpu")
    # init_weights draws through fp32 per parameter: hide the large ones from it, fill them here
    hidden: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    for name, _ in list(model.named_parameters()):
        if _is_large(name):
            mod_name, _, leaf = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            hidden.append((mod, leaf, mod._parameters.pop(leaf)))
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    pool = (torch.randn(2 * POOL, generator=gen) * config.initializer_range).to(dtype)
    for mod, leaf, p in hidden:
        flat = p.data.view(-1)
        offsets = torch.randint(0, POOL, ((flat.numel() + POOL - 1) // POOL,), generator=gen).tolist()
        for i, o in enumerate(offsets):
            part = flat[i * POOL : (i + 1) * POOL]
            part.copy_(pool[o : o + part.numel()])
        mod._parameters[leaf] = p
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def quantize_model(model, *, bits: int = 4, group_size: int | None = 64, modules: list[str] | None = None):
    """A quantized model holding `model`'s weights: the format's default modules (or `modules`)
    become clover's quant modules, every other tensor is shared with `model` (not copied)."""
    from ..models import build_model
    from ..quant.format import quantizable, quantize_tensor, select_modules
    from ..quant.loader import _make_module, _set_module

    config = model.config
    dtype = model.dtype
    names = modules if modules is not None else select_modules(config)
    targets = quantizable(config)
    qmodel = build_model(config, device="meta")
    replaced: set[str] = set()
    for name in names:
        t = targets[name]
        src = model.get_submodule(name)
        module = _make_module(t, bits, group_size, dtype)
        if t.kind == "experts":
            for part in ("gate_up_proj", "down_proj"):
                module.set_quantized(part, quantize_tensor(getattr(src, part), bits, group_size), dtype=dtype)
        else:
            q = quantize_tensor(src.weight, bits, group_size)
            bias = getattr(src, "bias", None)
            if bits == 8:
                module.set_quantized(q["qweight"], q["scales"], bias, dtype=dtype)
            else:
                module.set_quantized(q["qweight"], q["scales"], q["zeros"], bias, dtype=dtype)
        _set_module(qmodel, name, module)
        replaced.update(f"{name}.{k}" for k, _ in src.named_parameters())
    shared = {k: v for k, v in model.state_dict().items() if k not in replaced}
    qmodel.load_state_dict(shared, strict=False, assign=True)
    left = [n for n, p in list(qmodel.named_parameters()) + list(qmodel.named_buffers()) if p.is_meta]
    if left:
        raise RuntimeError(f"quantize_model: nothing for {left[:5]}")
    return qmodel.eval()


# ---------------------------------------------------------------------------- accounting
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layer_bytes(model) -> list[dict]:
    """Per decoder layer: 'dense' (every weight a forward reads whatever the routing) and 'expert'
    (one routed expert), in the model's storage (bf16, or packed int4 + scales/zeros)."""
    out = []
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        ex_ids = {id(t) for t in (list(experts.parameters()) + list(experts.buffers()))} if experts is not None else set()
        dense = sum(_nbytes(t) for t in list(layer.parameters()) + list(layer.buffers()) if id(t) not in ex_ids)
        expert = 0
        if experts is not None:
            expert = sum(_nbytes(t) for t in list(experts.parameters()) + list(experts.buffers())) // experts.num_experts
        out.append({"type": layer.layer_type, "dense": dense, "expert": expert})
    return out


def head_bytes(model) -> int:
    return sum(_nbytes(t) for t in list(model.lm_head.parameters()) + list(model.lm_head.buffers())) + _nbytes(model.model.norm.weight)


def layer_state_bytes(cache, prefix_len: int) -> list[int]:
    """Cache bytes each layer reads: K/V up to the prefix, or the GDN recurrent and conv states."""
    from ..cache import AttentionState

    out = []
    for s in cache.layers:
        if isinstance(s, AttentionState):
            out.append(sum(_nbytes(t[:, :, :prefix_len]) for t in s.tensors()))
        else:
            out.append(sum(_nbytes(t) for t in s.tensors()))
    return out


class LayerClock:
    """Forward hooks timing each decoder layer and the lm_head of one model (CPU: no sync needed)."""

    def __init__(self, model) -> None:
        self.layers: list[float] = []
        self.head = 0.0
        self._t = 0.0
        self._handles = []
        for layer in model.model.layers:
            self._handles.append(layer.register_forward_pre_hook(self._start))
            self._handles.append(layer.register_forward_hook(self._stop_layer))
        self._handles.append(model.lm_head.register_forward_pre_hook(self._start))
        self._handles.append(model.lm_head.register_forward_hook(self._stop_head))

    def reset(self) -> None:
        self.layers, self.head = [], 0.0

    def _start(self, *_):
        self._t = time.perf_counter()

    def _stop_layer(self, *_):
        self.layers.append(time.perf_counter() - self._t)

    def _stop_head(self, *_):
        self.head += time.perf_counter() - self._t

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# ------------------------------------------------------------------------------ measuring
def forward_kinds(block_size: int, expert_budget: int | None) -> dict[str, dict]:
    """name -> step arguments (besides the cache); `budget` rows share experts in the denoise block."""
    kinds = {"ar": {"commit": 1, "denoise": 0, "budget": None},
             "denoise": {"commit": 0, "denoise": block_size, "budget": None}}
    if expert_budget is not None:
        kinds["denoise_shared"] = {"commit": 0, "denoise": block_size, "budget": expert_budget}
    kinds["verify"] = {"commit": block_size, "denoise": block_size, "budget": None}
    if expert_budget is not None:
        kinds["verify_shared"] = {"commit": block_size, "denoise": block_size, "budget": expert_budget}
    return kinds


def run_slice(*, layers: int = 4, quick: bool = False, dtypes: tuple[str, ...] = ("bf16", "int4"),
              prefix: int | None = None, block_size: int = 32, expert_budget: int | None = 24,
              repeat: int | None = None, group_size: int = 64, bandwidth_bytes: int | None = None,
              seed: int = 0, progress=None) -> dict:
    config = slice_config(layers, quick)
    prefix = prefix or (16 if quick else 128)
    repeat = repeat or (2 if quick else 5)
    if quick:
        block_size = min(block_size, 8)
        expert_budget = None if expert_budget is None else min(expert_budget, 2 * config.num_experts_per_tok)
    bandwidth_bytes = bandwidth_bytes or (32 if quick else 1024) * 2**20
    say = progress or (lambda msg: None)
    from .roofline import measure_bandwidth

    say("bandwidth")
    bw = measure_bandwidth(bandwidth_bytes)
    t0 = time.perf_counter()
    say("building the bf16 slice")
    base = build_slice_model(config, seed=seed)
    build = {"bf16": time.perf_counter() - t0}
    models = {}
    if "bf16" in dtypes:
        models["bf16"] = base
    if "int4" in dtypes:
        say("quantizing to int4")
        t0 = time.perf_counter()
        models["int4"] = quantize_model(base, bits=4, group_size=group_size)
        build["int4"] = time.perf_counter() - t0
    if "bf16" not in dtypes:
        del base

    gen = torch.Generator().manual_seed(seed + 1)
    V = config.vocab_size
    prompt = torch.randint(0, V - 1, (1, prefix), generator=gen)
    draft = torch.randint(0, V - 1, (1, block_size), generator=gen)
    # a block mid-denoise: every other position already unmasked (an all-masked block of identical
    # inputs routes every position alike under random weights, which would understate the experts)
    block = torch.full((1, block_size), config.mask_token_id, dtype=torch.long)
    block[:, 1::2] = torch.randint(0, V - 1, (1, block_size // 2), generator=gen)
    tok = draft[:, :1]
    kinds = forward_kinds(block_size, expert_budget)

    caches, clocks, snaps = {}, {}, {}
    with torch.inference_mode():
        for name, m in models.items():
            say(f"prefill {name}")
            caches[name] = m.make_cache(1, prefix + 2 * block_size + 8)
            m.step(caches[name], commit_ids=prompt)
            snaps[name] = caches[name].snapshot()
            clocks[name] = LayerClock(m)

        def call(name: str, kind: dict):
            m, cache = models[name], caches[name]
            commit = (tok if kind["commit"] == 1 else draft) if kind["commit"] else None
            out = m.step(cache, commit_ids=commit, denoise_ids=block if kind["denoise"] else None,
                         expert_budget=kind["budget"], all_logits=kind["commit"] > 1, track_experts=True)
            cache.restore(snaps[name])
            return out

        samples: dict[tuple[str, str], list[dict]] = {(n, k): [] for n in models for k in kinds}
        for r in range(repeat + 1):  # the first round is the warm-up
            for name in models:
                for kname, kind in kinds.items():
                    say(f"round {r}/{repeat} {name} {kname}")
                    clocks[name].reset()
                    t0 = time.perf_counter()
                    out = call(name, kind)
                    total = time.perf_counter() - t0
                    if r:
                        samples[(name, kname)].append({"total": total, "layers": list(clocks[name].layers),
                                                       "head": clocks[name].head, "touched": list(out.experts_touched)})
        for c in clocks.values():
            c.remove()

    results: dict[str, dict] = {}
    for name, m in models.items():
        lb = layer_bytes(m)
        hb = head_bytes(m)
        state = layer_state_bytes(caches[name], prefix)
        per_kind = {}
        for kname, kind in kinds.items():
            ss = samples[(name, kname)]
            n_layers = len(lb)
            layer_ms = [1e3 * statistics.median(s["layers"][i] for s in ss) for i in range(n_layers)]
            touched = [statistics.mean(s["touched"][i] for s in ss) for i in range(n_layers)]
            head_ms = 1e3 * statistics.median(s["head"] for s in ss)
            total_ms = 1e3 * statistics.median(s["total"] for s in ss)
            other_ms = max(0.0, total_ms - sum(layer_ms) - head_ms)
            rows = []
            for i, b in enumerate(lb):
                nbytes = b["dense"] + touched[i] * b["expert"] + state[i]
                gbps = nbytes / (layer_ms[i] / 1e3) / 1e9
                rows.append({"layer": i, "type": b["type"], "ms": layer_ms[i], "experts_touched": touched[i],
                             "bytes": int(nbytes), "gbps": gbps, "pct_of_read_bandwidth": 100 * gbps / bw["read_gbps"],
                             "bound_ms": 1e3 * nbytes / (bw["read_gbps"] * 1e9)})
            gdn = [r for r in rows if r["type"] == "linear_attention"]
            att = [r for r in rows if r["type"] == "full_attention"]
            mean = lambda rs, k: statistics.mean(r[k] for r in rs) if rs else None  # noqa: E731
            n_att = FULL_LAYERS // config.full_attention_interval
            n_gdn = FULL_LAYERS - n_att
            g_ms, a_ms = mean(gdn, "ms"), mean(att, "ms")
            g_b, a_b = mean(gdn, "bytes"), mean(att, "bytes")
            extrap = None
            if g_ms is not None and a_ms is not None:
                fwd_ms = n_gdn * g_ms + n_att * a_ms + head_ms + other_ms
                fwd_bytes = n_gdn * g_b + n_att * a_b + hb
                extrap = {"layers": FULL_LAYERS, "ms": fwd_ms, "layers_ms": n_gdn * g_ms + n_att * a_ms,
                          "bytes": int(fwd_bytes), "bound_ms": 1e3 * fwd_bytes / (bw["read_gbps"] * 1e9),
                          "pct_of_read_bandwidth": 100 * fwd_bytes / (fwd_ms / 1e3) / 1e9 / bw["read_gbps"]}
            per_kind[kname] = {
                **kind,
                "tokens": kind["commit"] + kind["denoise"],
                "ms_total": total_ms,
                "ms_per_layer": sum(layer_ms) / n_layers,
                "ms_gdn_layer": g_ms,
                "ms_attention_layer": a_ms,
                "ms_lm_head": head_ms,
                "ms_other": other_ms,
                "experts_touched_per_layer": statistics.mean(touched),
                "bytes_per_layer": statistics.mean(r["bytes"] for r in rows),
                "pct_of_read_bandwidth": 100 * sum(r["bytes"] for r in rows) / (sum(layer_ms) / 1e3) / 1e9 / bw["read_gbps"],
                "layers": rows,
                "extrapolated_40_layers": extrap,
            }
        results[name] = {"layer_bytes": lb, "head_bytes": hb, "forwards": per_kind}
    ar = {n: r["forwards"]["ar"]["ms_per_layer"] for n, r in results.items()}
    ratios = {n: {k: f["ms_per_layer"] / ar[n] for k, f in r["forwards"].items()} for n, r in results.items()}
    return {
        "schema": SCHEMA,
        "quick": quick,
        "note": (f"{layers} of {FULL_LAYERS} layers at the real shapes, random weights; the 40-layer figures are an "
                 "extrapolation (30 x mean GDN layer + 10 x attention layer + lm_head + step overhead)"),
        "config": shape_summary(config),
        "prefix": prefix,
        "block_size": block_size,
        "expert_budget": expert_budget,
        "group_size": group_size,
        "repeat": repeat,
        "bandwidth": bw,
        "build_seconds": build,
        "machine": machine(),
        "models": results,
        "per_layer_ratio_to_ar": ratios,
    }


def slice_table(result: dict):
    from rich.table import Table

    bw = result["bandwidth"]
    t = Table(title=(f"clover bench slice · {result['config']['num_hidden_layers']} of {FULL_LAYERS} layers of the "
                     f"35B-A3B (random weights) · prefix {result['prefix']} · {result['machine']['torch_threads']} threads · "
                     f"read {bw['read_gbps']:.1f} GB/s · 40-layer columns are an extrapolation"), title_justify="left")
    for col in ("dtype", "forward", "tokens", "ms/layer", "× AR", "GDN ms", "attn ms", "experts/layer",
                "MB/layer", "% read BW", "lm_head ms", "40-layer ms (extrap.)", "40-layer bound ms"):
        t.add_column(col, justify="left" if col in ("dtype", "forward") else "right")
    for name, r in result["models"].items():
        for kname, f in r["forwards"].items():
            e = f["extrapolated_40_layers"]
            t.add_row(name, kname, str(f["tokens"]), f"{f['ms_per_layer']:.1f}",
                      f"{result['per_layer_ratio_to_ar'][name][kname]:.2f}",
                      "-" if f["ms_gdn_layer"] is None else f"{f['ms_gdn_layer']:.1f}",
                      "-" if f["ms_attention_layer"] is None else f"{f['ms_attention_layer']:.1f}",
                      f"{f['experts_touched_per_layer']:.1f}", f"{f['bytes_per_layer'] / 1e6:.0f}",
                      f"{f['pct_of_read_bandwidth']:.0f}%", f"{f['ms_lm_head']:.1f}",
                      "-" if e is None else f"{e['ms']:.0f}", "-" if e is None else f"{e['bound_ms']:.0f}")
    return t
