"""Triton kernels of the distillation tiles: one program per row. Forward: one pass for both
rows' online softmax statistics (and the student's at temperature 1 for the hard term when
T != 1), then one pass for the divergence and its aux; backward: one pass writing the student's
gradient over the student tile, in place. Semantics and edge cases: naive.py. Unlike the C++
kernels, the KL modes take the two-pass form too: for nearly equal rows their value carries an
absolute error of about eps * log V (the C++ one-pass KL state keeps it relative)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import new_output
from .naive import DIVERGENCES

INF = float("inf")


@triton.jit
def _log_mix(p, q, beta):
    # log of the mixture (1 - beta) p + beta q, held at FLT_MIN or more (csrc/common/distill_math.h
    # log_mix: one log instead of exp + log1p). FLT_MIN written exactly (2^-126): Triton types a
    # literal below it as float64, which made the whole gradient float64 (and, through the
    # interpreter's float64 -> bfloat16 conversion, garbage in bfloat16 tiles).
    m = tl.maximum((1.0 - beta) * p + beta * q, 1.1754943508222875e-38)
    tl.static_assert(m.dtype == tl.float32, "the mixture must stay float32")
    return tl.log(m)


@triton.jit
def _merge(m, s, z):
    """Online (max, sum exp) state m, s with the block z added."""
    m2 = tl.maximum(m, tl.max(z, 0))
    scale = tl.where(m2 == -float("inf"), 0.0, tl.exp(m - m2))
    e = tl.where(z == -float("inf"), 0.0, tl.exp(z - m2))
    return m2, s * scale + tl.sum(e, 0)


@triton.jit
def _fwd_kernel(
    S, T, LAB, MASK, VAL, LSS, LST, AUX, HLP, LSH,
    V, s_stride, t_stride, inv_t, beta, ignore_index,
    MODE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_LABELS: tl.constexpr,
    HARD_SEP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    keep = True
    if HAS_MASK:
        keep = tl.load(MASK + row) != 0
    if keep:
        sb = S + row * s_stride
        tb = T + row * t_stride
        ms = -float("inf")
        ss = 0.0
        mt = -float("inf")
        st = 0.0
        m1 = -float("inf")
        s1 = 0.0
        bad = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            msk = offs < V
            x = tl.load(sb + offs, mask=msk, other=-float("inf")).to(tl.float32)
            w = tl.load(tb + offs, mask=msk, other=-float("inf")).to(tl.float32) * inv_t
            z = x * inv_t
            bad = tl.maximum(bad, tl.max(tl.where((z != z) | (z == float("inf")), 1, 0), 0))
            bad = tl.maximum(bad, tl.max(tl.where((w != w) | (w == float("inf")), 1, 0), 0))
            ms, ss = _merge(ms, ss, z)
            mt, st = _merge(mt, st, w)
            if HARD_SEP:
                m1, s1 = _merge(m1, s1, x)
        lse_s = ms + tl.log(ss)
        lse_t = mt + tl.log(st)
        val = 0.0
        aux = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            msk = offs < V
            z = tl.load(sb + offs, mask=msk, other=-float("inf")).to(tl.float32) * inv_t
            w = tl.load(tb + offs, mask=msk, other=-float("inf")).to(tl.float32) * inv_t
            lp = z - lse_s
            lq = w - lse_t
            p = tl.exp(lp)
            q = tl.exp(lq)
            if MODE == 0:
                val += tl.sum(tl.where(q > 0.0, q * (lq - lp), 0.0), 0)
            elif MODE == 1:
                val += tl.sum(tl.where(p > 0.0, p * (lp - lq), 0.0), 0)
            elif MODE == 2:
                lm = _log_mix(p, q, beta)
                kp = tl.where(p > 0.0, p * (lp - lm), 0.0)
                kq = tl.where(q > 0.0, q * (lq - lm), 0.0)
                val += tl.sum(beta * kq + (1.0 - beta) * kp, 0)
                aux += tl.sum(kp, 0)
            else:
                val += tl.sum(0.5 * tl.abs(p - q), 0)
                sg = tl.where(p > q, 1.0, tl.where(p < q, -1.0, 0.0))
                aux += tl.sum(p * sg, 0)
        if MODE == 1:
            aux = val
        undefined = (bad > 0) | (ms == -float("inf")) | (mt == -float("inf"))
        tl.store(VAL + row, tl.where(undefined, float("nan"), val))
        tl.store(AUX + row, tl.where(undefined, float("nan"), aux))
        tl.store(LSS + row, lse_s)
        tl.store(LST + row, lse_t)
        if HAS_LABELS:
            lse_h = lse_s
            if HARD_SEP:
                lse_h = m1 + tl.log(s1)
            y = tl.load(LAB + row)
            ys = tl.where(y == ignore_index, 0, y)
            zy = tl.load(sb + ys).to(tl.float32)
            tl.store(HLP + row, tl.where(y == ignore_index, 0.0, zy - lse_h))
            tl.store(LSH + row, lse_h)
    else:
        tl.store(VAL + row, 0.0)
        tl.store(AUX + row, 0.0)
        tl.store(LSS + row, 0.0)
        tl.store(LST + row, 0.0)
        if HAS_LABELS:
            tl.store(HLP + row, 0.0)
            tl.store(LSH + row, 0.0)


@triton.jit
def _bwd_kernel(
    S, T, LAB, MASK, LSS, LST, AUX, LSH, G, GH,
    V, s_stride, t_stride, inv_t, beta, ignore_index,
    MODE: tl.constexpr, HAS_MASK: tl.constexpr, HARD: tl.constexpr, HARD_SEP: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    keep = True
    if HAS_MASK:
        keep = tl.load(MASK + row) != 0
    sb = S + row * s_stride
    tb = T + row * t_stride
    ga = tl.load(G + row).to(tl.float32) * inv_t
    lse_s = tl.load(LSS + row)
    lse_t = tl.load(LST + row)
    aux = tl.load(AUX + row)
    gh = 0.0
    y = -1
    lse_h = lse_s
    if HARD:
        y = tl.load(LAB + row)
        gh = tl.where(y == ignore_index, 0.0, tl.load(GH + row).to(tl.float32))
        lse_h = tl.load(LSH + row)
    if keep:
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            msk = offs < V
            # the block is read before it is written: the student tile is its own output
            x = tl.load(sb + offs, mask=msk, other=0.0).to(tl.float32)
            w = tl.load(tb + offs, mask=msk, other=0.0).to(tl.float32) * inv_t
            lp = x * inv_t - lse_s
            lq = w - lse_t
            p = tl.exp(lp)
            q = tl.exp(lq)
            if MODE == 0:
                e = p - q
            elif MODE == 1:
                e = tl.where(p > 0.0, p * ((lp - lq) - aux), 0.0)
            elif MODE == 2:
                lm = _log_mix(p, q, beta)
                e = tl.where(p > 0.0, (1.0 - beta) * p * ((lp - lm) - aux), 0.0)
            else:
                sg = tl.where(p > q, 1.0, tl.where(p < q, -1.0, 0.0))
                e = 0.5 * p * (sg - aux)
            g = ga * e
            if HARD:
                p1 = p
                if HARD_SEP:
                    p1 = tl.exp(x - lse_h)
                g = g - gh * p1 + tl.where(offs == y, gh, 0.0)
            tl.store(sb + offs, g.to(S.dtype.element_ty), mask=msk)
    else:
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            zero = tl.zeros((BLOCK,), dtype=tl.float32)
            tl.store(sb + offs, zero.to(S.dtype.element_ty), mask=offs < V)


def _block(V):
    return min(triton.next_power_of_2(max(V, 16)), 4096)


def _mode_args(divergence, beta):
    return DIVERGENCES.index(divergence), float(beta)


def forward(student, teacher, labels, mask, inv_t, divergence, beta, ignore_index):
    N, V = student.shape
    f32 = dict(dtype=torch.float32, device=student.device)
    val, lss, lst, aux = (new_output((N,), **f32) for _ in range(4))
    has_labels = labels is not None
    hlp = new_output((N,), **f32) if has_labels else torch.empty(0, **f32)
    lsh = new_output((N,), **f32) if has_labels else torch.empty(0, **f32)
    if N:
        mode, b = _mode_args(divergence, beta)
        block = _block(V)
        _fwd_kernel[(N,)](
            student, teacher,
            labels.contiguous() if has_labels else val,
            mask.contiguous() if mask is not None else val,
            val, lss, lst, aux,
            hlp if has_labels else val, lsh if has_labels else val,
            V, student.stride(0), teacher.stride(0), float(inv_t), b, int(ignore_index),
            MODE=mode, HAS_MASK=mask is not None, HAS_LABELS=has_labels,
            HARD_SEP=has_labels and float(inv_t) != 1.0, BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip
    return val, lss, lst, aux, hlp, lsh


def backward_(student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
              inv_t, divergence, beta, ignore_index):  # fmt: skip
    N, V = student.shape
    if N == 0 or V == 0:
        return
    mode, b = _mode_args(divergence, beta)
    hard = grad_hard is not None
    block = _block(V)

    def f32(t):
        return t.float().contiguous()

    _bwd_kernel[(N,)](
        student, teacher,
        labels.contiguous() if hard else student,
        mask.contiguous() if mask is not None else student,
        f32(lse_s), f32(lse_t), f32(aux),
        f32(lse_hard) if hard else student,
        f32(grad), f32(grad_hard) if hard else student,
        V, student.stride(0), teacher.stride(0), float(inv_t), b, int(ignore_index),
        MODE=mode, HAS_MASK=mask is not None, HARD=hard,
        HARD_SEP=hard and float(inv_t) != 1.0, BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
