"""The public API of the fused hidden-states policy loss: `linear_policy_loss` (typed arguments,
defaults, the aggregation's normalisers, rollout correction from given log-probs). Tensor checks
(dtype, shape, device) run in the registered op (csrc/ops/linear_policy_loss.cpp); this layer
checks what only it sees (scalars, the loss type's options, shapes before they are flattened)."""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    check_bool,
    check_devices,
    check_float,
    check_int,
    check_same_device,
    check_temperature,
    check_tensor,
)
from ..fused_linear.planner import resolve_logits_dtype
from ..kl.naive import parse_estimator, resolve_clamp
from ..losses import policy_loss as ext
from ..losses import policy_math as pm
from ..losses import rollout_correction as rc
from ..losses.aggregate import aggregation, checked_config
from . import op

_op = _backend.op("linear_policy_loss")


def _per_token(name, t, shape, rows):
    check_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} (like labels), got {tuple(t.shape)}"
        )
    return t.reshape(rows)


def _is_threshold(x):
    """rollout_is_threshold as the schema's string: a number, or 'lower_upper'."""
    if isinstance(x, (tuple, list)):
        return f"{float(x[0])!r}_{float(x[1])!r}"
    return x if isinstance(x, str) else repr(float(x))


def _joined(x):
    """rollout_rs / rollout_rs_threshold as the schema's comma-separated string."""
    if isinstance(x, (tuple, list)):
        return ",".join(v if isinstance(v, str) else repr(float(v)) for v in x)
    return x if isinstance(x, str) else repr(float(x))


def linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    *,
    bias: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_bias: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    weights: Tensor | None = None,
    loss_type: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    delta: float | None = None,
    log_ratio_clamp: float | None = None,
    importance_sampling_level: str = "token",
    agg: str | None = None,
    dp_size: int = 1,
    global_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
    loss_scale_factor: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp=None,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int | None = None,
    logits_dtype: str | None = "auto",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    dro_beta: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 0.1,
    generator: torch.Generator | None = None,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | tuple[float, float] | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    bypass_mode: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    reduce_hidden_grad: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO / GRPO policy loss from the hidden states and the LM head in one chunked pass:
    logits, log-probs, entropy, KL, the loss and its gradients, never building the [N, V] logits,
    with the logits computed once (3 GEMMs: the logits, then grad_hidden = G W and
    grad_weight = G^T h for the logits gradient G formed in the forward; `loss.backward()` only
    scales these by the upstream gradient).

    loss = pg - entropy_coef * agg(entropy) + kl_coef * agg(kl)   (verl's actor convention)

    Args:
        hidden: `[..., H]` (e.g. `[B, T, H]`), float32 / bfloat16 / float16 (float64 runs the
            float64 eager loop); gradients flow to it, to weight and to bias, each only when it
            requires grad (a frozen LM head costs no weight-gradient GEMM).
        weight: `[V, H]`, the LM head, hidden's dtype. bias: optional `[V]`.
        labels: int64 / int32, `hidden.shape[:-1]`; the leading dimensions are the sequences
            (rows), the last one their tokens (a 1-D input is one sequence).
        advantages: per token (labels' shape) or per sequence (`labels.shape[:-1]`).
        old_logprobs, mask: per token (mask: bool / integer / float weights; 0 = no loss).
        ref_logprobs: per token; the KL term `kl_coef * agg(kl)` with the sampled estimator
            `kl_estimator` ("k1", "k2", "k3", "abs", their aliases, "+" straight-through) and
            `kl_clamp` (as kl_penalty: "none", "verl", "openrlhf" or a KLClamp).
        ref_hidden, ref_weight, ref_bias: instead of ref_logprobs, the reference model's hidden
            states (`[..., H_ref]`) and LM head: kl is the exact KL(pi || pi_ref) over the whole
            vocabulary (as `full_kl`, the same temperature and softcap), its reference logits
            tile computed in the same pass (one more GEMM, no gradient to the reference).
        entropy_coef: the entropy bonus `- entropy_coef * agg(entropy)`, with its exact gradient.
        loss_type, clip_low, clip_high, dual_clip, delta, log_ratio_clamp,
            importance_sampling_level, agg, dp_size, global_num_tokens, global_batch_size,
            loss_scale_factor, tau_pos, tau_neg, dro_beta, clip_cov_*, kl_cov_*, generator,
            weights, rollout_logprobs, rollout_is, rollout_is_threshold,
            rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, bypass_mode:
            exactly as `ppo_policy_loss` (every loss type; agg=None takes the type's default;
            the KL and entropy terms use the same aggregation, over the corrected mask).
        temperature, softcap, ignore_index, max_chunk_bytes: as `linear_token_logprobs`.
        logits_dtype: for bf16 / fp16 inputs, "float32" (float32 tiles: the inputs upcast chunk
            by chunk, float32 GEMMs) or "input" (GEMMs in the input dtype, float32 reductions:
            the roundings of a materialised bf16 head, and of Liger's / TRL's); "auto" (default;
            None means the same): `ppo_kernels.default_logits_dtype(hidden.dtype,
            hidden.device)`, "input" on CPUs with native bf16 / fp16 matmuls, "float32"
            elsewhere (see `linear_token_logprobs`).
        process_group: vocab-parallel form (a tensor-parallel LM head, Megatron's layout, as
            `linear_token_logprobs`): `weight` / `bias` (and `ref_weight` / `ref_bias`) hold this
            rank's contiguous slice of the vocabulary, `hidden` and every per-token input are
            replicated, labels are global ids. One all-gather of a small header per call (the
            slices' layout), then one all-gather of per-row statistics per row block; loss and
            stats are the unsharded op's on every rank. Each rank's weight / bias gradient is its
            slice of the unsharded one; the hidden gradient is all-reduced once at the end unless
            `reduce_hidden_grad=False`. Eager only (no torch.compile graph).
        vocab_start: this rank's first vocabulary id (default: from the slice sizes, rank order).

    Passes: per-token types run one pass. Statistics of the current log-probs over a whole
    sequence (importance_sampling_level="sequence", gspo, geo_mean) cost nothing extra when a
    chunk holds whole sequences; a sequence longer than a chunk, clip_cov / kl_cov (batch
    statistics) and bypass_mode (weights and rejection from the current log-probs) take a first
    pass computing the log-probs only, then the full pass (4 GEMMs).

    Returns:
        `(loss, stats)`: a 0-dim float32 loss (float64 for float64 hidden); stats, detached and
        without host syncs: per-token `logprobs`, `entropy` and (with ref_logprobs) `kl`
        (labels' shape; kl is 0 off the mask), `pg_loss`, `entropy_loss` (agg(entropy)),
        `entropy_mean`, `kl_loss`, `kl_mean` (with ref_logprobs), the policy statistics of
        `ppo_policy_loss` for that type (`clip_frac`, `clip_frac_lower`, `approx_kl`,
        `ratio_mean`, TRL's clip fractions), and with rollout correction `masked_fraction`,
        `is_weight_mean` and verl's `rollout_corr/*` metrics. Means are over the (corrected)
        mask, 0 for an empty one.
    """
    # every argument by name (not **locals(): torch 2.11's Dynamo cannot trace that)
    call, stats, shape = _resolve(
        hidden,
        weight,
        labels,
        advantages,
        old_logprobs,
        mask,
        bias=bias,
        ref_logprobs=ref_logprobs,
        ref_hidden=ref_hidden,
        ref_weight=ref_weight,
        ref_bias=ref_bias,
        rollout_logprobs=rollout_logprobs,
        weights=weights,
        loss_type=loss_type,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        delta=delta,
        log_ratio_clamp=log_ratio_clamp,
        importance_sampling_level=importance_sampling_level,
        agg=agg,
        dp_size=dp_size,
        global_num_tokens=global_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        kl_clamp=kl_clamp,
        entropy_coef=entropy_coef,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        max_chunk_bytes=max_chunk_bytes,
        logits_dtype=logits_dtype,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        dro_beta=dro_beta,
        clip_cov_ratio=clip_cov_ratio,
        clip_cov_lb=clip_cov_lb,
        clip_cov_ub=clip_cov_ub,
        kl_cov_ratio=kl_cov_ratio,
        kl_cov_coef=kl_cov_coef,
        generator=generator,
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        bypass_mode=bypass_mode,
        process_group=process_group,
        vocab_start=vocab_start,
        reduce_hidden_grad=reduce_hidden_grad,
    )
    args = call[: len(op.ARG_NAMES)]
    if process_group is not None:
        from ..distributed.vocab_parallel_policy import vocab_parallel_linear_policy_loss

        loss, st, tok = vocab_parallel_linear_policy_loss(
            args, process_group, vocab_start, reduce_hidden_grad
        )
    else:
        loss, st, tok = _op(*args)
    out = dict(zip(op.stat_names(call), st.unbind(0)))
    out.update(stats)
    out["logprobs"] = tok[0].view(shape)
    out["entropy"] = tok[1].view(shape)
    if call.ref_logprobs is not None or call.ref_hidden is not None:
        out["kl"] = tok[2].view(shape)
    return loss, out


_SIGNATURE = inspect.signature(linear_policy_loss)


def arguments(*args, **kwargs) -> tuple[op.Call, dict[str, Tensor], tuple[int, ...]]:
    """What linear_policy_loss(*args, **kwargs) hands the registered op: (its arguments as
    op.Call, need_* False; the statistics computed before it (rollout correction from given
    log-probs); the per-token shape). The tests feed the same Call to
    reference.linear_policy_loss."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return _resolve(**bound.arguments)


def _resolve(
    hidden,
    weight,
    labels,
    advantages,
    old_logprobs,
    mask,
    *,
    bias,
    ref_logprobs,
    ref_hidden,
    ref_weight,
    ref_bias,
    rollout_logprobs,
    weights,
    loss_type,
    clip_low,
    clip_high,
    dual_clip,
    delta,
    log_ratio_clamp,
    importance_sampling_level,
    agg,
    dp_size,
    global_num_tokens,
    global_batch_size,
    loss_scale_factor,
    kl_coef,
    kl_estimator,
    kl_clamp,
    entropy_coef,
    temperature,
    softcap,
    ignore_index,
    max_chunk_bytes,
    logits_dtype,
    tau_pos,
    tau_neg,
    dro_beta,
    clip_cov_ratio,
    clip_cov_lb,
    clip_cov_ub,
    kl_cov_ratio,
    kl_cov_coef,
    generator,
    rollout_is,
    rollout_is_threshold,
    rollout_is_batch_normalize,
    rollout_rs,
    rollout_rs_threshold,
    bypass_mode,
    process_group,
    vocab_start,
    reduce_hidden_grad,
):
    check_tensor("hidden", hidden, min_dim=1)
    if process_group is None and vocab_start is not None:
        raise ValueError("vocab_start: needs process_group (the vocab-parallel form)")
    check_bool("reduce_hidden_grad", reduce_hidden_grad)
    check_tensor("weight", weight)
    check_tensor("labels", labels, min_dim=1)
    shape = tuple(labels.shape)
    if tuple(hidden.shape[:-1]) != shape:
        raise ValueError(
            f"hidden: expected shape {shape + (hidden.shape[-1],)} (labels.shape + (H,)), "
            f"got {tuple(hidden.shape)}"
        )
    check_same_device(hidden=hidden, weight=weight, labels=labels)
    # the rest too: the rollout correction reads some before the op's checks run
    check_devices(
        "hidden", hidden, old_logprobs=old_logprobs, mask=mask, advantages=advantages, bias=bias,
        ref_logprobs=ref_logprobs, weights=weights, ref_hidden=ref_hidden, ref_weight=ref_weight,
        ref_bias=ref_bias, rollout_logprobs=rollout_logprobs,
    )  # fmt: skip
    T = shape[-1]
    B = math.prod(shape[:-1])
    rows = (B, T)
    h2 = hidden.reshape(B * T, hidden.shape[-1])
    lab = _per_token("labels", labels, shape, rows)
    old = _per_token("old_logprobs", old_logprobs, shape, rows)
    msk = _per_token("mask", mask, shape, rows)
    check_tensor("advantages", advantages)
    if tuple(advantages.shape) == shape[:-1]:  # one per sequence
        adv = advantages.reshape(B)
    else:
        adv = _per_token("advantages", advantages, shape, rows)
    ref = None if ref_logprobs is None else _per_token("ref_logprobs", ref_logprobs, shape, rows)
    wts = None if weights is None else _per_token("weights", weights, shape, rows)
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
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator)}")
    if agg is None:
        agg, all_rows = pm.default_aggregation(cfg.loss_type)
        if all_rows and global_batch_size is None:
            global_batch_size = B  # TRL: every row counts
    elif cfg.loss_type == "geo_mean":
        raise ValueError(
            "agg: geo_mean averages its per-sequence losses over the rows; leave agg None"
        )
    agg_i, scale, gd, gdv = aggregation(
        agg, T, dp_size, global_num_tokens, global_batch_size, loss_scale_factor, hidden.device,
        "hidden",
    )  # fmt: skip
    kl_coef = check_float("kl_coef", kl_coef)
    entropy_coef = check_float("entropy_coef", entropy_coef)
    rh = None
    if ref_hidden is not None:
        check_tensor("ref_hidden", ref_hidden, min_dim=1)
        if tuple(ref_hidden.shape[:-1]) != shape:
            raise ValueError(
                f"ref_hidden: expected shape {shape} + (H_ref,) (like labels), got "
                f"{tuple(ref_hidden.shape)}"
            )
        rh = ref_hidden.detach().reshape(B * T, ref_hidden.shape[-1])
    if kl_coef != 0 and ref_logprobs is None and ref_hidden is None:
        raise ValueError("kl_coef: a KL term needs ref_logprobs or ref_hidden / ref_weight")
    est, st = parse_estimator(kl_estimator)
    bounds = resolve_clamp(kl_clamp, est)
    temperature = check_temperature(temperature)
    softcap = check_float("softcap", softcap, positive=True, allow_none=True)
    ignore_index = check_int("ignore_index", ignore_index)
    max_chunk_bytes = check_int("max_chunk_bytes", max_chunk_bytes, min_value=1, allow_none=True)
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    stats: dict[str, Tensor] = {}
    bypass = rollout is not None and rollout.bypass
    if rollout is not None and not bypass:
        # weights and rejection from the old vs the rollout log-probs: known before the loop
        check_tensor("rollout_logprobs", rollout_logprobs)
        roll = _per_token("rollout_logprobs", rollout_logprobs, shape, rows)
        check_same_device(hidden=hidden, rollout_logprobs=roll)
        lp, rl, m = rc.rows_of(old, roll, msk)
        rw, keep, met = rc.compute(
            lp, rl, m, rollout.level, rollout.is_spec, rollout.batch_normalize, rollout.rs_specs
        )
        stats.update({f"rollout_corr/{k}": v for k, v in met.items()})
        n0 = (m != 0).sum().to(m.dtype)
        if keep is not None:
            m = m * keep
            msk = m
        n1 = (m != 0).sum().to(m.dtype)
        stats["masked_fraction"] = torch.where(n0 > 0, (n0 - n1) / n0.clamp(min=1), n0 * 0)
        if rw is not None:
            stats["is_weight_mean"] = pm.masked_means({"w": rw}, m)["w"]
            wts = rw if wts is None else rw * wts.to(rw.dtype)
    call = op.Call(
        h2,
        weight,
        lab,
        adv,
        old,
        msk,
        bias,
        ref,
        wts,
        gd,
        rh,
        None if ref_weight is None else ref_weight.detach(),
        None if ref_bias is None else ref_bias.detach(),
        cfg.loss_type,
        cfg.clip_low,
        cfg.clip_high,
        cfg.dual_clip,
        cfg.delta,
        cfg.log_ratio_clamp,
        cfg.importance_sampling_level,
        cfg.tau_pos,
        cfg.tau_neg,
        cfg.dro_beta,
        cfg.clip_cov_ratio,
        cfg.clip_cov_lb,
        cfg.clip_cov_ub,
        cfg.kl_cov_ratio,
        cfg.kl_cov_coef,
        agg_i,
        scale,
        gdv,
        kl_coef,
        est,
        st,
        *bounds,
        entropy_coef,
        float(temperature),
        softcap,
        ignore_index,
        int(max_chunk_bytes or 0),
        logits_dtype,
        bypass,
        rollout.level if bypass else None,
        _is_threshold(rollout_is_threshold) if bypass and rollout.is_spec else None,
        bool(rollout.batch_normalize) if bypass else False,
        _joined(rollout_rs) if bypass and rollout.rs_specs else None,
        _joined(rollout_rs_threshold) if bypass and rollout.rs_specs else None,
        generator,
        False,
        False,
        False,
    )
    return call, stats, shape
