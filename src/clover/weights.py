"""Safetensors weight files of a model directory (never pickle): finding the shards, reading them,
checking them, writing them. What a model directory means (config + weights -> a model, plain or
quantized) is `clover.checkpoint`, one level up.

A directory holds either `model.safetensors` or shards listed by `model.safetensors.index.json`.
Keys are mapped to parameter names by the architecture's key layout (`clover.models`), e.g. the
multimodal `model.language_model.*` prefix, skipped `model.visual.*` / `mtp.*`, experts stored one by
one stacked into the fused layout. Weights are read shard by shard from memory-mapped files.

Reading refuses what would hang or silently corrupt a generation: a weight file that is not a
regular file (a FIFO or device would block on open), a shard path in the index that leaves the
model directory, a weight stored in a non-float dtype, and weights holding NaN or Inf (a chunked
scan per tensor, after the conversion to the load dtype; opt out with `check_finite=False`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import stat
from collections import defaultdict
from pathlib import Path, PurePosixPath
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """safetensors' `save_file`, the file then given the mode any new file gets (0644 under the usual
    umask): safetensors itself writes 0600, which hides a model directory from other users."""
    save_file(tensors, str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
    return Path(path)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class CheckpointError(ValueError):
    """A model directory whose files do not form a loadable checkpoint."""


# The default of `check_finite` for loads that do not pass it (clover.load, the quantized loader).
_CHECK_FINITE: contextvars.ContextVar[bool] = contextvars.ContextVar("clover_check_finite", default=True)
FINITE_SCAN_CHUNK = 1 << 24  # elements per isfinite() call: bounds the temporary bool mask at 16 MiB
NO_CHECK_HINT = "to load it anyway, pass check_finite=False (CLI: --no-check-finite)"


@contextlib.contextmanager
def finite_check(enabled: bool) -> Iterator[None]:
    """Within the block, loads that do not pass `check_finite` scan (True) or skip the scan (False)
    for non-finite weights: `with finite_check(False): clover.load(path)`."""
    token = _CHECK_FINITE.set(bool(enabled))
    try:
        yield
    finally:
        _CHECK_FINITE.reset(token)


def require_regular_file(path: Path, what: str = "weight file") -> None:
    """Raise CheckpointError unless `path` is a regular file (symlinks to one are fine). Opening a
    FIFO blocks until a writer comes, and a device never ends, so neither is ever opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or special file"
        raise CheckpointError(f"{path}: not a regular file ({kind}); a {what} must be a plain file")


def first_non_finite(t: torch.Tensor, *, chunk: int = FINITE_SCAN_CHUNK) -> tuple[int, ...] | None:
    """The index of the first NaN/Inf in `t`, or None (always None for non-float tensors).

    One aminmax reduction per chunk of the flattened tensor: NaN propagates to both ends and an
    Inf is one of them, so a clean chunk costs one read and no temporary (isfinite().all() is
    ~20x slower on CPU: it writes a bool mask). Only a dirty chunk is searched element-wise."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        try:
            lo, hi = torch.aminmax(part)
            clean = bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
        except RuntimeError:  # dtypes without aminmax (float8)
            part = part.float()
            clean = bool(torch.isfinite(part).all())
        if not clean:
            offset = start + int((~torch.isfinite(part)).nonzero()[0, 0])
            return tuple(int(i) for i in torch.unravel_index(torch.tensor(offset), t.shape))
    return None


def _non_finite_error(path: Path, key: str, t: torch.Tensor, where: tuple[int, ...], stored: torch.Tensor | None) -> CheckpointError:
    bad = ~torch.isfinite(t)
    n_nan = int(torch.isnan(t).sum())
    n_inf = int(bad.sum()) - n_nan
    counts = ", ".join(f"{n} {name}" for n, name in ((n_nan, "NaN"), (n_inf, "Inf")) if n)
    converted = ""
    if stored is not None and first_non_finite(stored) is None:
        converted = (f" after conversion from {str(stored.dtype).replace('torch.', '')} to {str(t.dtype).replace('torch.', '')}"
                     " (values too large for that dtype; load in float32 or bfloat16)")
    return CheckpointError(
        f"{path}: tensor {key!r} holds non-finite values{converted} ({counts} of {t.numel()}, first at index {list(where)}); "
        f"the checkpoint is corrupt; {NO_CHECK_HINT}"
    )


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16") from None


def read_index(directory: Path) -> dict[str, str] | None:
    """The index's weight_map (key -> shard path relative to `directory`), or None without an index.
    Every shard path must name a file inside the directory: no absolute paths, no '..' that leaves it."""
    index = directory / INDEX_FILE
    if not os.path.lexists(index):
        return None
    require_regular_file(index, "safetensors index")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is {type(weight_map).__name__}, not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: weight_map[{key!r}] is {shard!r}, not a file name")
        parts = PurePosixPath(shard.replace("\\", "/")).parts
        depth = 0
        for part in parts:
            depth += -1 if part == ".." else 0 if part == "." else 1
            if depth < 0:
                break
        if PurePosixPath(shard).is_absolute() or os.path.isabs(shard) or depth < 0 or not parts:
            raise CheckpointError(
                f"{index}: weight_map[{key!r}] points outside the model directory ({shard!r}); "
                "shard paths must be relative to the directory holding the index"
            )
    return weight_map


def shard_files(directory: Path) -> list[Path]:
    weight_map = read_index(directory)
    if weight_map is not None:
        index = directory / INDEX_FILE
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.lexists(directory / f)]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
        for f in files:
            require_regular_file(directory / f)
        return [directory / f for f in files]
    single = directory / SINGLE_FILE
    if os.path.lexists(single):
        require_regular_file(single)
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        for f in found:
            require_regular_file(f)
        return found
    if list(directory.glob("*.bin")) or list(directory.glob("*.pt")):
        raise CheckpointError(f"{directory}: only pickle weights (*.bin/*.pt) found; convert them to safetensors first (pickle is never loaded)")
    raise CheckpointError(f"{directory}: no model.safetensors or {INDEX_FILE}; is this a model directory?")


def iter_tensors(
    path: Path, dtype: torch.dtype | None, *, check_finite: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every tensor of one safetensors file, floats converted to `dtype`.
    With `check_finite` (default: the `finite_check` setting, on) a float tensor holding NaN/Inf
    raises CheckpointError naming the file and key."""
    if check_finite is None:
        check_finite = _CHECK_FINITE.get()
    require_regular_file(path)
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
        keys = list(f.keys())
    except Exception as e:  # header unreadable: truncated or not safetensors
        raise CheckpointError(f"{path}: cannot read safetensors header ({e}); the file is truncated or corrupt") from None
    for key in keys:
        try:
            t = f.get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {key!r} ({e}); the file is truncated or corrupt") from None
        stored = t
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if check_finite:
            where = first_non_finite(t)
            if where is not None:
                raise _non_finite_error(path, key, t, where, stored if stored.dtype != t.dtype else None)
        yield key, t


def expected_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict(keep_vars=True).items()}


def read_state_dict(
    directory: str | Path,
    expected: dict[str, torch.Size],
    *,
    layout,
    dtype: torch.dtype | None = None,
    allow_missing: set[str] | frozenset = frozenset(),
    check_finite: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Read every shard, map names and stack per-expert weights with the architecture's key `layout`
    (`model.key_layout`), and check the result against `expected`.

    Raises CheckpointError naming the file and key for unexpected keys, shape mismatches, weights
    stored in a non-float dtype, non-finite weights (unless `check_finite` is False), missing keys
    and unreadable files."""
    directory = Path(directory)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))

    def place(name: str, t: torch.Tensor, path: Path, what: str, unexpected: str, shaped: str, hint: str) -> None:
        """Keep `t` as parameter `name`, or CheckpointError: not a parameter, or not its shape."""
        if name not in expected:
            raise CheckpointError(f"{path}: {unexpected}")
        if t.shape != expected[name]:
            raise CheckpointError(f"{path}: {what} {shaped} {tuple(t.shape)} but the config implies "
                                  f"{tuple(expected[name])}{hint}")
        state[name] = t
        origin[name] = path

    for path in shard_files(directory):
        for key, t in iter_tensors(path, dtype, check_finite=check_finite):
            name = layout.name(key)
            if name is None:
                continue
            if not t.is_floating_point():
                raise CheckpointError(
                    f"{path}: tensor {key!r} is stored as {str(t.dtype).replace('torch.', '')}, but model weights are floating "
                    "point (float32, bfloat16 or float16); the file is corrupt, or quantized without a quantization_config in config.json"
                )
            part = layout.expert_part(name)
            if part is not None:
                prefix, e, which = part
                per_expert[prefix][e][which] = t
                origin[prefix] = path
                continue
            place(name, t, path, f"key {key!r}", f"unexpected key {key!r} (no such parameter in this model); "
                  "is config.json the one these weights were saved with?", "has shape", "; the weights and config.json disagree")
    for prefix, experts in per_expert.items():
        path = origin[prefix]
        try:
            stacked = layout.stack_experts(prefix, experts)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        for name, t in stacked.items():
            place(name, t, path, f"per-expert weights under {prefix!r}",
                  f"unexpected per-expert weights under {prefix!r}", "stack to", "")
        per_expert[prefix].clear()
    missing = sorted(set(expected) - set(state) - set(allow_missing))
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        files = ", ".join(p.name for p in shard_files(directory))
        weight_map = read_index(directory) or {}
        listed = sorted({weight_map[k] for k in missing if k in weight_map})
        where = f"; {INDEX_FILE} puts them in {', '.join(listed)}" if listed else ""
        raise CheckpointError(f"{directory}: missing key(s) {shown} (searched {files}{where}); the checkpoint is incomplete or for another model")
    return state


def save_state_dict(
    state: dict[str, torch.Tensor],
    directory: str | Path,
    *,
    max_shard_bytes: int = 4 * 1024**3,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write `state` as model.safetensors, or as shards + index when larger than max_shard_bytes."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in list(directory.glob("model*.safetensors")) + [directory / INDEX_FILE]:
        if old.exists():
            old.unlink()
    meta = {"format": "pt", **(metadata or {})}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        write_safetensors(shards[0], directory / SINGLE_FILE, metadata=meta)
        return [directory / SINGLE_FILE]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(shard, directory / fname, metadata=meta)
        paths.append(directory / fname)
        weight_map.update({k: fname for k in shard})
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths
