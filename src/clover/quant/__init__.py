"""Weight-only INT8 / INT4 quantization (`clover quantize`, docs/quantization.md).

- `quantize_checkpoint(src, dst, bits=8|4, group_size=..., skip=..., include_embeddings=...)` writes a
  quantized checkpoint (safetensors + `quantization_config` in config.json + the tokenizer);
- `load_quantized(directory, config, dtype=..., device=...)` is what `clover.load` calls for one;
- `Int8Linear`, `Int4Linear`, `QuantExperts`, `QuantEmbedding`: the runtime modules;
- `footprint(config, ...)` / `footprint_table()`: bytes on disk / in memory for any config (e.g. the
  full 35B-A3B).

The command is `clover quantize` (`clover.cli.quantize`); the fp32 / bf16 / int8 / int4 size, speed
and quality comparison is a benchmark, `clover bench quant` (`clover.bench.quant.compare`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "load_quantized": "clover.quant.loader",
    "quantize_checkpoint": "clover.quant.writer",
    "Int8Linear": "clover.quant.modules",
    "Int4Linear": "clover.quant.modules",
    "QuantExperts": "clover.quant.modules",
    "QuantEmbedding": "clover.quant.modules",
    "footprint": "clover.quant.sizes",
    "footprint_table": "clover.quant.sizes",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
