"""The public API of the fused hidden-states policy loss: `linear_policy_loss` (typed arguments,
defaults, the aggregation's normalisers, rollout correction from given log-probs). Tensor checks
(dtype, shape, device) run in the registered op (csrc/ops/linear_policy_loss.cpp); this layer
checks what only it sees (scalars, the loss type's options, shapes before they are flattened)."""

from __future__ import annotations

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
    check_str,
    check_temperature,
    check_tensor,
)
from ..fused_linear.planner import resolve_logits_dtype
from ..kl.naive import parse_estimator, resolve_clamp
from ..losses import policy_loss as ext
from ..losses import policy_math as pm
from ..losses import rollout_correction as rc
from ..losses.aggregate import policy_aggregation
from ..losses.config import (
    AggregationConfig,
    EntropyTermConfig,
    KLTermConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    takes_configs,
)
from ..token_logprobs.api import check_sampler_unused, check_values_here, sampler_options
from ..token_logprobs.naive import SAMPLERS
from . import op

_op = _backend.op("linear_policy_loss")
_sampler_op = _backend.op("linear_policy_loss_sampler")


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


def sampler_args(labels, B, T, temperature, top_k, top_p, min_p, sampler, mask_outside,
                 process_group=None):  # fmt: skip
    """(the scalar temperature, the op's sampler arguments: op.SAMPLER_NAMES), checked. A
    per-row tensor (shape a leading part of labels.shape) becomes [B] (one value per sequence)
    or [B, T] (per token), as the op's [B, T] labels take it. The vocab-parallel form
    (process_group) runs no registered op to check the tensors' values: they are checked here,
    before any collective, so that every rank raises alike."""
    sampler = check_str("sampler", sampler, SAMPLERS)
    mask_outside = check_bool("mask_outside", mask_outside)
    values = None if process_group is None else check_values_here(labels)
    _, _, temp, temps, k, ks, p, ps, mp, mps = sampler_options(
        labels, temperature, top_k, top_p, min_p, None, 0, values
    )
    L = labels.dim()

    def rows(t):
        if t is None:
            return None
        if t.dim() == L:
            return t.reshape(B, T)
        lead = tuple(labels.shape[:-1])
        return t.reshape(tuple(t.shape) + (1,) * (L - 1 - t.dim())).expand(lead).reshape(B)

    return temp, (rows(temps), k, rows(ks), p, rows(ps), mp, rows(mps), sampler, mask_outside)


def wants_sampler(temperature, top_k, top_p, min_p, sampler, mask_outside) -> bool:
    """Whether a fused loss's call gives one of the sampler's options (a temperature tensor,
    top_k, top_p, min_p); else `sampler` and `mask_outside` are checked, unused."""
    if (
        top_k is not None
        or top_p is not None
        or min_p is not None
        or isinstance(temperature, Tensor)
    ):
        return True
    if sampler != "vllm" or mask_outside is not True:
        check_sampler_unused(sampler, 0)
        check_bool("mask_outside", mask_outside)
    return False


_CAPTURE: list = []  # arguments(): the calls whose op arguments are kept instead of run


@takes_configs(
    loss_config=PolicyLossConfig,
    aggregation_config=AggregationConfig,
    rollout_config=RolloutCorrectionConfig,
    kl_config=KLTermConfig,
    entropy_config=EntropyTermConfig,
)
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
    loss_config: PolicyLossConfig | None = None,
    aggregation_config: AggregationConfig | None = None,
    rollout_config: RolloutCorrectionConfig | None = None,
    kl_config: KLTermConfig | None = None,
    entropy_config: EntropyTermConfig | None = None,
    temperature: float | Tensor = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int | None = None,
    logits_dtype: str | None = "auto",
    generator: torch.Generator | None = None,
    process_group=None,
    vocab_start: int | None = None,
    reduce_hidden_grad: bool = True,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    sampler: str = "vllm",
    mask_outside: bool = True,
    z_loss: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO / GRPO policy loss from the hidden states and the LM head in one chunked pass:
    logits, log-probs, entropy, KL, the loss and its gradients, never building the [N, V] logits.

    loss = pg - entropy_coef * agg(entropy) + kl_coef * agg(kl)   (verl's actor convention)
           + z_loss * mean over the mask of lse^2                (with `z_loss`)

    pg is `ppo_policy_loss` of the log-probs z = (h W^T + b) / temperature gives, for every loss
    type. The logits are computed once (3 GEMMs: the logits tile, then grad_hidden = G W and
    grad_weight = G^T h for the logits gradient G formed in the forward); `loss.backward()` only
    scales these by the upstream gradient.

    Args:
        hidden (Tensor): `[..., H]` (e.g. `[B, T, H]`), float32 / bfloat16 / float16 (float64
            runs the float64 eager loop). Gradients flow to it, to weight and to bias, each
            only when it requires grad (a frozen head costs no weight-gradient GEMM).
        weight (Tensor): `[V, H]`, hidden's dtype. The LM head.
        labels (Tensor): `[...]` = `hidden.shape[:-1]`, int64 / int32. The leading dimensions
            are the sequences, the last one their tokens (1-D: one sequence).
        advantages (Tensor): labels' shape, or `labels.shape[:-1]` (one per sequence).
        old_logprobs (Tensor): labels' shape, float. The rollout-time log-probs.
        mask (Tensor): labels' shape, bool / integer / float. 0 = no loss.
        bias (Tensor, optional): `[V]`. Default None.
        ref_logprobs (Tensor, optional): labels' shape. The reference model's token log-probs:
            the KL term uses the sampled estimator of `kl_config`. Default None.
        ref_hidden (Tensor, optional): `[..., H_ref]`, with `ref_weight` `[V, H_ref]` and
            optional `ref_bias` `[V]`: the reference head instead of ref_logprobs. kl is then the
            exact KL(pi || pi_ref) over the vocabulary, its tile computed in the same pass (one
            more GEMM, no gradient to the reference). Default None.
        ref_weight (Tensor, optional): see ref_hidden. Default None.
        ref_bias (Tensor, optional): see ref_hidden. Default None.
        rollout_logprobs (Tensor, optional): labels' shape. The rollout engine's log-probs, for
            rollout correction (as `ppo_policy_loss`). Default None.
        weights (Tensor, optional): labels' shape. Per-token loss weights. Default None.
        loss_config (PolicyLossConfig, optional): the loss type and its options; its fields
            are accepted as flat keyword arguments (`loss_type="grpo"`, ...). Default "ppo".
        aggregation_config (AggregationConfig, optional): `agg` and its normalisers (flat
            fields too). The KL and entropy terms use the same aggregation. Default: the loss
            type's.
        rollout_config (RolloutCorrectionConfig, optional): rollout correction (flat fields
            too). Default: none.
        kl_config (KLTermConfig, optional): `kl_coef`, `kl_estimator`, `kl_clamp` (flat fields
            too). Default: no KL term.
        entropy_config (EntropyTermConfig, optional): `entropy_coef` (flat field too).
            Default: no entropy term.
        temperature (float or Tensor): divides the logits; positive. A float tensor gives
            per-row values (the rollout's per-request temperatures): its shape is a leading part
            of labels.shape (`[B]` per sequence or `[B, T]` per token for `[B, T]` labels).
            Default 1.0.
        softcap (float, optional): `softcap * tanh(z / softcap)` on the logits (Gemma's head).
            Default None.
        ignore_index (int): a label with this value has no log-prob and no loss. Default -100.
        max_chunk_bytes (int, optional): the chunk buffers' memory budget. Default None: 64 MiB
            on the CPU, 2 GiB on a GPU.
        logits_dtype (str, optional): "float32" (tiles in float32), "input" (GEMMs in the input
            dtype, float32 reductions: the roundings of a materialised bf16 head) or "auto"
            (`default_logits_dtype`). Default "auto".
        generator (torch.Generator, optional): clip_cov's random draw. Default None.
        process_group (ProcessGroup, optional): the vocab-parallel form: `weight` / `bias`
            (and the reference head's) hold this rank's contiguous slice of the vocabulary;
            hidden and every per-token input are replicated; labels are global ids. Eager
            only. Default None.
        vocab_start (int, optional): this rank's first vocabulary id. Default None: from the
            slice sizes, in rank order.
        reduce_hidden_grad (bool): all-reduce the hidden gradient across the group. Default
            True.
        top_k (int or Tensor, optional): the rollout engine's top-k (0 or >= V: off), a scalar
            or a per-row int tensor shaped like a per-row temperature. With top_p / min_p / a
            temperature tensor, the log-probs and entropy of the loss are those of the
            distribution the engine sampled from (`token_logprobs`' sampler: temperature, then
            min-p, then top-k and top-p, the kept tokens renormalised; docs/ppo-math.md, "The
            distribution the rollout sampled from"), and the gradient flows through the kept
            tokens only. Every tile then holds whole rows of the vocabulary: `max_chunk_bytes`
            must hold two rows' tiles (the tile and its gradient); with `process_group` whole
            rows of the slice, the kept set found with the other ranks per row block
            (docs/ppo-math.md). Not with the reference head (`ref_hidden`; `ref_logprobs`
            works). Default None: off.
        top_p (float or Tensor, optional): the engine's top-p, in (0, 1] (1: off), scalar or per
            row. Default None: off.
        min_p (float or Tensor, optional): the engine's min-p, in [0, 1] (0: off), scalar or per
            row. Default None: off.
        sampler (str): whose truncation rules, "vllm" or "sglang". Default "vllm".
        mask_outside (bool): a token whose label is outside the kept set (log-prob -inf: the
            engine could not have sampled it) leaves the loss as if its mask were 0: no loss, no
            gradient, and out of every normaliser and token count of the aggregation and of the
            statistics (with a truncation on, a first pass over the head finds these tokens
            before the normalisers: 4 GEMMs instead of 3). False keeps them in the mask with the -inf log-prob, as
            `ppo_policy_loss` on `token_logprobs`' sampled log-probs has them (one pass): the
            clipped types clamp its log-ratio (`log_ratio_clamp`), so the token adds a constant
            to the loss; the unclipped types (cispo, gpg, reinforce, dppo_*, kl_cov) and the KL
            term make the loss and the statistics non-finite. The gradients stay finite: the
            sampler's gradient has no log-prob term for a label outside the kept set (whatever
            the loss's coefficient there; its entropy term stays), and the sequence and batch
            statistics clamp or drop the -inf. Either way `num_outside` counts them. Default
            True.
        z_loss (float): the z-loss coefficient c >= 0 (PaLM's auxiliary loss, keeping the
            log-normaliser near 0): adds c * sum_t m_t lse_t^2 / sum_t m_t, lse_t the
            log-sum-exp of the token's tempered (and soft-capped) logits over the whole
            vocabulary (0 for a label == ignore_index), m the mask after rollout correction;
            its gradient on the logits is 2 c m_t lse_t softmax(z_t) / (T sum m), formed in the
            same pass (no extra GEMM). Reported as `z_loss` (the mean of lse^2). With the
            sampler's options lse_t is still the whole vocabulary's (the normaliser the model's
            head produces, not the kept set's), at the token's temperature, m the mask after
            `mask_outside`. Default 0.0: no term.

    Returns:
        `(loss, stats)`: a 0-dim float32 loss (float64 for float64 hidden) and a dict, detached
        and without host syncs: per-token `logprobs`, `entropy` and (with a reference) `kl`
        (labels' shape; kl is 0 off the mask); `pg_loss`, `entropy_loss`, `entropy_mean`,
        `kl_loss`, `kl_mean`; the policy statistics of `ppo_policy_loss` for the type; with
        rollout correction `masked_fraction`, `is_weight_mean` and `rollout_corr/*`. With the
        sampler's options: `num_outside` (the mask's tokens whose label is outside the kept set)
        and the per-token bool `outside` (labels' shape; `logprobs` is -inf there).

    Why: the loss, its gradients and every statistic in one pass over the head, without the
    N x V logits that dominate a policy step's memory. Statistics of the current log-probs over a
    whole sequence (sequence-level ratios, gspo, geo_mean) cost nothing extra when a block holds
    whole sequences; a longer sequence, clip_cov / kl_cov and bypass mode take a first pass of
    log-probs only (4 GEMMs). Semantics: docs/ppo-math.md ("The policy loss from hidden
    states"); the engine: ppo_kernels/fused_linear/.
    """
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
    cfg = loss_config
    rollout = ext.rollout_options(cfg, rollout_logprobs, rollout_config)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator)}")
    agg_i, scale, gd, gdv = policy_aggregation(
        aggregation_config, cfg.loss_type, B, T, hidden.device, "hidden"
    )
    kl_coef, entropy_coef = kl_config.kl_coef, entropy_config.entropy_coef
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
    est, st = parse_estimator(kl_config.kl_estimator)
    bounds = resolve_clamp(kl_config.kl_clamp, est)
    sampled = None  # the sampler's arguments of the op (op.SAMPLER_NAMES), or None: none given
    if wants_sampler(temperature, top_k, top_p, min_p, sampler, mask_outside):
        if ref_hidden is not None or ref_weight is not None:
            raise ValueError(
                "ref_hidden: the exact KL against a reference head is not supported with the "
                "sampler's options (temperature tensor, top_k, top_p, min_p) yet; give "
                "ref_logprobs (the sampled KL estimators)"
            )
        temperature, sampled = sampler_args(
            labels, B, T, temperature, top_k, top_p, min_p, sampler, mask_outside, process_group
        )
    if type(z_loss) is not float or z_loss != 0.0:
        z_loss = check_float("z_loss", z_loss, nonneg=True)
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
        *(getattr(cfg, k) for k in op.CONFIG_FIELDS),
        agg_i,
        scale,
        gdv,
        kl_coef,
        est,
        st,
        *bounds,
        entropy_coef,
        z_loss,
        float(temperature),
        softcap,
        ignore_index,
        int(max_chunk_bytes or 0),
        logits_dtype,
        bypass,
        rollout.level if bypass else None,
        _is_threshold(rollout_config.rollout_is_threshold) if bypass and rollout.is_spec else None,
        bool(rollout.batch_normalize) if bypass else False,
        _joined(rollout_config.rollout_rs) if bypass and rollout.rs_specs else None,
        _joined(rollout_config.rollout_rs_threshold) if bypass and rollout.rs_specs else None,
        generator,
        False,
        False,
        False,
    )
    if sampled is not None:
        call = op.SamplerCall(*call[: len(op.ARG_NAMES)], *sampled, False, False, False)
    if _CAPTURE:
        _CAPTURE[-1] = (call, stats, shape)
        return None
    outside = None
    if sampled is not None and process_group is not None:
        from ..distributed.vocab_parallel_policy import vocab_parallel_linear_policy_loss

        loss, st, tok, outside = vocab_parallel_linear_policy_loss(
            call[: len(op.ARG_NAMES)], process_group, vocab_start, reduce_hidden_grad, sampled
        )
    elif sampled is not None:
        loss, st, tok, outside = _sampler_op(*call[: len(op.ARG_NAMES) + len(op.SAMPLER_NAMES)])
    elif process_group is not None:
        from ..distributed.vocab_parallel_policy import vocab_parallel_linear_policy_loss

        loss, st, tok = vocab_parallel_linear_policy_loss(
            call[: len(op.ARG_NAMES)], process_group, vocab_start, reduce_hidden_grad
        )
    else:
        loss, st, tok = _op(*call[: len(op.ARG_NAMES)])
    out = dict(zip(op.stat_names(call), st.unbind(0)))
    out.update(stats)
    out["logprobs"] = tok[0].view(shape)
    out["entropy"] = tok[1].view(shape)
    if outside is not None:
        out["outside"] = outside.view(shape)
    if call.ref_logprobs is not None or call.ref_hidden is not None:
        out["kl"] = tok[2].view(shape)
    return loss, out


def arguments(*args, **kwargs) -> tuple[op.Call, dict[str, Tensor], tuple[int, ...]]:
    """What linear_policy_loss(*args, **kwargs) hands the registered op, without running it:
    (its arguments as op.Call -- op.SamplerCall with the sampler's options --, need_* False;
    the statistics computed before it (rollout correction from given log-probs); the per-token
    shape). The tests feed the same Call to naive.linear_policy_loss."""
    _CAPTURE.append(None)
    try:
        linear_policy_loss(*args, **kwargs)
        return _CAPTURE[-1]
    finally:
        _CAPTURE.pop()
