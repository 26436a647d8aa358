"""Eager reference of linear_policy_loss: the semantics, written as the composition of the existing
ops' references and differentiated by torch autograd (float64-capable; it builds the [N, V]
logits, so it is for tests and small sizes). The registered op (op.py) must give the loss, the
statistics and the gradients autograd gives here.

With z = softcap(hidden @ weight.T + bias) / temperature (softcap: cap * tanh(logits / cap)):
  logprobs[t] = log_softmax(z[t])[label[t]], entropy[t] = H(softmax(z[t])), both 0 (and no
    gradient) where label == ignore_index  (token_logprobs / linear_token_logprobs);
  m = the mask weights; in bypass mode times verl's rejection (rollout.compute on the detached
    current log-probs vs old_logprobs, the rollout log-probs there), whose IS weights multiply the
    per-token policy loss of the non-clipped types;
  pg = the policy loss of `loss_type` on those log-probs (policy_naive.policy_loss: every type
    of policy_math, aggregated by `agg` with row coefficients c_b), weighted by `weights`;
  k = c_b * m (the same aggregation, unweighted), kl[t] = kl_penalty(logprobs, ref_logprobs)[t]
    where m != 0, else 0;
  loss = pg - entropy_coef * sum(k * entropy) + kl_coef * sum(k * kl)   (verl's actor:
    pg - entropy_coeff * agg(entropy) + kl_coef * agg(kl)),
    + z_loss * sum(m * lse^2) / sum(m) with lse = logsumexp(z) (0 where label == ignore_index).
Statistics: masked means over m (0 for an empty mask) of policy_math's per-token statistics, of the
entropy (`entropy_mean`) and of the KL (`kl_mean`), the aggregated terms (`pg_loss`,
`entropy_loss` = agg(entropy), `kl_loss` = agg(kl)), TRL's per-row summaries, and in bypass mode
verl's rollout-correction metrics.

Under the rollout sampler's distribution (the arguments of linear_policy_loss_sampler: a
temperature tensor, top-k, top-p, min-p, `sampler`, `mask_outside`): logprobs and entropy are
token_logprobs' sampler's (token_logprobs/naive.py: sampler_forward decides the kept set K on the
detached logits; the renormalised softmax on K is written out here, so autograd gives the gradient
on K only), a label outside K has logprob -inf; with mask_outside those tokens get m = 0 before
anything else (the loss, every normaliser and every statistic), and `num_outside` counts the
tokens of the given mask whose label is outside K.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._math import acc_dtype
from ..kl import naive as kl_ref
from ..losses import policy_math as pm
from ..losses import policy_naive
from ..losses import rollout_correction as rc
from ..losses.config import PolicyLossConfig, fields
from ..losses.naive import row_coefficients
from ..token_logprobs import naive as tl_ref


def _logits(a, h, W, b, acc, temperature=True):
    """softcap(h W^T + b) / temperature in the accumulation dtype (temperature=False: not
    divided). With logits_dtype="input" (bf16 / fp16) the logits are rounded to the input dtype
    first, as the materialised path (and the op's input-dtype tiles) do."""
    if a.logits_dtype == "input" and h.dtype in (torch.bfloat16, torch.float16):
        logits = h @ W.T
        if b is not None:
            logits = logits + b
        if a.softcap is not None:
            logits = torch.tanh(logits / a.softcap) * a.softcap
        logits = logits.to(acc)
    else:
        logits = h.to(acc) @ W.to(acc).T
        if b is not None:
            logits = logits + b.to(acc)
        if a.softcap is not None:
            logits = torch.tanh(logits / a.softcap) * a.softcap
    return logits / a.temperature if temperature else logits


def _per_token(value, t, shape, dtype):
    """A sampler parameter per token: the tensor t ([B] or [B, T]) broadcast, else the scalar."""
    if t is None:
        return torch.full(shape, value, dtype=dtype)
    t = t.to(dtype)
    return t.reshape(tuple(t.shape) + (1,) * (len(shape) - t.dim())).expand(shape)


def sampled_token_values(a) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, outside) [B, T] under the sampler's distribution, differentiable
    (autograd) through the kept set: K from token_logprobs' sampler_forward on the detached
    logits, then logsumexp / softmax restricted to K."""
    h = a.hidden
    acc = acc_dtype(h.dtype)
    x = _logits(a, h, a.weight, a.bias, acc, temperature=False)
    shape = tuple(a.labels.shape)
    f64 = torch.float64
    temps = _per_token(a.temperature, a.temperatures, shape, f64)
    inv_t = 1.0 / temps
    r = tl_ref.sampler_forward(
        x.detach().view(*shape, -1), a.labels, inv_t, _per_token(a.top_k, a.top_ks, shape,
        torch.int64), _per_token(a.top_p, a.top_ps, shape, f64), _per_token(a.min_p, a.min_ps,
        shape, f64), a.sampler, a.ignore_index, True,
    )  # fmt: skip
    cut, cut_index, outside = (t.reshape(-1) for t in r[3:6])
    V = x.shape[-1]
    j = torch.arange(V, device=x.device)
    xd = x.detach()
    kept = (xd > cut.unsqueeze(-1)) | ((xd == cut.unsqueeze(-1)) & (j <= cut_index.unsqueeze(-1)))
    zt = x * inv_t.reshape(-1, 1).to(acc)
    lse = torch.logsumexp(torch.where(kept, zt, -torch.inf), -1, keepdim=True)
    logq = torch.where(kept, zt - lse, 0.0)
    q = torch.where(kept, logq.exp(), 0.0)
    labels = a.labels.reshape(-1)
    valid = labels != a.ignore_index
    safe = torch.where(valid, labels, 0).long().unsqueeze(-1)
    in_set = kept.gather(-1, safe).squeeze(-1)
    zero = torch.zeros((), dtype=acc, device=x.device)
    lp = torch.where(valid & in_set, logq.gather(-1, safe).squeeze(-1), zero)
    lp = torch.where(valid & ~in_set, -torch.inf, lp)
    ent = torch.where(valid, -(q * logq).sum(-1), zero)
    return lp.view(shape), ent.view(shape), outside.view(shape)


def token_values(a) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logprobs, entropy, the exact KL to the reference head or None) [B, T] from the hidden
    states, differentiable (autograd; the reference head is not)."""
    h = a.hidden
    acc = acc_dtype(h.dtype)
    z = _logits(a, h, a.weight, a.bias, acc)
    logp = torch.log_softmax(z, -1)
    labels = a.labels.reshape(-1)
    valid = labels != a.ignore_index
    zero = torch.zeros((), dtype=acc, device=h.device)
    lp = logp.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    lp = torch.where(valid, lp, zero)
    ent = -(torch.softmax(z, -1) * logp).sum(-1)
    ent = torch.where(valid, ent, zero)
    kl = None
    if a.ref_hidden is not None:
        with torch.no_grad():
            logq = torch.log_softmax(_logits(a, a.ref_hidden, a.ref_weight, a.ref_bias, acc), -1)
        kl = (logp.exp() * (logp - logq)).sum(-1).view(a.labels.shape)
    return lp.view(a.labels.shape), ent.view(a.labels.shape), kl


def loss_config(a) -> PolicyLossConfig:
    """The PolicyLossConfig of a call's arguments (op.Call's fields)."""
    return PolicyLossConfig(**{k: getattr(a, k) for k in fields(PolicyLossConfig)})


def linear_policy_loss(a, generator=None) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, stats) of the registered op's arguments `a` (op.Call's fields; the need_* flags
    are not used: autograd gives every gradient). stats holds the op's statistics by name and the
    per-token `logprobs`, `entropy`, `kl` (detached)."""
    cfg = loss_config(a)
    sampled = hasattr(a, "mask_outside")  # a SamplerCall: the sampler's distribution
    outside, mask = None, a.mask
    if sampled:
        lp, ent, outside = sampled_token_values(a)
        full_kl = None
        if a.mask_outside:
            mask = torch.where(outside, torch.zeros_like(mask), mask)
    else:
        lp, ent, full_kl = token_values(a)
    acc = lp.dtype
    x = pm.prepare(lp, a.old_logprobs, a.advantages, mask)
    gd = a.global_denom
    if gd is not None:
        gd = gd.reshape(()).to(acc)
    elif a.global_denom_value is not None:
        gd = torch.tensor(a.global_denom_value, dtype=acc, device=lp.device)
    w = None if a.weights is None else torch.where(x.m != 0, a.weights.to(acc), 0.0)
    stats: dict[str, Tensor] = {"masked_fraction": torch.zeros((), dtype=acc)}
    if sampled:
        stats["num_outside"] = (outside & (a.mask != 0)).sum().to(acc)
        stats["outside"] = outside
    if a.bypass_mode:
        level, is_spec, rs = rc.check_options(
            a.rollout_is, a.rollout_is_threshold, a.rollout_rs, a.rollout_rs_threshold
        )
        rw, keep, met = rc.compute(
            x.lp.detach(), x.old, x.m, level, is_spec, a.rollout_is_batch_normalize, rs
        )
        m0 = x.m
        if keep is not None:
            x = x._replace(m=x.m * keep)
        n0, n1 = (m0 != 0).sum().to(acc), (x.m != 0).sum().to(acc)
        stats["masked_fraction"] = torch.where(n0 > 0, (n0 - n1) / n0.clamp(min=1), 0 * n0)
        if rw is not None:
            stats["is_weight_mean"] = pm.masked_means({"w": rw}, x.m)["w"]
            if cfg.loss_type not in pm.CLIP_TYPES:
                w = rw if w is None else w * rw
        stats.update({f"rollout_corr/{k}": v for k, v in met.items()})
    m = x.m
    state = _rng_state(generator)
    pg = policy_naive.policy_loss(cfg, x, x.lp, a.agg, a.scale, gd, w, generator)
    k = row_coefficients(m, a.agg, a.scale, gd).unsqueeze(-1) * m
    zero = torch.zeros((), dtype=acc, device=lp.device)
    ent_m = torch.where(m != 0, ent, zero)
    ent_agg = (k * ent_m).sum()
    loss = pg - a.entropy_coef * ent_agg
    stats.update(pg_loss=pg.detach(), entropy_loss=ent_agg.detach())
    means = {"entropy_mean": ent_m.detach()}
    kl = torch.zeros_like(lp)
    if a.ref_logprobs is not None or full_kl is not None:
        if full_kl is not None:
            kl = full_kl
        else:
            kl = kl_ref.kl_penalty(
                lp,
                a.ref_logprobs.to(acc),
                a.kl_estimator,
                a.kl_straight_through,
                (a.kl_in_lo, a.kl_in_hi, a.kl_out_lo, a.kl_out_hi),
            )
        kl = torch.where(m != 0, kl, zero)
        kl_agg = (k * kl).sum()
        loss = loss + a.kl_coef * kl_agg
        stats["kl_loss"] = kl_agg.detach()
        means["kl_mean"] = kl.detach()
    if a.z_loss != 0:  # mean over the mask of lse^2, lse of the tempered logits (0 off a label)
        z = _logits(a, a.hidden, a.weight, a.bias, acc, temperature=not sampled)
        if sampled:  # the temperature per token (the sampler's tensor)
            t = _per_token(a.temperature, a.temperatures, tuple(a.labels.shape), acc)
            z = z / t.reshape(-1, 1).to(z.device)
        labels = a.labels.reshape(-1)
        lse = torch.where(labels != a.ignore_index, torch.logsumexp(z, -1), zero).view(m.shape)
        means["z_loss"] = (lse * lse).detach()
        loss = loss + a.z_loss * pm.masked_means({"z": lse * lse}, m)["z"]
    stats.update(pm.masked_means(means, m))
    # policy_math's statistics of the detached values (what ppo_policy_loss reports)
    xd = pm.Inputs(*(t.detach() for t in x))
    after = _rng_state(generator)
    _set_rng_state(generator, state)  # clip_cov: the loss's draw again
    terms = pm.token_terms(cfg, xd, pm.statistics(cfg, xd, generator))
    _set_rng_state(generator, after)
    per_row = cfg.sequence_level and a.advantages.dim() == 1
    stats.update(pm.masked_means(terms.metrics, m))
    stats.update(pm.row_metrics(terms.metrics, m, per_row))
    stats.update(logprobs=lp.detach(), entropy=ent.detach(), kl=kl.detach())
    return loss, stats


def _rng_state(generator):
    return torch.random.get_rng_state() if generator is None else generator.get_state()


def _set_rng_state(generator, state):
    if generator is None:
        torch.random.set_rng_state(state)
    else:
        generator.set_state(state)
