"""The public API of the KL ops: `kl_penalty` and `kl_penalized_rewards` (typed arguments,
defaults, presets). Tensor checks (dtype, shape, device) run once, in the registered ops
(csrc/ops/kl.cpp); this layer checks what only it sees (scalars, presets, promotions)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    check_devices,
    check_float,
    check_same_device,
    check_shape,
    check_tensor,
)
from . import op  # noqa: F401  (registers the ops' Python side)
from .naive import KLClamp, parse_estimator, resolve_clamp

_kl_penalty = _backend.op("kl_penalty")
_kl_rewards = _backend.op("kl_penalized_rewards")


_SETTINGS: dict = {}  # (estimator, clamp) -> (name, straight_through, bounds)


def _settings(estimator, clamp):
    """The canonical estimator and clamp bounds, cached per (estimator, clamp) argument pair."""
    key = (estimator, clamp)
    if not torch.compiler.is_compiling():
        try:
            hit = _SETTINGS.get(key)
        except TypeError:  # unhashable arguments: resolved uncached (same errors)
            key = hit = None
        if hit is not None:
            return hit
    name, st = parse_estimator(estimator)
    out = name, st, resolve_clamp(clamp, name)
    if key is not None and not torch.compiler.is_compiling() and len(_SETTINGS) < 256:
        _SETTINGS[key] = out
    return out


_F32 = torch.float32
_INF = float("inf")
_UNBOUNDED = (-_INF, _INF, -_INF, _INF)


def _plain_f32_pair(a: Tensor, b: Tensor) -> bool:
    """Unclamped k1 of float32 inputs is one IEEE subtraction, the kernels' result bit for bit:
    torch's own subtraction runs it without the custom op's call (~5 us: 1.1-1.2x eager's time
    at 64 x 4096 on the CPU; on the H200 the op was slower than eager at 4M tokens). Only for
    same-shape float32 tensors (anything else reaches the op and its named errors) and when no
    backend was requested by name."""
    return (
        a.dtype is _F32 and b.dtype is _F32 and a.shape == b.shape and not _backend.any_requested()
    )


def _k1_by_torch(a: Tensor, b: Tensor) -> Tensor | None:
    """a - b by torch when `_plain_f32_pair` allows it, else None (the op runs). (torch.sub:
    the binding itself, ~0.2-0.4 us less than the operator's Python protocol.)"""
    if not _plain_f32_pair(a, b):
        return None
    if a.dim() == 0 and a.device != b.device:  # torch takes a CPU scalar beside a GPU one
        return None  # (the op refuses it, naming the argument)
    try:
        return torch.sub(a, b)
    except RuntimeError:  # e.g. two devices: the op's checks name the argument
        return None


def _pair(logprobs: Tensor, ref_logprobs: Tensor):
    """Both float tensors; mixed dtypes promoted (shapes and devices: the op checks them)."""
    if type(logprobs) is Tensor and type(ref_logprobs) is Tensor:
        if logprobs.dtype is ref_logprobs.dtype:  # nothing to promote: the op checks the dtype
            return logprobs, ref_logprobs
    check_tensor("logprobs", logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("ref_logprobs", ref_logprobs, dtypes=FLOAT_DTYPES)
    if logprobs.dtype != ref_logprobs.dtype:
        dt = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
        logprobs, ref_logprobs = logprobs.to(dt), ref_logprobs.to(dt)
    return logprobs, ref_logprobs


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
    See ppo_kernels/kl/naive.py for the formulas, presets and edge cases.
    """
    if (
        estimator == "k1"  # the defaults, spelled out: the common call in the fewest steps
        and clamp == "none"
        and is_logprobs is None
        and type(logprobs) is Tensor
        and type(ref_logprobs) is Tensor
    ):
        kl = _k1_by_torch(logprobs, ref_logprobs)
        if kl is not None:
            return kl
    name, st, bounds = _settings(estimator, clamp)
    logprobs, ref_logprobs = _pair(logprobs, ref_logprobs)
    kl = None
    if name == "k1" and bounds == _UNBOUNDED and not st:  # other spellings of unclamped k1
        kl = _k1_by_torch(logprobs, ref_logprobs)
    if kl is None:
        kl = _kl_penalty(logprobs, ref_logprobs, name, st, *bounds)
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
        check_devices(
            "kl", kl, scores=scores, mask=mask, beta=beta if isinstance(beta, Tensor) else None
        )
        # kl - 0 under k1 with no clamp is kl exactly: the op masks it and places the scores
        logprobs, ref_logprobs, estimator, clamp = kl, torch.zeros_like(kl), "k1", "none"
    elif logprobs is None or ref_logprobs is None:
        raise ValueError("logprobs, ref_logprobs: required unless kl is given")
    name, _, bounds = _settings(estimator, clamp)
    logprobs, ref_logprobs = _pair(logprobs, ref_logprobs)
    # dtypes, shapes and devices: the registered op checks them, naming the argument
    if logprobs.dim() != 2:
        check_tensor("logprobs", logprobs, dim=2)
    if not isinstance(scores, Tensor):
        check_tensor("scores", scores)
    if not isinstance(mask, Tensor):
        check_tensor("mask", mask)
    token_scores = None
    if scores.dim() == 2:
        check_shape("scores", scores, logprobs.shape, "[B] or logprobs.shape")
        token_scores, scores = scores, scores.new_zeros(logprobs.shape[0])
    mask_dtype = mask.dtype
    if mask_dtype is not torch.bool and mask_dtype is not torch.float32:
        if mask_dtype.is_complex:
            raise TypeError("mask: complex masks are not supported")
        if not (mask_dtype is torch.float64 and logprobs.dtype is torch.float64):
            mask = mask.to(torch.float32)
    beta_t = None
    if type(beta) is float:  # the op checks that it is finite
        beta_f = beta
    elif isinstance(beta, Tensor):
        check_tensor("beta", beta, dtypes=FLOAT_DTYPES)
        B = logprobs.shape[0]
        if beta.dim() > 1 or (beta.dim() == 1 and beta.shape[0] != B):
            raise ValueError(
                f"beta: expected a float, a 0-dim tensor or shape ({B},), got {tuple(beta.shape)}"
            )
        beta_t, beta_f = beta, 1.0
    else:
        beta_f = check_float("beta", beta)
    # no gradient flows: the op's Autograd kernel runs it below autograd (no detach copies here)
    r, k, mean_kl = _kl_rewards(scores, logprobs, ref_logprobs, mask, beta_t, beta_f, name, *bounds)
    if token_scores is not None:
        r = r + token_scores.detach().to(r.dtype)
    if convention == "openrlhf":
        r = _openrlhf_placement(
            r,
            scores.detach(),
            logprobs.detach(),
            ref_logprobs.detach(),
            mask,
            None if beta_t is None else beta_t.detach(),
            beta_f,
            name,
            bounds,
        )
    return r, k, mean_kl


def _openrlhf_placement(r, scores, logprobs, ref_logprobs, mask, beta_t, beta_f, name, bounds):
    """OpenRLHF's compute_reward on top of the masked result: the penalty on mask == 0 positions
    too, and an action-less row's score on its last position."""
    off = mask == 0
    kl_all = _kl_penalty(logprobs, ref_logprobs, name, False, *bounds).to(r.dtype)
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
