"""clover: block-diffusion language models on the Qwen3.5/3.6-MoE hybrid backbone.

    import clover
    llm = clover.load()                      # the bundled model (or a directory)
    out = llm.generate("def fibonacci(n):", mode="diffusion", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_forward)

Names are imported lazily so `clover --help` does not pay for importing torch.
"""

from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __all__ = lazy_exports(__name__, {
    "clover.api": ("LLM", "Generation", "StreamEvent", "load"),
    "clover.config": ("CloverConfig", "ConfigError"),
    "clover.checkpoint": ("CheckpointError",),
    "clover.decoding.base": ("GenerationStats",),
    "clover.tiny": ("build_tiny_checkpoint",),
})
