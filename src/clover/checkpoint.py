"""Model directories in the Hugging Face layout: `config.json` + safetensors (+ tokenizer files).

`load_model` reads a directory into the model of its architecture (`clover.models`; a quantized
checkpoint through `clover.quant`), `save_model` writes one. The safetensors files themselves —
shards, index, dtype and finiteness checks — are `clover.weights`, whose names are re-exported here.
A model is built on `meta` and its weights are assigned from memory-mapped files shard by shard, so
a large model never exists twice in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import CloverConfig, ConfigError
from .models import build_model, read_config
from .weights import (  # noqa: F401  (re-exported: the names callers import from here)
    DTYPES,
    FINITE_SCAN_CHUNK,
    INDEX_FILE,
    NO_CHECK_HINT,
    SINGLE_FILE,
    CheckpointError,
    _CHECK_FINITE,
    expected_shapes,
    finite_check,
    first_non_finite,
    iter_tensors,
    parse_dtype,
    read_index,
    read_state_dict,
    require_regular_file,
    save_state_dict,
    shard_files,
)

OWN_DRAFTER = "dflash"  # a model directory's own DFlash drafter lives in this subdirectory (`clover pull` puts it there)

def load_model(
    directory: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    check_finite: bool | None = None,
    config: CloverConfig | None = None,
):
    """config.json + safetensors -> the model of its architecture, in eval mode (built on meta,
    weights assigned); a quantized checkpoint (`quantization_config`) goes to `clover.quant`.
    `config`: the directory's config.json when the caller has read it already.

    `check_finite` (default: on, or what an enclosing `finite_check(...)` says) scans every weight
    for NaN/Inf and raises CheckpointError naming the tensor and file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory; pass the folder holding config.json and the safetensors")
    if check_finite is None:
        check_finite = _CHECK_FINITE.get()
    if config is None:
        config = read_config(directory)
    dtype = parse_dtype(dtype)
    if dtype is None:
        try:
            dtype = parse_dtype(config.torch_dtype) or torch.float32
        except ValueError:
            raise ConfigError(
                f"{directory / 'config.json'}: 'torch_dtype' is {config.torch_dtype!r}; expected float32, bfloat16 or float16 "
                "(or choose the load dtype: dtype=..., CLI --dtype)"
            ) from None
    if config.quantization_config:
        from .quant.loader import load_quantized  # (imported only for a quantized checkpoint)

        with finite_check(check_finite):  # the quantized loader reads through iter_tensors
            return load_quantized(directory, config, dtype=dtype, device=device)
    model = build_model(config, device="meta")
    expected = expected_shapes(model)
    allow = {"lm_head.weight"} if config.tie_word_embeddings else set()
    state = read_state_dict(directory, expected, layout=model.key_layout, dtype=dtype, allow_missing=allow, check_finite=check_finite)
    if device is not None and str(device) != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    model.tie_head()
    model.eval()
    return model


def save_model(model, directory: str | Path, *, max_shard_bytes: int = 4 * 1024**3) -> None:
    """Write config.json + safetensors in the layout `load_model` reads."""
    directory = Path(directory)
    model.config.save(directory)
    state = {k: v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_state_dict(state, directory, max_shard_bytes=max_shard_bytes)


# --------------------------------------------------------------------------- DFlash drafters
def load_drafter(directory: str | Path, target=None, *, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | None = None):
    """A DFlash drafter directory (config.json + safetensors in the published layout,
    `clover.models.dflash`) -> the drafter, in eval mode. With `target` (the target model or its
    config) a drafter that does not fit it is refused with a one-line `DrafterMismatch`."""
    from .models.dflash import DFlashConfig, DFlashDrafter

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"drafter: {directory} is not a directory; pass the folder holding the drafter's "
                                "config.json and safetensors")
    config = DFlashConfig.from_file(directory)
    if target is not None:
        config.check_target(getattr(target, "config", target))
    dtype = parse_dtype(dtype) or getattr(target, "dtype", None) or torch.float32
    with torch.device("meta"):
        model = DFlashDrafter(config)
    shapes = expected_shapes(model)
    state = read_state_dict(directory, shapes, layout=model.key_layout, dtype=dtype, allow_missing={"d2t"})
    if "d2t" in shapes:  # the draft vocabulary: an integer buffer beside the weights
        state["d2t"] = _read_d2t(directory, shapes["d2t"])
    if device is None and hasattr(target, "device"):
        device = target.device
    if device is not None and str(device) != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    return model


def _read_d2t(directory: Path, shape: torch.Size) -> torch.Tensor:
    """A drafter's `d2t` (draft index -> target token offset, int64), checked against `shape`."""
    from safetensors import safe_open

    for path in shard_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if "d2t" in f.keys():
                t = f.get_tensor("d2t")
                if t.shape != shape or t.is_floating_point():
                    raise CheckpointError(f"{path}: d2t is {str(t.dtype).replace('torch.', '')} {tuple(t.shape)}, "
                                          f"but config.json's draft_vocab_size implies int64 {tuple(shape)}")
                return t.long()
    raise CheckpointError(f"{directory}: config.json sets draft_vocab_size but no safetensors file holds d2t "
                          "(the draft vocabulary); the drafter is incomplete")


def save_drafter(drafter, directory: str | Path, *, dtype: torch.dtype | str | None = None) -> Path:
    """Write a drafter as config.json + model.safetensors in the published layout."""
    directory = Path(directory)
    dtype = parse_dtype(dtype) or drafter.dtype
    drafter.config.torch_dtype = str(dtype).replace("torch.", "")
    drafter.config.save(directory)
    save_state_dict({drafter.key_layout.stored(k): v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous()
                     for k, v in drafter.state_dict().items()}, directory)
    return directory
