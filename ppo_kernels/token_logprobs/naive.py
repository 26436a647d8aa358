"""Eager PyTorch implementation for token_logprobs: the semantics, the `eager` backend and the
benchmark baseline. Float64 inputs are computed in float64, everything else in float32.

Documented edge cases (every backend matches them):
  * label == ignore_index: logprob 0, entropy 0, gradient 0.
  * label outside [0, V): on the CPU an IndexError; on the GPU NaN for that row (logprob, entropy
    and gradient), never an out-of-bounds read; `strict_checks()` raises instead.
  * a row of all -inf logits (undefined distribution): logprob NaN, entropy NaN.
  * some -inf logits: those entries have probability 0; a label on one gives logprob -inf.
  * a row containing NaN or +inf: logprob NaN, entropy NaN.
  * finite logits whose scaled value overflows float32 (x = 3e38 at temperature 0.5): the exact,
    finite log-prob and entropy (the row is computed relative to its unscaled max); only the
    saved lse may be +-inf. A temperature whose inverse overflows float32 (< ~2.9e-39) is refused
    (ValueError naming temperature).
  * empty vocabulary with no rows: empty outputs; with rows: ValueError.
"""

from __future__ import annotations

import torch

from .._math import acc_dtype


def _label_masks(labels, V, ignore_index):
    ignored = labels == ignore_index
    valid = (labels >= 0) & (labels < V) & ~ignored
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    return ignored, valid, safe


def _shifted(logits, temperature):
    """(z - max z) with z = logits / temperature, computed as (x - max x) / temperature so that
    finite logits never overflow (x - max x <= 0; -inf where the gap itself overflows: p = 0), and
    the unscaled row max. Rows with NaN / +inf, or all -inf, come out NaN."""
    x = logits.to(acc_dtype(logits.dtype))
    m = x.amax(-1, keepdim=True) if x.shape[-1] > 0 else x.new_zeros(x.shape[:-1] + (1,))
    return (x - m) / temperature, m.squeeze(-1)


def forward(logits, labels, temperature=1.0, ignore_index=-100, with_entropy=True):
    """(logprobs, entropy, lse) with labels.shape; entropy is empty when not requested."""
    V = logits.shape[-1]
    z, m = _shifted(logits, temperature)
    lse_z = torch.logsumexp(z, dim=-1)  # of the shifted z: finite for every well-defined row
    lse = m / temperature + lse_z
    ignored, valid, safe = _label_masks(labels, V, ignore_index)
    zl = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    nan = torch.full_like(lse, float("nan"))
    lp = torch.where(valid & lse_z.isfinite(), zl - lse_z, nan).masked_fill(ignored, 0.0)
    if with_entropy:
        # H = -sum p log p: every term is >= 0, no cancellation (unlike lse - E[z]).
        logp = z - lse_z.unsqueeze(-1)
        p = logp.exp()
        plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
        ent = torch.where(valid & lse_z.isfinite(), -plogp.sum(-1), nan).masked_fill(ignored, 0.0)
    else:
        ent = lse.new_empty(0)
    return lp, ent, lse.masked_fill(ignored, 0.0)


def backward(
    grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature=1.0, ignore_index=-100
):
    """Gradient w.r.t. logits, in logits' dtype:
    inv_t * (g_lp * (onehot - p) - g_ent * p * (log p + H)). p is recomputed from the shifted
    logits (the saved lse may have overflowed, see forward)."""
    V = logits.shape[-1]
    acc = acc_dtype(logits.dtype)
    z, _ = _shifted(logits, temperature)
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    p = logp.exp()
    glp = grad_logprobs.to(acc).unsqueeze(-1)
    g = -glp * p
    if grad_entropy is not None and grad_entropy.numel() > 0:
        t = torch.where(p > 0, p * (logp + entropy.to(acc).unsqueeze(-1)), torch.zeros_like(p))
        g = g - grad_entropy.to(acc).unsqueeze(-1) * t
    ignored, valid, safe = _label_masks(labels, V, ignore_index)
    g = g.scatter_add(-1, safe.unsqueeze(-1), glp)
    g = g / temperature
    g = torch.where(valid.unsqueeze(-1), g, torch.full_like(g, float("nan")))
    g = g.masked_fill(ignored.unsqueeze(-1), 0.0)
    return g.to(logits.dtype)


def eager_logprobs(logits, labels, temperature=1.0, return_entropy=False):
    """What trainers do today (the benchmark baseline and the trainer's `--ops eager`): upcast,
    log_softmax, gather; with return_entropy also the entropy of the full distribution, computed
    separately as verl's entropy_from_logits does. Labels must be in [0, V)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return (lp, eager_entropy(logits, temperature)) if return_entropy else lp


def eager_entropy(logits, temperature=1.0):
    """verl's entropy_from_logits: softmax, then logsumexp(z) - sum(p * z), in float32."""
    z = logits.float() / temperature
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
