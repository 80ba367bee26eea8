"""Gated Delta Rule kernels: chunked == recurrent == naive == transformers' reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

import clover.kernels.gated_delta as gd
from clover.kernels import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_with_states,
    naive_gated_delta_rule,
    one_chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

ATOL = 1e-4
RTOL = 1e-4


def make_inputs(B, T, H, K, V, Hk=None, seed=0, dtype=torch.float32, normalize_k=True, with_state=False):
    """Random inputs in the model's ranges: g <= 0, beta in (0, 1).

    Without the in-kernel l2norm the delta rule is only stable for |k| <= ~1,
    so k is normalised here unless told otherwise."""
    Hk = Hk or H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen)
    k = torch.randn(B, T, Hk, K, generator=gen)
    if normalize_k:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.7 - 0.01
    beta = torch.rand(B, T, H, generator=gen)
    out = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta]
    s0 = torch.randn(B, H, K, V, generator=gen) * 0.3 if with_state else None
    return out, s0


SHAPES = [
    # B, T, H, K, V, Hk
    (1, 1, 2, 16, 16, None),
    (2, 37, 3, 16, 24, None),  # K != V, T not a multiple of the chunk
    (1, 64, 2, 32, 16, None),  # exactly one chunk
    (2, 130, 4, 32, 32, 2),  # grouped value heads, padding
    (1, 200, 2, 8, 40, None),  # several chunks, K < V
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}Hk{}".format(*s))
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("l2", [False, True])
def test_chunk_recurrent_naive_agree(shape, with_state, l2):
    B, T, H, K, V, Hk = shape
    (q, k, v, g, beta), s0 = make_inputs(B, T, H, K, V, Hk, seed=T + H, with_state=with_state)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o_ref.shape == (B, T, H, V) and s_ref.shape == (B, H, K, V)
    assert o_ref.abs().max() > 1e-3  # the comparison is not vacuous

    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    for o, s in [(o_c, s_c), (o_r, s_r)]:
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
        assert o.is_contiguous()
        assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
        assert_close(s, s_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("chunk_size", [1, 8, 16, 32, 64, 100])
def test_chunk_sizes(chunk_size):
    (q, k, v, g, beta), s0 = make_inputs(2, 77, 2, 16, 16, seed=3, with_state=True)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
    assert_close(s, s_ref, atol=ATOL, rtol=RTOL)


def test_long_sequence_multiple_slabs():
    # enough chunks to span several slabs of the chunked kernel
    (q, k, v, g, beta), s0 = make_inputs(1, 700, 2, 16, 16, seed=5, with_state=True)
    old = gd._SLAB_ROWS
    try:
        gd._SLAB_ROWS = 2 * 2 * 64  # two chunks per slab
        kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
        assert_close(s, s_ref, atol=ATOL, rtol=RTOL)
        o2, cs = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0, chunk_size=64,
                                                    use_qk_l2norm_in_kernel=True)
        assert_close(o2, o_ref, atol=ATOL, rtol=RTOL)
        o3, s3 = recurrent_gated_delta_rule(q[:, :640], k[:, :640], v[:, :640], g[:, :640], beta[:, :640],
                                            initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(cs[:, 10], s3, atol=ATOL, rtol=RTOL)
    finally:
        gd._SLAB_ROWS = old


@pytest.mark.parametrize("decay", ["none", "strong"])
def test_extreme_decay(decay):
    (q, k, v, g, beta), s0 = make_inputs(2, 150, 2, 16, 16, seed=53, with_state=True)
    if decay == "none":
        g = torch.zeros_like(g)
    else:
        g = g * 8.0
        g[:, 70:80] = -200.0  # exp underflows to 0: the state is wiped
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, **kw)
        assert torch.isfinite(o).all()
        assert_close(o, o_ref, atol=1e-4, rtol=1e-3)
        assert_close(s, s_ref, atol=ATOL, rtol=RTOL)


def test_final_state_none_and_scale():
    (q, k, v, g, beta), _ = make_inputs(1, 50, 2, 16, 8, seed=7)
    o_ref, _ = naive_gated_delta_rule(q, k, v, g, beta, scale=0.37)
    o_default, _ = naive_gated_delta_rule(q, k, v, g, beta)
    assert not torch.allclose(o_ref, o_default)  # the scale actually matters
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, scale=0.37)
        assert s is None
        assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
    # the default scale is K ** -0.5 applied to q
    o_manual, _ = naive_gated_delta_rule(q * 16**-0.5, k, v, g, beta, scale=1.0)
    assert_close(o_default, o_manual, atol=1e-6, rtol=1e-5)


def test_naive_matches_literal_recurrence():
    """Check the reference itself against an explicit per-(b, h) matrix loop."""
    (q, k, v, g, beta), s0 = make_inputs(1, 9, 2, 4, 3, seed=11, with_state=True)
    o, s = naive_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    for h in range(2):
        S = s0[0, h].clone()
        for t in range(9):
            kt = k[0, t, h] / torch.sqrt((k[0, t, h] ** 2).sum() + 1e-6)
            qt = q[0, t, h] / torch.sqrt((q[0, t, h] ** 2).sum() + 1e-6) * 4**-0.5
            S = S * torch.exp(g[0, t, h])
            S = S + torch.outer(kt, beta[0, t, h] * (v[0, t, h] - S.T @ kt))
            assert_close(o[0, t, h], S.T @ qt, atol=1e-5, rtol=1e-5)
        assert_close(s[0, h], S, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_token_decode(l2, dtype):
    (q, k, v, g, beta), s0 = make_inputs(2, 1, 4, 16, 8, Hk=2, seed=37, dtype=dtype, with_state=True)
    s0_copy = s0.clone()
    ref = naive_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=l2)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2)
    assert torch.equal(s0, s0_copy)
    assert o.dtype == dtype and s.dtype == torch.float32
    tol = dict(atol=ATOL, rtol=RTOL) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert_close(o, ref[0], **tol)
    assert_close(s, ref[1], atol=ATOL, rtol=RTOL)
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, use_qk_l2norm_in_kernel=l2)
    assert s2 is None
    ref0 = naive_gated_delta_rule(q, k, v, g, beta, scale=0.3, use_qk_l2norm_in_kernel=l2)
    assert_close(o2, ref0[0], **tol)


def test_bf16_inputs():
    (q, k, v, g, beta), s0 = make_inputs(1, 90, 2, 32, 32, seed=13, dtype=torch.bfloat16, with_state=True)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, **kw)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule, naive_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, **kw)
        assert o.dtype == torch.bfloat16
        assert s.dtype == torch.float32
        assert_close(o.float(), o_ref, atol=3e-2, rtol=2e-2)
        assert_close(s, s_ref, atol=1e-4, rtol=1e-4)  # all math is fp32 internally


@pytest.mark.parametrize("chunk_size", [8, 32])
def test_chunk_states_at_boundaries(chunk_size):
    B, T, H, K, V = 2, 75, 2, 16, 8
    (q, k, v, g, beta), s0 = make_inputs(B, T, H, K, V, seed=17, with_state=True)
    o, cs = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size,
                                               use_qk_l2norm_in_kernel=True)
    N = -(-T // chunk_size)
    assert cs.shape == (B, N, H, K, V) and cs.dtype == torch.float32
    o_ref, _ = naive_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True)
    assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
    assert_close(cs[:, 0], s0)
    for n in range(1, N):
        t = n * chunk_size
        _, s_ref = naive_gated_delta_rule(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], initial_state=s0,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(cs[:, n], s_ref, atol=ATOL, rtol=RTOL)
    # zero initial state when none is given
    _, cs0 = chunk_gated_delta_rule_with_states(q, k, v, g, beta, chunk_size=chunk_size)
    assert torch.count_nonzero(cs0[:, 0]) == 0


def _grads(fn, inputs, s0, **kw):
    leaves = [x.clone().requires_grad_() for x in inputs] + [s0.clone().requires_grad_()]
    o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    w = torch.linspace(-1, 1, o.numel()).view_as(o)
    loss = (o * w).sum() + (s**2).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_gradients_match_naive(fn):
    inputs, s0 = make_inputs(1, 45, 2, 8, 8, Hk=1, seed=19, with_state=True)
    ref = _grads(naive_gated_delta_rule, inputs, s0)
    if fn == "chunk":
        got = _grads(chunk_gated_delta_rule, inputs, s0, chunk_size=16)
    else:
        got = _grads(recurrent_gated_delta_rule, inputs, s0)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape, name
        assert b.abs().max() > 0, name
        assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"grad of {name}: {m}")


def test_gradients_through_chunk_states():
    inputs, s0 = make_inputs(1, 40, 2, 8, 8, seed=23, with_state=True)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, cs = chunk_gated_delta_rule_with_states(*leaves, initial_state=s0, chunk_size=16)
    loss = o.square().sum() + cs[:, 2].sum()
    got = torch.autograd.grad(loss, leaves)
    leaves2 = [x.clone().requires_grad_() for x in inputs]
    o2, _ = naive_gated_delta_rule(*leaves2, initial_state=s0)
    _, s32 = naive_gated_delta_rule(*[x[:, :32] for x in leaves2], initial_state=s0, output_final_state=True)
    ref = torch.autograd.grad(o2.square().sum() + s32.sum(), leaves2)
    for a, b in zip(got, ref):
        assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_decode_steps_chain_like_prefill():
    (q, k, v, g, beta), _ = make_inputs(2, 20, 4, 16, 16, Hk=2, seed=29)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    _, s = chunk_gated_delta_rule(q[:, :12], k[:, :12], v[:, :12], g[:, :12], beta[:, :12], **kw)
    outs = []
    for t in range(12, 20):
        s_before = s.clone()
        o_t, s_new = recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                beta[:, t:t + 1], initial_state=s, **kw)
        assert torch.equal(s, s_before)  # the caller's state is not modified
        s = s_new
        outs.append(o_t)
    assert_close(torch.cat(outs, 1), o_full[:, 12:], atol=ATOL, rtol=RTOL)
    assert_close(s, s_full, atol=ATOL, rtol=RTOL)


def test_non_contiguous_inputs():
    B, T, H, K, V = 1, 33, 2, 8, 8
    (q, k, v, g, beta), s0 = make_inputs(B, T, H, K, V, seed=31, with_state=True)
    # the model produces q/k/v as views of a transposed projection
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1).transpose(1, 2).contiguous().transpose(1, 2)
    qn, kn, vn = torch.split(mixed, [H * K, H * K, H * V], dim=-1)
    qn, kn, vn = qn.reshape(B, T, H, K), kn.reshape(B, T, H, K), vn.reshape(B, T, H, V)
    assert not qn.is_contiguous()
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(qn, kn, vn, g, beta, **kw)
        assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
        assert_close(s, s_ref, atol=ATOL, rtol=RTOL)
    assert_close(s0, s0.clone())


def test_empty_sequence():
    (q, k, v, g, beta), s0 = make_inputs(1, 0, 2, 8, 8, with_state=True)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule, naive_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert o.shape == (1, 0, 2, 8)
        assert_close(s, s0)


# --- transformers' reference implementation ----------------------------------------------------


def _hf():
    mod = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    return mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("shape", [(1, 37, 2, 16, 16, None), (2, 150, 4, 32, 24, 2), (1, 1, 2, 16, 16, None)])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers(shape, with_state):
    hf_chunk, hf_rec = _hf()
    B, T, H, K, V, Hk = shape
    (q, k, v, g, beta), s0 = make_inputs(B, T, H, K, V, Hk, seed=41, normalize_k=False, with_state=with_state)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o_hc, s_hc = hf_chunk(q, k, v, g=g, beta=beta, chunk_size=64, **kw)
        o_hr, s_hr = hf_rec(q, k, v, g=g, beta=beta, **kw)
    # transformers returns [B, T, H, V] in the input dtype and an fp32 state
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o_hc.shape == o_c.shape
    assert_close(o_c, o_hc, atol=ATOL, rtol=RTOL)
    assert_close(s_c, s_hc.float(), atol=ATOL, rtol=RTOL)
    assert_close(o_r, o_hr, atol=ATOL, rtol=RTOL)
    assert_close(s_r, s_hr.float(), atol=ATOL, rtol=RTOL)


def test_matches_transformers_bf16():
    hf_chunk, _ = _hf()
    (q, k, v, g, beta), _ = make_inputs(1, 70, 2, 16, 16, seed=43, dtype=torch.bfloat16, normalize_k=False)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o_h, s_h = hf_chunk(q, k, v, g=g, beta=beta, **kw)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o.dtype == o_h.dtype == torch.bfloat16
    assert_close(o.float(), o_h.float(), atol=1e-2, rtol=1e-2)
    assert_close(s, s_h.float(), atol=ATOL, rtol=RTOL)


# --- CUDA dispatch (no GPU here: exercised with a fake fla) ------------------------------------


class _FakeFla:
    def __init__(self, fail=False):
        self.calls = []
        self.fail = fail

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **extra):
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, extra=extra))
        if self.fail:
            raise RuntimeError("triton exploded")
        B, T, H, V = v.shape
        state = torch.full((B, H, q.shape[-1], V), 7.0, dtype=torch.float64) if output_final_state else None
        return torch.full_like(v, 3.0, dtype=torch.float64), state


@pytest.mark.parametrize("public,fla_name", [
    (chunk_gated_delta_rule, "chunk_gated_delta_rule"),
    (recurrent_gated_delta_rule, "fused_recurrent_gated_delta_rule"),
])
def test_cuda_dispatch_to_fla(monkeypatch, public, fla_name):
    fake = _FakeFla()
    asked = []
    monkeypatch.setattr(gd, "_fla_eligible", lambda x: True)
    monkeypatch.setattr(gd, "_load_fla", lambda name: asked.append(name) or fake)
    (q, k, v, g, beta), s0 = make_inputs(1, 5, 4, 8, 8, Hk=2, with_state=True)
    o, s = public(q, k, v, g, beta, scale=0.5, initial_state=s0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    assert asked == [fla_name]
    (call,) = fake.calls
    assert call["scale"] == 0.5 and call["initial_state"] is s0
    assert call["output_final_state"] is True and call["use_qk_l2norm_in_kernel"] is True
    assert call["v"] is v and call["g"] is g and call["beta"] is beta
    assert call["q"].shape == (1, 5, 4, 8)  # q/k heads expanded to the value heads
    assert o.dtype == v.dtype and torch.all(o == 3)
    assert s.dtype == torch.float32 and torch.all(s == 7)
    o, s = public(q, k, v, g, beta)
    assert s is None


@pytest.mark.parametrize("public", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_cuda_dispatch_fails_loudly_or_falls_back(monkeypatch, public):
    (q, k, v, g, beta), s0 = make_inputs(1, 5, 2, 8, 8, with_state=True)
    kw = dict(initial_state=s0, output_final_state=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    monkeypatch.setattr(gd, "_fla_eligible", lambda x: True)
    # fla installed but its kernel raising -> a loud error naming the kernel and the way out
    monkeypatch.setattr(gd, "_load_fla", lambda name: _FakeFla(fail=True))
    with pytest.raises(RuntimeError, match="CLOVER_GDN_BACKEND=torch"):
        public(q, k, v, g, beta, **kw)
    # fla not importable -> torch path
    monkeypatch.setattr(gd, "_load_fla", lambda name: None)
    o, s = public(q, k, v, g, beta, **kw)
    assert_close(s, s_ref, atol=ATOL, rtol=RTOL)


def test_backend_env_keeps_cuda_on_torch(monkeypatch):
    monkeypatch.setenv("CLOVER_GDN_BACKEND", "torch")
    assert not gd._fla_eligible(torch.empty(0))


def test_cpu_never_consults_fla(monkeypatch):
    def boom(name):
        raise AssertionError("fla looked up for CPU tensors")

    monkeypatch.setattr(gd, "_load_fla", boom)
    (q, k, v, g, beta), _ = make_inputs(1, 4, 2, 8, 8)
    chunk_gated_delta_rule(q, k, v, g, beta)
    recurrent_gated_delta_rule(q, k, v, g, beta)


def test_load_fla_handles_missing_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("fla"):
            raise ImportError("no fla here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(gd, "_FLA_CACHE", {})
    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr("importlib.import_module", lambda name: fake_import(name))
    assert gd._load_fla("chunk_gated_delta_rule") is None


def test_scratch_reuse_across_inference_mode():
    """Scratch buffers made under inference mode must not be reused (and written) outside it."""
    from clover.kernels import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 130, 2, 16, generator=g), torch.randn(1, 130, 2, 16, generator=g)
    v = torch.randn(1, 130, 2, 16, generator=g)
    gate = -torch.rand(1, 130, 2, generator=g)
    beta = torch.rand(1, 130, 2, generator=g)
    with torch.inference_mode():
        a, _ = chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        b, _ = chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shape", [(1, 1, 2, 16, 16, None), (2, 32, 4, 16, 8, 2), (1, 64, 2, 32, 16, None)],
                         ids=lambda s: "B{}T{}H{}K{}V{}Hk{}".format(*s))
@pytest.mark.parametrize("decay", ["model", "strong"])
def test_one_chunk_matches_naive(shape, decay):
    """The compile-friendly single-chunk WY form (static block commits) against the definition."""
    B, T, H, K, V, Hk = shape
    (q, k, v, g, beta), s0 = make_inputs(B, T, H, K, V, Hk, seed=T + 7, with_state=True)
    if decay == "strong":
        g = g * 8.0
        g[:, T // 2 :] -= 60.0  # exp underflows to 0 inside the chunk
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    o, s = one_chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert torch.isfinite(o).all() and o_ref.abs().max() > 1e-3
    assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
    assert_close(s, s_ref, atol=ATOL, rtol=RTOL)
    # zero gates and betas on padded steps leave the state as if they were absent
    n = max(T // 2, 1)
    valid = (torch.arange(T) < n)[None, :, None]
    _, s_pad = one_chunk_gated_delta_rule(q, k, v, g * valid, beta * valid, s0)
    _, s_cut = naive_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], initial_state=s0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(s_pad, s_cut, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("decay", ["model", "strong"])
def test_state_after_any_prefix_from_the_wy_terms(decay):
    """A rollback's state (`state_after`, from a one-chunk commit's WY terms) against the definition
    run over exactly the kept tokens, per row, nothing kept included."""
    from clover.kernels import state_after

    B, T, H, K, V, Hk = 3, 8, 4, 16, 8, 2
    (q, k, v, g, beta), s0 = make_inputs(B, T, H, K, V, Hk, seed=11, with_state=True)
    if decay == "strong":
        g = g * 8.0
        g[:, T // 2 :] -= 60.0
    _, s_all, wy = one_chunk_gated_delta_rule(q, k, v, g, beta, s0, wy=True)
    for keep in ([0, 1, 2], [3, 8, 5], [T, T, T]):
        got = state_after(s0, wy, torch.tensor(keep))
        for b, n in enumerate(keep):
            if n == 0:
                assert_close(got[b], s0[b].float(), atol=0, rtol=0)
                continue
            _, ref = naive_gated_delta_rule(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], g[b : b + 1, :n],
                                            beta[b : b + 1, :n], initial_state=s0[b : b + 1], output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
            assert_close(got[b], ref[0], atol=ATOL, rtol=RTOL)
    assert_close(state_after(s0, wy, torch.tensor([T] * B)), s_all, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("T", [1, 2, 8, 33])
def test_one_chunk_masks_built_once(T):
    """The one-chunk kernel's masks and identity, kept per shape eagerly, are the triangles and the
    identity they stand for, and its results are the same, bit for bit, with the masks kept or new."""
    gd._CHUNK_MASKS.clear()
    above, upper, eye = gd._chunk_masks(T, torch.device("cpu"), torch.float32)
    ones = torch.ones(T, T, dtype=torch.bool)
    assert torch.equal(above, ~ones.tril()) and torch.equal(upper, ~ones.tril(-1)) and torch.equal(eye, torch.eye(T))
    assert gd._chunk_masks(T, torch.device("cpu"), torch.float32)[0] is above
    (q, k, v, g, beta), s0 = make_inputs(2, T, 4, 16, 8, 2, seed=T, with_state=True)
    kept = one_chunk_gated_delta_rule(q, k, v, g, beta, s0, wy=True)
    gd._CHUNK_MASKS.clear()
    new = one_chunk_gated_delta_rule(q, k, v, g, beta, s0, wy=True)
    for a, b in zip((*kept[:2], *kept[2]), (*new[:2], *new[2])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T", [1, 2, 3, 17, 32, 33])
def test_unit_lower_inverse_products(T):
    a = (torch.randn(2, T, T, generator=torch.Generator().manual_seed(T)) * 0.3).tril(-1)
    assert_close(gd._unit_lower_inverse_products(a), torch.linalg.inv(torch.eye(T) + a), atol=1e-5, rtol=1e-5)
