"""The Python side of the registered ops `ppo_kernels::ppo_policy_loss`,
`ppo_kernels::ppo_value_loss` and `ppo_kernels::masked_aggregate` (+ their backward ops), defined in C++ (csrc/ops/losses.cpp:
schemas, checks, routing, autograd): their fake kernels and their triton / eager
implementations. The cpp backend is csrc/cpu/losses.cpp. Semantics and edge cases:
ppo_kernels/losses/naive.py.

Each forward returns (loss [], stats [n], row_coef [B]): one pass over the tokens computes the
per-token loss, the per-row partial sums and the aggregation (verl's four `agg_loss` modes) with
no host synchronisation; `row_coef` (d loss / d (mask * token loss) per row) is what the backward
op scales the recomputed per-token gradient by. Inputs reach the implementations as contiguous
[B, T] rows; an empty input runs the eager one.
"""

from __future__ import annotations

import torch

from .. import _backend, _modes
from .._checks import check_devices
from .._math import acc_dtype
from . import naive

# Elementwise passes plus one combine: Triton is the GPU kernel.
_backend.register_op(
    "ppo_policy_loss",
    kernel="ppo_policy_loss_fwd",
    triton=True,
    cuda_default="triton",
    folder="losses",
)
_backend.register_op(
    "ppo_value_loss",
    kernel="ppo_value_loss_fwd",
    triton=True,
    cuda_default="triton",
    folder="losses",
)
# A reduction: one C++ pass on the CPU (torch's `where` for the NaN-safe select costs several
# passes there); on the GPU the composition of torch ops is already memory-bound.
_backend.register_op(
    "masked_aggregate",
    kernel="masked_aggregate_fwd",
    triton=False,
    cuda_default="eager",
    folder="losses",
)
_backend.routes_in_cpp("ppo_policy_loss")
_backend.routes_in_cpp("ppo_value_loss")
_backend.routes_in_cpp("masked_aggregate")

N_STATS_POLICY = len(naive.OP_STAT_NAMES_POLICY)  # verl's and TRL's statistics
N_STATS_VALUE = len(naive.STAT_NAMES_VALUE)

# The Triton kernels take both losses' parameters as one 4-tuple and the "off" values of the
# shared loss math (csrc/common/loss_math.h): dual clip / value clip <= 0 is off, a negative
# global denominator value is none.
_OFF = 0.0
_NO_DENOM = -1.0


def _outputs(x, n_stats):
    out = acc_dtype(x.dtype)
    return (
        x.new_empty((), dtype=out),
        x.new_empty((n_stats,), dtype=out),
        x.new_empty((x.shape[0],), dtype=out),
    )


def _gden(global_denom, global_denom_value, like):
    """The eager implementations' denominator tensor (a Python number only reaches here from a
    direct op call; the public API passes numbers on to the kernels as numbers)."""
    if global_denom is not None:
        return global_denom.reshape(()).to(like.device)
    if global_denom_value is not None:
        return torch.full((), global_denom_value, dtype=acc_dtype(like.dtype), device=like.device)
    return None


def _eager_grad(token_grad, x, mask, row_coef, grad_loss):
    """grad_loss * row_coef[b] * mask * d loss / dx, zero where mask == 0."""
    g = token_grad
    m = mask.to(g.dtype)
    out = torch.where(m != 0, row_coef.to(g.dtype)[:, None] * m * g, 0.0) * grad_loss.to(g.dtype)
    return out.to(x.dtype)


def _triton_loss(kind, x, y, z, mask, params, agg, scale, gd, gdv, n_stats):
    from . import triton_kernels

    return triton_kernels.loss_forward(
        kind,
        x,
        y,
        z,
        mask,
        params,
        _modes.index("agg", _modes.AGG_MODES, agg),
        scale,
        gd,
        _NO_DENOM if gdv is None else gdv,
        n_stats,
    )


def _policy_params(clip_low, clip_high, dual_clip, log_ratio_clamp):
    return (clip_low, clip_high, _OFF if dual_clip is None else dual_clip, log_ratio_clamp)


# The fakes and fallbacks check devices as the C++ checks do (a meta tensor sends a call to its
# fake whatever the other arguments' devices); names as the schemas write them.
def _policy_devices(lp, old, adv, mask, **more):
    check_devices("logprobs", lp, old_logprobs=old, advantages=adv, mask=mask, **more)


def _value_devices(v, vo, ret, mask, **more):
    check_devices("values", v, old_values=vo, returns=ret, mask=mask, **more)


# --------------------------------------------------------------------------- policy loss
@_backend.fake("ppo_policy_loss")
def _(lp, old, adv, mask, clip_low, clip_high, dual_clip, lr_clamp, agg, scale, gd, gdv):
    _policy_devices(lp, old, adv, mask, global_denom=gd)
    return _outputs(lp, N_STATS_POLICY)


@_backend.impl("ppo_policy_loss", "triton")
def _(lp, old, adv, mask, clip_low, clip_high, dual_clip, lr_clamp, agg, scale, gd, gdv):
    params = _policy_params(clip_low, clip_high, dual_clip, lr_clamp)
    return _triton_loss(0, lp, old, adv, mask, params, agg, scale, gd, gdv, N_STATS_POLICY)


@_backend.impl("ppo_policy_loss", "eager")
def _(lp, old, adv, mask, clip_low, clip_high, dual_clip, lr_clamp, agg, scale, gd, gdv):
    loss, stats, coef = naive.policy_loss(
        lp, old, adv, mask, clip_low, clip_high, dual_clip, agg, lr_clamp, scale,
        _gden(gd, gdv, lp),
    )  # fmt: skip
    out = acc_dtype(lp.dtype)
    return loss.to(out), stats.to(out), coef.to(out)


@_backend.fake("ppo_policy_loss_backward")
def _(grad, lp, old, adv, mask, coef, clip_low, clip_high, dual_clip, lr_clamp):
    _policy_devices(lp, old, adv, mask, grad_loss=grad, row_coef=coef)
    return torch.empty_like(lp)


@_backend.impl("ppo_policy_loss_backward", "triton")
def _(grad, lp, old, adv, mask, coef, clip_low, clip_high, dual_clip, lr_clamp):
    from . import triton_kernels

    params = _policy_params(clip_low, clip_high, dual_clip, lr_clamp)
    return triton_kernels.loss_backward(0, grad, lp, old, adv, mask, coef, params)


@_backend.impl("ppo_policy_loss_backward", "eager")
def _(grad, lp, old, adv, mask, coef, clip_low, clip_high, dual_clip, lr_clamp):
    g = naive.policy_token_grad(lp, old, adv, clip_low, clip_high, dual_clip, lr_clamp)
    return _eager_grad(g, lp, mask, coef, grad)


# --------------------------------------------------------------------------- value loss
@_backend.fake("ppo_value_loss")
def _(v, vo, ret, mask, clip, agg, scale, gd, gdv):
    _value_devices(v, vo, ret, mask, global_denom=gd)
    return _outputs(v, N_STATS_VALUE)


@_backend.impl("ppo_value_loss", "triton")
def _(v, vo, ret, mask, clip, agg, scale, gd, gdv):
    params = (_OFF if clip is None else clip, 0.0, 0.0, 0.0)
    return _triton_loss(1, v, vo, ret, mask, params, agg, scale, gd, gdv, N_STATS_VALUE)


@_backend.impl("ppo_value_loss", "eager")
def _(v, vo, ret, mask, clip, agg, scale, gd, gdv):
    loss, stats, coef = naive.value_loss(v, vo, ret, mask, clip, agg, scale, _gden(gd, gdv, v))
    out = acc_dtype(v.dtype)
    return loss.to(out), stats.to(out), coef.to(out)


@_backend.fake("ppo_value_loss_backward")
def _(grad, v, vo, ret, mask, coef, clip):
    _value_devices(v, vo, ret, mask, grad_loss=grad, row_coef=coef)
    return torch.empty_like(v)


@_backend.impl("ppo_value_loss_backward", "triton")
def _(grad, v, vo, ret, mask, coef, clip):
    from . import triton_kernels

    params = (_OFF if clip is None else clip, 0.0, 0.0, 0.0)
    return triton_kernels.loss_backward(1, grad, v, vo, ret, mask, coef, params)


@_backend.impl("ppo_value_loss_backward", "eager")
def _(grad, v, vo, ret, mask, coef, clip):
    return _eager_grad(naive.value_token_grad(v, vo, ret, clip), v, mask, coef, grad)


# --------------------------------------------------------------------------- masked_aggregate
def _aggregate(x, mask, agg, scale, gd, gdv):
    """The composition: rows' masked sums and mask totals in the accumulation dtype (masked NaN
    never reach them), the row coefficients of the totals, the loss."""
    acc = acc_dtype(x.dtype)
    if mask.dtype == torch.bool:  # 0 / 1 weights: selecting is weighting (one pass fewer)
        row_sums = torch.where(mask, x, 0.0).sum(-1, dtype=acc)
        counts = mask.view(torch.uint8).sum(-1, dtype=acc)  # as bytes: far faster on the CPU
    else:
        m = mask.to(acc)
        row_sums = (torch.where(m != 0, x, 0.0) * m).sum(-1)
        counts = m.sum(-1)
    den = _gden(gd, gdv, x)
    coef = naive.row_coefficients_of_counts(counts, agg, scale, den)  # the mask's alone
    return (coef * row_sums).sum(), coef


@_backend.fake("masked_aggregate")
def _(x, mask, agg, scale, gd, gdv):
    check_devices("loss_mat", x, mask=mask, global_denom=gd)
    out = acc_dtype(x.dtype)
    return x.new_empty((), dtype=out), x.new_empty((x.shape[0],), dtype=out)


@_backend.impl("masked_aggregate", "eager")
def _(x, mask, agg, scale, gd, gdv):
    loss, coef = _aggregate(x.detach(), mask, agg, scale, gd, gdv)
    out = acc_dtype(x.dtype)
    return loss.to(out), coef.to(out)


@_backend.fake("masked_aggregate_backward")
def _(grad, mask, coef, dtype):
    check_devices("mask", mask, grad_loss=grad, row_coef=coef)
    return mask.new_empty(mask.shape, dtype=dtype)


@_backend.impl("masked_aggregate_backward", "eager")
def _(grad, mask, coef, dtype):
    m = mask.to(coef.dtype)
    g = torch.where(m != 0, coef[:, None] * m, 0.0) * grad.to(coef.dtype)
    return g.to(dtype)


# --------------------------------------------------------------------------- no extension
# The references themselves, differentiable by autograd (the gradient flows to the first input).
@_backend.fallback("ppo_policy_loss")
def _(lp, old, adv, mask, clip_low, clip_high, dual_clip, lr_clamp, agg, scale, gd, gdv):
    _policy_devices(lp, old, adv, mask, global_denom=gd)
    loss, stats, coef = naive.policy_loss(
        lp, old.detach(), adv.detach(), mask, clip_low, clip_high, dual_clip, agg, lr_clamp,
        scale, _gden(gd, gdv, lp),
    )  # fmt: skip
    out = acc_dtype(lp.dtype)
    return loss.to(out), stats.detach().to(out), coef.detach().to(out)


@_backend.fallback("ppo_value_loss")
def _(v, vo, ret, mask, clip, agg, scale, gd, gdv):
    _value_devices(v, vo, ret, mask, global_denom=gd)
    loss, stats, coef = naive.value_loss(
        v, vo.detach(), ret.detach(), mask, clip, agg, scale, _gden(gd, gdv, v)
    )
    out = acc_dtype(v.dtype)
    return loss.to(out), stats.detach().to(out), coef.detach().to(out)


@_backend.fallback("masked_aggregate")
def _(x, mask, agg, scale, gd, gdv):
    check_devices("loss_mat", x, mask=mask, global_denom=gd)
    loss, coef = _aggregate(x, mask, agg, scale, gd, gdv)
    out = acc_dtype(x.dtype)
    return loss.to(out), coef.detach().to(out)
