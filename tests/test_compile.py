"""`clover.load(compile=True)` / `--compile`: the compiled per-layer modules give the same tokens
as eager in every decoding mode (tiny model). Compiling takes minutes on a CPU, so the token test
is marked slow; the wiring is checked without compiling."""

from __future__ import annotations

import pytest
import torch

import clover
from clover.decoding import mode_names
from clover.models.compile import compile_model, is_compiled


def test_compile_wiring(tiny_dir, monkeypatch):
    """compile=True reaches compile_model; the state dict keys are unchanged; nothing compiles by default."""
    import clover.models.compile as mc

    seen = []
    monkeypatch.setattr(mc.torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    llm = clover.load(tiny_dir)
    assert not is_compiled(llm.model)
    keys = set(llm.model.state_dict())
    llm = clover.load(tiny_dir, compile=True)
    assert is_compiled(llm.model) and seen
    assert set(llm.model.state_dict()) == keys
    out = llm.generate("ab", mode="ar", max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4


@pytest.mark.slow
def test_compiled_tokens_equal_eager(tiny_dir):
    torch.set_num_threads(1)
    eager = clover.load(tiny_dir)
    compiled = clover.load(tiny_dir)
    compile_model(compiled.model)
    for mode in mode_names():
        kw = dict(mode=mode, max_new_tokens=12, ignore_eos=True)
        if mode != "ar":
            kw["block_size"] = 4
        a = eager.generate("def f(x):", **kw)
        b = compiled.generate("def f(x):", **kw)
        assert a.token_ids == b.token_ids, mode
