"""`compile_model`: torch.compile (inductor), opt-in (`clover.load(compile=True)`, CLI `--compile`).

The AR step, the denoise step, a block commit fused with the next denoise step and the speculative
verify step each run as one graph-break-free graph over static shapes: the eager step's own
forward with `static=True` (`clover.models.static`); measured 2.84x (AR), 1.5x (diffusion) and
1.25x (speculative) faster than eager on the bundled model after warm-up (docs/benchmarks.md).
Results equal eager's up to floating-point reassociation; tests compare generated tokens.

Where eager clover would run its linear layers on oneDNN's packed copies (`kernels.packed`: a CPU,
float32, a model large enough to stream its weights each forward), the graphs are compiled with
inductor's freezing instead (`default_freezing`): the packing moves into the graph, whose plain
`aten::mm` otherwise cost ~4x the packed matmul on clover-smol's verify (docs/experiments.md).
"""

from __future__ import annotations

from torch import nn

COMPILE_MODES = ("static",)


def default_freezing(model: nn.Module) -> bool:
    """Whether `compile_model` freezes the weights into the graphs by default: where eager clover
    would pack them for oneDNN (`kernels.packed.default_packing` True: a CPU, float32 layers, the
    copies fit in memory)."""
    from ..kernels.packed import default_packing

    return model.device.type == "cpu" and default_packing(model) is True


def compile_model(model: nn.Module, *, mode: str = "static", backend: str = "inductor",
                  freezing: bool | None = None) -> nn.Module:
    """Compile `model`'s cached steps in place (`StaticSteps`); returns the model. Needs plain
    (unquantized) experts and raises ValueError otherwise. `freezing`: inductor's freezing for
    these graphs (None: `default_freezing`)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)} (or True)")
    from .static import StaticSteps

    if freezing is None:
        freezing = default_freezing(model)
    model.static_steps = StaticSteps(model, backend=backend, freezing=freezing)
    return model


def is_compiled(model: nn.Module) -> bool:
    return getattr(model, "static_steps", None) is not None
