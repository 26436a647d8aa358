"""The Python side of the registered ops `ppo_kernels::masked_mean` and `ppo_kernels::masked_whiten`
(+ their backward ops), defined in C++ (csrc/ops/masked_stats.cpp: schemas, checks, routing,
autograd): their fake kernels and their eager implementations, which are also the float64
reference (float64 inputs always run them). The cpp backend is csrc/cpu/masked_stats.cpp (CPU,
double accumulation); on CUDA the eager implementation is the default (a handful of reductions
with no host sync, CUDA-graph capturable; a kernel would read the same bytes).

Semantics: the mean and variance are over the positions where mask != 0, a float mask weighting
each position by its value (n = the total weight, den = n, or 1 when n = 0). Masked-out positions
never contribute, even when NaN. The float32 statistics are computed on x / s with s = the power
of two near max |x| over the mask (exact), so any finite input gives a finite result."""

from __future__ import annotations

import torch

from .. import _backend, _math
from .._checks import check_devices
from .._math import acc_dtype

_backend.register_op(
    "masked_mean",
    kernel="masked_mean_fwd",
    triton=False,
    cuda_default="eager",
    folder="masked_stats",
)
_backend.register_op(
    "masked_whiten",
    kernel="masked_whiten_fwd",
    triton=False,
    cuda_default="eager",
    folder="masked_stats",
)
_backend.routes_in_cpp("masked_mean")
_backend.routes_in_cpp("masked_whiten")


def _reduced_shape(x, dim):
    if dim is None or len(dim) == 0:
        return ()
    nd = max(x.dim(), 1)
    red = {d % nd for d in dim}
    return tuple(s for i, s in enumerate(x.shape) if i not in red)


# The fakes and fallbacks check devices as the C++ checks do (a meta tensor sends a call to its
# fake whatever the other arguments' devices).
@_backend.fake("masked_mean")
def _(x, mask, dim, empty):
    check_devices("x", x, mask=mask)
    return x.new_empty(_reduced_shape(x, dim), dtype=acc_dtype(x.dtype))


@_backend.fake("masked_mean_backward")
def _(grad, x, mask, dim, empty):
    check_devices("x", x, mask=mask, grad=grad)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _sum_dim(t, dim):
    return t.sum() if dim is None or len(dim) == 0 else t.sum(dim)


def _mean_eager(x, mask, dim, empty):
    xf, m, w = _math.masked_weights(x, mask)
    s = _sum_dim(torch.where(m, xf * w, torch.zeros((), dtype=xf.dtype, device=xf.device)), dim)
    n = _sum_dim(w, dim)
    if empty == "nan":
        return s / n
    return torch.where(n != 0, s / torch.where(n != 0, n, 1.0), 0.0)


@_backend.impl("masked_mean", "eager")
def _(x, mask, dim, empty):
    return _mean_eager(x, mask, dim, empty)


@_backend.impl("masked_mean_backward", "eager")
def _(grad, x, mask, dim, empty):
    """d mean / d x = w / n on the selected positions (0 in an empty set with empty="zero")."""
    xf, m, w = _math.masked_weights(x, mask)
    n = _sum_dim(w, dim)
    coef = grad.to(xf.dtype) / n if empty == "nan" else torch.where(n != 0, grad / n, 0.0)
    if dim is not None and len(dim) > 0 and x.dim() > 0:
        for d in sorted(d % x.dim() for d in dim):
            coef = coef.unsqueeze(d)
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    return torch.where(m, coef * w, zero).to(x.dtype).contiguous()


@_backend.fake("masked_whiten")
def _(x, mask, shift_mean, unbiased, eps):
    check_devices("x", x, mask=mask)
    return x.new_empty(x.shape, dtype=acc_dtype(x.dtype))


@_backend.fake("masked_whiten_backward")
def _(grad, x, mask, shift_mean, unbiased, eps):
    check_devices("x", x, mask=mask, grad=grad)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _whiten_stats(x, mask, unbiased, eps):
    """(m, w, den, s, ys, mean_s, sigma_s, bessel): the statistics of x / s (s a power of two
    near max |x| over the mask), ys = (x - mean) / s, mean_s = mean / s, sigma_s = sqrt(var +
    eps) / s."""
    xf, m, w = _math.masked_weights(x, mask)
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    n = torch.where(m, w, zero).sum()
    s = _math.pow2_scale(xf, m)
    xs = xf / s
    den = torch.where(n != 0, n, 1.0)
    mean = torch.where(m, xs * w, zero).sum() / den
    ys = xs - mean  # |ys| < 4 on the mask
    var = torch.where(m, ys.square() * w, zero).sum() / den
    bessel = torch.ones((), dtype=xf.dtype, device=xf.device)
    if unbiased:
        # n / (n - 1): NaN for a total weight of 0 or 1 (no sync), where verl raises (as
        # strict_checks() does in the public API).
        nan = torch.full((), float("nan"), dtype=xf.dtype, device=xf.device)
        bessel = torch.where((n != 0) & (n != 1), n / (n - 1), nan)
    var = var * bessel
    # sqrt(var + eps / s^2) as a hypot: eps / s^2 overflows for tiny s (then the result is 0).
    sigma = torch.hypot(var.sqrt(), (eps**0.5) / s)
    return m, w, den, s, ys, mean, sigma, bessel


@_backend.impl("masked_whiten", "eager")
def _(x, mask, shift_mean, unbiased, eps):
    _, _, _, s, ys, mean, sigma, _ = _whiten_stats(x, mask, unbiased, eps)
    out = ys / sigma
    return out if shift_mean else out + mean * s


@_backend.impl("masked_whiten_backward", "eager")
def _(grad, x, mask, shift_mean, unbiased, eps):
    """out = d / sigma (+ mean), d = x - mean, sigma = sqrt(var + eps); with G = sum g and
    H = sum g d (every position) and D = sum w d (the selection), in units of s:
    dx_j = g_j / sigma + w_j / den (-G / sigma + [not shift_mean] G - bessel H / sigma^3 (d_j - D
    / den))."""
    m, w, den, s, ys, _, sigma, bessel = _whiten_stats(x, mask, unbiased, eps)
    g = grad.to(ys.dtype)
    zero = torch.zeros((), dtype=ys.dtype, device=ys.device)
    wm = torch.where(m, w, zero)
    G, H, D = g.sum(), (g * ys).sum(), (wm * ys).sum()
    # scaled: sigma = s sigma_s, d = s ys, H = s H_s, D = s D_s; every term but the mean's is / s
    inner = -G / sigma - bessel * (H / sigma) / sigma / sigma * (ys - D / den)
    out = (g / sigma + wm / den * inner) / s
    if not shift_mean:
        out = out + wm / den * G
    return out.to(x.dtype).contiguous()


# Without the compiled extension: the eager forward, differentiable by autograd.
@_backend.fallback("masked_mean")
def _(x, mask, dim, empty):
    check_devices("x", x, mask=mask)
    return _mean_eager(x, mask, dim, empty)


@_backend.fallback("masked_whiten")
def _(x, mask, shift_mean, unbiased, eps):
    check_devices("x", x, mask=mask)
    return _backend.python_impl("masked_whiten", "eager")(x, mask, shift_mean, unbiased, eps)
