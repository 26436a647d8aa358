"""Eager PyTorch implementation for full_kl: the semantics, the `eager` backend and the benchmark
baseline. Float64 inputs are computed in float64, everything else in float32.

    KL(pi || pi_ref)[t] = sum_j p_j (log p_j - log q_j),  p = softmax(z), q = softmax(w),
    z = logits / temperature, w = ref_logits / temperature (a number, or a tensor of per-row
    temperatures with shape logits.shape[:-1] + (1,)).
Gradients (times 1 / temperature): dKL/dz_j = p_j ((log p_j - log q_j) - KL), dKL/dw_j = q_j - p_j.

Documented edge cases (every backend matches them):
  * mask[t] == 0: KL 0 and no gradient; the kernels do not read that row.
  * entries with p_j = 0 (logit -inf) contribute 0; p_j > 0 where q_j = 0 gives KL = +inf.
  * a row of all -inf logits or all -inf ref_logits (undefined distribution): NaN.
  * a row containing NaN or +inf: NaN.
  * rounding: KL of (nearly) identical distributions may come out a few 1e-7 below 0 in float32.
  * a temperature whose inverse overflows float32 (< ~2.9e-39) is refused (ValueError naming it).
  * the backward op checks its saved inputs (grad, kl, lse_z, lse_w, mask: shape, dtype, device)
    and raises naming the argument instead of reading out of bounds.

Under the sampler's distribution (`top_k`, `top_p`, `min_p`; docs/ppo-math.md, "Full-vocabulary
KL"): KL(q || r) = sum_{j in K} q_j (log q_j - log r_j), K the kept set of the policy's tempered
logits (token_logprobs' sampler rules), q = softmax(z) renormalised on K, r = softmax(w) over the
whole vocabulary. Computed as above with z_j = -inf outside K (the kept set given as (cut,
cut_index): x > cut, or x == cut and j <= cut_index; a cut of -inf keeps the row whole), so:
  * gradients: to logits on K only (K is piecewise constant), to ref_logits r_j - q_j everywhere;
  * a token of K where r_j = 0 gives +inf; the reference is never truncated;
  * a row undefined without truncation (NaN / +inf, all -inf) stays NaN (its cut is -inf).
"""

from __future__ import annotations

import torch

from .._math import acc_dtype


def _drop_outside(z, logits, cut, cut_index):
    """z with the tokens outside the sampler's kept set (cut, cut_index) at -inf; z itself when no
    kept set is given. The comparisons are on the logits in the cut's dtype, as the kernels'."""
    if cut is None:
        return z
    x = logits.to(cut.dtype)
    c, ci = cut.unsqueeze(-1), cut_index.unsqueeze(-1)
    j = torch.arange(x.shape[-1], device=x.device)
    kept = (x > c) | ((x == c) & (j <= ci)) | (c == -float("inf"))
    return torch.where(kept, z, torch.full_like(z, -float("inf")))


def forward(logits, ref_logits, temperature=1.0, mask=None, cut=None, cut_index=None):
    """(kl, lse_z, lse_w) with logits.shape[:-1]; masked rows give 0 for all three. Computed in
    float64 whatever the input dtype: this is the exact reference (the kernels accumulate in
    float32 with the cancellation-free state of csrc/common/kl_stats.h). With (cut, cut_index),
    the policy's distribution is truncated to that kept set (lse_z is then its log-normaliser)."""
    acc = torch.float64
    z = _drop_outside(logits.to(acc) / temperature, logits, cut, cut_index)
    w = ref_logits.to(acc) / temperature
    # relative to each row's max, as the kernels: a - b cancels a constant shift between z and w
    # exactly, where (z - lse_z) - (w - lse_w) would lose it to the rounding of |lse| in float32
    mz = z.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    mw = w.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    a, b = z - mz, w - mw
    lsa, lsb = torch.logsumexp(a, -1), torch.logsumexp(b, -1)
    lse_z, lse_w = lsa + mz.squeeze(-1), lsb + mw.squeeze(-1)
    p = (a - lsa.unsqueeze(-1)).exp()
    terms = torch.where(p == 0, torch.zeros_like(p), p * ((a - b) - (lsa - lsb).unsqueeze(-1)))
    kl = terms.sum(-1)
    undefined = (lse_z == -float("inf")) | (lse_w == -float("inf"))
    kl = torch.where(undefined, torch.full_like(kl, float("nan")), kl)
    if mask is not None:
        keep = mask != 0
        kl, lse_z, lse_w = (torch.where(keep, x, torch.zeros_like(x)) for x in (kl, lse_z, lse_w))
    return kl, lse_z, lse_w


def backward(grad, logits, ref_logits, kl, lse_z, lse_w, temperature=1.0, mask=None, need_ref=True,
             cut=None, cut_index=None):  # fmt: skip
    """(grad_logits, grad_ref_logits or None) in the logits' dtypes; with (cut, cut_index) the
    forward's kept set (no gradient outside it)."""
    acc = acc_dtype(logits.dtype)
    z = _drop_outside(logits.to(acc) / temperature, logits, cut, cut_index)
    w = ref_logits.to(acc) / temperature
    g = grad.to(acc).unsqueeze(-1) / temperature
    p = (z - lse_z.to(acc).unsqueeze(-1)).exp()
    c = (lse_z.to(acc) - lse_w.to(acc) + kl.to(acc)).unsqueeze(-1)
    gz = torch.where(p > 0, g * p * ((z - w) - c), torch.zeros_like(p))
    gw = g * ((w - lse_w.to(acc).unsqueeze(-1)).exp() - p) if need_ref else None
    if mask is not None:
        keep = (mask != 0).unsqueeze(-1)
        gz = torch.where(keep, gz, torch.zeros_like(gz))
        gw = torch.where(keep, gw, torch.zeros_like(gw)) if need_ref else None
    return gz.to(logits.dtype), (gw.to(ref_logits.dtype) if need_ref else None)


def eager_full_kl(logits, ref_logits, temperature=1.0):
    """What a trainer writes today (the benchmark baseline): two log_softmax and an N x V product."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    logq = torch.log_softmax(ref_logits.float() / temperature, -1)
    return (logp.exp() * (logp - logq)).sum(-1)
