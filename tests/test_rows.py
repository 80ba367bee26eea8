"""The few-row kernel (`clover.kernels.rows`) against `F.linear` and the reference experts, its
fallback where it cannot be built, and packed models through it against plain ones."""

import platform
import warnings

import pytest
import torch
import torch.nn.functional as F

import clover
from clover.kernels import packed, rows
from clover.models.layers import Experts
from clover.moe import reference_expert_forward, route

X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(scope="module")
def builds():
    """The kernel as built by default, and (on x86) for AVX2 and for no vector ISA: the three code paths."""
    if rows.library() is None:
        pytest.skip("no C compiler here: the fallback is tested below")
    libs = {rows.isa(): rows.library()}
    if X86:
        for flags in (("-O3", "-mavx2", "-mfma", "-mno-avx512f"), ("-O3", "-mno-avx", "-mno-avx2")):
            lib = rows._load((*flags, "-shared", "-fPIC"))
            libs[lib.clover_rows_isa().decode()] = lib
        assert {"avx2", "scalar"} <= set(libs)
    return libs


@pytest.fixture
def each_build(builds, request, monkeypatch):
    monkeypatch.setattr(rows, "_lib", builds[request.param] if request.param in builds else pytest.skip(request.param))
    return request.param


ISAS = ["avx512", "avx2", "scalar"]


@pytest.mark.parametrize("each_build", ISAS, indirect=True)
@pytest.mark.parametrize("N,K", [(37, 53), (5, 300), (64, 16), (1, 7)])
def test_linear_equals_f_linear(each_build, N, K):
    """Every row count 1…16 (the row blocks and their short last one), N and K not multiples of the
    tile or the vector (the tails), with and without a bias."""
    g = torch.Generator().manual_seed(N * K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    for M in range(1, rows.MAX_ROWS + 1):
        x = torch.randn(M, K, generator=g)
        torch.testing.assert_close(rows.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(rows.linear(x[None], w, b), F.linear(x[None], w, b), atol=1e-4, rtol=1e-5)


def _routed(inter: int, N: int, k: int):
    """16 random experts of hidden 40 and width `inter`, N random tokens routed to k of them."""
    ex = Experts(16, 40, inter)
    g = torch.Generator().manual_seed(N + k)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
    x = torch.randn(N, 40, generator=g)
    w, idx = route(torch.randn(N, 16, generator=g), k)
    return ex, x, w, idx


@pytest.mark.parametrize("each_build", ISAS, indirect=True)
@pytest.mark.parametrize("N,k", [(1, 2), (3, 2), (8, 4), (16, 8)])
def test_experts_equal_reference(each_build, N, k):
    ex, x, w, idx = _routed(13, N, k)  # odd sizes: the tails
    with torch.inference_mode():
        out = rows.experts(x, idx, w, ex.gate_up_proj, ex.down_proj)
        torch.testing.assert_close(out, reference_expert_forward(ex, x, idx, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("N,k", [(17, 4), (40, 4), (96, 2)])
def test_experts_of_many_tokens_equal_reference_and_take_the_kernel_by_size(builds, N, k, monkeypatch):
    """`rows.experts` past 16 tokens (an expert's rows in several row blocks) == the per-token
    reference; through `Experts`' dispatch, plain (unpacked) experts take it where `rows_take` says:
    gate_up matrices of at least `ROW_EXPERT_BYTES`, up to `ROW_EXPERT_SLOTS` slots per expert."""
    import clover.moe as moe

    ex, x, w, idx = _routed(12, N, k)  # strides torch's grouped matmul takes (16-byte multiples)
    calls = []
    real = packed.rows_experts
    monkeypatch.setattr(packed, "rows_experts", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    with torch.inference_mode():
        want = reference_expert_forward(ex, x, idx, w)
        torch.testing.assert_close(rows.experts(x, idx, w, ex.gate_up_proj, ex.down_proj), want, atol=1e-5, rtol=1e-5)
        built = rows._lib
        monkeypatch.setattr(rows, "_lib", None)  # not loaded yet in this process
        moe.dispatch_experts(ex, x, idx, w)
        assert calls == [] and rows._lib is None  # small experts: their path as before, the kernel not even built
        monkeypatch.setattr(rows, "_lib", built)
        monkeypatch.setattr(packed, "ROW_EXPERT_BYTES", ex.gate_up_proj[0].numel() * 4)
        torch.testing.assert_close(moe.dispatch_experts(ex, x, idx, w)[0], want, atol=1e-5, rtol=1e-5)
        assert calls == [N]
        monkeypatch.setattr(packed, "ROW_EXPERT_SLOTS", N * k // 16 - 1)  # past the slot bound: torch's grouped matmul
        torch.testing.assert_close(moe.dispatch_experts(ex, x, idx, w)[0], want, atol=1e-5, rtol=1e-5)
        assert calls == [N]
        monkeypatch.setattr(packed, "ROW_EXPERT_SLOTS", 10**6)
        grouped = []
        real_grouped = moe.static_expert_forward
        monkeypatch.setattr(moe, "static_expert_forward", lambda e, x, *a: grouped.append(x.shape[0]) or real_grouped(e, x, *a))
        ex, x, w, idx = _routed(16, N, k)  # bf16 experts (16-byte strides): the kernel is float32's, their path
        ex.to(torch.bfloat16)  # as before (torch's grouped matmul)
        moe.dispatch_experts(ex, x.bfloat16(), idx, w.bfloat16())
        assert calls == [N] and grouped == [N]


def test_bad_input_is_refused_clearly(builds):
    w, x = torch.randn(8, 16), torch.randn(16, 4)
    with pytest.raises(ValueError, match="x must be a contiguous torch.float32 CPU tensor"):
        rows.linear(x.t(), w)  # a transposed view: refused, not read with the wrong strides
    with pytest.raises(ValueError, match="must be a contiguous torch.float32"):
        rows.linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="do not match"):
        rows.linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match=r"17 rows \(1…16\)"):
        rows.linear(torch.randn(17, 16), w)
    gu, dn = torch.randn(4, 6, 16), torch.randn(4, 16, 3)
    with pytest.raises(ValueError, match="expert ids outside 0…3"):
        rows.experts(torch.randn(2, 16), torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2), gu, dn)
    with pytest.raises(ValueError, match="top_idx must be a contiguous torch.int64"):
        rows.experts(torch.randn(2, 16), torch.tensor([[0, 3], [1, 2]], dtype=torch.int32), torch.ones(2, 2), gu, dn)


@pytest.fixture
def counted(monkeypatch, builds):
    """Every layer packs (MIN_BYTES 0); the row kernel's calls and oneDNN's are counted."""
    monkeypatch.setattr(packed, "MIN_BYTES", 0)
    calls = {"rows": [], "onednn": [], "experts": []}
    real_rows, real_dnn, real_ex = packed._rows_mm, packed._packed_mm, packed.rows_experts
    monkeypatch.setattr(packed, "_rows_mm", lambda x, w, b: calls["rows"].append(x.shape[0]) or real_rows(x, w, b))
    monkeypatch.setattr(packed, "_packed_mm", lambda x, p, b: calls["onednn"].append(x.shape[0]) or real_dnn(x, p, b))
    monkeypatch.setattr(packed, "rows_experts", lambda x, *a: calls["experts"].append(x.shape[0]) or real_ex(x, *a))
    return calls


@pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN packed linear")
def test_packed_linear_takes_the_row_kernel_up_to_8_rows(counted):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=True)
    with torch.no_grad():
        lin.bias.copy_(torch.randn(80, generator=g))
    packed.pack_model(lin)
    with torch.inference_mode():
        for shape in ((1, 2, 48), (16, 48), (3, 6, 48), (1, 48)):
            x = torch.randn(shape, generator=g)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 48, 4, generator=g).transpose(1, 2)  # [2, 4, 48], not contiguous: copied first
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert counted["rows"] == [2, 8] and counted["onednn"] == [16, 18]  # one row: the plain GEMV
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            lin(torch.randn(4, 48, generator=g))  # more threads: oneDNN's threaded GEMM
    finally:
        torch.set_num_threads(1)
    assert counted["onednn"] == [16, 18, 4]


def test_fallback_when_the_kernel_cannot_be_built(monkeypatch, tmp_path, tiny_dir):
    """No compiler, or a failing one: one warning, once; `library()` None; packed layers and experts
    keep oneDNN and the host loop, with the same tokens."""
    monkeypatch.setenv("CLOVER_KERNELS", str(tmp_path))
    for cc, reason in (("no-such-compiler-here", "no C compiler"), ("false", "exited with 1")):
        monkeypatch.setenv("CC", cc)
        monkeypatch.setattr(rows, "_lib", None)
        with pytest.warns(RuntimeWarning, match=f"could not be built.*{reason}.*using torch's matmuls"):
            assert rows.library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert rows.library() is None and not packed.row_kernel()  # no second warning
    assert not list(tmp_path.iterdir())  # nothing half-built left in the cache
    if packed.available():
        monkeypatch.setattr(packed, "MIN_BYTES", 0)
        plain, fast = clover.load(tiny_dir, pack=False), clover.load(tiny_dir, pack=True)
        kw = dict(mode="diffusion", max_new_tokens=16, ignore_eos=True)
        assert fast.generate("def f(x):", **kw).token_ids == plain.generate("def f(x):", **kw).token_ids


@pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN packed linear")
def test_packed_model_through_the_row_kernel_equals_plain_model(tiny_dir, counted):
    """A packed tiny model with the row kernel on: step logits within f32 tolerance of the plain
    model's, greedy tokens identical through the engine (AR, diffusion, speculative)."""
    from test_packed import _step_outputs

    plain, fast = clover.load(tiny_dir, pack=False), clover.load(tiny_dir, pack=True)
    for a, b in zip(_step_outputs(plain), _step_outputs(fast)):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    assert counted["rows"] and counted["experts"]  # dense layers and routed experts took the kernel
    prompts = ["The capital of France is", "def add(a, b):"]
    for mode in ("ar", "diffusion", "speculative"):
        kw = dict(mode=mode, max_new_tokens=24, ignore_eos=True)
        assert [g.token_ids for g in fast.generate(prompts, **kw)] == [g.token_ids for g in plain.generate(prompts, **kw)]
    kw = dict(mode="ar", max_new_tokens=8, ignore_eos=True)
    counted["experts"].clear()
    assert fast.generate(prompts[0], **kw).token_ids == plain.generate(prompts[0], **kw).token_ids
    assert 1 in counted["experts"]  # an AR step's one token: its experts in one call too


def test_pack_without_copies_takes_the_row_kernel_up_to_16_rows(counted):
    """`pack_model(copies=False)`: no oneDNN copy; 2…16 rows through the row kernel, one row and more
    than 16 through `F.linear`, oneDNN never."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=True)
    with torch.no_grad():
        lin.bias.copy_(torch.randn(80, generator=g))
    assert packed.pack_model(lin, copies=False) == 0 and lin.pack.packed is None
    with torch.inference_mode():
        for shape in ((1, 2, 48), (16, 48), (3, 6, 48), (1, 48), (17, 48)):
            x = torch.randn(shape, generator=g)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert counted["rows"] == [2, 16] and counted["onednn"] == []
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            torch.testing.assert_close(lin(x[:4]), F.linear(x[:4], lin.weight, lin.bias))  # more threads: F.linear
    finally:
        torch.set_num_threads(1)
    assert counted["rows"] == [2, 16] and counted["onednn"] == []


def test_model_with_the_row_kernel_alone_equals_plain_model(tiny_dir, counted, monkeypatch):
    """`clover.load(pack="rows")`: no copies; step logits within f32 tolerance of the plain model's,
    greedy tokens identical (AR, diffusion, speculative); a few tokens' experts in one kernel call,
    more tokens on torch's grouped matmul (no host loop); its own cost-curve key; and the default
    where copies do not fit. A bad `pack` is refused before loading."""
    import clover.moe as L  # where the routed experts are dispatched (moe.dispatch_experts)
    from clover.decoding.width import cost_key
    from test_packed import _step_outputs

    grouped = []
    real_grouped = L.static_expert_forward
    monkeypatch.setattr(L, "static_expert_forward", lambda ex, x, *a: grouped.append(x.shape[0]) or real_grouped(ex, x, *a))
    plain, lean = clover.load(tiny_dir, pack=False), clover.load(tiny_dir, pack="rows")
    assert packed.packing(lean.model) == "rows" and packed.packing(plain.model) is None
    assert all(m.pack.packed is None for m in lean.model.modules() if isinstance(m, packed.PackedLinear))
    for a, b in zip(_step_outputs(plain), _step_outputs(lean)):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    assert counted["rows"] and counted["experts"] and not counted["onednn"]
    assert grouped and all(n > rows.MAX_ROWS for n in grouped[len(grouped) // 2:])  # the prompt's tokens
    prompts = ["The capital of France is", "def add(a, b):"]
    for mode in ("ar", "diffusion", "speculative"):
        kw = dict(mode=mode, max_new_tokens=24, ignore_eos=True)
        assert [g.token_ids for g in lean.generate(prompts, **kw)] == [g.token_ids for g in plain.generate(prompts, **kw)]
    assert cost_key(lean.model)["packed"] == "rows" and "packed" not in cost_key(plain.model)
    monkeypatch.setattr(packed, "MIN_MODEL_BYTES", 0)
    monkeypatch.setattr(packed.os, "sysconf", lambda name: 1)  # the copies do not fit: the kernel alone
    assert packed.packing(clover.load(tiny_dir).model) == "rows"
    with pytest.raises(ValueError, match="pack='yes'"):
        clover.load(tiny_dir / "no-such-model", pack="yes")
