"""Triton kernels for linear_token_logprobs: reductions of one float32 logits tile
[rows, vocab_chunk] (the tile itself comes from a cuBLAS matmul in chunks.py). One program per row.

Why not a fused tl.dot kernel (logits tiles computed on chip)? It has no GPU benchmark against
cuBLAS + these reductions yet; the chunked cuBLAS path moves one extra float32 tile through HBM
per chunk (about 2 x 4 bytes per logit, small next to the 2 x H flops per logit of the matmul at
H >= 1024), and it is the one we can make correct and test here (the interpreter runs these
kernels on the CPU). Revisit with bench/gpu_checks/linear_logprobs.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton_math import softmax_grad, softmax_grad_coefs, softmax_stats_update


@triton.jit
def _tile_stats_kernel(
    X, LAB, ST, ZL, R, Vt, ld, v_start, inv_t, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LAB + row).to(tl.int64)
    if label != ignore_index:
        base = X + row * ld
        m = tl.load(ST + row)
        s = tl.load(ST + R + row)
        u = tl.load(ST + 2 * R + row)
        for start in range(0, Vt, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            z = tl.load(base + offs, mask=offs < Vt, other=-float("inf")).to(tl.float32) * inv_t
            m, s, u = softmax_stats_update(m, s, u, z)
        tl.store(ST + row, m)
        tl.store(ST + R + row, s)
        tl.store(ST + 2 * R + row, u)
        k = label - v_start
        if (k >= 0) & (k < Vt):
            tl.store(ZL + row, tl.load(base + k).to(tl.float32) * inv_t)


@triton.jit
def _tile_bwd_kernel(
    X,
    LAB,
    LSE,
    ENT,
    GLP,
    GENT,
    Vt,
    ld,
    v_start,
    V,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LAB + row).to(tl.int64)
    base = X + row * ld
    ignored = label == ignore_index
    valid = (label >= 0) & (label < V) & (label != ignore_index)
    lse, a, b, c = softmax_grad_coefs(GLP, GENT, ENT, LSE, row, inv_t, WITH_ENT)
    k = label - v_start
    for start in range(0, Vt, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < Vt
        z = tl.load(base + offs, mask=msk, other=0.0).to(tl.float32) * inv_t
        g = softmax_grad(z, lse, a, b, c) + tl.where(offs == k, a, 0.0)
        g = tl.where(valid, g, float("nan"))
        g = tl.where(ignored, 0.0, g)
        tl.store(base + offs, g, mask=msk)


def _block(Vt):
    return min(triton.next_power_of_2(max(Vt, 16)), 4096)


def _warps(block):
    return 8 if block >= 2048 else 4


def tile_stats_(tile, labels, v_start, inv_t, ignore_index, state, zlabel):
    """Same contract as reference.tile_stats_ (tile float32 [R, Vt], stride(1) == 1)."""
    R, Vt = tile.shape
    if R == 0 or Vt == 0:
        return
    assert tile.stride(1) == 1 and state.is_contiguous() and zlabel.is_contiguous()
    block = _block(Vt)
    _tile_stats_kernel[(R,)](
        tile,
        labels.contiguous(),
        state,
        zlabel,
        R,
        Vt,
        tile.stride(0),
        int(v_start),
        float(inv_t),
        int(ignore_index),
        BLOCK=block,
        num_warps=_warps(block),
    )


def tile_bwd_(
    tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V
):
    """Same contract as reference.tile_bwd_ (in place on a float32 tile)."""
    R, Vt = tile.shape
    if R == 0 or Vt == 0:
        return
    assert tile.stride(1) == 1
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    glp = grad_logprobs.float().contiguous()
    gent = grad_entropy.float().contiguous() if with_ent else glp
    ent = entropy.float().contiguous() if with_ent else lse
    block = _block(Vt)
    _tile_bwd_kernel[(R,)](
        tile,
        labels.contiguous(),
        lse.float().contiguous(),
        ent,
        glp,
        gent,
        Vt,
        tile.stride(0),
        int(v_start),
        int(V),
        float(inv_t),
        int(ignore_index),
        WITH_ENT=with_ent,
        BLOCK=block,
        num_warps=_warps(block),
    )
