"""Weight-only INT8 / INT4 quantization (`clover quantize`, docs/quantization.md).

- `quantize_checkpoint(src, dst, bits=8|4, group_size=..., skip=..., include_embeddings=...)` writes a
  quantized checkpoint (safetensors + `quantization_config` in config.json + the tokenizer);
- `load_quantized(directory, config, dtype=..., device=...)` is what `clover.load` calls for one;
- `Int8Linear`, `Int4Linear`, `QuantExperts`, `QuantEmbedding`: the runtime modules;
- `compare(model_dir, ...)`: the fp32 / bf16 / int8 / int4 size-speed-quality table;
- `footprint(config, ...)`: bytes on disk / in memory for any config (e.g. the full 35B-A3B);
- `configure(parser)` / `run(args)`: the `clover quantize` sub-command.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_quantized": "clover.quant.loader",
    "quantize_checkpoint": "clover.quant.writer",
    "Int8Linear": "clover.quant.modules",
    "Int4Linear": "clover.quant.modules",
    "QuantExperts": "clover.quant.modules",
    "QuantEmbedding": "clover.quant.modules",
    "compare": "clover.quant.compare",
    "format_table": "clover.quant.compare",
    "footprint": "clover.quant.compare",
    "footprint_table": "clover.quant.compare",
    "configure": "clover.quant.cli",
    "run": "clover.quant.cli",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'clover.quant' has no attribute {name!r}")
