"""Decoding modes: one file each, registered in `modes` (the registry every front end reads).
Each import below registers one mode."""

from . import ar, diffusion, naive, speculative  # noqa: F401 - registration
from . import dflash  # noqa: F401 - registration (needs a drafter: `clover.load(..., drafter=)`)
from . import canvas  # noqa: F401 - registration (whole-sequence diffusion models: Dream, LLaDA)
from .modes import EngineSpec, Mode, default_mode, get_mode, mode_names, register

__all__ = ["EngineSpec", "Mode", "default_mode", "get_mode", "mode_names", "register"]
