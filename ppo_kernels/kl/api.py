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


def _k1_by_torch(a: Tensor, b: Tensor) -> Tensor | None:
    """Unclamped k1 of float32 inputs is one IEEE subtraction, the kernels' result bit for bit.
    torch.sub runs it without the custom op's call, whose overhead made the op slower than eager
    on the CPU and on a GPU (bench/results/cpu_overhead.md, bench/results/gpu_H200.md).

    Returns None (the op runs, with its named errors) unless both are float32 of one shape and
    no backend was requested by name. A 0-dim pair on two devices also goes to the op: torch
    would take a CPU scalar beside a GPU one."""
    if a.dtype is not _F32 or b.dtype is not _F32 or _backend.any_requested():
        return None
    shape = a.shape
    if shape != b.shape or (not shape and a.device != b.device):
        return None
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
    """Per-token KL estimate between the policy and the reference, from sampled-token log-probs.

    With d = logprobs - ref_logprobs: k1 is `d`, abs `|d|`, k2 `d^2 / 2`, k3 `exp(-d) + d - 1`.
    A "+" suffix is straight-through: the named estimator's value with k2's gradient. Clamps bound
    d before the estimator and the value after it, each peer its own way.

    Args:
        logprobs (Tensor): `[...]`, float32 / bfloat16 / float16 / float64. The policy's log-probs
            of the sampled tokens. The gradient flows to it.
        ref_logprobs (Tensor): logprobs' shape, any of those dtypes (mixed dtypes are promoted).
            The reference model's log-probs. The gradient flows to it.
        estimator (str): "k1" (alias "kl"), "abs", "k2" ("mse") or "k3" ("low_var_kl"), each
            optionally with a "+" suffix. Default "k1".
        clamp (str | KLClamp, optional): a peer's convention by name: "none" (= "trl"), "verl" or
            "openrlhf". Or explicit bounds, `KLClamp(log_ratio=(lo, hi), value=(lo, hi))`.
            None: no clamp. Default "none".
        is_logprobs (Tensor, optional): logprobs' shape. With a "+" estimator, the log-probs of the
            policy that sampled the tokens. The k2 gradient is then weighted by
            `min(exp(logprobs - is_logprobs), is_clip)` (detached), as OpenRLHF's
            `unbiased_gradient`. Default None.
        is_clip (float): the upper bound of those importance weights; positive. Default 10.0.

    Returns:
        Tensor: the estimate, logprobs' shape, float32 (float64 for float64 input). Its gradient
        is exact, through the clamps too (0 where a clamp is active, as torch.clamp).

    Why: one kernel for the estimators and clamps verl, OpenRLHF and TRL each write their own
    way, with each peer's numbers exactly. k3 is computed without the float32 cancellation of
    `exp(x) - x - 1` near 0. Formulas and presets: docs/ppo-math.md ("KL estimators") and
    ppo_kernels/kl/naive.py, which also lists the edge cases.
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
    """RLHF-PPO per-token rewards: the KL penalty plus each sequence's score, in one pass.

    `r[t] = -beta * kl[t] * mask[t] + score * [t == the row's last position with mask != 0]`,
    with kl the estimator of `kl_penalty` (0 where mask is 0). Also returns the per-sequence mean
    KL over the mask, the input of an adaptive KL controller.

    Args:
        scores (Tensor): `[B]`, any float dtype. One score per sequence (reward model or
            verifier). Or `[B, T]`, token-level scores (verl's `token_level_scores`), added as
            they are: `r = scores - beta * kl * mask`.
        logprobs (Tensor, optional): `[B, T]`, float32 / bfloat16 / float16 / float64. The policy's
            log-probs of the sampled tokens. None when `kl` is given.
        ref_logprobs (Tensor, optional): `[B, T]`, a float dtype (mixed dtypes are promoted). The
            reference model's log-probs. None when `kl` is given.
        mask (Tensor): `[B, T]`, bool / integer / float. The action mask; a float mask weights
            tokens.
        beta (float | Tensor): the KL coefficient, keyword-only and required. A float, or a 0-dim /
            `[B]` tensor read on the device (no host sync, no recompile). Under torch.compile a
            float is a constant of the graph: pass a changing beta as a tensor.
        estimator (str): as in `kl_penalty`; a "+" variant equals its base here. Default "k1".
        clamp (str | KLClamp, optional): as in `kl_penalty`. Default "none".
        kl (Tensor, optional): `[B, T]`, a float dtype. A precomputed per-token KL instead of
            logprobs and ref_logprobs (give None for both), as OpenRLHF's `compute_reward` takes
            it. `estimator` and `clamp` are then unused. Default None.
        convention (str): "verl" (the formula above) or "openrlhf": the penalty on every position,
            mask 0 too, and a row without actions gets its score on its last position.
            Default "verl".

    Returns:
        tuple[Tensor, Tensor, Tensor]: `(rewards [B, T], kl [B, T], mean_kl [B])`, float32
        (float64 for float64 log-probs). Under "verl" a row without actions gets all zeros and
        mean KL 0; its score is dropped. No gradient flows: rewards are constants to PPO.

    Why: the rewards are several masked passes over `[B, T]` in verl and OpenRLHF; here they are
    one kernel, with each peer's placement of the score. Formulas: docs/ppo-math.md ("KL-penalised
    per-token rewards"). Edge cases: ppo_kernels/kl/naive.py.
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
