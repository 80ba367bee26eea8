"""The uncached baseline (`mode="naive"`): every denoise step recomputes the whole sequence, as the
original masked-diffusion reference generators do. Same block/threshold rules as the cached engine,
so the two must produce the same tokens; only the cost differs."""

from __future__ import annotations

from .diffusion import Diffusion
from .modes import register


class Naive(Diffusion):
    name = "naive"
    reference = "diffusion"
    summary = "block diffusion recomputing the whole sequence every step (the uncached reference)"
    recompute = True


register(Naive())
