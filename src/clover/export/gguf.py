"""The GGUF export's former home: `clover.gguf.write` (kept for the imports that name it)."""

from ..gguf.names import GGUFExportError  # noqa: F401
from ..gguf.tokenizer import detect_pre_tokenizer  # noqa: F401
from ..gguf.write import (check_supported, export_drafter_gguf, export_gguf, mrope_sections,  # noqa: F401
                          sidecar_path)
