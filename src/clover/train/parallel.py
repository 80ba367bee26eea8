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

Gradient clipping on sharded gradients (`clip_grad_norm_`): the norm is the global one -- each rank
sums the squares of its local shards, one all-reduce adds them -- so a clip gives the same scale on
every rank as clipping the full gradients would.
"""

from __future__ import annotations

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
