"""Eager PyTorch implementation for kl_penalty and kl_penalized_rewards: the semantics, the `eager`
backend and the benchmark baseline. Float64 inputs are computed in float64, everything else in
float32 (as OpenRLHF does; verl computes in the input dtype).

Estimators, with d = logprob - ref_logprob (http://joschu.net/blog/kl-approx.html):
  "k1" ("kl")           d
  "abs"                 |d|
  "k2" ("mse")          d^2 / 2
  "k3" ("low_var_kl")   x = -d; exp(x) - x - 1
  "<name>+"             straight-through: the value of <name>, the gradient of k2 (d, unclamped),
                        as verl's "k3+".
Clamps (`KLClamp`): d is clamped to `log_ratio` = (lo, hi) before the estimator and the value to
`value` = (lo, hi) after it (None: no bound on that side). Gradients are those of torch.clamp: zero
wherever a finite bound is active (outside the open interval (lo, hi); NaN too). Presets:
  "none" / "trl"  no clamps (TRL).
  "verl"          k3: d to [-20, 20] (verl clamps x = -d, the same thing) and the value to
                  [-10, 10]; k1 / abs / k2 unclamped.
  "openrlhf"      every estimator's value to [-10, 10]; k3 also d >= -10 (OpenRLHF >= 0.11; the
                  same values and gradients as without it, minus the 0 * inf NaN gradient).
Edge cases (every backend matches them):
  * k3 is computed without the float32 cancellation of exp(x) - x - 1 near x = 0 (a series there),
    so tiny KLs are accurate, where the peers' float32 code is off by ~1e-7 absolute.
  * k3 at d < -88 without a value clamp overflows float32 to +inf (the float64 value is finite);
    its gradient is then -inf. Nothing is NaN unless an input is.
kl_penalized_rewards (RLHF-PPO rewards), for each row b with action mask m:
  kl[b, t]        = estimator(d[b, t]) where m[b, t] != 0, else 0 (never 0 * inf = NaN)
  rewards[b, t]   = -beta_b * kl[b, t] * m[b, t] + score_b * [t == last t with m[b, t] != 0]
  mean_kl[b]      = sum_t kl[b, t] * m[b, t] / sum_t m[b, t]
  A row with no action (all m = 0): rewards and kl all 0, the score is dropped, mean_kl = 0.
  A float mask whose weights sum to 0 (e.g. 1 and -1): mean_kl = 0 (no 0 / 0).
  beta must be finite (a float; a tensor beta is read on the device as it is).
  (OpenRLHF would put the score on the row's last position; verl divides by count + 1e-8.)
  beta is a float, a 0-dim tensor or a [B] tensor (read on the device: no sync, no recompile).
  No gradient flows (rewards are constants to PPO); use kl_penalty for a differentiable KL loss.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .._math import acc_dtype
from .._modes import KL_ESTIMATOR_ALIASES, KL_ESTIMATORS

ESTIMATORS = {**{n: n for n in KL_ESTIMATORS}, **KL_ESTIMATOR_ALIASES}  # accepted name -> canonical


@dataclass(frozen=True)
class KLClamp:
    """Explicit clamps of a KL estimator, for `kl_penalty(..., clamp=KLClamp(...))`.

    Args:
        log_ratio (tuple, optional): `(lo, hi)` bounds of d = logprob - ref_logprob before the
            estimator. Either side may be None (unbounded). Default None: no clamp.
        value (tuple, optional): `(lo, hi)` bounds of the estimator's value, sides as above.
            Default None: no clamp.

    The gradient is 0 wherever a finite bound is active, as torch.clamp's. The named presets
    ("verl", "openrlhf") are tables of these: ppo_kernels/kl/naive.py.
    """

    log_ratio: tuple[float | None, float | None] | None = None
    value: tuple[float | None, float | None] | None = None

    def bounds(self) -> tuple[float, float, float, float]:
        """(in_lo, in_hi, out_lo, out_hi) with +-inf for a missing bound."""

        def pair(p, what):
            if p is None:
                return -math.inf, math.inf
            if not (isinstance(p, (tuple, list)) and len(p) == 2):
                raise TypeError(f"clamp: {what} expected a (lo, hi) pair, got {p!r}")
            lo, hi = p
            lo = -math.inf if lo is None else _bound(lo, what)
            hi = math.inf if hi is None else _bound(hi, what)
            if not (lo <= hi):  # NaN fails too (comparisons only: traceable by torch.compile)
                raise ValueError(f"clamp: {what} bounds must satisfy lo <= hi, got {p}")
            return lo, hi

        return pair(self.log_ratio, "log_ratio") + pair(self.value, "value")


def _bound(x, what):
    from .._checks import check_float

    return check_float(f"clamp: {what} bound", x, finite=False)


NO_CLAMP = KLClamp()
PRESETS = {
    "none": {},
    "trl": {},
    "verl": {"k3": KLClamp(log_ratio=(-20.0, 20.0), value=(-10.0, 10.0))},
    "openrlhf": {
        "k1": KLClamp(value=(-10.0, 10.0)),
        "abs": KLClamp(value=(-10.0, 10.0)),
        "k2": KLClamp(value=(-10.0, 10.0)),
        "k3": KLClamp(log_ratio=(-10.0, None), value=(-10.0, 10.0)),
    },
}


def parse_estimator(estimator: str) -> tuple[str, bool]:
    """("low_var_kl+" -> ("k3", True)): the canonical name and straight-through; raises ValueError
    naming the argument."""
    if not isinstance(estimator, str):
        raise TypeError(f"estimator: expected a string, got {type(estimator).__name__}")
    name = estimator.strip().lower()
    st = name.endswith("+")
    code = ESTIMATORS.get(name[:-1] if st else name)
    if code is None:
        raise ValueError(
            f"estimator: unknown KL estimator {estimator!r}; expected one of "
            f"{sorted(ESTIMATORS)} optionally followed by '+' (straight-through)"
        )
    return code, st


def resolve_clamp(clamp, estimator: str) -> tuple[float, float, float, float]:
    if clamp is None:
        return NO_CLAMP.bounds()
    if isinstance(clamp, KLClamp):
        return clamp.bounds()
    if isinstance(clamp, str):
        table = PRESETS.get(clamp.strip().lower())
        if table is None:
            raise ValueError(
                f"clamp: unknown preset {clamp!r}; expected one of {sorted(PRESETS)}, "
                "None, or a KLClamp"
            )
        return table.get(estimator, NO_CLAMP).bounds()
    raise TypeError(f"clamp: expected a preset name, None or a KLClamp, got {type(clamp).__name__}")


def _acc(*ts):
    """The accumulation dtype of the widest input (float64 if any is)."""
    return acc_dtype(functools.reduce(torch.promote_types, (t.dtype for t in ts)))


def _clamp(x, lo, hi):
    """clamp with gradient 1 strictly inside (lo, hi) and 0 on and beyond a bound, as the kernels
    (`_passes`). Not torch.clamp's autograd: its gradient at a value exactly on a bound changed
    between torch releases (1 in 2.11, 0 in 2.14), and bf16 log-ratios land on 10.0 often."""
    if lo == -math.inf and hi == math.inf:
        return x
    c = torch.clamp(x, min=None if lo == -math.inf else lo, max=None if hi == math.inf else hi)
    return torch.where(_passes(x, lo, hi), x, c.detach())


def _k3(x):
    """exp(x) - x - 1. In float32, expm1(x) - x still cancels to ~1e-3 relative at |x| = 1e-5, so
    near 0 it is the Taylor series the kernels use (csrc/common/kl_stats.h: k3_value)."""
    v = torch.expm1(x) - x
    if x.dtype == torch.float64:
        return v
    t = x * (1 / 40320) + 1 / 5040
    for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5):
        t = x * t + c
    return torch.where(x.abs() < 0.25, x * x * t, v)


def kl_penalty(
    logprobs, ref_logprobs, estimator="k1", straight_through=False, bounds=NO_CLAMP.bounds()
):
    """The estimator as a differentiable torch composition (its autograd is the reference
    gradient)."""
    in_lo, in_hi, out_lo, out_hi = bounds
    acc = _acc(logprobs, ref_logprobs)
    d_raw = logprobs.to(acc) - ref_logprobs.to(acc)
    d = _clamp(d_raw, in_lo, in_hi)
    if estimator == "k1":
        v = d
    elif estimator == "abs":
        v = d.abs()
    elif estimator == "k2":
        v = 0.5 * d.square()
    else:
        v = _k3(-d)
    v = _clamp(v, out_lo, out_hi)
    if straight_through:
        k2 = 0.5 * d_raw.square()
        v = k2 - k2.detach() + v.detach()
    return v


def _passes(v, lo, hi):
    ok = torch.ones_like(v, dtype=torch.bool)
    if lo != -math.inf:
        ok = ok & (v > lo)
    if hi != math.inf:
        ok = ok & (v < hi)
    return ok


def kl_penalty_grad(
    logprobs, ref_logprobs, estimator="k1", straight_through=False, bounds=NO_CLAMP.bounds()
):
    """d value / d logprobs (= -d value / d ref_logprobs) in closed form: the eager backward. The
    tests check it, and the kernels, against autograd through `kl_penalty`."""
    in_lo, in_hi, out_lo, out_hi = bounds
    acc = _acc(logprobs, ref_logprobs)
    d = logprobs.to(acc) - ref_logprobs.to(acc)
    if straight_through:
        return d
    dc = _clamp(d, in_lo, in_hi)
    if estimator == "k1":
        v, g = dc, torch.ones_like(dc)
    elif estimator == "abs":
        v, g = dc.abs(), torch.sign(dc)
    elif estimator == "k2":
        v, g = 0.5 * dc.square(), dc
    else:
        v = _k3(-dc)
        g = dc - v
    zero = torch.zeros_like(g)
    g = torch.where(_passes(d, in_lo, in_hi), g, zero)
    return torch.where(_passes(v, out_lo, out_hi), g, zero)


def kl_penalized_rewards(
    scores, logprobs, ref_logprobs, mask, beta, estimator="k1", bounds=NO_CLAMP.bounds()
):
    """(rewards, kl, mean_kl) per the module docstring; beta: float or a 0-dim / [B] tensor."""
    acc = _acc(logprobs, ref_logprobs)
    with torch.no_grad():
        kl = kl_penalty(logprobs, ref_logprobs, estimator, False, bounds).to(acc)
        m = mask.to(acc)
        active = mask != 0
        kl = torch.where(active, kl, torch.zeros_like(kl))
        wkl = torch.where(active, kl * m, torch.zeros_like(kl))
        B, T = kl.shape
        b = (
            torch.as_tensor(beta, dtype=acc, device=kl.device).reshape(-1, 1)
            if isinstance(beta, torch.Tensor)
            else torch.full((1, 1), float(beta), dtype=acc, device=kl.device)
        )
        rewards = torch.where(active, -b * wkl, torch.zeros_like(kl))
        pos = torch.arange(T, device=kl.device).expand(B, T)
        last = (
            torch.where(active, pos, torch.full_like(pos, -1)).amax(-1)
            if T > 0
            else torch.full((B,), -1, device=kl.device)
        )
        is_last = (pos == last.unsqueeze(-1)) & active
        rewards = rewards + torch.where(is_last, scores.to(acc).unsqueeze(-1), torch.zeros_like(kl))
        cnt = m.sum(-1)
        mean = torch.where(
            active.any(-1) & (cnt != 0),
            wkl.sum(-1) / torch.where(cnt == 0, torch.ones_like(cnt), cnt),
            torch.zeros_like(cnt),
        )
    return rewards, kl, mean


# -- the peers' formulas, written from their documented semantics (benchmark baselines) --


def eager_kl_penalty_verl(logprob, ref_logprob, estimator="k1"):
    """verl-style composition: the estimator in the input dtype with verl's k3 clamps."""
    st = estimator.endswith("+")
    name = estimator[:-1] if st else estimator
    if name in ("kl", "k1"):
        v = logprob - ref_logprob
    elif name == "abs":
        v = (logprob - ref_logprob).abs()
    elif name in ("mse", "k2"):
        v = 0.5 * (logprob - ref_logprob).square()
    else:
        x = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        v = torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)
    if st:
        k2 = 0.5 * (logprob - ref_logprob).square()
        v = k2 - k2.detach() + v.detach()
    return v


def eager_kl_rewards(scores, logprobs, ref_logprobs, mask, beta, estimator="k1"):
    """The composition trainers run today: estimator, mask, masked mean, score scatter."""
    kl = eager_kl_penalty_verl(logprobs, ref_logprobs, estimator) * mask
    rewards = -beta * kl
    T = mask.shape[1]
    eos = T - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)
    rewards = rewards + torch.zeros_like(kl).scatter_(1, eos, scores.unsqueeze(1).to(kl.dtype))
    mean = (kl * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    return rewards, kl, mean
