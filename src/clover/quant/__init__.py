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

__getattr__, __all__ = lazy_exports(__name__, {
    "clover.quant.loader": ("load_quantized",),
    "clover.quant.writer": ("quantize_checkpoint",),
    "clover.quant.modules": ("Int8Linear", "Int4Linear", "QuantExperts", "QuantEmbedding"),
    "clover.quant.sizes": ("footprint", "footprint_table"),
})
