"""Shared math (layer 2 of the layout): the accumulation dtype every kernel and reference uses, and
masked moments with a power-of-two scale, used by the masked statistics' eager implementation
(masked_stats/op.py) and their data-parallel form (distributed/data_parallel.py). Plain PyTorch,
no host sync, traceable by torch.compile."""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops accumulate and return per-token outputs in: float64 for float64 inputs
    (the exact reference, gradcheck), float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_weights(x: Tensor, mask: Tensor):
    """(x in the accumulation dtype, selection m = mask != 0, weights w): a float mask weights
    each position by its value (as verl's and OpenRLHF's `x * mask` sums do); bool / integer masks
    select (weight 1)."""
    acc = acc_dtype(x.dtype)
    m = mask != 0
    w = mask.to(acc) if mask.is_floating_point() else m.to(acc)
    return x.to(acc), m, w


def pow2_scale(xf: Tensor, m: Tensor) -> Tensor:
    """A power of two s with max |x| / s in [1, 2) over the mask (1 when that max is 0 or not
    finite): dividing by it is exact, and sums of squares of x / s cannot overflow (s = 2^(e - 1)
    with max |x| = f 2^e, f in [0.5, 1): 2^e itself overflows for max |x| near FLT_MAX)."""
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    amax = torch.where(m, xf.abs(), zero).amax() if xf.numel() > 0 else zero
    ok = (amax > 0) & (amax < float("inf"))
    _, e = torch.frexp(torch.where(ok, amax, torch.ones_like(amax)))
    return torch.ldexp(torch.ones_like(amax), e - 1)


def local_moments(xf: Tensor, m: Tensor, w: Tensor | None = None) -> Tensor:
    """(count, mean / s, M2 / s^2, s) of xf over m (bool), as one tensor [4] in xf's dtype, with s
    = pow2_scale (exact, so that finite inputs of any spread give finite moments); with weights w
    (a float mask's values) the weighted ones."""
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    w = m.to(xf.dtype) if w is None else torch.where(m, w.to(xf.dtype), zero)
    s = pow2_scale(xf, m)
    xs = xf / s
    n = w.sum()
    mean = torch.where(m, xs * w, zero).sum() / torch.where(n > 0, n, torch.ones_like(n))
    dev = torch.where(m, xs - mean, zero)
    m2 = (dev.square() * w).sum()
    return torch.stack([n, mean, m2, s])
