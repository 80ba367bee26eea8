"""Checkpoints by Hugging Face repo id: `clover.load("JetLM/SDAR-1.7B-Chat")`, `--model ORG/NAME` and
`clover pull ORG/NAME`, through `huggingface_hub` — its cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`),
its progress bars, its offline mode (`HF_HUB_OFFLINE=1`: the local cache only) and its token
(`HF_TOKEN`, or `hf auth login`'s).

Only the files a model needs are fetched (`FILES`: config.json, the safetensors shards and their
index, the tokenizer files, generation_config.json, the chat template; never a pickle). Before any
weight is downloaded, `pull` reads the repo's file list and config.json and refuses in one line a
model_type clover has no family for, a repo without safetensors weights, and a model that does not
fit: its weights (the safetensors bytes) plus the K/V cache at the requested context against the
memory free now (RAM, or VRAM for a CUDA device).

A name that is a local path wins over a repo id of the same spelling (`clover.api.model_path`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
         "added_tokens.json", "chat_template.jinja", "chat_template.json")
DEFAULT_CONTEXT = 4096  # tokens the fit check reserves cache for when none is asked
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")
_TRUE = {"1", "on", "yes", "true"}


class HubError(ValueError):
    """A repo id clover cannot use (the message is one line and says what to do)."""


def is_repo_id(name: str) -> bool:
    """`ORG/NAME` as the hub spells repo ids (one slash, no `..`, not an absolute or home path)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith(".gguf")


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, read now (also when set after it was imported)."""
    from huggingface_hub import constants

    if "HF_HUB_OFFLINE" in os.environ:
        return os.environ["HF_HUB_OFFLINE"].strip().lower() in _TRUE
    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    """The hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else huggingface_hub's default."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def complete(snapshot: Path) -> bool:
    """A snapshot holding config.json and all its safetensors weights (every shard its index names)."""
    import json

    if not (snapshot / "config.json").is_file():
        return False
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return bool(shards) and all((snapshot / s).is_file() for s in shards)
    return any(snapshot.glob("*.safetensors"))


def cached(repo_id: str) -> Path | None:
    """The repo's snapshot in the hub cache when it holds the whole model, else None (no network)."""
    from huggingface_hub import snapshot_download

    try:
        snap = Path(snapshot_download(repo_id, cache_dir=cache_dir(), allow_patterns=list(FILES), local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, a broken ref: not cached
        return None
    return snap if complete(snap) else None


def resolve(repo_id: str, *, device: str | None = None, context: int | None = None) -> Path:
    """The model directory of a repo id: its cached snapshot, else (online) `pull`; offline and not
    cached: FileNotFoundError naming `clover pull REPO_ID`."""
    snap = cached(repo_id)
    if snap is not None:
        return snap
    if offline():
        raise FileNotFoundError(f"{repo_id} is not in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE is "
                                f"set: run `clover pull {repo_id}` while online, then use it offline")
    return pull(repo_id, device=device, context=context)


# --------------------------------------------------------------------------------- the fit check
@dataclass(frozen=True)
class Fit:
    weight_bytes: int
    cache_bytes: int  # K/V at `context` tokens
    context: int
    free_bytes: int  # 0: the system does not say
    where: str  # "RAM" or "VRAM"

    @property
    def need(self) -> int:
        return self.weight_bytes + self.cache_bytes

    @property
    def fits(self) -> bool:
        return not self.free_bytes or self.need <= self.free_bytes

    def line(self, repo_id: str) -> str:
        gib = 1 << 30
        return (f"{repo_id} needs about {self.need / gib:.1f} GiB (weights {self.weight_bytes / gib:.1f} GiB + K/V "
                f"cache {self.cache_bytes / gib:.1f} GiB at {self.context} tokens) and {self.free_bytes / gib:.1f} GiB "
                f"of {self.where} is free")


def free_memory(device: str | None = None) -> tuple[int, str]:
    """(bytes free now, "RAM" or "VRAM"): a CUDA device's free memory, else the system's available RAM."""
    if device and str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(torch.device(device))[0]), "VRAM"
    from .kernels.packed import available_memory

    return available_memory(), "RAM"


def family_config(raw: dict, source: str):
    """config.json's contents as the config of a family clover runs; HubError in one line otherwise."""
    from .config import ConfigError
    from .models import SUPPORTED_MODEL_TYPES, config_from_dict

    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HubError(f"{source}: model_type {model_type!r} is not a family clover runs; families: "
                       f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        return config_from_dict(raw, source=source)
    except ConfigError as e:
        raise HubError(str(e)) from None


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "int8": 1}


def estimate(config, *, weight_bytes: int | None = None, context: int | None = None, device: str | None = None,
             free: int | None = None) -> Fit:
    """Weights (`weight_bytes`: the safetensors total when known, else parameters x the stored dtype)
    plus the K/V cache of every full-attention layer at `context` tokens, against free memory."""
    elem = _DTYPE_BYTES.get(str(config.torch_dtype or "bfloat16").removeprefix("torch."), 2)
    if weight_bytes is None:
        from .models import parameter_counts

        weight_bytes = parameter_counts(config)["total"] * elem
    context = context or min(DEFAULT_CONTEXT, getattr(config, "max_position_embeddings", None) or DEFAULT_CONTEXT)
    from .cache import kv_bytes

    cache = kv_bytes(config, context, elem=elem)
    where = "RAM"
    if free is None:
        free, where = free_memory(device)
    return Fit(int(weight_bytes), int(cache), int(context), int(free), where)


# ------------------------------------------------------------------------------------- the pull
def _hub_call(repo_id: str, fn):
    """Run one huggingface_hub call, its errors as one line."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        return fn()
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN (or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id}: no such model on the Hugging Face hub (nor a local directory); a private repo "
                       "needs HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id}: no such revision on the hub") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{repo_id}: the hub cannot be reached and the model is not in the cache ({cache_dir()}); "
                       "check the network and retry") from None
    except HfHubHTTPError as e:
        raise HubError(f"{repo_id}: the hub answered {str(e).splitlines()[0][:160]}") from None
    except Exception as e:  # the HTTP client's connection errors (no network, DNS, a timeout)
        if not type(e).__module__.startswith(("httpx", "httpcore", "requests", "urllib3", "ssl", "socket")) \
                and not isinstance(e, (OSError, TimeoutError)):
            raise
        raise HubError(f"{repo_id}: cannot reach the Hugging Face hub ({type(e).__name__}: {str(e)[:120]}) and the model "
                       f"is not in the cache ({cache_dir()}); check the network, or set HF_ENDPOINT for a mirror") from None


def pull(repo_id: str, *, device: str | None = None, context: int | None = None, force: bool = False,
         free: int | None = None) -> Path:
    """A repo's model files into the hub cache (huggingface_hub's progress bars); returns the snapshot.
    Before any weight is downloaded: the repo must hold safetensors weights, its model_type must be a
    family clover runs, and weights + K/V cache at `context` must fit the free memory (HubError, one line)."""
    import json

    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    if not force and (snap := cached(repo_id)) is not None:
        return snap
    if offline():
        raise HubError(f"{repo_id}: HF_HUB_OFFLINE is set and the model is not in the cache ({cache_dir()}); "
                       "unset it to download")
    info = _hub_call(repo_id, lambda: HfApi().model_info(repo_id, files_metadata=True))
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    weights = {f: n for f, n in sizes.items() if f.endswith(".safetensors") and "/" not in f}
    if "config.json" not in sizes:
        raise HubError(f"{repo_id}: no config.json at the repo's top level; not a transformers model repo")
    if not weights:
        raise HubError(f"{repo_id}: no safetensors weights (clover never loads .bin / .pth pickles)")
    config_file = _hub_call(repo_id, lambda: hf_hub_download(repo_id, "config.json", cache_dir=cache_dir()))
    config = family_config(json.loads(Path(config_file).read_text()), f"{repo_id}/config.json")
    fit = estimate(config, weight_bytes=sum(weights.values()) or None, context=context, device=device, free=free)
    if not fit.fits:
        raise HubError(f"{fit.line(repo_id)}: it does not fit; nothing downloaded (a smaller model, or a shorter "
                       f"--context)")
    snap = _hub_call(repo_id, lambda: snapshot_download(repo_id, cache_dir=cache_dir(), allow_patterns=list(FILES),
                                                        force_download=force))
    return Path(snap)
