"""Static-shape steps compiled whole (`clover.load(compile=True)`), gpt-fast style.

What is compiled is the eager step's own forward, `model.forward_step(..., static=True)`, as
`torch.compile(fullgraph=True, dynamic=False)` graphs from the token ids to the logits, with no
graph break and no host read inside. `static=True` picks the fixed-shape form of each piece of that
one layer loop: K/V scattered at each row's length into the buffers at their full capacity and
attention over the whole capacity under the length mask (`cached_attention_mask(key_slots=)`); the
GDN states updated in place, a block commit as one WY chunk (`one_chunk_gated_delta_rule`); the
routed experts grouped on the device (`moe.static_expert_forward`); the experts touched counted on
the device. The forward kinds served:

- **ar**: one token per row committed (`step(cache, commit_ids=[B, 1])`);
- **denoise**: one block denoised against the cache (`step(cache, denoise_ids=[B, Bd])`);
- **commit+denoise**: a finished block committed (rows may commit fewer tokens, `n_commit`) fused
  with the next block's first denoise step;
- **verify**: the same with logits at every commit position and the GDN commit inputs returned for
  a rollback (speculative decoding: the draft verified causally, the next block drafted), or a
  commit alone of that kind (dflash: the anchor and drafts verified, with the hidden states of the
  layers the drafter reads, `hidden_out`).

Every other forward runs eagerly: the prompt prefill (its length would be one graph more), and
every forward of a model with quantized experts (`unsupported_reason`). A speculative rollback
re-runs the recurrence over the kept tokens eagerly (`HybridCache.rollback`). A graph is built per
(forward kind, batch size, block width, cache capacity, ragged commit or not, expert budget);
`warm` compiles one ahead of use. To keep requests of different lengths on one graph,
`make_cache` rounds the capacity up to a multiple of `CAPACITY_QUANTUM`; past `RECOMPILE_LIMIT`
graphs, new shapes run eagerly (one warning). Results equal the eager step up to floating-point
reassociation (tests compare generated tokens); compile times and speed-ups are in
docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter

import torch

CAPACITY_QUANTUM = 256
RECOMPILE_LIMIT = 64
KINDS = ("ar", "denoise", "commit+denoise", "verify")


def unsupported_reason(model) -> str | None:
    """Why `model` cannot use the static steps, or None."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            return (f"compile: {type(experts).__name__} (quantized experts) has no static dispatch; "
                    f"load this model without compiling")
    return None


def round_capacity(capacity: int) -> int:
    return -(-int(capacity) // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


def step_kind(commit_ids, n_commit, denoise_ids, *, all_logits: bool, record: bool) -> str | None:
    """Which compiled kind serves this step, or None (eager): a prompt prefill, a commit of another
    length than the block's, logits at every position without a commit, a row with nothing to commit
    in an AR step."""
    Tc = 0 if commit_ids is None else commit_ids.shape[1]
    Bd = 0 if denoise_ids is None else denoise_ids.shape[1]
    if all_logits and not Tc:
        return None
    if Tc and not (Tc == 1 or Tc == Bd or (record and not Bd)):
        return None  # a prompt: its length would be one more graph
    if Tc == 1 and n_commit is not None:
        return None
    if record:
        return "verify"
    return "ar" if Tc == 1 and not Bd else "commit+denoise" if Tc else "denoise"


def compile_static(fn, device: torch.device, backend: str = "inductor"):
    """`fn` compiled as the static steps are: one graph-break-free graph per input shape."""
    # one graph per (forward kind, batch size, cache capacity, ...): more than dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    opts = dict(fullgraph=True, dynamic=False, backend=backend)
    if backend == "inductor" and device.type == "cpu":
        # a C++ wrapper around the kernels instead of a Python one: measured 3.0x vs 2.4x over eager
        # on the bundled model's AR step (docs/benchmarks.md)
        opts["options"] = {"cpp_wrapper": True}
    return torch.compile(fn, **opts)


class StaticSteps:
    """The compiled forward of one model; `run` serves a step when it is one of `KINDS`."""

    def __init__(self, model, *, backend: str = "inductor") -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        model.model.rotary_emb.inv_freq(model.device)  # cached outside the graph
        self._forward = compile_static(functools.partial(model.forward_step, static=True), model.device, backend)
        self.calls: Counter = Counter()  # forwards served per kind (and "eager": past the graph limit)
        self.limit_hit = False

    def run(self, commit_ids, n_commit, denoise_ids, lengths: torch.Tensor, states: list, *, expert_budget,
            expert_rank: str, all_logits: bool, record: bool, hidden_out: dict | None = None):
        """`model.forward_step`'s result from the compiled graph, or None when the step is not one
        of its kinds (or past the graph limit): the caller then runs it eagerly. Called by `step`
        with the cache already large enough and `n_commit` None when every row commits all its
        tokens; nothing is written before the graph runs."""
        kind = step_kind(commit_ids, n_commit, denoise_ids, all_logits=all_logits, record=record)
        if kind is None:
            return None
        try:
            out = self._forward(commit_ids, n_commit, denoise_ids, lengths, states, expert_budget=expert_budget,
                                expert_rank=expert_rank, all_logits=all_logits, record=record, hidden_out=hidden_out)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # more shapes than RECOMPILE_LIMIT graphs: raised while compiling, before the graph runs
            # (nothing was written to the cache), so this call and later new shapes run eagerly
            if not self.limit_hit:
                warnings.warn(f"compile: {RECOMPILE_LIMIT} compiled graphs reached (forward kinds x "
                              f"batch sizes x cache sizes); new shapes run eagerly", RuntimeWarning, stacklevel=3)
            self.limit_hit = True
            self.calls["eager"] += 1
            return None
        self.calls[kind] += 1
        return out

    def warm(self, kind: str, batch: int, width: int, capacity: int, *, ragged: bool = False,
             expert_budget: int | None = None, expert_rank: str = "sum") -> None:
        """Compile (or find compiled) the graph of one shape ahead of use, on a scratch cache:
        `kind` one of `KINDS`, `batch` rows, `width` the block (1 for "ar"), `capacity` the cache
        capacity as `make_cache` rounds it; `ragged`: rows commit fewer than `width` tokens
        (`n_commit` given; commit kinds only). The graph is then reused by any step of that shape."""
        if kind not in KINDS:
            raise ValueError(f"static step kind {kind!r}: expected one of {', '.join(KINDS)}")
        m = self.model
        cache = m.make_cache(batch, capacity)
        Tc = 1 if kind == "ar" else 0 if kind == "denoise" else width
        if Tc > 1 and ragged:
            n = torch.full((batch,), Tc - 1, dtype=torch.long, device=m.device)
        else:
            n = None
        ids = torch.zeros(batch, width, dtype=torch.long, device=m.device)
        commit = ids[:, :Tc] if Tc else None
        denoise = ids if kind != "ar" else None
        states = [s.tensors() for s in cache.layers]
        with torch.no_grad():
            out = self.run(commit, n, denoise, cache.lengths, states, expert_budget=expert_budget,
                           expert_rank=expert_rank, all_logits=kind == "verify", record=kind == "verify")
        if out is None:
            raise ValueError(f"static step {kind} (batch {batch}, width {width}, capacity {capacity}) was not compiled")
        self.calls[kind] -= 1  # a warm-up serves no request
