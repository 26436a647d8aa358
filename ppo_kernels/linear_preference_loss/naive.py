"""Eager reference of linear_preference_loss: the semantics, on materialised logits, differentiated
by torch autograd (float64-capable; it builds the [N, V] logits, so it is for tests and small
sizes). The registered op (op.py) must give the loss, the statistics and the gradients autograd
gives here. It shares the peers' formulas with losses/preference_naive.py (TRL's and Liger's
losses written as they write them), not the analytic math the op runs (preference_math.py).

With z = softcap(hidden @ weight.T + bias) / temperature and the rows R = completions of T tokens:
  lp[r, t] = log_softmax(z[r, t])[label] where label != ignore_index and mask != 0, else 0;
  seq[r] = sum_t k[r, t] lp[r, t] with k the mask (sums), mask / n (average_log_prob) or LD-DPO's
    weights (ld_alpha);
  paired types: the pairs (chosen row, rejected row) -- the first / second half of the rows, or
    `pairs` -- and per pair preference_naive.pair_losses of (seq_c, seq_r, ref_c, ref_r);
    loss = sum_k lambda_k mean_pairs(l_k);
  unpaired (kto, apo_zero_unpaired): per row the KTO term of x = seq - ref against the reference
    point, loss = mean over the rows;
  the reference: given sequence log-probs `ref_logps`, or the reference head's seq computed the
    same way (no gradient), or none (0).
Edge cases: a row without tokens has sequence log-prob 0; the SFT term of a batch without chosen
tokens is 0; no pairs (or no rows) give loss 0.

Under the rollout sampler's distribution (the arguments of linear_preference_loss_sampler): each
head's lp is token_logprobs' sampler's under its own kept set (linear_policy_loss/naive.py's
sampled_token_values on the policy's and on the reference head's logits), -inf for a label
outside it; with mask_outside a token outside either kept set leaves the mask (before the
sequence sums, their weights and counts); `num_outside` counts the completion tokens flagged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._math import acc_dtype
from ..linear_policy_loss.naive import sampled_token_values
from ..losses import preference_naive as NV
from ..losses.config import fields
from ..losses.preference_config import PreferenceLossConfig


def logits_of(a, h, W, b, acc):
    """softcap(h W^T + b) / temperature in the accumulation dtype (rounded to the input dtype
    first with logits_dtype="input", as the materialised bf16 path and the input tiles are)."""
    if a.logits_dtype == "input" and h.dtype in (torch.bfloat16, torch.float16):
        z = h @ W.T
        if b is not None:
            z = z + b
        if a.softcap is not None:
            z = torch.tanh(z / a.softcap) * a.softcap
        z = z.to(acc)
    else:
        z = h.to(acc) @ W.to(acc).T
        if b is not None:
            z = z + b.to(acc)
        if a.softcap is not None:
            z = torch.tanh(z / a.softcap) * a.softcap
    return z / a.temperature


def _mean(x: Tensor) -> Tensor:
    return x.sum() / max(x.numel(), 1)


def linear_preference_loss(a):
    """(loss, stats {name: 0-dim}, rows {logps, ref_logps, rewards: [R]}, token log-probs [R, T])
    of the op's arguments `a` (op.Call; hidden [N, H]), differentiable to a.hidden, a.weight,
    a.bias by autograd."""
    cfg = PreferenceLossConfig(**{k: getattr(a, k) for k in fields(PreferenceLossConfig)})
    R, T = a.labels.shape
    h = a.hidden
    acc = acc_dtype(h.dtype)
    V = a.weight.shape[0]
    sampled = hasattr(a, "mask_outside")  # a SamplerCall: the sampler's distribution
    extra = {}
    if sampled:
        lp, m, rlp, lp_out, extra = _sampled(a, acc)
        zr = rlp  # (a reference head was given)
    else:
        z = logits_of(a, h, a.weight, a.bias, acc).reshape(R, T, V)
        lp, m = NV.token_logprobs(z, a.labels, a.mask, 1.0, a.ignore_index)
        zr = None
        if a.ref_hidden is not None:
            with torch.no_grad():
                zr = logits_of(a, a.ref_hidden, a.ref_weight, a.ref_bias, acc).reshape(R, T, V)
                rlp, _ = NV.token_logprobs(zr, a.labels, a.mask, 1.0, a.ignore_index)
        lp_out = lp
    beta = cfg.beta
    if cfg.unpaired:
        seq = NV.sequence_logps(lp, m, cfg.average_log_prob)
        ref = None
        if a.ref_logps is not None:
            ref = a.ref_logps.to(acc)
        elif zr is not None:
            ref = NV.sequence_logps(rlp, m, cfg.average_log_prob)
        ucfg = cfg.unpaired_config()
        x = seq if ref is None else seq - ref
        y = a.desirable.bool()
        if a.reference_point is None or ucfg.loss_type == "apo_zero_unpaired":
            kl = torch.zeros((), dtype=acc)
        else:
            kl = a.reference_point.detach().to(acc).reshape(())
        if ucfg.loss_type == "kto":
            ch, rj = 1 - torch.sigmoid(beta * (x - kl)), 1 - torch.sigmoid(beta * (kl - x))
        else:
            ch, rj = 1 - torch.sigmoid(beta * x), torch.sigmoid(beta * x)
        losses = torch.where(y, ucfg.desirable_weight * ch, ucfg.undesirable_weight * rj)
        loss = losses.sum() / max(R, 1)
        with torch.no_grad():
            rw, s = beta * x, seq
            nd, nu = y.sum(), (~y).sum()

            def per(v, k):
                return v / k if k > 0 else v * 0

            stats = {
                "kl": kl,
                "chosen_rewards_sum": rw[y].sum(),
                "rejected_rewards_sum": rw[~y].sum(),
                "chosen_logps_sum": s[y].sum(),
                "rejected_logps_sum": s[~y].sum(),
            }
            stats["rewards/chosen"] = per(stats["chosen_rewards_sum"], nd)
            stats["rewards/rejected"] = per(stats["rejected_rewards_sum"], nu)
            stats["rewards/margins"] = stats["rewards/chosen"] - stats["rewards/rejected"]
            stats["logps/chosen"] = per(stats["chosen_logps_sum"], nd)
            stats["logps/rejected"] = per(stats["rejected_logps_sum"], nu)
        rows = {
            "logps": seq.detach(),
            "ref_logps": torch.zeros_like(seq) if ref is None else ref.detach(),
            "rewards": rw,
        }
        stats.update(extra)
        return loss, stats, rows, lp_out.detach()
    P = R // 2
    if a.pairs is None:
        cr = torch.arange(R)
    else:
        cr = torch.cat((a.pairs[:, 0], a.pairs[:, 1])).long()
    pcfg = cfg.paired_config()
    lpc, mc = lp[cr], m[cr]
    seq = NV.sequence_logps(lpc, mc, cfg.average_log_prob, cfg.ld_alpha)
    c, r = seq[:P], seq[P:]
    ref = None
    if a.ref_logps is not None:
        ref = a.ref_logps.to(acc)[cr]
    elif zr is not None:
        ref = NV.sequence_logps(rlp[cr], mc, cfg.average_log_prob, cfg.ld_alpha)
    rc, rr = (ref[:P], ref[P:]) if ref is not None else (torch.zeros_like(c),) * 2
    n = mc.sum(-1)
    n_c, n_r = n[:P], n[P:]
    plain = (lpc * mc).sum(-1)[:P]
    N = n_c.sum()
    terms = NV.pair_losses(pcfg, c, r, rc, rr, n_c, n_r, plain, N)
    loss = sum(lam * (v.sum() / max(P, 1)) for lam, v in zip(pcfg.weights, terms))
    with torch.no_grad():
        cw, rw = beta * (c - rc), beta * (r - rr)
        stats = {
            "rewards/chosen": _mean(cw),
            "rewards/rejected": _mean(rw),
            "rewards/accuracies": _mean((cw > rw).to(acc)),
            "rewards/margins": _mean(cw - rw),
            "logps/chosen": _mean(c),
            "logps/rejected": _mean(r),
        }
        if "sft" in pcfg.loss_types:
            stats["nll_loss"] = -plain.sum() / N if N > 0 else plain.sum() * 0
        if "orpo" in pcfg.loss_types:  # Liger's formulas
            o = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
            stats["log_odds_ratio"] = _mean(F.logsigmoid(o))
            stats["log_odds_chosen"] = _mean(o)
        out = torch.empty(3, R, dtype=seq.dtype)
        out[0, cr] = seq.detach()
        out[1, cr] = torch.zeros_like(seq) if ref is None else ref.detach()
        out[2, cr] = torch.cat((cw, rw))
    rows = dict(zip(("logps", "ref_logps", "rewards"), out))
    stats.update(extra)
    return loss, stats, rows, lp_out.detach()


def _sampled(a, acc):
    """(lp for the sums, m, the reference head's lp or None, lp as reported, {num_outside,
    outside}) [R, T] under the sampler's distribution."""
    keep = a.labels != a.ignore_index
    if a.mask is not None:
        keep = keep & (a.mask != 0)
    labels = torch.where(keep, a.labels, a.ignore_index)  # the op folds the mask into labels
    b = a._replace(labels=labels)
    lp, _, outside = sampled_token_values(b)
    rlp = None
    if a.ref_hidden is not None:
        with torch.no_grad():
            r = b._replace(hidden=a.ref_hidden, weight=a.ref_weight, bias=a.ref_bias)
            rlp, _, r_out = sampled_token_values(r)
            outside = outside | r_out
    outside = outside & keep
    m = keep.to(acc)
    if a.mask_outside:
        m = torch.where(outside, 0.0, m)
    zero = torch.zeros((), dtype=lp.dtype)
    lp_sum = torch.where(m != 0, lp, zero)
    if rlp is not None:
        rlp = torch.where(m != 0, rlp, zero)
    extra = {"num_outside": outside.sum().to(acc), "outside": outside}
    return lp_sum, m, rlp, torch.where(keep, lp, zero), extra
