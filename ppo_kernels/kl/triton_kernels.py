"""Triton kernels for kl_penalty (elementwise) and kl_penalized_rewards (one program per row).
The estimator math mirrors csrc/common/kl_stats.h line for line."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import new_output
from .._triton_math import SERIES_BOUND, expm1_minus_x_series


@triton.jit
def _clamp_nan(v, lo, hi):
    return tl.where(v < lo, lo, tl.where(v > hi, hi, v))


@triton.jit
def _passes(v, lo, hi):
    return ((lo == -float("inf")) | (v > lo)) & ((hi == float("inf")) | (v < hi))


@triton.jit
def _estimate(d, in_lo, in_hi, out_lo, out_hi, EST: tl.constexpr, ST: tl.constexpr):
    """(value, d value / d d) of one estimator, as kl_estimate in kl_stats.h."""
    dc = _clamp_nan(d, in_lo, in_hi)
    if EST == 0:
        v = dc
        g = tl.full(d.shape, 1.0, tl.float32)
    elif EST == 1:
        v = tl.abs(dc)
        g = tl.where(dc > 0, 1.0, tl.where(dc < 0, -1.0, 0.0))
    elif EST == 2:
        v = 0.5 * dc * dc
        g = dc
    else:
        v = tl.where(
            tl.abs(-dc) < SERIES_BOUND, expm1_minus_x_series(-dc), (tl.exp(-dc) - 1.0) + dc
        )
        g = dc - v
    g = tl.where(_passes(d, in_lo, in_hi), g, 0.0)
    g = tl.where(_passes(v, out_lo, out_hi), g, 0.0)
    v = _clamp_nan(v, out_lo, out_hi)
    if ST:
        g = d
    return v, g


@triton.jit
def _fwd_kernel(
    LP, REF, OUT, n, in_lo, in_hi, out_lo, out_hi, EST: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < n
    d = tl.load(LP + offs, mask=msk, other=0.0).to(tl.float32) - tl.load(
        REF + offs, mask=msk, other=0.0
    ).to(tl.float32)
    v, g = _estimate(d, in_lo, in_hi, out_lo, out_hi, EST, False)
    tl.store(OUT + offs, v, mask=msk)


@triton.jit
def _bwd_kernel(
    G,
    LP,
    REF,
    GLP,
    GREF,
    n,
    in_lo,
    in_hi,
    out_lo,
    out_hi,
    EST: tl.constexpr,
    ST: tl.constexpr,
    NEED_LP: tl.constexpr,
    NEED_REF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < n
    d = tl.load(LP + offs, mask=msk, other=0.0).to(tl.float32) - tl.load(
        REF + offs, mask=msk, other=0.0
    ).to(tl.float32)
    v, g = _estimate(d, in_lo, in_hi, out_lo, out_hi, EST, ST)
    g = g * tl.load(G + offs, mask=msk, other=0.0).to(tl.float32)
    if NEED_LP:
        tl.store(GLP + offs, g.to(GLP.dtype.element_ty), mask=msk)
    if NEED_REF:
        tl.store(GREF + offs, (-g).to(GREF.dtype.element_ty), mask=msk)


@triton.jit
def _rewards_kernel(
    SC,
    LP,
    REF,
    M,
    BETA,
    R,
    K,
    MEAN,
    T,
    beta_f,
    beta_stride,
    in_lo,
    in_hi,
    out_lo,
    out_hi,
    EST: tl.constexpr,
    HAS_BETA_T: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    # pass 1 (mask only): the last action position, so pass 2 writes every reward exactly once
    last_v = tl.full((BLOCK,), -1, tl.int64)
    for start in range(0, T, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = tl.load(M + base + offs, mask=offs < T, other=0).to(tl.float32)
        last_v = tl.maximum(last_v, tl.where(w != 0.0, offs.to(tl.int64), -1))
    last = tl.max(last_v, 0)
    be = beta_f
    if HAS_BETA_T:
        be = tl.load(BETA + row * beta_stride).to(tl.float32) * beta_f
    score = tl.load(SC + row).to(tl.float32)
    s_v = tl.zeros((BLOCK,), tl.float32)
    c_v = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, T, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < T
        d = tl.load(LP + base + offs, mask=msk, other=0.0).to(tl.float32) - tl.load(
            REF + base + offs, mask=msk, other=0.0
        ).to(tl.float32)
        w = tl.load(M + base + offs, mask=msk, other=0).to(tl.float32)
        act = w != 0.0
        v, g = _estimate(d, in_lo, in_hi, out_lo, out_hi, EST, False)
        v = tl.where(act, v, 0.0)
        wv = tl.where(act, v * w, 0.0)
        r = tl.where(act, -be * wv, 0.0) + tl.where(offs == last, score, 0.0)
        tl.store(K + base + offs, v, mask=msk)
        tl.store(R + base + offs, r, mask=msk)
        s_v += wv
        c_v += w
    s = tl.sum(s_v, 0)
    c = tl.sum(c_v, 0)
    ok = (last >= 0) & (c != 0.0)  # weights summing to 0: mean 0, as a row with no action
    tl.store(MEAN + row, tl.where(ok, s / tl.where(ok, c, 1.0), 0.0))


_BLOCK = 1024


def forward(lp, ref, est, bounds):
    lp, ref = lp.contiguous(), ref.contiguous()
    out = new_output(lp.shape, torch.float32, lp.device)
    n = lp.numel()
    if n:
        _fwd_kernel[(triton.cdiv(n, _BLOCK),)](lp, ref, out, n, *bounds, EST=est, BLOCK=_BLOCK)
    return out


def backward(grad, lp, ref, est, st, bounds, need_lp, need_ref):
    lp, ref = lp.contiguous(), ref.contiguous()
    grad = grad.contiguous()
    glp = new_output(lp.shape, lp.dtype, lp.device) if need_lp else lp.new_empty(0)
    gref = new_output(lp.shape, lp.dtype, lp.device) if need_ref else lp.new_empty(0)
    n = lp.numel()
    if n and (need_lp or need_ref):
        _bwd_kernel[(triton.cdiv(n, _BLOCK),)](
            grad,
            lp,
            ref,
            glp if need_lp else lp,
            gref if need_ref else lp,
            n,
            *bounds,
            EST=est,
            ST=st,
            NEED_LP=need_lp,
            NEED_REF=need_ref,
            BLOCK=_BLOCK,
        )
    return glp, gref


def rewards(scores, lp, ref, mask, beta_t, beta, est, bounds):
    B, T = lp.shape
    lp, ref, mask, scores = (
        lp.contiguous(),
        ref.contiguous(),
        mask.contiguous(),
        scores.contiguous(),
    )
    f32 = dict(dtype=torch.float32, device=lp.device)
    r, k, mean = new_output((B, T), **f32), new_output((B, T), **f32), new_output((B,), **f32)
    if B:
        block = min(triton.next_power_of_2(max(T, 16)), 2048)
        has_bt = beta_t is not None
        bt = beta_t.contiguous() if has_bt else scores
        stride = 1 if has_bt and beta_t.numel() == B and B > 1 else 0
        _rewards_kernel[(B,)](
            scores,
            lp,
            ref,
            mask,
            bt,
            r,
            k,
            mean,
            T,
            float(beta),
            stride,
            *bounds,
            EST=est,
            HAS_BETA_T=has_bt,
            BLOCK=block,
        )
    return r, k, mean
