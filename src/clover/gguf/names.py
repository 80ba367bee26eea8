"""What GGUF calls our tensors, one table per llama.cpp architecture, both directions.

A `Table` lists every tensor: our parameter name (after `model.layers.N.` for a layer's), the GGUF
name (after `blk.N.`), the transform on the way out (`write.py`) and its inverse on the way in
(`read.py`), so export and import read the same rows. An architecture reaches its table through
its registration (`models/registry.py`: `Architecture.gguf_arch`, `table_for`).

The qwen35moe transforms are the ones llama.cpp's own converter (`Qwen3_5MoeTextModel` in
`convert_hf_to_gguf.py`) applies:
- zero-centred RMSNorm weights (`(1 + w)`) are stored as `1 + w` (llama.cpp multiplies by the plain
  weight); the GDN output norm (`linear_attn.norm`, a plain weight) is stored as is;
- `A_log` is stored as `ssm_a = -exp(A_log)`; `dt_bias` as `ssm_dt.bias`;
- the depthwise conv `[C, 1, K]` is stored as `[C, K]`;
- GDN value heads are reordered from grouped-by-key-head (`[k0: v0 v1 | k1: v0 v1]`, what
  `repeat_interleave` expects) to tiled (`[k0 v0, k1 v0, k0 v1, k1 v1]`, what ggml's broadcast
  expects), in every tensor with a value-head axis: the V rows of `in_proj_qkv` and of the conv,
  `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`, the columns of `out_proj`, and Clover's
  per-head tensors;
- fused experts `gate_up_proj [E, 2I, H]` are split into `ffn_gate_exps` and `ffn_up_exps`;
  per-expert checkpoints are stacked first;
- `shared_expert_gate [1, H]` is stored as `[H]`.
The llama transforms are the converter's (`LlamaModel`): the q_proj and k_proj rows (and biases)
are permuted per head from the rotate-half layout to interleaved pairs (`permute_rows`; ggml's
RoPE over adjacent pairs then gives the same result), everything else is stored as it is. Export
writes the very layout the converter writes for a Llama model (SmolLM2, TinyLlama, Llama 3.x);
import undoes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..models.layers import CLOVER_PARAMETERS

# Clover-specific tensors: our parameter leaf -> GGUF leaf (after `blk.N.`); stock llama.cpp does not load them
CLOVER_TENSORS = {f"linear_attn.{n}": f"clover_{n}" for n in CLOVER_PARAMETERS}
FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, H], gate first -> ffn_gate_exps + ffn_up_exps
SPLIT_EXPERTS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up"}  # the GGUF halves of FUSED_GATE_UP
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# kept in float32 whatever --dtype says (llama.cpp's converter does the same; its ops expect f32 here)
F32_ALWAYS = re.compile(r"(_norm\.weight|ffn_gate_inp\.weight|ffn_gate_inp_shexp\.weight|ssm_conv1d\.weight|clover_conv1d_right\.weight)$")


class GGUFExportError(ValueError):
    """An input the GGUF export cannot represent (the message says what and why)."""


class GGUFImportError(ValueError):
    """A GGUF file that cannot become a model directory (the message is one line)."""


def is_clover_tensor(gguf_name: str) -> bool:
    return ".clover_" in gguf_name


# ------------------------------------------------------------------------------- the transforms
def tile_v_heads(t: torch.Tensor, dim: int, n_k: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Reorder a value-head axis from grouped ([k0: v0..v{r-1}, k1: ...]) to tiled ([k0 v0, k1 v0, ...]);
    with the two counts swapped, back (a transpose of the [n_k, per_k] grid)."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], n_k, per_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


@dataclass(frozen=True)
class Heads:
    """The head counts the transforms need (from the config): the GDN's, for the value-head
    reordering (zero where the model has no GDN), and the attention's, for llama's q/k permutation."""

    n_k: int
    n_v: int
    dk: int
    dv: int
    n_head: int = 0
    n_head_kv: int = 0

    @classmethod
    def of(cls, c) -> "Heads":
        gdn = (getattr(c, k, 0) or 0 for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                                "linear_value_head_dim"))
        return cls(*gdn, n_head=c.num_attention_heads, n_head_kv=c.num_key_value_heads)

    @property
    def per_k(self) -> int:
        return self.n_v // self.n_k

    def v(self, t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        """Grouped -> tiled along `dim`."""
        if self.n_k == self.n_v:
            return t
        return tile_v_heads(t, dim, self.n_k, self.per_k, head_dim)

    def unv(self, t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        """Tiled -> grouped along `dim`."""
        return tile_v_heads(t, dim, self.per_k, self.n_k, head_dim)

    def qkv(self, t: torch.Tensor, back: bool = False) -> torch.Tensor:
        """The V rows of a [q | k | v] stack reordered (q and k rows stay)."""
        qk = 2 * self.n_k * self.dk
        return torch.cat([t[:qk], (self.unv if back else self.v)(t[qk:], 0, self.dv)], dim=0)


Transform = Callable[[torch.Tensor, Heads], torch.Tensor]


def same(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return t


def norm_offset(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return t + 1.0  # zero-centred RMSNorm: (1 + w)


def norm_unoffset(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return t - 1.0


def qkv_rows(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return h.qkv(t)


def v_rows(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return h.v(t, 0, h.dv)


def head_rows(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return h.v(t, 0, 1)


def neg_exp_heads(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return h.v(-torch.exp(t), 0, 1)


def conv(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return h.qkv(t.squeeze(1))  # [C, 1, K] -> [C, K]


def v_cols(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return h.v(t, 1, h.dv)


def squeeze0(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return t.reshape(t.shape[-1])


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `permute(w, n_head, ...)` on the rows of q/k ([n_head*D, ...] or a bias): per head,
    the rotate-half halves [x0..x{D/2-1} | y0..] become adjacent pairs [x0 y0 x1 y1 ...]."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute_rows`."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q_pairs(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return permute_rows(t, h.n_head)


def k_pairs(t: torch.Tensor, h: Heads) -> torch.Tensor:
    return permute_rows(t, h.n_head_kv)


# each transform's inverse, for reading a file back
INVERSE: dict[Transform, Transform] = {
    same: same,
    norm_offset: norm_unoffset,
    qkv_rows: lambda t, h: h.qkv(t, back=True),
    v_rows: lambda t, h: h.unv(t, 0, h.dv),
    head_rows: lambda t, h: h.unv(t, 0, 1),
    neg_exp_heads: lambda t, h: torch.log(-h.unv(t, 0, 1)),
    conv: lambda t, h: h.qkv(t, back=True).unsqueeze(1),
    v_cols: lambda t, h: h.unv(t, 1, h.dv),
    squeeze0: lambda t, h: t.reshape(1, -1),
    q_pairs: lambda t, h: unpermute_rows(t, h.n_head),
    k_pairs: lambda t, h: unpermute_rows(t, h.n_head_kv),
}
# the transforms that only reorder elements: what a quantized weight may go through (`write._Mapper.planes`)
REARRANGING = (same, qkv_rows, v_rows, v_cols, q_pairs, k_pairs)


# ------------------------------------------------------------------------------- the tables
FLOAT_KEYS = frozenset({"rope.freq_base", "attention.layer_norm_rms_epsilon"})  # float32 (others: uint32)

@dataclass(frozen=True)
class Table:
    """One llama.cpp architecture: its tensors, ours -> (GGUF name, transform) for the layers (after
    `model.layers.N.` / `blk.N.`) and the globals; the metadata keys that are config attributes as
    they are; `writes`: whether clover writes it (export)."""

    arch: str
    layer: dict[str, tuple[str, Transform]]
    globals: dict[str, tuple[str, Transform]]
    writes: bool = True
    keys: dict[str, str] = field(default_factory=dict)  # metadata key after `{arch}.` -> config attribute
    stems: bool = False  # the layer rows are stems, each mapping its `.weight` and `.bias` (`layer_entry`)

    def write_keys(self, w, config) -> None:
        """The `keys` of `config` into the gguf.GGUFWriter `w` (uint32, float32 for FLOAT_KEYS)."""
        for key, attr in self.keys.items():
            add = w.add_float32 if key in FLOAT_KEYS else w.add_uint32
            add(f"{self.arch}.{key}", getattr(config, attr))

    def read_layer(self) -> dict[str, tuple[str, Transform]]:
        """A layer's GGUF name (after `blk.N.`) -> (our name after `model.layers.N.`, the inverse transform)."""
        return {g: (ours, INVERSE[fn]) for ours, (g, fn) in self.layer.items()}

    def read_globals(self) -> dict[str, tuple[str, Transform]]:
        """A global GGUF name -> (our name, the inverse transform)."""
        return {g: (ours, INVERSE[fn]) for ours, (g, fn) in self.globals.items()}


QWEN35MOE = Table("qwen35moe", layer={
    "input_layernorm.weight": ("attn_norm.weight", norm_offset),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", norm_offset),
    # gated attention (full-attention layers)
    "self_attn.q_proj.weight": ("attn_q.weight", same),  # per head [query | gate], as llama.cpp reads it
    "self_attn.k_proj.weight": ("attn_k.weight", same),
    "self_attn.v_proj.weight": ("attn_v.weight", same),
    "self_attn.o_proj.weight": ("attn_output.weight", same),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", norm_offset),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", norm_offset),
    # Gated DeltaNet (linear-attention layers)
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", qkv_rows),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", v_rows),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", head_rows),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", head_rows),
    "linear_attn.A_log": ("ssm_a", neg_exp_heads),
    "linear_attn.dt_bias": ("ssm_dt.bias", head_rows),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", conv),
    "linear_attn.norm.weight": ("ssm_norm.weight", same),  # plain weight: no offset
    "linear_attn.out_proj.weight": ("ssm_out.weight", v_cols),
    # mixture of experts (FUSED_GATE_UP is split in two, SPLIT_EXPERTS)
    "mlp.gate.weight": ("ffn_gate_inp.weight", same),
    "mlp.experts.down_proj": ("ffn_down_exps.weight", same),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", same),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", same),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", same),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", squeeze0),
    # Clover (the denoise mode); stock llama.cpp does not load these
    "linear_attn.conv1d_right.weight": (CLOVER_TENSORS["linear_attn.conv1d_right.weight"], conv),
    "linear_attn.intra_scale": (CLOVER_TENSORS["linear_attn.intra_scale"], head_rows),
    "linear_attn.block_gain_a": (CLOVER_TENSORS["linear_attn.block_gain_a"], head_rows),
    "linear_attn.block_gain_b": (CLOVER_TENSORS["linear_attn.block_gain_b"], head_rows),
}, globals={
    "model.embed_tokens.weight": ("token_embd.weight", same),
    "model.norm.weight": ("output_norm.weight", norm_offset),
    "lm_head.weight": ("output.weight", same),
}, keys={  # docs/gguf.md "Metadata"; `rope.dimension_sections`, `ssm.inner_size`, `attention.recurrent_layers` are derived
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size", "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.value_length": "head_dim", "rope.freq_base": "rope_theta",
    "rope.dimension_count": "rotary_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "ssm.conv_kernel": "linear_conv_kernel_dim", "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads", "ssm.time_step_rank": "linear_num_value_heads",
    "full_attention_interval": "full_attention_interval",
})

# llama (SmolLM2, TinyLlama, Llama 3.x), as llama.cpp's converter writes it (`LlamaModel`). A layer's
# entries hold the stem: `.weight` and `.bias` both map (`layer_entry`).
LLAMA = Table("llama", stems=True, layer={
    "input_layernorm": ("attn_norm", same),
    "post_attention_layernorm": ("ffn_norm", same),
    "self_attn.q_proj": ("attn_q", q_pairs),
    "self_attn.k_proj": ("attn_k", k_pairs),
    "self_attn.v_proj": ("attn_v", same),
    "self_attn.o_proj": ("attn_output", same),
    "mlp.gate_proj": ("ffn_gate", same),
    "mlp.up_proj": ("ffn_up", same),
    "mlp.down_proj": ("ffn_down", same),
}, globals={
    "model.embed_tokens.weight": ("token_embd.weight", same),
    "model.norm.weight": ("output_norm.weight", same),
    "lm_head.weight": ("output.weight", same),
}, keys={  # the converter's keys; import reads them back (`read.llama_config`)
    "vocab_size": "vocab_size", "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.value_length": "head_dim", "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
})


def layer_entry(table: Table, leaf: str, read: dict[str, tuple[str, Transform]] | None = None
                ) -> tuple[str, Transform] | None:
    """A layer tensor's row of `table` (our leaf after `model.layers.N.`, or with `read`, the table's
    `read_layer()` built once by the caller, the GGUF leaf after `blk.N.`): (the other side's leaf, the
    transform, or with `read` its inverse), or None. A table of stems (`stems`) maps a stem's
    `.weight` and `.bias` alike."""
    rows = table.layer if read is None else read
    if not table.stems:
        return rows.get(leaf)
    stem, _, kind = leaf.rpartition(".")
    if stem not in rows or kind not in ("weight", "bias"):
        return None
    other, fn = rows[stem]
    return f"{other}.{kind}", fn

TABLES = {t.arch: t for t in (LLAMA, QWEN35MOE)}  # what import-gguf reads, by general.architecture


def table_for(config) -> Table | None:
    """The GGUF table of a config's architecture (its registration's `gguf_arch`), or None."""
    from ..models import architecture_of

    return TABLES.get(architecture_of(config).gguf_arch)


# ------------------------------------------------------------------------------ DFlash drafter
# A DFlash drafter (`clover.models.dflash`) as a GGUF of its own, for the llama.cpp port's `--mode
# dflash --drafter FILE` (stock llama.cpp has no such architecture). Its norms are plain Qwen3 ones
# (`w * x / rms(x)`), stored as they are; no embedding and no LM head (the target's).
DRAFTER = Table("dflash", layer={
    "input_layernorm.weight": ("attn_norm.weight", same), "post_attention_layernorm.weight": ("ffn_norm.weight", same),
    "self_attn.q_proj.weight": ("attn_q.weight", same), "self_attn.k_proj.weight": ("attn_k.weight", same),
    "self_attn.v_proj.weight": ("attn_v.weight", same), "self_attn.o_proj.weight": ("attn_output.weight", same),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", same), "self_attn.k_norm.weight": ("attn_k_norm.weight", same),
    "mlp.gate_proj.weight": ("ffn_gate.weight", same), "mlp.up_proj.weight": ("ffn_up.weight", same),
    "mlp.down_proj.weight": ("ffn_down.weight", same),
}, globals={
    "fc.weight": ("fc.weight", same), "hidden_norm.weight": ("hidden_norm.weight", same),
    "norm.weight": ("output_norm.weight", same),
}, keys={  # DFlashConfig's attributes; the drafter's own keys follow (write.export_drafter_gguf)
    "embedding_length": "hidden_size", "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
    "attention.value_length": "head_dim", "feed_forward_length": "intermediate_size",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta", "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings",
})
