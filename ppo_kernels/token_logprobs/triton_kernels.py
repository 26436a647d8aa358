"""Triton kernels for token_logprobs: one program per row, one pass over the vocabulary with an
online max / sum-exp (the same state as csrc/common/softmax_stats.h), backward in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import new_output
from .._triton_math import softmax_grad, softmax_grad_coefs, softmax_stats_update
from .._triton_utils import row_indexer


@triton.jit
def _unscaled_stats(base, V, inv_t, BLOCK: tl.constexpr):
    """(max x, log sum exp((x - max x) * inv_t), entropy) of one row, relative to its unscaled max:
    the slow path of a row whose scaled logits overflow float32 (x = 3e38 at temperature 0.5),
    as csrc/cpu/token_logprobs.cpp's row_stats64. NaN for a row with NaN / +inf, or all -inf."""
    mx = -float("inf")
    bad = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        bad = tl.maximum(bad, tl.max(tl.where((x != x) | (x == float("inf")), 1.0, 0.0), 0))
        mx = tl.maximum(mx, tl.max(x, 0))
    m = -float("inf")
    s = 0.0
    u = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m, s, u = softmax_stats_update(m, s, u, (x - mx) * inv_t)
    ok = (bad == 0.0) & (mx > -float("inf"))
    return (
        tl.where(ok, mx, float("nan")),
        tl.where(ok, m + tl.log(s), float("nan")),
        tl.where(ok, tl.log(s) - u / s, float("nan")),
    )


@triton.jit
def _fwd_kernel(
    X,
    LAB,
    LP,
    ENT,
    LSE,
    V,
    inner,
    stride_outer,
    stride_inner,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LAB + row).to(tl.int64)
    if label == ignore_index:
        tl.store(LP + row, 0.0)
        tl.store(LSE + row, 0.0)
        if WITH_ENT:
            tl.store(ENT + row, 0.0)
    else:
        base = X + (row // inner) * stride_outer + (row % inner) * stride_inner
        m = -float("inf")
        s = 0.0
        u = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            z = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32) * inv_t
            m, s, u = softmax_stats_update(m, s, u, z)
        lse = m + tl.log(s)
        valid = (label >= 0) & (label < V)
        xl = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
        lp = (xl * inv_t - m) - tl.log(s)  # exact near the max even when lse rounds log s away
        ent = tl.log(s) - u / s
        if lse - lse != 0.0:  # lse not finite: the scaled logits overflow (see _unscaled_stats)
            mx, lsx, ent = _unscaled_stats(base, V, inv_t, BLOCK)
            lse = mx * inv_t + lsx
            lp = (xl - mx) * inv_t - lsx
        tl.store(LP + row, tl.where(valid, lp, float("nan")))
        tl.store(LSE + row, lse)
        if WITH_ENT:
            tl.store(ENT + row, tl.where(valid, ent, float("nan")))


@triton.jit
def _bwd_kernel(
    X,
    G,
    LAB,
    GLP,
    GENT,
    LSE,
    ENT,
    V,
    inner,
    stride_outer,
    stride_inner,
    g_inner,
    g_stride_outer,
    g_stride_inner,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LAB + row).to(tl.int64)
    base = X + (row // inner) * stride_outer + (row % inner) * stride_inner
    gbase = G + (row // g_inner) * g_stride_outer + (row % g_inner) * g_stride_inner
    ignored = label == ignore_index
    valid = (label >= 0) & (label < V) & (label != ignore_index)
    lse, a, b, c = softmax_grad_coefs(GLP, GENT, ENT, LSE, row, inv_t, WITH_ENT)
    shift = tl.where(lse == lse, 0.0, 0.0)  # a float32 0 (the type the branch below assigns)
    if (lse - lse != 0.0) & valid:  # the scaled logits overflow: p relative to the unscaled max
        shift, lse, h = _unscaled_stats(base, V, inv_t, BLOCK)
        if WITH_ENT:
            c = h - lse
        else:
            c = -lse
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < V
        z = (tl.load(base + offs, mask=msk, other=0.0).to(tl.float32) - shift) * inv_t
        g = softmax_grad(z, lse, a, b, c) + tl.where(offs == label, a, 0.0)
        g = tl.where(valid, g, float("nan"))
        g = tl.where(ignored, 0.0, g)
        tl.store(gbase + offs, g.to(G.dtype.element_ty), mask=msk)


def _block(V):
    return min(triton.next_power_of_2(max(V, 16)), 4096)


def _warps(block):
    return 8 if block >= 2048 else 4


def forward(logits, labels, inv_temperature, ignore_index, with_entropy):
    V = logits.shape[-1]
    idx, logits = row_indexer(logits)
    labels = labels.contiguous()
    N = labels.numel()
    f32 = dict(dtype=torch.float32, device=logits.device)
    lp = new_output(labels.shape, **f32)
    lse = new_output(labels.shape, **f32)
    ent = new_output(labels.shape, **f32) if with_entropy else torch.empty(0, **f32)
    if N > 0:
        block = _block(V)
        _fwd_kernel[(N,)](
            logits,
            labels,
            lp,
            ent if with_entropy else lp,
            lse,
            V,
            *idx,
            float(inv_temperature),
            int(ignore_index),
            WITH_ENT=with_entropy,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return lp, ent, lse


def backward(
    grad_logprobs,
    grad_entropy,
    logits,
    labels,
    lse,
    entropy,
    inv_temperature,
    ignore_index,
    grad_logits,
):
    V = logits.shape[-1]
    idx, logits = row_indexer(logits)
    # rows the kernel cannot address (leading dims that do not collapse to two strided dims, e.g.
    # an inplace gradient into x[:, :-1, :-1] of a 4-D tensor): write a contiguous copy, then back
    gidx, g = row_indexer(grad_logits)
    labels = labels.contiguous()
    N = labels.numel()
    if N == 0:
        return
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    glp = grad_logprobs.float().contiguous()
    gent = grad_entropy.float().contiguous() if with_ent else glp
    ent = entropy.contiguous() if with_ent else lse
    block = _block(V)
    _bwd_kernel[(N,)](
        logits,
        g,
        labels,
        glp,
        gent,
        lse.contiguous(),
        ent,
        V,
        *idx,
        *gidx,
        float(inv_temperature),
        int(ignore_index),
        WITH_ENT=with_ent,
        BLOCK=block,
        num_warps=_warps(block),
    )
    if g is not grad_logits:
        grad_logits.copy_(g)
