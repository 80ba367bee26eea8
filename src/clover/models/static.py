"""Static-shape steps compiled whole (`clover.load(compile=True)`), gpt-fast style.

What is compiled is the eager step's own forward, `model.forward_step(..., static=True)`, as
`torch.compile(fullgraph=True, dynamic=False)` graphs from the token ids to the logits, with no
graph break and no host read inside. `static=True` picks the fixed-shape form of each piece of that
one layer loop: K/V scattered at each row's length into the buffers at their full capacity and
attention over the whole capacity under the length mask (`cached_attention_mask(key_slots=)`); the
GDN states updated in place, a block commit as one WY chunk (`one_chunk_gated_delta_rule`); the
routed experts grouped on the device (`moe.static_expert_forward`); the experts touched counted on
the device. A step's kind is the engine's (`step.Step.kind`); `graph_kind` picks the graph that
serves it where its shapes fit one. The graphs:

- **ar**: a "commit" step of one token per row (`Step("commit", commit_ids=[B, 1])`);
- **denoise**: a "denoise" step, one block against the cache (`Step("denoise", denoise_ids=[B, Bd])`);
- **commit+denoise**: a "commit+denoise" step, a finished block committed (rows may commit fewer
  tokens, `n_commit`) fused with the next block's first denoise step;
- **verify**: a "verify" step with a block: the same with logits at every commit position and the
  GDN commit inputs returned for a rollback (speculative decoding: the draft verified causally, the
  next block drafted);
- **verify-commit**: a "verify" step without a block (dflash: the anchor and drafts verified, with
  the hidden states of the layers the drafter reads, `Step.hidden_layers`; a graph per set of those
  layers);
- **block-commit**: a "commit" step of one whole block per row and no block to denoise (Fast-dLLM
  v2, `first_token` "commit_argmax": the next block's first token is this commit's argmax).

A model that commits block-causally (`commit_attention` "block": SDAR, LLaDA2, Fast-dLLM v2; the
step's `commit_block`) runs the same graphs: the block-causal commit is the attention mask's. It
decodes by block diffusion only, so `load_shapes` compiles its denoise, commit+denoise and
block-commit graphs, no AR nor verify ones.

Every other forward runs eagerly: the prompt prefill (its length would be one graph more), and
every forward of a model with quantized experts (`unsupported_reason`). A speculative rollback
re-runs the recurrence over the kept tokens eagerly (`HybridCache.rollback`). A graph is built per
(forward kind, batch size, block width, cache capacity, ragged commit or not, expert budget);
`warm` compiles one ahead of use. To keep requests of different lengths on one graph,
`make_cache` rounds the capacity up to a power of two of at least `CAPACITY_QUANTUM` (the cache
grows by doubling, so it stays on those sizes); past `RECOMPILE_LIMIT` graphs, new shapes run
eagerly (one warning).

`clover.load(compile=True)` and `clover serve --compile` compile a bounded set at load
(`load_shapes`: the AR step and, at the model's block size, the denoise, commit+denoise and verify
forwards, with a DFlash drafter its verify-commit at the drafter's block size, for batch sizes in powers of two (and the largest batch itself) and the capacities in `LOAD_CAPACITIES`), with a
progress bar (`warm_all`), and then freeze: a shape outside the set runs eagerly instead of
compiling, so no request waits on a compile. A batch between two compiled sizes runs on the larger
graph in place: the cache keeps memory for that many rows (`HybridCache.reserve_rows`) and the
spare rows are the dummies. Results equal the eager step up to floating-point
reassociation (tests compare generated tokens); compile times and speed-ups are in
docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter

import torch

from ..cache import first_rows, row_room
from .step import Step

CAPACITY_QUANTUM = 512  # the smallest static cache: prompt + max_new_tokens + the plan's reserve up to 512 share one graph
LOAD_CAPACITIES = (CAPACITY_QUANTUM,)  # the cache capacities compiled at load
RECOMPILE_LIMIT = 64
KINDS = ("ar", "denoise", "commit+denoise", "verify", "verify-commit", "block-commit")
# the compiled kinds that can serve a step of each `Step` kind, the usual one first (`graph_kind` picks one)
GRAPHS_OF = {"commit": ("ar", "block-commit"), "denoise": ("denoise",), "commit+denoise": ("commit+denoise",),
             "verify": ("verify", "verify-commit")}


def unsupported_reason(model) -> str | None:
    """Why `model` cannot use the static steps, or None."""
    cfg = model.config
    if cfg.commit_attention == "full" or (cfg.commit_attention == "block" and cfg.has_linear_attention):
        # a block-causal commit is the attention mask's (`cached_attention_mask`); the whole-sequence
        # models decode with the canvas mode, which has no static steps
        return (f"compile: the static steps commit causally; this model commits block-causally "
                f"(commit_attention {cfg.commit_attention!r}); load it without compiling")
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            return (f"compile: {type(experts).__name__} (quantized experts) has no static dispatch; "
                    f"load this model without compiling")
    return None


def round_capacity(capacity: int) -> int:
    """The power of two at least `capacity` and `CAPACITY_QUANTUM`."""
    return max(CAPACITY_QUANTUM, 1 << max(0, int(capacity) - 1).bit_length())


def call_frozen(fn, *args, frozen: bool, **kw):
    """`fn(*args, **kw)`, a compiled function; where `frozen`, under dynamo's "fail_on_recompile"
    stance, and None when it has no graph of these shapes (refused before anything ran, so the
    caller runs the step eagerly)."""
    try:
        with torch.compiler.set_stance("fail_on_recompile") if frozen else contextlib.nullcontext():
            return fn(*args, **kw)
    except RuntimeError as e:
        if not (frozen and "fail_on_recompile" in str(e)):
            raise
        return None


def load_shapes(config, *, batches=(1,), capacities=LOAD_CAPACITIES, drafter=None) -> list[tuple]:
    """The graphs compiled at load, as `StaticSteps.warm` arguments (kind, batch, width, capacity,
    ragged, hidden): the AR step and, for a model with a mask token, the denoise, commit+denoise and
    verify forwards at its block size (the diffusion block and speculative draft), at every batch
    size in `batches` and every capacity in `capacities`; with a DFlash `drafter` (its
    `verify_widths` and `target_layer_ids`), dflash's verify-commit of the anchor and its drafts at
    each of those widths, returning the hidden states of those layers. At batch > 1 the
    commit+denoise kind, and the verify kind at every batch, are compiled ragged only (rows may commit fewer tokens than the block; a frozen `run` serves
    every such commit there, a draft shorter than the block padded to it). A model that commits
    block-causally: its denoise and commit+denoise forwards and, where the block's first token is the
    commit's argmax, the block-commit (ragged at batch > 1)."""
    shapes = []
    w = int(config.block_size) if config.mask_token_id is not None else None
    if config.commit_attention == "block":  # SDAR, LLaDA2, Fast-dLLM v2: block diffusion only (no AR, no verify)
        for b in batches:
            for cap in capacities:
                shapes += [("denoise", b, w, cap, False, ()), ("commit+denoise", b, w, cap, b > 1, ())]
                if config.first_token == "commit_argmax":  # the commit-only forward of a block's first token
                    shapes.append(("block-commit", b, w, cap, b > 1, ()))
        return shapes
    for b in batches:
        ragged = b > 1
        for cap in capacities:
            shapes.append(("ar", b, 1, cap, False, ()))
            if w is not None:
                shapes += [("denoise", b, w, cap, False, ()), ("commit+denoise", b, w, cap, ragged, ()),
                           ("verify", b, w, cap, True, ())]
            if drafter is not None:  # every row verifies as many drafts: not ragged (a batch with a prefill is eager)
                shapes += [("verify-commit", b, int(w), cap, False, tuple(drafter.target_layer_ids))
                           for w in drafter.verify_widths]
    return shapes


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes compiled at load for up to `max_batch` rows: the powers of two below it and
    `max_batch` itself, so that a full batch has its own graph (a batch between two sizes runs on the
    larger one with dummy rows)."""
    top = max(1, int(max_batch))
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def graph_kind(step) -> str | None:
    """The compiled kind (`KINDS`) that serves `step` (a `clover.models.step.Step`), or None (eager):
    the step's own kind where its shapes fit a graph -- a commit of one token per row ("ar"), a
    block commit as wide as the block ("commit+denoise", "verify"), a verify's commit alone
    ("verify-commit"), a block-causal commit of one block alone ("block-commit"); not a prompt (its length would be one graph more), nor a commit of one
    token on a row with nothing to commit, nor logits at every position without a commit."""
    Tc, Bd, n_commit = step.commit_len, step.denoise_len, step.n_commit
    verify = step.kind == "verify"
    if step.kind == "commit" and Tc > 1 and Tc == step.commit_block:
        return "block-commit"
    if step.all_logits and not Tc:
        return None
    if Tc and not (Tc == 1 or Tc == Bd or (verify and not Bd and n_commit is None)):
        return None
    if Tc == 1 and n_commit is not None:
        return None
    if verify and not Bd:
        return "verify-commit"
    return GRAPHS_OF[step.kind][0]


def compile_static(fn, device: torch.device, backend: str = "inductor", *, buffer_reuse: bool = True,
                   freezing: bool = False):
    """`fn` compiled as the static steps are: one graph-break-free graph per input shape.
    `buffer_reuse` False: inductor gives no buffer a second use (see `StaticSteps`). `freezing`:
    inductor's freezing for these graphs alone (`options`, not the global config): the weights are
    constants of the graph, a float32 linear's packed for oneDNN as the eager `kernels.packed` does
    (a second copy of them), so a graph must be rebuilt if the weights change."""
    # one graph per (forward kind, batch size, cache capacity, ...): more than dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    opts = dict(fullgraph=True, dynamic=False, backend=backend)
    if backend == "inductor" and device.type == "cpu":
        # a C++ wrapper around the kernels instead of a Python one: measured 3.0x vs 2.4x over eager
        # on the bundled model's AR step (docs/benchmarks.md)
        opts["options"] = {"cpp_wrapper": True}
    if backend == "inductor" and not buffer_reuse:
        opts.setdefault("options", {})["allow_buffer_reuse"] = False
    if backend == "inductor" and freezing:
        opts.setdefault("options", {})["freezing"] = True
    return torch.compile(fn, **opts)


class StaticSteps:
    """The compiled forward of one model; `run` serves a step when it is one of `KINDS`."""

    def __init__(self, model, *, backend: str = "inductor", freezing: bool = False) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.freezing = freezing  # the graphs' weights frozen in (`compile_static`; the drafter's too)
        model.model.rotary_emb.inv_freq(model.device)  # cached outside the graph
        # a block-causal model's graphs without inductor's buffer reuse: with it (torch 2.13, CPU), the
        # Qwen2 stack's (Fast-dLLM v2's) commit graphs left garbage in the first layer's key buffer
        # after the graph, its logits right (tests/test_released_compile.py, slow)
        self._forward = compile_static(functools.partial(model.forward_step, static=True), model.device, backend,
                                       buffer_reuse=model.config.commit_attention != "block", freezing=freezing)
        # a model denoised in sub-blocks reads at most a sub-block's logits a step: its denoise graphs
        # compute the last layer's outputs and the LM head at those positions only (`denoise_read`)
        cfg = model.config
        self.read_width = (cfg.sub_block if cfg.sub_block and cfg.sub_block < cfg.block_size and model.live_positions
                           else None)
        self.calls: Counter = Counter()  # forwards served per kind (and "eager": past the graph limit, or frozen)
        self.limit_hit = False
        self.frozen = False  # after `warm_all`: a shape without a graph runs eagerly, never compiles
        self.batches: tuple[int, ...] = ()  # the batch sizes `warm_all` compiled (a batch between them is padded)
        self.widths: frozenset[tuple[str, int]] = frozenset()  # the (kind, width) pairs `warm_all` compiled

    def run(self, step, lengths: torch.Tensor, states: list, *, record: bool, hidden_out: dict | None = None):
        """`model.forward_step`'s result for `step` (a `Step` without eager skips) from the compiled
        graph of its kind (`graph_kind`), or None when no graph serves it (or past the graph limit):
        the caller then runs it eagerly. Called by `run_step` with the cache already large enough and
        `n_commit` None when every row commits all its tokens; nothing is written before the graph runs."""
        kind = graph_kind(step)
        if kind is None:
            return None
        commit_ids, n_commit, denoise_ids = step.commit_ids, step.n_commit, step.denoise_ids
        B = lengths.shape[0]
        b = self.batch_for(B)
        if self.frozen and commit_ids is not None and kind != "verify-commit":
            Tc, Bd = commit_ids.shape[1], 0 if denoise_ids is None else denoise_ids.shape[1]
            if kind == "verify" and Tc < Bd:  # a draft shorter than the block (speculative after a rejection)
                n_commit = n_commit if n_commit is not None else torch.full_like(lengths, Tc)
                commit_ids = torch.cat([commit_ids, commit_ids.new_zeros(B, Bd - Tc)], 1)
            elif n_commit is None and Tc > 1 and (b > 1 or kind == "verify"):
                n_commit = torch.full_like(lengths, Tc)  # the ragged graph serves every commit
        kw = dict(expert_budget=step.expert_budget, expert_rank=step.expert_rank, all_logits=step.all_logits,
                  record=record, hidden_out=hidden_out, commit_block=step.commit_block)
        need = step.denoise_need
        if (self.read_width and kind in ("denoise", "commit+denoise") and need is not None and step.expert_budget is None
                and not step.all_logits and int(need.sum(1).max()) <= self.read_width):
            # each row's read positions first (then any others), K of them
            # (contiguous: a graph is specialised on its inputs' strides, and a padded batch's are)
            kw["denoise_read"] = torch.sort((~need).to(torch.uint8), dim=1, stable=True).indices[:, : self.read_width].contiguous()
        if b != B:
            return self._run_padded(kind, b, commit_ids, n_commit, denoise_ids, lengths, states, **kw)
        return self._call(kind, commit_ids, n_commit, denoise_ids, lengths, states, **kw)

    def _call(self, kind: str, *args, **kw):
        """The graph of `kind` on these inputs, or None (not compiled while frozen, or past the limit)."""
        try:
            out = call_frozen(self._forward, *args, frozen=self.frozen, **kw)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # more shapes than RECOMPILE_LIMIT graphs: raised while compiling, before the graph runs
            # (nothing was written to the cache), so this call and later new shapes run eagerly
            if not self.limit_hit:
                warnings.warn(f"compile: {RECOMPILE_LIMIT} compiled graphs reached (forward kinds x "
                              f"batch sizes x cache sizes); new shapes run eagerly", RuntimeWarning, stacklevel=4)
            self.limit_hit = True
            out = None
        if out is None:
            self.calls["eager"] += 1
            return None
        self.calls[kind] += 1
        return out

    def has_graph(self, kind: str, width: int) -> bool:
        """Whether a step of `kind` (a `Step` kind) at block `width` runs on a graph: not frozen (one
        is compiled on first use), or one of that width was compiled before freezing."""
        if not self.frozen:
            return True
        kinds = GRAPHS_OF[kind]
        return any(k in kinds and w == width for k, w in self.widths)

    def batch_for(self, rows: int) -> int:
        """The batch size of the graph that serves a step of `rows` rows: once frozen, the smallest
        compiled size at least `rows` (the cache keeps that many rows of memory, `HybridCache.reserve_rows`)."""
        return min((x for x in self.batches if x >= rows), default=rows) if self.frozen else rows

    def _run_padded(self, kind: str, b: int, commit_ids, n_commit, denoise_ids, lengths, states, **kw):
        """A step of B rows on the graph of `b` > B rows (frozen: the batch sizes compiled are powers
        of two): b - B dummy rows at length 0 are appended to the inputs, the graph runs, and the
        first B rows of its outputs are kept (the experts-touched count includes the dummy rows).
        The cache's tensors run in place with their spare rows as the dummies (`reserve_rows`, which
        `step` does), or else through padded copies written back after the graph."""
        B = lengths.shape[0]
        self.calls["padded"] += 1

        def pad(t, fill=0):
            return None if t is None else torch.cat([t, t.new_full((b - B,) + tuple(t.shape[1:]), fill)])

        if n_commit is not None:
            n_commit = pad(n_commit, commit_ids.shape[1])
        if kw.get("denoise_read") is not None:
            kw["denoise_read"] = pad(kw["denoise_read"])
        in_place = all(row_room(t) >= b for s in states for t in s)
        padded = [tuple(first_rows(t, b) if in_place else pad(t) for t in s) for s in states]
        out = self._call(kind, pad(commit_ids), n_commit, pad(denoise_ids), pad(lengths), padded, **kw)
        if out is None:
            return None
        hidden = kw.get("hidden_out")
        for i in hidden or ():
            hidden[i] = hidden[i][:B]
        if not in_place:
            for s, p in zip(states, padded):
                for t, tp in zip(s, p):
                    t.copy_(tp[:B])
        commit_logits, denoise_logits, touched, records = out
        cut = (lambda t: None if t is None else t[:B])
        records = tuple(tuple(x[:B] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == b else x for x in r)
                        for r in records)
        return cut(commit_logits), cut(denoise_logits), touched, records

    def warm(self, kind: str, batch: int, width: int, capacity: int, *, ragged: bool = False, hidden=(),
             expert_budget: int | None = None, expert_rank: str = "sum") -> None:
        """Compile (or find compiled) the graph of one shape ahead of use, on a scratch cache:
        `kind` one of `KINDS`, `batch` rows, `width` the block (1 for "ar"), `capacity` the cache
        capacity as `make_cache` rounds it; `ragged`: rows commit fewer than `width` tokens
        (`n_commit` given; commit kinds only); `hidden`: the layers whose outputs a verify-commit
        returns (`hidden_out`). The graph is then reused by any step of that shape."""
        if kind not in KINDS:
            raise ValueError(f"static step kind {kind!r}: expected one of {', '.join(KINDS)}")
        m = self.model
        # everything in inference mode, as the engines make their caches and step: a graph is
        # specialised on the grad mode and on whether its inputs are inference tensors
        with torch.inference_mode():
            cache = m.make_cache(batch, capacity)
            Tc = 1 if kind == "ar" else 0 if kind == "denoise" else width
            block = width if m.config.commit_attention == "block" else None  # as the diffusion engine passes it
            if Tc > 1 and ragged:
                n = torch.full((batch,), Tc - 1, dtype=torch.long, device=m.device)
            else:
                n = None
            ids = torch.zeros(batch, width, dtype=torch.long, device=m.device)
            commit = ids[:, :Tc] if Tc else None
            denoise = ids if kind not in ("ar", "verify-commit", "block-commit") else None
            states = [s.tensors() for s in cache.layers]
            verify = kind.startswith("verify")
            need = None if denoise is None or verify else torch.zeros(batch, width, dtype=torch.bool, device=m.device)
            step = Step("verify" if verify else "commit" if kind in ("ar", "block-commit") else kind, commit, n, denoise,
                        all_logits=verify, expert_budget=expert_budget, expert_rank=expert_rank, commit_block=block,
                        denoise_need=need)
            out = self.run(step, cache.lengths, states, record=verify,
                           hidden_out=dict.fromkeys(hidden) if hidden else None)
        if out is None:
            raise ValueError(f"static step {kind} (batch {batch}, width {width}, capacity {capacity}) was not compiled")
        self.calls[kind] -= 1  # a warm-up serves no request

    def warm_all(self, shapes, *, bar=None) -> None:
        """Compile every shape in `shapes` (`warm` arguments, e.g. `load_shapes`), then freeze: from then
        on a step of another shape runs eagerly. `bar`: a progress bar (tqdm's `update` and
        `set_postfix_str`), made by the caller: this module is bundled into the transformers export,
        which may import only torch and transformers."""
        for kind, batch, width, capacity, ragged, *hidden in shapes:  # hidden: optional (the layers a verify-commit returns)
            hidden = hidden[0] if hidden else ()
            if bar is not None:
                bar.set_postfix_str(f"{kind} batch {batch} width {width} capacity {capacity}{' ragged' if ragged else ''}")
            self.warm(kind, batch, width, capacity, ragged=ragged, hidden=hidden)
            if bar is not None:
                bar.update()
        self.batches = tuple(sorted({int(x[1]) for x in shapes}))
        self.widths = frozenset((x[0], int(x[2])) for x in shapes)
        self.frozen = True
