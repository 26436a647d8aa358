"""Triton kernel for GRPO / RLOO group advantages: one program per block of BI rows compares its
rows' group ids with every candidate row's (a [BI, BJ] tile at a time) and accumulates the group
count, sum and centred sum of squares in float64. With contiguous groups (group_size) only the
rows of the block's own groups are visited (O(B * group_size) work); with an arbitrary group_index
every row is (O(B^2): 67M compares for B = 8192, microseconds on a GPU) -- deterministic, no
atomics, no host sync, no sort. The advantage is then broadcast over the mask's tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import new_output


@triton.jit
def _gid(GI, jj, jin, group_size, BY_INDEX: tl.constexpr):
    if BY_INDEX:
        g = tl.load(GI + jj, mask=jin, other=-1).to(tl.int64)
    else:
        g = jj // group_size
    return tl.where(jin, g, -2)


@triton.jit
def _group_adv_kernel(
    S,
    GI,
    M,
    OUT,
    B,
    T,
    group_size,
    eps,
    BY_INDEX: tl.constexpr,
    KIND: tl.constexpr,
    NORM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    BT: tl.constexpr,
):
    i0 = tl.program_id(0).to(tl.int64) * BI
    ii = i0 + tl.arange(0, BI)
    iin = ii < B
    x_i = tl.load(S + ii, mask=iin, other=0.0).to(tl.float64)
    g_i = _gid(GI, ii, iin, group_size, BY_INDEX)
    if BY_INDEX:
        j_lo = 0
        j_hi = B
    else:
        j_lo = (i0 // group_size) * group_size
        j_hi = tl.minimum(B, ((tl.minimum(i0 + BI, B) - 1) // group_size + 1) * group_size)
    cnt = tl.zeros([BI], dtype=tl.float64)
    s = tl.zeros([BI], dtype=tl.float64)
    for j0 in range(j_lo, j_hi, BJ):
        jj = j0 + tl.arange(0, BJ)
        jin = jj < j_hi
        x_j = tl.load(S + jj, mask=jin, other=0.0).to(tl.float64)
        eq = g_i[:, None] == _gid(GI, jj, jin, group_size, BY_INDEX)[None, :]
        cnt += tl.sum(tl.where(eq, 1.0, 0.0).to(tl.float64), 1)
        s += tl.sum(tl.where(eq, x_j[None, :], 0.0), 1)
    mean = s / tl.maximum(cnt, 1.0)
    c = x_i - mean
    single = cnt <= 1.0
    if KIND == 0:
        if NORM:
            ss = tl.zeros([BI], dtype=tl.float64)
            for j0 in range(j_lo, j_hi, BJ):
                jj = j0 + tl.arange(0, BJ)
                jin = jj < j_hi
                x_j = tl.load(S + jj, mask=jin, other=0.0).to(tl.float64)
                eq = g_i[:, None] == _gid(GI, jj, jin, group_size, BY_INDEX)[None, :]
                dj = x_j[None, :] - mean[:, None]
                ss += tl.sum(tl.where(eq, dj * dj, 0.0), 1)
            std = tl.sqrt(ss / tl.maximum(cnt - 1.0, 1.0))
            # eps = 0 on a group of equal scores: 0 (c is exactly 0), not 0 / 0
            den = std + eps
            adv = tl.where(single, x_i / (1.0 + eps), tl.where(den > 0, c / den, 0.0))
        else:
            adv = tl.where(single, x_i, c)
    else:
        adv = tl.where(single, x_i, c * cnt / tl.maximum(cnt - 1.0, 1.0))
    if BY_INDEX:
        adv = tl.where((g_i >= 0) & (g_i < B), adv, float("nan"))  # out-of-range group id
    adv = adv.to(tl.float32)
    if HAS_MASK:
        for t0 in range(0, T, BT):
            tt = t0 + tl.arange(0, BT)
            tin = tt < T
            inb = iin[:, None] & tin[None, :]
            off = ii[:, None] * T + tt[None, :]
            m = tl.load(M + off, mask=inb, other=0).to(tl.float32)
            tl.store(OUT + off, adv[:, None] * m, mask=inb)
    else:
        tl.store(OUT + ii, adv, mask=iin)


def group_advantages(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    B = scores.shape[0]
    T = mask.shape[1] if mask is not None else 0
    f32 = dict(dtype=torch.float32, device=scores.device)
    out = new_output((B, T) if mask is not None else (B,), **f32)
    if B == 0 or (mask is not None and T == 0):
        return out
    BI = 16
    BT = min(triton.next_power_of_2(max(T, 16)), 256)
    dummy = scores
    _group_adv_kernel[(triton.cdiv(B, BI),)](
        scores,
        group_index if group_index is not None else dummy,
        mask if mask is not None else dummy,
        out,
        B,
        T,
        max(int(group_size), 1),
        float(eps),
        BY_INDEX=group_index is not None,
        KIND=int(kind),
        NORM=bool(norm_by_std),
        HAS_MASK=mask is not None,
        BI=BI,
        BJ=64,
        BT=BT,
        num_warps=4,
    )
    return out
