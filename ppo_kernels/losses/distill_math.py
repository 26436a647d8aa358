"""The math of the distillation losses around the tile kernels, with analytic gradients: one home
for what a distillation head term needs besides the full-vocabulary divergence of a row (which
the tile kernels of ppo_kernels/distill/ compute, with the student tile's gradient):

- `combine`: the per-token values (divergence D_t, hard-label log-prob lp_t) to Liger's loss
  `w_soft sum_t D_t / n + w_hard sum_t (-lp_t) / n` (n = max(#kept tokens, 1)) and the per-token
  coefficients d L / d D_t, d L / d lp_t the backward kernel multiplies in;
- `sparse_divergence`: a cached teacher's top-k (ids + log-probs): the divergence on that support
  from the student's log-probs at the ids, and d D / d (those log-probs); `topk_logits_grad`
  turns them into the gradient of the student's logits (sum_k d_k (onehot(id_k) - p) / T);
- `sampled_reverse_kl`: log p(y) - log q(y) of the sampled token, on-policy distillation's
  per-token signal (its negative, detached, is the token's advantage).

Plain torch in the accumulation dtype (float64 stays float64, else float32), no host sync.
Formulas and conventions: docs/ppo-math.md, "Distillation losses"; the float64 autograd
reference: distill_naive.py.

Top-k support (entries k with a finite teacher log-prob; lp_k the student's, lq_k the teacher's,
both at temperature T), the two distributions compared:
  bucket: (exp(lp_1..K), 1 - sum_k exp(lp_k)) and the same for the teacher (the sum clamped to
      at most exp(-1e-7)): the mass outside the support is one more entry;
  renormalize: exp(lp_k) / sum_k' exp(lp_k') on the support, the rest dropped.
With E_i = d D / d log p~_i on the compared distribution p~ (forward_kl: -q~_i; reverse_kl:
p~_i (log p~_i - log q~_i + 1); jsd: (1 - beta) p~_i (log p~_i - log m~_i); tv:
p~_i sgn(p~_i - q~_i) / 2), the student's support log-probs get
  bucket: d D / d lp_k = E_k - G_tail exp(lp_k) (G = E / p~, 0 when the clamp holds the sum),
  renormalize: d D / d lp_k = E_k - p~_k sum_i E_i.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._math import acc_dtype
from .distill_config import DIVERGENCES, TOPK_TAILS, DistillLossConfig  # noqa: F401  (their home)

_TAIL_CLAMP = -1e-7  # the log of the largest top-k mass a bucket keeps (TRL's)


def resolve(divergence: str, beta: float) -> str:
    """Liger's / TRL's convention: jsd at beta = 0 is forward_kl KL(q || p), at beta = 1
    reverse_kl KL(p || q) (the limits of jsd / beta and jsd / (1 - beta))."""
    if divergence == "jsd" and beta == 0.0:
        return "forward_kl"
    if divergence == "jsd" and beta == 1.0:
        return "reverse_kl"
    return divergence


class TokenResult(NamedTuple):
    loss: Tensor
    soft_loss: Tensor
    hard_loss: Tensor
    d_value: Tensor  # [N] d L / d D_t
    d_hard_logprob: Tensor  # [N] d L / d lp_t (0 where no hard term)


def coefficients(cfg: DistillLossConfig, keep: Tensor, num_tokens: Tensor) -> tuple:
    """(d L / d D_t, d L / d lp_t) per token [N] (None for a term of weight 0) of Liger's
    reduction over num_tokens kept tokens (keep [N] bool; num_tokens at least 1)."""
    kf = keep.to(num_tokens.dtype) / num_tokens
    d_value = cfg.weight_soft_loss * kf if cfg.weight_soft_loss != 0 else None
    d_hard = -cfg.weight_hard_loss * kf if cfg.weight_hard_loss != 0 else None
    return d_value, d_hard


def num_kept(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """max(#kept tokens, 1) as a 0-dim tensor of `dtype` (no host sync)."""
    return keep.sum().clamp(min=1).to(dtype)


def combine(
    cfg: DistillLossConfig,
    values: Tensor,
    hard_logprobs: Tensor | None,
    keep: Tensor,
    num_tokens: Tensor | int | None = None,
) -> TokenResult:
    """Liger's reduction of the per-token values [N] over the kept tokens (keep [N]: the label is
    not ignored and the mask is set); num_tokens: the batch's kept count when these tokens are a
    block of it (default: this block's, at least 1). Values off `keep` are never read; a term
    of weight 0 is left out of the loss (its value may be infinite)."""
    acc = acc_dtype(values.dtype)
    k = keep.to(torch.bool)
    n = num_kept(k, acc) if num_tokens is None else torch.as_tensor(num_tokens).to(acc)
    zero = torch.zeros((), dtype=acc, device=values.device)
    soft = torch.where(k, values.detach().to(acc), zero).sum() / n
    if hard_logprobs is None:
        hard = zero
    else:
        hard = -torch.where(k, hard_logprobs.detach().to(acc), zero).sum() / n
    loss = zero
    if cfg.weight_hard_loss != 0:
        loss = loss + cfg.weight_hard_loss * hard
    if cfg.weight_soft_loss != 0:
        loss = loss + cfg.weight_soft_loss * soft
    d_value, d_hard = coefficients(cfg, k, n)
    kz = torch.zeros_like(k, dtype=acc)
    d_value = kz if d_value is None else d_value
    d_hard = kz if (d_hard is None or hard_logprobs is None) else d_hard
    return TokenResult(loss, soft, hard, d_value, d_hard)


def _entry_terms(divergence, beta, lp, lq):
    """(D terms, E = d term / d lp, G = E / p) per entry of two distributions' log-probs."""
    p, q = lp.exp(), lq.exp()
    zero = torch.zeros_like(p)
    if divergence == "forward_kl":
        t = torch.where(q > 0, q * (lq - lp), zero)
        return t, -q, torch.where(q > 0, -q / p, zero)
    if divergence == "reverse_kl":
        g = lp - lq + 1
        return torch.where(p > 0, p * (lp - lq), zero), torch.where(p > 0, p * g, zero), g
    if divergence == "tv":
        s = torch.sign(p - q)
        return 0.5 * (p - q).abs(), 0.5 * p * s, 0.5 * s
    lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
    t = beta * torch.where(q > 0, q * (lq - lm), zero) + (1 - beta) * torch.where(
        p > 0, p * (lp - lm), zero
    )
    g = (1 - beta) * (lp - lm)
    return t, torch.where(p > 0, p * g, zero), g


def sparse_divergence(
    divergence: str, beta: float, student_lp: Tensor, teacher_lp: Tensor, tail: str = "bucket"
) -> tuple[Tensor, Tensor]:
    """(D [...], d D / d student_lp [..., K]) on a top-k support. student_lp, teacher_lp: [..., K]
    log-probs at the support's ids (temperature applied); a teacher entry of -inf is an unused
    slot (no term, no gradient)."""
    divergence = resolve(divergence, beta)
    acc = acc_dtype(student_lp.dtype)
    valid = teacher_lp > -math.inf
    ninf = torch.full((), -math.inf, dtype=acc, device=student_lp.device)
    ls = torch.where(valid, student_lp.detach().to(acc), ninf)
    lt = torch.where(valid, teacher_lp.detach().to(acc), ninf)
    if tail == "bucket":
        s_raw = torch.logsumexp(ls, -1, keepdim=True)
        s_t = torch.logsumexp(lt, -1, keepdim=True).clamp(max=_TAIL_CLAMP)
        tail_s = torch.log(-torch.expm1(s_raw.clamp(max=_TAIL_CLAMP)))
        tail_t = torch.log(-torch.expm1(s_t))
        terms, E, _ = _entry_terms(divergence, beta, ls, lt)
        t_tail, _, G_tail = _entry_terms(divergence, beta, tail_s, tail_t)
        G_tail = torch.where(s_raw <= _TAIL_CLAMP, G_tail, torch.zeros_like(G_tail))
        d = E - G_tail * ls.exp()
        value = terms.sum(-1) + t_tail.squeeze(-1)
    elif tail == "renormalize":
        ls = ls - torch.logsumexp(ls, -1, keepdim=True)
        lt = lt - torch.logsumexp(lt, -1, keepdim=True)
        terms, E, _ = _entry_terms(divergence, beta, ls, lt)
        d = E - ls.exp() * E.sum(-1, keepdim=True)
        value = terms.sum(-1)
    else:
        raise ValueError(f"tail: expected one of {TOPK_TAILS}, got {tail!r}")
    return value, torch.where(valid, d, torch.zeros_like(d))


def topk_logits_grad(
    student_logits: Tensor, ids: Tensor, d_lp: Tensor, temperature: float = 1.0
) -> Tensor:
    """d / d student_logits of sum_k d_lp_k lp(id_k), lp = log softmax(z / T): sum_k d_k
    (onehot(id_k) - p) / T, in the accumulation dtype (eager; the fused op forms it in its tile)."""
    acc = acc_dtype(student_logits.dtype)
    p = torch.softmax(student_logits.detach().to(acc) / temperature, -1)
    d = d_lp.to(acc)
    g = -p * d.sum(-1, keepdim=True)
    return g.scatter_add(-1, ids, d) / temperature


def sampled_reverse_kl(student_lp: Tensor, teacher_lp: Tensor) -> tuple[Tensor, Tensor]:
    """(k, advantage) per sampled token: k = log p(y) - log q(y) (the reverse KL's one-sample
    estimate; d k / d log p(y) = 1) and on-policy distillation's advantage -k, detached."""
    acc = acc_dtype(student_lp.dtype)
    k = student_lp.detach().to(acc) - teacher_lp.detach().to(acc)
    return k, -k
