"""Masked statistics for advantage post-processing, with no host synchronisation (verl's versions
check the mask count on the host twice per call). Plain PyTorch: a handful of reductions, traceable
by torch.compile and CUDA-graph capturable, so the only backend is `eager` (a kernel would read
the same bytes); the ops are still registered so use_backend / PPO_KERNELS_BACKEND accept their
names and a request for a backend they do not have fails clearly."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import FLOAT_DTYPES, check_bool, check_float, check_shape, check_tensor


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


def _pow2_scale(xf, m):
    """A power of two s with max |x| / s in [1, 2) over the mask (1 when that max is 0 or not
    finite): dividing by it is exact, and sums of squares of x / s cannot overflow (s = 2^(e - 1)
    with max |x| = f 2^e, f in [0.5, 1): 2^e itself overflows for max |x| near FLT_MAX)."""
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    amax = torch.where(m, xf.abs(), zero).amax() if xf.numel() > 0 else zero
    ok = (amax > 0) & (amax < float("inf"))
    _, e = torch.frexp(torch.where(ok, amax, torch.ones_like(amax)))
    return torch.ldexp(torch.ones_like(amax), e - 1)


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
    be None), with one all-gather of four numbers per rank and no host sync."""
    _check_empty(empty)
    xf, m, w = _prep(x, mask)
    _backend.backend_for("masked_mean", x)  # eager; raises if another backend was requested
    if process_group is not None:
        if dim is not None:
            raise ValueError("dim: a data-parallel masked_mean (process_group) reduces everything; "
                             "pass dim=None")
        from ..distributed import global_moments
        n, mean, _, scale = global_moments(xf, m, process_group, w)
        mean = mean * scale
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
    Any finite input gives a finite, correct result: the statistics are computed on x / s with s a
    power of two near max |x| (exact), so a spread beyond ~1e19 (whose float32 variance would
    overflow) is no problem; `(x - mean) * rsqrt(var + eps)` = `y / sqrt(var_y + eps / s^2)`.
    process_group: mean and variance over the data of every rank of this torch.distributed group
    (global whitening), with one all-gather of three numbers per rank and no host sync."""
    check_bool("shift_mean", shift_mean)
    check_bool("unbiased", unbiased)
    eps = check_float("eps", eps, nonneg=True)
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
    s = _pow2_scale(xf, m)
    xs = xf / s
    den = torch.where(nf != 0, nf, 1.0)
    mean = torch.where(m, xs * w, zero).sum() / den
    y = xs - mean  # |y| < 4 on the mask
    var = torch.where(m, y.square() * w, zero).sum() / den
    if unbiased:
        # n / (n - 1): NaN for a total weight of 0 or 1 (no sync), where verl raises (as
        # strict_checks() does).
        nan = torch.full((), float("nan"), dtype=xf.dtype, device=xf.device)
        bessel = torch.where((n != 0) & (n != 1), nf / (nf - 1), nan)
        var = var * bessel
    # sqrt(var + eps / s^2) as a hypot: eps / s^2 overflows for tiny s (then the result is 0).
    out = y / torch.hypot(var.sqrt(), (eps ** 0.5) / s)
    if not shift_mean:
        out = out + mean * s
    return out
