"""oneDNN-packed weights (`clover.kernels.packed`) against the plain path they replace."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import clover
from clover.kernels import packed, rows
from clover.models.layers import Experts
from clover.moe import grouped_expert_forward, reference_expert_forward, route

BUNDLED = Path(__file__).resolve().parents[1] / "src" / "clover" / "assets" / "clover-tiny"
pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN packed linear")


@pytest.fixture
def count_packed(monkeypatch):
    """Every layer packs (MIN_BYTES 0), and the calls that took the packed path are counted (oneDNN's:
    the row kernel, which takes up to 16 rows where it is built, is off here; tests/test_rows.py)."""
    monkeypatch.setattr(packed, "MIN_BYTES", 0)
    monkeypatch.setattr(packed, "row_kernel", lambda: False)
    calls = []
    real = packed._packed_mm
    monkeypatch.setattr(packed, "_packed_mm", lambda x, p, b: calls.append(x.shape[0]) or real(x, p, b))
    return calls


def test_packed_linear_equals_f_linear_and_falls_back_where_it_must(count_packed):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=True)
    with torch.no_grad():
        lin.bias.copy_(torch.randn(80, generator=g))
    assert packed.pack_model(lin) == 48 * 80 * 4 and isinstance(lin, packed.PackedLinear)
    with torch.inference_mode():
        for rows in (2, 8, 32):
            x = torch.randn(1, rows, 48, generator=g)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        assert count_packed == [2, 8, 32]
        lin(torch.randn(1, 48, generator=g))  # one row: the plain GEMV
        lin(torch.randn(packed.MAX_ROWS + 1, 48, generator=g))  # many rows: MKL's GEMM
    with torch.enable_grad():
        lin(torch.randn(4, 48, generator=g))  # autograd: plain
    assert count_packed == [2, 8, 32]
    with torch.no_grad():
        lin.weight.mul_(2.0)  # an in-place update: the pack is stale, the layer falls back
    x = torch.randn(4, 48, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert count_packed == [2, 8, 32]
    packed.pack_model(lin)  # packed again: the new weight
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert count_packed == [2, 8, 32, 4]


@pytest.mark.parametrize("N,k", [(1, 2), (5, 2), (33, 4), (40, 8)])
def test_packed_experts_equal_reference(N, k, count_packed):
    ex = Experts(16, 24, 12)
    g = torch.Generator().manual_seed(N)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
    packed.pack_model(ex)
    assert ex.packs is not None and len(ex.packs) == 16
    x = torch.randn(N, 24, generator=g)
    w, idx = route(torch.randn(N, 16, generator=g), k)
    with torch.inference_mode():
        out = grouped_expert_forward(ex, x, idx, w)
        torch.testing.assert_close(out, reference_expert_forward(ex, x, idx, w), atol=1e-5, rtol=1e-5)
    rows = torch.bincount(idx.reshape(-1), minlength=16)
    assert sorted(count_packed) == sorted(2 * [int(r) for r in rows if 2 <= r <= packed.EXPERT_MAX_ROWS])  # two packed matmuls each


def _step_outputs(llm):
    """A prefix, then a block commit fused with a denoise block, and a denoise block alone."""
    m = llm.model
    g = torch.Generator().manual_seed(1)
    V, mask = m.config.vocab_size, m.config.mask_token_id
    with torch.inference_mode():
        cache = m.make_cache(2, 64)
        m.step(cache, commit_ids=torch.randint(3, V - 8, (2, 12), generator=g))
        block = m.step(cache, commit_ids=torch.randint(3, V - 8, (2, 8), generator=g),
                       denoise_ids=torch.full((2, 8), mask))
        alone = m.step(cache, denoise_ids=torch.full((2, 16), mask))
    return block.commit_logits, block.denoise_logits, alone.denoise_logits


@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_packed_model_equals_plain_model(which, tiny_dir, count_packed):
    """Step outputs within f32 tolerance, and greedy tokens identical through the engine (AR,
    diffusion, speculative), on a tiny random model and the bundled model."""
    path = tiny_dir if which == "tiny" else BUNDLED
    plain, fast = clover.load(path, pack=False), clover.load(path, pack=True)
    assert not any(isinstance(mod, packed.PackedLinear) for mod in plain.model.modules())
    for a, b in zip(_step_outputs(plain), _step_outputs(fast)):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    assert count_packed  # the packed model's forwards of several positions took the packed path
    prompts = ["The capital of France is", "def add(a, b):"]
    for mode in ("ar", "diffusion", "speculative"):
        kw = dict(mode=mode, max_new_tokens=24, ignore_eos=True)
        assert [g.token_ids for g in fast.generate(prompts, **kw)] == [g.token_ids for g in plain.generate(prompts, **kw)]


def test_packed_model_with_many_rows_per_expert_takes_the_grouped_path(tiny_dir, count_packed, monkeypatch):
    """Above `EXPERT_MAX_ROWS` routed slots per expert (a prompt) the experts go through torch's
    grouped matmul as unpacked ones do; the outputs still equal the plain model's."""
    plain, fast = clover.load(tiny_dir, pack=False), clover.load(tiny_dir, pack=True)
    assert all(mod.packs is not None for mod in fast.model.modules() if isinstance(mod, Experts))
    monkeypatch.setattr(packed, "EXPERT_MAX_ROWS", 1)
    import clover.moe as moe

    grouped = []
    real = moe.grouped_swiglu
    monkeypatch.setattr(moe, "grouped_swiglu", lambda xs, *a: grouped.append(xs.shape[0]) or real(xs, *a))
    outs = _step_outputs(fast)
    assert grouped and count_packed  # grouped experts, packed dense layers
    for a, b in zip(_step_outputs(plain), outs):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    grouped.clear()
    monkeypatch.setattr(packed, "EXPERT_MAX_ROWS", 16)
    _step_outputs(fast)
    assert grouped == []  # a few rows per expert: the packed host loop instead


def test_pack_is_the_default_only_where_it_fits(tiny_dir, monkeypatch):
    """Nothing large enough to pack in a tiny model (nor in the bundled one): not packed; every layer
    large enough and memory to spare: packed by default; no memory to spare: the row kernel alone
    where it is built (no copies), else not packed."""
    for path in (tiny_dir, BUNDLED):
        assert not any(isinstance(mod, packed.PackedLinear) for mod in clover.load(path).model.modules())
    monkeypatch.setattr(packed, "MIN_BYTES", 0)
    assert not any(isinstance(mod, packed.PackedLinear) for mod in clover.load(tiny_dir).model.modules())
    monkeypatch.setattr(packed, "MIN_MODEL_BYTES", 0)
    assert any(isinstance(mod, packed.PackedLinear) for mod in clover.load(tiny_dir).model.modules())
    monkeypatch.setattr(packed.os, "sysconf", lambda name: 1)  # no memory to spare: no copies
    assert packed.packing(clover.load(tiny_dir).model) == ("rows" if rows.library() is not None else None)
    monkeypatch.setattr(rows, "_lib", False)  # nor the row kernel: not packed
    assert not any(isinstance(mod, packed.PackedLinear) for mod in clover.load(tiny_dir).model.modules())


def test_cost_curve_key_tells_packed_from_plain(tiny_dir, count_packed):
    """`block_size="auto"` reads the cost curve measured on the same kind of forward: a packed model's
    curve has its own key; a plain model's key is what it was before packing existed."""
    from clover.decoding.width import cost_key

    plain, fast = clover.load(tiny_dir, pack=False), clover.load(tiny_dir, pack=True)
    assert packed.is_packed(fast.model) and not packed.is_packed(plain.model)
    assert "packed" not in cost_key(plain.model) and cost_key(fast.model).pop("packed") is True
    assert {k: v for k, v in cost_key(fast.model).items() if k != "packed"} == cost_key(plain.model)
