"""clover: block-diffusion language models on the Qwen3.5/3.6-MoE hybrid backbone."""

from .api import LLM, Generation, StreamEvent, load
from .config import CloverConfig, ConfigError
from .checkpoint import CheckpointError
from .decoding.base import GenerationStats
from .tiny import build_tiny_checkpoint

__all__ = [
    "LLM",
    "Generation",
    "GenerationStats",
    "StreamEvent",
    "load",
    "CloverConfig",
    "ConfigError",
    "CheckpointError",
    "build_tiny_checkpoint",
]
__version__ = "0.1.0"
