"""An OpenAI-compatible HTTP server that batches rows of concurrent requests into shared forwards.

`create_app(llm, ...)` builds the FastAPI app; `serve(model_dir, ...)` loads a model and runs it
with uvicorn (the `clover serve` command calls `run_app`). See docs/serving.md. Nothing heavy is
imported here: `clover.serve.defaults` is readable without the `serve` extra installed."""

from __future__ import annotations

import importlib

_EXPORTS = {"create_app": "clover.serve.app", "serve": "clover.serve.app", "run_app": "clover.serve.app"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'clover.serve' has no attribute {name!r}")
