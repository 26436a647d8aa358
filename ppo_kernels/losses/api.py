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
    checked_config,
    rows,
)
from .naive import STAT_NAMES_POLICY, STAT_NAMES_VALUE
from .policy_math import default_aggregation

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


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str | None = None,
    log_ratio_clamp: float | None = None,
    dp_size: int = 1,
    global_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
    loss_scale_factor: float | None = None,
    entropy: Tensor | None = None,
    approx_kl: str = "clamped",
    empty: str = "zero",
    empty_stats: str = "zero",
    weights: Tensor | None = None,
    loss_type: str = "ppo",
    importance_sampling_level: str = "token",
    delta: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    dro_beta: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 0.1,
    generator: torch.Generator | None = None,
    rollout_logprobs: Tensor | None = None,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | tuple[float, float] | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    bypass_mode: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped policy loss (verl's `compute_policy_loss_vanilla` + `agg_loss`), fused, and
    every other policy-loss type of verl's registry and of TRL / Liger (`loss_type`).

    Per token, with rho = exp(clamp(logprob - old_logprob, +-log_ratio_clamp)):
    `max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))`, and for A < 0 with dual clip
    `min(that, -A * dual_clip)`; aggregated over `mask` by `agg`:
      token-mean               sum(mask * l) / N * dp_size     (N = global_num_tokens or sum(mask))
      seq-mean-token-sum       sum_b sum_t(mask * l) / S * dp_size
      seq-mean-token-mean      sum_b [sum_t(mask * l) / sum_t mask] / S * dp_size
      seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor   (default: T, as verl)
      token-sum                sum(mask * l) * dp_size
    where S = global_batch_size or the number of rows with a non-empty mask; rows with an empty
    mask never count. Pass the data-parallel totals (numbers, or 0-dim tensors for no host sync)
    with dp_size > 1, as verl does.

    loss_type (formulas, statistics and which need a second pass: docs/ppo-math.md and
    ppo_kernels/losses/policy_math.py):
      "ppo"      the loss above (today's fused kernels).
      "grpo", "bnpo", "dr_grpo", "dapo", "luspo"  TRL's / Liger's clipped loss (with `delta`:
                 min(rho, delta) in the unclipped branch) under their normalisations when
                 agg=None: grpo = seq-mean-token-mean over all B rows, bnpo = token-mean,
                 dr_grpo = sum / (B * loss_scale_factor) (TRL's max_completion_length, default T),
                 dapo = token-mean over global_num_tokens (TRL's num_items_in_batch / processes),
                 luspo = seq-mean-token-sum over all B rows. No log-ratio clamp by default.
      "gspo", "sapo", "cispo", "gpg" (= "reinforce"), "dro", "dppo_tv", "dppo_kl", "geo_mean",
      "clip_cov", "kl_cov"  verl's registry entries of those names (sapo: `tau_pos`/`tau_neg`;
                 dro: `dro_beta`; dppo: clip_low / clip_high are the divergence thresholds and
                 dual_clip the ratio truncation, default 20; geo_mean: clip_low / clip_high bound
                 the log-ratio, the loss is the mean over the B rows (agg must stay None);
                 clip_cov / kl_cov: `clip_cov_*` / `kl_cov_*`, clip_cov draws its tokens with
                 `generator`). TRL's / Liger's cispo is "cispo" with clip_low=1 and
                 clip_high=epsilon_high - 1.
    agg None takes the type's default ("token-mean" for most); log_ratio_clamp None the peer's
    clamp of that type (20 for verl's ppo / sapo / cispo / dppo, 10 on the log sequence ratio
    for gspo, none otherwise). importance_sampling_level="sequence" (TRL's GSPO: the ratio of
    the row's mean log-ratio, gradient through the mean) applies to the clipped types, sapo and
    cispo.

    Rollout correction (verl's semantics, see `rollout_correction`): with `rollout_logprobs`,
    weights from old_logprobs vs rollout_logprobs (`rollout_is`, `rollout_is_threshold`,
    `rollout_is_batch_normalize`) multiply the per-token loss and rejected tokens
    (`rollout_rs`, `rollout_rs_threshold`) leave the mask. `bypass_mode=True` (verl's bypass:
    old_logprobs are the rollout log-probs): weights and rejection from the current log-probs
    (detached); the clipped types apply only the rejection, gpg / reinforce the weights too.

    Args:
        logprobs: `[..., T]` float32 / bfloat16 / float16 / float64; the gradient flows to it.
        old_logprobs: same shape, any float dtype (no gradient).
        advantages: same shape, or `[...]` (one per sequence).
        mask: same shape, bool / integer / float (a float mask weights tokens).
        clip_high: defaults to clip_low. dual_clip: None (off; verl's default is 3.0) or > 1.
        entropy: optional per-token entropy (same shape); adds the `entropy_mean` statistic
            (masked mean, no host sync). It does not enter the loss: add an entropy bonus with
            `masked_mean` / your aggregation as verl does.
        weights: optional per-token weights multiplying the per-token loss (detached).
    Returns:
        `(loss, stats)`: a 0-dim float32 loss (float64 for float64 logprobs) and 0-dim tensors
        `clip_frac`, `clip_frac_lower` (dual clip; 0 without it), `approx_kl` (masked mean of
        -log-ratio, verl's ppo_kl) and `ratio_mean`, all over the local (corrected) mask, no host
        sync (each as that type's verl function reports it); TRL's types (grpo, bnpo, dr_grpo,
        dapo, luspo, cispo) add TRL's `clip_low_frac` / `clip_high_frac` / `clip_region_frac`,
        `clip_low_frac_min`, `clip_high_frac_max` (and, at sequence level with per-sequence
        advantages, TRL's per-row `seq_clip_*_frac`); rollout correction adds `masked_fraction`,
        `is_weight_mean` and verl's metrics as `rollout_corr/<name>`.
    See ppo_kernels/losses/naive.py for the documented edge cases (all-zero mask: loss 0).
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
    cfg = checked_config(
        loss_type=loss_type,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        delta=delta,
        log_ratio_clamp=log_ratio_clamp,
        importance_sampling_level=importance_sampling_level,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        dro_beta=dro_beta,
        clip_cov_ratio=clip_cov_ratio,
        clip_cov_lb=clip_cov_lb,
        clip_cov_ub=clip_cov_ub,
        kl_cov_ratio=kl_cov_ratio,
        kl_cov_coef=kl_cov_coef,
    )
    rollout = ext.rollout_options(
        cfg,
        rollout_logprobs,
        rollout_is,
        rollout_is_threshold,
        rollout_is_batch_normalize,
        rollout_rs,
        rollout_rs_threshold,
        bypass_mode,
    )
    if rollout_logprobs is not None:
        check_tensor("rollout_logprobs", rollout_logprobs, dtypes=VALUE_DTYPES)
        check_shape("rollout_logprobs", rollout_logprobs, logprobs.shape, "like logprobs")
        check_same_device(logprobs=logprobs, rollout_logprobs=rollout_logprobs)
    if agg is None:
        agg, all_rows = default_aggregation(cfg.loss_type)
        if all_rows and global_batch_size is None:
            global_batch_size = logprobs.shape[:-1].numel()  # TRL: every row counts
    elif cfg.loss_type == "geo_mean":
        raise ValueError(
            "agg: geo_mean averages its per-sequence losses over the rows; leave agg None"
        )
    agg_i, scale, gd, gdv = aggregation(
        agg,
        logprobs.shape[-1],
        dp_size,
        global_num_tokens,
        global_batch_size,
        loss_scale_factor,
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
    """Clipped value loss (verl's `compute_value_loss`), fused: per token
    `0.5 * max((v - G)^2, (clip(v, v_old - clip, v_old + clip) - G)^2)` (`0.5 * (v - G)^2` when
    clip is None), aggregated like `ppo_policy_loss` (`empty`, `empty_stats`, `weights` as
    there). The gradient flows to `values`.

    Returns `(loss, {"clip_frac": ...})` (clip_frac: masked mean of [clipped error > plain error])."""
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
