"""Cached block-diffusion decoding.

Per row: the prompt is committed, then blocks of `block_size` positions are generated. A block
starts fully masked; each denoise step proposes a token for every masked position and accepts
those whose confidence reaches the threshold (or the single most confident one if none does).
A finished block is committed in the same forward that runs the next block's first denoise step
(and the prompt prefill is fused with the first block's first step), so a block costs exactly its
number of denoise steps.

Shift-by-one: the hidden state at position i predicts token i+1, so block position 0 is predicted
by the last committed position (the commit part of the forward) and position j >= 1 by block
position j-1 (the denoise part).

`recompute=True` is the uncached baseline (`mode="naive"`): every forward rebuilds the whole
committed sequence from scratch with the same block and acceptance rules.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .ar import next_tokens, pad_right
from .base import DecodeEvent, RowState
from .sampling import make_generator


@torch.inference_mode()
def diffusion_decode(
    model,
    rows: list[RowState],
    *,
    block_size: int,
    threshold: float,
    mask_id: int,
    pad_id: int = 0,
    recompute: bool = False,
    provisional: bool = False,
) -> Iterator[DecodeEvent]:
    device = model.device
    B, Bs = len(rows), block_size
    for i, r in enumerate(rows):
        if r.params.max_new_tokens == 0:
            r._finish("length")
            yield DecodeEvent("finish", i, [], [])
    if all(r.finished for r in rows):
        return
    gens = [make_generator(r.params.seed, device) for r in rows]
    committed = [list(r.prompt) for r in rows]  # what the cache holds (recompute: what to rebuild)
    pending = [list(r.prompt) for r in rows]  # to commit in the next forward
    blk = torch.full((B, Bs), mask_id, dtype=torch.long, device=device)
    masked = torch.ones(B, Bs, dtype=torch.bool, device=device)
    dec_step = torch.zeros(B, Bs, dtype=torch.long, device=device)
    step = [0] * B
    block_no = [0] * B
    need = [min(Bs, r.remaining) for r in rows]  # positions that must be decoded in this block
    first_logits = None
    cache = None
    if not recompute:
        longest = max(len(p) for p in committed) + max(r.params.max_new_tokens for r in rows) + 2 * Bs
        cache = model.make_cache(B, longest)

    while not all(r.finished for r in rows):
        if recompute:
            cache = model.make_cache(B, max(len(c) for c in committed) + Bs)
            commit_src = committed
        else:
            commit_src = [p if not r.finished else [] for p, r in zip(pending, rows)]
        has_commit = any(commit_src)
        commit_ids, n_commit = pad_right(commit_src, pad_id, device) if has_commit else (None, None)
        out = model.step(
            cache,
            commit_ids=commit_ids,
            n_commit=n_commit,
            denoise_ids=blk,
            expert_budget=rows[0].params.expert_budget,
            track_experts=True,
        )
        if has_commit:
            fresh = out.commit_logits
            if first_logits is None:
                first_logits = fresh.clone()
            else:
                for i, src in enumerate(commit_src):
                    if src:
                        first_logits[i] = fresh[i]
        for i, src in enumerate(commit_src):
            if src and not recompute:
                committed[i].extend(src)
                pending[i] = []
        # position 0 from the commit part, position j >= 1 from block position j-1
        logits = torch.cat([first_logits[:, None], out.denoise_logits[:, : Bs - 1]], dim=1)

        for i, r in enumerate(rows):
            if r.finished:
                continue
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            step[i] += 1
            cand = (masked[i, : need[i]]).nonzero().squeeze(-1)
            tails = None
            if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.no_repeat_ngram_size:
                block_now = [None if masked[i, j] else int(blk[i, j]) for j in range(Bs)]
                tails = [block_now[:j] for j in cand.tolist()]
            toks, conf = next_tokens(r, logits[i, cand], gens[i], tails)
            conf_t = torch.tensor(conf)
            take = (conf_t >= threshold).nonzero().squeeze(-1)
            if take.numel() == 0:
                take = conf_t.argmax().reshape(1)
            pos = cand[take]
            blk[i, pos] = torch.tensor([toks[t] for t in take.tolist()], dtype=torch.long, device=device)
            masked[i, pos] = False
            dec_step[i, pos] = step[i]
            if not r.params.ignore_eos and r.eos_ids:
                eos_hits = [j for j in pos.tolist() if int(blk[i, j]) in r.eos_ids]
                if eos_hits:  # everything after the first accepted EOS becomes EOS
                    e = min(eos_hits)
                    eos_tok = int(blk[i, e])
                    later = torch.arange(e + 1, Bs, device=device)
                    fill = later[masked[i, e + 1 :] | (blk[i, e + 1 :] != eos_tok)]
                    blk[i, fill] = eos_tok
                    dec_step[i, fill[masked[i, fill]]] = step[i]
                    masked[i, fill] = False
            if provisional:
                yield DecodeEvent(
                    "provisional",
                    i,
                    [None if masked[i, j] else int(blk[i, j]) for j in range(Bs)],
                    dec_step[i].tolist(),
                    block=block_no[i],
                    step=step[i],
                )
            if bool(masked[i, : need[i]].any()):
                continue
            # block finished: emit it, then queue it for commit with the next block's first step
            tokens = blk[i, : need[i]].tolist()
            r.block_steps.append(step[i])
            kept = r.accept(tokens, dec_step[i, : need[i]].tolist())
            if kept:
                yield DecodeEvent("commit", i, kept, r.steps[len(r.tokens) - len(kept) :], block=block_no[i], step=step[i])
            if r.finished:
                yield DecodeEvent("finish", i, [], [])
                continue
            if recompute:
                committed[i].extend(blk[i].tolist())
            else:
                pending[i] = blk[i].tolist()
            blk[i] = mask_id
            masked[i] = True
            dec_step[i] = 0
            step[i] = 0
            block_no[i] += 1
            need[i] = min(Bs, r.remaining)
