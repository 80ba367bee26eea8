"""Acceptance policies: which of a block's masked positions one denoise step commits.

A policy is a pure function of the candidates (the block's masked positions, in position order):
their confidences, their block positions and, for the entropy rule, the entropy of each position's
distribution. It returns the indices into the candidates to commit, ascending, or an empty tensor
when nothing meets its bar; `accept` then applies the fallback (a *forced* step: one position is
committed anyway so that every step makes progress).

The rules (`policy=`):
- `threshold`: every candidate whose confidence reaches `threshold` (Fast-dLLM's threshold rule);
- `factor`: sort by confidence c(1) >= c(2) >= ...; the top n for the largest n with
  c(n) >= 1 - factor / (n + 1) (Fast-dLLM's factor rule: more tokens only when all are sure);
- `hierarchy`: every candidate at or above `threshold`, plus those in [`low_threshold`, `threshold`)
  that are local maxima of their run of adjacent masked positions (at most one per neighbourhood,
  so adjacent uncertain tokens are never committed together);
- `entropy`: in confidence order while the summed entropy of the accepted positions stays
  <= `entropy_budget` nats (an entropy-bounded sampler).
The fallback on a forced step (`fallback=`): `confident` (the most confident candidate), `leftmost`
(the leftmost, as left-to-right decoding would) or `quota`: a step that accepts fewer than its
quota commits the quota most confident instead, the quota of step s of a block of width B decoded
in `steps` steps being B // steps, one more for the first B % steps steps (`step_quota`; `steps`
null: B, one a step, which is `confident`). `threshold` with `quota` is SDAR's and LLaDA2's
`low_confidence_dynamic` (theirs compares `> threshold`, this rule `>=`: they differ only on a
confidence equal to the threshold in fp32)."""

from __future__ import annotations

from typing import Callable

import torch

POLICIES: dict[str, Callable] = {}
FALLBACKS = ("confident", "leftmost", "quota")


def _policy(name: str):
    def add(fn):
        POLICIES[name] = fn
        return fn
    return add


@_policy("threshold")
def threshold_rule(conf: torch.Tensor, *, threshold: float, **_) -> torch.Tensor:
    return (conf >= threshold).nonzero().squeeze(-1)


@_policy("factor")
def factor_rule(conf: torch.Tensor, *, factor: float, **_) -> torch.Tensor:
    order = conf.argsort(descending=True, stable=True)
    n = torch.arange(1, conf.numel() + 1, device=conf.device, dtype=conf.dtype)
    ok = conf[order] >= 1 - factor / (n + 1)
    # the largest n whose n-th confidence passes (the bar rises with n, so passes form a prefix
    # except for ties; take the longest passing prefix)
    bad = (~ok).nonzero()
    count = int(bad[0]) if bad.numel() else conf.numel()
    return order[:count].sort().values


@_policy("hierarchy")
def hierarchy_rule(conf: torch.Tensor, *, pos: torch.Tensor, threshold: float, low_threshold: float, **_) -> torch.Tensor:
    high = conf >= threshold
    mid = (conf >= low_threshold) & ~high
    # neighbours inside a run of adjacent masked positions (candidates are in position order)
    left_adj = torch.zeros_like(high)
    right_adj = torch.zeros_like(high)
    if conf.numel() > 1:
        adj = pos[1:] == pos[:-1] + 1
        left_adj[1:] = adj
        right_adj[:-1] = adj
    left = torch.where(left_adj, conf.roll(1), torch.full_like(conf, -1.0))
    right = torch.where(right_adj, conf.roll(-1), torch.full_like(conf, -1.0))
    local_max = (conf > left) & (conf >= right)
    return (high | (mid & local_max)).nonzero().squeeze(-1)


@_policy("entropy")
def entropy_rule(conf: torch.Tensor, *, entropy: torch.Tensor, entropy_budget: float, **_) -> torch.Tensor:
    order = conf.argsort(descending=True, stable=True)
    within = entropy[order].cumsum(0) <= entropy_budget
    bad = (~within).nonzero()
    count = int(bad[0]) if bad.numel() else conf.numel()
    return order[:count].sort().values


def step_quota(width: int, steps: int | None, step: int) -> int:
    """The positions step `step` (0-based) of a block of `width` must commit at least, when the
    block is decoded in `steps` steps (None: `width`, one a step); past the last step, the last's."""
    steps = steps or width
    step = min(step, steps - 1)
    return width // steps + (step < width % steps)


def accept(params, conf: torch.Tensor, pos: torch.Tensor, entropy: torch.Tensor | None = None, *,
           step: int = 0, width: int = 1) -> tuple[torch.Tensor, bool]:
    """conf [N] (N >= 1), pos [N] block positions (ascending), entropy [N] (the entropy rule),
    `step` the block's denoise step (0-based) and `width` its width (the quota fallback) ->
    (indices into the candidates to commit, ascending; forced)."""
    take = POLICIES[params.policy](conf, pos=pos, entropy=entropy, threshold=params.threshold,
                                   factor=params.factor, low_threshold=params.low_threshold,
                                   entropy_budget=params.entropy_budget)
    if params.fallback == "quota":
        quota = min(step_quota(width, params.steps, step), conf.numel())
        if take.numel() >= quota:
            return take, False
        return conf.topk(quota).indices.sort().values, True
    if take.numel():
        return take, False
    if params.fallback == "leftmost":
        return torch.zeros(1, dtype=torch.long, device=conf.device), True
    return conf.argmax().reshape(1), True


def needs_entropy(params) -> bool:
    return params.policy == "entropy"
