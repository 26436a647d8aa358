"""kl_penalty and kl_penalized_rewards as torch ops (`ppo_kernels::kl_penalty`,
`ppo_kernels::kl_penalized_rewards`) with fake kernels, registered autograd (kl_penalty) and a
backend per call. Semantics and edge cases: ppo_kernels/kl/reference.py."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend, _modes
from .._checks import (
    FLOAT_DTYPES,
    check_arg,
    check_bool,
    check_float,
    check_same_device,
    check_shape,
    check_str,
    check_tensor,
)
from . import reference
from .reference import KLClamp, parse_estimator, resolve_clamp

# Elementwise / one-row ops: Triton is the GPU kernel (a CUDA C++ kernel would not read less).
_backend.register_op(
    "kl_penalty", kernel="kl_penalty_fwd", triton=True, cuda_default="triton", folder="kl"
)
_backend.register_op(
    "kl_penalized_rewards", kernel="kl_rewards_fwd", triton=True, cuda_default="triton", folder="kl"
)


def _check_op_args(logprobs, ref_logprobs, estimator, in_lo, in_hi, out_lo, out_hi):
    """What the registered ops are given, whoever calls them (metadata only)."""
    check_tensor("logprobs", logprobs, dtypes=FLOAT_DTYPES)
    check_arg(
        "ref_logprobs",
        ref_logprobs,
        logprobs.device,
        dtypes=(logprobs.dtype,),
        shape=logprobs.shape,
        what="like logprobs",
    )
    check_str("estimator", estimator, _modes.KL_ESTIMATORS)
    for name, lo, hi in (("clamp log_ratio", in_lo, in_hi), ("clamp value", out_lo, out_hi)):
        if not (check_float(name, lo, finite=False) <= check_float(name, hi, finite=False)):
            raise ValueError(f"{name}: bounds must satisfy lo <= hi, got ({lo}, {hi})")


def _check_backward_args(
    grad,
    logprobs,
    ref_logprobs,
    estimator,
    straight_through,
    in_lo,
    in_hi,
    out_lo,
    out_hi,
    need_lp,
    need_ref,
):
    _check_op_args(logprobs, ref_logprobs, estimator, in_lo, in_hi, out_lo, out_hi)
    check_arg(
        "grad",
        grad,
        logprobs.device,
        dtypes=FLOAT_DTYPES,
        shape=logprobs.shape,
        what="like logprobs",
    )
    for name, b in (
        ("straight_through", straight_through),
        ("need_lp", need_lp),
        ("need_ref", need_ref),
    ):
        check_bool(name, b)


# The kernels, one implementation per backend with one signature. estimator: a canonical name
# of _modes.KL_ESTIMATORS; clamps: (in_lo, in_hi, out_lo, out_hi), +-inf = no bound.
forward = _backend.Kernel("kl_penalty", "forward")
backward = _backend.Kernel("kl_penalty", "backward")
rewards = _backend.Kernel("kl_penalized_rewards", "forward")


def _est(estimator):  # the Triton kernels specialise on the estimator's index
    return _modes.index("estimator", _modes.KL_ESTIMATORS, estimator)


@forward.impl("cpp")
def _(logprobs, ref_logprobs, estimator, straight_through, bounds):
    return _backend.cpp_ops().kl_penalty_fwd(
        logprobs, ref_logprobs, estimator, straight_through, *bounds
    )


@forward.impl("triton")
def _(logprobs, ref_logprobs, estimator, straight_through, bounds):
    from . import triton_kernels

    return triton_kernels.forward(logprobs, ref_logprobs, _est(estimator), bounds)


@forward.impl("eager")
def _(logprobs, ref_logprobs, estimator, straight_through, bounds):
    v = reference.kl_penalty(logprobs, ref_logprobs, estimator, False, bounds)
    return v.to(_backend.out_dtype(logprobs)).contiguous()


@backward.impl("cpp")
def _(logprobs, grad, ref_logprobs, estimator, straight_through, bounds, need_lp, need_ref):
    return _backend.cpp_ops().kl_penalty_bwd(
        grad, logprobs, ref_logprobs, estimator, straight_through, *bounds, need_lp, need_ref
    )


@backward.impl("triton")
def _(logprobs, grad, ref_logprobs, estimator, straight_through, bounds, need_lp, need_ref):
    from . import triton_kernels

    return triton_kernels.backward(
        grad, logprobs, ref_logprobs, _est(estimator), straight_through, bounds, need_lp, need_ref
    )


@backward.impl("eager")
def _(logprobs, grad, ref_logprobs, estimator, straight_through, bounds, need_lp, need_ref):
    g = grad * reference.kl_penalty_grad(
        logprobs, ref_logprobs, estimator, straight_through, bounds
    )
    empty = logprobs.new_empty(0)
    return (g.to(logprobs.dtype) if need_lp else empty), (
        (-g).to(logprobs.dtype) if need_ref else logprobs.new_empty(0)
    )


@rewards.impl("cpp")
def _(logprobs, scores, ref_logprobs, mask, beta_t, beta, estimator, bounds):
    return _backend.cpp_ops().kl_rewards_fwd(
        scores, logprobs, ref_logprobs, mask, beta_t, beta, estimator, *bounds
    )


@rewards.impl("triton")
def _(logprobs, scores, ref_logprobs, mask, beta_t, beta, estimator, bounds):
    from . import triton_kernels

    return triton_kernels.rewards(
        scores, logprobs, ref_logprobs, mask, beta_t, beta, _est(estimator), bounds
    )


@rewards.impl("eager")
def _(logprobs, scores, ref_logprobs, mask, beta_t, beta, estimator, bounds):
    b = beta if beta_t is None else beta_t * beta
    r, k, m = reference.kl_penalized_rewards(
        scores, logprobs, ref_logprobs, mask, b, estimator, bounds
    )
    out = _backend.out_dtype(logprobs)
    return r.to(out).contiguous(), k.to(out).contiguous(), m.to(out).contiguous()


@torch.library.custom_op("ppo_kernels::kl_penalty", mutates_args=())
def kl_penalty_op(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str,
    straight_through: bool,
    in_lo: float,
    in_hi: float,
    out_lo: float,
    out_hi: float,
) -> Tensor:
    """estimator: a name of _modes.KL_ESTIMATORS; clamp bounds +-inf = none."""
    _check_op_args(logprobs, ref_logprobs, estimator, in_lo, in_hi, out_lo, out_hi)
    return forward(
        logprobs, ref_logprobs, estimator, straight_through, (in_lo, in_hi, out_lo, out_hi)
    )


@kl_penalty_op.register_fake
def _(logprobs, ref_logprobs, estimator, straight_through, in_lo, in_hi, out_lo, out_hi):
    return torch.empty(logprobs.shape, dtype=_backend.out_dtype(logprobs), device=logprobs.device)


@torch.library.custom_op("ppo_kernels::kl_penalty_backward", mutates_args=())
def kl_penalty_backward_op(
    grad: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str,
    straight_through: bool,
    in_lo: float,
    in_hi: float,
    out_lo: float,
    out_hi: float,
    need_lp: bool,
    need_ref: bool,
) -> tuple[Tensor, Tensor]:
    """(grad_logprobs, grad_ref_logprobs), each an empty tensor when not needed."""
    _check_backward_args(
        grad,
        logprobs,
        ref_logprobs,
        estimator,
        straight_through,
        in_lo,
        in_hi,
        out_lo,
        out_hi,
        need_lp,
        need_ref,
    )
    return backward(
        logprobs,
        grad,
        ref_logprobs,
        estimator,
        straight_through,
        (in_lo, in_hi, out_lo, out_hi),
        need_lp,
        need_ref,
    )


@kl_penalty_backward_op.register_fake
def _(
    grad,
    logprobs,
    ref_logprobs,
    estimator,
    straight_through,
    in_lo,
    in_hi,
    out_lo,
    out_hi,
    need_lp,
    need_ref,
):
    def out(need):
        return torch.empty(
            logprobs.shape if need else (0,), dtype=logprobs.dtype, device=logprobs.device
        )

    return out(need_lp), out(need_ref)


def _setup_context(ctx, inputs, output):
    logprobs, ref_logprobs, *args = inputs
    ctx.save_for_backward(logprobs, ref_logprobs)
    ctx.args = args


def _backward(ctx, grad):
    logprobs, ref_logprobs = ctx.saved_tensors
    need_lp, need_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ga, gb = torch.ops.ppo_kernels.kl_penalty_backward(
        grad, logprobs, ref_logprobs, *ctx.args, need_lp, need_ref
    )
    return (ga if need_lp else None), (gb if need_ref else None), None, None, None, None, None, None


kl_penalty_op.register_autograd(_backward, setup_context=_setup_context)


def _common_pair(logprobs: Tensor, ref_logprobs: Tensor, what: str):
    check_tensor("logprobs", logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("ref_logprobs", ref_logprobs, dtypes=FLOAT_DTYPES)
    check_same_device(logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_shape("ref_logprobs", ref_logprobs, logprobs.shape, what)
    dt = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
    return logprobs.to(dt), ref_logprobs.to(dt)


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str = "k1",
    *,
    clamp: str | KLClamp | None = "none",
    is_logprobs: Tensor | None = None,
    is_clip: float = 10.0,
) -> Tensor:
    """Per-token KL estimate between the policy and the reference from sampled-token log-probs.

    Args:
        logprobs, ref_logprobs: same shape, float32 / bfloat16 / float16 / float64 (mixed dtypes
            are promoted). Gradients flow to both.
        estimator: "k1" ("kl"), "abs", "k2" ("mse"), "k3" ("low_var_kl"), or any of them with a
            "+" suffix (straight-through: this value, the gradient of k2).
        is_logprobs: with a "+" estimator, the log-probs of the policy that sampled the tokens:
            the k2 gradient is importance-weighted by `w = min(exp(logprobs - is_logprobs),
            is_clip)` (detached), OpenRLHF's `unbiased_gradient` with `log_probs_old`.
        clamp: the peers' clamp conventions by name -- "none" (= "trl"), "verl", "openrlhf" -- or
            explicit bounds `KLClamp(log_ratio=(lo, hi), value=(lo, hi))` (None: unbounded).

    Returns:
        float32 tensor of logprobs' shape (float64 for float64 input). Gradients are exact,
        including through clamps (zero where a clamp is active, as torch.clamp).
    See ppo_kernels/kl/reference.py for the formulas, presets and edge cases.
    """
    name, st = parse_estimator(estimator)
    bounds = resolve_clamp(clamp, name)
    logprobs, ref_logprobs = _common_pair(logprobs, ref_logprobs, "logprobs.shape")
    kl = torch.ops.ppo_kernels.kl_penalty(logprobs, ref_logprobs, name, st, *bounds)
    if is_logprobs is None:
        return kl
    if not st:
        raise ValueError(
            "is_logprobs: importance weights apply to the straight-through gradient; "
            f"use a '+' estimator (got {estimator!r})"
        )
    check_tensor("is_logprobs", is_logprobs, dtypes=FLOAT_DTYPES)
    check_same_device(logprobs=logprobs, is_logprobs=is_logprobs)
    check_shape("is_logprobs", is_logprobs, logprobs.shape, "logprobs.shape")
    if not (float(is_clip) > 0):
        raise ValueError(f"is_clip: expected a positive number, got {is_clip!r}")
    # the value unchanged (kl + w * 0 is kl exactly), the gradient scaled by the detached weight
    w = torch.exp(logprobs.detach().to(kl.dtype) - is_logprobs.detach().to(kl.dtype)).clamp(
        max=float(is_clip)
    )
    return kl.detach() + w * (kl - kl.detach())


def _check_rewards_args(
    scores, logprobs, ref_logprobs, mask, beta_t, beta, estimator, in_lo, in_hi, out_lo, out_hi
):
    _check_op_args(logprobs, ref_logprobs, estimator, in_lo, in_hi, out_lo, out_hi)
    check_tensor("logprobs", logprobs, dim=2)
    dev, B = logprobs.device, logprobs.shape[0]
    check_arg("scores", scores, dev, dtypes=FLOAT_DTYPES, shape=(B,), what="[B]")
    check_arg("mask", mask, dev, shape=logprobs.shape, what="like logprobs")
    if beta_t is not None:
        check_arg("beta", beta_t, dev, dtypes=FLOAT_DTYPES)
        if beta_t.numel() not in (1, B):
            raise ValueError(f"beta: expected 1 or {B} values, got shape {tuple(beta_t.shape)}")
    check_float("beta", beta)


@torch.library.custom_op("ppo_kernels::kl_penalized_rewards", mutates_args=())
def kl_penalized_rewards_op(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    beta_t: Tensor | None,
    beta: float,
    estimator: str,
    in_lo: float,
    in_hi: float,
    out_lo: float,
    out_hi: float,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_rewards_args(
        scores, logprobs, ref_logprobs, mask, beta_t, beta, estimator, in_lo, in_hi, out_lo, out_hi
    )
    return rewards(
        logprobs,
        scores,
        ref_logprobs,
        mask,
        beta_t,
        beta,
        estimator,
        (in_lo, in_hi, out_lo, out_hi),
    )


@kl_penalized_rewards_op.register_fake
def _(scores, logprobs, ref_logprobs, mask, beta_t, beta, estimator, in_lo, in_hi, out_lo, out_hi):
    out = _backend.out_dtype(logprobs)
    B, T = logprobs.shape
    return (
        logprobs.new_empty((B, T), dtype=out),
        logprobs.new_empty((B, T), dtype=out),
        logprobs.new_empty((B,), dtype=out),
    )


def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    *,
    beta: float | Tensor,
    estimator: str = "k1",
    clamp: str | KLClamp | None = "none",
    kl: Tensor | None = None,
    convention: str = "verl",
) -> tuple[Tensor, Tensor, Tensor]:
    """RLHF-PPO per-token rewards in one pass:
    `r[t] = -beta * kl[t] * mask[t] + score * [t == last position with mask != 0]`.

    Args:
        scores: `[B]` sequence scores (reward model or verifier), any float dtype.
        logprobs, ref_logprobs: `[B, T]` sampled-token log-probs of the policy and the reference.
        mask: `[B, T]` action mask: bool, integer 0/1, or float weights.
        beta: KL coefficient: a float, or a 0-dim / `[B]` tensor (e.g. an adaptive KL controller's
            value, read on the device: no sync, no recompile). Under torch.compile a float beta is
            a constant of the graph, so pass a changing beta as a tensor.
        estimator, clamp: as in `kl_penalty` (straight-through "+" variants equal their base here).
        kl: a precomputed per-token KL `[B, T]` instead of logprobs / ref_logprobs (pass None for
            both; estimator and clamp are then not used), as OpenRLHF's compute_reward takes it.
        scores may also be token-level `[B, T]` (verl's token_level_scores): they are added as
            they are, `r = scores - beta * kl * mask`.
        convention: "verl" (above) or "openrlhf": the penalty `-beta * kl` on every position
            (mask == 0 ones too), and a row with no action gets its score on its last position.

    Returns:
        `(token_rewards [B, T], kl [B, T], mean_kl_per_sequence [B])`, float32 (float64 for
        float64 log-probs); kl is 0 where mask == 0. A row with no action: all zeros, its score
        dropped, mean kl 0. No gradient flows (the inputs are detached).
    """
    if convention not in ("verl", "openrlhf"):
        raise ValueError(f"convention: expected 'verl' or 'openrlhf', got {convention!r}")
    if kl is not None:
        if logprobs is not None or ref_logprobs is not None:
            raise ValueError(
                "kl: pass either a precomputed kl or logprobs and ref_logprobs, not both"
            )
        check_tensor("kl", kl, dtypes=FLOAT_DTYPES, dim=2)
        # kl - 0 under k1 with no clamp is kl exactly: the op masks it and places the scores
        logprobs, ref_logprobs, estimator, clamp = kl, torch.zeros_like(kl), "k1", "none"
    elif logprobs is None or ref_logprobs is None:
        raise ValueError("logprobs, ref_logprobs: required unless kl is given")
    name, _ = parse_estimator(estimator)
    bounds = resolve_clamp(clamp, name)
    logprobs, ref_logprobs = _common_pair(logprobs, ref_logprobs, "logprobs.shape")
    check_tensor("logprobs", logprobs, dim=2)
    B = logprobs.shape[0]
    check_tensor("scores", scores, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask)
    check_same_device(logprobs=logprobs, scores=scores, mask=mask)
    token_scores = None
    if scores.dim() == 2:
        check_shape("scores", scores, logprobs.shape, "[B] or logprobs.shape")
        token_scores, scores = scores, scores.new_zeros(B)
    check_shape("scores", scores, (B,), "[B] or logprobs.shape")
    check_shape("mask", mask, logprobs.shape, "logprobs.shape")
    if mask.dtype.is_complex:
        raise TypeError("mask: complex masks are not supported")
    if mask.dtype not in (torch.bool, torch.float32) and not (
        mask.dtype == torch.float64 and logprobs.dtype == torch.float64
    ):
        mask = mask.to(torch.float32)
    beta_t = None
    if isinstance(beta, torch.Tensor):
        check_tensor("beta", beta, dtypes=FLOAT_DTYPES)
        check_same_device(logprobs=logprobs, beta=beta)
        if beta.dim() > 1 or (beta.dim() == 1 and beta.shape[0] != B):
            raise ValueError(
                f"beta: expected a float, a 0-dim tensor or shape ({B},), got {tuple(beta.shape)}"
            )
        beta_t, beta_f = beta.detach(), 1.0
    else:
        beta_f = check_float("beta", beta)
    r, k, mean_kl = torch.ops.ppo_kernels.kl_penalized_rewards(
        scores.detach(),
        logprobs.detach(),
        ref_logprobs.detach(),
        mask,
        beta_t,
        beta_f,
        name,
        *bounds,
    )
    if token_scores is not None:
        r = r + token_scores.detach().to(r.dtype)
    if convention == "openrlhf":
        r = _openrlhf_placement(
            r,
            scores.detach(),
            logprobs.detach(),
            ref_logprobs.detach(),
            mask,
            beta_t,
            beta_f,
            name,
            bounds,
        )
    return r, k, mean_kl


def _openrlhf_placement(r, scores, logprobs, ref_logprobs, mask, beta_t, beta_f, name, bounds):
    """OpenRLHF's compute_reward on top of the masked result: the penalty on mask == 0 positions
    too, and an action-less row's score on its last position."""
    off = mask == 0
    kl_all = torch.ops.ppo_kernels.kl_penalty(logprobs, ref_logprobs, name, False, *bounds).to(
        r.dtype
    )
    beta = beta_f
    if beta_t is not None:
        beta = (beta_t * beta_f).to(r.dtype)
        beta = beta.reshape(-1, 1) if beta.dim() else beta
    r = r - torch.where(off, beta * kl_all, torch.zeros((), dtype=r.dtype, device=r.device))
    empty = off.all(-1)
    last = torch.zeros_like(r)
    last[:, -1] = torch.where(
        empty, scores.to(r.dtype), torch.zeros((), dtype=r.dtype, device=r.device)
    )
    return r + last
