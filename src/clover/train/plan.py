"""`clover train plan RECIPE --gpus N --gpu-mem 80`: what a run costs before it starts.

Per-rank memory (params, grads, optimizer, the FSDP working set, activations), tokens/s from an
assumed MFU, and the days to a token budget -- all from the recipe (stage, seq_len, micro-batch,
run.parallel, fsdp_mixed_precision, activation_checkpointing) and the model config (`[model]`,
`init`'s config.json, or `--model`). Estimates on paper, not measurements; the formulas:

Memory (P parameters, N ranks, fp32 master weights and AdamW, as the trainer keeps them):
- ddp:  params 4P, grads 4P, AdamW 8P per rank (every rank a full replica);
- fsdp: the same divided by N, plus the working set of unsharded weights: the root (embeddings,
  LM head, final norm; gathered for the whole step) and two decoder layers (the running one and
  the prefetched one), each with its unsharded gradient and, under bf16 mixed precision, the fp32
  copy reduce-scattered.
- activations (per micro-batch of b rows x S tokens, stage 2 runs (1 + k) S positions: the clean
  stream and k noisy copies): per layer and position, in the compute dtype, the tensors autograd
  keeps -- the two norms' inputs and outputs (4h), the mixer's projections (attention: q, k, v and
  the attention output, plus the gate and the gated o_proj input where the attention has an output
  gate, `has_gated_attention`; GDN: the qkv projection and its
  convolution, z, the core output and the gated norm output) plus GDN's fp32 chunk states (one
  hv x dk x dv state per 64 positions), and the MoE's (router input and fp32 logits, per routed slot
  the gathered input, the gate/up output and the activation, the shared expert likewise). With
  activation checkpointing only each layer's input is kept, plus one layer's full set during its
  recompute. The loss: bf16 logits and their fp32 softmax at every position a loss reads (S clean +
  S masked for stage 2; S for AR).

Speed: FLOPs per training token = 6 x (active non-embedding parameters x positions per token +
attention scores) + 6 x h x V x logit positions per token; tokens/s = N x peak x MFU / that. MFU counts
model FLOPs only, so activation recomputation shows up as a lower MFU, not as more FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
CHUNK = 64  # GDN chunk length of the chunked delta rule: one fp32 state per chunk is kept for backward


@dataclass
class Plan:
    params: int
    active: int
    gpus: int
    micro_batch: int
    seq_len: int
    positions: int  # per micro-batch forward: rows x positions per row
    memory_gb: dict[str, float]
    tokens_per_s: float
    flops_per_token: float
    days: float
    tokens: float
    fits: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _model_config(recipe, model: str | None):
    from ..models import config_from_dict, read_config
    from ..models.shapes import shape_config

    if model:
        return shape_config(model) or read_config(model)
    if recipe.model:
        return config_from_dict({**recipe.model, "model_type": recipe.model.get("model_type", "clover")},
                                      source="recipe [model]")
    if recipe.init and (Path(recipe.init) / "config.json").is_file():
        return read_config(recipe.init)
    raise ValueError(f"no model config: the recipe's init {recipe.init!r} has no config.json here; pass --model")


def _layer_sizes(cfg) -> tuple[int, int, int]:
    """(root parameters, largest decoder layer's parameters, non-embedding parameters), off meta."""
    from ..models import build_model

    m = build_model(cfg, device="meta")
    layers = [sum(p.numel() for p in layer.parameters()) for layer in m.model.layers]
    total = sum(p.numel() for p in m.parameters())
    root = total - sum(layers)
    return root, max(layers), total - m.model.embed_tokens.weight.numel()


def activation_bytes_per_position(cfg, layer_type: str, elem: int) -> float:
    """Bytes autograd keeps per position for one decoder layer (see the module docstring)."""
    h = cfg.hidden_size
    n = 4 * h  # input_layernorm and post_attention_layernorm: inputs and outputs
    extra = 0.0
    if layer_type == "full_attention":
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        n += 2 * q + 2 * kv  # q, k, v, attention output (a plain attention's o_proj input)
        if cfg.has_gated_attention:
            n += 2 * q  # the output gate and the gated o_proj input
    else:
        vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        n += 2 * cfg.linear_conv_dim + 3 * vd  # qkv projection and its convolution; z, core output, gated norm output
        hv = cfg.linear_num_value_heads
        extra += 4 * hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim / CHUNK  # fp32 chunk states
    if cfg.has_experts:
        k, inter, shared = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        n += h + k * (h + 3 * inter) + (h + 3 * shared if shared else 0)
        extra += 4 * cfg.num_experts  # fp32 router logits (kept for the aux loss)
    else:
        n += h + 3 * cfg.intermediate_size
    return n * elem + extra


def plan(recipe, *, gpus: int, gpu_mem_gb: float = 80.0, mfu: float = 0.25, peak_tflops: float = 989.0,
         tokens: float = 1e9, model: str | None = None, micro_batch: int | None = None) -> Plan:
    from ..models import parameter_counts

    cfg = _model_config(recipe, model)
    run, stage = recipe.run, recipe.stage
    counts = parameter_counts(cfg)
    P, A = counts["total"], counts["active"]
    root, layer, non_embed = _layer_sizes(cfg)
    fsdp = run.parallel == "fsdp"
    n = gpus if fsdp else 1
    autocast = run.autocast in ("bf16", "auto")  # plans are for GPUs, where "auto" means bf16
    bf16 = autocast or (fsdp and run.fsdp_mixed_precision == "bf16")
    elem = 2 if bf16 else 4
    mem = {"params": 4 * P / n, "grads": 4 * P / n, "optimizer": 8 * P / n}
    if fsdp:  # unsharded weights + their grads (+ the fp32 reduce copy under bf16)
        per = elem + elem + (4 if elem == 2 else 0)
        mem["fsdp_working_set"] = per * (root + 2 * layer)
    elif autocast:
        mem["autocast_weight_copies"] = 2 * P  # bf16 casts of the weights, cached for the step
    mb = micro_batch or recipe.data.batch_size // max(1, gpus * recipe.optim.grad_accum)
    if mb < 1:
        raise ValueError(f"data.batch_size {recipe.data.batch_size} gives no rows per rank on {gpus} GPUs "
                         f"(grad_accum {recipe.optim.grad_accum}); pass --micro-batch")
    S = recipe.data.seq_len
    copies = (2 if recipe.diffusion.complementary else 1) if stage == "diffusion" else 0
    pos = mb * S * (1 + copies)
    per_layer = [activation_bytes_per_position(cfg, t, elem) for t in cfg.layer_types]
    if run.activation_checkpointing:
        act = pos * (cfg.num_hidden_layers * cfg.hidden_size * elem + max(per_layer))
    else:
        act = pos * sum(per_layer)
    logit_pos = mb * S * (2 if stage == "diffusion" else 1)
    mem["activations"] = act
    mem["logits"] = logit_pos * cfg.vocab_size * (elem + 4)
    total = sum(mem.values())
    mem_gb = {k: v / GB for k, v in mem.items()}
    mem_gb["total"] = total / GB
    # speed
    attn_layers = sum(t == "full_attention" for t in cfg.layer_types)
    q = cfg.num_attention_heads * cfg.head_dim
    ctx = S * (1 + copies)  # a noisy block reads the clean prefix and itself; the clean stream is causal
    attn = attn_layers * 2 * q * ctx / 2 * 2  # QK^T and AV over half the context on average, 2 FLOPs a MAC
    active_body = A - (P - non_embed) - cfg.vocab_size * cfg.hidden_size  # minus the embeddings and the LM head
    per_pos = 2 * active_body + attn
    flops_tok = 3 * (per_pos * (1 + copies) + 2 * cfg.hidden_size * cfg.vocab_size * (logit_pos / (mb * S)))
    tps = gpus * peak_tflops * 1e12 * mfu / flops_tok
    return Plan(params=P, active=A, gpus=gpus, micro_batch=mb, seq_len=S, positions=pos, memory_gb=mem_gb,
                tokens_per_s=tps, flops_per_token=flops_tok, days=tokens / tps / 86400, tokens=tokens,
                fits=total / GB <= gpu_mem_gb)


def format_plan(p: Plan, recipe, gpu_mem_gb: float, mfu: float, peak_tflops: float) -> str:
    r = recipe.run
    lines = [
        f"recipe {recipe.name}  stage {recipe.stage}  parallel {r.parallel}"
        + (f" ({r.fsdp_mixed_precision} mixed precision)" if r.parallel == "fsdp" else "")
        + f"  activation checkpointing {'on' if r.activation_checkpointing else 'off'}",
        f"model {p.params / 1e9:.2f}B parameters ({p.active / 1e9:.2f}B active)  {p.gpus} GPUs x {gpu_mem_gb:g} GB",
        f"micro-batch {p.micro_batch} x {p.seq_len} tokens per rank ({p.positions} positions per forward)",
        "per-rank memory (GB):",
    ]
    for k, v in p.memory_gb.items():
        if k != "total":
            lines.append(f"  {k:24s} {v:9.2f}")
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"  {'total':24s} {p.memory_gb['total']:9.2f}   {verdict} in {gpu_mem_gb:g} GB")
    lines.append(f"speed: {p.flops_per_token / 1e9:.1f} GFLOP per training token; at MFU {mfu:g} of {peak_tflops:g} "
                 f"TFLOPS per GPU: {p.tokens_per_s:,.0f} tokens/s")
    lines.append(f"{p.tokens:.3g} tokens: {p.days:.2f} days")
    return "\n".join(lines)
