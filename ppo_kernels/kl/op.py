"""The Python side of the registered ops `ppo_kernels::kl_penalty` (+ `kl_penalty_backward`) and
`ppo_kernels::kl_penalized_rewards`, defined in C++ (csrc/ops/kl.cpp: schemas, checks, routing,
autograd): their fake kernels and their triton / eager implementations. The cpp backend is
csrc/cpu/kl.cpp. Semantics and edge cases: ppo_kernels/kl/naive.py."""

from __future__ import annotations

import torch

from .. import _backend, _modes
from .._checks import check_devices
from .._math import acc_dtype
from . import naive

# Elementwise / one-row ops: Triton is the GPU kernel (a CUDA C++ kernel would not read less).
_backend.register_op(
    "kl_penalty", kernel="kl_penalty_fwd", triton=True, cuda_default="triton", folder="kl"
)
_backend.register_op(
    "kl_penalized_rewards", kernel="kl_rewards_fwd", triton=True, cuda_default="triton", folder="kl"
)
_backend.routes_in_cpp("kl_penalty")
_backend.routes_in_cpp("kl_penalized_rewards")


def _est(estimator):  # the Triton kernels specialise on the estimator's index
    return _modes.index("estimator", _modes.KL_ESTIMATORS, estimator)


# The fakes and fallbacks check devices as the C++ checks do (a meta tensor sends a call to its
# fake whatever the other arguments' devices).
def _rewards_devices(scores, logprobs, ref_logprobs, mask, beta_t):
    check_devices(
        "logprobs", logprobs, ref_logprobs=ref_logprobs, scores=scores, mask=mask, beta=beta_t
    )


@_backend.fake("kl_penalty")
def _(logprobs, ref_logprobs, estimator, straight_through, in_lo, in_hi, out_lo, out_hi):
    check_devices("logprobs", logprobs, ref_logprobs=ref_logprobs)
    return logprobs.new_empty(logprobs.shape, dtype=acc_dtype(logprobs.dtype))


@_backend.impl("kl_penalty", "triton")
def _(logprobs, ref_logprobs, estimator, straight_through, in_lo, in_hi, out_lo, out_hi):
    from . import triton_kernels

    return triton_kernels.forward(
        logprobs, ref_logprobs, _est(estimator), (in_lo, in_hi, out_lo, out_hi)
    )


@_backend.impl("kl_penalty", "eager")
def _(logprobs, ref_logprobs, estimator, straight_through, in_lo, in_hi, out_lo, out_hi):
    v = naive.kl_penalty(logprobs, ref_logprobs, estimator, False, (in_lo, in_hi, out_lo, out_hi))
    return v.to(acc_dtype(logprobs.dtype)).contiguous()


@_backend.fake("kl_penalty_backward")
def _(grad, logprobs, ref_logprobs, estimator, st, in_lo, in_hi, out_lo, out_hi, need_lp, need_ref):
    check_devices("logprobs", logprobs, ref_logprobs=ref_logprobs, grad=grad)

    def out(need):
        return logprobs.new_empty(logprobs.shape if need else (0,))

    return out(need_lp), out(need_ref)


@_backend.impl("kl_penalty_backward", "triton")
def _(grad, logprobs, ref_logprobs, estimator, st, in_lo, in_hi, out_lo, out_hi, need_lp, need_ref):
    from . import triton_kernels

    bounds = (in_lo, in_hi, out_lo, out_hi)
    return triton_kernels.backward(
        grad, logprobs, ref_logprobs, _est(estimator), st, bounds, need_lp, need_ref
    )


@_backend.impl("kl_penalty_backward", "eager")
def _(grad, logprobs, ref_logprobs, estimator, st, in_lo, in_hi, out_lo, out_hi, need_lp, need_ref):
    bounds = (in_lo, in_hi, out_lo, out_hi)
    g = grad * naive.kl_penalty_grad(logprobs, ref_logprobs, estimator, st, bounds)
    empty = logprobs.new_empty(0)
    return (g.to(logprobs.dtype) if need_lp else empty), (
        (-g).to(logprobs.dtype) if need_ref else logprobs.new_empty(0)
    )


@_backend.fake("kl_penalized_rewards")
def _(scores, logprobs, ref_logprobs, mask, beta_t, beta, estimator, in_lo, in_hi, out_lo, out_hi):
    _rewards_devices(scores, logprobs, ref_logprobs, mask, beta_t)
    out = acc_dtype(logprobs.dtype)
    B, T = logprobs.shape
    return (
        logprobs.new_empty((B, T), dtype=out),
        logprobs.new_empty((B, T), dtype=out),
        logprobs.new_empty((B,), dtype=out),
    )


@_backend.impl("kl_penalized_rewards", "triton")
def _(scores, logprobs, ref_logprobs, mask, beta_t, beta, estimator, in_lo, in_hi, out_lo, out_hi):
    from . import triton_kernels

    bounds = (in_lo, in_hi, out_lo, out_hi)
    return triton_kernels.rewards(
        scores, logprobs, ref_logprobs, mask, beta_t, beta, _est(estimator), bounds
    )


@_backend.impl("kl_penalized_rewards", "eager")
def _(scores, logprobs, ref_logprobs, mask, beta_t, beta, estimator, in_lo, in_hi, out_lo, out_hi):
    b = beta if beta_t is None else beta_t * beta
    bounds = (in_lo, in_hi, out_lo, out_hi)
    r, k, m = naive.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, b, estimator, bounds)
    out = acc_dtype(logprobs.dtype)
    return r.to(out).contiguous(), k.to(out).contiguous(), m.to(out).contiguous()


# Without the compiled extension: the references themselves, differentiable by autograd.
@_backend.fallback("kl_penalty")
def _(logprobs, ref_logprobs, estimator, straight_through, in_lo, in_hi, out_lo, out_hi):
    check_devices("logprobs", logprobs, ref_logprobs=ref_logprobs)
    bounds = (in_lo, in_hi, out_lo, out_hi)
    v = naive.kl_penalty(logprobs, ref_logprobs, estimator, straight_through, bounds)
    return v.to(acc_dtype(logprobs.dtype))


@_backend.fallback("kl_penalized_rewards")
def _(*args):
    _rewards_devices(*args[:5])
    with torch.no_grad():  # as the registered op's Autograd kernel: the rewards carry no history
        return _backend.python_impl("kl_penalized_rewards", "eager")(*args)
