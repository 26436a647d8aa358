"""Float64 reference of the distillation losses on materialised logits, differentiated by
autograd: the semantics the distillation tile kernels (ppo_kernels/distill/) and the analytic
math (distill_math.py) are tested against; it shares no code with them. Formulas and the peers'
conventions: docs/ppo-math.md, "Distillation losses".

Per token, with p = softmax(z_student / T), q = softmax(z_teacher / T) over the whole vocabulary:
  forward_kl  KL(q || p) = sum_j q_j (log q_j - log p_j)
  reverse_kl  KL(p || q) = sum_j p_j (log p_j - log q_j)
  jsd(beta)   beta KL(q || m) + (1 - beta) KL(p || m),  m = (1 - beta) p + beta q; Liger's and
              TRL's convention: beta = 0 is forward_kl and beta = 1 reverse_kl (`resolve`)
  tv          sum_j |p_j - q_j| / 2
Terms with a zero probability contribute 0 (0 log 0 = 0). The hard-label term is the student's
cross-entropy at temperature 1 (Liger computes it before scaling); the sampled-token reverse KL
is log p(y) - log q(y) of the sampled token y.
"""

from __future__ import annotations

import math

import torch

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tv")


def resolve(divergence: str, beta: float) -> str:
    """Liger's / TRL's switch: jsd at beta 0 is forward_kl, at beta 1 reverse_kl (the limits of
    jsd / beta and jsd / (1 - beta); jsd itself goes to 0 there)."""
    if divergence == "jsd" and beta == 0.0:
        return "forward_kl"
    if divergence == "jsd" and beta == 1.0:
        return "reverse_kl"
    return divergence


def _xlogy(p, a):
    """p * a, 0 where p == 0 (whatever a is, and without a NaN gradient from there)."""
    return p * torch.where(p > 0, a, torch.zeros_like(a))


def divergence_from_logprobs(logp, logq, divergence: str, beta: float = 0.5, support=None):
    """The divergence per row of two distributions given by their log-probs [..., K]; entries
    off `support` (bool [..., K]) are left out (as TRL's sparse divergences mask them)."""
    divergence = resolve(divergence, beta)
    if support is not None:
        logp = torch.where(support, logp, torch.zeros_like(logp))
        logq = torch.where(support, logq, torch.zeros_like(logq))
        p = torch.where(support, logp.exp(), torch.zeros_like(logp))
        q = torch.where(support, logq.exp(), torch.zeros_like(logq))
    else:
        p, q = logp.exp(), logq.exp()
    if divergence == "forward_kl":
        return _xlogy(q, logq - logp).sum(-1)
    if divergence == "reverse_kl":
        return _xlogy(p, logp - logq).sum(-1)
    if divergence == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    logm = torch.logaddexp(logp + math.log1p(-beta), logq + math.log(beta))
    return (beta * _xlogy(q, logq - logm) + (1 - beta) * _xlogy(p, logp - logm)).sum(-1)


def divergence(student_logits, teacher_logits, divergence: str, beta=0.5, temperature=1.0):
    """[...] the full-vocabulary divergence per token, float64, autograd to both logits."""
    logp = torch.log_softmax(student_logits.double() / temperature, -1)
    logq = torch.log_softmax(teacher_logits.double() / temperature, -1)
    return divergence_from_logprobs(logp, logq, divergence, beta)


def topk_divergence(
    student_logits, topk_ids, topk_logprobs, divergence: str, beta=0.5, temperature=1.0,
    tail="bucket",
):  # fmt: skip
    """[...] the divergence on a cached teacher's top-k support. topk_ids [..., K], topk_logprobs
    [..., K] (the teacher's log-probs at temperature T; -inf marks an unused slot). The student's
    log-probs at those ids come from its full softmax. The mass outside the support:
      tail="bucket": one more entry per distribution, log(1 - sum of its top-k probabilities)
          (the sum clamped to at most exp(-1e-7), TRL's server distillation `loss_add_tail`);
      tail="renormalize": both restricted to the support and renormalised there (TRL's default).
    """
    logp = torch.log_softmax(student_logits.double() / temperature, -1)
    valid = topk_logprobs > -math.inf
    ninf = torch.full((), -math.inf, dtype=torch.float64)
    ls = torch.where(valid, logp.gather(-1, torch.where(valid, topk_ids, 0)), ninf)
    lt = torch.where(valid, topk_logprobs.double(), ninf)
    if tail == "bucket":

        def add_tail(x):
            s = torch.logsumexp(x, -1, keepdim=True).clamp(max=-1e-7)
            return torch.cat((x, torch.log(-torch.expm1(s))), -1)

        ls, lt = add_tail(ls), add_tail(lt)
        valid = torch.cat((valid, torch.ones_like(valid[..., :1])), -1)
    elif tail == "renormalize":
        ls = ls - torch.logsumexp(ls, -1, keepdim=True)
        lt = lt - torch.logsumexp(lt, -1, keepdim=True)
    else:
        raise ValueError(f"tail: expected 'bucket' or 'renormalize', got {tail!r}")
    return divergence_from_logprobs(ls, lt, divergence, beta, support=valid)


def hard_logprobs(student_logits, labels, ignore_index=-100):
    """[...] log softmax(z)[label] at temperature 1 (Liger's hard loss is its negative), 0 where
    the label is ignored."""
    logp = torch.log_softmax(student_logits.double(), -1)
    keep = labels != ignore_index
    lp = logp.gather(-1, torch.where(keep, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, lp, torch.zeros_like(lp))


def distill_loss(
    student_logits,
    teacher_logits,
    labels,
    *,
    divergence_type="jsd",
    beta=0.5,
    temperature=1.0,
    weight_hard_loss=0.5,
    weight_soft_loss=0.5,
    ignore_index=-100,
    mask=None,
):
    """(loss, soft_loss, hard_loss) as Liger's fused distillation losses define them: over the
    N tokens whose label is not ignored (and mask != 0), soft = sum D / n, hard = sum CE / n with
    n = max(count, 1), loss = weight_hard hard + weight_soft soft."""
    keep = labels != ignore_index
    if mask is not None:
        keep = keep & (mask != 0)
    n = keep.sum().clamp(min=1)
    d = divergence(student_logits, teacher_logits, divergence_type, beta, temperature)
    soft = torch.where(keep, d, torch.zeros_like(d)).sum() / n
    lp = hard_logprobs(student_logits, torch.where(keep, labels, ignore_index), ignore_index)
    hard = -lp.sum() / n
    return weight_hard_loss * hard + weight_soft_loss * soft, soft, hard


def sampled_reverse_kl(student_logits, teacher_logits, tokens, temperature=1.0):
    """log p(y) - log q(y) of the sampled tokens y: the per-token reverse-KL sample that on-policy
    distillation uses (its negative, detached, is the token's advantage)."""
    logp = torch.log_softmax(student_logits.double() / temperature, -1)
    logq = torch.log_softmax(teacher_logits.double() / temperature, -1)
    idx = tokens.unsqueeze(-1)
    return (logp.gather(-1, idx) - logq.gather(-1, idx)).squeeze(-1)
