"""Sharded data parallelism with PyTorch FSDP2 (`run.parallel = "fsdp"`).

`shard_model` applies `torch.distributed.fsdp.fully_shard` to every decoder layer and then to the
root (embeddings, final norm, LM head), the layout torchtitan uses: each rank holds 1/N of every
parameter (dim-0 shards, as DTensors), a layer's full weights exist only while that layer runs
(all-gathered before its forward and again before its backward), and gradients are reduce-scattered
back to shards. The optimizer is built on the sharded parameters, so its state is sharded too.

Options (recipe `[run]`):
- `fsdp_mixed_precision = "bf16"`: parameters all-gathered and computed in bf16, gradients reduced
  in fp32; the sharded master weights and the optimizer stay fp32.
- `fsdp_cpu_offload = true`: shards, gradients and optimizer state live in CPU memory (CUDA only;
  the optimizer step runs on the CPU).
- `activation_checkpointing = true`: each decoder layer's activations are recomputed in backward
  (`torch.distributed._composable.checkpoint`, which keeps parameter names unchanged). Works with
  either `parallel` mode.

Stage 2 calls `forward_block_diffusion`, not `forward`; it is registered as an FSDP forward method
so the root's parameters are gathered for it (the layers are called through their `forward`).

Starting from a checkpoint (`init`, a safetensors model directory) the model is built on the meta
device, sharded there, and each rank then allocates only its shards and reads them from the files
(`build_on_meta`, `load_shards`): no rank ever holds the whole model, so a 35B-A3B run can start
on ranks that hold 1/N of it. A run from scratch, from a DCP checkpoint, with a self-distillation
set or an adapter still builds the whole model first (`meta_start_reason` says which).

Gradient clipping on sharded gradients (`clip_grad_norm_`): the norm is the global one -- each rank
sums the squares of its local shards, one all-reduce adds them -- so a clip gives the same scale on
every rank as clipping the full gradients would.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a (possibly DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (names of parameters unchanged)."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)


def shard_model(
    model: nn.Module,
    *,
    device: torch.device,
    mixed_precision: str = "none",
    cpu_offload: bool = False,
) -> nn.Module:
    """fully_shard per decoder layer, then the root, over a 1-D mesh of all ranks (in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if not dist.is_initialized():
        raise RuntimeError("FSDP needs a process group (run under torchrun)")
    if cpu_offload and device.type != "cuda":
        raise ValueError("run.fsdp_cpu_offload moves GPU shards to CPU memory; this run is already on the CPU")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision == "none":
        mp = MixedPrecisionPolicy()
    else:
        raise ValueError(f"run.fsdp_mixed_precision must be 'none' or 'bf16', not {mixed_precision!r}")
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by backward: keep them gathered
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    if hasattr(model, "forward_block_diffusion"):
        register_fsdp_forward_method(model, "forward_block_diffusion")
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Under FSDP: whether this backward reduce-scatters (off for all but the last micro-batch)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)


@torch.no_grad()
def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of `params` (plain or sharded) to a global L2 norm `max_norm`; returns
    the norm before clipping (the same value on every rank)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    dev = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    if dist.is_initialized() and any(hasattr(p, "to_local") for p in params):
        dist.all_reduce(sq)
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


# ----------------------------------------------------------------------------- start on meta
def meta_start_reason(recipe) -> str | None:
    """Why this FSDP run cannot start on the meta device (None: it can). The meta start needs a
    safetensors model directory as `init` (the weights each rank reads its shards from)."""
    from ..models import read_config
    from . import checkpointing as ck

    if not recipe.init:
        return "no init (a model trained from scratch is initialised whole, then sharded)"
    if ck.checkpoint_format(recipe.init) != "safetensors":
        return "init is a DCP checkpoint (it is loaded through DCP)"
    if read_config(recipe.init).quantization_config:
        return "init is quantized"
    if recipe.data.distill_fraction:
        return "the self-distillation set needs the whole init model"
    if getattr(getattr(recipe, "adapter", None), "rank", 0):
        return "adapters are attached to the whole model"
    return None


def build_on_meta(recipe, mask_token_id: int | None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model of `recipe.init` on the meta device (a Clover model when stage "diffusion" starts
    from an AR one), and the tensors that are not in the files (the Clover parameters at their
    initial values, small). Nothing of the weights is read."""
    from ..models import build_model, read_config
    from ..models.clover import clover_config, clover_parameters

    config = read_config(recipe.init)
    extra: dict[str, torch.Tensor] = {}
    if recipe.stage == "diffusion" and not config.is_clover:
        if mask_token_id is None:
            raise ValueError("stage 'diffusion' from an AR model needs <|mask|> in the tokenizer: run "
                             "`clover convert AR_DIR CLOVER_DIR` first and set init = CLOVER_DIR")
        config = clover_config(config, mask_token_id)
        extra = clover_parameters(config)
    if config.tie_word_embeddings:
        raise ValueError("the FSDP meta start does not handle tied embeddings")
    model = build_model(config, device="meta")
    model.train()
    return model, extra


def _rows(p) -> tuple[int, int] | None:
    """The dim-0 rows [start, stop) of the full parameter that this rank's shard holds (FSDP2's
    Shard(0) over a 1-D mesh: chunks of ceil(n / world)); None for a parameter that is not sharded."""
    from torch.distributed.tensor import DTensor, Shard

    d = p.data
    if not isinstance(d, DTensor) or d.device_mesh.ndim != 1 or list(d.placements) != [Shard(0)]:
        return None
    n, world = d.shape[0], d.device_mesh.size()
    chunk = -(-n // world)
    start = min(d.device_mesh.get_local_rank() * chunk, n)
    return start, start + d.to_local().shape[0]


def load_shards(model: nn.Module, directory: str | Path, extra: dict[str, torch.Tensor] | None = None,
                device: torch.device | str = "cpu") -> int:
    """Materialise a model that `shard_model` sharded on the meta device: allocate each rank's shards
    on `device` (`to_empty`), then copy into each parameter the rows this rank owns, read from the
    safetensors files as slices (`safe_open(...).get_slice`): a rank reads its own rows only, never the
    whole model. Per-expert files (one tensor per expert) are stacked a layer at a time first. Checks
    names, shapes and finiteness as `clover.load` does; returns the number of parameters loaded."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ..weights import CheckpointError, first_non_finite, shard_files

    model.to_empty(device=device)
    params = dict(model.named_parameters())
    layout = model.key_layout
    done: set[str] = set()

    def check(name: str, shape, where) -> torch.nn.Parameter:
        p = params.get(name)
        if p is None:
            raise CheckpointError(f"{where}: unexpected key {name!r} (no such parameter in this model)")
        if tuple(shape) != tuple(p.shape):  # a DTensor's shape is the full one
            raise CheckpointError(f"{where}: {name!r} has shape {tuple(shape)} but the config implies {tuple(p.shape)}")
        return p

    def copy(p, local: torch.Tensor, name: str, where) -> None:
        if local.is_floating_point() and first_non_finite(local) is not None:
            raise CheckpointError(f"{where}: tensor {name!r} holds non-finite values; the checkpoint is corrupt")
        with torch.no_grad():
            (p.data.to_local() if isinstance(p.data, DTensor) else p.data).copy_(local.to(p.dtype))
        done.add(name)

    def put_full(name: str, full: torch.Tensor, where) -> None:
        p = check(name, full.shape, where)
        rows = _rows(p)
        if rows is not None:
            local = full[rows[0]:rows[1]]
        elif isinstance(p.data, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        else:
            local = full
        copy(p, local, name, where)

    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for path in shard_files(Path(directory)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = layout.name(key)
                if name is None:
                    continue
                part = layout.expert_part(name)
                if part is None:
                    sl = f.get_slice(key)
                    p = check(name, sl.get_shape(), path)
                    rows = _rows(p)
                    if rows is not None:
                        copy(p, sl[rows[0]:rows[1]], name, path)  # only this rank's rows are read
                    else:
                        put_full(name, f.get_tensor(key), path)
                    continue
                prefix, e, which = part
                layer = experts.setdefault(prefix, {})
                layer.setdefault(e, {})[which] = f.get_tensor(key)
                fused = params.get(prefix + ".gate_up_proj")
                if fused is not None and len(layer) == fused.shape[0] and all(len(v) == 3 for v in layer.values()):
                    for k, v in layout.stack_experts(prefix, layer).items():
                        put_full(k, v, path)
                    del experts[prefix]
    for name, t in (extra or {}).items():
        put_full(name, t, "the Clover parameters")
    missing = sorted(set(params) - done)
    if missing or experts:
        raise CheckpointError(f"{directory}: missing {', '.join((missing or list(experts))[:5])}")
    return len(done)
