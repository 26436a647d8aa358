"""Float64 reference of the preference losses on materialised logits, differentiated by autograd:
logits -> token log-probs -> masked sums / means -> each type's loss written as the peers write it
(TRL's DPOTrainer / KTOTrainer, Liger's chunked losses). What the analytic math of
preference_math.py and the fused preference op are tested against; it shares no code with them.

Layout: rows [chosen_0 .. chosen_{B-1}; rejected_0 .. rejected_{B-1}] (TRL's and Liger's); labels
[R, T] with `ignore_index` where no loss is taken, and an optional mask [R, T] on top.

Edge cases (the math follows them): a row without tokens has sequence log-prob 0 (a mean of
nothing is 0, not NaN); the SFT term of a batch without chosen tokens is 0; no pairs give loss 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .preference_math import PreferenceConfig
from .preference_unpaired import UnpairedConfig


def token_logprobs(logits, labels, mask=None, temperature=1.0, ignore_index=-100):
    """(lp [R, T], m [R, T]) in float64: log softmax(logits / T) at the label, 0 off the mask."""
    keep = labels != ignore_index
    if mask is not None:
        keep = keep & (mask != 0)
    logp = torch.log_softmax(logits.double() / temperature, -1)
    safe = torch.where(keep, labels, torch.zeros_like(labels))
    lp = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    m = keep.double()
    return lp * m, m


def log_sum_sq_probs(logits, temperature=1.0):
    """log sum_v p_v^2 per token (TRL's fused head output for WPO), detached."""
    logp = torch.log_softmax(logits.detach().double() / temperature, -1)
    return torch.logsumexp(2 * logp, -1)


def sequence_logps(lp, m, average=False, ld_alpha=None):
    """[R] masked sums (or means; LD-DPO's shared + ld_alpha * tail sums), as TRL computes them."""
    if ld_alpha is not None:
        pos = m.cumsum(1)
        lens = m.sum(1)
        c, r = lens.chunk(2)
        shared = torch.minimum(c, r).repeat(2).unsqueeze(1)
        shared_mask = (pos > 0) & (pos <= shared)
        tail_mask = pos > shared
        return (lp * shared_mask).sum(1) + ld_alpha * (lp * tail_mask).sum(1)
    s = (lp * m).sum(-1)
    if average:
        n = m.sum(-1)
        return torch.where(n > 0, s / n.clamp(min=1), torch.zeros_like(s))
    return s


def _score(cfg, x):
    f = cfg.f_divergence_type
    if f == "forward_kl":
        return 1 - torch.exp(-x)
    if f == "js_divergence":
        return math.log(2) + F.logsigmoid(x)
    if f == "alpha_divergence" and abs(cfg.f_alpha_divergence_coef - 1.0) >= 1e-6:
        a = cfg.f_alpha_divergence_coef
        return (torch.exp(torch.clamp((a - 1) * x, max=80.0)) - 1.0) / (a - 1)
    return x


def pair_losses(cfg: PreferenceConfig, c, r, rc, rr, n_c, n_r, P, N):
    """Per type the per-pair loss [B] (TRL's / Liger's formulas)."""
    beta, eps = cfg.beta, cfg.label_smoothing
    xc, xr = c - rc, r - rr
    sc, sr = _score(cfg, xc), _score(cfg, xr)
    delta = sc - sr
    out = []
    for t in cfg.loss_types:
        if t == "sigmoid":
            v = -F.logsigmoid(beta * delta)
        elif t == "hinge":
            v = torch.relu(1 - beta * delta)
        elif t == "ipo":
            v = (sc / n_c.clamp(min=1.0) - sr / n_r.clamp(min=1.0) - 1 / (2 * beta)) ** 2
        elif t == "exo_pair":
            qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
            v = qw * (F.logsigmoid(beta * delta) - math.log1p(-eps)) + ql * (
                F.logsigmoid(-beta * delta) - math.log(eps)
            )
        elif t == "nca_pair":
            a, b = beta * xc, beta * xr
            v = -F.logsigmoid(a) - 0.5 * F.logsigmoid(-a) - 0.5 * F.logsigmoid(-b)
        elif t == "robust":
            clean = -(1 - eps) * F.logsigmoid(beta * delta)
            flipped = -eps * F.logsigmoid(-beta * delta)
            v = (clean - flipped) / (1 - 2 * eps)
        elif t == "bco_pair":
            v = -F.logsigmoid(beta * xc) - F.logsigmoid(-beta * xr)
        elif t == "sppo_hard":
            v = (xc - 0.5 / beta) ** 2 + (xr + 0.5 / beta) ** 2
        elif t in ("aot", "aot_unpaired"):
            if t == "aot":
                d = torch.sort(c - r, dim=0)[0] - torch.sort(rc - rr, dim=0)[0]
            else:
                d = torch.sort(xc, dim=0)[0] - torch.sort(xr, dim=0)[0]
            v = -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
        elif t == "apo_zero":
            v = 1 - torch.sigmoid(beta * xc) + torch.sigmoid(beta * xr)
        elif t == "apo_down":
            v = torch.sigmoid(beta * xc) + 1 - torch.sigmoid(beta * (xc - xr))
        elif t == "discopop":
            z = beta * delta
            mod = torch.sigmoid(z / cfg.discopop_tau)
            v = -F.logsigmoid(z) * (1 - mod) + torch.exp(-z) * mod
        elif t == "sft":
            v = (-P.sum() / N if N > 0 else P.sum() * 0).expand(c.shape[0])
        elif t == "sigmoid_norm":
            v = -F.logsigmoid(beta * (sc / n_c.clamp(min=1.0) - sr / n_r.clamp(min=1.0)))
        elif t == "orpo":
            o = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
            v = -beta * F.logsigmoid(o)
        elif t in ("simpo", "cpo"):
            y = beta * (c - r) - (cfg.simpo_gamma if t == "simpo" else 0.0)
            v = -F.logsigmoid(y) * (1 - eps) - F.logsigmoid(-y) * eps
        else:
            raise ValueError(f"loss_type: unknown {t!r}")
        out.append(v)
    return out


def paired_loss(
    cfg: PreferenceConfig,
    logits,
    labels,
    *,
    mask=None,
    ref_logits=None,
    ref_chosen=None,
    ref_rejected=None,
    average_log_prob=False,
    ld_alpha=None,
    use_weighting=False,
    temperature=1.0,
    ignore_index=-100,
):
    """(loss, metrics) of the pairs in `logits` [2B, T, V] (float64, autograd to the logits).
    The reference: ref_logits [2B, T, V] (no gradient), or given sequence log-probs, or none."""
    lp, m = token_logprobs(logits, labels, mask, temperature, ignore_index)
    seq = sequence_logps(lp, m, average_log_prob, ld_alpha)
    B = seq.shape[0] // 2
    c, r = seq[:B], seq[B:]
    if ref_logits is not None:
        with torch.no_grad():
            rlp, rm = token_logprobs(ref_logits, labels, mask, temperature, ignore_index)
            rseq = sequence_logps(rlp, rm, average_log_prob, ld_alpha)
        rc, rr = rseq[:B], rseq[B:]
    elif ref_chosen is not None:
        rc, rr = ref_chosen.double(), ref_rejected.double()
    else:
        rc = rr = torch.zeros_like(c)
    n = m.sum(-1)
    n_c, n_r = n[:B], n[B:]
    P = (lp * m).sum(-1)[:B]
    N = n_c.sum()
    terms = pair_losses(cfg, c, r, rc, rr, n_c, n_r, P, N)
    if use_weighting:
        with torch.no_grad():
            lssp = log_sum_sq_probs(logits, temperature)
            aligned = ((lp - lssp) * m).sum(1) / n.clamp(min=1)
            w = torch.exp(aligned)
            pw = w[:B] * w[B:]
        terms = [v * pw for v in terms]
    loss = sum(lam * (v.sum() / max(B, 1)) for lam, v in zip(cfg.weights, terms))
    with torch.no_grad():
        cr, rr_ = cfg.beta * (c - rc), cfg.beta * (r - rr)
        metrics = {
            "rewards/chosen": cr.mean(),
            "rewards/rejected": rr_.mean(),
            "rewards/accuracies": (cr > rr_).double().mean(),
            "rewards/margins": (cr - rr_).mean(),
            "logps/chosen": c.mean(),
            "logps/rejected": r.mean(),
        }
        if "sft" in cfg.loss_types:
            metrics["nll_loss"] = -P.sum() / N if N > 0 else P.sum() * 0
    return loss, metrics


def unpaired_loss(
    cfg: UnpairedConfig,
    logits,
    labels,
    desirable,
    *,
    mask=None,
    ref_logits=None,
    kl=None,
    average_log_prob=False,
    temperature=1.0,
    ignore_index=-100,
):
    """(loss, metrics) of KTO / APO-zero unpaired over the rows of `logits` [N, T, V] (float64,
    autograd). kl: the detached reference point (TRL: kto_reference_point of the mismatched
    rows), None for 0."""
    lp, m = token_logprobs(logits, labels, mask, temperature, ignore_index)
    seq = sequence_logps(lp, m, average_log_prob)
    if ref_logits is not None:
        with torch.no_grad():
            rlp, rm = token_logprobs(ref_logits, labels, mask, temperature, ignore_index)
            ref = sequence_logps(rlp, rm, average_log_prob)
        x = seq - ref
    else:
        x = seq
    y = desirable.bool()
    beta = cfg.beta
    # TRL computes no reference point for apo_zero_unpaired
    no_kl = kl is None or cfg.loss_type == "apo_zero_unpaired"
    k = torch.zeros((), dtype=torch.float64) if no_kl else torch.as_tensor(kl).double()
    if cfg.loss_type == "kto":
        ch = 1 - torch.sigmoid(beta * (x - k))
        rj = 1 - torch.sigmoid(beta * (k - x))
    else:
        ch = 1 - torch.sigmoid(beta * x)
        rj = torch.sigmoid(beta * x)
    losses = torch.where(y, cfg.desirable_weight * ch, cfg.undesirable_weight * rj)
    loss = losses.sum() / max(losses.numel(), 1)
    with torch.no_grad():
        rw = beta * x
        metrics = {
            "kl": k,
            "chosen_rewards_sum": rw[y].sum(),
            "rejected_rewards_sum": rw[~y].sum(),
            "chosen_logps_sum": seq[y].sum(),
            "rejected_logps_sum": seq[~y].sum(),
        }
    return loss, metrics
