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
def _fwd_kernel(X, LAB, LP, ENT, LSE, V, inner, stride_outer, stride_inner, inv_t, ignore_index,
                WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
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
        zl = tl.load(base + tl.where(valid, label, 0)).to(tl.float32) * inv_t
        tl.store(LP + row, tl.where(valid, zl - lse, float("nan")))
        tl.store(LSE + row, lse)
        if WITH_ENT:
            tl.store(ENT + row, tl.where(valid, tl.log(s) - u / s, float("nan")))


@triton.jit
def _bwd_kernel(X, G, LAB, GLP, GENT, LSE, ENT, V, inner, stride_outer, stride_inner,
                g_inner, g_stride_outer, g_stride_inner, inv_t, ignore_index,
                WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LAB + row).to(tl.int64)
    base = X + (row // inner) * stride_outer + (row % inner) * stride_inner
    gbase = G + (row // g_inner) * g_stride_outer + (row % g_inner) * g_stride_inner
    ignored = label == ignore_index
    valid = (label >= 0) & (label < V) & (label != ignore_index)
    lse, a, b, c = softmax_grad_coefs(GLP, GENT, ENT, LSE, row, inv_t, WITH_ENT)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < V
        z = tl.load(base + offs, mask=msk, other=0.0).to(tl.float32) * inv_t
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
        _fwd_kernel[(N,)](logits, labels, lp, ent if with_entropy else lp, lse, V, *idx,
                          float(inv_temperature), int(ignore_index), WITH_ENT=with_entropy,
                          BLOCK=block, num_warps=_warps(block))
    return lp, ent, lse


def backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy, inv_temperature,
             ignore_index, grad_logits):
    V = logits.shape[-1]
    idx, logits = row_indexer(logits)
    gidx, g = row_indexer(grad_logits)
    assert g is grad_logits, "grad buffer must be writable in place"
    labels = labels.contiguous()
    N = labels.numel()
    if N == 0:
        return
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    glp = grad_logprobs.float().contiguous()
    gent = grad_entropy.float().contiguous() if with_ent else glp
    ent = entropy.contiguous() if with_ent else lse
    block = _block(V)
    _bwd_kernel[(N,)](logits, grad_logits, labels, glp, gent, lse.contiguous(), ent, V, *idx, *gidx,
                      float(inv_temperature), int(ignore_index), WITH_ENT=with_ent, BLOCK=block,
                      num_warps=_warps(block))
