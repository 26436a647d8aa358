"""The public API of the PPO losses: `ppo_policy_loss` and `ppo_value_loss` (typed arguments,
defaults, the aggregation's normalisers, the loss types). The tensors' dtypes and devices are
checked once, by the registered ops (csrc/ops/losses.cpp) on the fused path and here where a call
leaves it (weights, the other loss types: compositions of torch ops); this layer checks what only
it sees (the `[..., T]` shapes before they become rows, Python scalars, options)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_float, check_same_device, check_shape, check_tensor
from . import (
    naive,
    op,  # noqa: F401  (registers the ops' Python side)
)
from . import policy_loss as ext
from .aggregate import (
    MASK_DTYPES,
    VALUE_DTYPES,
    aggregation,
    apply_empty,
    apply_empty_stats,
    policy_aggregation,
    rows,
)
from .config import (
    AggregationConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    takes_configs,
)
from .naive import STAT_NAMES_POLICY, STAT_NAMES_VALUE

_policy_op = _backend.op("ppo_policy_loss")
_value_op = _backend.op("ppo_value_loss")


_POLICY = ("logprobs", "old_logprobs", "advantages")
_VALUE = ("values", "old_values", "returns")


def _check_shapes(names, tensors, mask):
    """Tensors of one `[..., T]` shape (what the registered ops cannot see once they are rows);
    their dtypes and devices: the op, or `_check_tensors` off the fused path."""
    x = tensors[0]
    check_tensor(names[0], x, min_dim=1)
    for n, t in zip(names[1:] + ("mask",), tensors[1:] + (mask,)):
        check_tensor(n, t)
        if t.shape != x.shape:
            raise ValueError(
                f"{n}: expected shape {tuple(x.shape)} (like {names[0]}), got {tuple(t.shape)}"
            )


def _check_tensors(names, tensors, mask):
    """Dtypes and devices, where a call does not reach a registered op."""
    for n, t in zip(names, tensors):
        check_tensor(n, t, dtypes=VALUE_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    check_same_device(**dict(zip(names, tensors)), mask=mask)


def _weighted(terms, weights, like, mask, agg, scale, gd, gdv):
    """(loss, stats) of per-token terms (loss, *stats) with the loss weighted per token: the
    reference composition, differentiable by autograd; denominators and stats from the mask."""
    check_tensor("weights", weights, dtypes=VALUE_DTYPES)
    check_shape("weights", weights, like.shape, "like the per-token inputs")
    check_same_device(weights=weights, mask=mask)
    token_loss, *stats = terms
    acc = token_loss.dtype
    if gd is None and gdv is not None:
        gd = torch.full((), gdv, dtype=acc, device=like.device)
    loss, st, _ = naive.aggregate(
        token_loss * weights.detach().to(acc), [t.detach() for t in stats], mask, agg, scale, gd
    )
    return loss, st


@takes_configs(
    loss_config=PolicyLossConfig,
    aggregation_config=AggregationConfig,
    rollout_config=RolloutCorrectionConfig,
)
def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_config: PolicyLossConfig | None = None,
    aggregation_config: AggregationConfig | None = None,
    rollout_config: RolloutCorrectionConfig | None = None,
    rollout_logprobs: Tensor | None = None,
    weights: Tensor | None = None,
    entropy: Tensor | None = None,
    approx_kl: str = "clamped",
    empty: str = "zero",
    empty_stats: str = "zero",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO / GRPO policy loss on given log-probs, fused: every policy-loss type of verl's
    registry and of TRL / Liger, with its aggregation, rollout correction and statistics.

    Per token, with rho = exp(clamp(logprob - old_logprob, +-log_ratio_clamp)), the "ppo" loss is
    `max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))`; for A < 0 with a dual clip c,
    `min(that, -A c)`. The per-token loss is aggregated over `mask` (`AggregationConfig.agg`):

      token-mean               sum(mask * l) / N * dp_size     (N = global_num_tokens or sum(mask))
      seq-mean-token-sum       sum_b sum_t(mask * l) / S * dp_size
      seq-mean-token-mean      sum_b [sum_t(mask * l) / sum_t mask] / S * dp_size
      seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor   (default: T, as verl)
      token-sum                sum(mask * l) * dp_size

    S is global_batch_size or the number of rows with a non-empty mask. Every type's formula and
    statistics: docs/ppo-math.md ("PPO losses").

    Args:
        logprobs (Tensor): `[..., T]`, float32 / bfloat16 / float16 / float64. The current
            policy's token log-probs; the gradient flows to it.
        old_logprobs (Tensor): `[..., T]`, any float dtype. The log-probs at rollout time (no
            gradient).
        advantages (Tensor): `[..., T]`, or `[...]` (one per sequence). No gradient.
        mask (Tensor): `[..., T]`, bool / integer / float. 0 marks a token without loss; a float
            mask weights tokens.
        loss_config (PolicyLossConfig, optional): the loss type and its options. Default None:
            built from the flat keyword arguments of its fields (`loss_type`, `clip_low`, ...),
            else `PolicyLossConfig()` ("ppo", clip 0.2).
        aggregation_config (AggregationConfig, optional): `agg` and its normalisers; its fields
            are accepted as flat keyword arguments too. Default: the loss type's aggregation.
        rollout_config (RolloutCorrectionConfig, optional): rollout correction (importance
            weights and rejection); its fields are accepted as flat keyword arguments too.
            Default: none.
        rollout_logprobs (Tensor, optional): `[..., T]`. The rollout engine's log-probs: weights
            and rejection from old_logprobs vs these. Default None (in bypass mode
            old_logprobs are the rollout's).
        weights (Tensor, optional): `[..., T]`. Per-token weights multiplying the per-token loss
            (detached). Default None.
        entropy (Tensor, optional): `[..., T]`. Adds the `entropy_mean` statistic (not a loss
            term: add an entropy bonus with `masked_aggregate`). Default None.
        approx_kl (str): "clamped" (verl's ppo_kl of the clamped log-ratio) or "raw". Default
            "clamped".
        empty (str): "zero" (0 over a zero denominator) or "nan" (verl's and OpenRLHF's 0 / 0).
            Default "zero".
        empty_stats (str): the same for the statistics. Default "zero".
        generator (torch.Generator, optional): clip_cov's random draw. Default None.

    Returns:
        `(loss, stats)`: a 0-dim float32 loss (float64 for float64 logprobs) and a dict of 0-dim
        statistics, no host sync: `clip_frac`, `clip_frac_lower`, `approx_kl`, `ratio_mean`
        (verl's), TRL's `clip_low_frac`, `clip_high_frac`, `clip_region_frac`,
        `clip_low_frac_min`, `clip_high_frac_max` for TRL's types, and with rollout correction
        `masked_fraction`, `is_weight_mean` and verl's `rollout_corr/<name>`.

    Why: one op for the loss verl, TRL, OpenRLHF and Liger each write their own way, with their
    exact normalisations selected by `loss_type` and `agg`; the analytic gradient is formed in
    the forward (no autograd graph of ~100 small ops). Edge cases: ppo_kernels/losses/naive.py.
    """
    per_row_adv = (
        isinstance(advantages, Tensor)
        and isinstance(logprobs, Tensor)
        and logprobs.dim() >= 1
        and advantages.shape == logprobs.shape[:-1]
    )
    if per_row_adv:
        check_tensor("advantages", advantages, dtypes=VALUE_DTYPES)
        full_adv = advantages.unsqueeze(-1).expand(logprobs.shape)
    else:
        full_adv = advantages
    inputs = (logprobs, old_logprobs, full_adv)
    _check_shapes(_POLICY, inputs, mask)
    cfg = loss_config
    rollout = ext.rollout_options(cfg, rollout_logprobs, rollout_config)
    if rollout_logprobs is not None:
        check_tensor("rollout_logprobs", rollout_logprobs, dtypes=VALUE_DTYPES)
        check_shape("rollout_logprobs", rollout_logprobs, logprobs.shape, "like logprobs")
        check_same_device(logprobs=logprobs, rollout_logprobs=rollout_logprobs)
    agg_i, scale, gd, gdv = policy_aggregation(
        aggregation_config,
        cfg.loss_type,
        logprobs.shape[:-1].numel(),
        logprobs.shape[-1],
        logprobs.device,
        "logprobs",
    )
    extended = ext.needs_extension(cfg, rollout)
    if extended or weights is not None:  # compositions of torch ops: no registered op checks
        _check_tensors(_POLICY, inputs, mask)
    if extended:
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
        terms = naive.policy_token_terms(
            logprobs,
            old_logprobs.detach(),
            full_adv.detach(),
            cfg.clip_low,
            cfg.clip_high,
            cfg.dual_clip,
            cfg.log_ratio_clamp,
        )
        loss, stats = _weighted(terms, weights, logprobs, mask, agg_i, scale, gd, gdv)
        out = dict(zip(STAT_NAMES_POLICY, stats.unbind(0), strict=True))
    else:
        loss, stats, _ = _policy_op(
            rows(logprobs),
            rows(old_logprobs),
            rows(full_adv),
            rows(mask),
            cfg.clip_low,
            cfg.clip_high,
            cfg.dual_clip,
            cfg.log_ratio_clamp,
            agg_i,
            scale,
            gd,
            gdv,
        )
        out = dict(zip(STAT_NAMES_POLICY, stats[: len(STAT_NAMES_POLICY)].unbind(0), strict=True))
    loss = apply_empty(loss, agg_i, mask, gd, gdv, empty)
    if approx_kl == "raw":
        out["approx_kl"] = _backend.op("masked_mean")(
            (old_logprobs.detach().float() - logprobs.detach().float()), mask, None, "zero"
        )
    elif approx_kl != "clamped":
        raise ValueError(f"approx_kl: expected 'clamped' or 'raw', got {approx_kl!r}")
    out = apply_empty_stats(out, mask, empty_stats)
    if entropy is not None:
        check_shape("entropy", entropy, logprobs.shape, "logprobs.shape")
        check_same_device(logprobs=logprobs, entropy=entropy)
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
    """Clipped value loss (verl's `compute_value_loss`), fused, with its aggregation and statistics.

    Per token, with v the values, v_old the old values and G the returns:
    `0.5 * max((v - G)^2, (clip(v, v_old - clip, v_old + clip) - G)^2)`, or `0.5 * (v - G)^2`
    when clip is None. The per-token loss is aggregated over the mask as in `masked_aggregate`.

    Args:
        values (Tensor): `[..., T]`, float32 / bfloat16 / float16 / float64. The critic's current
            values. The gradient flows to it.
        old_values (Tensor): values' shape, a float dtype. The values at rollout time (no
            gradient).
        returns (Tensor): values' shape, a float dtype. The targets, e.g. GAE's returns (no
            gradient).
        mask (Tensor): values' shape, bool / integer / float. 0 marks a token without loss; a
            float mask weights tokens.
        clip (float, optional): the clip range of the values around old_values; positive.
            Default None: no clipping.
        agg (str): "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean" or
            "seq-mean-token-sum-norm" (see `masked_aggregate`). Default "token-mean".
        dp_size (int): the data-parallel world size the loss is scaled by, as verl. Default 1.
        global_num_tokens (int | float | Tensor, optional): the data-parallel total of mask tokens
            (token modes), a number or a one-element tensor. Default None: sum(mask).
        global_batch_size (int | float | Tensor, optional): the data-parallel total of non-empty
            sequences (sequence modes), as global_num_tokens. Default None.
        loss_scale_factor (float, optional): seq-mean-token-sum-norm's divisor. Default None: T.
        empty (str): "zero" (0 over a zero denominator) or "nan" (verl's and OpenRLHF's 0 / 0).
            Default "zero".
        empty_stats (str): the same for the statistics. Default "zero".
        weights (Tensor, optional): values' shape. Per-token weights multiplying the per-token
            loss (detached). Default None.

    Returns:
        tuple[Tensor, dict[str, Tensor]]: `(loss, stats)`. A 0-dim float32 loss (float64 for
        float64 values) and `{"clip_frac": ...}`, the masked mean of [clipped error > plain
        error], 0-dim, with no host sync.

    Why: one op with an analytic gradient instead of the composition's chain of small ops, with
    verl's aggregation modes exactly. Formulas: docs/ppo-math.md ("PPO losses").
    """
    inputs = (values, old_values, returns)
    _check_shapes(_VALUE, inputs, mask)
    clip = check_float("clip", clip, positive=True, allow_none=True)
    agg_i, scale, gd, gdv = aggregation(
        agg,
        values.shape[-1],
        dp_size,
        global_num_tokens,
        global_batch_size,
        loss_scale_factor,
        values.device,
        "values",
    )
    if weights is not None:
        _check_tensors(_VALUE, inputs, mask)
        terms = naive.value_token_terms(values, old_values.detach(), returns.detach(), clip)
        loss, stats = _weighted(terms, weights, values, mask, agg_i, scale, gd, gdv)
    else:
        loss, stats, _ = _value_op(
            rows(values), rows(old_values), rows(returns), rows(mask), clip, agg_i, scale, gd, gdv
        )
    loss = apply_empty(loss, agg_i, mask, gd, gdv, empty)
    return loss, apply_empty_stats(dict(zip(STAT_NAMES_VALUE, stats.unbind(0))), mask, empty_stats)
