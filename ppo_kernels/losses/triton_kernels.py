"""Triton kernels for the PPO policy / value losses (the GPU backend).

Forward: one program per (row, chunk of BLOCK tokens) computes the per-token loss and writes the
chunk's partial sums (masked loss, mask, 6 per-token statistics); one single-program combine
kernel turns them into the per-row aggregation weights, the loss and the statistics (in float64,
deterministic, no atomics, no host sync; the policy loss adds TRL's clip region and the per-row
min / max of its clip fractions). Backward: one program per (row, chunk) recomputes the per-token
gradient and scales it by grad_loss * row_coef[row] * mask. The per-token math mirrors
csrc/common/loss_math.h (torch's tie rules included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import new_output

N_PARTIALS = 8


@triton.jit
def _max_w(a, b):
    """d max(a, b) / da under torch's rule (1, 0, or 1/2 at a tie)."""
    return tl.where(a > b, 1.0, tl.where(a < b, 0.0, 0.5))


@triton.jit
def _policy_tok(lp, old, adv, lo, hi, dual_c, lrc, DUAL: tl.constexpr):
    d = lp - old
    dc = tl.where(d < -lrc, -lrc, tl.where(d > lrc, lrc, d))
    r = tl.exp(dc)
    rc = tl.where(r < lo, lo, tl.where(r > hi, hi, r))
    pg1 = -adv * r
    pg2 = -adv * rc
    clip1 = tl.where((pg1 != pg1) | (pg1 > pg2), pg1, pg2)
    w1 = _max_w(pg1, pg2)
    in_clip = tl.where((r > lo) & (r < hi), 1.0, 0.0)
    g = -adv * (w1 + (1.0 - w1) * in_clip)
    loss = clip1
    clipped = tl.where(pg2 > pg1, 1.0, 0.0)
    clipped_lo = tl.zeros_like(clipped)
    if DUAL:
        neg = adv < 0
        pg3 = -adv * dual_c
        clipped_lo = tl.where(neg & (clip1 > pg3), 1.0, 0.0)
        loss = tl.where(neg, tl.where((clip1 != clip1) | (clip1 < pg3), clip1, pg3), clip1)
        g = tl.where(neg, g * _max_w(pg3, clip1), g)
    g = tl.where((d > -lrc) & (d < lrc), g * r, 0.0)
    # TRL's clip indicators (exclusive by the sign of A)
    low = tl.where((r < lo) & (adv < 0), 1.0, 0.0)
    high = tl.where((r > hi) & (adv > 0), 1.0, 0.0)
    return loss, g, clipped, clipped_lo, -dc, r, low, high


@triton.jit
def _value_tok(v, vo, ret, clip, CLIP: tl.constexpr):
    e1 = v - ret
    l1 = e1 * e1
    if CLIP:
        hi = vo + clip
        lo = vo - clip
        mn = tl.where((v != v) | (v < hi), v, hi)
        vc = tl.where((mn != mn) | (mn > lo), mn, lo)
        dvc = (1.0 - _max_w(v, hi)) * _max_w(mn, lo)
        e2 = vc - ret
        l2 = e2 * e2
        w1 = _max_w(l1, l2)
        loss = 0.5 * tl.where((l1 != l1) | (l1 > l2), l1, l2)
        g = w1 * e1 + (1.0 - w1) * e2 * dvc
        clipped = tl.where(l2 > l1, 1.0, 0.0)
    else:
        loss = 0.5 * l1
        g = e1
        clipped = tl.zeros_like(l1)
    return loss, g, clipped


@triton.jit
def _token(a, b, c, p0, p1, p2, p3, KIND: tl.constexpr, FLAG: tl.constexpr):
    if KIND == 0:
        loss, g, s0, s1, s2, s3, s4, s5 = _policy_tok(a, b, c, p0, p1, p2, p3, FLAG)
    else:
        loss, g, s0 = _value_tok(a, b, c, p0, FLAG)
        s1 = tl.zeros_like(s0)
        s2 = tl.zeros_like(s0)
        s3 = tl.zeros_like(s0)
        s4 = tl.zeros_like(s0)
        s5 = tl.zeros_like(s0)
    return loss, g, s0, s1, s2, s3, s4, s5


@triton.jit
def _fwd_partials_kernel(
    X,
    Y,
    Z,
    M,
    P,
    T,
    nch,
    p0,
    p1,
    p2,
    p3,
    KIND: tl.constexpr,
    FLAG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1).to(tl.int64)
    offs = ch * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    idx = row * T + offs
    m = tl.load(M + idx, mask=inb, other=0).to(tl.float32)
    keep = m != 0  # masked positions never contribute, even if their inputs are NaN
    a = tl.load(X + idx, mask=inb, other=0.0).to(tl.float32)
    b = tl.load(Y + idx, mask=inb, other=0.0).to(tl.float32)
    c = tl.load(Z + idx, mask=inb, other=0.0).to(tl.float32)
    loss, g, s0, s1, s2, s3, s4, s5 = _token(a, b, c, p0, p1, p2, p3, KIND, FLAG)
    out = P + (row * nch + ch) * 8
    tl.store(out + 0, tl.sum(tl.where(keep, m * loss, 0.0), 0))
    tl.store(out + 1, tl.sum(m, 0))
    tl.store(out + 2, tl.sum(tl.where(keep, m * s0, 0.0), 0))
    tl.store(out + 3, tl.sum(tl.where(keep, m * s1, 0.0), 0))
    tl.store(out + 4, tl.sum(tl.where(keep, m * s2, 0.0), 0))
    tl.store(out + 5, tl.sum(tl.where(keep, m * s3, 0.0), 0))
    tl.store(out + 6, tl.sum(tl.where(keep, m * s4, 0.0), 0))
    tl.store(out + 7, tl.sum(tl.where(keep, m * s5, 0.0), 0))


@triton.jit
def _combine_kernel(
    P,
    COEF,
    LOSS,
    STATS,
    GDEN,
    B,
    nch,
    scale,
    gden_value,
    AGG: tl.constexpr,
    HAS_GDEN: tl.constexpr,
    N_STATS: tl.constexpr,
    RB: tl.constexpr,
):
    lanes = tl.arange(0, RB)
    n_tot = tl.zeros([RB], dtype=tl.float64)
    n_seq = tl.zeros([RB], dtype=tl.float64)
    s0 = tl.zeros([RB], dtype=tl.float64)
    s1 = tl.zeros([RB], dtype=tl.float64)
    s2 = tl.zeros([RB], dtype=tl.float64)
    s3 = tl.zeros([RB], dtype=tl.float64)
    s4 = tl.zeros([RB], dtype=tl.float64)
    s5 = tl.zeros([RB], dtype=tl.float64)
    low_min = tl.full([RB], float("inf"), dtype=tl.float64)  # over the rows with a token
    high_max = tl.full([RB], float("-inf"), dtype=tl.float64)
    for r0 in range(0, B, RB):
        rows = (r0 + lanes).to(tl.int64)
        rin = rows < B
        rn = tl.zeros([RB], dtype=tl.float64)
        rlow = tl.zeros([RB], dtype=tl.float64)
        rhigh = tl.zeros([RB], dtype=tl.float64)
        for c in range(0, nch):
            base = P + (rows * nch + c) * 8
            rn += tl.load(base + 1, mask=rin, other=0.0).to(tl.float64)
            s0 += tl.load(base + 2, mask=rin, other=0.0).to(tl.float64)
            s1 += tl.load(base + 3, mask=rin, other=0.0).to(tl.float64)
            s2 += tl.load(base + 4, mask=rin, other=0.0).to(tl.float64)
            s3 += tl.load(base + 5, mask=rin, other=0.0).to(tl.float64)
            rlow += tl.load(base + 6, mask=rin, other=0.0).to(tl.float64)
            rhigh += tl.load(base + 7, mask=rin, other=0.0).to(tl.float64)
        s4 += rlow
        s5 += rhigh
        has = rn > 0
        safe = tl.where(has, rn, 1.0)
        low_min = tl.minimum(low_min, tl.where(has, rlow / safe, float("inf")))
        high_max = tl.maximum(high_max, tl.where(has, rhigh / safe, float("-inf")))
        n_tot += rn
        n_seq += tl.where(rn > 0, 1.0, 0.0).to(tl.float64)
    n_total = tl.sum(n_tot, 0)
    if HAS_GDEN:
        denom = tl.load(GDEN).to(tl.float64)
    elif gden_value >= 0:
        denom = tl.zeros([], dtype=tl.float64) + gden_value
    elif AGG == 0:
        denom = n_total
    else:
        denom = tl.sum(n_seq, 0)
    per = tl.where(denom != 0, scale / tl.where(denom != 0, denom, 1.0), 0.0)
    total = tl.zeros([RB], dtype=tl.float64)
    for r0 in range(0, B, RB):
        rows = (r0 + lanes).to(tl.int64)
        rin = rows < B
        rn = tl.zeros([RB], dtype=tl.float64)
        rl = tl.zeros([RB], dtype=tl.float64)
        for c in range(0, nch):
            base = P + (rows * nch + c) * 8
            rl += tl.load(base + 0, mask=rin, other=0.0).to(tl.float64)
            rn += tl.load(base + 1, mask=rin, other=0.0).to(tl.float64)
        if AGG == 0:
            coef = per + tl.zeros([RB], dtype=tl.float64)
        elif AGG == 2:
            coef = tl.where(rn > 0, per / tl.where(rn > 0, rn, 1.0), 0.0)
        else:
            coef = tl.where(rn > 0, per, 0.0)
        tl.store(COEF + rows, coef.to(tl.float32), mask=rin)
        total += tl.where(rin, coef * rl, 0.0)
    tl.store(LOSS, tl.sum(total, 0).to(tl.float32))
    inv = tl.where(n_total != 0, 1.0 / tl.where(n_total != 0, n_total, 1.0), 0.0)
    tl.store(STATS + 0, (tl.sum(s0, 0) * inv).to(tl.float32))
    if N_STATS > 1:
        tl.store(STATS + 1, (tl.sum(s1, 0) * inv).to(tl.float32))
        tl.store(STATS + 2, (tl.sum(s2, 0) * inv).to(tl.float32))
        tl.store(STATS + 3, (tl.sum(s3, 0) * inv).to(tl.float32))
    if N_STATS > 4:  # TRL's: low, high, region means; min / max row fractions (NaN: no row)
        tl.store(STATS + 4, (tl.sum(s4, 0) * inv).to(tl.float32))
        tl.store(STATS + 5, (tl.sum(s5, 0) * inv).to(tl.float32))
        tl.store(STATS + 6, ((tl.sum(s4, 0) + tl.sum(s5, 0)) * inv).to(tl.float32))
        lo_min = tl.min(low_min, 0)
        hi_max = tl.max(high_max, 0)
        tl.store(STATS + 7, tl.where(lo_min == float("inf"), float("nan"), lo_min).to(tl.float32))
        tl.store(STATS + 8, tl.where(hi_max == float("-inf"), float("nan"), hi_max).to(tl.float32))


@triton.jit
def _bwd_kernel(
    G,
    X,
    Y,
    Z,
    M,
    COEF,
    GX,
    T,
    p0,
    p1,
    p2,
    p3,
    KIND: tl.constexpr,
    FLAG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1).to(tl.int64)
    offs = ch * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    idx = row * T + offs
    m = tl.load(M + idx, mask=inb, other=0).to(tl.float32)
    a = tl.load(X + idx, mask=inb, other=0.0).to(tl.float32)
    b = tl.load(Y + idx, mask=inb, other=0.0).to(tl.float32)
    c = tl.load(Z + idx, mask=inb, other=0.0).to(tl.float32)
    w = tl.load(G).to(tl.float32) * tl.load(COEF + row)
    loss, g, s0, s1, s2, s3, s4, s5 = _token(a, b, c, p0, p1, p2, p3, KIND, FLAG)
    grad = tl.where(m != 0, w * m * g, 0.0)
    tl.store(GX + idx, grad.to(GX.dtype.element_ty), mask=inb)


def _block(T):
    return min(triton.next_power_of_2(max(T, 16)), 1024)


def _scalars(kind, params):
    # the clip bounds 1 -+ eps are formed in double and rounded once, as the C++ kernel does
    if kind == 0:
        return [1.0 - float(params[0]), 1.0 + float(params[1]), float(params[2]), float(params[3])]
    return [float(v) for v in params]


def _flag(kind, params):
    # policy: dual clip on; value: clipping on
    return bool(params[2] > 0) if kind == 0 else bool(params[0] > 0)


def loss_forward(kind, x, y, z, mask, params, agg, scale, gden, gden_value, n_stats):
    B, T = x.shape
    block = _block(T)
    nch = triton.cdiv(T, block)
    f32 = dict(dtype=torch.float32, device=x.device)
    partials = torch.empty(B * nch * N_PARTIALS, **f32)  # scratch, every element written
    coef = new_output((B,), **f32)
    loss = new_output((), **f32)
    stats = new_output((n_stats,), **f32)
    flag = _flag(kind, params)
    p = _scalars(kind, params)
    _fwd_partials_kernel[(B, nch)](
        x, y, z, mask, partials, T, nch, *p, KIND=kind, FLAG=flag, BLOCK=block, num_warps=4
    )
    _combine_kernel[(1,)](
        partials,
        coef,
        loss,
        stats,
        gden if gden is not None else partials,
        B,
        nch,
        float(scale),
        float(gden_value),
        AGG=int(agg),
        HAS_GDEN=gden is not None,
        N_STATS=n_stats,
        RB=128,
        num_warps=4,
    )
    return loss, stats, coef


def loss_backward(kind, grad_loss, x, y, z, mask, row_coef, params):
    B, T = x.shape
    grad = new_output(x.shape, x.dtype, x.device)
    block = _block(T)
    nch = triton.cdiv(T, block)
    p = _scalars(kind, params)
    _bwd_kernel[(B, nch)](
        grad_loss.reshape(()),
        x,
        y,
        z,
        mask,
        row_coef.float().contiguous(),
        grad,
        T,
        *p,
        KIND=kind,
        FLAG=_flag(kind, params),
        BLOCK=block,
        num_warps=4,
    )
    return grad
