"""What every benchmark shares: robust summaries of timings, the machine description, memory
probes, and synchronisation-aware timing."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from typing import Callable, Sequence

import torch


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty sequence."""
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def spread(xs: Sequence[float]) -> dict:
    """median, quartiles (IQR) and min/max of a sample; all None for an empty one."""
    if not xs:
        return {"median": None, "q1": None, "q3": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(xs),
        "q1": quantile(xs, 0.25),
        "q3": quantile(xs, 0.75),
        "min": float(min(xs)),
        "max": float(max(xs)),
        "n": len(xs),
    }


def synchronize(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device=None) -> tuple[object, float]:
    """(result, seconds), waiting for queued GPU work on both ends."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
LINEAR_ATTENTION_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
ROUTING_FIELDS = ("num_experts", "num_experts_per_tok")  # how many experts, how many a token uses
EXPERT_FIELDS = (*ROUTING_FIELDS, "moe_intermediate_size", "shared_expert_intermediate_size")


def _fields(config, has: bool, names: Sequence[str]) -> dict:
    """The fields of a capability the architecture has (`has_experts`, ...), else every value 0."""
    return {k: getattr(config, k) if has else 0 for k in names}


def shape_summary(config) -> dict:
    """The config fields that set a forward's cost, for a benchmark's JSON."""
    return {**_fields(config, True, SHAPE_FIELDS), **_fields(config, config.has_linear_attention, LINEAR_ATTENTION_FIELDS),
            **_fields(config, config.has_experts, EXPERT_FIELDS), "layer_types": config.layer_types}


def config_summary(config, dtype: str) -> dict:
    """The model a benchmark ran: width, depth, experts, vocabulary, parameters, dtype."""
    from ..models import parameter_counts

    return {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            **_fields(config, config.has_experts, ROUTING_FIELDS), "vocab_size": config.vocab_size,
            "parameters": parameter_counts(config), "dtype": dtype}


def machine(device: torch.device | str | None = None) -> dict:
    """What the numbers were measured on. CPU numbers on a shared machine are noisy: say so."""
    dev = torch.device(device or "cpu")
    info = {
        "device": str(dev),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    return info


def set_threads(n: int | None) -> None:
    if n is not None:
        if n <= 0:
            raise ValueError(f"threads: must be a positive integer, got {n}")
        torch.set_num_threads(n)


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"
