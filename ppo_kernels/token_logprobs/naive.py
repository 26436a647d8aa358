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

Under the sampler's distribution (sampler_forward; the rules: docs/ppo-math.md):
  * a label outside the kept set: logprob -inf (never NaN), `outside` True, no log-prob gradient
    (the entropy's still flows); the kept set is never empty (the top token is always kept).
  * label == ignore_index: 0 for every output (False / -1 for is_argmax / the top ids).
  * a row undefined without truncation (NaN / +inf logits, all -inf): NaN, with the full kept set
    (cut -inf) and `outside` False.
  * tied logits: vLLM keeps or drops a tie group whole (top-k: every tie of the k-th value; top-p:
    by the mass strictly above the value); SGLang orders ties by token id.
  * a per-row parameter tensor (temperature, top_k, top_p, min_p) has a shape that is a leading
    part of labels.shape; its values are checked like the scalars (ValueError naming it).
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


# ---- the sampler's distribution (docs/ppo-math.md, "The distribution the rollout sampled from") --

SAMPLERS = ("vllm", "sglang")
STATS = ("outside", "sum_p2", "lse", "topk", "is_argmax")
MAX_STATS_TOP_K = 64


def _sorted_rows(x):
    """Rank order: decreasing logit, ties by increasing token id (a stable sort)."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def sampler_kept(x, inv_temperature, top_k, top_p, min_p, sampler="vllm"):
    """The kept set of each row of x [N, V] (any float dtype; computed in its dtype) as the engines
    compute it: sort, then cumulative sums. inv_temperature (1 / T), top_k (int, 0 = off), top_p
    (1 = off), min_p (0 = off) are [N] tensors. Returns (kept [N, V] bool in token order, sorted indices,
    z sorted relative to the row max, the last kept rank [N], the row's active flag [N])."""
    N, V = x.shape
    xs, idx = _sorted_rows(x)
    zs = (xs - xs[:, :1]) * inv_temperature.to(x.dtype).unsqueeze(-1)  # z - max z, <= 0
    ps = torch.softmax(zs, dim=-1)
    keep = zs >= torch.log(min_p.to(x.dtype)).unsqueeze(-1)  # p_j >= min_p * p_max
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    p = top_p.to(x.dtype).unsqueeze(-1)
    p_on = top_p < 1
    rank = torch.arange(V, device=x.device)
    if sampler == "vllm":
        # top-k on what min-p kept: every tie of the k-th largest value stays
        kth = xs.gather(-1, (k.clamp(1, V) - 1).unsqueeze(-1))
        cut_k = k_on & (keep.sum(-1) > k)
        keep = keep & ~(cut_k.unsqueeze(-1) & (xs < kth))
        # top-p on that set renormalised: the mass strictly above a token's value decides
        q = torch.where(keep, ps, torch.zeros_like(ps))
        excl = torch.cumsum(q, -1) - q
        start = torch.ones_like(keep)
        start[:, 1:] = xs[:, 1:] != xs[:, :-1]
        above = torch.cummax(torch.where(start, excl, torch.full_like(excl, -1.0)), -1).values
        total = q.sum(-1, keepdim=True)
        keep = keep & ~(p_on.unsqueeze(-1) & ~(above < p * total))
    elif sampler == "sglang":
        # every filter on the temperature-scaled distribution itself, ties by token id
        keep = keep & ~(k_on.unsqueeze(-1) & (rank >= k.unsqueeze(-1)))
        excl = torch.cumsum(ps, -1) - ps
        keep = keep & ~(p_on.unsqueeze(-1) & ~(excl <= p))
    else:
        raise ValueError(f"sampler: expected one of {SAMPLERS}, got {sampler!r}")
    last = (keep.sum(-1) - 1).clamp(min=0)  # (the top token is always kept for top_p > 0)
    kept = torch.zeros_like(keep).scatter(-1, idx, keep)
    active = k_on | p_on | (min_p > 0)
    return kept, idx, xs, zs, last, active


def sampler_forward(
    logits,
    labels,
    inv_temperature,
    top_k,
    top_p,
    min_p,
    sampler="vllm",
    ignore_index=-100,
    with_entropy=True,
    with_sum_p2=False,
    with_lse=False,
    stats_top_k=0,
    with_is_argmax=False,
):
    """token_logprobs under the sampler's distribution. logits [..., V]; labels and the per-token
    parameters (inv_temperature = 1 / T, top_k, top_p, min_p) with labels.shape. Computed in float64 for
    float64 logits, else float32. Returns (logprobs, entropy, lse, cut, cut_index, outside,
    sum_p2, full_lse, top_ids, top_logprobs, is_argmax), each with labels.shape (top_* with a
    last dim of stats_top_k); entropy and the statistics not asked for are empty.

    lse is the log-normaliser of the kept set (log sum_{j in K} exp(z_j)); (cut, cut_index) the
    kept set for the backward: x_j > cut, or x_j == cut and j <= cut_index ((-inf, V - 1) for a
    row with every option off; cut_index is V - 1 under "vllm", whose kept set holds whole tie
    groups). Rows with label == ignore_index give 0 (False, -1 for the ids); rows undefined
    without truncation (NaN / +inf logits, all -inf) give NaN (-1 for the ids), with the full
    kept set."""
    shape = labels.shape
    V = logits.shape[-1]
    acc = acc_dtype(logits.dtype)
    x = logits.to(acc).reshape(-1, V)
    lab = labels.reshape(-1)
    N = lab.numel()
    per = [t.reshape(-1) for t in (inv_temperature, top_k, top_p, min_p)]
    mx = x.amax(-1) if V > 0 else x.new_zeros(N)
    bad = ~(torch.logsumexp(x - mx.nan_to_num(0.0, 0.0, 0.0).unsqueeze(-1), -1).isfinite()) | (
        ~mx.isfinite()
    )
    xs_in = torch.where(bad.unsqueeze(-1), torch.zeros_like(x), x)  # no NaN in the sort
    kept, idx, xs, zs, last, active = sampler_kept(xs_in, *per, sampler=sampler)
    ks = kept.gather(-1, idx)  # kept, in rank order
    zk = torch.where(ks, zs, torch.full_like(zs, -float("inf")))
    lse_s = torch.logsumexp(zk, -1)  # of z - max z over the kept set
    it = per[0].to(acc)
    ignored, valid, safe = _label_masks(lab, V, ignore_index)
    xl = x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    in_set = kept.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    nan = torch.full((N,), float("nan"), dtype=acc, device=x.device)
    lp = torch.where(in_set, (xl - mx) * it - lse_s, torch.full_like(nan, -float("inf")))
    lp = torch.where(valid & ~bad, lp, nan).masked_fill(ignored, 0.0)
    lse = torch.where(bad, nan, mx * it + lse_s).masked_fill(ignored, 0.0)
    logq = zk - lse_s.unsqueeze(-1)
    q = logq.exp()
    cut = xs.gather(-1, last.unsqueeze(-1)).squeeze(-1)
    cut = torch.where(active & ~bad, cut, torch.full_like(cut, -float("inf")))
    cut_index = idx.gather(-1, last.unsqueeze(-1)).squeeze(-1)
    full = torch.full_like(cut_index, V - 1)
    cut_index = full if sampler == "vllm" else torch.where(active & ~bad, cut_index, full)
    cut = cut.masked_fill(ignored, -float("inf"))
    cut_index = cut_index.masked_fill(ignored, V - 1)
    outside = valid & ~bad & ~in_set

    def finish(v):
        return torch.where(valid & ~bad, v, nan).masked_fill(ignored, 0.0).reshape(shape)

    empty = x.new_empty(0)
    ent = empty
    if with_entropy:
        plogp = torch.where(q > 0, q * logq, torch.zeros_like(q))
        ent = finish(-plogp.sum(-1))
    sum_p2 = finish((q * q).sum(-1)) if with_sum_p2 else empty
    full_lse = empty
    if with_lse:
        fl = mx * it + torch.logsumexp(zs, -1)
        full_lse = torch.where(bad, nan, fl).masked_fill(ignored, 0.0).reshape(shape)
    if stats_top_k > 0:
        kk = stats_top_k
        top_ids = idx[:, :kk].masked_fill((ignored | bad).unsqueeze(-1), -1)
        tl = torch.where(ks[:, :kk], logq[:, :kk], torch.full_like(logq[:, :kk], -float("inf")))
        tl = torch.where(bad.unsqueeze(-1), torch.full_like(tl, float("nan")), tl)
        top_lp = tl.masked_fill(ignored.unsqueeze(-1), 0.0)
        top_ids, top_lp = top_ids.reshape(shape + (kk,)), top_lp.reshape(shape + (kk,))
    else:
        top_ids, top_lp = torch.empty(0, dtype=torch.long, device=x.device), empty
    if with_is_argmax:
        is_argmax = (valid & (xl == mx)).reshape(shape)
    else:
        is_argmax = torch.empty(0, dtype=torch.bool, device=x.device)
    return (
        lp.reshape(shape),
        ent,
        lse.reshape(shape),
        cut.reshape(shape),
        cut_index.reshape(shape),
        outside.reshape(shape),
        sum_p2,
        full_lse,
        top_ids,
        top_lp,
        is_argmax,
    )


def sampler_backward(
    grad_logprobs,
    grad_entropy,
    logits,
    labels,
    lse,
    entropy,
    cut,
    cut_index,
    inv_temperature,
    ignore_index=-100,
):
    """Gradient w.r.t. logits of sum(grad_logprobs * logprobs + grad_entropy * entropy) under the
    kept set (cut, cut_index) of sampler_forward, in logits' dtype: on the kept set K,
    (g_lp * (onehot - q) - g_ent * q * (log q + H)) / T with q = softmax(z) renormalised on K; 0
    outside K, and no log-prob term for a label outside K. q is recomputed relative to the row max
    (the saved lse may have overflowed). inv_temperature: per-token 1 / T with labels.shape."""
    V = logits.shape[-1]
    acc = acc_dtype(logits.dtype)
    x = logits.to(acc)
    it = inv_temperature.to(acc).unsqueeze(-1)
    j = torch.arange(V, device=x.device)
    c = cut.to(acc).unsqueeze(-1)
    kept = (x > c) | ((x == c) & (j <= cut_index.unsqueeze(-1)))
    m = x.amax(-1, keepdim=True) if V > 0 else x.new_zeros(x.shape[:-1] + (1,))
    z = torch.where(kept, (x - m) * it, torch.full_like(x, -float("inf")))
    logq = z - torch.logsumexp(z, -1, keepdim=True)
    q = logq.exp()
    ignored, valid, safe = _label_masks(labels, V, ignore_index)
    in_set = kept.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    glp = torch.where(in_set, grad_logprobs.to(acc), torch.zeros_like(grad_logprobs, dtype=acc))
    g = -glp.unsqueeze(-1) * q
    if grad_entropy is not None and grad_entropy.numel() > 0:
        w = torch.where(q > 0, q * (logq + entropy.to(acc).unsqueeze(-1)), torch.zeros_like(q))
        g = g - grad_entropy.to(acc).unsqueeze(-1) * w
    g = g.scatter_add(-1, safe.unsqueeze(-1), glp.unsqueeze(-1))
    g = g * it
    g = torch.where(valid.unsqueeze(-1), g, torch.full_like(g, float("nan")))
    g = g.masked_fill(ignored.unsqueeze(-1), 0.0)
    return g.to(logits.dtype)


def eager_sampled_logprobs(logits, labels, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """What a trainer would write with the engine's code (the benchmark baseline): vLLM's order on
    a float32 copy -- temperature, the min-p mask, one full sort, the top-k and top-p masks on the
    sorted logits and their cumulative sum, the mask scattered back, log_softmax, gather. Scalar
    parameters; labels in [0, V)."""
    z = logits.float() / temperature
    if min_p:
        p = torch.softmax(z, -1)
        z = z.masked_fill(p < min_p * p.amax(-1, keepdim=True), -float("inf"))
    if top_k or (top_p is not None and top_p < 1):
        zs, idx = z.sort(-1)
        if top_k:
            zs = zs.masked_fill(zs < zs[:, -top_k:][:, :1], -float("inf"))
        if top_p is not None and top_p < 1:
            cs = zs.softmax(-1).cumsum(-1)
            drop = cs <= 1 - top_p
            drop[:, -1] = False
            zs = zs.masked_fill(drop, -float("inf"))
        z = z.scatter(-1, idx, zs)
    return torch.log_softmax(z, -1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
