"""The unpaired preference losses (KTO, APO-zero unpaired) on sequence log-probs: the value, the
analytic d L / d(sequence log-prob) per row and the metrics TRL reports (formulas:
docs/ppo-math.md "Preference losses"; the paired types: preference_math.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import check_float
from .._math import acc_dtype
from .preference_math import UNPAIRED_TYPES, _mean, _sig_prime


@dataclass(frozen=True)
class UnpairedConfig:
    """Unpaired preference loss (KTO and APO-zero unpaired)."""

    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def check_unpaired_config(cfg: UnpairedConfig):
    if cfg.loss_type not in UNPAIRED_TYPES:
        raise ValueError(f"loss_type: unknown {cfg.loss_type!r}; expected one of {UNPAIRED_TYPES}")
    check_float("beta", cfg.beta, positive=True)  # finite too; traces a SymFloat


class UnpairedResult(NamedTuple):
    loss: Tensor
    d_logps: Tensor  # [N]
    losses: Tensor  # [N]
    metrics: dict[str, Tensor]


def kto_reference_point(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """TRL's KTO reference point: max(mean(kl_logps - ref_kl_logps), 0), detached (the batch's
    mismatched rows; across ranks TRL averages the per-rank means before the clamp)."""
    acc = acc_dtype(kl_logps.dtype)
    d = kl_logps.detach().to(acc) - ref_kl_logps.detach().to(acc)
    return _mean(d).clamp(min=0.0)


def unpaired_loss(
    cfg: UnpairedConfig,
    logps: Tensor,
    ref_logps: Tensor | None,
    desirable: Tensor,
    kl: Tensor | float | None = None,
    num_rows: int | Tensor | None = None,
) -> UnpairedResult:
    """KTO / APO-zero unpaired over N rows: logps, ref_logps [N] (None: no reference),
    desirable [N] bool, kl: the detached reference point (a 0-dim tensor or a number; None: 0),
    num_rows: the batch's row count when these rows are a block of it (default N)."""
    acc = acc_dtype(logps.dtype)
    lp = logps.detach().to(acc)
    x = lp if ref_logps is None else lp - ref_logps.detach().to(acc)
    y = desirable.to(torch.bool)
    beta = cfg.beta
    if kl is None or cfg.loss_type == "apo_zero_unpaired":
        k = torch.zeros((), dtype=acc, device=lp.device)
    else:
        k = torch.as_tensor(kl, dtype=acc, device=lp.device).detach()
    wd, wu = cfg.desirable_weight, cfg.undesirable_weight
    if cfg.loss_type == "kto":
        a, b = beta * (x - k), beta * (k - x)
        l_des, g_des = 1 - torch.sigmoid(a), -beta * _sig_prime(a)
        l_und, g_und = 1 - torch.sigmoid(b), beta * _sig_prime(b)
    else:
        a = beta * x
        l_des, g_des = 1 - torch.sigmoid(a), -beta * _sig_prime(a)
        l_und, g_und = torch.sigmoid(a), beta * _sig_prime(a)
    losses = torch.where(y, wd * l_des, wu * l_und)
    N = max(lp.shape[0], 1) if num_rows is None else num_rows
    d = torch.where(y, wd * g_des, wu * g_und) / N
    rewards = beta * x
    yf = y.to(acc)
    n_des, n_und = yf.sum(), (1 - yf).sum()

    def per(v, n):
        return torch.where(n > 0, v / torch.where(n > 0, n, 1.0), torch.zeros_like(v))

    ch_r, rj_r = (rewards * yf).sum(), (rewards * (1 - yf)).sum()
    ch_l, rj_l = (lp * yf).sum(), (lp * (1 - yf)).sum()
    metrics = {
        "kl": k,
        "rewards": rewards,
        "chosen_rewards_sum": ch_r,
        "rejected_rewards_sum": rj_r,
        "chosen_logps_sum": ch_l,
        "rejected_logps_sum": rj_l,
        "rewards/chosen": per(ch_r, n_des),
        "rewards/rejected": per(rj_r, n_und),
        "rewards/margins": per(ch_r, n_des) - per(rj_r, n_und),
        "logps/chosen": per(ch_l, n_des),
        "logps/rejected": per(rj_l, n_und),
    }
    return UnpairedResult(losses.sum() / N, d, losses, metrics)
