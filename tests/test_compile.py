"""`clover.load(compile=...)` / `--compile`: the static whole-step graphs and the compiled per-layer
modules give the same tokens as eager in every decoding mode (tiny model). Compiling takes minutes
on a CPU, so those token tests are marked slow; the wiring, and the static graphs' code run eagerly
(torch.compile replaced by the identity), are checked without compiling."""

from __future__ import annotations

import pytest
import torch

import clover
from clover.decoding import mode_names
from clover.models.compile import compile_model, is_compiled
from clover.models.static import CAPACITY_QUANTUM


def _identity_compile(monkeypatch, seen=None):
    import clover.models.compile as mc

    monkeypatch.setattr(mc.torch, "compile", lambda fn, **kw: (seen.append(kw) if seen is not None else None) or fn)


def test_compile_wiring(tiny_dir, monkeypatch):
    """compile=True reaches compile_model; the state dict keys are unchanged; nothing compiles by default."""
    seen = []
    _identity_compile(monkeypatch, seen)
    llm = clover.load(tiny_dir)
    assert not is_compiled(llm.model) and llm.model.static_steps is None
    keys = set(llm.model.state_dict())
    llm = clover.load(tiny_dir, compile="layers")
    assert is_compiled(llm.model) and seen and llm.model.static_steps is None
    assert set(llm.model.state_dict()) == keys
    out = llm.generate("ab", mode="ar", max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4
    seen.clear()
    llm = clover.load(tiny_dir, compile=True)  # True means the static steps
    assert llm.model.static_steps is not None and seen == [dict(fullgraph=True, dynamic=False, backend="inductor",
                                                                   options={"cpp_wrapper": True})]
    assert set(llm.model.state_dict()) == keys
    with pytest.raises(ValueError, match="compile mode"):
        clover.load(tiny_dir, compile="fast")


def test_static_steps_run_eagerly_equal_eager_step(tiny_dir, monkeypatch):
    """The static graphs' code (no compile) gives the eager step's tokens in every mode, in a batch
    of rows at different lengths, and serves each forward kind it claims."""
    torch.set_num_threads(1)
    _identity_compile(monkeypatch)
    eager = clover.load(tiny_dir)
    static = clover.load(tiny_dir, compile="static")
    prompts = ["def f(x):", "ab", "a longer prompt of a few words"]
    for mode in mode_names():
        kw = dict(mode=mode, max_new_tokens=12, ignore_eos=True)
        if mode != "ar":
            kw["block_size"] = 4
        for a, b in zip(eager.generate(prompts, **kw), static.generate(prompts, **kw)):
            assert a.token_ids == b.token_ids, mode
            assert a.finish_reason == b.finish_reason
    calls = static.model.static_steps.calls
    assert calls["ar"] and calls["denoise"] and calls["commit+denoise"] and calls["verify"], calls


def test_static_cache_capacity_is_rounded(tiny_dir, monkeypatch):
    _identity_compile(monkeypatch)
    llm = clover.load(tiny_dir, compile=True)
    assert llm.model.make_cache(2, 37).capacity == CAPACITY_QUANTUM
    assert llm.model.make_cache(1, CAPACITY_QUANTUM + 1).capacity == 2 * CAPACITY_QUANTUM
    assert clover.load(tiny_dir).model.make_cache(2, 37).capacity == 37


@pytest.mark.slow
@pytest.mark.parametrize("how", ["static", "layers"])
def test_compiled_tokens_equal_eager(tiny_dir, how):
    torch.set_num_threads(1)
    eager = clover.load(tiny_dir)
    compiled = clover.load(tiny_dir)
    compile_model(compiled.model, mode=how)
    for mode in mode_names():
        kw = dict(mode=mode, max_new_tokens=12, ignore_eos=True)
        if mode != "ar":
            kw["block_size"] = 4
        a = eager.generate("def f(x):", **kw)
        b = compiled.generate("def f(x):", **kw)
        assert a.token_ids == b.token_ids, mode


def test_static_refuses_quantized_experts(tiny_dir, tmp_path, monkeypatch):
    from clover.quant import quantize_checkpoint

    _identity_compile(monkeypatch)
    q = tmp_path / "int8"
    quantize_checkpoint(tiny_dir, q, bits=8, progress=False)
    with pytest.raises(ValueError, match="quantized experts.*compile=\"layers\""):
        clover.load(q, compile=True)


def test_static_falls_back_to_eager_past_the_graph_limit(tiny_dir, monkeypatch):
    """More shapes than the recompile limit: the call runs eagerly (same tokens), with one warning."""
    import torch._dynamo.exc as dexc

    _identity_compile(monkeypatch)
    eager = clover.load(tiny_dir)
    static = clover.load(tiny_dir, compile=True)
    steps = static.model.static_steps

    def refuse(*a, **k):
        raise dexc.FailOnRecompileLimitHit("limit")

    steps._forward = refuse
    kw = dict(mode="diffusion", max_new_tokens=8, ignore_eos=True, block_size=4)
    with pytest.warns(RuntimeWarning, match="graphs reached"):
        out = static.generate("def f(x):", **kw)
    assert out.token_ids == eager.generate("def f(x):", **kw).token_ids
    assert steps.limit_hit and steps.calls["eager"] >= 2 and steps.calls["denoise"] == 0
