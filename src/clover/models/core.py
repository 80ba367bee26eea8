"""The model core every architecture shares: the decoder stack over an architecture's layers, the
causal LM with its cached `step` (commit and/or denoise in one forward), the block-diffusion
training forward, `make_cache`, the plain initialisation and the identity checkpoint key layout.

An architecture file (`qwen3_5.py`, `llama.py`, ...) subclasses `CausalLM` and names its parts as
class attributes: `attention_class` (full-attention layers), `linear_attention_class` (linear-attention
layers), `mlp_class` (called as `mlp(x, sharing, count_experts, static) -> (y, ExpertStats | None)`; per layer
`mlp_class_for` where the layers differ), `norm_class` (`norm_class(dim, eps)`) and `rotary_class` (`rotary_class.from_config(config)`), each
built from the config; plus its `key_layout` (stored key -> parameter name) and, where its stack is
not `TextModel`'s, `build_text_model`. Everything else here reads only what every architecture has.

One forward can carry two parts per row, laid side by side on the time axis: a *commit* part
`[B, Tc]` (causal; appended to the cache) and a *denoise* part `[B, Bd]` (one block, bidirectional
inside, reading the cache after the commit part; never written). The prompt prefill, AR decoding,
committing a finished block and denoising the next block are all instances of `step`.
`forward(input_ids)` is the plain causal forward without a cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cache import HybridCache
from ..config import BlockSemantics, CloverConfig
from ..moe import BlockSharing
from .step import Step
from .layers import (
    Live,
    Segments,
    block_diffusion_mask,
    cached_attention_mask,
    init_plain_weights,
    step_positions,
)


# --------------------------------------------------------------------------- key layout
class KeyLayout:
    """Checkpoint key -> parameter name: stored keys are our parameter names (an architecture whose
    checkpoints differ subclasses it)."""

    def name(self, key: str) -> str | None:
        """Our parameter name for a stored key; None for keys skipped on purpose."""
        return key

    def expert_part(self, name: str) -> tuple[str, int, str] | None:
        """(module prefix, expert index, part) for a weight stored per expert; None otherwise."""
        return None

    def stack_experts(self, prefix: str, experts: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no per-expert weights ({prefix})")


# --------------------------------------------------------------------------- stack
class DecoderLayer(nn.Module):
    """`h = x + mixer(input_layernorm(x))`, `out = h + mlp(post_attention_layernorm(h))`."""

    def __init__(self, config: CloverConfig, layer_idx: int, parts: type) -> None:
        """`parts`: the model class, whose `attention_class`, `linear_attention_class`, `mlp_class`
        and `norm_class` this layer is made of."""
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "full_attention":
            self.self_attn = parts.attention_class(config)
        else:
            self.linear_attn = parts.linear_attention_class(config)
        self.mlp = parts.mlp_class_for(config, layer_idx)(config)
        self.input_layernorm = parts.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = parts.norm_class(config.hidden_size, config.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == "full_attention" else self.linear_attn

    def make_state(self, batch: int, capacity: int, *, dtype: torch.dtype, device):
        return self.mixer.make_state(batch, capacity, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segments: Segments,
        *,
        mask: torch.Tensor | None = None,
        state: tuple[torch.Tensor, ...] | None = None,
        lengths: torch.Tensor | None = None,
        sharing: BlockSharing | None = None,
        count_experts: bool = False,
        static: bool = False,
        records: list | None = None,
        live: Live | None = None,
    ):
        """-> (x, ExpertStats | None). `state`: this layer's cache tensors (updated in place).
        `live` (an eager cached forward without expert sharing): the layer computes only its `out`
        positions' outputs (from its `kv` positions' inputs); the others keep their input."""
        h = self.input_layernorm(x)
        if self.layer_type == "full_attention":
            h = self.self_attn(h, rope, mask=mask, state=state, lengths=lengths, commit_len=segments.commit_len,
                               live=live)
        else:
            h = self.linear_attn(h, segments, state, static=static, records=records, live=live)
        if live is None:
            x = x + h
            y, stats = self.mlp(self.post_attention_layernorm(x), sharing, count_experts, static)
            return x + y, stats
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        xo = flat[live.out] + h
        y, stats = self.mlp(self.post_attention_layernorm(xo)[None], None, count_experts, static)
        return flat.index_copy(0, live.out, xo + y[0]).view(B, T, H), stats


class TextModel(nn.Module):
    def __init__(self, config: CloverConfig, parts: type) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, parts) for i in range(config.num_hidden_layers))
        self.norm = parts.norm_class(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = parts.rotary_class.from_config(config)


@dataclass
class StepOutput:
    commit_logits: torch.Tensor | None  # [B, V] at each row's last valid commit token (or [B, Tc, V] if all_logits)
    denoise_logits: torch.Tensor | None  # [B, Bd, V]
    experts_touched: list[int]  # per MoE layer, when tracked (empty for a dense MLP)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # `Step.hidden_layers`' outputs [B, Tc, H]
    memo: list | None = None  # with `Step.denoise_memo`: per layer, this forward's block inputs

class CausalLM(nn.Module):
    """The causal LM over an architecture's layers (its class attributes, below), with the cached
    `step`, the plain and block-diffusion forwards and the cache factory."""

    # the architecture's parts, set by each architecture's subclass; each is built from the config
    attention_class: type[nn.Module]  # full-attention layers
    linear_attention_class: type[nn.Module]  # linear-attention layers
    mlp_class: type[nn.Module]  # called as mlp(x, sharing, count_experts, static) -> (y, ExpertStats | None)
    norm_class: type[nn.Module]  # norm_class(dim, eps)
    rotary_class: type[nn.Module]  # rotary_class.from_config(config)
    key_layout: KeyLayout = KeyLayout()
    live_positions: bool = True  # its layers take `live` (an eager forward computes only the positions it needs)

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_text_model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_head()

    def tie_head(self) -> None:
        """The LM head shares the embedding's tensor where the config ties them: at construction, and
        again after whatever gave each its own tensor (`to_empty`, `load_state_dict(assign=True)`, a
        checkpoint load that fills them apart)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def mlp_class_for(cls, config: CloverConfig, layer_idx: int) -> type[nn.Module]:
        """The MLP class of layer `layer_idx`: `mlp_class` in every layer, unless an architecture's
        layers differ (LLaDA2's first dense ones)."""
        return cls.mlp_class

    def build_text_model(self, config: CloverConfig) -> nn.Module:
        """The stack (`embed_tokens`, `layers`, `norm`, `rotary_emb`): `TextModel` of this class's parts."""
        return TextModel(config, type(self))

    # -- properties
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    static_steps = None  # `clover.models.static.StaticSteps` once compiled (`compile_model`)

    def make_cache(self, batch_size: int, capacity: int) -> HybridCache:
        """A cache for `batch_size` rows, built from the state each layer declares (with static steps,
        the capacity rounded up so that requests of other lengths reuse the compiled graphs)."""
        if self.static_steps is not None:
            from .static import round_capacity

            capacity = round_capacity(capacity)
        dtype, device = self.dtype, self.device
        states = [layer.make_state(batch_size, capacity, dtype=dtype, device=device) for layer in self.model.layers]
        return HybridCache(states, batch_size, capacity, device=device)

    def _layers(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segments: Segments,
        *,
        mask: torch.Tensor | None = None,
        states: list | None = None,
        lengths: torch.Tensor | None = None,
        sharing: BlockSharing | None = None,
        count_experts: bool = False,
        static: bool = False,
        router_logits: list | None = None,
        records: list | None = None,
        hidden_out: dict | None = None,
        lives: list | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run every layer (the one layer loop: training, the plain forward and every cached step,
        eager or compiled); collect router logits (into `router_logits`), the GDN commit inputs
        (into `records`), the experts touched per MoE layer (0-d tensors, when counted) and the
        outputs of the layers keyed in `hidden_out` (layer index -> [B, T, H], filled in). `lives`: each
        layer's `Live` (the positions it computes), or None for every position."""
        touched: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            state = states[i] if states is not None else None
            kw = {} if lives is None or lives[i] is None else {"live": lives[i]}
            x, stats = layer(x, rope, segments, mask=mask, state=state, lengths=lengths, sharing=sharing,
                             count_experts=count_experts, static=static, records=records, **kw)
            if hidden_out is not None and i in hidden_out:
                hidden_out[i] = x
            if stats is not None:
                if router_logits is not None:
                    router_logits.append(stats.router_logits)
                if stats.experts_touched is not None:
                    touched.append(stats.experts_touched)
        return x, touched

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))

    # -- attention masks: where the config's `commit_attention` acts (how a commit part sees itself)
    def step_mask(self, lengths: torch.Tensor, segments: Segments, *, key_slots: int | None = None,
                  denoise_valid: torch.Tensor | None = None) -> torch.Tensor:
        """The cached step's attention mask (`cached_attention_mask`): the commit part causal
        (`commit_attention` "causal"), or block-causal where the step names its blocks
        (`segments.commit_block`, which a "block" model's steps must); the denoise block
        bidirectional inside and after the commit part; `denoise_valid [B, Bd]`: a row's block keys
        after its end are not there. A whole-sequence model (`commit_attention` "full") has no
        commit order: every query sees every cached key, this forward's commit keys and the block
        (Fast-dLLM's caches of the canvas mode)."""
        full = self.config.commit_attention == "full"
        if self.config.commit_attention != "causal" and segments.commit_block is None and not full:
            raise self.config.semantics.refuse("commit_attention", "the cached step's attention mask")
        mask = cached_attention_mask(lengths, segments, key_slots=key_slots)
        if full and segments.commit_len:  # every row reads what a block row reads (the commit's valid keys, the block)
            n = segments.n_commit if segments.n_commit is not None else torch.full_like(lengths, segments.commit_len)
            cols = torch.arange(mask.shape[-1] - segments.denoise_len, device=lengths.device) < (lengths + n)[:, None]
            cols = torch.cat([cols, cols.new_ones(cols.shape[0], segments.denoise_len)], dim=1)
            mask = cols[:, None, None, :].expand(-1, 1, mask.shape[2], -1)
        if denoise_valid is not None:
            mask = mask.clone()
            mask[..., -denoise_valid.shape[1]:] &= denoise_valid[:, None, None, :]
        return mask

    def forward_mask(self, input_ids: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor | None:
        """The plain forward's mask: None (causal, `commit_attention` "causal"), or every key of the
        row (`commit_attention` "full": the whole-sequence models), `key_valid [B, T]` its keys."""
        c = self.config.commit_attention
        if c == "full":
            B, T = input_ids.shape
            mask = torch.ones(B, 1, T, T, dtype=torch.bool, device=input_ids.device)
            return mask if key_valid is None else mask & key_valid[:, None, None, :]
        if c != "causal":
            raise self.config.semantics.refuse("commit_attention", "the plain forward")
        if key_valid is not None:
            raise ValueError("key_valid: only a whole-sequence model (commit_attention 'full') takes one")
        return None

    def training_mask(self, L: int, k: int, block_size: int, device) -> torch.Tensor:
        """The block-diffusion training forward's mask (`block_diffusion_mask`): the clean stream
        causal (`commit_attention` "causal"), each noisy block over the clean prefix and itself."""
        if self.config.commit_attention != "causal":
            raise self.config.semantics.refuse("commit_attention", "the block-diffusion training mask")
        return block_diffusion_mask(L, k, block_size, device)

    # -- plain causal forward (no cache): logits [B, T, V]
    def forward(self, input_ids: torch.Tensor, *, router_logits: list | None = None,
                hidden_out: dict | None = None, key_valid: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """`router_logits`, when a list, receives each MoE layer's router logits (for the aux loss);
        `hidden_out`, when a dict, the outputs of the layers it has as keys (e.g. for a DFlash drafter).
        A whole-sequence model (`commit_attention` "full": Dream, LLaDA) attends both ways over the
        sequence; `key_valid [B, T]` (bool, a prefix per row) then says where each row's sequence ends
        (the positions after it are not attended to: right-padded rows compute what they would alone).
        `logits_at [n]` (indices into the B*T positions, row-major): the head runs on those positions
        only and the logits are [n, V] (the canvas mode reads a few positions of a long canvas)."""
        mask = self.forward_mask(input_ids, key_valid)
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, x.dtype)
        x, _ = self._layers(x, rope, Segments(commit_len=T), mask=mask, router_logits=router_logits,
                            hidden_out=hidden_out)
        if logits_at is not None:
            x = x.reshape(B * T, -1)[logits_at]
        return self._logits(x)

    # -- block-diffusion training forward (clean stream + noisy stream, vectorised over blocks)
    def forward_block_diffusion(
        self,
        clean_ids: torch.Tensor,
        noisy_ids: torch.Tensor,
        block_size: int,
        *,
        router_logits: list | None = None,
        noisy_logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """clean_ids [B, L], noisy_ids [B, k*L] (L a multiple of block_size; k >= 1 noisy copies of the
        sequence, e.g. k = 2 for complementary masks) -> (clean_logits [B, L, V], noisy_logits [B, k*L, V]).
        `noisy_logits_at` (bool [B, k*L]) computes the noisy logits only there: noisy_logits is then
        [N, V], the selected positions in row-major order (the LM head is a large share of training).

        Clean stream: causal, exactly commit mode, computed once however many noisy copies there are.
        Noisy block b of every copy (positions [b*Bs, (b+1)*Bs) of that copy) sees the clean prefix
        before it (attention: clean keys; GDN: the clean state and conv inputs at the block boundary)
        and itself bidirectionally -- exactly what the engine's denoise step computes with that prefix
        committed. Copies never see each other. The noisy logits are read shift-by-one (position i
        predicts token i+1) by the loss (`clover.train.losses`): `logit_shift` 1 only."""
        if self.config.logit_shift != 1:
            raise self.config.semantics.refuse("logit_shift", "block-diffusion training")
        B, L = clean_ids.shape
        if noisy_ids.shape[0] != B or noisy_ids.shape[1] == 0 or noisy_ids.shape[1] % max(L, 1):
            raise ValueError(
                f"noisy_ids {tuple(noisy_ids.shape)} must be [B, k*L] for clean_ids {tuple(clean_ids.shape)}"
            )
        if L % block_size:
            raise ValueError(f"sequence length {L} is not a multiple of block_size {block_size}")
        k = noisy_ids.shape[1] // L
        dev = clean_ids.device
        positions = torch.arange(L, device=dev).repeat(k + 1).expand(B, (k + 1) * L)
        mask = self.training_mask(L, k, block_size, dev)
        x = self.model.embed_tokens(torch.cat([clean_ids, noisy_ids], dim=1))
        rope = self.model.rotary_emb(positions, x.dtype)
        segments = Segments(commit_len=L, denoise_len=k * L, block_size=block_size)
        x, _ = self._layers(x, rope, segments, mask=mask, router_logits=router_logits)
        clean_x, noisy_x = x[:, :L], x[:, L:]
        if noisy_logits_at is not None:
            noisy_x = noisy_x[noisy_logits_at]
        return self._logits(clean_x), self._logits(noisy_x)

    # -- the cached step: commit and/or denoise in one forward
    @property
    def compiled(self) -> bool:
        """Whether steps run on compiled graphs where one fits (`clover.models.compile`)."""
        return self.static_steps is not None

    def has_graph(self, kind: str, width: int) -> bool:
        """Whether a step of `kind` (`Step.kind`) at block `width` runs on a compiled graph: compiled,
        and a graph of that width was built at load (or, not frozen, is built on first use)."""
        return self.static_steps is not None and self.static_steps.has_graph(kind, width)

    def step(
        self,
        cache: HybridCache,
        commit_ids: torch.Tensor | None = None,
        n_commit: torch.Tensor | None = None,
        denoise_ids: torch.Tensor | None = None,
        *,
        kind: str | None = None,
        hidden_out: dict | None = None,
        denoise_memo: list | None = None,
        **fields,
    ) -> StepOutput:
        """`run_step(cache, Step(...))` from keyword arguments (`Step`'s fields). `kind` None: what the
        parts and the cache say (a commit while the cache records is a verify). Two containers are
        filled in place, for callers that hold them: `hidden_out` (a dict keyed by layer index: those
        layers' outputs over the commit part, `Step.hidden_layers`) and `denoise_memo` when a list (an
        earlier forward's block inputs on entry, this forward's on return; a tuple is
        `Step.denoise_memo`, this forward's then in `StepOutput.memo`)."""
        if kind is None:
            kind = Step.kind_of(commit_ids, denoise_ids, verify=cache.record is not None)
        if hidden_out is not None:
            fields["hidden_layers"] = tuple(hidden_out)
        if denoise_memo is not None:
            fields["denoise_memo"] = tuple(denoise_memo)
        step = Step(kind, commit_ids, n_commit, denoise_ids, **fields)
        out = self.run_step(cache, step)
        if hidden_out is not None:
            hidden_out.update(out.hidden)
        if isinstance(denoise_memo, list):
            denoise_memo[:] = out.memo
        return out

    def run_step(self, cache: HybridCache, step: Step) -> StepOutput:
        """One forward, as `step` describes it: its commit part appended to `cache`, its denoise
        block denoised against the updated cache.

        The host side of a step (normalise `n_commit`, grow the cache, keep the commit's inputs
        while recording, advance the lengths) is here; the forward itself is `forward_step`, run
        eagerly or, with static steps, on the compiled graph of the step's kind when one fits
        (`StaticSteps.run`; never a step with an eager skip)."""
        Tc = step.commit_len
        if step.commit_block is not None and "linear_attention" in self.config.layer_types:
            raise BlockSemantics(commit_attention="block").refuse("commit_attention", "linear-attention layers")
        if step.kind == "verify" and cache.record is None:
            raise ValueError("a verify step needs a recording cache (cache.start_recording() before it)")
        if step.n_commit is not None and Tc and bool((step.n_commit == Tc).all()):
            step = dataclasses.replace(step, n_commit=None)
        cache.ensure_capacity(int(cache.lengths.max()) + Tc)
        if self.static_steps is not None:  # a batch between two compiled sizes runs in place on the larger graph
            cache.reserve_rows(self.static_steps.batch_for(cache.batch_size))
        record = cache.record is not None and Tc > 0
        states = [s.tensors() for s in cache.layers]
        hidden = dict.fromkeys(step.hidden_layers) if step.hidden_layers else None
        out = None
        if self.static_steps is not None and not step.has_skips:
            out = self.static_steps.run(step, cache.lengths, states, record=record, hidden_out=hidden)
        memo = None
        if out is None:
            memo = None if step.denoise_memo is None else list(step.denoise_memo)
            out = self.forward_step(
                step.commit_ids, step.n_commit, step.denoise_ids, cache.lengths, states,
                expert_budget=step.expert_budget, expert_rank=step.expert_rank, all_logits=step.all_logits,
                record=record, count_experts=step.track_experts, denoise_need=step.denoise_need, hidden_out=hidden,
                denoise_frozen=step.denoise_frozen, denoise_memo=memo, denoise_width=step.denoise_width,
                denoise_valid=step.denoise_valid, commit_block=step.commit_block, denoise_start=step.denoise_start)
        commit_logits, denoise_logits, touched, records = out
        if record:  # what `HybridCache.rollback` re-runs
            for state, rec in zip(cache.deltanet_states(), records):
                state.record = rec
        if Tc:
            cache.advance(step.n_commit if step.n_commit is not None else Tc)
        return StepOutput(commit_logits, denoise_logits, touched.tolist() if step.track_experts else [],
                          hidden if hidden is not None else {}, memo)

    def forward_step(
        self,
        commit_ids: torch.Tensor | None,
        n_commit: torch.Tensor | None,
        denoise_ids: torch.Tensor | None,
        lengths: torch.Tensor,
        states: list[tuple[torch.Tensor, ...]],
        *,
        expert_budget: int | None = None,
        expert_rank: str = "sum",
        all_logits: bool = False,
        record: bool = False,
        count_experts: bool = False,
        denoise_need: torch.Tensor | None = None,
        static: bool = False,
        hidden_out: dict | None = None,
        denoise_frozen: torch.Tensor | None = None,
        denoise_memo: list | None = None,
        denoise_width: int | None = None,
        denoise_valid: torch.Tensor | None = None,
        commit_block: int | None = None,
        denoise_start: torch.Tensor | None = None,
        denoise_read: torch.Tensor | None = None,
    ):
        """The forward of a cached step, over the cache's tensors (`states`: per layer
        `state.tensors()`, updated in place; `lengths` [B] before the step, not advanced here) ->
        (commit logits [B, V] at each row's last commit token (`all_logits`: [B, Tc, V]), denoise
        logits [B, Bd, V], experts touched per MoE layer [n_moe] (when counted), per GDN layer the
        commit's inputs (when `record`)).

        `static=True` is the same forward with fixed shapes and no host read, which is what
        `clover.models.static` compiles whole: K/V scattered at each row's length and attention
        over the full capacity under the length mask, a block commit as one WY chunk, the routed
        experts grouped on the device, the experts touched always counted, all denoise logits.

        Eagerly (not `static`, no expert sharing, a model whose layers take `live`), a forward
        computes only the positions it needs (`Live`): the last layer's queries, output projection
        and MLP only where logits are read (the commit's last position per row unless `all_logits`,
        the denoise positions in `denoise_need`); every other output equals the full forward's (the
        K/V, GDN state and conv inputs it writes, the logits it returns), up to floating-point
        reassociation. Two approximate skips, which the engine opts into
        (`clover.decoding.diffusion`): `denoise_frozen [B, Bd]` positions take every layer's inputs
        (attention K/V, GDN pre-conv inputs) from `denoise_memo` and compute nothing; `denoise_memo`,
        when a list, holds per layer the tensors of an earlier forward on entry and this forward's
        on return ([B, Bd, ...] each). `denoise_width`: the block's width when `denoise_ids` carries
        only its first positions (the GDN block gain's). `denoise_valid [B, Bd]` (bool, a prefix per
        row): each row's block ends there (the positions after it are not computed, not attended to,
        and read by the GDN as past the block's end), so a row computes what it would alone with
        `denoise_ids` cut there. `denoise_read [B, K]` (`static`, a model whose layers take `live`,
        no expert budget, not `all_logits`: `StaticSteps.run` passes it only there):
        the only block positions whose logits are read, K per row (repeats allowed), so the static
        forward too computes the last layer's queries, output projection and MLP and the LM head there
        only (and at each row's last commit token); the other denoise logits are garbage."""
        parts = [p for p in (commit_ids, denoise_ids) if p is not None]
        ids = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        B = ids.shape[0]
        Tc = 0 if commit_ids is None else commit_ids.shape[1]
        Bd = 0 if denoise_ids is None else denoise_ids.shape[1]
        n = n_commit if n_commit is not None else torch.full_like(lengths, Tc)
        x = self.model.embed_tokens(ids)
        positions = step_positions(lengths, n, Tc, Bd)
        if denoise_start is not None:
            positions[:, Tc:] = denoise_start[:, None] + torch.arange(Bd, device=positions.device)
        rope = self.model.rotary_emb(positions, x.dtype)
        segments = Segments(commit_len=Tc, denoise_len=Bd, n_commit=n_commit, denoise_width=denoise_width,
                            denoise_valid=denoise_valid, commit_block=commit_block)
        sharing = BlockSharing(expert_budget, B, Tc, expert_rank) if expert_budget is not None and Bd else None
        lives = None
        if not static and sharing is None and self.live_positions:
            absent = None if denoise_valid is None else ~denoise_valid
            skip = denoise_frozen if absent is None else absent if denoise_frozen is None else denoise_frozen | absent
            lives = self._lives(B, Tc, Bd, n, all_logits, denoise_need, skip, denoise_frozen, denoise_memo,
                                hidden_out, x.device)
        elif static and denoise_read is not None:
            lives = [None] * (len(self.model.layers) - 1) + [self._read_live(B, Tc, Bd, n, denoise_read)]
        mask = None
        if "full_attention" in self.config.layer_types:
            slots = next(s[0].shape[2] for s, layer in zip(states, self.model.layers)
                         if layer.layer_type == "full_attention") if static else None
            mask = self.step_mask(lengths, segments, key_slots=slots, denoise_valid=denoise_valid)
        records: list | None = [] if record else None
        x, touched = self._layers(x, rope, segments, mask=mask, states=states, lengths=lengths, sharing=sharing,
                                  count_experts=count_experts or static, static=static, records=records,
                                  hidden_out=hidden_out, lives=lives)
        if hidden_out is not None and Bd:
            for i in hidden_out:
                hidden_out[i] = hidden_out[i][:, :Tc]
        commit_logits = denoise_logits = None
        if Tc:
            if all_logits:
                commit_logits = self._logits(x[:, :Tc])
            else:
                commit_logits = self._logits(x[torch.arange(B, device=x.device), n - 1])  # [B, V]
        if Bd:
            if static and lives is not None:  # `denoise_read`: K positions per row, fixed shapes
                idx = denoise_read[..., None]
                read = self._logits(x[:, Tc:].gather(1, idx.expand(-1, -1, x.shape[-1])))  # [B, K, V]
                denoise_logits = read.new_empty(B, Bd, read.shape[-1]).scatter_(1, idx.expand(-1, -1, read.shape[-1]), read)
            elif denoise_need is None or static:
                denoise_logits = self._logits(x[:, Tc:])
            else:  # only the positions whose predictions are still needed (masked next positions)
                denoise_logits = x.new_empty(B, Bd, self.config.vocab_size)
                denoise_logits[denoise_need] = self._logits(x[:, Tc:][denoise_need])
        touched_t = torch.stack(touched) if touched else torch.zeros(0, dtype=torch.long, device=x.device)
        return commit_logits, denoise_logits, touched_t, tuple(records or ())

    def _read_live(self, B: int, Tc: int, Bd: int, n: torch.Tensor, read: torch.Tensor) -> Live:
        """The last layer's `Live` of a static forward with `denoise_read` [B, K]: every position's K/V,
        outputs at the K read block positions of each row and at its last commit token."""
        T, dev = Tc + Bd, read.device
        base = torch.arange(B, device=dev)[:, None] * T
        out = (base + Tc + read).flatten()
        if Tc:
            out = torch.cat([base[:, 0] + (n - 1).clamp(min=0), out])
        return Live(B, T, Tc, torch.arange(B * T, device=dev), out)

    def _lives(self, B: int, Tc: int, Bd: int, n: torch.Tensor, all_logits: bool, denoise_need, skip, frozen, memo,
               hidden_out, device) -> list[Live] | None:
        """Each layer's `Live` for an eager cached forward, or None when it needs every position:
        `skip` [B, Bd] the denoise positions not computed (frozen or absent), `frozen` those of them
        whose inputs come from the memo."""
        T, L = Tc + Bd, len(self.model.layers)
        read = torch.zeros(B, T, dtype=torch.bool, device=device)
        if Tc:
            if all_logits or (hidden_out is not None and L - 1 in hidden_out):
                read[:, :Tc] = True
            else:
                read[torch.arange(B, device=device), n - 1] = True
        if Bd:
            read[:, Tc:] = True if denoise_need is None else denoise_need
        # a batch's commit part is padded to its longest row; an attention-only stack computes no
        # padding (a GDN layer reads its commit positions as one run)
        pad = None
        if Tc and not self.config.has_linear_attention and bool((n < Tc).any()):
            pad = torch.arange(Tc, device=device)[None, :] >= n[:, None]
        if skip is None and memo is None and pad is None:  # only the last layer skips (the others take the plain path)
            if bool(read.all()):
                return None
            every = torch.arange(B * T, device=device)
            return [None] * (L - 1) + [Live(B, T, Tc, every, read.flatten().nonzero().squeeze(1))]
        kv = torch.ones(B, T, dtype=torch.bool, device=device)
        if pad is not None:
            kv[:, :Tc] = ~pad
        if skip is not None:
            kv[:, Tc:] = ~skip
        read &= kv
        memo_in = list(memo) if memo else [None] * L
        keep = None
        if memo is not None:
            memo.clear()
            keep = memo
        kv_idx = kv.flatten().nonzero().squeeze(1)
        out_idx = read.flatten().nonzero().squeeze(1)
        return [Live(B, T, Tc, kv_idx, out_idx if i == L - 1 else kv_idx, frozen, memo_in[i], keep)
                for i in range(L)]

    # -- initialisation for random/tiny models and training from scratch
    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None, *, on_device: bool = False) -> None:
        """normal(0, std) for matrices and embeddings, zero biases, norms at 1 (an architecture with
        other identities or special parameters overrides it). Values are drawn on the CPU
        (reproducible across devices) and copied in place; `on_device`: drawn in place on the
        parameters' device (`init_plain_weights`)."""
        init_plain_weights(self, seed, std if std is not None else self.config.initializer_range, on_device=on_device)
