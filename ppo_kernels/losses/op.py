"""PPO policy / value losses, reward-model and DPO losses as torch ops.

`ppo_kernels::ppo_policy_loss` and `ppo_kernels::ppo_value_loss` return (loss, stats, row_coef):
one fused pass over the tokens computes the per-token loss, the per-row partial sums and the
aggregation (verl's four `agg_loss` modes) with no host synchronisation; `row_coef` (the weight
d loss / d token-loss of each row, non-differentiable) is saved for the backward op, which
recomputes the per-token gradient from the inputs. Backends: "cpp" (C++ on the CPU), "triton" (the
GPU default; CPU under TRITON_INTERPRET=1), "eager" (reference.py, and always for float64).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend, _modes
from .._checks import (
    check_arg,
    check_float,
    check_int,
    check_same_device,
    check_shape,
    check_str,
    check_tensor,
)
from .._modes import AGG_MODES
from . import policy_loss as ext
from . import reference
from .policy_math import default_aggregation
from .reference import STAT_NAMES_POLICY, STAT_NAMES_VALUE

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
# Reward-model and DPO losses: B values, not B x T -- an eager composition is all they need.
_backend.register_op(
    "pairwise_logsigmoid_loss",
    kernel=None,
    triton=False,
    cuda_default="eager",
    public=("reward_model_loss", "dpo_loss"),
    folder="losses",
)

VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MASK_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
) + VALUE_DTYPES


def _gden(global_denom, global_denom_value, like):
    if global_denom is not None:
        return global_denom.reshape(()).to(like.device)
    if global_denom_value is not None:
        return torch.tensor(global_denom_value, dtype=_backend.out_dtype(like), device=like.device)
    return None


def _fake_outputs(x, n_stats):
    out = _backend.out_dtype(x)
    return (
        x.new_empty((), dtype=out),
        x.new_empty((n_stats,), dtype=out),
        x.new_empty((x.shape[0],), dtype=out),
    )


def _check_op_args(names, x, y, z, mask, agg=None, global_denom=None):
    """What the registered loss ops are given, whoever calls them: [B, T] inputs of one shape on
    one device (metadata only)."""
    check_tensor(names[0], x, dtypes=VALUE_DTYPES, dim=2)
    for n, t in zip(names[1:], (y, z)):
        check_arg(n, t, x.device, dtypes=VALUE_DTYPES, shape=x.shape, what=f"like {names[0]}")
    check_arg("mask", mask, x.device, dtypes=MASK_DTYPES, shape=x.shape, what=f"like {names[0]}")
    if agg is not None:
        check_str("agg", agg, AGG_MODES)
    if global_denom is not None:
        check_arg("global_denom", global_denom, x.device, dtypes=MASK_DTYPES)  # a count
        if global_denom.numel() != 1:
            raise ValueError(
                f"global_denom: expected a single value, got shape {tuple(global_denom.shape)}"
            )


def _check_backward_args(names, grad_loss, x, y, z, mask, row_coef):
    _check_op_args(names, x, y, z, mask)
    check_arg("grad_loss", grad_loss, x.device, dtypes=VALUE_DTYPES, shape=(), what="the loss")
    check_arg(
        "row_coef",
        row_coef,
        x.device,
        dtypes=(_backend.out_dtype(x),),
        shape=x.shape[:1],
        what="one per row",
    )


_POLICY = ("logprobs", "old_logprobs", "advantages")
_VALUE = ("values", "old_values", "returns")


def _eager_grad(token_grad, x, mask, row_coef, grad_loss):
    """grad_loss * row_coef[b] * mask * d loss / dx, zero where mask == 0."""
    g = token_grad
    m = mask.to(g.dtype)
    out = torch.where(m != 0, row_coef.to(g.dtype)[:, None] * m * g, 0.0) * grad_loss.to(g.dtype)
    return out.to(x.dtype)


# The Triton kernels take both losses' parameters as one 4-tuple and the "off" values of the
# shared loss math (csrc/common/loss_math.h): dual clip / value clip <= 0 is off, a negative
# global denominator value is none.
_OFF = 0.0
_NO_DENOM = -1.0


def _triton_agg(agg):
    return _modes.index("agg", _modes.AGG_MODES, agg)


# The kernels, one implementation per backend with one signature. Inputs [B, T] contiguous; agg a
# name of _modes.AGG_MODES; dual_clip / clip / global_denom_value None = off / none. An empty
# input needs no kernel (eager).
policy_forward = _backend.Kernel("ppo_policy_loss", "forward", eager_if_empty=True)
policy_backward = _backend.Kernel("ppo_policy_loss", "backward", eager_if_empty=True)
value_forward = _backend.Kernel("ppo_value_loss", "forward", eager_if_empty=True)
value_backward = _backend.Kernel("ppo_value_loss", "backward", eager_if_empty=True)


@policy_forward.impl("cpp")
def _(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
    agg,
    scale,
    global_denom,
    global_denom_value,
):
    return _backend.cpp_ops().ppo_policy_loss_fwd(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low,
        clip_high,
        dual_clip,
        log_ratio_clamp,
        agg,
        scale,
        global_denom,
        global_denom_value,
    )


@policy_forward.impl("triton")
def _(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
    agg,
    scale,
    global_denom,
    global_denom_value,
):
    from . import triton_kernels

    params = (clip_low, clip_high, _OFF if dual_clip is None else dual_clip, log_ratio_clamp)
    return triton_kernels.loss_forward(
        0,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        params,
        _triton_agg(agg),
        scale,
        global_denom,
        _NO_DENOM if global_denom_value is None else global_denom_value,
        4,
    )


@policy_forward.impl("eager")
def _(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
    agg,
    scale,
    global_denom,
    global_denom_value,
):
    loss, stats, coef = reference.policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low,
        clip_high,
        dual_clip,
        agg,
        log_ratio_clamp,
        scale,
        _gden(global_denom, global_denom_value, logprobs),
    )
    out = _backend.out_dtype(logprobs)
    return loss.to(out), stats.to(out), coef.to(out)


@policy_backward.impl("cpp")
def _(
    logprobs,
    grad_loss,
    old_logprobs,
    advantages,
    mask,
    row_coef,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
):
    return _backend.cpp_ops().ppo_policy_loss_bwd(
        grad_loss,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        row_coef,
        clip_low,
        clip_high,
        dual_clip,
        log_ratio_clamp,
    )


@policy_backward.impl("triton")
def _(
    logprobs,
    grad_loss,
    old_logprobs,
    advantages,
    mask,
    row_coef,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
):
    from . import triton_kernels

    params = (clip_low, clip_high, _OFF if dual_clip is None else dual_clip, log_ratio_clamp)
    return triton_kernels.loss_backward(
        0, grad_loss, logprobs, old_logprobs, advantages, mask, row_coef, params
    )


@policy_backward.impl("eager")
def _(
    logprobs,
    grad_loss,
    old_logprobs,
    advantages,
    mask,
    row_coef,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
):
    g = reference.policy_token_grad(
        logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip, log_ratio_clamp
    )
    return _eager_grad(g, logprobs, mask, row_coef, grad_loss)


@value_forward.impl("cpp")
def _(values, old_values, returns, mask, clip, agg, scale, global_denom, global_denom_value):
    return _backend.cpp_ops().ppo_value_loss_fwd(
        values, old_values, returns, mask, clip, agg, scale, global_denom, global_denom_value
    )


@value_forward.impl("triton")
def _(values, old_values, returns, mask, clip, agg, scale, global_denom, global_denom_value):
    from . import triton_kernels

    params = (_OFF if clip is None else clip, 0.0, 0.0, 0.0)
    return triton_kernels.loss_forward(
        1,
        values,
        old_values,
        returns,
        mask,
        params,
        _triton_agg(agg),
        scale,
        global_denom,
        _NO_DENOM if global_denom_value is None else global_denom_value,
        1,
    )


@value_forward.impl("eager")
def _(values, old_values, returns, mask, clip, agg, scale, global_denom, global_denom_value):
    loss, stats, coef = reference.value_loss(
        values,
        old_values,
        returns,
        mask,
        clip,
        agg,
        scale,
        _gden(global_denom, global_denom_value, values),
    )
    out = _backend.out_dtype(values)
    return loss.to(out), stats.to(out), coef.to(out)


@value_backward.impl("cpp")
def _(values, grad_loss, old_values, returns, mask, row_coef, clip):
    return _backend.cpp_ops().ppo_value_loss_bwd(
        grad_loss, values, old_values, returns, mask, row_coef, clip
    )


@value_backward.impl("triton")
def _(values, grad_loss, old_values, returns, mask, row_coef, clip):
    from . import triton_kernels

    return triton_kernels.loss_backward(
        1,
        grad_loss,
        values,
        old_values,
        returns,
        mask,
        row_coef,
        (_OFF if clip is None else clip, 0.0, 0.0, 0.0),
    )


@value_backward.impl("eager")
def _(values, grad_loss, old_values, returns, mask, row_coef, clip):
    g = reference.value_token_grad(values, old_values, returns, clip)
    return _eager_grad(g, values, mask, row_coef, grad_loss)


# --------------------------------------------------------------------------- policy loss
@torch.library.custom_op("ppo_kernels::ppo_policy_loss", mutates_args=())
def ppo_policy_loss_op(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
    agg: str,
    scale: float,
    global_denom: Tensor | None,
    global_denom_value: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """[B, T] contiguous inputs; dual_clip None: no dual clip; no global_denom and no
    global_denom_value: local denominators. Returns (loss [], stats [4], row_coef [B])."""
    _check_op_args(_POLICY, logprobs, old_logprobs, advantages, mask, agg, global_denom)
    return policy_forward(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low,
        clip_high,
        dual_clip,
        log_ratio_clamp,
        agg,
        scale,
        global_denom,
        global_denom_value,
    )


@ppo_policy_loss_op.register_fake
def _(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
    agg,
    scale,
    global_denom,
    global_denom_value,
):
    return _fake_outputs(logprobs, 4)


@torch.library.custom_op("ppo_kernels::ppo_policy_loss_backward", mutates_args=())
def ppo_policy_loss_backward_op(
    grad_loss: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    row_coef: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
) -> Tensor:
    _check_backward_args(_POLICY, grad_loss, logprobs, old_logprobs, advantages, mask, row_coef)
    return policy_backward(
        logprobs,
        grad_loss,
        old_logprobs,
        advantages,
        mask,
        row_coef,
        clip_low,
        clip_high,
        dual_clip,
        log_ratio_clamp,
    )


@ppo_policy_loss_backward_op.register_fake
def _(
    grad_loss,
    logprobs,
    old_logprobs,
    advantages,
    mask,
    row_coef,
    clip_low,
    clip_high,
    dual_clip,
    log_ratio_clamp,
):
    return torch.empty_like(logprobs)


def _policy_setup(ctx, inputs, output):
    lp, old, adv, mask, clip_low, clip_high, dual_clip, lrc, *_ = inputs
    _, stats, coef = output
    ctx.save_for_backward(lp, old, adv, mask, coef)
    ctx.params = (clip_low, clip_high, dual_clip, lrc)
    ctx.mark_non_differentiable(stats, coef)


def _policy_backward(ctx, grad_loss, grad_stats, grad_coef):
    lp, old, adv, mask, coef = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 12
    g = torch.ops.ppo_kernels.ppo_policy_loss_backward(
        grad_loss, lp, old, adv, mask, coef, *ctx.params
    )
    return (g,) + (None,) * 11


ppo_policy_loss_op.register_autograd(_policy_backward, setup_context=_policy_setup)


# --------------------------------------------------------------------------- value loss
@torch.library.custom_op("ppo_kernels::ppo_value_loss", mutates_args=())
def ppo_value_loss_op(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None,
    agg: str,
    scale: float,
    global_denom: Tensor | None,
    global_denom_value: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """clip None: unclipped. Returns (loss [], stats [1], row_coef [B])."""
    _check_op_args(_VALUE, values, old_values, returns, mask, agg, global_denom)
    return value_forward(
        values, old_values, returns, mask, clip, agg, scale, global_denom, global_denom_value
    )


@ppo_value_loss_op.register_fake
def _(values, old_values, returns, mask, clip, agg, scale, global_denom, global_denom_value):
    return _fake_outputs(values, 1)


@torch.library.custom_op("ppo_kernels::ppo_value_loss_backward", mutates_args=())
def ppo_value_loss_backward_op(
    grad_loss: Tensor,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    row_coef: Tensor,
    clip: float | None,
) -> Tensor:
    _check_backward_args(_VALUE, grad_loss, values, old_values, returns, mask, row_coef)
    return value_backward(values, grad_loss, old_values, returns, mask, row_coef, clip)


@ppo_value_loss_backward_op.register_fake
def _(grad_loss, values, old_values, returns, mask, row_coef, clip):
    return torch.empty_like(values)


def _value_setup(ctx, inputs, output):
    v, vo, ret, mask, clip, *_ = inputs
    _, stats, coef = output
    ctx.save_for_backward(v, vo, ret, mask, coef)
    ctx.clip = clip
    ctx.mark_non_differentiable(stats, coef)


def _value_backward(ctx, grad_loss, grad_stats, grad_coef):
    v, vo, ret, mask, coef = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 9
    g = torch.ops.ppo_kernels.ppo_value_loss_backward(grad_loss, v, vo, ret, mask, coef, ctx.clip)
    return (g,) + (None,) * 8


ppo_value_loss_op.register_autograd(_value_backward, setup_context=_value_setup)


# --------------------------------------------------------------------------- public API
def _check_loss_inputs(names, tensors, mask):
    x = tensors[0]
    for n, t in zip(names, tensors):
        check_tensor(n, t, dtypes=VALUE_DTYPES, min_dim=1)
        if tuple(t.shape) != tuple(x.shape):
            raise ValueError(
                f"{n}: expected shape {tuple(x.shape)} (like {names[0]}), got {tuple(t.shape)}"
            )
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    if tuple(mask.shape) != tuple(x.shape):
        raise ValueError(
            f"mask: expected shape {tuple(x.shape)} (like {names[0]}), got {tuple(mask.shape)}"
        )
    check_same_device(**dict(zip(names, tensors)), mask=mask)


AGG_NAMES = AGG_MODES + ("token-sum",)


def _aggregation(agg, T, dp_size, global_num_tokens, global_batch_size, loss_scale_factor, device):
    """(agg, scale, global_denom tensor or None, global_denom value or None).

    "token-sum" is token-mean over a denominator of 1. A normaliser the mode does not use
    (global_batch_size for the token modes, global_num_tokens for the sequence modes,
    loss_scale_factor outside seq-mean-token-sum-norm) is ignored, as verl's agg_loss does: verl
    passes all of them whatever the mode."""
    check_str("agg", agg, AGG_NAMES)
    dp_size = check_int("dp_size", dp_size, min_value=1)
    loss_scale_factor = check_float(
        "loss_scale_factor", loss_scale_factor, positive=True, allow_none=True
    )
    if agg == "token-sum":
        return "token-mean", float(dp_size), None, 1.0
    token = agg == "token-mean"
    denom, name = (
        (global_num_tokens, "global_num_tokens")
        if token
        else (global_batch_size, "global_batch_size")
    )
    if denom is None and dp_size > 1:
        raise ValueError(
            f"{name}: required when dp_size > 1 (the data-parallel total of "
            f"{'action tokens' if token else 'non-empty sequences'})"
        )
    scale = float(dp_size)
    if agg == "seq-mean-token-sum-norm":
        # default: T, as verl; T = 0 has no token, the loss is 0 whatever the factor
        lsf = max(T, 1) if loss_scale_factor is None else loss_scale_factor
        scale /= float(lsf)
    if isinstance(denom, Tensor):
        if denom.numel() != 1:
            raise ValueError(f"{name}: expected a single value, got shape {tuple(denom.shape)}")
        if denom.device != device:
            raise ValueError(f"{name}: expected device {device}, got {denom.device}")
        return agg, scale, denom.reshape(()), None
    if denom is not None:
        check_float(name, denom, nonneg=True)
        return agg, scale, None, float(denom)
    return agg, scale, None, None


def _denominator(agg, mask, gd, gdv):
    """The aggregation's denominator as a 0-dim tensor (no host sync): the global one when given,
    else the mask total (token-mean) or the number of non-empty rows (sequence modes)."""
    if gd is not None:
        return gd
    if gdv is not None:
        return torch.tensor(gdv, device=mask.device)
    m = _rows(mask)
    if agg == "token-mean":
        return m.sum(dtype=torch.float32 if not m.dtype == torch.float64 else torch.float64)
    return (m != 0).any(-1).sum()


def _empty_stats(stats, mask, empty):
    if empty == "zero":
        return stats
    if empty != "nan":
        raise ValueError(f"empty_stats: expected 'zero' or 'nan', got {empty!r}")
    some = (mask != 0).any()
    return {
        k: torch.where(some, v, torch.full((), float("nan"), dtype=v.dtype, device=v.device))
        for k, v in stats.items()
    }


def _empty_value(loss, agg, mask, gd, gdv, empty):
    """empty="zero": as computed (0 over a zero denominator); "nan": NaN there, as verl's and
    OpenRLHF's 0 / 0."""
    if empty == "zero":
        return loss
    if empty != "nan":
        raise ValueError(f"empty: expected 'zero' or 'nan', got {empty!r}")
    d = _denominator(agg, mask, gd, gdv)
    return torch.where(
        d != 0, loss, torch.full((), float("nan"), dtype=loss.dtype, device=loss.device)
    )


def _rows(t):
    return t.reshape(t.shape[:-1].numel(), t.shape[-1]).contiguous()  # not (-1, T): T may be 0


def _weighted(terms, weights, like, mask, agg, scale, gd, gdv):
    """(loss, stats) of per-token terms (loss, *stats) with the loss weighted per token: the
    reference composition, differentiable by autograd; denominators and stats from the mask."""
    check_tensor("weights", weights, dtypes=VALUE_DTYPES)
    check_shape("weights", weights, like.shape, "like the per-token inputs")
    check_same_device(weights=weights, mask=mask)
    token_loss, *stats = terms
    acc = token_loss.dtype
    if gd is None and gdv is not None:
        gd = torch.tensor(gdv, dtype=acc, device=like.device)
    loss, st, _ = reference.aggregate(
        token_loss * weights.detach().to(acc), [t.detach() for t in stats], mask, agg, scale, gd
    )
    return loss, st


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str | None = None,
    log_ratio_clamp: float | None = None,
    dp_size: int = 1,
    global_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
    loss_scale_factor: float | None = None,
    entropy: Tensor | None = None,
    approx_kl: str = "clamped",
    empty: str = "zero",
    empty_stats: str = "zero",
    weights: Tensor | None = None,
    loss_type: str = "ppo",
    importance_sampling_level: str = "token",
    delta: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    dro_beta: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 0.1,
    generator: torch.Generator | None = None,
    rollout_logprobs: Tensor | None = None,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | tuple[float, float] | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    bypass_mode: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped policy loss (verl's `compute_policy_loss_vanilla` + `agg_loss`), fused, and
    every other policy-loss type of verl's registry and of TRL / Liger (`loss_type`).

    Per token, with rho = exp(clamp(logprob - old_logprob, +-log_ratio_clamp)):
    `max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))`, and for A < 0 with dual clip
    `min(that, -A * dual_clip)`; aggregated over `mask` by `agg`:
      token-mean               sum(mask * l) / N * dp_size     (N = global_num_tokens or sum(mask))
      seq-mean-token-sum       sum_b sum_t(mask * l) / S * dp_size
      seq-mean-token-mean      sum_b [sum_t(mask * l) / sum_t mask] / S * dp_size
      seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor   (default: T, as verl)
      token-sum                sum(mask * l) * dp_size
    where S = global_batch_size or the number of rows with a non-empty mask; rows with an empty
    mask never count. Pass the data-parallel totals (numbers, or 0-dim tensors for no host sync)
    with dp_size > 1, as verl does.

    loss_type (formulas, statistics and which need a second pass: docs/ppo-math.md and
    ppo_kernels/losses/policy_math.py):
      "ppo"      the loss above (today's fused kernels).
      "grpo", "bnpo", "dr_grpo", "dapo", "luspo"  TRL's / Liger's clipped loss (with `delta`:
                 min(rho, delta) in the unclipped branch) under their normalisations when
                 agg=None: grpo = seq-mean-token-mean over all B rows, bnpo = token-mean,
                 dr_grpo = sum / (B * loss_scale_factor) (TRL's max_completion_length, default T),
                 dapo = token-mean over global_num_tokens (TRL's num_items_in_batch / processes),
                 luspo = seq-mean-token-sum over all B rows. No log-ratio clamp by default.
      "gspo", "sapo", "cispo", "gpg" (= "reinforce"), "dro", "dppo_tv", "dppo_kl", "geo_mean",
      "clip_cov", "kl_cov"  verl's registry entries of those names (sapo: `tau_pos`/`tau_neg`;
                 dro: `dro_beta`; dppo: clip_low / clip_high are the divergence thresholds and
                 dual_clip the ratio truncation, default 20; geo_mean: clip_low / clip_high bound
                 the log-ratio, the loss is the mean over the B rows (agg must stay None);
                 clip_cov / kl_cov: `clip_cov_*` / `kl_cov_*`, clip_cov draws its tokens with
                 `generator`). TRL's / Liger's cispo is "cispo" with clip_low=1 and
                 clip_high=epsilon_high - 1.
    agg None takes the type's default ("token-mean" for most); log_ratio_clamp None the peer's
    clamp of that type (20 for verl's ppo / sapo / cispo / dppo, 10 on the log sequence ratio
    for gspo, none otherwise). importance_sampling_level="sequence" (TRL's GSPO: the ratio of
    the row's mean log-ratio, gradient through the mean) applies to the clipped types, sapo and
    cispo.

    Rollout correction (verl's semantics, see `rollout_correction`): with `rollout_logprobs`,
    weights from old_logprobs vs rollout_logprobs (`rollout_is`, `rollout_is_threshold`,
    `rollout_is_batch_normalize`) multiply the per-token loss and rejected tokens
    (`rollout_rs`, `rollout_rs_threshold`) leave the mask. `bypass_mode=True` (verl's bypass:
    old_logprobs are the rollout log-probs): weights and rejection from the current log-probs
    (detached); the clipped types apply only the rejection, gpg / reinforce the weights too.

    Args:
        logprobs: `[..., T]` float32 / bfloat16 / float16 / float64; the gradient flows to it.
        old_logprobs: same shape, any float dtype (no gradient).
        advantages: same shape, or `[...]` (one per sequence).
        mask: same shape, bool / integer / float (a float mask weights tokens).
        clip_high: defaults to clip_low. dual_clip: None (off; verl's default is 3.0) or > 1.
        entropy: optional per-token entropy (same shape); adds the `entropy_mean` statistic
            (masked mean, no host sync). It does not enter the loss: add an entropy bonus with
            `masked_mean` / your aggregation as verl does.
        weights: optional per-token weights multiplying the per-token loss (detached).
    Returns:
        `(loss, stats)`: a 0-dim float32 loss (float64 for float64 logprobs) and 0-dim tensors
        `clip_frac`, `clip_frac_lower` (dual clip; 0 without it), `approx_kl` (masked mean of
        -log-ratio, verl's ppo_kl) and `ratio_mean`, all over the local (corrected) mask, no host
        sync (each as that type's verl function reports it); TRL's types (grpo, bnpo, dr_grpo,
        dapo, luspo, cispo) add TRL's `clip_low_frac` / `clip_high_frac` / `clip_region_frac`,
        `clip_low_frac_min`, `clip_high_frac_max` (and, at sequence level with per-sequence
        advantages, TRL's per-row `seq_clip_*_frac`); rollout correction adds `masked_fraction`,
        `is_weight_mean` and verl's metrics as `rollout_corr/<name>`.
    See ppo_kernels/losses/reference.py for the documented edge cases (all-zero mask: loss 0).
    """
    per_row_adv = (
        isinstance(advantages, Tensor)
        and isinstance(logprobs, Tensor)
        and logprobs.dim() >= 1
        and tuple(advantages.shape) == tuple(logprobs.shape[:-1])
    )
    if per_row_adv:
        check_tensor("advantages", advantages, dtypes=VALUE_DTYPES)
        full_adv = advantages.unsqueeze(-1).expand(logprobs.shape)
    else:
        per_row_adv, full_adv = False, advantages
    _check_loss_inputs(_POLICY, (logprobs, old_logprobs, full_adv), mask)
    cfg = ext.make_config(
        loss_type,
        clip_low,
        clip_high,
        dual_clip,
        delta,
        log_ratio_clamp,
        importance_sampling_level,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        dro_beta=dro_beta,
        clip_cov_ratio=clip_cov_ratio,
        clip_cov_lb=clip_cov_lb,
        clip_cov_ub=clip_cov_ub,
        kl_cov_ratio=kl_cov_ratio,
        kl_cov_coef=kl_cov_coef,
    )
    rollout = ext.rollout_options(
        cfg,
        rollout_logprobs,
        rollout_is,
        rollout_is_threshold,
        rollout_is_batch_normalize,
        rollout_rs,
        rollout_rs_threshold,
        bypass_mode,
    )
    if rollout_logprobs is not None:
        check_tensor("rollout_logprobs", rollout_logprobs, dtypes=VALUE_DTYPES)
        check_shape("rollout_logprobs", rollout_logprobs, logprobs.shape, "like logprobs")
        check_same_device(logprobs=logprobs, rollout_logprobs=rollout_logprobs)
    if agg is None:
        agg, all_rows = default_aggregation(cfg.loss_type)
        if all_rows and global_batch_size is None:
            global_batch_size = logprobs.shape[:-1].numel()  # TRL: every row counts
    elif cfg.loss_type == "geo_mean":
        raise ValueError(
            "agg: geo_mean averages its per-sequence losses over the rows; leave agg None"
        )
    agg_i, scale, gd, gdv = _aggregation(
        agg,
        logprobs.shape[-1],
        dp_size,
        global_num_tokens,
        global_batch_size,
        loss_scale_factor,
        logprobs.device,
    )
    if ext.needs_extension(cfg, rollout):
        loss, out, mask = ext.extended_policy_loss(
            cfg,
            rollout,
            logprobs,
            old_logprobs,
            advantages,
            mask,
            weights,
            agg_i,
            scale,
            gd,
            gdv,
            generator,
            rollout_logprobs,
        )
    elif weights is not None:
        terms = reference.policy_token_terms(
            logprobs,
            old_logprobs.detach(),
            full_adv.detach(),
            cfg.clip_low,
            cfg.clip_high,
            cfg.dual_clip,
            cfg.log_ratio_clamp,
        )
        loss, stats = _weighted(terms, weights, logprobs, mask, agg_i, scale, gd, gdv)
        out = dict(zip(STAT_NAMES_POLICY, stats.unbind(0)))
    else:
        loss, stats, _ = torch.ops.ppo_kernels.ppo_policy_loss(
            _rows(logprobs),
            _rows(old_logprobs),
            _rows(full_adv),
            _rows(mask),
            cfg.clip_low,
            cfg.clip_high,
            cfg.dual_clip,
            cfg.log_ratio_clamp,
            agg_i,
            scale,
            gd,
            gdv,
        )
        out = dict(zip(STAT_NAMES_POLICY, stats.unbind(0)))
    loss = _empty_value(loss, agg_i, mask, gd, gdv, empty)
    if approx_kl == "raw":
        out["approx_kl"] = _backend.op("masked_mean")(
            (old_logprobs.detach().float() - logprobs.detach().float()), mask, None, "zero"
        )
    elif approx_kl != "clamped":
        raise ValueError(f"approx_kl: expected 'clamped' or 'raw', got {approx_kl!r}")
    out = _empty_stats(out, mask, empty_stats)
    if entropy is not None:
        check_shape("entropy", entropy, logprobs.shape, "logprobs.shape")
        out["entropy_mean"] = _backend.op("masked_mean")(
            entropy.detach().float(), mask, None, "zero"
        )
    return loss, out


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = None,
    agg: str = "token-mean",
    dp_size: int = 1,
    global_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
    loss_scale_factor: float | None = None,
    empty: str = "zero",
    empty_stats: str = "zero",
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (verl's `compute_value_loss`), fused: per token
    `0.5 * max((v - G)^2, (clip(v, v_old - clip, v_old + clip) - G)^2)` (`0.5 * (v - G)^2` when
    clip is None), aggregated like `ppo_policy_loss` (`empty`, `empty_stats`, `weights` as there). The gradient flows to
    `values`.

    Returns `(loss, {"clip_frac": ...})` (clip_frac: masked mean of [clipped error > plain error])."""
    _check_loss_inputs(_VALUE, (values, old_values, returns), mask)
    clip = check_float("clip", clip, positive=True, allow_none=True)
    agg_i, scale, gd, gdv = _aggregation(
        agg,
        values.shape[-1],
        dp_size,
        global_num_tokens,
        global_batch_size,
        loss_scale_factor,
        values.device,
    )
    if weights is not None:
        terms = reference.value_token_terms(
            values, old_values.detach(), returns.detach(), float(clip) if clip is not None else None
        )
        loss, stats = _weighted(terms, weights, values, mask, agg_i, scale, gd, gdv)
    else:
        loss, stats, _ = torch.ops.ppo_kernels.ppo_value_loss(
            _rows(values),
            _rows(old_values),
            _rows(returns),
            _rows(mask),
            float(clip) if clip is not None else None,
            agg_i,
            scale,
            gd,
            gdv,
        )
    loss = _empty_value(loss, agg_i, mask, gd, gdv, empty)
    return loss, _empty_stats(dict(zip(STAT_NAMES_VALUE, stats.unbind(0))), mask, empty_stats)


# --------------------------------------------------------------------------- reward model / DPO
# Small elementwise ops (one value per pair): eager compositions inside a custom op with analytic
# gradients. A kernel would not pay here: there are B values, not B x T.
_REDUCTIONS = ("mean", "sum", "none")


def _reduce_grad(grad, n, reduction):
    if reduction == "mean":
        return grad / max(n, 1)
    return grad


@torch.library.custom_op("ppo_kernels::pairwise_logsigmoid_loss", mutates_args=())
def pairwise_logsigmoid_loss_op(z: Tensor, reduction: str) -> Tensor:
    """-logsigmoid(z) reduced ("mean", "sum" or "none"); z is the (scaled) preference margin."""
    check_tensor("z", z, dtypes=VALUE_DTYPES)
    check_str("reduction", reduction, _REDUCTIONS)
    _backend.backend_for("pairwise_logsigmoid_loss", z)  # eager; raises if another was requested
    loss = -torch.nn.functional.logsigmoid(z.to(_backend.out_dtype(z)))
    return reference._reduce(loss, reduction)


@pairwise_logsigmoid_loss_op.register_fake
def _(z, reduction):
    return z.new_empty(z.shape if reduction == "none" else (), dtype=_backend.out_dtype(z))


def _pls_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.reduction = inputs[1]


def _pls_backward(ctx, grad):
    (z,) = ctx.saved_tensors
    # d/dz -logsigmoid(z) = -sigmoid(-z), finite for any z
    g = -torch.sigmoid(-z.to(_backend.out_dtype(z))) * grad
    return _reduce_grad(g, z.numel(), ctx.reduction).to(z.dtype), None


pairwise_logsigmoid_loss_op.register_autograd(_pls_backward, setup_context=_pls_setup)


def _check_pairs(**tensors):
    first = next(iter(tensors))
    for n, t in tensors.items():
        check_tensor(n, t, dtypes=VALUE_DTYPES)
        if tuple(t.shape) != tuple(tensors[first].shape):
            raise ValueError(
                f"{n}: expected shape {tuple(tensors[first].shape)} (like {first}), got {tuple(t.shape)}"
            )
    check_same_device(**tensors)


def reward_model_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, *, reduction: str = "mean"
) -> Tensor:
    """Bradley-Terry reward-model loss `-log sigmoid(r_chosen - r_rejected)`, stable for any margin.

    reduction: "mean" (0 for no pairs), "sum" or "none" (per pair). float32 result (float64 for
    float64 inputs); gradients to both scores."""
    _check_pairs(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    check_str("reduction", reduction, _REDUCTIONS)
    acc = _backend.out_dtype(chosen_scores)
    z = chosen_scores.to(acc) - rejected_scores.to(acc)
    return torch.ops.ppo_kernels.pairwise_logsigmoid_loss(z, reduction)


def dpo_loss(
    policy_chosen_lp: Tensor,
    policy_rejected_lp: Tensor,
    ref_chosen_lp: Tensor,
    ref_rejected_lp: Tensor,
    *,
    beta: float,
    reduction: str = "mean",
) -> Tensor:
    """DPO loss `-log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l)))`, stable for any margin.

    The inputs are the summed log-probs of each response's action tokens (e.g. a masked sum of
    `token_logprobs`). Gradients flow to all four (detach the reference ones as usual)."""
    _check_pairs(
        policy_chosen_lp=policy_chosen_lp,
        policy_rejected_lp=policy_rejected_lp,
        ref_chosen_lp=ref_chosen_lp,
        ref_rejected_lp=ref_rejected_lp,
    )
    beta = check_float("beta", beta, positive=True)
    check_str("reduction", reduction, _REDUCTIONS)
    acc = _backend.out_dtype(policy_chosen_lp)
    z = float(beta) * (
        (policy_chosen_lp.to(acc) - ref_chosen_lp.to(acc))
        - (policy_rejected_lp.to(acc) - ref_rejected_lp.to(acc))
    )
    return torch.ops.ppo_kernels.pairwise_logsigmoid_loss(z, reduction)
