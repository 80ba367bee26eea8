"""`clover serve`: the OpenAI-compatible server (`clover.serve`) on a model directory."""

from __future__ import annotations

import argparse

from .common import (UsageError, add_engine_arguments, add_model_arguments, extra_hint, llama_threads, load_llm, stderr,
                     wants_drafter)

SERVE_EXTRA = ("fastapi", "uvicorn", "pydantic", "starlette", "prometheus_client")  # pyproject's `serve` extra


def configure(p: argparse.ArgumentParser) -> None:
    from ..serve import defaults as d  # constants only: readable without the extra

    add_model_arguments(p)
    p.add_argument("--host", default=d.HOST, help=f"address to bind (default {d.HOST})")
    p.add_argument("--port", type=int, default=d.PORT, help=f"port (default {d.PORT})")
    p.add_argument("--max-batch", type=int, default=d.MAX_BATCH, help=f"rows decoded together (default {d.MAX_BATCH})")
    p.add_argument("--max-queue", type=int, default=d.MAX_QUEUE,
                   help=f"rows waiting beyond the batch before 429 (default {d.MAX_QUEUE})")
    p.add_argument("--max-body-bytes", type=int, default=d.MAX_BODY_BYTES, metavar="N",
                   help=f"the largest request body; larger ones get 413 (default {d.MAX_BODY_BYTES})")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    add_engine_arguments(p, "decode")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model family's tool-call format: hermes or qwen3_xml (default: read off the chat template)")


def _missing_serve_extra() -> str | None:
    """The first module of the `serve` extra that cannot be imported, or None."""
    import importlib.util

    for name in SERVE_EXTRA:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # a broken install, or sys.modules[name] is None
            return name
    return None


def calibration_note(llm, max_batch: int) -> None:
    """One line on what a first request may measure: speculative draft auto's step costs at the batch
    sizes the user cache does not hold yet."""
    if llm.config.mask_token_id is None:
        return
    from ..decoding.speculative import pending_step_curves
    from ..decoding.width import BATCH_BUCKETS, batch_bucket

    pending = pending_step_curves(llm.model, [b for b in BATCH_BUCKETS if b <= batch_bucket(max_batch)])
    if pending:
        stderr(f"clover serve: the first speculative request at batch size {', '.join(map(str, pending))} measures "
               "what a draft step costs (draft auto's widths; seconds, once per model and machine, then cached)")


def run(args: argparse.Namespace) -> int:
    missing = _missing_serve_extra()  # before loading the model: uvicorn is only imported to run
    if missing is None:
        try:
            from ..serve.app import run_app
        except ImportError as e:
            if (e.name or "").split(".")[0] not in SERVE_EXTRA:
                raise
            missing = e.name
    if missing is not None:
        raise UsageError(f"serving needs the serve extra ({missing} is not installed): {extra_hint('serve')}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch: must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue: must be >= 0, got {args.max_queue}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes: must be >= 1, got {args.max_body_bytes}")
    if args.tool_call_parser is not None:
        from ..serve.tools import get_parser

        get_parser(args.tool_call_parser)  # ValueError naming the registered formats, before loading
    import contextlib

    # nothing measured before the server listens: speculative draft auto's step costs are measured
    # (then cached) by the first request that needs them
    llm = load_llm(args, bundled_drafter=wants_drafter(args))
    if args.engine == "torch":
        calibration_note(llm, args.max_batch)
    with contextlib.ExitStack() as stack:
        if args.engine == "llama.cpp":
            from ..integrations.llama_port import port_llm

            llm = port_llm(llm, stack, gguf=args.gguf, threads=llama_threads(args), parallel=args.max_batch)
        run_app(llm, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
                api_key=args.api_key, model_name=args.served_model_name,
                max_body_bytes=args.max_body_bytes, tool_parser=args.tool_call_parser)
    return 0
