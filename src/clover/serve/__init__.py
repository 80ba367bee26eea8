"""An OpenAI-compatible HTTP server that batches rows of concurrent requests into shared forwards.

`create_app(llm, ...)` builds the FastAPI app; `serve(model_dir, ...)` loads a model and runs it
with uvicorn (the `clover serve` command calls `run_app`). See docs/serving.md. Nothing heavy is
imported here: `clover.serve.defaults` is readable without the `serve` extra installed."""

from __future__ import annotations

from ..lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {"clover.serve.app": ("create_app", "serve", "run_app")})
