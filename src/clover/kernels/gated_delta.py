"""Gated Delta Rule kernels (Gated DeltaNet linear attention) in plain torch.

Layout conventions (same as the model code):
    q, k   : [B, T, Hk, K]
    v      : [B, T, H, V]        (H must be a multiple of Hk; each q/k head serves
                                  H // Hk consecutive value heads)
    g      : [B, T, H]           log-decay, expected <= 0
    beta   : [B, T, H]
    state  : [B, H, K, V]        always float32
    output : [B, T, H, V]        in v's dtype

Per (b, h) the state S in R^{K x V} evolves token by token as

    S <- S * exp(g_t)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)

with q, k optionally L2-normalised first (``x * rsqrt(sum(x^2) + 1e-6)``) and
``scale`` defaulting to K ** -0.5.  All arithmetic happens in float32.

Three implementations are provided:

* :func:`naive_gated_delta_rule` -- the literal per-token loop (reference).
* :func:`recurrent_gated_delta_rule` -- per-token loop tuned for decode (T=1).
* :func:`chunk_gated_delta_rule` -- chunked WY form for prefill / training; it
  is built on :func:`chunk_gated_delta_rule_with_states`, which also returns the
  state at every chunk boundary.

On CUDA, when the ``fla`` package can be imported, the public entry points hand
the work to its Triton kernels; anything that goes wrong there falls back to
the torch code.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Optional, Tuple

import torch

__all__ = [
    "naive_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_with_states",
    "one_chunk_gated_delta_rule",
]

_L2_EPS = 1e-6

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def _check_shapes(q, k, v, g, beta):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, Hk, _ = q.shape
    if v.dim() != 4 or v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must be [B, T, H, V] matching q; got {tuple(v.shape)}")
    H = v.shape[2]
    if H % Hk != 0:
        raise ValueError(f"value heads ({H}) must be a multiple of q/k heads ({Hk})")
    if g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(
            f"g and beta must be [B, T, H] = {(B, T, H)}; got {tuple(g.shape)} and {tuple(beta.shape)}"
        )


def _expand_heads(q, k, H):
    """Grouped value heads: repeat each q/k head for its group of value heads."""
    Hk = q.shape[2]
    if Hk != H:
        rep = H // Hk
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    return q, k


def _needs_grad(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------
# optional CUDA dispatch to flash-linear-attention
# ---------------------------------------------------------------------------

_FLA_CACHE: dict = {}


def _load_fla(name: str):
    """Return ``fla.ops.gated_delta_rule.<name>`` or None (import attempted once)."""
    if name not in _FLA_CACHE:
        fn = None
        try:
            import importlib

            mod = importlib.import_module("fla.ops.gated_delta_rule")
            fn = getattr(mod, name, None)
        except Exception:  # not installed, or a broken install (triton missing, ...)
            fn = None
        _FLA_CACHE[name] = fn
    return _FLA_CACHE[name]


def _fla_eligible(x: torch.Tensor) -> bool:
    """The fla kernels are Triton/CUDA only; CLOVER_GDN_BACKEND=torch keeps CUDA on the torch path."""
    return x.is_cuda and os.environ.get("CLOVER_GDN_BACKEND", "auto") != "torch"


def _try_fla(name, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """Run the fla kernel; None when it does not apply (not CUDA, or fla not installed). When fla is
    installed and its kernel fails, that is an error, not a silent switch to a slower path."""
    if not _fla_eligible(q):
        return None
    fn = _load_fla(name)
    if fn is None:
        return None
    # older fla releases want as many q/k heads as value heads: expand (always valid)
    q, k = _expand_heads(q, k, v.shape[2])
    try:
        if initial_state is not None:
            initial_state = initial_state.to(torch.float32)
        o, state = fn(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
    except Exception as e:
        raise RuntimeError(
            f"flash-linear-attention's {name} failed ({type(e).__name__}: {e}) on q {tuple(q.shape)} "
            f"{q.dtype}, v {tuple(v.shape)}; fix the fla install or set CLOVER_GDN_BACKEND=torch to use "
            "clover's torch kernels"
        ) from e
    if o.dtype != v.dtype:
        o = o.to(v.dtype)
    if not output_final_state:
        state = None
    elif state is not None and state.dtype != torch.float32:
        state = state.to(torch.float32)
    return o, state


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Literal token-by-token recurrence (vectorised over batch and heads only)."""
    _check_shapes(q, k, v, g, beta)
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    q, k = _expand_heads(q, k, H)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if scale is None:
        scale = K**-0.5
    q = q * scale
    if initial_state is None:
        S = torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device)
    else:
        S = initial_state.float()
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[:, :, None, None]
        k_t = k[:, t]  # [B, H, K]
        pred = torch.einsum("bhkv,bhk->bhv", S, k_t)
        delta = beta[:, t][:, :, None] * (v[:, t] - pred)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    if T > 0:
        o = torch.stack(outs, dim=1)
    else:
        o = torch.zeros(B, 0, H, V, dtype=torch.float32, device=v.device)
    return o.to(out_dtype), (S if output_final_state else None)


# ---------------------------------------------------------------------------
# recurrent (decode) form
# ---------------------------------------------------------------------------


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-by-token gated delta rule, cheap for T=1 decode steps.

    The caller's ``initial_state`` is never modified.
    """
    _check_shapes(q, k, v, g, beta)
    res = _try_fla(
        "fused_recurrent_gated_delta_rule",
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    )
    if res is not None:
        return res
    if q.shape[1] == 1 and not _needs_grad(q, k, v, g, beta, initial_state):
        return _decode_step(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
    return _recurrent_torch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def _decode_step(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """Single token, no autograd: as few kernel launches and state passes as possible.

    With P = [q; k] S_old (one read of the old state), decay d and beta b:
        delta = b * (v - d * P_k),   o = d * P_q + delta * (k . q),
        S_new = d * S_old + k delta^T.
    """
    B, _, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    BH = B * H
    f32 = torch.float32
    q, k = _expand_heads(q, k, H)
    qk = torch.stack((q.reshape(BH, K), k.reshape(BH, K)), dim=1)  # [BH, 2, K]
    if qk.dtype != f32:
        qk = qk.to(f32)
    if use_qk_l2norm_in_kernel:
        qk = qk * torch.rsqrt(qk.square().sum(-1, keepdim=True).add_(_L2_EPS))
    qk[:, 0].mul_(K**-0.5 if scale is None else scale)
    if initial_state is None:
        S0 = torch.zeros(BH, K, V, dtype=f32, device=v.device)
    else:
        S0 = initial_state.reshape(BH, K, V)
        if S0.dtype != f32:
            S0 = S0.to(f32)
    d = g.reshape(BH, 1).to(f32).exp()
    b = beta.reshape(BH, 1).to(f32)
    P = torch.bmm(qk, S0)  # [BH, 2, V]
    kq = torch.bmm(qk, qk.transpose(1, 2))[:, 0, 1:]  # [BH, 1] = q . k
    delta = (P[:, 1] * d).neg_().add_(v.reshape(BH, V)).mul_(b)
    o = (P[:, 0] * d).addcmul_(delta, kq)
    final = None
    if output_final_state:
        final = (S0 * d.unsqueeze(-1)).baddbmm_(qk[:, 1].unsqueeze(2), delta.unsqueeze(1))
        final = final.view(B, H, K, V)
    return o.view(B, 1, H, V).to(v.dtype), final


def _recurrent_torch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    BH = B * H
    f32 = torch.float32
    dev = v.device
    inplace = not _needs_grad(q, k, v, g, beta, initial_state)
    q, k = _expand_heads(q, k, H)

    # time-major, (batch*head)-flattened float32 views; for T=1 and fp32 inputs
    # these are views, not copies
    def tm(x, d):
        return x.transpose(0, 1).reshape(T, BH, d).to(f32)

    qf, kf, vf = tm(q, K), tm(k, K), tm(v, V)
    if scale is None:
        scale = K**-0.5
    if use_qk_l2norm_in_kernel:
        qf = qf * (torch.rsqrt((qf * qf).sum(-1, keepdim=True) + _L2_EPS) * scale)
        kf = _l2norm(kf)
    else:
        qf = qf * scale
    decay = g.transpose(0, 1).reshape(T, BH).to(f32).exp()  # [T, BH]
    bf = beta.transpose(0, 1).reshape(T, BH).to(f32)

    if initial_state is None:
        S = torch.zeros(BH, K, V, dtype=f32, device=dev)
    else:
        S = initial_state.reshape(BH, K, V).to(f32)

    if inplace:
        # One read of the old state per token: with P = [q; k] S_old,
        #   S^T k after decay = d * P_k,   delta = beta * (v - d * P_k)
        #   o = S_new^T q = d * P_q + delta * (k . q)
        # then S_new = d * S_old + k delta^T (written in place after step 0).
        qk = torch.stack([qf, kf], dim=2)  # [T, BH, 2, K]
        kq = (qf * kf).sum(-1, keepdim=True)  # [T, BH, 1]
        dcol = decay.unsqueeze(-1)  # [T, BH, 1]
        bcol = bf.unsqueeze(-1)
        out = torch.empty(T, BH, V, dtype=f32, device=dev)
        P = torch.empty(BH, 2, V, dtype=f32, device=dev)
        for t in range(T):
            torch.bmm(qk[t], S, out=P)
            delta = torch.mul(P[:, 1], dcol[t]).neg_().add_(vf[t]).mul_(bcol[t])  # [BH, V]
            torch.mul(P[:, 0], dcol[t], out=out[t]).addcmul_(delta, kq[t])
            # the first multiply allocates a fresh state, so the caller's
            # initial_state is never modified
            S = S * dcol[t].unsqueeze(-1) if t == 0 else S.mul_(dcol[t].unsqueeze(-1))
            S.baddbmm_(kf[t].unsqueeze(2), delta.unsqueeze(1))  # rank-1 update
        if T == 0 and initial_state is not None:
            S = S.clone()
        o = out.view(T, B, H, V).transpose(0, 1)
    else:
        outs = []
        for t in range(T):
            k_t = kf[t]
            S = S * decay[t].view(BH, 1, 1)
            pred = torch.bmm(k_t.unsqueeze(1), S)
            delta = (vf[t].unsqueeze(1) - pred) * bf[t].view(BH, 1, 1)
            S = torch.baddbmm(S, k_t.unsqueeze(2), delta)
            outs.append(torch.bmm(qf[t].unsqueeze(1), S))
        if T > 0:
            o = torch.stack(outs, 0).view(T, B, H, V).transpose(0, 1)
        else:
            o = torch.zeros(B, 0, H, V, dtype=f32, device=dev)
    o = o.to(v.dtype).contiguous()
    final = S.view(B, H, K, V) if output_final_state else None
    return o, final


# ---------------------------------------------------------------------------
# chunked (WY) form
# ---------------------------------------------------------------------------


# Chunk-major layout used below: a slab of ``nc`` chunks of the sequence is held
# as float32 [nc, B, H, C, D], viewed as a batch of nc*B*H matrices [C, D]
# (batch index = n*B*H + b*H + h).
#
# The sequence is processed slab by slab (a few hundred tokens at a time): every
# intermediate stays small, so it is reused from the allocator between slabs and
# stays in cache, which matters more on a small shared CPU than the flop count.

_SLAB_ROWS = 4096  # target number of (token, head) rows per slab


def _fill_chunks(dst: torch.Tensor, x: torch.Tensor) -> None:
    """Copy x [B, L, H, D] into dst [nc, B, H, C, D] (L <= nc*C), converting dtype.

    Positions past L are left untouched (the caller zero-fills them)."""
    nc, B, H, C, D = dst.shape
    L = x.shape[1]
    view = dst.permute(1, 0, 3, 2, 4)  # [B, nc, C, H, D]
    full = min(nc, L // C)
    if full:
        view[:, :full].copy_(x[:, : full * C].reshape(B, full, C, H, D))
    rest = L - full * C
    if rest:
        view[:, full, :rest].copy_(x[:, full * C :])


class _Workspace:
    """Scratch buffers reused from slab to slab (inference path only).

    Fresh multi-megabyte allocations are costly on small VMs (the pages are
    faulted in on first touch), so every per-slab temporary is carved from a
    buffer allocated for the first slab.  With ``None`` in place of a
    workspace, plain allocations are used (needed under autograd)."""

    def __init__(self, device):
        self.device = device
        self.bufs = {}

    def get(self, name, shape):
        n = math.prod(shape)
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=torch.float32, device=self.device)
            self.bufs[name] = buf
        return buf[:n].view(shape)


_WS_LOCAL = threading.local()
_WS_KEEP_BYTES = 96 * 2**20  # keep a thread's scratch between calls up to this size


def _workspace(device) -> _Workspace:
    """Per-thread, per-device scratch kept between calls (layers reuse it)."""
    cache = getattr(_WS_LOCAL, "cache", None)
    if cache is None:
        cache = _WS_LOCAL.cache = {}
    # buffers made under inference mode are inference tensors and cannot be written outside it
    key = (str(device), torch.is_inference_mode_enabled())
    ws = cache.pop(key, None) or _Workspace(device)  # popped: a nested call gets its own
    ws.key = key
    return ws


def _release_workspace(ws: _Workspace) -> None:
    if sum(b.numel() * b.element_size() for b in ws.bufs.values()) <= _WS_KEEP_BYTES:
        _WS_LOCAL.cache[ws.key] = ws


def _slab(x: torch.Tensor, t0: int, t1: int, nc: int, C: int, ws=None, name="") -> torch.Tensor:
    """x[:, t0:t1] ([B, L, H, D]) -> float32 [nc*B*H, C, D], zero padded."""
    B, _, H, D = x.shape
    shape = (nc, B, H, C, D)
    padded = t1 - t0 != nc * C
    if ws is not None:
        buf = ws.get(name, shape)
        if padded:
            buf.zero_()
    elif padded:
        buf = torch.zeros(shape, dtype=torch.float32, device=x.device)
    else:
        buf = torch.empty(shape, dtype=torch.float32, device=x.device)
    _fill_chunks(buf, x[:, t0:t1])
    return buf.view(nc * B * H, C, D)


def _bmm(a, b, out=None):
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)


def _mul(a, b, out=None):
    return torch.mul(a, b) if out is None else torch.mul(a, b, out=out)


def _unit_lower_inverse(a: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(I + strictly_lower(a))^{-1} for a batch [n, C, C] (written to ``out`` if given).

    The diagonal and upper triangle of ``a`` are ignored.  Blocks larger than 16
    are split in two: both diagonal blocks are inverted in one batched call and
    the off-diagonal block comes from two small matmuls, which on CPU beats one
    big triangular solve against the identity.
    """
    n, C, _ = a.shape
    h = C // 2
    if C <= 16 or C != 2 * h:
        eye = torch.eye(C, dtype=a.dtype, device=a.device).expand(n, C, C)
        if out is None:
            return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True, out=out)
    diag = _unit_lower_inverse(torch.cat([a[:, :h, :h], a[:, h:, h:]], 0))
    x11, x22 = diag[:n], diag[n:]
    x21 = torch.bmm(torch.bmm(x22, a[:, h:, :h]), x11)
    if out is None:
        top = torch.cat([x11, torch.zeros_like(x11)], dim=2)
        bottom = torch.cat([-x21, x22], dim=2)
        return torch.cat([top, bottom], dim=1)
    out[:, :h, :h].copy_(x11)
    out[:, :h, h:].zero_()
    out[:, h:, :h].copy_(x21).neg_()
    out[:, h:, h:].copy_(x22)
    return out


def _chunk_core(q, k, v, g, beta, scale, initial_state, chunk_size, use_qk_l2norm_in_kernel, keep_states):
    """Shared chunked computation.

    Returns ``(o, final_state, states)``: o [B, T, H, V] in v.dtype, final state
    [B*H, K, V] float32, and (only when keep_states) float32 [N, B*H, K, V] with
    states[n] the state before chunk n.
    """
    _check_shapes(q, k, v, g, beta)
    if chunk_size < 1:
        raise ValueError("chunk_size must be a positive integer")
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    BH = B * H
    f32 = torch.float32
    dev = v.device
    C = int(chunk_size)
    grad = _needs_grad(q, k, v, g, beta, initial_state)
    q, k = _expand_heads(q, k, H)
    if scale is None:
        scale = K**-0.5

    if initial_state is None:
        S = torch.zeros(BH, K, V, dtype=f32, device=dev)
    else:
        S = initial_state.reshape(BH, K, V).to(f32)
    if T == 0:
        states = S.unsqueeze(0)[:0] if keep_states else None
        return v.new_zeros(B, 0, H, V), (S if grad else S.clone()), states

    N = -(-T // C)
    # gates for the whole sequence (small): inclusive cumulative log decay within each chunk
    gb = torch.zeros((N, B, H, C, 2), dtype=f32, device=dev)
    _fill_chunks(gb[..., 0:1], g.unsqueeze(-1))
    _fill_chunks(gb[..., 1:2], beta.unsqueeze(-1))
    gc_all = gb[..., 0].reshape(N * BH, C).cumsum(-1)
    bc_all = gb[..., 1].reshape(N * BH, C)
    upper = torch.ones(C, C, dtype=torch.bool, device=dev).triu_(1)

    per_slab = max(1, _SLAB_ROWS // (BH * C))
    states = work = None
    ws = None if grad else _workspace(dev)
    if grad:
        o_parts, st_parts = [], []
        states = None
        out = None
    else:
        out = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
        if keep_states:
            states = torch.empty(N + 1, BH, K, V, dtype=f32, device=dev)
            states[0].copy_(S)
        else:
            work = ws.get("work", (min(per_slab, N) + 1, BH, K, V))
            work[0].copy_(S)

    for n0 in range(0, N, per_slab):
        n1 = min(N, n0 + per_slab)
        nc = n1 - n0
        NB = nc * BH
        t0, t1 = n0 * C, min(T, n1 * C)
        qc = _slab(q, t0, t1, nc, C, ws, "q")
        kc = _slab(k, t0, t1, nc, C, ws, "k")
        vc = _slab(v, t0, t1, nc, C, ws, "v")

        def scratch(name, shape):
            return None if ws is None else ws.get(name, shape)

        gc = gc_all[n0 * BH : n1 * BH]
        bc = bc_all[n0 * BH : n1 * BH]

        # Per-row factors: normalisation and scale are folded into [NB, C]
        # vectors rather than applied to the [NB, C, K] tensors.
        if use_qk_l2norm_in_kernel:
            rq = torch.rsqrt(torch.linalg.vector_norm(qc, dim=-1).square() + _L2_EPS) * scale
            rk = torch.rsqrt(torch.linalg.vector_norm(kc, dim=-1).square() + _L2_EPS)
            a_row = bc * rk
        else:
            rq = rk = None
            a_row = bc

        # decay between positions j <= i of a chunk, exp(gc_i - gc_j); zero above the diagonal
        dmat = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()
        if rk is not None:
            dmat = dmat * rk.unsqueeze(-2)  # column factor rk_j, shared by both products
        kt = kc.transpose(-1, -2)
        amat = _bmm(kc, kt, scratch("amat", (NB, C, C)))  # strictly-lower part: A of the unit-triangular system
        attn = _bmm(qc, kt, scratch("attn", (NB, C, C)))  # intra-chunk attention (lower triangle incl. diagonal)
        if grad:
            amat = amat * dmat * a_row.unsqueeze(-1)
            attn = attn * dmat * (rq.unsqueeze(-1) if rq is not None else scale)
        else:
            amat.mul_(dmat).mul_(a_row.unsqueeze(-1))
            attn.mul_(dmat).mul_(rq.unsqueeze(-1) if rq is not None else scale)

        # Tinv = (I + A)^{-1};  U0 = Tinv diag(beta) v ;  W = Tinv diag(beta * gamma * rk) k
        tinv = _unit_lower_inverse(amat, scratch("tinv", (NB, C, C)))
        gamma = gc.exp()
        tb = scratch("tb", (NB, C, C))
        u0 = _bmm(_mul(tinv, bc.unsqueeze(-2), tb), vc, scratch("u", (NB, C, V)))
        w = _bmm(_mul(tinv, (a_row * gamma).unsqueeze(-2), tb), kc, scratch("w", (NB, C, K)))

        # keys decayed to the end of their chunk, queries decayed from its start
        gl = gc[:, -1:]
        kfac = (gl - gc).exp_()
        if rk is not None:
            kfac = kfac * rk
        qfac = gamma * rq if rq is not None else gamma * scale
        if grad:
            kdec = kc * kfac.unsqueeze(-1)
            qdec = qc * qfac.unsqueeze(-1)
        else:
            kdec = kc.mul_(kfac.unsqueeze(-1))  # kc / qc are no longer needed as such
            qdec = qc.mul_(qfac.unsqueeze(-1))
        chunk_decay = gl.exp().view(nc, BH, 1, 1)
        u0 = u0.view(nc, BH, C, V)
        w = w.view(nc, BH, C, K)
        kdec_t = kdec.view(nc, BH, C, K).transpose(-1, -2)

        # sequential part: U_n = U0_n - W_n S_n ;  S_{n+1} = exp(gl_n) S_n + Kdec_n^T U_n
        if grad:
            sts, us = [], []
            for i in range(nc):
                sts.append(S)
                u = torch.baddbmm(u0[i], w[i], S, alpha=-1.0)
                S = torch.baddbmm(S * chunk_decay[i], kdec_t[i], u)
                us.append(u)
            st = torch.stack(sts, 0)
            u_all = torch.stack(us, 0)
            if keep_states:
                st_parts.append(st)
        else:
            st_full = states[n0 : n1 + 1] if keep_states else work[: nc + 1]
            u_all = u0  # overwritten in place with U_n
            for i in range(nc):
                u_all[i].baddbmm_(w[i], st_full[i], alpha=-1.0)
                torch.mul(st_full[i], chunk_decay[i], out=st_full[i + 1]).baddbmm_(kdec_t[i], u_all[i])
            st = st_full[:nc]
            S = st_full[nc]

        # outputs for the whole slab: o = Qdec S_n + attn U_n
        if grad:
            o = torch.baddbmm(torch.bmm(attn, u_all.view(NB, C, V)), qdec, st.reshape(NB, K, V))
        else:
            o = torch.bmm(attn, u_all.view(NB, C, V), out=scratch("o", (NB, C, V)))
            o.baddbmm_(qdec, st.reshape(NB, K, V))
        o = o.view(nc, B, H, C, V)
        if grad:
            o_parts.append(o.permute(1, 0, 3, 2, 4).reshape(B, nc * C, H, V))
        else:
            L = t1 - t0
            ov = o.permute(1, 0, 3, 2, 4)  # [B, nc, C, H, V]
            full = L // C
            dst = out[:, t0:t1]
            if full:
                dst[:, : full * C].view(B, full, C, H, V).copy_(ov[:, :full])
            if L - full * C:
                dst[:, full * C :].copy_(ov[:, full, : L - full * C])
            if not keep_states and n1 < N:
                work[0].copy_(S)  # carry the state into the next slab's buffer

    if grad:
        out = torch.cat(o_parts, 1)[:, :T].to(v.dtype).contiguous()
        states = torch.cat(st_parts, 0) if keep_states else None
    elif keep_states:
        states = states[:N]
    else:
        S = S.clone()  # do not hand out a view of the scratch buffer
    if ws is not None:
        _release_workspace(ws)
    return out, S, states


def chunk_gated_delta_rule_with_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule that also returns every chunk-boundary state.

    Returns ``(o, chunk_states)``: o is [B, T, H, V] in v's dtype and
    chunk_states is float32 [B, N, H, K, V], N = ceil(T / chunk_size), where
    ``chunk_states[:, n]`` is the state *before* chunk n (i.e. after token
    n*chunk_size - 1); ``chunk_states[:, 0]`` is the initial state (or zeros).
    Always runs the torch path (differentiable).  The returned tensor is a
    permuted view of a [N, B, H, K, V] buffer; call .contiguous() if needed.
    """
    o, _, states = _chunk_core(
        q, k, v, g, beta, scale, initial_state, chunk_size, use_qk_l2norm_in_kernel, keep_states=True
    )
    B, _, H, V = v.shape
    K = q.shape[-1]
    N = states.shape[0]
    return o, states.reshape(N, B, H, K, V).permute(1, 0, 2, 3, 4)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked (WY representation) gated delta rule for prefill and training.

    Returns ``(o, final_state)``; final_state is float32 [B, H, K, V] or None.
    ``chunk_size`` only affects speed and rounding on the torch path.
    """
    _check_shapes(q, k, v, g, beta)
    res = _try_fla(
        "chunk_gated_delta_rule",
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    )
    if res is not None:
        return res
    T = q.shape[1]
    # a sequence shorter than one chunk needs no padding: one chunk of length T
    cs = min(int(chunk_size), T) if T > 0 else int(chunk_size)
    o, S, _ = _chunk_core(
        q, k, v, g, beta, scale, initial_state, cs, use_qk_l2norm_in_kernel, keep_states=False
    )
    if not output_final_state:
        return o, None
    B, _, H, V = v.shape
    return o, S.reshape(B, H, q.shape[-1], V)


_CHUNK_MASKS: dict = {}


def _chunk_masks(T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a chunk of T tokens: (above, diagonal and above) as bool [T, T] and the identity [T, T] of
    `dtype`, built once per shape and device eagerly (~7 ops per GDN layer of a verify otherwise); a
    compiled graph builds them in the graph."""
    key = (T, device, dtype)
    eager = not torch.compiler.is_compiling()
    masks = _CHUNK_MASKS.get(key) if eager else None
    if masks is None:
        upper = torch.ones(T, T, dtype=torch.bool, device=device).triu()
        masks = (upper.triu(1), upper, torch.eye(T, dtype=dtype, device=device))
        if eager:
            _CHUNK_MASKS[key] = masks
    return masks


def _unit_lower_inverse_products(a: torch.Tensor, eye: torch.Tensor | None = None) -> torch.Tensor:
    """(I + a)^-1 for strictly lower triangular a [..., T, T], as matmuls only (a compiled graph
    calls no triangular solve): a is nilpotent, so (I + a)^-1 = sum_i (-a)^i
    = (I - a)(I + a^2)(I + a^4)...(I + a^(2^m)) with 2^(m+1) >= T. `eye`: the identity, if at hand."""
    if eye is None:
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    inv = eye - a
    power, span = a, 2
    while span < a.shape[-1]:
        power = power @ power
        inv = inv + inv @ power
        span *= 2
    return inv


def one_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: Optional[float] = None,
    wy: bool = False,
):
    """The WY form over the whole input as one chunk, with q/k L2-normalised: plain allocations, no
    workspace, no ``out=`` and no host read, so that a compiled graph can hold it whole
    (`clover.models.static`: a block commit of up to a few dozen tokens), and fewer ops than the
    chunked kernel for a short input eagerly (a speculative verify's commit). Same arguments and
    results as ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True, output_final_state=True)``
    with ``chunk_size >= T``; tested against the recurrence. ``wy``: also (k, c, v') below, from which
    `state_after` gives the state after any prefix without running the recurrence again.

    Per (row, head), with c = cumsum(g) and A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j) for j < i:
        T = (I + A)^-1 (`_unit_lower_inverse_products`),  W = T (beta exp(c) k),  U = T (beta v),  v' = U - W S,
        o = exp(c) q S + tril(q k^T exp(c_i - c_j)) v',  S' = exp(c_T) S + (exp(c_T - c) k)^T v'.
    """
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    f32 = torch.float32
    q, k = _expand_heads(q, k, H)
    scale = K**-0.5 if scale is None else scale

    def heads(x):  # [B, T, H, D] -> [B, H, T, D] float32
        return x.transpose(1, 2).to(f32)

    qf, kf, vf = _l2norm(heads(q)) * scale, _l2norm(heads(k)), heads(v)
    c = g.transpose(1, 2).to(f32).cumsum(-1)  # [B, H, T]
    b = beta.transpose(1, 2).to(f32)[..., None]  # [B, H, T, 1]
    decay = c[..., :, None] - c[..., None, :]  # [B, H, T, T]: c_i - c_j
    above, upper, eye = _chunk_masks(T, q.device, f32)
    gamma = decay.masked_fill(above, float("-inf")).exp()  # 0 above the diagonal
    A = (b * (kf @ kf.transpose(-1, -2)) * gamma).masked_fill(upper, 0.0)
    Tinv = _unit_lower_inverse_products(A, eye)
    S = initial_state.to(f32)  # [B, H, K, V]
    ec = c.exp()[..., None]
    w = Tinv @ (b * ec * kf)
    u = Tinv @ (b * vf)
    v_new = u - w @ S
    o = (qf * ec) @ S + ((qf @ kf.transpose(-1, -2)) * gamma) @ v_new
    last = c[..., -1:]  # [B, H, 1]
    S_new = S * last.exp()[..., None] + (kf * (last - c).exp()[..., None]).transpose(-1, -2) @ v_new
    if wy:
        return o.transpose(1, 2).to(v.dtype), S_new, (kf, c, v_new)
    return o.transpose(1, 2).to(v.dtype), S_new


def state_after(initial_state: torch.Tensor, wy: tuple, keep: torch.Tensor) -> torch.Tensor:
    """The state after the first `keep[b]` tokens of a chunk (0: `initial_state`), from the chunk's WY
    terms (`one_chunk_gated_delta_rule(..., wy=True)`: k [B, H, T, K], c [B, H, T], v' [B, H, T, V]):
    S_m = exp(c_m) S + sum_{j <= m} exp(c_m - c_j) k_j v'_j^T (v'_j depends on no later token), a
    dozen ops where running the recurrence again over m tokens is ~25 per token."""
    kf, c, v_new = wy
    T = c.shape[-1]
    last = (keep - 1).clamp_min(0)[:, None, None].expand(c.shape[0], c.shape[1], 1)
    kept = (torch.arange(T, device=c.device)[None, :] < keep[:, None])[:, None, :]  # [B, 1, T]
    c_m = torch.where(kept[..., :1], c.gather(-1, last), 0.0)  # [B, H, 1]
    w = torch.where(kept, (c_m - c).exp(), 0.0)  # [B, H, T]
    return initial_state.float() * c_m.exp()[..., None] + (kf * w[..., None]).transpose(-1, -2) @ v_new
