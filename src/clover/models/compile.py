"""`compile_model`: torch.compile (inductor), opt-in (`clover.load(compile=...)`), in one of two forms.

- `"static"` (`clover.models.static`): the AR step, the denoise step, a block commit fused with
  the next denoise step and the speculative verify step each run as one graph-break-free graph
  over static shapes; measured 2.84x (AR), 1.5x (diffusion) and 1.25x (speculative) faster than
  eager on the bundled model after warm-up.
- `"layers"` (below): each layer's dense modules compiled on their own; measured no faster than eager.

`"layers"`:

What is compiled: each decoder layer's token mixer (Gated DeltaNet or gated attention), its two
RMSNorms and the shared expert — the dense, elementwise-heavy parts where inductor can fuse the
~1,500 small ops of a step. What stays eager: the routed-expert dispatch (`grouped_expert_forward`
reads the per-expert token counts on the host and loops over the touched experts), the router and
the LM head. Each module's `forward` is replaced on the instance (state-dict keys are unchanged).

This is not yet the static-shape, graph-break-free step of issue 20: the cache's K/V write reads
the row lengths on the host (`int(lengths.max())`), the attention mask is sized by the longest row,
and the MoE dispatch is data-dependent, so Dynamo splits there and re-specialises as the prefix
grows (`dynamic=None`: the second shape marks a dimension dynamic). Results equal eager's up to
floating-point reassociation; tests compare generated tokens.
"""

from __future__ import annotations

import torch
from torch import nn


def _compile_forward(module: nn.Module, **options) -> None:
    if getattr(module, "_clover_compiled", False):
        return
    module.forward = torch.compile(module.forward, **options)
    module._clover_compiled = True


def _compile_gdn(module: nn.Module, **options) -> None:
    """The GDN layer: compiled when it commits at most one token (the AR step's recurrent update)
    or only denoises; eager for multi-token commits (prefill, verify), whose chunked kernel uses
    `solve_triangular(..., out=)`, which inductor (torch 2.13, CPU) fails to lower."""
    if getattr(module, "_clover_compiled", False):
        return
    eager = module.forward
    compiled = torch.compile(eager, **options)

    def forward(x, segments, state=None):
        if state is None or segments.commit_len > 1 or segments.block_size is not None:
            return eager(x, segments, state)
        return compiled(x, segments, state)

    module.forward = forward
    module._clover_compiled = True


COMPILE_MODES = ("static", "layers")


def compile_model(model: nn.Module, *, mode: str = "static", dynamic: bool | None = None,
                  backend: str = "inductor") -> nn.Module:
    """Compile `model` in place (`mode`: "static" whole-step graphs, or "layers"); returns the model.
    "static" needs plain (unquantized) experts and raises ValueError otherwise."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)}")
    if mode == "static":
        from .static import StaticSteps

        model.static_steps = StaticSteps(model, backend=backend)
        model._clover_compiled = True
        return model
    options = {"dynamic": dynamic, "backend": backend}
    for layer in model.model.layers:
        if layer.layer_type == "full_attention":
            _compile_forward(layer.mixer, **options)
        else:
            _compile_gdn(layer.mixer, **options)
        _compile_forward(layer.input_layernorm, **options)
        _compile_forward(layer.post_attention_layernorm, **options)
        shared = getattr(layer.mlp, "shared_expert", None)
        if shared is not None:
            _compile_forward(shared, **options)
        elif not hasattr(layer.mlp, "experts"):  # a dense MLP
            _compile_forward(layer.mlp, **options)
    model._clover_compiled = True
    return model


def is_compiled(model: nn.Module) -> bool:
    return bool(getattr(model, "_clover_compiled", False))
