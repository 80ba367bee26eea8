"""Named models: a short name (`clover-smol`) that `clover.load`, `--model` and the server resolve
to a model directory in the user's cache, and `clover pull NAME`, which puts it there.

The models root is `$CLOVER_MODELS`, else `${XDG_CACHE_HOME:-~/.cache}/clover/models`.
"""

from __future__ import annotations

import os
from pathlib import Path

MODELS_ENV = "CLOVER_MODELS"


def models_root() -> Path:
    """Where named models live: `$CLOVER_MODELS`, else `${XDG_CACHE_HOME:-~/.cache}/clover/models`."""
    env = os.environ.get(MODELS_ENV)
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "clover" / "models"
