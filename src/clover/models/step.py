"""A cached forward as the engine that asks for it describes it (`Step`), which the model core
dispatches on (`core.CausalLM.run_step`; its compiled graphs, `static.graph_kind`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


STEP_KINDS = ("commit", "denoise", "commit+denoise", "verify")


@dataclass(frozen=True, eq=False)
class Step:
    """One cached forward, as the engine that asks for it describes it (`CausalLM.run_step`).

    `kind`: "commit" (tokens appended to the cache: a prompt, an AR step), "denoise" (one block
    denoised against the cache), "commit+denoise" (a commit and the next block in one forward) or
    "verify" (a commit whose logits are read at every position and whose inputs are recorded for a
    rollback: the cache records, `HybridCache.start_recording`; a denoise block may ride along).
    The segments: `commit_ids [B, Tc]` (right-padded, `n_commit[b]` valid; None = all valid) and
    `denoise_ids [B, Bd]`. What to return: `all_logits` (commit logits at every commit position, not
    only each row's last), `track_experts` (experts touched per MoE layer), `hidden_layers` (those
    layers' outputs over the commit part, `StepOutput.hidden`: a DFlash drafter's context),
    `denoise_need [B, Bd]` (bool: denoise logits only there, the others garbage). How:
    `expert_budget` experts shared across the denoise block (MoE only), ranked by `expert_rank`
    ("sum" or "max" of the block's router probabilities). The eager forward's approximate skips
    (`forward_step`; a step with one runs eagerly): `denoise_frozen [B, Bd]` (bool),
    `denoise_memo` (per layer, an earlier forward's block inputs; `()` none yet; this forward's
    return in `StepOutput.memo`), `denoise_width` and `denoise_valid [B, Bd]`. `commit_block`: the
    commit part attends bidirectionally inside blocks of that size on the absolute grid (positions
    [kB, (k+1)B)) and causally across them (`commit_attention` "block", SDAR's); None: causally. It
    runs eagerly (attention-only layers). `denoise_start [B]`: the RoPE position of each row's first
    block position (default: right after its cache and commit part); a whole-sequence model's dual
    cache keeps the keys after the block too. It runs eagerly."""

    kind: str
    commit_ids: torch.Tensor | None = None
    n_commit: torch.Tensor | None = None
    denoise_ids: torch.Tensor | None = None
    all_logits: bool = False
    track_experts: bool = False
    hidden_layers: tuple[int, ...] = ()
    denoise_need: torch.Tensor | None = None
    expert_budget: int | None = None
    expert_rank: str = "sum"
    denoise_frozen: torch.Tensor | None = None
    denoise_memo: tuple | None = None
    denoise_width: int | None = None
    denoise_valid: torch.Tensor | None = None
    commit_block: int | None = None
    denoise_start: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"step kind {self.kind!r}: expected one of {', '.join(STEP_KINDS)}")
        commit, denoise = self.commit_ids is not None, self.denoise_ids is not None
        parts = {"commit": (True, False), "denoise": (False, True), "commit+denoise": (True, True)}.get(self.kind)
        if (parts is not None and parts != (commit, denoise)) or (self.kind == "verify" and not commit):
            have = " and ".join(n for n, on in (("commit_ids", commit), ("denoise_ids", denoise)) if on) or "neither part"
            raise ValueError(f"a {self.kind} step has {have}")

    @staticmethod
    def kind_of(commit_ids, denoise_ids, *, verify: bool = False) -> str:
        """The kind of a step of these parts (`verify`: a commit into a recording cache)."""
        if commit_ids is None and denoise_ids is None:
            raise ValueError("step needs commit_ids, denoise_ids or both")
        if commit_ids is not None and verify:
            return "verify"
        return "commit+denoise" if commit_ids is not None and denoise_ids is not None else \
            "commit" if commit_ids is not None else "denoise"

    @property
    def commit_len(self) -> int:
        return 0 if self.commit_ids is None else self.commit_ids.shape[1]

    @property
    def denoise_len(self) -> int:
        return 0 if self.denoise_ids is None else self.denoise_ids.shape[1]

    @property
    def has_skips(self) -> bool:
        """Whether the step uses an eager skip (it then runs eagerly)."""
        return not (self.denoise_frozen is None and self.denoise_memo is None and self.denoise_width is None
                    and self.denoise_valid is None and self.commit_block is None and self.denoise_start is None)
