"""The engines `clover bench peers` knows, by name, and which of them this machine has."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from .base import GGUF_DTYPES, Engine, llama_cpp_dir
from .clover import CloverEngine
from .hf import TransformersEngine
from .hf_dflash import HFDFlashEngine
from .llama_cpp import LlamaCppEngine
from .llama_cpp_dflash import LlamaCppDFlashEngine
from .port import PortEngine
from .reference import REFERENCES
from .vllm_cpu import VLLMEngine
from .zlab_dflash import ZlabEngine

ENGINES: dict[str, type[Engine]] = {e.name: e for e in (CloverEngine, TransformersEngine, LlamaCppEngine, PortEngine,
                                                        VLLMEngine, LlamaCppDFlashEngine, ZlabEngine, HFDFlashEngine,
                                                        *REFERENCES)}


def check_engines(engines: Iterable[str] | None) -> list[str]:
    """The engine names asked for (None: all), or ValueError naming the known ones."""
    wanted = list(ENGINES if engines is None else engines)
    bad = [e for e in wanted if e not in ENGINES]
    if bad:
        raise ValueError(f"engines: unknown {bad[0]!r}; choose from {', '.join(ENGINES)}")
    return wanted


def discover(config, *, dtype: str = "float32", engines: Iterable[str] | None = None, llama_dir: str | Path | None = None,
             vllm_python: str | None = None, reference: str | Path | None = None,
             reference_python: str | None = None) -> dict[str, dict]:
    """{engine: {"available": bool, "note": why not / caveats, "version": ..., ...}} for every engine;
    the ones not in `engines` are marked as not asked for."""
    wanted = check_engines(engines)
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(GGUF_DTYPES)}, got {dtype!r}")
    where = dict(dtype=dtype, llama_dir=Path(llama_dir) if llama_dir else llama_cpp_dir(), vllm_python=vllm_python,
                 reference=Path(reference) if reference else None, reference_python=reference_python)
    from ...decoding import get_mode

    why = get_mode("ar").refusal(config)  # an autoregressive peer decodes what clover's ar mode decodes

    def find(cls: type[Engine]) -> dict:
        if cls.causal and why:
            return {"available": False, "note": f"decodes autoregressively; {why.removeprefix('mode: ')}"}
        return cls.find(config, **where)

    return {name: find(cls) if name in wanted else {"available": False, "note": "not asked for (--engines)"}
            for name, cls in ENGINES.items()}
