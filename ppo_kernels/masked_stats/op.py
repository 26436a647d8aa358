"""Masked statistics for advantage post-processing, with no host synchronisation (verl's versions
check the mask count on the host twice per call). Plain PyTorch: a handful of reductions, traceable
by torch.compile and CUDA-graph capturable, so the only backend is `eager` (a kernel would read
the same bytes); the ops are still registered so use_backend / PPO_KERNELS_BACKEND accept their
names and a request for a backend they do not have fails clearly."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import FLOAT_DTYPES, check_shape, check_tensor


_backend.register_op("masked_mean", kernel=None, triton=False, cuda_default="eager",
                     folder="masked_stats")
_backend.register_op("masked_whiten", kernel=None, triton=False, cuda_default="eager",
                     folder="masked_stats")


def _prep(x, mask):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask)
    check_shape("mask", mask, x.shape, "like x")
    if mask.device != x.device:
        raise ValueError(f"mask: expected device {x.device} (like x), got {mask.device}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(acc), (mask != 0)


def masked_mean(x: Tensor, mask: Tensor, dim=None, *, process_group=None) -> Tensor:
    """Mean of x over the positions where mask != 0 (over `dim`, or everything when None).
    Masked-out entries never contribute, even when NaN. A set with no position gives 0 (verl
    divides by count + 1e-8 and gets 0 there too). float32 (float64 for float64 x).
    process_group: the mean over the data of every rank of this torch.distributed group (dim must
    be None), with one all-gather of three numbers and no host sync."""
    xf, m = _prep(x, mask)
    _backend.backend_for("masked_mean", x)  # eager; raises if another backend was requested
    if process_group is not None:
        if dim is not None:
            raise ValueError("dim: a data-parallel masked_mean (process_group) reduces everything; "
                             "pass dim=None")
        from ..distributed import global_moments
        return global_moments(xf, m, process_group)[1]
    s = torch.where(m, xf, torch.zeros((), dtype=xf.dtype, device=xf.device))
    if dim is None:
        return s.sum() / m.sum().clamp(min=1).to(xf.dtype)
    return s.sum(dim) / m.sum(dim).clamp(min=1).to(xf.dtype)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, unbiased: bool = True,
                  eps: float = 1e-8, process_group=None) -> Tensor:
    """`(x - mean) * rsqrt(var + eps)` with the mean and variance over mask != 0 (one set for
    the whole tensor, as verl and OpenRLHF do); `shift_mean=False` adds the mean back.
    `unbiased` uses the n - 1 (Bessel) variance like verl; False the biased one.
    verl raises when unbiased and fewer than two positions are unmasked; that needs a host sync, so
    here the result is NaN instead, and `ppo_kernels.strict_checks()` raises like verl.
    Every position is whitened (masked ones too), as in verl. float32 (float64 for float64 x).
    process_group: mean and variance over the data of every rank of this torch.distributed group
    (global whitening), with one all-gather of three numbers per rank and no host sync."""
    xf, m = _prep(x, mask)
    _backend.backend_for("masked_whiten", x)  # eager; raises if another backend was requested
    if process_group is not None:
        from ..distributed.data_parallel import whiten_global
        return whiten_global(xf, m, shift_mean, unbiased, eps, process_group)
    n = m.sum()
    if _backend.strict() and unbiased and int(n) < 2:  # host sync, by request
        raise ValueError(f"mask: masked_whiten with unbiased=True needs at least two unmasked "
                         f"positions, got {int(n)}")
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    nf = n.to(xf.dtype)
    mean = torch.where(m, xf, zero).sum() / nf.clamp(min=1)
    var = torch.where(m, (xf - mean).square(), zero).sum() / nf.clamp(min=1)
    if unbiased:
        # n / (n - 1): NaN for n < 2 (no sync), like verl's ValueError under strict_checks().
        bessel = torch.where(n >= 2, nf / (nf - 1), torch.full((), float("nan"), dtype=xf.dtype,
                                                               device=xf.device))
        var = var * bessel
    out = (xf - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out
