"""DFlash block drafter (arXiv 2602.06036; reference code z-lab/dflash, `DFlashDraftModel`): a few
Qwen3-style layers that draft a whole block in one non-causal forward, conditioned on a target
model's hidden states.

The published layout, which this module reads and writes:
- `config.json`: a Qwen3 config (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
  `num_key_value_heads`, `head_dim`, `intermediate_size`, `rms_norm_eps`, `rope_theta` or
  `rope_parameters.rope_theta`, `vocab_size`), `block_size` (top level or in `dflash_config`),
  `num_target_layers`, and `dflash_config` with `target_layer_ids` and `mask_token_id`
  (`input_embedding_scale`, `output_multiplier`, `final_logit_softcapping` optional;
  `draft_vocab_size` for a reduced draft vocabulary, below);
- safetensors: `fc.weight [H, n*H_t]`, `hidden_norm.weight`, `layers.N.{input_layernorm,
  post_attention_layernorm}.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`,
  `layers.N.self_attn.{q,k}_norm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`, `norm.weight`.
  No embedding and no LM head: both are the target's.

A reduced draft vocabulary (EAGLE-3's `d2t`, here on a borrowed head): with `draft_vocab_size` V_d
the drafter scores only V_d of the target's tokens, the rows of the target's LM head they name, and
stores `d2t` [V_d] (int64; draft index d is target token d + d2t[d], as EAGLE-3 writes it). On a
small target the full head is most of a draft's cost (SmolLM2-135M: 15 x 49k head rows against two
576-wide layers); a token outside the set is never drafted, so a block stops there and the verify
stays lossless. `logits` scatters the scores back into the target's vocabulary (the rest at a large
negative value), so sampling, grammars and the rejection rule see the usual shape.

The computation: the target's hidden states after layers `target_layer_ids` (the reference's
`hidden_states[i + 1]`: decoder layer i's output; the last layer's is after the final norm) are
concatenated per token, projected by `fc` and normed (`hidden_norm`): one context vector per
committed token. Every draft layer projects those vectors with its own `k_proj`/`v_proj` (+ `k_norm`,
RoPE at the token's position) into extra keys and values, kept in the drafter's cache. The block --
the anchor (the last token the target produced, not yet committed) and `block_size - 1` mask
tokens, embedded with the target's embedding -- attends to all context keys and to itself
bidirectionally. Block position i >= 1 (after the final `norm` and the target's LM head) predicts
the token at that position (no shift: the anchor predicts nothing).

Norms are Qwen3's (`w * x / rms(x)`, w initialised to 1), unlike the zero-centred norms of the target
family; RoPE covers the whole head. z-lab's current drafters (both layouts) have mostly sliding-window
layers (`layer_types`, `sliding_window`): as in its code, a sliding layer's block is also causal
(each block position sees the positions up to its own) unless the config's `is_causal` says otherwise,
and every layer's keys lie within the window of the query's position.

DFlash2 (`architectures: ["DFlash2DraftModel"]`, the dflash package's `DFlash2DraftModel`) is DFlash
plus two modules, both read from `dflash_config`:
- per layer two grouped dynamic causal convolutions over the block's positions
  (`conv_kernel_size` K, `conv_group_size` G): `attention_conv` mixes the normed input before
  attention and `mlp_conv` before the MLP; each also mixes the sublayer's output with a second
  kernel (keys `layers.N.{attention,mlp}_conv.{base_kernel [2, K, H], kernel_projection.weight
  [2*K*H/G, H]}`);
- a candidate selector (`selector_rank` R, `selector_top_k` k): the draft is a left-to-right path
  through each position's top-k tokens scored by the logit plus a low-rank pair term between the
  token before and the candidate (keys `candidate_selector.{predecessor_codebook,
  successor_codebook}` [V, R], stored without `.weight`, and `candidate_selector.hidden_projection.weight`).
Which modules and key names a layout has is the table `LAYOUTS`; any other architecture is refused.

The vLLM `speculators` layout of a DFlash drafter (`speculators_model_type: "dflash"`, its
`DFlashDraftModel`; `from_speculators` reads it) has the same tensor names and computation under another
config.json: the Qwen3 keys sit in `transformer_layer_config`, and `block_size`, `mask_token_id`,
`draft_vocab_size` (equal to the vocabulary: none) at the top. Its `aux_hidden_state_layer_ids` count
vLLM's way (id i: the input of decoder layer i, `hidden_states[i]`), one more than `target_layer_ids`;
id 0 (the embedding) and id n (the final hidden state) have no z-lab counterpart and are refused. A
reduced vocabulary stores `d2t` as EAGLE-3 does, plus `t2d` and `lm_head.weight` (the target head's rows,
frozen in speculators' training), which clover does not read: it takes those rows from the target.
Not read: `sample_from_anchor` (the anchor predicts too) and sliding-window layers (speculators' window
ends at the anchor, not at the query). Saving such a drafter writes z-lab's layout.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import AttentionState, HybridCache, scatter_kv
from ..config import ConfigError
from .qwen3 import Qwen3Attention
from .static import call_frozen
from .layers import PlainRMSNorm, init_plain_weights, MLP, RotaryEmbedding, Segments, cached_attention_mask, step_positions

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DrafterLayout:
    """One published drafter layout: the `dflash_config` keys its extra modules need, and stored key
    -> parameter name renames (beyond the optional "model." prefix)."""
    required: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()  # stored keys clover does not read


# architectures name -> layout (z-lab's `dflash` package: `DFlashDraftModel`, `DFlash2DraftModel`)
LAYOUTS = {
    ARCHITECTURE: DrafterLayout(),
    "DFlash2DraftModel": DrafterLayout(
        required=("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
        renames=tuple((f"candidate_selector.{n}", f"candidate_selector.{n}.weight")
                      for n in ("predecessor_codebook", "successor_codebook"))),
}
SPECULATORS = DrafterLayout(ignored=("t2d", "lm_head.weight"))  # vLLM speculators' DFlash (`from_speculators`)
OUTSIDE = -1e4  # a draft logit for a token outside the draft vocabulary


class DrafterMismatch(ValueError):
    """A drafter that does not fit the target it was loaded next to."""


# --------------------------------------------------------------------------- config
@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    head_dim: int | None = None
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None  # a reduced draft vocabulary (`d2t`), or None: the target's whole head
    architecture: str = ARCHITECTURE  # a key of LAYOUTS
    conv_kernel_size: int | None = None  # DFlash2: the dynamic convolutions' width (None: none)
    conv_group_size: int | None = None
    selector_rank: int | None = None  # DFlash2: the candidate selector (None: none)
    selector_top_k: int | None = None
    layer_types: list[str] | None = None  # per layer "full_attention" or "sliding_attention" (None: all full)
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: the sliding layers' blocks are causal, the full ones' not (z-lab's rule)
    layout: str = "z-lab"  # the config.json it was read from: "z-lab" or "speculators" (saved as z-lab's)
    torch_dtype: str = "float32"
    extra: dict = field(default_factory=dict)  # other config.json keys, written back unchanged

    tie_word_embeddings = False  # no LM head of its own (`save_model` reads this)
    has_experts = False  # dense MLPs: no router (the trainer's aux loss asks)
    has_linear_attention = False

    @property
    def qkv_bias(self) -> bool:
        """Qwen3's `attention_bias` covers q/k/v as well as o (what `Qwen3Attention` reads)."""
        return self.attention_bias

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict, *, source: str = "config.json") -> "DFlashConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        archs = raw.get("architectures") or [ARCHITECTURE]
        if len(archs) != 1 or archs[0] not in LAYOUTS:
            raise ConfigError(f"{source}: architectures {archs} is not a drafter layout clover reads "
                              f"({', '.join(LAYOUTS)})")
        layout = LAYOUTS[archs[0]]
        if "transformer_layer_config" in raw or "speculators_model_type" in raw:
            return replace(cls.from_dict(from_speculators(raw, source), source=source), layout="speculators")
        dc = raw.get("dflash_config") or {}
        get = lambda k, d=None: dc.get(k, raw.get(k, d))  # noqa: E731 - dflash_config wins, as in the reference
        types = raw.get("layer_types") or None
        bad = [t for t in types or [] if t not in ("full_attention", "sliding_attention")]
        if bad or (types is not None and len(types) != raw.get("num_hidden_layers")):
            raise ConfigError(f"{source}: layer_types {types} is not one of full_attention / sliding_attention per "
                              "drafter layer")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in raw]
        missing += [k for k in ("target_layer_ids", "mask_token_id", *layout.required) if get(k) is None]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)}; not a DFlash drafter config")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default" or raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: rope_type {rope.get('rope_type', rope.get('type'))!r} / hidden_act "
                              f"{raw.get('hidden_act')!r}: a drafter reads default RoPE and SiLU MLPs only")
        known = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "vocab_size", "dflash_config", "block_size", "head_dim", "num_target_layers", "rms_norm_eps",
                 "rope_theta", "rope_parameters", "attention_bias", "max_position_embeddings", "torch_dtype", "dtype",
                 "architectures", "model_type", "layer_types", "is_causal", "sliding_window"}
        opt = lambda k: None if get(k) is None else int(get(k))  # noqa: E731
        try:
            return cls(
                hidden_size=int(raw["hidden_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
                intermediate_size=int(raw["intermediate_size"]), vocab_size=int(raw["vocab_size"]),
                target_layer_ids=[int(i) for i in get("target_layer_ids")], mask_token_id=int(get("mask_token_id")),
                block_size=int(get("block_size", 16)), head_dim=raw.get("head_dim"),
                num_target_layers=raw.get("num_target_layers"), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1e6))),
                attention_bias=bool(raw.get("attention_bias", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=get("final_logit_softcapping"),
                draft_vocab_size=None if get("draft_vocab_size") is None else int(get("draft_vocab_size")),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                architecture=archs[0], conv_kernel_size=opt("conv_kernel_size"), conv_group_size=opt("conv_group_size"),
                selector_rank=opt("selector_rank"), selector_top_k=opt("selector_top_k"),
                layer_types=None if types is None or set(types) == {"full_attention"} else list(types),
                sliding_window=None if raw.get("sliding_window") is None else int(raw["sliding_window"]),
                is_causal=None if raw.get("is_causal") is None else bool(raw["is_causal"]),
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "DFlashConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json; a drafter directory holds config.json and its safetensors")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        arch = d.pop("architecture")
        d.pop("layout")
        dc = {k: d.pop(k) for k in ("target_layer_ids", "mask_token_id", "input_embedding_scale",
                                    "output_multiplier", "final_logit_softcapping", "draft_vocab_size",
                                    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
        dc = {k: v for k, v in dc.items() if not (k in ("input_embedding_scale", "output_multiplier") and v == 1.0)
              and v is not None}
        theta = d.pop("rope_theta")
        d["layer_types"] = d["layer_types"] or ["full_attention"] * self.num_hidden_layers
        d = {k: v for k, v in d.items() if not (k in ("sliding_window", "is_causal") and v is None)}
        return {"architectures": [arch], "model_type": "qwen3", **extra, **d, "dflash_config": dc,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta}}

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def check_target(self, target) -> None:
        """DrafterMismatch (one line naming the mismatch) unless this drafter fits `target` (a CloverConfig)."""
        t, n = target, target.num_hidden_layers
        aux = [i + 1 for i in self.target_layer_ids]
        if self.layout == "speculators" and max(aux) >= n:
            why = ("names the final hidden state, which clover does not feed a speculators drafter" if max(aux) == n
                   else "names a layer it does not have; this drafter was trained for another model")
            raise DrafterMismatch(f"drafter: aux_hidden_state_layer_ids {aux} (the target has {n} layers) {why}")
        if self.hidden_size != t.hidden_size:
            raise DrafterMismatch(f"drafter: hidden_size {self.hidden_size} != the target's {t.hidden_size}; "
                                  "this drafter was trained for another model")
        if self.vocab_size != t.vocab_size:
            raise DrafterMismatch(f"drafter: vocab_size {self.vocab_size} != the target's {t.vocab_size}; "
                                  "this drafter was trained for another model")
        bad = [i for i in self.target_layer_ids if not 0 <= i < n]
        if bad:
            raise DrafterMismatch(f"drafter: target_layer_ids {self.target_layer_ids} name layer {bad[0]}, but the "
                                  f"target has {n} layers; this drafter was trained for another model")
        if self.num_target_layers is not None and self.num_target_layers != n:
            raise DrafterMismatch(f"drafter: num_target_layers {self.num_target_layers} != the target's {n} layers; "
                                  "this drafter was trained for another model")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= t.vocab_size:
            raise DrafterMismatch(f"drafter: draft_vocab_size {self.draft_vocab_size} does not fit the target's "
                                  f"vocabulary ({t.vocab_size})")
        if not 0 <= self.mask_token_id < t.vocab_size:
            raise DrafterMismatch(f"drafter: mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                                  f"({t.vocab_size})")


def from_speculators(raw: dict, source: str = "config.json") -> dict:
    """A vLLM `speculators` DFlash config.json -> the z-lab config dict `DFlashConfig.from_dict` reads
    (the module docstring says what maps to what); ConfigError in one line for what has no z-lab
    counterpart."""
    kind, tl = raw.get("speculators_model_type"), raw.get("transformer_layer_config")
    if kind != "dflash" or not isinstance(tl, dict):
        raise ConfigError(f"{source}: speculators_model_type {kind!r}: clover reads speculators' dflash drafters "
                          "(with a transformer_layer_config object) only")
    ids = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 1 for i in ids):
        raise ConfigError(f"{source}: aux_hidden_state_layer_ids {ids!r}: a speculators drafter needs target layer "
                          "ids of 1 or more (id 0, the embedding output, is not fed to a drafter)")
    if raw.get("sample_from_anchor"):
        raise ConfigError(f"{source}: sample_from_anchor is true (the anchor predicts a token too); clover's "
                          "DFlash drafts from the positions after the anchor only")
    if "sliding_attention" in (tl.get("layer_types") or []):
        raise ConfigError(f"{source}: sliding-window layers in the speculators layout (its window ends at the "
                          "anchor, z-lab's at the query) are not read")
    hidden, wide = tl.get("hidden_size"), raw.get("target_hidden_size")
    if wide is not None and wide != hidden:
        raise ConfigError(f"{source}: target_hidden_size {wide} != hidden_size {hidden}; speculators' DFlash "
                          "reads target layers as wide as itself")
    draft_vocab = raw.get("draft_vocab_size")
    dc = {"block_size": raw.get("block_size", 8), "target_layer_ids": [i - 1 for i in ids],
          "mask_token_id": raw.get("mask_token_id"),
          "draft_vocab_size": None if draft_vocab in (None, tl.get("vocab_size")) else draft_vocab}
    dtype = {k: raw[k] for k in ("torch_dtype", "dtype") if raw.get(k)}
    return {**tl, **dtype, "architectures": [ARCHITECTURE], "dflash_config": {k: v for k, v in dc.items() if v is not None}}


# --------------------------------------------------------------------------- layers
def layer_masks(c: DFlashConfig, mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> list[torch.Tensor]:
    """Per draft layer its attention mask: `mask` [B, 1, Q, K] (bool) narrowed where the layer is
    causal (a key at a later position than the query is hidden) or sliding (a key `sliding_window` or
    more positions away is hidden; z-lab's published configs set `sliding_window` without transformers'
    `use_sliding_window`, and the window is what they mean), z-lab's `_attention_mask`.
    q_pos [B, Q], k_pos [B, K]."""
    if c.layer_types is None and not c.is_causal:
        return [mask] * c.num_hidden_layers
    d = q_pos[:, None, :, None] - k_pos[:, None, None, :]  # [B, 1, Q, K] how far behind the query a key is
    out = []
    for t in c.layer_types or ["full_attention"] * c.num_hidden_layers:
        sliding = t == "sliding_attention"
        causal = sliding if c.is_causal is None else c.is_causal
        m = mask & (d >= 0) if causal else mask
        if sliding and c.sliding_window is not None:
            m = m & (d < c.sliding_window) & (causal or (-d < c.sliding_window))
        out.append(m)
    return out


class DraftAttention(Qwen3Attention):
    """Qwen3's attention (q/k norms, no output gate): queries from the block; keys/values from the
    context vectors (cached, `kv`) and the block itself."""

    def forward(self, h: torch.Tensor, rope_q, ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h [B, Bd, H] (normed block), ctx_k/v [B, Hkv, Lk, D] -> [B, Bd, H]; mask [B, 1, Bd, Lk + Bd]."""
        q, k, v, _ = self.project(h, rope_q)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.finish(out, None)


def causal_group_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """x [B, T, H] mixed along T causally: out[t] = sum_o (base[o] + dynamic[t, o]) * x[t - o], the
    dynamic part one scalar per channel group of `group`. dynamic [B, T, K, H/group], base [K, H]."""
    B, T, H = x.shape
    K = base.shape[0]
    xs = x.view(B, T, H // group, group)
    dyn = dynamic.reshape(B, T, K, H // group, 1)
    out = torch.zeros_like(xs)
    for o in range(K):
        shifted = xs if o == 0 else F.pad(xs[:, :-o], (0, 0, 0, 0, o, 0))
        out = out + base[o].view(1, 1, H // group, group).to(x.dtype) * shifted
        out = torch.addcmul(out, dyn[:, :, o], shifted)
    return out.view_as(x)


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution around a sublayer: kernels from the sublayer's
    input mix its input (`before`) and its output (`after`) along the block's positions."""

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        if hidden % group:
            raise ConfigError(f"drafter: conv_group_size {group} does not divide hidden_size {hidden}")
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def around(self, sublayer, x: torch.Tensor, width: int) -> torch.Tensor:
        """sublayer(conv(x)) conv'ed again; x [B, T, H] holds blocks of `width` positions each (T a
        multiple: training runs many blocks at once); the convolution never crosses a block."""
        B, T, H = x.shape
        dyn = self.kernel_projection(x).view(B, T, 2, self.kernel, H // self.group)
        blocks = lambda t: t.reshape(B * T // width, width, *t.shape[2:])  # noqa: E731
        y = causal_group_conv(blocks(x), blocks(dyn[:, :, 0]), self.base_kernel[0], self.group).view(B, T, H)
        y = sublayer(y)
        return causal_group_conv(blocks(y), blocks(dyn[:, :, 1]), self.base_kernel[1], self.group).view(B, T, H)


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = PlainRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = PlainRMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.conv_kernel_size is not None:  # DFlash2
            self.attention_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, x, rope_q, ctx_k, ctx_v, mask, width: int | None = None) -> torch.Tensor:
        """width: the block's positions (x holds one block per row, or several in a row when training)."""
        attn = functools.partial(self.self_attn, rope_q=rope_q, ctx_k=ctx_k, ctx_v=ctx_v, mask=mask)
        if not hasattr(self, "attention_conv"):
            x = x + attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        width = width or x.shape[1]
        x = x + self.attention_conv.around(attn, self.input_layernorm(x), width)
        return x + self.mlp_conv.around(self.mlp, self.post_attention_layernorm(x), width)


class CandidateSelector(nn.Module):
    """DFlash2's draft choice: position by position, among the top-k tokens of the drafter's logits,
    the one with the best logit + <predecessor_codebook[previous] * hidden_projection(h),
    successor_codebook[candidate]> (previous: the anchor, then the token chosen before)."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.top_k = c.selector_top_k
        self.predecessor_codebook = nn.Embedding(c.vocab_size, c.selector_rank)
        self.successor_codebook = nn.Embedding(c.vocab_size, c.selector_rank)
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)

    def select(self, h: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """h [B, D, H], logits [B, D, V], anchors [B] -> the greedy path [B, D]."""
        unary, cands = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)  # [B, D, k]
        hp = self.hidden_projection(h.to(self.hidden_projection.weight.dtype))
        prev, path = anchors, []
        for j in range(h.shape[1]):
            pair = torch.einsum("br,bkr->bk", self.predecessor_codebook(prev) * hp[:, j],
                                self.successor_codebook(cands[:, j]))
            pick = torch.argmax(unary[:, j] + pair.to(unary.dtype), dim=-1)
            prev = cands[:, j].gather(-1, pick[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


# --------------------------------------------------------------------------- the drafter
def mask_embedding(target, mask_token_id: int) -> torch.Tensor:
    """The vector `target` embeds its mask token with (what the drafter reads for a block's masks; a
    clover Llama's denoise adapter embeds it with a vector of its own, not the embedding's row)."""
    with torch.no_grad():
        return target.model.embed_tokens(torch.tensor([mask_token_id], device=target.device))[0].detach()


class DFlashDrafter(nn.Module):
    key_layout = None  # set below: stored keys are our parameter names (an optional "model." prefix dropped)

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = PlainRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = PlainRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope_theta)
        if c.draft_vocab_size is not None:  # draft index d -> target token d + d2t[d] (EAGLE-3's layout)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        if c.selector_rank is not None:  # DFlash2
            if c.draft_vocab_size is not None:
                raise ConfigError("drafter: a candidate selector over a reduced draft vocabulary is not supported")
            self.candidate_selector = CandidateSelector(c)
        self.key_layout = DrafterKeyLayout(SPECULATORS if c.layout == "speculators" else LAYOUTS[c.architecture])
        self._head_rows = None  # (the target head's weight, its rows of the draft vocabulary), cached

    # -- properties the engine reads
    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The verify widths (anchor + drafts) a draft may be cut to: 4, 8 and the full block
        (compiled at load beside the full block's draft, `clover.models.static.load_shapes`)."""
        return tuple(w for w in (4, 8) if w < self.block_size) + (self.block_size,)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # -- pieces
    def context_features(self, hidden: dict[int, torch.Tensor], target) -> torch.Tensor:
        """The target's layer outputs (`hidden[i]` [B, T, H_t], from `step(hidden_out=...)` or
        `forward(hidden_out=...)`) -> the drafter's context input [B, T, n*H_t], as the reference's
        `extract_context_feature` (the last layer's output is taken after the target's final norm)."""
        last = target.config.num_hidden_layers - 1
        parts = [target.model.norm(hidden[i]) if i == last else hidden[i] for i in self.config.target_layer_ids]
        return torch.cat(parts, dim=-1).to(self.dtype)

    def embed(self, ids: torch.Tensor, target) -> torch.Tensor:
        x = target.model.embed_tokens(ids).to(self.dtype)
        s = self.config.input_embedding_scale
        return x * s if s != 1.0 else x

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target token of each draft index [V_d], or None (the whole vocabulary)."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, token_ids) -> None:
        """Fix the draft vocabulary to `token_ids` (distinct target token ids, V_d of them)."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"drafter: the draft vocabulary needs {self.config.draft_vocab_size} distinct token ids, "
                             f"got {ids.numel()} ({ids.unique().numel()} distinct)")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self._head_rows = None

    def _head(self, target) -> torch.Tensor:
        """The target's LM head weight, cut to the draft vocabulary's rows (cached while the head
        and the vocabulary stay the same tensors)."""
        w = target.lm_head.weight
        if self.config.draft_vocab_size is None:
            return w
        key = (w.data_ptr(), w.dtype, w.device, self.d2t.data_ptr(), self.d2t._version)
        if self._head_rows is None or self._head_rows[0] != key:
            self._head_rows = (key, w.detach()[self.draft_ids.to(w.device)].contiguous())
        return self._head_rows[1]

    def draft_logits(self, h: torch.Tensor, target) -> torch.Tensor:
        """Drafter output (after `norm`) -> logits [..., V_d] over the draft vocabulary (the target's
        whole vocabulary without one), through the target's LM head (no target norm)."""
        w = self._head(target)
        out = F.linear(h.to(w.dtype), w)
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping:
            cap = float(c.final_logit_softcapping)
            out = torch.tanh(out / cap) * cap
        return out

    def select(self, h: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor | None:
        """Greedy drafts [B, D] from DFlash2's candidate selector (h [B, D, H] the outputs of block
        positions 1..D, logits theirs, anchors [B]), or None: the argmax is the greedy draft."""
        sel = getattr(self, "candidate_selector", None)
        return None if sel is None else sel.select(h, logits, anchors)

    def logits(self, h: torch.Tensor, target) -> torch.Tensor:
        """Drafter output -> logits over the target's vocabulary; with a draft vocabulary, tokens
        outside it get `OUTSIDE` (finite: a temperature or a grammar mask leaves no NaN behind)."""
        out = self.draft_logits(h, target)
        if self.config.draft_vocab_size is None:
            return out
        full = out.new_full((*out.shape[:-1], self.config.vocab_size), OUTSIDE)
        return full.index_copy_(-1, self.draft_ids.to(out.device), out)

    def make_cache(self, batch_size: int, capacity: int) -> HybridCache:
        """Per draft layer the K/V of the context vectors; `lengths[b]` = context tokens of row b."""
        c = self.config
        states = [AttentionState.empty(batch_size, c.num_key_value_heads, capacity, c.head_dim, dtype=self.dtype,
                                       device=self.device) for _ in self.layers]
        return HybridCache(states, batch_size, capacity, device=self.device)

    # -- the cached draft forward (decoding)
    static_draft = None  # `forward_draft(static=True)` compiled (`compile_static`), or None
    static_batches: tuple[int, ...] | None = None  # after `warm_static`: frozen, the batch sizes compiled

    def draft(self, cache: HybridCache, ctx: torch.Tensor, n_ctx: torch.Tensor | None, block: torch.Tensor) -> torch.Tensor:
        """ctx [B, Tc, n*H_t] context features of the tokens committed since the last draft
        (right-padded, `n_ctx[b]` valid; Tc may be 0), block [B, Bd, H] embedded block ->
        hidden [B, Bd, H] after the final norm. The context keys are appended to `cache`. Compiled
        (`compile_static`) when the context is padded to the block's width; once frozen
        (`warm_static`), a shape without a graph runs eagerly instead of compiling."""
        B, Tc, Bd = ctx.shape[0], ctx.shape[1], block.shape[1]
        n = n_ctx if n_ctx is not None else torch.full((B,), Tc, dtype=torch.long, device=ctx.device)
        cache.ensure_capacity(int(cache.lengths.max()) + Tc)
        states = [s.tensors() for s in cache.layers]
        h = None
        if self.static_draft is not None and Tc == Bd:
            h = self._run_static(ctx, n, block, cache.lengths, states)
            self.static_calls["static" if h is not None else "eager"] += 1
        if h is None:
            h = self.forward_draft(ctx, n, block, cache.lengths, states)
        if Tc:
            cache.advance(n)
        return h

    def _run_static(self, ctx, n, block, lengths, states) -> torch.Tensor | None:
        """The compiled draft, or None where frozen and it has no graph of this shape (dynamo's
        "fail_on_recompile" stance refuses before anything ran)."""
        frozen = self.static_batches is not None
        if frozen and ctx.shape[0] not in self.static_batches:
            return None
        return call_frozen(self.static_draft, ctx, n, block, lengths, states, frozen=frozen)

    def forward_draft(self, ctx: torch.Tensor, n: torch.Tensor, block: torch.Tensor, lengths: torch.Tensor,
                      states: list, *, static: bool = False) -> torch.Tensor:
        """`draft`'s forward over the cache's tensors (`states`: per layer K/V buffers, written in
        place at `lengths`, which are not advanced here). `static=True`: fixed shapes and no host
        read (attention over the whole capacity under the length mask), what `compile_static`
        compiles."""
        Tc, Bd = ctx.shape[1], block.shape[1]
        positions = step_positions(lengths, n, Tc, Bd)
        cos, sin = self.rotary_emb(positions, block.dtype)
        rope_c, rope_q = (cos[:, :Tc], sin[:, :Tc]), (cos[:, Tc:], sin[:, Tc:])
        segments = Segments(commit_len=Tc, denoise_len=Bd, n_commit=n)
        mask = cached_attention_mask(lengths, segments, key_slots=states[0][0].shape[2] if static else None)[:, :, Tc:]
        c = self.hidden_norm(self.fc(ctx)) if Tc else None
        slots = mask.shape[-1] - Bd  # the longest row's context after this write (static: the capacity)
        q_pos = positions[:, Tc:]
        k_pos = torch.cat([torch.arange(slots, device=q_pos.device).expand(q_pos.shape[0], slots), q_pos], dim=1)
        x = block
        for layer, (keys, values), m in zip(self.layers, states, layer_masks(self.config, mask, q_pos, k_pos)):
            if Tc:
                scatter_kv(keys, values, *layer.self_attn.kv(c, rope_c), lengths)
            x = layer(x, rope_q, keys[:, :, :slots], values[:, :, :slots], m)
        return self.norm(x)

    def compile_static(self, backend: str = "inductor", *, freezing: bool = False) -> "DFlashDrafter":
        """Compile the draft forward as the target's static steps are (`clover.models.static`): one
        graph per (batch size, block width, cache capacity), used when the context is padded to
        the block's width (the decoding engine does so once a row has drafted); `freezing` as the
        target's (`compile_static`)."""
        from .static import compile_static

        self.rotary_emb.inv_freq(self.device)  # cached outside the graph
        self.static_draft = compile_static(functools.partial(self.forward_draft, static=True), self.device, backend,
                                           freezing=freezing)
        self.static_calls = Counter()  # block-wide drafts served: "static" (a graph) or "eager" (frozen, no graph)
        return self

    def warm_static(self, batches, capacities, *, bar=None) -> None:
        """Compile the draft of a full block (the anchor and `block_size - 1` masks, the context
        padded to it) at each batch size in `batches` and cache capacity in `capacities` (as the
        target's `load_shapes`), then freeze: another shape runs eagerly, never compiles.
        `bar`: a progress bar (tqdm's `update`), made by the caller."""
        Bd, F = self.block_size, self.fc.in_features
        with torch.inference_mode():  # as the engine drafts: a graph is specialised on the grad mode
            for b in batches:
                for cap in capacities:
                    cache = self.make_cache(b, cap)
                    ctx = torch.zeros(b, Bd, F, dtype=self.dtype, device=self.device)
                    block = torch.zeros(b, Bd, self.config.hidden_size, dtype=self.dtype, device=self.device)
                    n = torch.full((b,), Bd, dtype=torch.long, device=self.device)
                    self.static_draft(ctx, n, block, cache.lengths, [s.tensors() for s in cache.layers])
                    if bar is not None:
                        bar.update()
        self.static_batches = tuple(sorted({int(b) for b in batches}))

    # -- the training forward (no cache; many blocks per sequence)
    def forward_train(self, ctx: torch.Tensor, anchors: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """ctx [B, L, n*H_t] context features of a whole sequence, anchors [B, A] anchor positions,
        block [B, A, Bd, H] the embedded blocks -> hidden [B, A, Bd, H]. Block j sees the context
        vectors of positions < anchors[j] and itself, at positions anchors[j] + i: exactly what
        `draft` computes after committing those positions."""
        B, L, _ = ctx.shape
        A, Bd = anchors.shape[1], block.shape[2]
        dev = ctx.device
        pos_c = torch.arange(L, device=dev).expand(B, L)
        pos_q = (anchors[:, :, None] + torch.arange(Bd, device=dev)).reshape(B, A * Bd)
        rope_c = self.rotary_emb(pos_c, block.dtype)
        rope_q = self.rotary_emb(pos_q, block.dtype)
        q_anchor = anchors[:, :, None].expand(B, A, Bd).reshape(B, A * Bd)
        see_ctx = torch.arange(L, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, A*Bd, L]
        blk = torch.arange(A, device=dev).repeat_interleave(Bd)
        see_blk = (blk[:, None] == blk[None, :]).expand(B, A * Bd, A * Bd)
        mask = torch.cat([see_ctx, see_blk], dim=2)[:, None]
        c = self.hidden_norm(self.fc(ctx))
        x = block.reshape(B, A * Bd, -1)
        masks = layer_masks(self.config, mask, pos_q, torch.cat([pos_c, pos_q], dim=1))
        for layer, m in zip(self.layers, masks):
            k, v = layer.self_attn.kv(c, rope_c)
            x = layer(x, rope_q, k, v, m, width=Bd)
        return self.norm(x).reshape(B, A, Bd, -1)

    # -- initialisation
    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float = 0.02) -> None:
        init_plain_weights(self, seed, std)


class DrafterKeyLayout:
    """Stored key -> parameter name: a "model." prefix is dropped, then the layout's renames apply
    (`stored` is the way back, as `save_drafter` writes)."""

    def __init__(self, layout: DrafterLayout = DrafterLayout()) -> None:
        self.renames = dict(layout.renames)
        self.back = {v: k for k, v in layout.renames}
        self.ignored = frozenset(("d2t", *layout.ignored))  # d2t: an index buffer, `checkpoint.load_drafter` reads it apart

    def name(self, key: str) -> str | None:
        if key in self.ignored:
            return None
        key = key[len("model."):] if key.startswith("model.") else key
        return self.renames.get(key, key)

    def stored(self, name: str) -> str:
        return self.back.get(name, name)

    def expert_part(self, name: str):
        return None


DFlashDrafter.key_layout = DrafterKeyLayout()  # the class's default; each drafter sets its layout's


# --------------------------------------------------------------------------- files
def build_drafter(config: DFlashConfig, *, device="cpu", dtype: torch.dtype = torch.float32, seed: int | None = 0) -> DFlashDrafter:
    """A drafter with random weights (tests, the start of training)."""
    with torch.device(device):
        d = DFlashDrafter(config)
    d.init_weights(seed)
    return d.to(dtype)


def drafter_config_for(target, *, target_layer_ids: list[int] | None = None, num_hidden_layers: int = 1,
                       intermediate_size: int | None = None, block_size: int = 16, mask_token_id: int | None = None,
                       num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                       head_dim: int | None = None, draft_vocab_size: int | None = None) -> DFlashConfig:
    """A drafter config that fits `target` (a CloverConfig): its hidden size and vocabulary, and by
    default target layers spread as in the published drafters (from layer 1 to the third-last)."""
    n = target.num_hidden_layers
    if target_layer_ids is None:
        k = min(5, max(1, n - 2))
        lo, hi = min(1, n - 1), max(min(1, n - 1), n - 3)
        target_layer_ids = sorted({round(lo + (hi - lo) * j / max(1, k - 1)) for j in range(k)})
    mask = mask_token_id if mask_token_id is not None else target.mask_token_id
    if mask is None:
        raise ValueError("drafter: the target has no mask token; pass mask_token_id (a token id of its vocabulary)")
    heads = num_attention_heads or target.num_attention_heads
    return DFlashConfig(
        hidden_size=target.hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or target.num_key_value_heads,
        intermediate_size=intermediate_size or 4 * target.hidden_size, vocab_size=target.vocab_size,
        target_layer_ids=list(target_layer_ids), mask_token_id=int(mask), block_size=block_size,
        head_dim=head_dim or target.head_dim, num_target_layers=n, rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
        draft_vocab_size=draft_vocab_size or None,
    )


def drafter_parameters(config: DFlashConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in DFlashDrafter(config).parameters())


__all__ = ["DFlashConfig", "DFlashDrafter", "DrafterMismatch", "build_drafter", "drafter_config_for",
           "drafter_parameters"]
