"""Triton kernels for full_kl: one program per row, one pass over both logits rows with the online
state of csrc/common/kl_stats.h (maxes mz, mw; sums sz, sw; u = sum e^a (a - b)), merged block by
block; backward in one pass. With the sampler's kept set of each row (cut, cut_index), the
policy's tokens outside it are dropped (-inf) as they are loaded."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import new_output
from .._triton_math import SERIES_BOUND, expm1_minus_x_series
from .._triton_utils import row_indexer


@triton.jit
def _log1p(x):
    # log1p without libdevice (the interpreter has none): log(1 + x) corrected for the rounding of
    # 1 + x (Goldberg's trick); exact to a few ulp for tiny x
    y = 1.0 + x
    den = tl.where(y == 1.0, 1.0, y - 1.0)
    return tl.where(y == 1.0, x, tl.log(y) * (x / den))


@triton.jit
def _kept(x, offs, cut, cut_index):
    # the sampler's kept set (csrc/common/sampler_rules.h); NaN kept: a row holding one has
    # cut -inf (undefined: its KL stays NaN), a row without keeps what it should
    return (x > cut) | ((x == cut) & (offs <= cut_index)) | (x != x)


@triton.jit
def _fwd_kernel(
    X,
    Y,
    MASK,
    KL,
    LZ,
    LW,
    V,
    inner,
    so,
    si,
    y_inner,
    y_so,
    y_si,
    inv_t,
    INV_TS,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_TS: tl.constexpr = False,
    CUT=None,
    CUT_INDEX=None,
    HAS_CUT: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    keep = True
    if HAS_MASK:
        keep = tl.load(MASK + row) != 0
    if HAS_TS:  # a temperature per row
        inv_t = tl.load(INV_TS + row).to(tl.float32)
    if HAS_CUT:
        cut = tl.load(CUT + row)
        cut_index = tl.load(CUT_INDEX + row)
    if keep:
        xb = X + (row // inner) * so + (row % inner) * si
        yb = Y + (row // y_inner) * y_so + (row % y_inner) * y_si
        mz = -float("inf")
        mw = -float("inf")
        sz = 0.0
        v = 0.0
        u = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            msk = offs < V
            xr = tl.load(xb + offs, mask=msk, other=-float("inf")).to(tl.float32)
            z = xr * inv_t
            if HAS_CUT:
                z = tl.where(_kept(xr, offs, cut, cut_index), z, -float("inf"))
            w = tl.load(yb + offs, mask=msk, other=-float("inf")).to(tl.float32) * inv_t
            mz2 = tl.maximum(mz, tl.max(z, 0))
            mw2 = tl.maximum(mw, tl.max(w, 0))
            # rescale the running state to the new maxes (kl_stats_rescale)
            dz = tl.where(mz == mz2, 0.0, mz - mz2)
            dw = tl.where(mw == mw2, 0.0, mw - mw2)
            fz = tl.exp(dz)
            fw = tl.exp(dw)
            sw = sz + v
            x = dw - dz
            sz2 = sz * fz
            v_moved = tl.where(
                tl.abs(x) < SERIES_BOUND,
                v * fw + sz2 * (x + expm1_minus_x_series(x)),
                sw * fw - sz2,
            )
            v = tl.where(sz != 0.0, v_moved, sw * fw)
            u = tl.where(sz != 0.0, tl.where(u == float("inf"), u, fz * (u + (dz - dw) * sz)), 0.0)
            sz = tl.where(sz != 0.0, sz2, 0.0)
            mz = mz2
            mw = mw2
            # add the block (kl_stats_add)
            a = tl.where(mz == -float("inf"), -float("inf"), z - mz)
            b = tl.where(mw == -float("inf"), -float("inf"), w - mw)
            e = tl.exp(a)
            eb = tl.exp(b)
            d = b - a
            sz += tl.sum(e, 0)
            v += tl.sum(
                tl.where(tl.abs(d) < SERIES_BOUND, e * (d + expm1_minus_x_series(d)), eb - e), 0
            )
            u += tl.sum(tl.where(e > 0.0, e * (a - b), 0.0), 0)
        undefined = (mz == -float("inf")) | (mw == -float("inf"))
        kl = tl.where(undefined, float("nan"), u / sz + _log1p(v / sz))
        tl.store(KL + row, kl)
        tl.store(LZ + row, mz + tl.log(sz))
        tl.store(LW + row, mw + tl.log(sz + v))
    else:
        tl.store(KL + row, 0.0)
        tl.store(LZ + row, 0.0)
        tl.store(LW + row, 0.0)


@triton.jit
def _bwd_kernel(
    G,
    X,
    Y,
    MASK,
    KL,
    LZ,
    LW,
    GX,
    GY,
    V,
    inner,
    so,
    si,
    y_inner,
    y_so,
    y_si,
    inv_t,
    INV_TS,
    HAS_MASK: tl.constexpr,
    NEED_REF: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_TS: tl.constexpr = False,
    CUT=None,
    CUT_INDEX=None,
    HAS_CUT: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    keep = True
    n_load = V  # a masked row loads nothing (a bound, not `msk & keep`: the interpreter of
    if HAS_MASK:  # some Triton releases refuses a load mask combined with a scalar)
        keep = tl.load(MASK + row) != 0
        n_load = V * keep.to(tl.int32)
    if HAS_TS:  # a temperature per row
        inv_t = tl.load(INV_TS + row).to(tl.float32)
    if HAS_CUT:
        cut = tl.load(CUT + row)
        cut_index = tl.load(CUT_INDEX + row)
    xb = X + (row // inner) * so + (row % inner) * si
    yb = Y + (row // y_inner) * y_so + (row % y_inner) * y_si
    a = tl.load(G + row).to(tl.float32) * inv_t
    lz = tl.load(LZ + row)
    lw = tl.load(LW + row)
    c = lz - lw + tl.load(KL + row)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < V
        ld = offs < n_load
        xr = tl.load(xb + offs, mask=ld, other=0.0).to(tl.float32)
        z = xr * inv_t
        if HAS_CUT:
            z = tl.where(_kept(xr, offs, cut, cut_index), z, -float("inf"))
        w = tl.load(yb + offs, mask=ld, other=0.0).to(tl.float32) * inv_t
        p = tl.exp(z - lz)
        gz = tl.where(p > 0.0, a * p * ((z - w) - c), 0.0)
        tl.store(GX + row * V + offs, tl.where(keep, gz, 0.0).to(GX.dtype.element_ty), mask=msk)
        if NEED_REF:
            gw = a * (tl.exp(w - lw) - p)
            tl.store(GY + row * V + offs, tl.where(keep, gw, 0.0).to(GY.dtype.element_ty), mask=msk)


def _block(V):
    return min(triton.next_power_of_2(max(V, 16)), 4096)


def _kept_args(cut, cut_index):
    """The kernels' kept-set arguments (contiguous per-row tensors, or none)."""
    if cut is None:
        return {}
    return dict(CUT=cut.contiguous(), CUT_INDEX=cut_index.contiguous(), HAS_CUT=True)


def forward(logits, ref_logits, mask, inv_t, inv_temperatures=None, cut=None, cut_index=None):
    V = logits.shape[-1]
    shape = logits.shape[:-1]
    ix, logits = row_indexer(logits)
    iy, ref_logits = row_indexer(ref_logits)
    N = shape.numel()
    f32 = dict(dtype=torch.float32, device=logits.device)
    kl, lz, lw = new_output(shape, **f32), new_output(shape, **f32), new_output(shape, **f32)
    if N:
        block = _block(V)
        has_mask = mask is not None
        _fwd_kernel[(N,)](
            logits,
            ref_logits,
            mask.contiguous() if has_mask else kl,
            kl,
            lz,
            lw,
            V,
            *ix,
            *iy,
            float(inv_t),
            inv_temperatures if inv_temperatures is not None else kl,
            HAS_MASK=has_mask,
            BLOCK=block,
            HAS_TS=inv_temperatures is not None,
            num_warps=8 if block >= 2048 else 4,
            **_kept_args(cut, cut_index),
        )
    return kl, lz, lw


def backward(grad, logits, ref_logits, mask, kl, lz, lw, inv_t, grad_logits, grad_ref,
             inv_temperatures=None, cut=None, cut_index=None):  # fmt: skip
    V = logits.shape[-1]
    N = logits.shape[:-1].numel()
    if N == 0 or V == 0:
        return
    ix, logits = row_indexer(logits)
    iy, ref_logits = row_indexer(ref_logits)
    assert grad_logits.is_contiguous() and (grad_ref is None or grad_ref.is_contiguous())
    need_ref = grad_ref is not None
    has_mask = mask is not None
    block = _block(V)
    _bwd_kernel[(N,)](
        grad.float().contiguous(),
        logits,
        ref_logits,
        mask.contiguous() if has_mask else kl,
        kl.contiguous(),
        lz.contiguous(),
        lw.contiguous(),
        grad_logits,
        grad_ref if need_ref else grad_logits,
        V,
        *ix,
        *iy,
        float(inv_t),
        inv_temperatures if inv_temperatures is not None else kl,
        HAS_MASK=has_mask,
        NEED_REF=need_ref,
        BLOCK=block,
        HAS_TS=inv_temperatures is not None,
        num_warps=8 if block >= 2048 else 4,
        **_kept_args(cut, cut_index),
    )
