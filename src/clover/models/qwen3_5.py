"""Qwen3.5 (dense): the hybrid stack — Gated DeltaNet and gated full attention, 3:1 by default — with a
dense SwiGLU MLP per layer. model_type `qwen3_5_text` (`Qwen3_5ForCausalLM`) or `qwen3_5` (the
multimodal `Qwen3_5ForConditionalGeneration`, text config in `text_config`).

This file also holds what every member of the family shares on top of `layers.py`: the decoder
layer, the causal LM with its cached `step` (commit and/or denoise in one forward), the
block-diffusion training forward, `make_cache`, random initialisation and the checkpoint key layout.
`qwen3_5_moe.py` swaps the MLP for the sparse MoE; `clover.py` adds the denoise parameters to either.

One forward can carry two parts per row, laid side by side on the time axis: a *commit* part
`[B, Tc]` (causal; appended to the cache) and a *denoise* part `[B, Bd]` (one block, bidirectional
inside, reading the cache after the commit part; never written). The prompt prefill, AR decoding,
committing a finished block and denoising the next block are all instances of `step`.
`forward(input_ids)` is the plain causal forward without a cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import HybridCache
from ..config import CloverConfig, ConfigError
from ..moe import BlockSharing
from .registry import Architecture, VLLMSupport
from .layers import (
    DenseMLP,
    GatedAttention,
    GatedDeltaNet,
    Live,
    RMSNorm,
    RotaryEmbedding,
    Segments,
    block_diffusion_mask,
    cached_attention_mask,
    step_positions,
    denoise_parameters,
)

MULTIMODAL = {"qwen3_5": "qwen3_5_text"}  # the multimodal model_type -> the text model in its `text_config`


# --------------------------------------------------------------------------- arguments
@dataclass(kw_only=True)
class Qwen3_5Config(CloverConfig):
    """The text part of a Qwen3.5 `config.json` (the hybrid stack with a dense SwiGLU MLP), with
    Qwen3.5's defaults (partial RoPE at 0.25, theta 1e7, a full-attention layer every 4)."""

    MODEL_TYPES = ("qwen3_5_text",)
    HF_ARCHITECTURE = "Qwen3_5ForCausalLM"

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    # the sparse MoE's keys (`Qwen3_5MoeConfig` requires them); 0 for the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    hidden_act: str = "silu"

    def derive(self) -> None:
        if self.full_attention_interval <= 0:
            raise ConfigError(f"invalid config: full_attention_interval must be positive, got {self.full_attention_interval}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]

    def validate(self) -> None:
        super().validate()

        def bad(msg: str) -> None:
            raise ConfigError(f"invalid config: {msg}")

        for name in ("head_dim", "max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "full_attention_interval", "rms_norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        for name in self.mlp_fields():
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (0 < self.partial_rotary_factor <= 1):
            bad(f"partial_rotary_factor must lie in (0, 1], got {self.partial_rotary_factor}")
        if len(self.layer_types) != self.num_hidden_layers:
            bad(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            bad(f"unknown layer types {sorted(unknown)}; expected 'full_attention' or 'linear_attention'")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            bad(f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or too large rotary dim {self.rotary_dim}")

    @classmethod
    def mlp_fields(cls) -> tuple[str, ...]:
        return ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size")

    # the other MLP's keys, not written into this one's config.json
    UNUSED_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                   "router_aux_loss_coef")

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def has_gated_attention(self) -> bool:
        return True  # GatedAttention: the family's full-attention layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        """`rope_parameters` (or the older `rope_scaling`): theta and the partial rotary factor;
        only the default RoPE."""
        rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        rope = d.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {shown.get(rope_key, rope_key)!r} must be an object, got {rope!r}")
        where = shown.get(rope_key, rope_key)
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope and key not in d:
                d[key] = rope[key]
                shown[key] = f"{where}.{key}"
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (only the default RoPE)")

    def write_keys(self, d: dict) -> None:
        for k in self.UNUSED_KEYS:
            d.pop(k)
        d.pop("full_attention_interval")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": d.pop("partial_rotary_factor")}


# --------------------------------------------------------------------------- key layout
class KeyLayout:
    """Checkpoint key -> parameter name. The multimodal checkpoints keep the text model under
    `model.language_model.*` and carry a vision tower and an MTP head, which are skipped."""

    skipped_prefixes = ("model.visual.", "visual.", "mtp.", "model.mtp.")
    text_prefix = "model.language_model."

    def name(self, key: str) -> str | None:
        """Our parameter name for a stored key; None for keys skipped on purpose."""
        if key.startswith(self.skipped_prefixes):
            return None
        if key.startswith(self.text_prefix):
            return "model." + key[len(self.text_prefix) :]
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
        self.mlp = parts.mlp_class(config)
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


class Qwen3_5ForCausalLM(nn.Module):
    # the architecture's parts: another member of the family (or another architecture reusing this
    # stack, `step` and training forward) swaps any of them; each is built from the config
    attention_class: type[nn.Module] = GatedAttention  # full-attention layers
    linear_attention_class: type[nn.Module] = GatedDeltaNet  # linear-attention layers
    mlp_class: type[nn.Module] = DenseMLP  # called as mlp(x, sharing, count_experts, static) -> (y, ExpertStats | None)
    norm_class: type[nn.Module] = RMSNorm  # norm_class(dim, eps)
    rotary_class: type[nn.Module] = RotaryEmbedding  # rotary_class.from_config(config)
    key_layout: KeyLayout = KeyLayout()
    live_positions: bool = True  # its layers take `live` (an eager forward computes only the positions it needs)

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config, type(self))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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

    # -- plain causal forward (no cache): logits [B, T, V]
    def forward(self, input_ids: torch.Tensor, *, router_logits: list | None = None,
                hidden_out: dict | None = None) -> torch.Tensor:
        """`router_logits`, when a list, receives each MoE layer's router logits (for the aux loss);
        `hidden_out`, when a dict, the outputs of the layers it has as keys (e.g. for a DFlash drafter)."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, x.dtype)
        x, _ = self._layers(x, rope, Segments(commit_len=T), router_logits=router_logits, hidden_out=hidden_out)
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
        committed. Copies never see each other."""
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
        mask = block_diffusion_mask(L, k, block_size, dev)
        x = self.model.embed_tokens(torch.cat([clean_ids, noisy_ids], dim=1))
        rope = self.model.rotary_emb(positions, x.dtype)
        segments = Segments(commit_len=L, denoise_len=k * L, block_size=block_size)
        x, _ = self._layers(x, rope, segments, mask=mask, router_logits=router_logits)
        clean_x, noisy_x = x[:, :L], x[:, L:]
        if noisy_logits_at is not None:
            noisy_x = noisy_x[noisy_logits_at]
        return self._logits(clean_x), self._logits(noisy_x)

    # -- the cached step: commit and/or denoise in one forward
    def step(
        self,
        cache: HybridCache,
        commit_ids: torch.Tensor | None = None,
        n_commit: torch.Tensor | None = None,
        denoise_ids: torch.Tensor | None = None,
        *,
        expert_budget: int | None = None,
        expert_rank: str = "sum",
        all_logits: bool = False,
        track_experts: bool = False,
        denoise_need: torch.Tensor | None = None,
        hidden_out: dict | None = None,
        denoise_frozen: torch.Tensor | None = None,
        denoise_memo: list | None = None,
        denoise_width: int | None = None,
        denoise_valid: torch.Tensor | None = None,
    ) -> StepOutput:
        """One forward. `commit_ids [B, Tc]` (right-padded, `n_commit[b]` valid; None = all valid) are
        appended to `cache`; `denoise_ids [B, Bd]` is one block denoised against the updated cache.
        `expert_budget` shares that many experts across the denoise block (MoE only), ranked by
        `expert_rank` ("sum" or "max" of the block's router probabilities).
        `denoise_need [B, Bd]` (bool) limits the denoise logits to those positions (others are garbage).
        `hidden_out` (a dict keyed by layer index) receives those layers' outputs over the commit part
        ([B, Tc, H]; a DFlash drafter's context).
        `denoise_frozen [B, Bd]` (bool), `denoise_memo` (a list), `denoise_width` and `denoise_valid`
        are the eager forward's skips (`forward_step`); a step that uses one runs eagerly.

        The host side of a step (normalise `n_commit`, grow the cache, keep the commit's inputs
        while recording, advance the lengths) is here; the forward itself is `forward_step`, run
        eagerly or, with static steps, compiled when the call is one of their kinds."""
        if commit_ids is None and denoise_ids is None:
            raise ValueError("step needs commit_ids, denoise_ids or both")
        Tc = 0 if commit_ids is None else commit_ids.shape[1]
        if n_commit is not None and Tc and bool((n_commit == Tc).all()):
            n_commit = None
        cache.ensure_capacity(int(cache.lengths.max()) + Tc)
        if self.static_steps is not None:  # a batch between two compiled sizes runs in place on the larger graph
            cache.reserve_rows(self.static_steps.batch_for(cache.batch_size))
        record = cache.record is not None and Tc > 0
        states = [s.tensors() for s in cache.layers]
        args = (commit_ids, n_commit, denoise_ids, cache.lengths, states)
        kw = dict(expert_budget=expert_budget, expert_rank=expert_rank, all_logits=all_logits, record=record)
        out = None
        skips = dict(denoise_frozen=denoise_frozen, denoise_memo=denoise_memo, denoise_width=denoise_width,
                     denoise_valid=denoise_valid)
        if self.static_steps is not None and all(v is None for v in skips.values()):
            out = self.static_steps.run(*args, **kw, hidden_out=hidden_out)
        if out is None:
            out = self.forward_step(*args, **kw, count_experts=track_experts, denoise_need=denoise_need,
                                    hidden_out=hidden_out, **skips)
        commit_logits, denoise_logits, touched, records = out
        if record:  # what `HybridCache.rollback` re-runs
            for state, rec in zip(cache.deltanet_states(), records):
                state.record = rec
        if Tc:
            cache.advance(n_commit if n_commit is not None else Tc)
        return StepOutput(commit_logits, denoise_logits, touched.tolist() if track_experts else [])

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
        `denoise_ids` cut there."""
        parts = [p for p in (commit_ids, denoise_ids) if p is not None]
        ids = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        B = ids.shape[0]
        Tc = 0 if commit_ids is None else commit_ids.shape[1]
        Bd = 0 if denoise_ids is None else denoise_ids.shape[1]
        n = n_commit if n_commit is not None else torch.full_like(lengths, Tc)
        x = self.model.embed_tokens(ids)
        rope = self.model.rotary_emb(step_positions(lengths, n, Tc, Bd), x.dtype)
        segments = Segments(commit_len=Tc, denoise_len=Bd, n_commit=n_commit, denoise_width=denoise_width,
                            denoise_valid=denoise_valid)
        sharing = BlockSharing(expert_budget, B, Tc, expert_rank) if expert_budget is not None and Bd else None
        lives = None
        if not static and sharing is None and self.live_positions:
            absent = None if denoise_valid is None else ~denoise_valid
            skip = denoise_frozen if absent is None else absent if denoise_frozen is None else denoise_frozen | absent
            lives = self._lives(B, Tc, Bd, n, all_logits, denoise_need, skip, denoise_frozen, denoise_memo,
                                hidden_out, x.device)
        mask = None
        if "full_attention" in self.config.layer_types:
            slots = next(s[0].shape[2] for s, layer in zip(states, self.model.layers)
                         if layer.layer_type == "full_attention") if static else None
            mask = cached_attention_mask(lengths, segments, key_slots=slots)
            if denoise_valid is not None:  # a row's block keys after its end are not there
                mask = mask.clone()
                mask[..., -Bd:] &= denoise_valid[:, None, None, :]
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
            if denoise_need is None or static:
                denoise_logits = self._logits(x[:, Tc:])
            else:  # only the positions whose predictions are still needed (masked next positions)
                denoise_logits = x.new_empty(B, Bd, self.config.vocab_size)
                denoise_logits[denoise_need] = self._logits(x[:, Tc:][denoise_need])
        touched_t = torch.stack(touched) if touched else torch.zeros(0, dtype=torch.long, device=x.device)
        return commit_logits, denoise_logits, touched_t, tuple(records or ())

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
        if skip is None and memo is None:  # only the last layer skips (the others take the plain path)
            if bool(read.all()):
                return None
            every = torch.arange(B * T, device=device)
            return [None] * (L - 1) + [Live(B, T, Tc, every, read.flatten().nonzero().squeeze(1))]
        kv = torch.ones(B, T, dtype=torch.bool, device=device)
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
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """Random weights (normal(0, std) for matrices; the GDN decay and step drawn as in the
        reference; norms at their identity), and Clover's parameters at their initial values.
        Values are drawn on the CPU (reproducible across devices) and copied in place."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = std if std is not None else self.config.initializer_range
        denoise = denoise_parameters(self.config) if self.config.is_clover else {}

        def normal_(t: torch.Tensor, s: float = std) -> None:
            t.copy_(torch.randn(t.shape, generator=gen) * s)

        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            own = name.split("linear_attn.", 1)[-1] if "linear_attn." in name else None
            if own in denoise:
                p.copy_(denoise[own])
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf == "dt_bias":
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif "conv1d" in name:
                normal_(p, 1.0 / math.sqrt(self.config.linear_conv_kernel_dim))
            else:
                normal_(p)



ARCHITECTURE = Architecture(
    name="qwen3_5", config_class=Qwen3_5Config, model_class=Qwen3_5ForCausalLM, multimodal=MULTIMODAL,
    vllm=VLLMSupport("CloverDenseForCausalLM", "vllm.model_executor.models.qwen3_5:Qwen3_5ForCausalLM",
                     "transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5TextConfig"),
)
