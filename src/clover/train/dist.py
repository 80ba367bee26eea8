"""The training processes: this rank's device, and the few collectives the trainer needs (gradients
averaged for plain data parallelism, metrics averaged, rank 0's decisions broadcast). One process is
a world of one: every collective is then a no-op."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """`run.device` -> this rank's device: "auto" is CUDA when available, else the CPU."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec != "cuda":
        raise ValueError(f"run.device must be 'auto', 'cpu' or 'cuda', not {spec!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("run.device = 'cuda' but CUDA is not available here; use --device cpu (or auto)")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"rank with LOCAL_RANK={local_rank} has no GPU ({torch.cuda.device_count()} visible); "
            "start at most one process per GPU (torchrun --nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


class Dist:
    def __init__(self, device_spec: str = "cpu") -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = resolve_device(device_spec, int(os.environ.get("LOCAL_RANK", "0")))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.active = self.world > 1
        if self.active and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        if not self.active:
            return
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off : off + n].view_as(g))
            off += n

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        if not self.active:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        t /= self.world
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    def flag(self, value: bool) -> bool:
        """Rank 0's decision, broadcast (e.g. 'checkpoint now')."""
        if not self.active:
            return value
        t = torch.tensor([1 if value else 0], device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()
