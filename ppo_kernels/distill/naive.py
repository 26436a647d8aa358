"""Eager implementation of the distillation tile kernels: the semantics every backend follows and
the `eager` backend (float64 tiles compute in float64, everything else in float32). The float64
autograd reference of the whole loss is ppo_kernels/losses/distill_naive.py.

Per row r of a student tile z_s and a teacher tile z_t [N, V] (whole vocabulary),
z = logits / T, p = softmax(z_s / T), q = softmax(z_t / T):

forward(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index)
    -> (value, lse_student, lse_teacher, aux, hard_logprob, lse_hard), float32 [N]:
    value  D_r: forward_kl KL(q || p), reverse_kl KL(p || q), jsd beta KL(q || m)
           + (1 - beta) KL(p || m) with m = (1 - beta) p + beta q (0 < beta < 1: beta 0 and 1 are
           the KLs, resolved by the caller), tv sum |p - q| / 2;
    lse_*  logsumexp(z_* / T);
    aux    what the gradient needs: reverse_kl D, jsd KL(p || m), tv sum p sgn(p - q), else 0;
    hard_logprob, lse_hard (only with labels; else empty): log softmax(z_s)[label] at
           temperature 1 (0 for ignore_index) and its logsumexp (Liger's hard loss is -that).
backward_(student, teacher, labels, mask, lse_student, lse_teacher, aux, lse_hard, grad,
          grad_hard, inv_temperature, divergence, beta, ignore_index):
    overwrites the student tile with grad_r dD_r/dz_s + grad_hard_r (onehot(label) - softmax(z_s))
    (the second only with grad_hard, not for ignore_index), per element
      forward_kl p - q;  reverse_kl p (log p - log q - D);  jsd (1 - beta) p (log p - log m - aux);
      tv p (sgn(p - q) - aux) / 2;   all times 1 / T.

Documented edge cases (every backend matches them):
  * mask[r] == 0: every output 0 and a zero gradient row; the row is not read.
  * entries with p_j = 0 (logit -inf) contribute 0 (0 log 0 = 0); reverse_kl with p_j > 0 where
    q_j = 0 is +inf, as forward_kl with q_j > 0 where p_j = 0.
  * a row of all -inf in either tile (no distribution), or with NaN / +inf: value and aux NaN.
  * the tiles share one float dtype; the gradient is rounded to it. backward_ reads each block of
    a row before writing it: the student tile may be (and in a fused op is) the output.
"""

from __future__ import annotations

import math

import torch

from .._math import acc_dtype
from ..losses.distill_config import DIVERGENCES


def _check(divergence, beta):
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence: unknown mode {divergence!r}; expected one of {DIVERGENCES}")
    if divergence == "jsd" and not 0 < beta < 1:
        raise ValueError(
            f"beta: jsd needs 0 < beta < 1 (beta 0 is forward_kl, 1 is reverse_kl), got {beta}"
        )


def _logprobs(x, inv_t, acc):
    """(log-probs, lse) of x * inv_t, relative to the row max (the kernels' arithmetic)."""
    z = x.to(acc) * inv_t
    m = z.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    a = z - m
    ls = torch.logsumexp(a, -1, keepdim=True)
    return a - ls, (ls + m).squeeze(-1)


def _xlogy(p, a):
    return torch.where(p > 0, p * a, torch.zeros_like(p))


def forward(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index):
    _check(divergence, beta)
    acc = acc_dtype(student.dtype)
    lp, lse_s = _logprobs(student, inv_temperature, acc)
    lq, lse_t = _logprobs(teacher, inv_temperature, acc)
    p, q = lp.exp(), lq.exp()
    if divergence == "forward_kl":
        value = _xlogy(q, lq - lp).sum(-1)
        aux = torch.zeros_like(value)
    elif divergence == "reverse_kl":
        value = _xlogy(p, lp - lq).sum(-1)
        aux = value
    elif divergence == "jsd":
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        kp = _xlogy(p, lp - lm)
        value = (beta * _xlogy(q, lq - lm) + (1 - beta) * kp).sum(-1)
        aux = kp.sum(-1)
    else:
        value = 0.5 * (p - q).abs().sum(-1)
        aux = (p * torch.sign(p - q)).sum(-1)
    bad = ~(torch.isfinite(lse_s) & torch.isfinite(lse_t))
    nan = torch.full_like(value, math.nan)
    value, aux = torch.where(bad, nan, value), torch.where(bad, nan, aux)
    outs = [value, lse_s, lse_t, aux]
    if labels is not None:
        if inv_temperature == 1.0:
            l1, lse_h = lp, lse_s
        else:
            l1, lse_h = _logprobs(student, 1.0, acc)
        keep = labels != ignore_index
        y = torch.where(keep, labels, 0).long().unsqueeze(-1)
        hard = torch.where(keep, l1.gather(-1, y).squeeze(-1), torch.zeros_like(lse_h))
        outs += [hard, lse_h]
    if mask is not None:
        keep = mask != 0
        outs = [torch.where(keep, o, torch.zeros_like(o)) for o in outs]
    out = acc_dtype(student.dtype)
    outs = [o.to(out) for o in outs]
    if labels is None:
        empty = student.new_empty((0,), dtype=out)
        outs += [empty, empty]
    return tuple(outs)


def grad_tile(
    student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
    inv_temperature, divergence, beta, ignore_index,
):  # fmt: skip
    """d L / d student [N, V] in the accumulation dtype (backward_ writes it into the tile)."""
    _check(divergence, beta)
    acc = acc_dtype(student.dtype)
    zs = student.to(acc) * inv_temperature
    zt = teacher.to(acc) * inv_temperature
    lp = zs - lse_s.to(acc).unsqueeze(-1)
    lq = zt - lse_t.to(acc).unsqueeze(-1)
    p, q = lp.exp(), lq.exp()
    a = aux.to(acc).unsqueeze(-1)
    if divergence == "forward_kl":
        e = p - q
    elif divergence == "reverse_kl":
        e = _xlogy(p, (lp - lq) - a)
    elif divergence == "jsd":
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        e = (1 - beta) * _xlogy(p, (lp - lm) - a)
    else:
        e = 0.5 * p * (torch.sign(p - q) - a)
    g = (grad.to(acc) * inv_temperature).unsqueeze(-1) * e
    if grad_hard is not None:
        keep = labels != ignore_index
        gh = torch.where(keep, grad_hard.to(acc), torch.zeros_like(grad_hard, dtype=acc))
        p1 = (
            p
            if inv_temperature == 1.0
            else (student.to(acc) - lse_hard.to(acc).unsqueeze(-1)).exp()
        )
        g = g - gh.unsqueeze(-1) * p1
        y = torch.where(keep, labels, 0).long().unsqueeze(-1)
        g = g.scatter_add(-1, y, gh.unsqueeze(-1))
    if mask is not None:
        g = torch.where((mask != 0).unsqueeze(-1), g, torch.zeros_like(g))
    return g


def backward_(
    student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
    inv_temperature, divergence, beta, ignore_index,
):  # fmt: skip
    g = grad_tile(student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
                  inv_temperature, divergence, beta, ignore_index)  # fmt: skip
    student.copy_(g)


def eager_linear_distill_loss(
    hidden, weight, labels, teacher_hidden, teacher_weight, *, beta=0.5, temperature=1.0,
    weight_hard_loss=0.5, weight_soft_loss=0.5, ignore_index=-100,
):  # fmt: skip
    """What a trainer does today (the benchmark baseline): both heads' logits materialised
    ([N, V] each, the GEMMs in the input dtype), upcast to float32, log_softmax, Liger's
    generalised JSD (beta 0: forward KL, 1: reverse KL) and the hard-label cross-entropy at
    temperature 1, token mean over the labels not ignored; differentiated by autograd."""
    z = (hidden.reshape(-1, hidden.shape[-1]) @ weight.T).float()
    with torch.no_grad():
        zt = (teacher_hidden.reshape(-1, teacher_hidden.shape[-1]) @ teacher_weight.T).float()
    y = labels.reshape(-1)
    keep = y != ignore_index
    n = keep.sum().clamp(min=1)
    lp = torch.log_softmax(z / temperature, -1)
    lq = torch.log_softmax(zt / temperature, -1)
    if beta == 0:
        d = torch.nn.functional.kl_div(lp, lq, reduction="none", log_target=True)
    elif beta == 1:
        d = torch.nn.functional.kl_div(lq, lp, reduction="none", log_target=True)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log(1 - beta), lq + math.log(beta)]), 0)
        d = beta * torch.nn.functional.kl_div(lm, lq, reduction="none", log_target=True)
        d = d + (1 - beta) * torch.nn.functional.kl_div(lm, lp, reduction="none", log_target=True)
    soft = torch.where(keep, d.sum(-1), 0.0).sum() / n
    hard = torch.nn.functional.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum") / n
    return weight_hard_loss * hard + weight_soft_loss * soft
