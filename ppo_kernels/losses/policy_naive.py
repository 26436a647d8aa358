"""Autograd reference of every policy-loss type: each loss written the direct way (stop-gradients
as `.detach()`, the sequence ratio through its mean, geo_mean per row), differentiated by torch.
The tests hold policy_math's analytic two-stage gradients against it in float64.

Only clip_cov's and kl_cov's token selections (no gradient, random for clip_cov) come from
policy_math.statistics, so both sides select the same tokens.
"""

from __future__ import annotations

import torch

from . import policy_math as pm
from .naive import row_coefficients


def token_losses(cfg: pm.PolicyLossConfig, x: pm.Inputs, lp: torch.Tensor, select=None):
    """[B, T] per-token losses as a differentiable function of lp (the prepared x's lp with
    requires_grad), or for geo_mean the [B] per-row losses."""
    old, adv, m = x.old, x.adv, x.m
    t = cfg.loss_type
    lo, hi, L = 1 - cfg.clip_low, 1 + cfg.clip_high, cfg.log_ratio_clamp
    d = lp - old
    n = m.sum(-1)
    if cfg.sequence_level and t in pm.SEQUENCE_LEVEL_TYPES:
        mu = (d * m).sum(-1, keepdim=True) / n.clamp(min=1.0).unsqueeze(-1)
        r = torch.exp(torch.clamp(mu, -L, L)).expand(lp.shape)
    else:
        r = torch.exp(torch.clamp(d, -L, L))

    def clipped(r, dual=None, delta=None):
        r1 = r if delta is None else torch.clamp(r, max=delta)
        out = -torch.minimum(r1 * adv, torch.clamp(r, lo, hi) * adv)  # TRL's form
        if dual is not None:
            out = torch.where(adv < 0, torch.minimum(out, -adv * dual), out)
        return out

    if t in pm.CLIP_TYPES:
        return clipped(r, cfg.dual_clip, cfg.delta)
    if t == "gspo":
        mu = ((d * m).sum(-1) / n.clamp(min=1.0)).detach()
        s = torch.exp(torch.clamp(lp - lp.detach() + mu.unsqueeze(-1), max=L))
        return torch.maximum(-adv * s, -adv * torch.clamp(s, lo, hi))
    if t == "sapo":
        tau = torch.where(
            adv > 0, torch.full_like(adv, cfg.tau_pos), torch.full_like(adv, cfg.tau_neg)
        )
        return -adv * torch.sigmoid(tau * (r - 1)) * 4 / tau
    if t == "cispo":
        return -torch.clamp(r, lo, hi).detach() * adv * lp
    if t in ("gpg", "reinforce"):
        return -lp * adv
    if t == "dro":
        return -(lp * adv - 0.5 * cfg.dro_beta * d**2)
    if t in ("dppo_tv", "dppo_kl"):
        C = 20.0 if cfg.dual_clip is None else cfg.dual_clip
        p, po = torch.exp(lp.detach()), torch.exp(old)
        if t == "dppo_tv":
            ok = torch.where(adv > 0, p - po <= cfg.clip_high, p - po >= -cfg.clip_low)
        else:
            kl = po * (old - lp.detach()) + (1 - po) * torch.log((1 - po + 1e-8) / (1 - p + 1e-8))
            ok = torch.where(
                adv > 0, (kl <= cfg.clip_high) | (p <= po), (kl <= cfg.clip_low) | (p >= po)
            )
        return -adv * torch.clamp(r, max=C).detach() * lp * ok.to(lp.dtype)
    if t == "geo_mean":
        sgn = torch.sign(adv)
        k = sgn * torch.minimum(sgn * d, sgn * torch.clamp(d, -cfg.clip_low, cfg.clip_high))
        safe_n = torch.where(n > 0, n, torch.ones_like(n))
        rho = torch.exp(torch.where(n > 0, (k * m).sum(-1) / safe_n, 0.0))
        abar = torch.where(n > 0, (adv * m).sum(-1) / safe_n, 0.0)
        return -abar * rho
    if t == "clip_cov":
        r = torch.exp(d)
        return torch.maximum(-adv * r, -adv * torch.clamp(r, lo, hi)) * select
    if t == "kl_cov":
        return -adv * torch.exp(d) + cfg.kl_cov_coef * d.abs() * select
    raise ValueError(f"loss_type: unknown {t!r}")


def policy_loss(
    cfg, x: pm.Inputs, lp, agg, scale=1.0, global_denominator=None, weights=None, generator=None
):
    """The aggregated loss (autograd through lp) of the prepared rows x."""
    st = pm.statistics(cfg, x, generator)
    coef = row_coefficients(x.m, agg, scale, global_denominator)
    w = pm.token_weights(cfg, x, st, weights)
    per = token_losses(cfg, x, lp, st.select)
    if cfg.loss_type == "geo_mean":
        sw = torch.ones_like(per) if w is None else w[:, 0] if w.shape[-1] else torch.ones_like(per)
        return (coef * per * sw).sum()
    k = coef.unsqueeze(-1) * x.m
    if w is not None:
        k = k * w
    return torch.where(x.m != 0, k * per, torch.zeros_like(per)).sum()
