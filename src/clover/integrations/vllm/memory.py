"""What a vLLM deployment of a Clover checkpoint holds per GPU, from the config alone (docs/scale-out.md).

How vLLM splits a Qwen3.5-MoE model over `N = tensor_parallel_size` GPUs (with
`--enable-expert-parallel`, the experts are split over the same N GPUs as whole experts instead of
slices of every expert; the bytes per GPU are the same, the kernels differ):
- attention / GDN projections, shared expert, embedding and lm_head (vocab-parallel): 1/N each;
- routed experts: 1/N of all of them (TP slices each expert's intermediate dim, EP places E/N experts);
- norms, router, GDN per-head scalars, the shared-expert gate: replicated (tiny);
- K/V cache: full-attention layers only, `num_key_value_heads` split over N but never below one head
  per GPU (with 2 KV heads and N > 2 the heads are replicated);
- GDN state: per sequence, per GDN layer, the recurrent state (value heads x dk x dv) and the conv
  state ((kernel - 1) x conv channels), both split over N by heads.

Weights only in `weight_bytes` per parameter (2 = bf16); Clover-only tensors are not loaded (the
plugin drops them). Pure arithmetic: no vLLM, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Parameters:
    """Parameter counts of the AR model vLLM loads, by how they split over GPUs."""

    sharded: int  # split 1/N: projections, shared expert, embedding, lm_head
    experts: int  # routed experts, split 1/N (TP or EP)
    replicated: int  # on every GPU

    @property
    def total(self) -> int:
        return self.sharded + self.experts + self.replicated


def parameters(c) -> Parameters:
    """`c`: a `clover.config.CloverConfig` (MoE or dense backbone)."""
    h = c.hidden_size
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    n_gdn = c.num_hidden_layers - n_attn
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = h * 2 * q + 2 * h * kv + q * h  # q_proj (query | gate), k_proj, v_proj, o_proj
    attn_rep = 2 * c.head_dim  # q_norm, k_norm
    dk, dv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    conv = 2 * dk + dv
    gdn = h * conv + h * dv + 2 * h * c.linear_num_value_heads + conv * c.linear_conv_kernel_dim + dv * h
    gdn_rep = 2 * c.linear_num_value_heads + c.linear_value_head_dim  # A_log, dt_bias, norm
    sharded = n_attn * attn + n_gdn * gdn
    replicated = n_attn * attn_rep + n_gdn * gdn_rep + c.num_hidden_layers * 2 * h + h  # layer norms, final norm
    experts = 0
    if c.has_experts:
        experts = c.num_hidden_layers * c.num_experts * 3 * h * c.moe_intermediate_size
        sharded += c.num_hidden_layers * 3 * h * c.shared_expert_intermediate_size
        replicated += c.num_hidden_layers * (c.num_experts * h + h)  # router, shared_expert_gate
    else:
        sharded += c.num_hidden_layers * 3 * h * c.intermediate_size
    emb = c.vocab_size * h
    sharded += emb if c.tie_word_embeddings else 2 * emb
    return Parameters(sharded=sharded, experts=experts, replicated=replicated)


@dataclass(frozen=True)
class PerGPU:
    gpus: int
    weight_bytes: int  # per GPU
    kv_bytes_per_token: int  # per GPU, all full-attention layers
    gdn_state_bytes_per_seq: int  # per GPU, all GDN layers (recurrent + conv)

    def total(self, tokens: int, seqs: int) -> int:
        """Weights + K/V for `tokens` cached tokens + GDN state for `seqs` running sequences."""
        return self.weight_bytes + tokens * self.kv_bytes_per_token + seqs * self.gdn_state_bytes_per_seq


def per_gpu(c, gpus: int = 1, *, weight_bytes: float = 2, kv_bytes: int = 2, state_bytes: int = 2,
            conv_bytes: int = 2) -> PerGPU:
    """Per-GPU memory of config `c` on `gpus` GPUs (tensor parallel, optionally expert parallel)."""
    if gpus < 1 or (gpus & (gpus - 1)):
        raise ValueError(f"gpus must be a power of two (vLLM splits heads evenly), got {gpus}")
    for name, heads in (("num_attention_heads", c.num_attention_heads), ("linear_num_key_heads", c.linear_num_key_heads),
                        ("linear_num_value_heads", c.linear_num_value_heads)):
        if heads % gpus:
            raise ValueError(f"{name}={heads} does not split over {gpus} GPUs")
    p = parameters(c)
    weights = math.ceil((p.sharded + p.experts) / gpus * weight_bytes + p.replicated * weight_bytes)
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    n_gdn = c.num_hidden_layers - n_attn
    kv_heads = max(1, c.num_key_value_heads // gpus)
    kv = n_attn * 2 * kv_heads * c.head_dim * kv_bytes
    hv = c.linear_num_value_heads // gpus
    conv_ch = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) // gpus
    state = n_gdn * (hv * c.linear_key_head_dim * c.linear_value_head_dim * state_bytes
                     + (c.linear_conv_kernel_dim - 1) * conv_ch * conv_bytes)
    return PerGPU(gpus=gpus, weight_bytes=weights, kv_bytes_per_token=kv, gdn_state_bytes_per_seq=state)


def table(c, gpus=(1, 2, 4, 8), *, tokens: int = 262144, seqs: int = 64, weight_bytes: float = 2,
          state_bytes: int = 2) -> str:
    """Markdown: per-GPU weights, K/V per token, GDN state per sequence, and the total for `tokens`
    cached tokens (summed over sequences) and `seqs` running sequences."""
    gib = 2**30
    out = ["| GPUs (TP, or TP+EP) | weights / GPU | K/V per token / GPU | GDN state per sequence / GPU | "
           f"total / GPU at {tokens:,} cached tokens + {seqs} sequences |", "|---:|---:|---:|---:|---:|"]
    for n in gpus:
        try:
            m = per_gpu(c, n, weight_bytes=weight_bytes, state_bytes=state_bytes)
        except ValueError as e:  # heads that do not split over n GPUs: vLLM refuses that size
            out.append(f"| {n} | {e} | | | |")
            continue
        out.append(f"| {n} | {m.weight_bytes / gib:.2f} GiB | {m.kv_bytes_per_token / 1024:.1f} KiB | "
                   f"{m.gdn_state_bytes_per_seq / 2**20:.1f} MiB | {m.total(tokens, seqs) / gib:.2f} GiB |")
    return "\n".join(out)


def report(c) -> str:
    """The tables of docs/scale-out.md for config `c` (`clover info MODEL --vllm-memory`): the parameter
    count vLLM loads, then per-GPU memory with a bf16 and with an fp32 GDN recurrent state."""
    return "\n".join([
        f"parameters (AR, as vLLM loads them): {parameters(c).total:,}",
        "", "bf16 weights, bf16 K/V, bf16 GDN state", "", table(c),
        "", "bf16 weights, bf16 K/V, fp32 GDN recurrent state (--mamba-ssm-cache-dtype float32)", "",
        table(c, state_bytes=4),
    ])
