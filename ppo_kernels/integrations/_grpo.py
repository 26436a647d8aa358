"""TRL's GRPO loss types -- Liger's fused GRPO loss ported them -- as `linear_policy_loss`
arguments, shared by the Liger adapter (its fused loss) and the TRL adapter (GRPOTrainer's loss
computation). The mapping is tabled in docs/ppo-math.md."""

from __future__ import annotations

import math
import numbers

from ._args import need

# each loss type's aggregation in ours (agg, every row counts)
AGG = {
    "grpo": ("seq-mean-token-mean", True),
    "sapo": ("seq-mean-token-mean", True),
    "bnpo": ("token-mean", False),
    "dr_grpo": ("seq-mean-token-sum-norm", True),
    "dapo": ("token-mean", False),
    "cispo": ("token-mean", False),
    "luspo": ("seq-mean-token-sum", True),
}
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def real(x, argument, ok=lambda v: True, what="a number"):
    need(isinstance(x, numbers.Real) and not isinstance(x, bool) and ok(float(x)), argument, what)
    return float(x)


def loss_kwargs(t, level, eps_low, eps_high, delta, tau_pos, tau_neg) -> dict:
    """linear_policy_loss's loss-type arguments for TRL's `loss_type` t: the clipped surrogate
    (clamp(ratio, 1 - epsilon_low, 1 + epsilon_high), `delta` the two-sided clip), cispo
    (clamp(ratio, max=epsilon_high), detached, no lower bound) or sapo (its soft gate); no
    log-ratio clamp (neither peer clamps)."""
    need(isinstance(t, str) and t in AGG, "loss_type", f"{t!r} is not a loss type of ours")
    need(level in ("token", "sequence"), "importance_sampling_level", f"{level!r}")
    eps_low = real(eps_low, "epsilon_low")
    eps_high = real(eps_high, "epsilon_high")
    kw: dict = dict(importance_sampling_level=level, log_ratio_clamp=math.inf)
    if t in CLIPPED:
        need(0 <= eps_low < 1, "epsilon_low", "expected a number in [0, 1)")
        need(eps_high >= 0, "epsilon_high", "expected a non-negative number")
        kw.update(loss_type=t, clip_low=eps_low, clip_high=eps_high)
        if delta is not None:
            kw["delta"] = real(delta, "delta", lambda v: v > 0, "a positive number")
    elif t == "cispo":
        need(eps_high > 0, "epsilon_high", "expected a positive bound for cispo")
        kw.update(loss_type="cispo", clip_low=1.0, clip_high=eps_high - 1)
    else:  # sapo
        pos = real(tau_pos, "sapo_temperature_pos", lambda v: v > 0)
        neg = real(tau_neg, "sapo_temperature_neg", lambda v: v > 0)
        kw.update(loss_type="sapo", tau_pos=pos, tau_neg=neg)
    return kw
