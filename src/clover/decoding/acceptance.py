"""Acceptance rules: which of a block's masked positions one denoise step commits.

A rule is a pure function of the candidates' confidences (the masked positions of the block, in
position order): it returns the indices into them to commit, ascending, and whether the step was
*forced* (no candidate met the rule's own bar, so it committed one anyway to make progress)."""

from __future__ import annotations

import torch


def threshold_rule(conf: torch.Tensor, threshold: float) -> tuple[torch.Tensor, bool]:
    """conf [N] (N >= 1) -> (indices, forced): every candidate whose confidence reaches `threshold`;
    if none does, the single most confident one (a forced step)."""
    take = (conf >= threshold).nonzero().squeeze(-1)
    if take.numel():
        return take, False
    return conf.argmax().reshape(1), True
