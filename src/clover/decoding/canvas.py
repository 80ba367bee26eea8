"""Whole-canvas masked diffusion (`mode="canvas"`): Dream's `diffusion_generate`, LLaDA's `generate`
and RND1's `diffusion_sample`, exactly, for the checkpoints whose model attends over the whole
sequence (`commit_attention` "full": Dream, LLaDA, RND1).

A row's canvas is its prompt followed by `max_new_tokens` mask tokens. Every step is one forward over
the whole canvas (no cache: the prompt attends to the masks, so nothing is final until the end), whose
logits predict each masked position (`logit_shift` 1, Dream: position i-1's logits, the first
position its own; 0, LLaDA: position i's); each masked position gets a token and a confidence
(`confidence`: "prob", the token's probability, which is Dream's `maskgit_plus` and LLaDA's
`low_confidence`; "margin", top-1 minus top-2, Dream's `topk_margin`; "entropy", the negative entropy,
Dream's `entropy`), and the step unmasks the most confident positions, as many as the family's
schedule says (the model's `canvas_schedule`):

- "timesteps" (Dream): one block over the whole canvas; at step i of `steps`, with the timesteps
  t = linspace(1, eps, steps + 1) (eps 1e-3), `int(n * (1 - t[i+1] / t[i]))` of the n masks left,
  and every mask left at the last step (computed in float32 as the reference does);
- "even" (LLaDA): semi-autoregressive blocks of `block_size` from the prompt's end, `steps / blocks`
  steps each, the block's masks split evenly over them (the remainder one each to the first steps);
  only the current block's masks compete. `cfg_scale` > 0 adds LLaDA's classifier-free guidance:
  a second forward with the prompt masked, `u + (cfg_scale + 1) * (c - u)`;
- "keep" (RND1, greedy): the canvas's last position is a pad its sampler reserves; at step j of
  `steps` the `int(n * (steps - 1 - j) / steps)` masks of highest entropy (of the logits over 1e-8:
  its greedy temperature) stay masked and every other takes its argmax (`keep_uncertain`); a row
  stops once nothing is masked.

Dream's confidences are read over the 50 largest logits (`canvas_top_k`; a request's `top_k` replaces
it): transformers' `PretrainedConfig` carries `top_k` 50, which `diffusion_generate` takes into its
generation config when none is given, and its `sample_tokens` filters before the softmax.

`steps` null: one token a step (`max_new_tokens` steps), the families' README settings. Temperature
0 takes each position's argmax; above it each family draws as its reference does (`canvas_sampler`:
Dream's categorical draw after `top_p` / top-k, LLaDA's Gumbel noise in float64), from the row's
`seed`, so a seeded row gives the reference's tokens after `torch.manual_seed(seed)` (alone; the
reference's batch shares one stream). Rows of any length and options ride one forward: the canvases
are right-padded and each row attends to its own canvas only (`key_valid`), at positions from 0, so a
row decodes as it does alone. The row's tokens are the canvas after the prompt, cut at the first EOS
(the reported count is the real one). `provisional` reports the canvas after every step.

What a step reads is all it computes: the LM head runs only at the positions the step may unmask
(`logits_at`; every position only where LLaDA's sampled draw puts noise over the whole canvas), and at
temperature 0 a top-k confidence is read off the k + 1 largest logits (`greedy_confidence`, found
by `top_values` in one pass over the row; `canvas_confidence` is the slow form it is tested against).
Equal confidences go in torch.topk's order, as the references'; `canvas_ties="position"` takes the
leftmost first, llama.cpp's `llama-diffusion-cli`'s order (with `top_k=1`, its only deterministic
setting, every confidence is 1 and it unmasks left to right).
"""

from __future__ import annotations

import torch

from .base import BatchEngine, DecodeEvent, EngineRow, RowState, grad_free_call, pad_right
from .modes import EngineSpec, Mode, register
from .sampling import SamplingParams, make_generator

EPS = 1e-3  # Dream's `eps`: the last timestep
CACHES = ("prefix", "dual")  # Fast-dLLM's caches (`canvas_cache`)
SCHEDULES = ("timesteps", "even", "keep")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Dream's `top_p_logits`: outside the smallest set whose probability passes `top_p` (the first
    token always kept), the dtype's minimum."""
    sorted_logits, order = torch.sort(logits, descending=True)
    drop = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1) > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def canvas_confidence(logits: torch.Tensor, kind: str, top_k: int = 0, *, temperature: float = 0.0,
                      top_p: float = 1.0, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (confidences [N], tokens [N]), as Dream's `sample_tokens`: the logits over
    `temperature`, filtered by `top_p` and `top_k` (the k largest kept, as `top_k_logits`), their
    softmax; the token its argmax (temperature 0) or a draw from it (`torch.multinomial` on the
    renormalised probabilities, as `Categorical.sample`, from `generator`); the confidence the
    token's probability ("prob": Dream's `maskgit_plus`, and LLaDA's low-confidence remasking at
    temperature 0), top-1 minus top-2 ("margin": `topk_margin`) or the negative entropy ("entropy")."""
    if temperature > 0:
        logits = logits / temperature
    if top_p < 1:
        logits = top_p_filter(logits, top_p)
    if top_k:
        floor = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
        logits = logits.masked_fill(logits < floor, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        tokens = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, True, generator=generator)[:, 0]
        confidence = probs.gather(-1, tokens[:, None])[:, 0]
    else:
        confidence, tokens = probs.max(dim=-1)
    if kind == "margin":
        top2 = probs.topk(2, dim=-1).values
        confidence = top2[:, 0] - top2[:, 1]
    elif kind == "entropy":
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, tokens


def top_values(logits: torch.Tensor, k: int, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(logits, k)` over rows of a wide vocabulary [N, V], reading the whole row once:
    the row cut into chunks of `width`, the k chunks with the largest maxima hold the k largest
    values (each of those lies in a chunk whose maximum is at least the k-th value, and at most k
    chunks have one, ties aside), so the exact top-k is taken over those chunks' values. The values
    equal topk's; the indices too where no two of the k + 1 largest values tie."""
    N, V = logits.shape
    if V < 4 * k * width or N == 0:  # (a block whose masks are done has no rows)
        return torch.topk(logits, k)
    pad = -V % width
    wide = torch.nn.functional.pad(logits, (0, pad), value=-torch.inf) if pad else logits
    chunks = wide.view(N, -1, width)
    best = torch.topk(chunks.amax(-1), k).indices  # [N, k] the chunks
    cand = chunks.gather(1, best[..., None].expand(-1, -1, width)).reshape(N, k * width)
    vals, where = torch.topk(cand, k)
    return vals, best.gather(1, where // width) * width + where % width


def greedy_confidence(logits: torch.Tensor, kind: str, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`canvas_confidence` at temperature 0 without top-p, read off the `top_k` largest logits
    instead of a filtered copy of the whole vocabulary (the softmax of the kept values is the
    filtered softmax: every other entry is exp(min - max) = 0). Rows where the k-th and the next
    logit tie (the slow filter keeps both) or the two largest tie (argmax's first index) go through
    `canvas_confidence`. Without a top-k it is `canvas_confidence`."""
    V = logits.shape[-1]
    if not top_k or top_k >= V:
        return canvas_confidence(logits, kind, top_k)
    vals, idx = top_values(logits, top_k + 1)
    tied = (vals[:, top_k - 1] == vals[:, top_k]) | (vals[:, 0] == vals[:, 1])
    probs = torch.softmax(vals[:, :top_k], dim=-1)
    tokens, confidence = idx[:, 0], probs[:, 0]
    if kind == "margin":
        confidence = probs[:, 0] - probs[:, 1] if top_k > 1 else probs[:, 0]
    elif kind == "entropy":
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    if bool(tied.any()):
        confidence, tokens = confidence.clone(), tokens.clone()
        confidence[tied], tokens[tied] = canvas_confidence(logits[tied], kind, top_k)
    return confidence, tokens


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """LLaDA's `add_gumbel_noise` then argmax: logits [L, V] -> tokens [L]; above temperature 0, in
    float64, exp(logits) / (-log u) ** temperature with u uniform over the whole canvas's logits."""
    if temperature == 0:
        return logits.argmax(-1)
    wide = logits.to(torch.float64)
    noise = torch.rand(wide.shape, dtype=torch.float64, generator=generator, device=wide.device)
    return (wide.exp() / (-torch.log(noise)) ** temperature).argmax(-1)


def timestep_count(masked: int, step: int, steps: int, eps: float = EPS) -> int:
    """Dream's number of positions to unmask at `step` of `steps` with `masked` masks left."""
    if step == steps - 1:
        return masked
    t = torch.linspace(1, eps, steps + 1)
    return int(torch.tensor(float(masked)) * (1 - t[step + 1] / t[step]))


def even_counts(masked: int, steps: int) -> list[int]:
    """LLaDA's `get_num_transfer_tokens`: `masked` split over `steps`, the remainder to the first ones."""
    base, rem = divmod(masked, steps)
    return [base + (i < rem) for i in range(steps)]


def keep_uncertain(logits: torch.Tensor, masked: torch.Tensor, total: int, step: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RND1's greedy step (`diffusion_sample`, greedy, temperature 0 read as 1e-8): logits [n, V] of
    the masked positions `masked` [T] -> (their argmax tokens, the positions to unmask): the
    `int(total * (steps - 1 - step) / steps)` masks of highest entropy stay masked (its torch.topk over
    the canvas, the others at the float32 minimum), every other mask is unmasked; the last step
    unmasks all. The ops are the reference's, in its order, so ties fall as they fall there."""
    logp = torch.log_softmax(logits / 1e-8, dim=-1)
    tokens = logp.argmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    scores = torch.zeros(1, masked.shape[0], dtype=entropy.dtype, device=logits.device)
    scores[0, masked] = entropy
    scores = scores.masked_fill(~masked[None], -torch.finfo(scores.dtype).max)
    cutoff = int((torch.tensor([[total]]) * ((steps - 1 - step) / steps)).long().clamp(min=0))
    keep = torch.zeros_like(masked)
    if cutoff > 0:
        keep[torch.topk(scores, cutoff, dim=-1, largest=True).indices[0]] = True
    return tokens, (masked & ~keep).nonzero()[:, 0]


class CanvasRow(EngineRow):
    def __init__(self, x: torch.Tensor, start: int, steps: int, blocks: list[tuple[int, int]], plan: list[int]) -> None:
        super().__init__()
        self.x = x  # [T] the canvas: prompt, then tokens and masks
        self.start = start  # the prompt's length
        self.steps = steps  # steps per block
        self.blocks = blocks  # [(begin, end)] canvas positions of each block
        self.block = 0
        self.step = 0  # within the block
        self.plan = plan  # tokens to unmask at each step of the current block
        self.decoded_at = torch.zeros_like(x)  # the step (from 1, over the whole generation) each position was decoded at
        self.done = 0  # steps run
        self.generator: torch.Generator | None = None  # the row's draws (a seed given)


class CanvasEngine(BatchEngine):
    """Rows in flight over whole-canvas forwards (no cache)."""

    semantics_implemented = {"logit_shift": (0,), "commit_attention": ("full",)}

    def __init__(self, model, spec: EngineSpec, *, mask_id: int, pad_id: int) -> None:
        super().__init__(model, pad_id=pad_id)
        c = model.config
        self.mask_id = mask_id
        self.shift = c.logit_shift
        self.schedule = getattr(c, "canvas_schedule", None)
        if self.schedule not in SCHEDULES or c.commit_attention != "full":
            raise ValueError(f"mode: 'canvas' needs a whole-sequence diffusion model (commit_attention 'full'); "
                             f"this one's is {c.commit_attention!r}")
        self.provisional = spec.provisional
        self.top_k = getattr(c, "canvas_top_k", 0)  # the family's top-k where a request sets none
        self.sampler = getattr(c, "canvas_sampler", "categorical")  # how the family draws a token (above 0)
        self.cached = next((k for k in CACHES if k in spec.skips), None)  # Fast-dLLM's caches (below)
        if self.cached and (self.schedule != "even" or self.shift):
            raise ValueError("canvas_cache: Fast-dLLM's caches are built here for LLaDA's semi-autoregressive "
                             "blocks (no logit shift, the even schedule)")

    @grad_free_call
    def add(self, row: RowState) -> list[DecodeEvent]:
        p = row.params
        if p.max_new_tokens == 0:
            row._finish("length")
            return [DecodeEvent("finish", -1, [], [], row_state=row)]
        n, start = p.max_new_tokens, len(row.prompt)
        x = torch.tensor(row.prompt + [self.mask_id] * n, dtype=torch.long, device=self.device)
        steps = p.steps or n
        if self.schedule != "even":
            blocks = [(start, start + n)]
        else:
            width = int(p.block_size)
            blocks = [(b, min(b + width, start + n)) for b in range(start, start + n, width)]
            if steps % len(blocks):
                raise ValueError(f"steps: {steps} must be a multiple of the number of blocks ({len(blocks)} of "
                                 f"block_size {width} in {n} tokens), as LLaDA's generate asks")
            steps //= len(blocks)
        if self.schedule == "keep":  # RND1: its sampler reserves the canvas's last position (pad, never decoded)
            if p.temperature > 0 or p.top_k or p.top_p < 1:
                raise ValueError("temperature: RND1's canvas decodes greedily only (its sampled draw and top-k/top-p "
                                 "filters are not built)")
            x[-1] = self.model.config.pad_token_id
        if self.cached and p.cfg_scale:
            raise ValueError("cfg_scale: not with canvas_cache (Fast-dLLM's cached generators have no guidance)")
        row.state = CanvasRow(x, start, steps, blocks, self._plan(x, blocks[0], steps))
        row.state.generator = make_generator(p.seed, self.device)
        if self.cached:
            fresh = self.model.make_cache(1, len(x))
            if self.cache is not None:
                fresh.ensure_capacity(self.cache.capacity)
                self.cache.ensure_capacity(fresh.capacity)
            self.cache = fresh if self.cache is None else self.cache.concat([self.cache, fresh])
        self.rows.append(row)
        return []

    def _plan(self, x: torch.Tensor, block: tuple[int, int], steps: int) -> list[int]:
        if self.schedule == "keep":
            return [int((x == self.mask_id).sum())]  # the masks the canvas starts with
        if self.schedule == "timesteps":
            return []  # computed at each step from the masks left
        return even_counts(int((x[block[0]:block[1]] == self.mask_id).sum()), steps)

    def _drop_finished(self) -> None:
        if self.cached:
            return super()._drop_finished()
        self.rows = [r for r in self.rows if not r.finished]

    def _cached_logits(self) -> list[tuple[torch.Tensor, int]]:
        """Fast-dLLM's caches. A row at its block's first step runs its whole canvas (attention both
        ways) and keeps K/V: "prefix", those of the positions before the block, its later steps
        running the block and what follows; "dual", those of every position but the block's, its
        later steps running the block alone. The kept K/V go stale as the block fills (approximate).
        -> per row (logits [N, V] of its positions from the block's start, that start)."""
        dual = self.cached == "dual"
        starts = [r.state.blocks[r.state.block][0] for r in self.rows]
        ends = [r.state.blocks[r.state.block][1] for r in self.rows]
        refresh = [r.state.step == 0 for r in self.rows]
        commit, block = [], []
        for i, r in enumerate(self.rows):
            x, a, b = r.state.x.tolist(), starts[i], ends[i]
            if refresh[i]:
                self.cache.lengths[i] = 0
            if dual:
                commit.append(x if refresh[i] else [])
                block.append([] if refresh[i] else x[a:b])
            else:
                commit.append(x[:a] if refresh[i] else [])
                block.append(x[a:])
        commit_ids = n = denoise_ids = valid = need = None
        if any(commit):
            commit_ids, n = pad_right(commit, self.pad_id, self.device)
        if any(block):
            denoise_ids, lens = pad_right(block, self.pad_id, self.device)
            cols = torch.arange(denoise_ids.shape[1], device=self.device)[None, :]
            valid = cols < lens[:, None]
            # the last layer and the head only where the block's masks are read
            width = torch.tensor(ends, device=self.device) - torch.tensor(starts, device=self.device)
            need = (denoise_ids == self.mask_id) & (cols < width[:, None])
        start = torch.tensor(starts, device=self.device) if dual else None
        out = self.model.step(self.cache, commit_ids=commit_ids, n_commit=n, denoise_ids=denoise_ids,
                              denoise_valid=valid, all_logits=dual, denoise_start=start, denoise_need=need)
        rows = []
        for i in range(len(self.rows)):
            a, b = starts[i], ends[i]
            if dual and refresh[i]:
                rows.append((out.commit_logits[i, a:b], a))
                self.cache.drop_span(i, a, b)
            else:
                rows.append((out.denoise_logits[i, : len(block[i])], a))
        return rows

    def _candidates(self, s: CanvasRow) -> torch.Tensor:
        """[T] bool: the positions this step may unmask (masked, in or before the current block)."""
        masked = s.x == self.mask_id
        masked[s.blocks[s.block][1]:] = False  # later blocks wait
        return masked

    def _reads_all(self, r: RowState) -> bool:
        """LLaDA's draw above temperature 0 is noise over every position's logits (its stream)."""
        return self.sampler == "gumbel" and r.params.temperature > 0

    def _logits(self, cands: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over every row's canvas (and, for rows with `cfg_scale`, the canvas with the
        prompt masked), the head run only where a position is read (each row's `cands`, unless it reads
        every position): per row (logits [n, V], the
        canvas positions [n] they predict), a guided row's after the rows'. A position's logits are
        its own (`logit_shift` 0) or the previous position's (1; the first position its own)."""
        seqs = [r.state.x for r in self.rows]
        reads = [torch.arange(len(r.state.x), device=self.device) if self._reads_all(r)
                 else c.nonzero()[:, 0] for r, c in zip(self.rows, cands)]
        for i, r in enumerate(self.rows):
            if r.params.cfg_scale:
                un = r.state.x.clone()
                un[: r.state.start] = self.mask_id
                seqs.append(un)
                reads.append(reads[i])
        T = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long, device=self.device)
        valid = torch.zeros(len(seqs), T, dtype=torch.bool, device=self.device)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = x
            valid[i, : len(x)] = True
        at = torch.cat([(pos - self.shift).clamp(min=0) + i * T for i, pos in enumerate(reads)])
        logits = self.model(ids, key_valid=valid, logits_at=at)
        return list(zip(logits.split([len(pos) for pos in reads]), reads))

    @grad_free_call
    def step(self) -> list[DecodeEvent]:
        cands = [self._candidates(r.state) for r in self.rows]  # once a step: the forward reads them, _unmask picks
        if self.cached:
            per_row = [(lg, torch.arange(a, a + lg.shape[0], device=self.device)) for lg, a in self._cached_logits()]
        else:
            per_row = self._logits(cands)
        events, guided = [], len(self.rows)
        for i, r in enumerate(self.rows):
            s = r.state
            lg, positions = per_row[i]
            if r.params.cfg_scale:
                un = per_row[guided][0]
                guided += 1
                lg = un + (r.params.cfg_scale + 1) * (lg - un)
            self._unmask(r, lg, positions, cands[i])
            r.forwards += 1
            if self.provisional:
                toks = [None if t == self.mask_id else t for t in s.x[s.start:].tolist()]
                events.append(DecodeEvent("provisional", i, toks, s.decoded_at[s.start:].tolist(), step=s.done,
                                          row_state=r))
            if s.block == len(s.blocks):
                kept = r.accept(s.x[s.start:].tolist(), s.decoded_at[s.start:].tolist())
                r.block_steps.append(s.done)
                if kept:
                    events.append(DecodeEvent("commit", i, kept, r.steps[-len(kept):], row_state=r))
                events.append(DecodeEvent("finish", i, [], [], row_state=r))  # the whole canvas is accepted: done
        self._drop_finished()
        return events

    def _unmask(self, r: RowState, logits: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor) -> None:
        """One step of row `r`'s schedule over its logits [n, V] of the canvas positions `positions`
        [n] (ascending; every position the step may unmask among them, `masked` [T]: its `_candidates`)."""
        s = r.state
        begin, end = s.blocks[s.block]
        rows = masked[positions]
        p = r.params
        read = logits if len(positions) == int(rows.sum()) else logits[rows]  # the candidates' logits
        if self.schedule == "keep":
            tokens, pick = keep_uncertain(read, masked, s.plan[0], s.step, s.steps)
        else:
            if self.schedule == "timesteps":
                k = timestep_count(int(masked.sum()), s.step, s.steps)
            else:
                k = s.plan[s.step] if s.step < len(s.plan) else 0
            tokens, pick = self._most_confident(r, logits, rows, read, masked, k)
        s.done += 1
        if len(pick):
            proposal = torch.full_like(s.x, self.mask_id)
            proposal[masked] = tokens
            s.x[pick] = proposal[pick]
            s.decoded_at[pick] = s.done
        s.step += 1
        left = bool((s.x[begin:end] == self.mask_id).any())
        done = s.step == s.steps if p.canvas_threshold is None else not left  # the block's steps, or its masks
        if done or (self.schedule == "keep" and not left):  # RND1 forwards no more once nothing is masked
            s.block, s.step = s.block + 1, 0
            if s.block < len(s.blocks):
                s.plan = self._plan(s.x, s.blocks[s.block], s.steps)

    def _most_confident(self, r: RowState, logits: torch.Tensor, rows: torch.Tensor, read: torch.Tensor,
                        masked: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dream's and LLaDA's pick: each candidate's token and confidence, the `k` most confident
        (Fast-dLLM's threshold: every one above it, at least one) -> (tokens of the candidates, the
        positions to unmask)."""
        s, p = r.state, r.params
        if p.temperature == 0 and p.top_p >= 1:  # LLaDA's argmax and its probability are "prob"'s
            kind = "prob" if self.sampler == "gumbel" else p.confidence
            conf, tokens = greedy_confidence(read, kind, p.top_k or self.top_k)
        elif self.sampler == "gumbel":  # LLaDA: noise over every position's logits, the confidence noise-free
            tokens = gumbel_argmax(logits, p.temperature, s.generator)[rows]
            conf = torch.softmax(read, dim=-1).gather(-1, tokens[:, None])[:, 0]
        else:
            conf, tokens = canvas_confidence(read, p.confidence, p.top_k or self.top_k, temperature=p.temperature,
                                             top_p=p.top_p, generator=s.generator)
        full = torch.full(s.x.shape, -torch.inf, dtype=logits.dtype, device=logits.device)
        full[masked] = conf
        if p.canvas_threshold is not None:  # Fast-dLLM's parallel decoding: the best, and every other above it
            k = max(1, int((conf >= p.canvas_threshold).sum()))
        if k <= 0:
            return tokens, full.new_zeros(0, dtype=torch.long)
        if p.canvas_ties == "position":  # equal confidences leftmost first (llama.cpp's CLI)
            return tokens, torch.sort(full, descending=True, stable=True).indices[:k]
        return tokens, torch.topk(full, k).indices  # the references' torch.topk (no promised order among equals)


class Canvas(Mode):
    name = "canvas"
    needs_mask = True
    summary = "whole-canvas masked diffusion: Dream's diffusion_generate / LLaDA's generate, exactly (no cache)"
    grammar = False
    engine = CanvasEngine

    def refusal(self, config) -> str | None:
        if config.commit_attention != "full":
            return f"mode: 'canvas' decodes whole-sequence models (Dream, LLaDA) only, not {config.model_type or 'this model'}"
        return None

    def check(self, params: SamplingParams) -> None:
        if params.steps is not None and params.steps > max(1, params.max_new_tokens):
            raise ValueError(f"steps: at most max_new_tokens ({params.max_new_tokens}), got {params.steps}")

    def spec(self, params: SamplingParams, provisional: bool = False) -> EngineSpec:
        return EngineSpec(self, provisional=provisional, skips=(params.canvas_cache,) if params.canvas_cache else ())

    def build_engine(self, model, spec, *, mask_id, pad_id, drafter=None):
        return CanvasEngine(model, spec, mask_id=mask_id, pad_id=pad_id)


register(Canvas())
