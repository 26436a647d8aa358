"""Eager PyTorch implementation for the PPO / reward-model / DPO losses: the semantics, the `eager`
backend and the benchmark baseline. Float64 inputs are computed in float64, everything else in
float32. Everything is differentiable by torch autograd; the fused kernels reproduce exactly the
gradient autograd gives for these compositions (including torch's half-and-half rule at ties of
torch.maximum / torch.minimum, see csrc/common/loss_math.h).

Layout: inputs are `[..., T]`; every leading index is one sequence (row), the last dimension its
tokens. `mask` is bool, integer or float; a float mask weights tokens (as in verl's masked_sum).

Documented edge cases (every backend matches them):
  * positions with mask == 0 contribute nothing, even when their inputs are NaN or inf (verl's
    masked_sum does the same for token-mean; its seq-mean modes would propagate such a NaN);
  * a denominator of 0 (all-zero mask, no non-empty row, or a global count of 0) gives a loss of 0
    and a gradient of 0 -- not NaN (verl gives 0/0 = NaN here); T = 0 (no token) gives a loss of 0
    in every mode (seq-mean-token-sum-norm's default loss_scale_factor T is then taken as 1);
  * statistics are means over the local mask (like verl's masked_mean); 0 for an all-zero mask;
  * the log-ratio is clamped to [-log_ratio_clamp, log_ratio_clamp] (verl: 20) before exp, so
    |logprob - old_logprob| > 20 gives a finite ratio (and no gradient through the clamp);
  * gradients at measure-zero points follow torch 2.14's autograd of these compositions: a tie of
    torch.maximum / torch.minimum splits the gradient in half, and a scalar-bound torch.clamp
    passes no gradient at exactly a bound (|log-ratio| == 20, ratio == 1 -+ clip). torch <= 2.13
    passed the gradient at a clamp bound; only exact-boundary tokens can differ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._math import acc_dtype
from .._modes import AGG_MODES
from .policy_math import _max_w, clip_surrogate, trl_clip_statistics

STAT_NAMES_POLICY = ("clip_frac", "clip_frac_lower", "approx_kl", "ratio_mean")
# TRL's / Liger's clip statistics on the same ratio (policy_math.trl_clip_statistics)
STAT_NAMES_TRL_CLIP = (
    "clip_low_frac",
    "clip_high_frac",
    "clip_region_frac",
    "clip_low_frac_min",
    "clip_high_frac_max",
)
# the registered op's statistics vector: verl's, then TRL's (one pass computes both)
OP_STAT_NAMES_POLICY = STAT_NAMES_POLICY + STAT_NAMES_TRL_CLIP
STAT_NAMES_VALUE = ("clip_frac",)


def _masked(x, keep):
    return torch.where(keep, x, torch.zeros_like(x))


def row_coefficients(mask, agg, scale=1.0, global_denominator=None):
    """Per-row weight c_b such that loss = sum_b c_b * sum_t mask[b, t] * loss[b, t] equals verl's
    agg_loss(loss, mask, agg, ...) * (the caller's scale). mask: [B, T] in the accumulation dtype.

    token-mean:              c_b = scale / N,   N = global_denominator or sum(mask)
    seq-mean-token-sum(-norm): c_b = scale / S for rows with sum(mask[b]) > 0, S = global or #such rows
    seq-mean-token-mean:     c_b = scale / (S * sum(mask[b]))
    (for -norm the caller folds 1 / loss_scale_factor into scale). A zero denominator gives 0."""
    return row_coefficients_of_counts(mask.sum(-1), agg, scale, global_denominator)


def row_coefficients_of_counts(n_b, agg, scale=1.0, global_denominator=None):
    """`row_coefficients` from the rows' mask totals n_b = sum_t mask[b, t] ([B])."""
    zero = torch.zeros((), dtype=n_b.dtype, device=n_b.device)
    if agg == "token-mean":
        denom = n_b.sum() if global_denominator is None else global_denominator.to(n_b.dtype)
        nz = denom != 0
        c = torch.where(nz, scale / torch.where(nz, denom, 1.0), zero)
        return c.expand(n_b.shape).clone()
    nonempty = n_b > 0
    denom = (
        nonempty.to(n_b.dtype).sum()
        if global_denominator is None
        else global_denominator.to(n_b.dtype)
    )
    nz = denom != 0
    per = torch.where(nz, scale / torch.where(nz, denom, 1.0), zero)
    c = torch.where(nonempty, per, zero)
    if agg == "seq-mean-token-mean":
        c = torch.where(nonempty, c / torch.where(nonempty, n_b, 1.0), zero)
    elif agg not in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        raise ValueError(f"agg: unknown mode {agg!r}; expected one of {AGG_MODES}")
    return c


def policy_token_terms(
    logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip=None, log_ratio_clamp=20.0
):
    """Per-token (loss, clipped, clipped_lower, neg_log_ratio, ratio), verl's vanilla PPO loss."""
    acc = acc_dtype(logprobs.dtype)
    lp, old, adv = logprobs.to(acc), old_logprobs.to(acc), advantages.to(acc)
    d = torch.clamp(lp - old, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(d)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(acc)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        loss = torch.where(adv < 0, torch.minimum(pg3, clip1), clip1)
        clipped_lo = ((clip1 > pg3) & (adv < 0)).to(acc)
    else:
        loss = clip1
        clipped_lo = torch.zeros_like(clipped)
    return loss, clipped, clipped_lo, -d, ratio


def value_token_terms(values, old_values, returns, clip=None):
    """Per-token (loss, clipped): 0.5 * max((v - G)^2, (clip(v, v_old -+ eps) - G)^2)."""
    acc = acc_dtype(values.dtype)
    v, vo, g = values.to(acc), old_values.to(acc), returns.to(acc)
    l1 = (v - g) ** 2
    if clip is None:
        return 0.5 * l1, torch.zeros_like(l1)
    vc = torch.max(torch.min(v, vo + clip), vo - clip)  # verl's clip_by_value
    l2 = (vc - g) ** 2
    return 0.5 * torch.maximum(l1, l2), (l2 > l1).to(acc)


def policy_token_grad(
    logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip=None, log_ratio_clamp=20.0
):
    """d loss[t] / d logprob[t] in closed form: what autograd gives for policy_token_terms (the
    eager backend's backward; custom-op kernels run below autograd, so they cannot call it).
    The clipped surrogate's derivative lives in policy_math.clip_surrogate (shared by every
    clipped loss type)."""
    acc = acc_dtype(logprobs.dtype)
    lp, old, adv = logprobs.to(acc), old_logprobs.to(acc), advantages.to(acc)
    d = lp - old
    ratio = torch.exp(torch.clamp(d, -log_ratio_clamp, log_ratio_clamp))
    _, g, _, _ = clip_surrogate(ratio, adv, 1.0 - clip_low, 1.0 + clip_high, dual_clip)
    in_lr = ((d > -log_ratio_clamp) & (d < log_ratio_clamp)).to(acc)
    return g * ratio * in_lr


def value_token_grad(values, old_values, returns, clip=None):
    """d loss[t] / d v[t] in closed form (what autograd gives for value_token_terms)."""
    acc = acc_dtype(values.dtype)
    v, vo, g = values.to(acc), old_values.to(acc), returns.to(acc)
    e1 = v - g
    if clip is None:
        return e1
    hi, lo = vo + clip, vo - clip
    mn = torch.min(v, hi)
    vc = torch.max(mn, lo)
    dvc = (1 - _max_w(v, hi)) * _max_w(mn, lo)
    e2 = vc - g
    w1 = _max_w(e1 * e1, e2 * e2)
    return w1 * e1 + (1 - w1) * e2 * dvc


def _rows(t):
    return t.reshape(t.shape[:-1].numel(), t.shape[-1]) if t.dim() > 0 else t.reshape(1, 1)


def aggregate(token_loss, stats, mask, agg, scale, global_denominator):
    """(loss, stats vector, row coefficients) from per-token terms, over the mask."""
    acc = token_loss.dtype
    m = _rows(mask).to(acc)
    keep = m != 0
    coef = row_coefficients(m, agg, scale, global_denominator)
    row_sums = _masked(_rows(token_loss) * m, keep).sum(-1)
    loss = (coef * row_sums).sum()
    n = m.sum()
    inv = torch.where(n != 0, 1.0 / torch.where(n != 0, n, 1.0), torch.zeros_like(n))
    st = torch.stack([_masked(_rows(s) * m, keep).sum() for s in stats]) * inv
    return loss, st, coef


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=None,
    dual_clip=None,
    agg="token-mean",
    log_ratio_clamp=20.0,
    scale=1.0,
    global_denominator=None,
):
    """(loss, stats [OP_STAT_NAMES_POLICY: verl's four, then TRL's five], row coefficients)."""
    clip_high = clip_low if clip_high is None else clip_high
    loss, *stats = policy_token_terms(
        logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip, log_ratio_clamp
    )
    loss, st, coef = aggregate(loss, stats, mask, agg, scale, global_denominator)
    ratio, m = _rows(stats[-1]), _rows(mask).to(loss.dtype)
    adv = _rows(advantages.to(loss.dtype).detach())
    means, rows = trl_clip_statistics(ratio.detach(), adv, m, 1.0 - clip_low, 1.0 + clip_high)
    trl = [*means.values(), *rows.values()]
    return loss, torch.cat([st, torch.stack(trl).to(st.dtype)]), coef


def value_loss(
    values,
    old_values,
    returns,
    mask,
    clip=None,
    agg="token-mean",
    scale=1.0,
    global_denominator=None,
):
    """(loss, stats [clip_frac], row coefficients)."""
    loss, clipped = value_token_terms(values, old_values, returns, clip)
    return aggregate(loss, [clipped], mask, agg, scale, global_denominator)


def reward_model_loss(chosen, rejected, reduction="mean"):
    """-log sigmoid(r_chosen - r_rejected) per pair (Bradley-Terry), stable for any margin."""
    acc = acc_dtype(chosen.dtype)
    loss = -F.logsigmoid(chosen.to(acc) - rejected.to(acc))
    return _reduce(loss, reduction)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, reduction="mean"):
    """-log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l))) per pair."""
    acc = acc_dtype(policy_chosen.dtype)
    z = beta * (
        (policy_chosen.to(acc) - ref_chosen.to(acc))
        - (policy_rejected.to(acc) - ref_rejected.to(acc))
    )
    return _reduce(-F.logsigmoid(z), reduction)


def _reduce(loss, reduction):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        # the mean of zero pairs is 0 (not NaN), like the policy loss's empty mask
        return loss.sum() / max(loss.numel(), 1)
    raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")


# ---------------------------------------------------------------------------------------------
# The benchmark baseline: the policy loss as trainers write it today (verl's vanilla loss: clamp,
# exp, three masked means with .item(), dual clip, agg_loss). Written from the documented
# semantics, for timing only.
def _masked_mean(x, m):
    return (torch.where(m.bool(), x, 0.0) * m).sum() / (m.sum() + 1e-8)


def eager_policy_loss_verl_style(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=3.0,
    agg="token-mean",
    sync=True,
):
    nlk = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(nlk)
    kl = _masked_mean(-nlk, mask)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    c1 = torch.maximum(pg1, pg2)
    cf = _masked_mean(torch.gt(pg2, pg1).float(), mask)
    if dual_clip is None:  # the trainer's --dual-clip default (verl always applies clip_ratio_c)
        pg, cfl = c1, torch.zeros_like(cf)
    else:
        pg3 = -advantages * dual_clip
        c2 = torch.min(pg3, c1)
        cfl = _masked_mean(torch.gt(c1, pg3) * (advantages < 0).float(), mask)
        pg = torch.where(advantages < 0, c2, c1)
    if agg == "token-mean":
        loss = (torch.where(mask.bool(), pg, 0.0) * mask).sum() / mask.sum()
    else:
        seq = (pg * mask).sum(-1)
        if agg == "seq-mean-token-mean":
            seq = seq / (mask.sum(-1) + 1e-8)
        sm = (mask.sum(-1) > 0).float()
        loss = (torch.where(sm.bool(), seq, 0.0) * sm).sum() / sm.sum()
        if agg == "seq-mean-token-sum-norm":
            loss = loss / mask.shape[-1]
    if sync:
        stats = {"clip_frac": cf.item(), "approx_kl": kl.item(), "clip_frac_lower": cfl.item()}
    else:
        stats = {"clip_frac": cf, "approx_kl": kl, "clip_frac_lower": cfl}
    return loss, stats


def eager_policy_loss_trl_style(
    logprobs, old_logprobs, advantages, mask, loss_type="grpo", eps_low=0.2, eps_high=0.2
):
    """TRL GRPOTrainer's token-level clipped loss ("grpo" / "bnpo") with the clip statistics it
    logs (low / high / region masked means, the per-sequence min / max), without its host syncs
    and collectives: the eager code ppo_policy_loss(loss_type=...) replaces."""
    coef_1 = torch.exp(logprobs - old_logprobs)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    m = mask.float()
    if loss_type == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    else:
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    low = (coef_1 < 1 - eps_low) & (advantages < 0)
    high = (coef_1 > 1 + eps_high) & (advantages > 0)
    n = m.sum().clamp(min=1.0)
    stats = {
        "clip_low_frac": (low.float() * m).sum() / n,
        "clip_high_frac": (high.float() * m).sum() / n,
        "clip_region_frac": ((low | high).float() * m).sum() / n,
    }
    low_rows = (low.float() * m).sum(-1) / m.sum(-1)
    high_rows = (high.float() * m).sum(-1) / m.sum(-1)
    inf = torch.full_like(low_rows, math.inf)
    stats["clip_low_frac_min"] = torch.where(low_rows.isnan(), inf, low_rows).min()
    stats["clip_high_frac_max"] = torch.where(high_rows.isnan(), -inf, high_rows).max()
    return loss, stats


def eager_value_loss_verl_style(values, old_values, returns, mask, clip=0.2):
    vc = torch.max(torch.min(values, old_values + clip), old_values - clip)
    l1 = (values - returns) ** 2
    l2 = (vc - returns) ** 2
    loss = 0.5 * (torch.where(mask.bool(), torch.max(l1, l2), 0.0) * mask).sum() / mask.sum()
    return loss, _masked_mean(torch.gt(l2, l1).float(), mask)
