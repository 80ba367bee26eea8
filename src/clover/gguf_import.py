"""GGUF import's former home: `clover.gguf.read` (kept for the imports that name it)."""

from .gguf.names import GGUFImportError  # noqa: F401
from .gguf.read import import_gguf  # noqa: F401
