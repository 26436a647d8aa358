"""The loss types of `ppo_policy_loss` beyond the fused "ppo" kernels: argument checks, rollout
correction inside the loss, and the shared two-stage math (policy_math.py) with its analytic
gradient attached to the loss (formed in the forward, as the fused hidden-states op does).

`ppo_policy_loss` (api.py) resolves the aggregation and calls `extended_policy_loss`; the fused
"ppo" op is reached as the registered op (op.py registers its Python side).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_tensor, device_error
from . import op  # noqa: F401  (registers the fused op's Python side)
from . import policy_math as pm
from . import rollout_correction as rc
from .config import PolicyLossConfig, RolloutCorrectionConfig
from .naive import (
    OP_STAT_NAMES_POLICY,
    STAT_NAMES_POLICY,
    STAT_NAMES_TRL_CLIP,
    row_coefficients,
)

_policy_op = _backend.op("ppo_policy_loss")

_BYPASS_TYPES = pm.CLIP_TYPES + ("gpg", "reinforce")


class RolloutOptions:
    """Checked rollout-correction options of `ppo_policy_loss` (None: no rollout correction)."""

    def __init__(self, level, is_spec, batch_normalize, rs_specs, bypass):
        self.level, self.is_spec, self.batch_normalize = level, is_spec, batch_normalize
        self.rs_specs, self.bypass = rs_specs, bypass


def rollout_options(
    cfg: PolicyLossConfig, rollout_logprobs, rc_cfg: RolloutCorrectionConfig
) -> RolloutOptions | None:
    """The correction a call asks for (None: none), checked against the loss type and the
    tensors given."""
    bypass, batch_normalize = rc_cfg.bypass_mode, rc_cfg.rollout_is_batch_normalize
    rollout_is, rollout_rs = rc_cfg.rollout_is, rc_cfg.rollout_rs
    level, is_spec, rs_specs = rc_cfg.parsed
    if bypass:
        if rollout_logprobs is not None:
            raise ValueError(
                "rollout_logprobs: in bypass_mode the old_logprobs are the rollout log-probs; "
                "pass them as old_logprobs only"
            )
        if cfg.loss_type not in _BYPASS_TYPES:
            raise ValueError(
                f"bypass_mode: defined for loss_type in {_BYPASS_TYPES} (verl's ppo_clip and "
                f"reinforce), not {cfg.loss_type!r}"
            )
    elif rollout_logprobs is None:
        if rollout_is is not None or rollout_rs is not None:
            name = "rollout_is" if rollout_is is not None else "rollout_rs"
            raise ValueError(f"{name}: needs rollout_logprobs (or bypass_mode=True)")
        return None
    return RolloutOptions(level, is_spec, batch_normalize, rs_specs, bypass)


def stat_scope(
    cfg: PolicyLossConfig, rollout: RolloutOptions | None, agg: str, global_denominator
) -> str:
    """policy_math.stat_scope widened by the rollout correction: in bypass mode the weights and
    the rejection come from the current log-probs -- per sequence at sequence level, per batch
    when batch-normalised or when a rejection changes a local denominator (no global one)."""
    scope = pm.stat_scope(cfg)
    if rollout is None or not rollout.bypass:
        return scope  # from old / rollout log-probs: known before the forward
    order = ("token", "sequence", "batch")
    need = "token"
    if rollout.level == "sequence" or any(
        not o.startswith("token") for o, _, _ in rollout.rs_specs
    ):
        need = "sequence"
    if rollout.batch_normalize or (rollout.rs_specs and global_denominator is None):
        need = "batch"
    return max(scope, need, key=order.index)


def needs_extension(cfg: PolicyLossConfig, rollout: RolloutOptions | None) -> bool:
    """Whether a call leaves today's fused "ppo" path (api.py runs that one itself)."""
    return (
        cfg.loss_type != "ppo" or cfg.sequence_level or cfg.delta is not None or rollout is not None
    )


class _PrecomputedGrad(torch.autograd.Function):
    """loss with its gradient d loss / d logprobs formed in the forward (grad_out * coef)."""

    @staticmethod
    def forward(ctx, logprobs, value, coef):
        ctx.save_for_backward(coef)
        ctx.dtype = logprobs.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        return (coef * grad.to(coef.dtype)).to(ctx.dtype), None, None


def _rows(t):
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _global(gd, gdv, like):
    if gd is not None:
        return gd.to(like.dtype)
    if gdv is not None:
        return torch.full((), gdv, dtype=like.dtype, device=like.device)  # a fill: no copy
    return None


def shared_loss(cfg, x: pm.Inputs, weights, agg, scale, gd, generator, per_row_adv):
    """(loss value, d loss / d lp [B, T], stats) of the shared math on prepared rows."""
    st = pm.statistics(cfg, x, generator)
    terms = pm.token_terms(cfg, x, st)
    coef_rows = row_coefficients(x.m, agg, scale, gd)
    loss, coef = pm.combine(terms, x, coef_rows, pm.token_weights(cfg, x, st, weights))
    stats = pm.masked_means(terms.metrics, x.m)
    stats.update(pm.row_metrics(terms.metrics, x.m, cfg.sequence_level and per_row_adv))
    return loss, coef, stats


def extended_policy_loss(
    cfg: PolicyLossConfig,
    rollout: RolloutOptions | None,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    agg: str,
    scale: float,
    gd: Tensor | None,
    gdv: float | None,
    generator: torch.Generator | None,
    rollout_logprobs: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """(loss, stats, effective mask) of any loss type; the inputs are checked by the caller
    (advantages [..., T] or [...]). Rollout correction: the weights multiply the per-token loss
    (not in bypass mode for the clipped types, whose ratio already is pi / pi_rollout), the
    rejected tokens leave the mask (denominators and statistics included)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator)}")
    shape = logprobs.shape
    per_row_adv = advantages.dim() == logprobs.dim() - 1
    adv_rows = advantages.reshape(-1, 1) if per_row_adv else _rows(advantages)
    lp_rows = _rows(logprobs)
    if rollout is None and weights is None and pm.is_ppo_surrogate(cfg):  # no prepare pass needed
        stats = {"masked_fraction": _masked_fraction(mask, mask, pm.acc_dtype(logprobs.dtype))}
        old_rows, mask_rows = _rows(old_logprobs), _rows(mask)
        loss = _fused_policy_loss(
            cfg, stats, lp_rows, old_rows, adv_rows, mask_rows, agg, scale, gd, gdv
        )
        return loss, stats, mask
    x = pm.prepare(lp_rows, _rows(old_logprobs).detach(), adv_rows.detach(), _rows(mask))
    if weights is not None:
        check_tensor(
            "weights", weights, dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64)
        )
        if tuple(weights.shape) != tuple(shape):
            raise ValueError(
                f"weights: expected shape {tuple(shape)} (like the per-token inputs), got "
                f"{tuple(weights.shape)}"
            )
        if weights.device != logprobs.device:
            raise device_error("weights", weights, logprobs.device, "logprobs")
    w = None if weights is None else _rows(weights).detach().to(x.m.dtype)
    stats: dict[str, Tensor] = {}
    eff_mask = mask
    if rollout is not None:
        # bypass: the old policy is the rollout policy; the weights use the current log-probs
        base = x.lp if rollout.bypass else x.old
        if rollout.bypass:
            roll = x.old
        else:
            roll = _rows(rollout_logprobs).detach().to(x.m.dtype)
            roll = torch.where(x.m != 0, roll, torch.zeros_like(roll))
        rw, keep, met = rc.compute(
            base.detach(),
            roll,
            x.m,
            rollout.level,
            rollout.is_spec,
            rollout.batch_normalize,
            rollout.rs_specs,
        )
        stats.update({f"rollout_corr/{k}": v for k, v in met.items()})
        if keep is not None:
            x = x._replace(m=x.m * keep)
            eff_mask = (mask * keep.reshape(shape)).to(mask.dtype)
        if rw is not None:
            stats["is_weight_mean"] = pm.masked_means({"w": rw}, x.m)["w"]
            if not (rollout.bypass and cfg.loss_type in pm.CLIP_TYPES):
                w = rw if w is None else w * rw
    stats["masked_fraction"] = _masked_fraction(mask, eff_mask, x.m.dtype)
    gden = _global(gd, gdv, x.m)
    if w is None and pm.is_ppo_surrogate(cfg):  # on the corrected mask
        old_rows = _rows(old_logprobs)
        loss = _fused_policy_loss(cfg, stats, lp_rows, old_rows, adv_rows, x.m, agg, scale, gd, gdv)
        return loss, stats, eff_mask
    with torch.no_grad():
        value, coef, st = shared_loss(cfg, x, w, agg, scale, gden, generator, per_row_adv)
    stats.update(st)
    loss = _PrecomputedGrad.apply(logprobs, value, coef.reshape(shape))
    return loss, stats, eff_mask


def _fused_policy_loss(cfg, stats, lp, old, adv, m, agg, scale, gd, gdv) -> Tensor:
    """The loss by the fused "ppo" kernels on [rows, T] inputs (adv [rows, T] or [rows, 1]);
    their statistics go into `stats` in shared_loss's order: for TRL's types TRL's clip means
    (the same pass computes them), verl's four, then TRL's per-row summaries."""
    loss, st, _ = _policy_op(
        lp,
        old,
        adv.expand(lp.shape),
        m,
        cfg.clip_low,
        cfg.clip_high,
        cfg.dual_clip,
        cfg.log_ratio_clamp,
        agg,
        scale,
        gd,
        gdv,
    )
    named = dict(zip(OP_STAT_NAMES_POLICY, st.unbind(0), strict=True))
    trl = cfg.loss_type != "ppo"
    if trl:
        stats.update((k, named[k]) for k in STAT_NAMES_TRL_CLIP[:3])
    stats.update((k, named[k]) for k in STAT_NAMES_POLICY)
    if trl:
        stats.update((k, named[k]) for k in STAT_NAMES_TRL_CLIP[3:])
    return loss


def _masked_fraction(mask, eff_mask, dtype):
    """Fraction of the mask's tokens the rejection removed (0 without rejection or tokens)."""
    if eff_mask is mask:
        return torch.zeros((), dtype=dtype, device=mask.device)
    a = (mask != 0).sum().to(dtype)
    b = (eff_mask != 0).sum().to(dtype)
    return torch.where(
        a > 0, (a - b) / a.clamp(min=1), torch.zeros((), dtype=dtype, device=mask.device)
    )
