"""Where clover keeps what it downloads, measures and trains: one rule for the user's cache."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(*parts: str, env: str | None = None) -> Path:
    """`$env` when that variable is set, else `${XDG_CACHE_HOME:-~/.cache}/clover/<parts...>`."""
    if env and os.environ.get(env):
        return Path(os.environ[env]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser().joinpath("clover", *parts)
