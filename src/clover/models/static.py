"""Static-shape steps compiled whole (`clover.load(compile="static")`), gpt-fast style.

The forwards of the AR and diffusion loops run as `torch.compile(fullgraph=True, dynamic=False)`
graphs, from the token ids to the logits, with no graph break and no host read inside:

- **ar**: one token per row committed (`step(cache, commit_ids=[B, 1])`);
- **denoise**: one block denoised against the cache (`step(cache, denoise_ids=[B, Bd])`);
- **commit+denoise**: a finished block committed (rows may commit fewer tokens, `n_commit`) fused
  with the next block's first denoise step;
- **verify**: the same with logits at every commit position and the GDN commit inputs returned for
  a rollback (speculative decoding: the draft verified causally, the next block drafted).

How each part avoids host reads and data-dependent shapes: K/V are written by a scatter at each
row's length into the buffers at their full capacity, and attention runs over the whole capacity
under a length mask; the GDN layers update their states in place (`GatedDeltaNet.commit_static`:
the decode-step recurrence for one token, one WY chunk, `one_chunk_gated_delta_rule`, for a block);
the routed experts go through `moe.static_expert_forward` (device-side grouping); the experts
touched per layer are counted on the device.

Every other forward runs the eager `step`: the prompt prefill (its length would be one graph
more), and every forward of a model with quantized experts (`unsupported_reason`). A speculative
rollback re-runs the recurrence over the kept tokens eagerly (`HybridCache.rollback`). A graph is built per (forward kind, batch size,
block size, cache capacity); to keep requests of different lengths on one graph, `make_cache`
rounds the capacity up to a multiple of `CAPACITY_QUANTUM`; past `RECOMPILE_LIMIT` graphs, new
shapes run eagerly (one warning). Results equal the eager step up to
floating-point reassociation (tests compare generated tokens); compile times and speed-ups are in
docs/benchmarks.md.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn.functional as F

from ..cache import HybridCache, scatter_kv
from ..moe import BlockSharing
from .layers import Segments, cached_attention_mask, step_positions

CAPACITY_QUANTUM = 256


def unsupported_reason(model) -> str | None:
    """Why `model` cannot use the static steps, or None."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            return (f"compile=\"static\": {type(experts).__name__} (quantized experts) has no static dispatch; "
                    f"load this model with compile=\"layers\" (CLI: --compile-layers) or without compiling")
    return None


RECOMPILE_LIMIT = 64


class StaticSteps:
    """The compiled forwards of one model; `try_step` runs one when the call fits."""

    def __init__(self, model, *, backend: str = "inductor") -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        model.model.rotary_emb.inv_freq(model.device)  # cached outside the graph
        # one graph per (forward kind, batch size, cache capacity): more than dynamo's default of 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        opts = dict(fullgraph=True, dynamic=False, backend=backend)
        if backend == "inductor" and model.device.type == "cpu":
            # a C++ wrapper around the kernels instead of a Python one: measured 3.0x vs 2.4x over eager
            # on the bundled model's AR step (docs/benchmarks.md)
            opts["options"] = {"cpp_wrapper": True}
        self._forward = torch.compile(self._graph, **opts)
        self.calls: Counter = Counter()  # forwards served per kind (and "eager": past the graph limit)
        self.limit_hit = False

    def try_step(self, cache: HybridCache, commit_ids, n_commit, denoise_ids, *, expert_budget, expert_rank,
                 all_logits: bool, track_experts: bool):
        """(commit logits, denoise logits, experts touched) from a compiled graph, or None when the
        call is not one of its kinds (a prompt prefill, or a commit of another length than the
        block's). Called by `step` with the cache already large enough and `n_commit` None when
        every row commits all its tokens."""
        Tc = 0 if commit_ids is None else commit_ids.shape[1]
        if all_logits and not Tc:
            return None
        if Tc and not (Tc == 1 or (denoise_ids is not None and Tc == denoise_ids.shape[1])):
            return None  # a prompt: its length would be one more graph
        if Tc == 1 and n_commit is not None:  # a row with nothing to commit: eager
            return None
        kv = [(s.keys, s.values) for s in cache.attention_states()]
        gdn = [(s.conv, s.recurrent) for s in cache.deltanet_states()]
        record = cache._recording and Tc > 0
        try:
            commit_logits, denoise_logits, touched, records = self._forward(
                commit_ids, n_commit, denoise_ids, cache.lengths, kv, gdn, expert_budget, expert_rank, all_logits,
                record)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # more shapes than RECOMPILE_LIMIT graphs: raised while compiling, before the graph runs
            # (nothing was written to the cache), so this call and later new shapes run eagerly
            if not self.limit_hit:
                warnings.warn(f"compile=\"static\": {RECOMPILE_LIMIT} compiled graphs reached (forward kinds x "
                              f"batch sizes x cache sizes); new shapes run eagerly", RuntimeWarning, stacklevel=3)
            self.limit_hit = True
            self.calls["eager"] += 1
            return None
        if record:  # what the eager step keeps for `HybridCache.rollback`
            for state, rec in zip(cache.deltanet_states(), records):
                state.record = rec
        if Tc:
            cache.advance(n_commit if n_commit is not None else Tc)
        kind = ("verify" if record else "ar" if Tc == 1 and denoise_ids is None else "commit+denoise" if Tc
                else "denoise")
        self.calls[kind] += 1
        return commit_logits, denoise_logits, touched.tolist() if track_experts else []

    def _graph(self, commit_ids, n, denoise_ids, lengths: torch.Tensor, kv: list, gdn: list,
               expert_budget: int | None, expert_rank: str, all_logits: bool = False, record: bool = False):
        """commit_ids [B, Tc] (n [B] valid per row, None = all) and/or denoise_ids [B, Bd] ->
        (commit logits [B, V] at each row's last commit token (`all_logits`: [B, Tc, V]), denoise
        logits [B, Bd, V], experts touched per MoE layer, per GDN layer the commit's inputs when
        `record`); the cache tensors in `kv` and `gdn` are updated in place."""
        m = self.model
        parts = [p for p in (commit_ids, denoise_ids) if p is not None]
        ids = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        B = ids.shape[0]
        Tc = 0 if commit_ids is None else commit_ids.shape[1]
        Bd = 0 if denoise_ids is None else denoise_ids.shape[1]
        dev = ids.device
        n_eff = n if n is not None else torch.full_like(lengths, Tc)
        x = m.model.embed_tokens(ids)
        rope = m.model.rotary_emb(step_positions(lengths, n_eff, Tc, Bd), x.dtype)
        sharing = BlockSharing(expert_budget, B, Tc, expert_rank) if expert_budget is not None and Bd else None
        segments = Segments(commit_len=Tc, denoise_len=Bd, n_commit=n)
        mask = cached_attention_mask(lengths, segments, key_slots=kv[0][0].shape[2]) if kv else None
        touched: list = []
        records: list = []
        a = d = 0
        for layer in m.model.layers:
            h = layer.input_layernorm(x)
            if layer.layer_type == "full_attention":
                kk, vv = kv[a]
                a += 1
                attn = layer.self_attn
                q, k, v, gate = attn.project(h, rope)
                if Tc:
                    scatter_kv(kk, vv, k[:, :, :Tc], v[:, :, :Tc], lengths)
                if Bd:
                    kk, vv = torch.cat([kk, k[:, :, Tc:]], dim=2), torch.cat([vv, v[:, :, Tc:]], dim=2)
                out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask,
                                                     enable_gqa=attn.num_kv_heads != attn.num_heads)
                h = attn.finish(out, gate)
            else:
                conv, rec = gdn[d]
                d += 1
                gd = layer.linear_attn
                mixed, z, g, beta = gd.project(h)
                outs = []
                if Tc:
                    o, inputs = gd.commit_static(mixed[:, :, :Tc], g[:, :Tc], beta[:, :Tc], n, conv, rec)
                    outs.append(o)
                    if record:
                        records.append(inputs)
                if Bd:
                    outs.append(gd.denoise_block(mixed[:, :, Tc:], conv, g[:, Tc:], rec))
                h = gd.finish(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1), z)
            x = x + h
            y, stats = layer.mlp(layer.post_attention_layernorm(x), sharing, static=True)
            if stats is not None:
                touched.append(stats.experts_touched)
            x = x + y
        commit_logits = None
        if Tc:
            commit_logits = m._logits(x[:, :Tc]) if all_logits else m._logits(x[torch.arange(B, device=dev), n_eff - 1])
        denoise_logits = m._logits(x[:, Tc:]) if Bd else None
        touched_t = torch.stack(touched) if touched else torch.zeros(0, dtype=torch.long, device=dev)
        return commit_logits, denoise_logits, touched_t, tuple(records)


def round_capacity(capacity: int) -> int:
    return -(-int(capacity) // CAPACITY_QUANTUM) * CAPACITY_QUANTUM
