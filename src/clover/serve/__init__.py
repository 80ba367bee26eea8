"""An OpenAI-compatible HTTP server that batches rows of concurrent requests into shared forwards.

`create_app(llm, ...)` builds the FastAPI app; `serve(...)` / `main_serve(args)` run it with uvicorn
(the `clover serve` command). See docs/serving.md."""

from __future__ import annotations

from .app import create_app, main_serve, serve

__all__ = ["create_app", "serve", "main_serve"]
