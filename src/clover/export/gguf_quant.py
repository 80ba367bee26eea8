"""The GGUF block types' former home: `clover.gguf.quant` (kept for the imports that name it)."""

from ..gguf.quant import planes_from_parts  # noqa: F401
