"""A cached forward as the engine that asks for it describes it (`Step`), which the model core
dispatches on (`core.CausalLM.run_step`; its compiled graphs, `static.graph_kind`); and the layout of a
forward along time that every layer reads (`Segments`, and `Live`: which positions a layer computes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


# --------------------------------------------------------------------------- forward layout
@dataclass(frozen=True)
class Segments:
    """The layout of one forward along time (an input; nothing is collected here)."""

    commit_len: int  # Tc: padded length of the commit part (0 = none)
    denoise_len: int = 0  # Bd: length of the denoise part (0 = none)
    n_commit: torch.Tensor | None = None  # [B] valid commit tokens per row; None = all Tc valid
    block_size: int | None = None  # set: block-diffusion training, x is [clean L | noisy k*L]
    denoise_width: int | None = None  # the block's width when the denoise part carries only its first positions
    denoise_valid: torch.Tensor | None = None  # [B, Bd] bool: each row's block positions present (a prefix)
    commit_block: int | None = None  # the commit part bidirectional inside blocks of this size (absolute grid)

    @property
    def ragged(self) -> bool:
        return self.n_commit is not None


@dataclass
class Live:
    """Which positions of an eager cached forward one layer computes, when it needs fewer than all
    (`CausalLM.forward_step` builds one per layer; flat indices into the forward's B*T).

    - `kv`: the positions whose layer inputs are computed: attention K/V, the GDN's pre-conv inputs
      and gates. The others are *frozen* denoise positions (`frozen` [B, Bd]), whose inputs come
      from `memo` (this layer's tensors of an earlier forward, [B, Bd, ...] each).
    - `out`: the positions whose outputs are computed (queries, the output projection, the MLP or
      MoE); a subset of `kv`. Below the last layer every `kv` position (the next layer reads it); at
      the last layer only the positions whose logits are read.

    A layer writes its full-block inputs of this forward (computed and frozen alike) into `keep`
    when it is a list, for the next forward's `memo`."""

    B: int
    T: int
    Tc: int
    kv: torch.Tensor
    out: torch.Tensor
    frozen: torch.Tensor | None = None
    memo: tuple | None = None
    keep: list | None = None

    def place(self, rows: torch.Tensor, memo: torch.Tensor | None = None) -> torch.Tensor:
        """Values at the `kv` positions [N, ...] -> [B, T, ...]: frozen positions from `memo`
        ([B, Bd, ...]), zero where nothing was computed."""
        if rows.shape[0] == self.B * self.T:  # every position computed: nothing to place
            return rows.view(self.B, self.T, *rows.shape[1:])
        full = rows.new_zeros((self.B * self.T, *rows.shape[1:])).index_copy_(0, self.kv, rows)
        full = full.view(self.B, self.T, *rows.shape[1:])
        if self.frozen is not None and memo is not None:
            full[:, self.Tc :][self.frozen] = memo[self.frozen].to(full.dtype)
        return full

    def remember(self, *full: torch.Tensor) -> None:
        """This layer's inputs of the denoise part, [B, T, ...] each, kept for the next forward."""
        if self.keep is not None:
            self.keep.append(tuple(t[:, self.Tc :] for t in full))


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
    [kB, (k+1)B)) and causally across them (`commit_attention` "block", SDAR's); None: causally
    (attention-only layers; the compiled graphs take it too). `denoise_start [B]`: the RoPE position of each row's first
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
                    and self.denoise_valid is None and self.denoise_start is None)
