"""`clover info`: what a model directory holds, from config.json, the file sizes, the first
safetensors header and tokenizer.json — no weights are loaded, and no file that is not a regular
one (a FIFO would block the read forever) is ever opened."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from .common import UsageError, add_model_arguments, given_model, human, model_dir


def configure(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, positional=True, weights=False)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--vllm-memory", action="store_true",
                   help="instead: the memory per GPU of a vLLM deployment on 1-8 GPUs (weights, K/V, GDN state), "
                        "from the config alone (docs/scale-out.md); MODEL may also be qwen3.6-35b-a3b")
    p.add_argument("--memory", action="store_true",
                   help="instead: the parameters and the memory of decoding (weights at bf16/int8/int4 + the K/V "
                        "cache at --context), from the config alone, the model built on the meta device; MODEL may "
                        "also be a full-size shape by name: " + ", ".join(_shape_names()))
    p.add_argument("--context", type=int, default=None,
                   help="--memory: cached tokens per row (default: the model's context length)")
    p.add_argument("--batch", type=int, default=1, help="--memory: rows decoded together (default 1)")


def _shape_names() -> list[str]:
    from ..models.shapes import SHAPES

    return list(SHAPES)


def _config(args: argparse.Namespace):
    """MODEL's config: a full-size shape by name (`clover.models.shapes`), else its config.json."""
    from ..models import read_config
    from ..models.shapes import shape_config

    return shape_config(given_model(args)) or read_config(model_dir(args))


def memory(args: argparse.Namespace) -> str:
    """`--memory`: `clover.quant.sizes.memory_plan` of MODEL's config at --context x --batch."""
    from ..quant.sizes import format_memory_plan, memory_plan

    c = _config(args)
    plan = memory_plan(c, context=c.max_position_embeddings if args.context is None else args.context, batch=args.batch)
    return json.dumps(plan) if args.json else format_memory_plan(plan, str(given_model(args)))


def _regular(path: Path) -> bool:
    from ..checkpoint import CheckpointError, require_regular_file

    try:
        require_regular_file(path)
    except CheckpointError:
        return False
    return True


def _disk_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8", "U8": "uint8",
                      "F8_E4M3": "float8_e4m3"}


def _stored_dtype(path: Path) -> str | None:
    """The dtype of the first tensor of the first safetensors file (reads only the header)."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        if not _regular(f):
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    dtype = st.get_slice(key).get_dtype()
                    return SAFETENSORS_DTYPES.get(dtype, dtype)
        except Exception:  # a corrupt header: info still shows the rest
            return None
    return None


def _token_string(path: Path, token_id: int | None) -> str | None:
    tok_file = path / "tokenizer.json"
    if token_id is None or not _regular(tok_file):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tok_file)).id_to_token(token_id)
    except Exception:  # not a tokenizer.json tokenizers can read
        return None


def _fields(c, has: bool, **names: str) -> dict | None:
    """{shown name: the config's field} for a capability the architecture has, else None (a Llama
    has no GDN heads and no experts: nothing to show, not zeros)."""
    return {k: getattr(c, field) for k, field in names.items()} if has else None


def model_info(path: Path) -> dict:
    """The facts `clover info` prints, from config.json and file sizes (no weights are loaded)."""
    from ..models import read_config
    from ..models import parameter_counts

    if not path.exists():
        raise UsageError(f"{path}: no such model directory")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory; pass the folder holding config.json and the safetensors")
    c = read_config(path)
    counts = parameter_counts(c)
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    n_gdn = sum(t == "linear_attention" for t in c.layer_types)
    return {
        "path": str(path),
        "model_type": c.model_type,
        "layers": c.num_hidden_layers,
        "layer_pattern": "".join("A" if t == "full_attention" else "L" for t in c.layer_types),
        "attention_layers": n_attn,
        "gdn_layers": n_gdn,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "attention": {"q_heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                      "rotary_dim": c.rotary_dim, "rope_theta": c.rope_theta, "output_gate": c.has_gated_attention},
        "gdn": _fields(c, c.has_linear_attention, key_heads="linear_num_key_heads", value_heads="linear_num_value_heads",
                       key_dim="linear_key_head_dim", value_dim="linear_value_head_dim", conv_kernel="linear_conv_kernel_dim"),
        "experts": _fields(c, c.has_experts, num="num_experts", top_k="num_experts_per_tok", intermediate="moe_intermediate_size",
                           shared_intermediate="shared_expert_intermediate_size", expert_budget="expert_budget"),
        "mlp_intermediate": None if c.has_experts else c.intermediate_size,  # the dense MLP's
        "parameters": {"total": counts["total"], "active": counts["active"]},
        "dtype": c.torch_dtype or _stored_dtype(path),
        "disk_bytes": _disk_size(path),
        "context_length": c.max_position_embeddings,
        "diffusion": c.mask_token_id is not None,
        "block_size": c.block_size if c.mask_token_id is not None else None,
        "threshold": c.threshold if c.mask_token_id is not None else None,
        "sub_block": c.sub_block if c.mask_token_id is not None else None,
        "semantics": dataclasses.asdict(c.semantics) if c.mask_token_id is not None else None,
        "mask_token_id": c.mask_token_id,
        "mask_token": _token_string(path, c.mask_token_id),
        "eos_token_ids": c.eos_token_ids,
        "quantization": c.quantization_config,
    }


def format_info(info: dict) -> str:
    a, g, e, p = info["attention"], info["gdn"], info["experts"], info["parameters"]
    pattern = info["layer_pattern"]
    if len(pattern) > 48:
        pattern = pattern[:45] + "…"
    rows = [
        ("model", f"{info['path']} ({info['model_type']})"),
        ("layers", f"{info['layers']}: " + (f"{info['gdn_layers']} GDN (linear attention) + " if g else "")
         + f"{info['attention_layers']} full attention  [{pattern}]"),
        ("hidden / vocab", f"{info['hidden_size']} / {info['vocab_size']}"),
        ("attention", f"{a['q_heads']} q heads, {a['kv_heads']} kv heads, head dim {a['head_dim']}, rotary dims {a['rotary_dim']}"
         + (", output gate" if a["output_gate"] else "")),
    ]
    if g:
        rows.append(("GDN", f"{g['key_heads']} key heads × {g['key_dim']}, {g['value_heads']} value heads × {g['value_dim']}, "
                            f"conv kernel {g['conv_kernel']}"))
    if e:
        rows.append(("experts", f"{e['num']} routed, top-{e['top_k']}, intermediate {e['intermediate']}"
                     + (f", shared expert {e['shared_intermediate']}" if e["shared_intermediate"] else "")
                     + (f", block budget {e['expert_budget']}" if e["expert_budget"] else "")))
    else:
        rows.append(("MLP", f"dense, intermediate {info['mlp_intermediate']}"))
    rows += [
        ("parameters", f"{human(p['total'])} total, {human(p['active'])} active per token ({p['total']:,} / {p['active']:,})"),
        ("dtype", info["dtype"] or "unknown"),
        ("size on disk", human(info["disk_bytes"], "B")),
        ("context length", f"{info['context_length']:,}"),
    ]
    if info["diffusion"]:
        mask = f"{info['mask_token_id']}" + (f" {info['mask_token']}" if info["mask_token"] else "")
        rows.append(("block size", str(info["block_size"])))
        if info["sub_block"]:  # denoised in sub-blocks of this size, left to right (Fast-dLLM v2)
            rows.append(("sub-block", str(info["sub_block"])))
        rows += [("threshold", str(info["threshold"])), ("mask token", mask)]
        from ..config import BlockSemantics

        other = {k: v for k, v in info["semantics"].items() if v != getattr(BlockSemantics, k)}
        if other:  # a released family's decoding (docs/architecture.md, "Block semantics")
            rows.append(("block semantics", ", ".join(f"{k}={v}" for k, v in other.items())))
    else:
        rows.append(("diffusion", "no mask token: autoregressive only"))
    q = info["quantization"]
    if isinstance(q, dict):
        shown = {k: (f"{len(v)} modules" if isinstance(v, list) and k == "modules" else v) for k, v in q.items()}
        rows.append(("quantization", ", ".join(f"{k}={v}" for k, v in shown.items())))
    else:
        rows.append(("quantization", "none"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def vllm_memory(args: argparse.Namespace) -> str:
    """`--vllm-memory`: the per-GPU tables for MODEL's config.json (or the 35B-A3B shapes by name)."""
    from ..integrations.vllm.memory import report

    c = _config(args)
    if not hasattr(c, "linear_num_key_heads"):  # the plugin's tables are Qwen3.5's (GDN + attention)
        raise UsageError(f"--vllm-memory: the vLLM plugin serves Qwen3.5-based checkpoints, not {c.model_type}; "
                         "use --memory")
    return report(c)


def run(args: argparse.Namespace) -> int:
    if args.memory:
        try:
            print(memory(args))
        except ValueError as e:
            raise UsageError(str(e)) from None
        return 0
    if args.vllm_memory:
        if args.json:
            raise UsageError("--vllm-memory prints tables; leave out --json")
        print(vllm_memory(args))
        return 0
    info = model_info(model_dir(args))
    print(json.dumps(info) if args.json else format_info(info))
    return 0
