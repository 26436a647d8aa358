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
    """(x in the accumulation dtype, selection mask, weights): a float mask weights each position
    by its value (as verl's and OpenRLHF's `x * mask` sums do); bool / integer masks select."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask)
    check_shape("mask", mask, x.shape, "like x")
    if mask.device != x.device:
        raise ValueError(f"mask: expected device {x.device} (like x), got {mask.device}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    m = mask != 0
    w = mask.to(acc) if mask.is_floating_point() else m.to(acc)
    return x.to(acc), m, w


_EMPTY = ("zero", "nan")


def _check_empty(empty):
    if empty not in _EMPTY:
        raise ValueError(f"empty: expected one of {_EMPTY}, got {empty!r}")


def masked_mean(x: Tensor, mask: Tensor, dim=None, *, empty: str = "zero",
                process_group=None) -> Tensor:
    """Mean of x over the positions where mask != 0 (over `dim`, or everything when None),
    weighted by the mask's values when it is a float mask: `sum(x * mask) / sum(mask)`.
    Masked-out entries never contribute, even when NaN. A set with no position (zero total weight)
    gives 0 with `empty="zero"` (verl divides by count + 1e-8 and gets 0 too) and NaN with
    `empty="nan"` (OpenRLHF's 0 / 0). Differentiable in x. float32 (float64 for float64 x).
    process_group: the mean over the data of every rank of this torch.distributed group (dim must
    be None), with one all-gather of three numbers and no host sync."""
    _check_empty(empty)
    xf, m, w = _prep(x, mask)
    _backend.backend_for("masked_mean", x)  # eager; raises if another backend was requested
    if process_group is not None:
        if dim is not None:
            raise ValueError("dim: a data-parallel masked_mean (process_group) reduces everything; "
                             "pass dim=None")
        from ..distributed import global_moments
        n, mean, _ = global_moments(xf, m, process_group, w)
        return mean if empty == "zero" else torch.where(n != 0, mean, float("nan"))
    s = torch.where(m, xf * w, torch.zeros((), dtype=xf.dtype, device=xf.device))
    s, n = (s.sum(), w.sum()) if dim is None else (s.sum(dim), w.sum(dim))
    if empty == "nan":
        return s / n
    return torch.where(n != 0, s / torch.where(n != 0, n, 1.0), 0.0)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, unbiased: bool = True,
                  eps: float = 1e-8, process_group=None) -> Tensor:
    """`(x - mean) * rsqrt(var + eps)` with the mean and variance over mask != 0 (one set for
    the whole tensor, as verl and OpenRLHF do); `shift_mean=False` adds the mean back.
    `unbiased` uses the n - 1 (Bessel) variance like verl; False the biased one. A float mask
    weights each position by its value, n being the total weight (verl's formulas).
    verl raises when unbiased and the mask total is 0 or 1; that needs a host sync, so
    here the result is NaN instead, and `ppo_kernels.strict_checks()` raises like verl.
    Every position is whitened (masked ones too), as in verl. float32 (float64 for float64 x).
    process_group: mean and variance over the data of every rank of this torch.distributed group
    (global whitening), with one all-gather of three numbers per rank and no host sync."""
    xf, m, w = _prep(x, mask)
    _backend.backend_for("masked_whiten", x)  # eager; raises if another backend was requested
    if process_group is not None:
        from ..distributed.data_parallel import whiten_global
        return whiten_global(xf, m, shift_mean, unbiased, eps, process_group, w)
    n = w.sum()
    if _backend.strict() and unbiased and float(n) in (0.0, 1.0):  # host sync, by request
        raise ValueError(f"mask: masked_whiten with unbiased=True needs at least two unmasked "
                         f"positions, got {float(n):g}")
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    nf = n.to(xf.dtype)
    mean = torch.where(m, xf * w, zero).sum() / torch.where(nf != 0, nf, 1.0)
    var = torch.where(m, (xf - mean).square() * w, zero).sum() / torch.where(nf != 0, nf, 1.0)
    if unbiased:
        # n / (n - 1): NaN for a total weight of 0 or 1 (no sync), where verl raises (as
        # strict_checks() does).
        nan = torch.full((), float("nan"), dtype=xf.dtype, device=xf.device)
        bessel = torch.where((n != 0) & (n != 1), nf / (nf - 1), nan)
        var = var * bessel
    out = (xf - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out
