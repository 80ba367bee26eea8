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
The fallback on a forced step (`fallback=`): `confident` (the most confident candidate) or
`leftmost` (the leftmost, as left-to-right decoding would)."""

from __future__ import annotations

from typing import Callable

import torch

POLICIES: dict[str, Callable] = {}
FALLBACKS = ("confident", "leftmost")


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


def accept(params, conf: torch.Tensor, pos: torch.Tensor, entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """conf [N] (N >= 1), pos [N] block positions (ascending), entropy [N] (the entropy rule) ->
    (indices into the candidates to commit, ascending; forced)."""
    take = POLICIES[params.policy](conf, pos=pos, entropy=entropy, threshold=params.threshold,
                                   factor=params.factor, low_threshold=params.low_threshold,
                                   entropy_budget=params.entropy_budget)
    if take.numel():
        return take, False
    if params.fallback == "leftmost":
        return torch.zeros(1, dtype=torch.long, device=conf.device), True
    return conf.argmax().reshape(1), True


def needs_entropy(params) -> bool:
    return params.policy == "entropy"
