"""`compile_model`: torch.compile (inductor), opt-in (`clover.load(compile=True)`, CLI `--compile`).

The AR step, the denoise step, a block commit fused with the next denoise step and the speculative
verify step each run as one graph-break-free graph over static shapes: the eager step's own
forward with `static=True` (`clover.models.static`); measured 2.84x (AR), 1.5x (diffusion) and
1.25x (speculative) faster than eager on the bundled model after warm-up (docs/benchmarks.md).
Results equal eager's up to floating-point reassociation; tests compare generated tokens.
"""

from __future__ import annotations

from torch import nn

COMPILE_MODES = ("static",)


def compile_model(model: nn.Module, *, mode: str = "static", backend: str = "inductor") -> nn.Module:
    """Compile `model`'s cached steps in place (`StaticSteps`); returns the model. Needs plain
    (unquantized) experts and raises ValueError otherwise."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)} (or True)")
    from .static import StaticSteps

    model.static_steps = StaticSteps(model, backend=backend)
    return model


def is_compiled(model: nn.Module) -> bool:
    return getattr(model, "static_steps", None) is not None
