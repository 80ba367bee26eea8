"""Llama (`LlamaForCausalLM`, model_type `llama`): an attention-only stack of pre-norm decoder
layers (plain-weight RMSNorm, grouped-query attention with full RoPE, a SwiGLU MLP), with optional
RoPE scaling (`linear`, `llama3`) and tied or untied embeddings. SmolLM2, TinyLlama and the Llama
3.x family are of this kind.

The Clover denoise mode of an attention-only backbone needs no new parameter: the block attends to
the cached prefix and bidirectionally to itself (`cached_attention_mask`), its masked positions
hold the mask token, and the hidden state at position i predicts token i+1 (shift by one, as in
commit mode), so a converted checkpoint starts from the AR model itself. The cached `step`, the
block-diffusion training forward and `make_cache` are the model core's (`core.CausalLM`);
this file supplies its arguments (`LlamaConfig`: its keys and defaults), its layers and its
registration (`ARCHITECTURE`).

**The denoise adapter** (`config.denoise_adapter = {"rank", "alpha", "targets"}`): low-rank
adapters on the chosen projections and a learned mask-token embedding that act on the denoise
positions only (the block of a `step`, the noisy stream of `forward_block_diffusion`). Commit mode
is then exactly the AR model: AR decoding, speculative verification and the prefix the block reads
are the original weights, and conversion training trains the adapters alone (the clean stream
needs no gradient). `attach_denoise_adapter` adds them to a model in memory (training); a
checkpoint whose config names them builds them (`lora_A`/`lora_B` per target, `mask_embedding`).
The mask token is never predicted: its logit is held at -1e9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CloverConfig, ConfigError
from ..moe import BlockSharing
from .core import CausalLM, Step
from .layers import GatedAttention, PlainRMSNorm, RotaryEmbedding, Segments, apply_rope
from .registry import Architecture

ROPE_TYPES = ("default", "linear", "llama3")
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MASK_LOGIT = -1e9  # finite: an entropy over the logits stays finite (0 * log 0 -> 0)

class LoRA(nn.Module):
    """delta(x) = (x A^T) B^T * alpha / rank; B starts at zero, so the delta does."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.zeros(rank, d_in))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


class Adapted(nn.Module):
    """A module whose linear layers may carry denoise adapters (`adapters[name]`), applied from
    `denoise_from` on along time: where the denoise positions start in the forward now running (None:
    a commit only), which the decoder layer sets from its `Segments` before each call (a plain
    attribute, not a context variable, so that a compiled step traces it)."""

    denoise_from: int | None = None

    def add_adapters(self, names, rank: int, alpha: float) -> None:
        self.adapters = nn.ModuleDict({
            n: LoRA(getattr(self, n).in_features, getattr(self, n).out_features, rank, alpha)
            for n in names if hasattr(self, n)
        })

    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = getattr(self, name)(x)
        start = self.denoise_from
        adapters = self._modules.get("adapters")  # registered by add_adapters, absent otherwise
        if start is None or adapters is None or name not in adapters or start >= x.shape[1]:
            return y
        delta = adapters[name](x[:, start:])
        return torch.cat([y[:, :start], y[:, start:] + delta.to(y.dtype)], dim=1)


@dataclass(kw_only=True)
class LlamaConfig(CloverConfig):
    """A Llama `config.json`, with Llama's defaults (full rotary, theta 1e4, 2048 positions) and
    meaning (plain norm weight, every layer full attention); the hybrid stack's keys do not exist here."""

    MODEL_TYPES = ("llama",)
    HF_ARCHITECTURE = "LlamaForCausalLM"

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # the rope_parameters beyond theta ({"rope_type": "llama3", ...})
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None  # every layer "full_attention"
    # Clover: low-rank adapters applied in denoise mode only ({"rank", "alpha", "targets"}; below)
    denoise_adapter: dict | None = None

    def derive(self) -> None:
        self.derive_full_attention()

    def validate(self) -> None:
        super().validate()
        for name in ("head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"invalid config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"invalid config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.layer_types != ["full_attention"] * self.num_hidden_layers:
            raise ConfigError("llama: every layer is full attention; layer_types lists other kinds or another count")
        if self.hidden_act != "silu":
            raise ConfigError(f"llama: hidden_act {self.hidden_act!r} is not supported (silu only)")
        scaling = self.rope_scaling
        if scaling is not None:
            kind = scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ConfigError(f"llama: rope type {kind!r} is not supported; expected one of {', '.join(ROPE_TYPES)}")
            need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")}.get(kind, ())
            missing = [k for k in need if k not in scaling]
            if missing:
                raise ConfigError(f"llama: rope type {kind!r} needs {', '.join(missing)} in rope_parameters")

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """Whether the query, key and value projections carry a bias (Llama: `attention_bias`, as the
        output projection; Qwen2: always)."""
        return self.attention_bias

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        """`rope_parameters` (or the older `rope_scaling`): theta, and a scaling other than the
        default kept in `rope_scaling` (checked by `validate`)."""
        rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        rope = d.pop(rope_key, None) or {}
        d.pop("rope_scaling", None)
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {shown.get(rope_key, rope_key)!r} must be an object, got {rope!r}")
        if "rope_theta" in rope and "rope_theta" not in d:
            d["rope_theta"] = rope["rope_theta"]
            shown["rope_theta"] = f"{shown.get(rope_key, rope_key)}.rope_theta"
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            d["rope_scaling"] = {"rope_type": kind, **{k: v for k, v in rope.items()
                                                       if k not in ("rope_theta", "partial_rotary_factor", "type", "rope_type")}}

    def write_keys(self, d: dict) -> None:
        if d.get("denoise_adapter") is None or not self.is_clover:
            d.pop("denoise_adapter", None)
        d.pop("layer_types")  # every layer full attention: derived
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"), **(d.pop("rope_scaling") or {})}


def rope_inv_freq(args: LlamaConfig, device=None) -> torch.Tensor:
    """[head_dim/2] inverse frequencies, scaled as `rope_scaling` says (transformers' formulas)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    s = args.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":
        factor, lo, hi, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


class LlamaRotaryEmbedding(RotaryEmbedding):
    """Full RoPE (rotate-half) with Llama's scaled frequencies: `layers.RotaryEmbedding` over every
    dim of a head, its frequencies from `rope_inv_freq` (cached outside a compiled graph the same way)."""

    def __init__(self, args: LlamaConfig) -> None:
        super().__init__(args.head_dim, args.rope_theta)
        self.args = args

    @classmethod
    def from_config(cls, config: LlamaConfig) -> "LlamaRotaryEmbedding":
        """The core's `rotary_class.from_config` hook (the architectures on Llama's stack: Qwen2, Qwen3, LLaDA)."""
        return cls(config)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = rope_inv_freq(self.args, device)
        return self._inv_freq


class LlamaAttention(Adapted, GatedAttention):
    """Grouped-query attention without an output gate; per-head q/k norms only in a family that has
    them (`qk_norm`: Qwen3's plain RMSNorm over head_dim, before RoPE). The cached path (writing K/V
    at each row's length, attending under the step's mask) and the live path (`core.Live`: K/V at
    its kv positions, queries and the output at its out positions) are the family's."""

    qk_norm = False  # Qwen3Attention: q_norm / k_norm

    def __init__(self, args: LlamaConfig) -> None:
        nn.Module.__init__(self)
        a = args
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_attention_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_attention_heads * a.head_dim, a.hidden_size, bias=a.attention_bias)
        self.q_norm = PlainRMSNorm(self.head_dim, a.rms_norm_eps) if self.qk_norm else None
        self.k_norm = PlainRMSNorm(self.head_dim, a.rms_norm_eps) if self.qk_norm else None

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        q = self.heads(self.lin("q_proj", x), self.num_heads, self.q_norm).transpose(1, 2)
        return (apply_rope(q, *rope), *self.kv(x, rope), None)

    def kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k (normed, RoPE applied), v [B, H_kv, T, D] (also a DFlash drafter's keys
        of its context vectors, `dflash.DraftAttention`)."""
        k = self.heads(self.lin("k_proj", x), self.num_kv_heads, self.k_norm).transpose(1, 2)
        return apply_rope(k, *rope), self.heads(self.lin("v_proj", x), self.num_kv_heads).transpose(1, 2)

    def finish(self, out: torch.Tensor, gate: None) -> torch.Tensor:
        B, _, T, _ = out.shape
        return self.lin("o_proj", out.transpose(1, 2).reshape(B, T, -1))

    # the live path's queries and output (its K/V: `GatedAttention.live_kv`); never with a denoise
    # adapter, whose layout is by time (a model with one computes every position)
    def live_q(self, xo: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q = self.heads(self.q_proj(xo), self.num_heads, self.q_norm)
        return apply_rope(q[:, :, None], cos, sin)[:, :, 0], None

    def live_finish(self, o: torch.Tensor, gate: None) -> torch.Tensor:
        return self.o_proj(o)


class LlamaMLP(Adapted):
    def __init__(self, args: LlamaConfig) -> None:
        super().__init__()
        h, i, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin("down_proj", F.silu(self.lin("gate_proj", x)) * self.lin("up_proj", x))


class LlamaDecoderLayer(nn.Module):
    """`h = x + attn(input_layernorm(x))`, `out = h + mlp(post_attention_layernorm(h))`."""

    layer_type = "full_attention"

    def __init__(self, args: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = PlainRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = PlainRMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def make_state(self, batch: int, capacity: int, *, dtype: torch.dtype, device):
        return self.self_attn.make_state(batch, capacity, dtype=dtype, device=device)

    def forward(self, x, rope, segments: Segments, *, mask=None, state=None, lengths=None,
                sharing: BlockSharing | None = None, count_experts: bool = False, static: bool = False,
                records: list | None = None):
        """-> (x, None): the layer interface of the family (no routing to report)."""
        self.self_attn.denoise_from = self.mlp.denoise_from = segments.commit_len if segments.denoise_len else None
        h = self.self_attn(self.input_layernorm(x), rope, mask=mask, state=state, lengths=lengths,
                           commit_len=segments.commit_len)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), None


class LlamaEmbedding(nn.Embedding):
    """The token embeddings; with a denoise adapter the mask token's vector is its own parameter
    (`mask_embedding`), so training it leaves every other row, and the tied LM head, untouched."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.mask_id: int | None = None
        self.register_parameter("mask_embedding", None)

    def add_mask_embedding(self, mask_id: int) -> None:
        self.mask_id = mask_id
        self.mask_embedding = nn.Parameter(torch.zeros(self.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        if self.mask_embedding is None:
            return x
        return torch.where((ids == self.mask_id)[..., None], self.mask_embedding.to(x.dtype), x)


class LlamaModel(nn.Module):
    def __init__(self, config: CloverConfig, args: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = LlamaEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(config.num_hidden_layers))
        self.norm = PlainRMSNorm(config.hidden_size, args.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(args)


class LlamaForCausalLM(CausalLM):
    """The Llama stack under the model core: `forward`, `step` (commit and/or denoise),
    `forward_block_diffusion` and `make_cache` work unchanged over attention-only layers; HF Llama
    keys are our parameter names (the core's `key_layout`), and the plain initialisation is the core's."""

    live_positions = False  # its layers (and the denoise adapter's layout) compute every position

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config)
        self.args = config
        if config.denoise_adapter:
            self._build_adapter(config.denoise_adapter)

    def build_text_model(self, config: CloverConfig) -> nn.Module:
        return LlamaModel(config, config)

    # -- the denoise adapter
    def _build_adapter(self, spec: dict) -> None:
        if self.config.mask_token_id is None:
            raise ConfigError("llama: denoise_adapter needs a Clover config with mask_token_id")
        try:
            rank, alpha = int(spec["rank"]), float(spec.get("alpha", 2 * int(spec["rank"])))
            targets = tuple(spec.get("targets", ADAPTER_TARGETS))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"llama: denoise_adapter must be {{'rank': int, 'alpha': float, 'targets': [...]}}, got {spec!r}") from None
        unknown = sorted(set(targets) - set(ADAPTER_TARGETS))
        if rank < 1 or unknown:
            raise ConfigError(f"llama: denoise_adapter rank must be >= 1 and targets among {', '.join(ADAPTER_TARGETS)}"
                              + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        for layer in self.model.layers:
            layer.self_attn.add_adapters(targets, rank, alpha)
            layer.mlp.add_adapters(targets, rank, alpha)
        self.model.embed_tokens.add_mask_embedding(self.config.mask_token_id)

    @torch.no_grad()
    def attach_denoise_adapter(self, rank: int, alpha: float | None = None, targets=ADAPTER_TARGETS,
                               seed: int = 0) -> list[str]:
        """Add fresh adapters (A ~ N(0, 1/in), B = 0: the model is unchanged) and the mask embedding
        (from the mask token's row); freeze everything else. Returns the trainable parameter names."""
        spec = {"rank": int(rank), "alpha": float(alpha if alpha is not None else 2 * rank), "targets": list(targets)}
        self.config.denoise_adapter = spec
        self._build_adapter(spec)
        gen = torch.Generator().manual_seed(seed)
        dev, dtype = self.device, self.dtype
        for name, p in self.named_parameters():
            if name.endswith("lora_A"):
                p.data = (torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])).to(dev, dtype)
            elif name.endswith("lora_B"):
                p.data = torch.zeros(p.shape, device=dev, dtype=dtype)
        emb = self.model.embed_tokens
        emb.mask_embedding.data = emb.weight[self.config.mask_token_id].detach().clone().to(dev, dtype)
        trainable = []
        for name, p in self.named_parameters():
            p.requires_grad_(is_adapter_parameter(name))
            if p.requires_grad:
                trainable.append(name)
        return trainable

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(h))
        m = self.config.mask_token_id
        if m is not None:
            logits = logits.index_fill(-1, torch.tensor([m], device=logits.device), MASK_LOGIT)
        return logits

    def forward_block_diffusion(self, clean_ids, noisy_ids, block_size, *, router_logits=None, noisy_logits_at=None):
        """The family's training forward. With a denoise adapter nothing trainable touches the clean
        stream, so it runs first without autograd, as a commit into a cache, and the noisy copies
        then read its keys (the same mask, `block_diffusion_mask`'s noisy rows): the backward pass
        covers the noisy positions only."""
        if not self.config.denoise_adapter:
            return super().forward_block_diffusion(clean_ids, noisy_ids, block_size, router_logits=router_logits,
                                                   noisy_logits_at=noisy_logits_at)
        B, L = clean_ids.shape
        if noisy_ids.shape[0] != B or noisy_ids.shape[1] == 0 or noisy_ids.shape[1] % max(L, 1) or L % block_size:
            raise ValueError(f"noisy_ids {tuple(noisy_ids.shape)} must be [B, k*L] for clean_ids {tuple(clean_ids.shape)}, "
                             f"L a multiple of block_size {block_size}")
        k = noisy_ids.shape[1] // L
        cache = self.make_cache(B, L)
        with torch.no_grad():
            clean_logits = self.run_step(cache, Step("commit", clean_ids, all_logits=True)).commit_logits
        dev = clean_ids.device
        mask = self.training_mask(L, k, block_size, dev)[:, :, L:]  # [1, 1, kL, (k+1)L]: clean keys, then the copies
        positions = torch.arange(L, device=dev).repeat(k).expand(B, k * L)
        x = self.model.embed_tokens(noisy_ids)
        rope = self.model.rotary_emb(positions, x.dtype)
        x, _ = self._layers(x, rope, Segments(commit_len=0, denoise_len=k * L), mask=mask,
                            states=[s.tensors() for s in cache.layers], lengths=cache.lengths)
        if noisy_logits_at is not None:
            x = x[noisy_logits_at]
        return clean_logits, self._logits(x)


def is_adapter_parameter(name: str) -> bool:
    return ".adapters." in name or name.endswith("mask_embedding")


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The denoise adapter's tensors (what ships): every LoRA factor and the mask embedding."""
    return {k: v.detach() for k, v in model.state_dict().items() if is_adapter_parameter(k)}


ARCHITECTURE = Architecture(name="llama", config_class=LlamaConfig, model_class=LlamaForCausalLM, gguf_arch="llama")
