"""`load_quantized`: a quantized model directory -> the model of its architecture with quantized modules.

The model is built on `meta`, the modules named by `quantization_config` are swapped for
Int8Linear / Int4Linear / QuantExperts / QuantEmbedding, and the safetensors are read shard by shard:
every key's dtype and shape is checked against what the config implies (a mismatch is a
CheckpointError naming the file and the key), and a module is packed for the device as soon as its
tensors are all read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import CloverConfig
from ..models import build_model
from ..weights import CheckpointError, expected_shapes, iter_tensors, shard_files
from .format import EMBEDDING, LM_HEAD, Target, parse_quantization_config, tensor_specs
from .modules import Int4Linear, Int8Linear, QuantEmbedding, QuantExperts


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def _make_module(target: Target, bits: int, group_size: int | None, dtype: torch.dtype) -> nn.Module:
    if target.kind == "experts":
        return QuantExperts(target.n, target.k, target.inter, bits=bits, group_size=group_size, dtype=dtype)
    if target.kind == "embedding":
        return QuantEmbedding(target.n, target.k, bits=bits, group_size=group_size, dtype=dtype)
    if bits == 8:
        return Int8Linear(target.k, target.n, bias=target.bias, dtype=dtype)
    return Int4Linear(target.k, target.n, group_size=group_size, bias=target.bias, dtype=dtype)


def _fill(module: nn.Module, target: Target, tensors: dict[str, torch.Tensor], bits: int, dtype: torch.dtype) -> None:
    """tensors: {on-disk key: tensor} of one module, on the target device."""
    name = target.name
    if target.kind == "experts":
        for part in ("gate_up_proj", "down_proj"):
            base = f"{name}.{part}."
            module.set_quantized(part, {k[len(base):]: v for k, v in tensors.items() if k.startswith(base)}, dtype=dtype)
        return
    q, s = tensors[f"{name}.qweight"], tensors[f"{name}.scales"]
    z = tensors.get(f"{name}.zeros")
    if target.kind == "embedding":
        module.set_quantized(q, s, z, dtype=dtype)
        return
    bias = tensors.get(f"{name}.bias")
    if bits == 8:
        module.set_quantized(q, s, bias, dtype=dtype)
    else:
        module.set_quantized(q, s, z, bias, dtype=dtype)


def _describe(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def load_quantized(
    directory: str | Path,
    config: CloverConfig,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
):
    """Build the quantized model for `config` from `directory`; `dtype` is the compute dtype of the
    activations and of every tensor kept in high precision. Returns the model in eval mode."""
    directory = Path(directory)
    dtype = dtype or torch.float32
    device = torch.device(device) if device is not None else torch.device("cpu")
    source = str(directory / "config.json")
    bits, group_size, targets = parse_quantization_config(config.quantization_config, config, source)
    tied = config.tie_word_embeddings

    model = build_model(config, device="meta")
    float_expected = expected_shapes(model)
    # what each quantized module contributes on disk, and which float keys it replaces
    specs: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = {}  # key -> (dtype, shape, module)
    owner: dict[str, str] = {}
    for name, t in targets.items():
        for key, (dt, shape) in tensor_specs(t, bits, group_size).items():
            specs[key] = (dt, shape, name)
        for wname in t.weight_shapes():
            float_expected.pop(wname, None)
        if t.bias:  # kept in high precision, read with its module (Qwen2's and Dream's q/k/v)
            owner[f"{name}.bias"] = name
            float_expected.pop(f"{name}.bias", None)
        _set_module(model, name, _make_module(t, bits, group_size, dtype))
    if tied:
        float_expected.pop("lm_head.weight", None)
    lm_head_from_embedding = tied and EMBEDDING in targets
    if lm_head_from_embedding:
        _set_module(model, LM_HEAD, _make_module(Target(LM_HEAD, "linear", config.vocab_size, config.hidden_size), bits, group_size, dtype))

    need: dict[str, set[str]] = {name: set() for name in targets}
    for key, (_, _, name) in specs.items():
        need[name].add(key)
    for key, name in owner.items():
        need[name].add(key)
    collected: dict[str, dict[str, torch.Tensor]] = {name: {} for name in targets}
    float_state: dict[str, torch.Tensor] = {}
    seen: set[str] = set()

    for path in shard_files(directory):
        for key, t in iter_tensors(path, None):
            if key in seen:
                raise CheckpointError(f"{path}: key {key!r} appears twice in the checkpoint")
            seen.add(key)
            if key in specs:
                want_dtype, want_shape, name = specs[key]
                kind = f"int{bits} {key.rsplit('.', 1)[1].rstrip('s') if not key.endswith('qweight') else 'weight'}"
                if t.dtype != want_dtype:
                    raise CheckpointError(
                        f"{path}: {kind} for {name} ({key!r}) is stored as {_describe(t.dtype)} but clover-weight-only "
                        f"int{bits} expects {_describe(want_dtype)}; the file is corrupt or from another tool"
                    )
                if tuple(t.shape) != want_shape:
                    raise CheckpointError(
                        f"{path}: {kind} for {name} ({key!r}) has shape {tuple(t.shape)} but config implies {want_shape}"
                        + (f" (int{bits}, group size {group_size})" if bits == 4 else " (int8 per channel)")
                        + "; the weights and config.json disagree"
                    )
                if key.endswith((".scales", ".zeros")) and not bool(torch.isfinite(t).all()):
                    raise CheckpointError(f"{path}: {key!r} holds non-finite values; the file is corrupt")
                collected[name][key] = t.to(device)
            elif key in owner:
                name = owner[key]
                want = (targets[name].n,)
                if tuple(t.shape) != want or not t.is_floating_point():
                    raise CheckpointError(f"{path}: bias {key!r} has shape {tuple(t.shape)} / {_describe(t.dtype)} but config implies a float {want}")
                collected[name][key] = t.to(device)
            elif key in float_expected:
                if not t.is_floating_point():
                    raise CheckpointError(f"{path}: key {key!r} is stored as {_describe(t.dtype)} but is kept in high precision (float) in this format")
                if t.shape != float_expected[key]:
                    raise CheckpointError(
                        f"{path}: key {key!r} has shape {tuple(t.shape)} but the config implies {tuple(float_expected[key])}; the weights and config.json disagree"
                    )
                float_state[key] = t.to(device=device, dtype=dtype)
            else:
                base = key.rsplit(".", 1)[0]
                hint = ""
                if key.endswith(".weight") and base in (set(targets) | {LM_HEAD}) or any(key.startswith(n + ".") for n in targets):
                    hint = " (that module is quantized in config.json; is this a float tensor in a quantized checkpoint?)"
                elif key.endswith((".qweight", ".scales", ".zeros")):
                    hint = " (a quantized tensor for a module config.json does not list as quantized)"
                raise CheckpointError(f"{path}: unexpected key {key!r}{hint}; is config.json the one these weights were saved with?")
            name = specs[key][2] if key in specs else owner.get(key)
            if name is not None and len(collected[name]) == len(need[name]):
                module = model.get_submodule(name)
                _fill(module, targets[name], collected[name], bits, dtype)
                if name == EMBEDDING and lm_head_from_embedding:
                    _fill(model.lm_head, Target(LM_HEAD, "linear", config.vocab_size, config.hidden_size),
                          {k.replace(EMBEDDING, LM_HEAD, 1): v for k, v in collected[name].items()}, bits, dtype)
                collected[name] = {}
                need[name] = set()  # done

    missing = sorted(set(float_expected) - set(float_state))
    missing += sorted(k for name, keys in need.items() for k in keys if k not in collected[name])
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        files = ", ".join(p.name for p in shard_files(directory))
        raise CheckpointError(f"{directory}: missing key(s) {shown} (searched {files}); the quantized checkpoint is incomplete")
    model.load_state_dict(float_state, strict=False, assign=True)
    if not lm_head_from_embedding:
        model.tie_head()
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise CheckpointError(f"{directory}: nothing loaded for {left[:5]}; the quantized checkpoint is incomplete")
    model.eval()
    return model
