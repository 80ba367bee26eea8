"""The uncached baseline (`mode="naive"`): every denoise step recomputes the whole sequence, as the
original masked-diffusion reference generators do. Same block/threshold rules as the cached engine,
so the two must produce the same tokens; only the cost differs."""

from __future__ import annotations

from functools import partial

from .diffusion import diffusion_decode

naive_decode = partial(diffusion_decode, recompute=True)
