"""The denoising playground: a static page (`static/`: HTML, JS and CSS, no build step, nothing
fetched from elsewhere) served at `/` and `/playground`, and `GET /v1/clover/modes`, what its
controls offer: the registry's modes, the acceptance policies, the model's defaults and each
option's limits, and whether the model is a chat model (the page then opens on the chat endpoint).

The page uses only the public API: it streams `/v1/completions` or `/v1/chat/completions` with
`stream_options.provisional` (a clover extension, docs/serving.md) and draws each denoise step."""

from __future__ import annotations

import dataclasses
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding import get_mode, mode_names
from ..decoding.acceptance import FALLBACKS, POLICIES
from ..decoding.sampling import LIMITS, SamplingParams

STATIC = resources.files(__package__) / "static"
PAGE = "index.html"
ASSETS = {"playground.js": "text/javascript; charset=utf-8", "playground.css": "text/css; charset=utf-8"}
# the page loads nothing from elsewhere and runs no inline code
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
# the options the page shows, in its order
OPTIONS = ("max_new_tokens", "temperature", "block_size", "threshold", "policy", "fallback", "factor",
           "low_threshold", "entropy_budget", "sub_block", "draft_length", "seed")


def _static(name: str, media_type: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=HEADERS)


def modes_info(llm, model_name: str, default_mode: str) -> dict:
    """What `GET /v1/clover/modes` answers."""
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    defaults.update(block_size=llm.config.block_size, threshold=llm.config.threshold, policy=llm.config.policy)
    options = {}
    for name in OPTIONS:
        lim = LIMITS.get(name)
        spec = {"default": defaults.get(name)}
        if lim is not None:
            spec.update({k: getattr(lim, k) for k in ("ge", "gt", "le") if getattr(lim, k) is not None})
            spec.update(doc=lim.doc, nullable=lim.nullable)
        options[name] = spec
    options["policy"]["choices"] = list(POLICIES)
    options["fallback"]["choices"] = list(FALLBACKS)
    data = []
    for name in mode_names():
        m = get_mode(name)
        data.append({"id": name, "summary": m.summary, "needs_mask": m.needs_mask,
                     "threshold_commit": m.threshold_commit, "reference": m.reference,
                     "available": llm.mode_available(name)})
    return {"object": "list", "model": model_name, "default": default_mode, "max_model_len": llm.context_length,
            "chat": bool(getattr(llm, "is_chat", False)), "data": data, "options": options}


router = APIRouter()  # the page, its two assets and the modes endpoint (under /v1, so behind `--api-key`)


@router.get("/", include_in_schema=False)
@router.get("/playground", include_in_schema=False)
async def playground_page():
    return _static(PAGE, "text/html; charset=utf-8")


@router.get("/playground/{name}", include_in_schema=False)
async def playground_asset(name: str):
    if name not in ASSETS:  # only the shipped files, never a path
        raise StarletteHTTPException(404, f"no playground file {name!r}")
    return _static(name, ASSETS[name])


@router.get("/v1/clover/modes", responses={401: {"description": "missing or wrong `Authorization: Bearer` key"}})
async def clover_modes(request: Request):
    """The decoding modes this server offers (the registry, `clover.decoding.mode_names()`),
    which the model can run, the default, and the playground's options with their defaults
    and limits."""
    srv = request.app.state.server
    return modes_info(srv.llm, srv.model_name, srv.llm.default_mode)
