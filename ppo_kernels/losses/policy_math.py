"""The per-token math of every policy-loss type, in two stages, with analytic gradients: one home
shared by `ppo_policy_loss` (on given log-probs) and the fused hidden-states policy loss.

Everything here is plain torch on `[B, T]` tensors in the accumulation dtype (float64 stays
float64, everything else float32), with no host synchronisation and no Python branching on
tensor values (only on the configuration), so it traces into one CUDA graph / compiled region.

Notation (per row b, token t): lp = logprob, old = old_logprob, d = lp - old, A = advantage
(per token, or per sequence broadcast), m = mask weight (0 = not a loss token), n_b = sum_t m,
w = per-token weight (rollout importance weights, caller's weights; detached),
r = exp(clamp(d, -L, L)) (L = log_ratio_clamp; inf = no clamp), lo = 1 - clip_low,
hi = 1 + clip_high, c_b = the aggregation's row coefficient (reference.row_coefficients), and
`mu_b = sum_t m d / max(n_b, 1)` (the mean log-ratio of a sequence).

The loss is `L = sum_b c_b sum_t m w l_t` and its gradient
`dL/dlp_t = c_b m w g_t + G_b * s_t`,  `G_b = sum_t' c_b m w q_t'`
where, per type, l_t is the per-token term, g_t = dl_t/dlp_t holding the row statistic fixed, and
(only where a gradient flows through a row statistic S_b) q_t = dl_t/dS_b and s_t = dS_b/dlp_t.

Per type: l_t; g_t; the stage-1 statistics; the terms through a row statistic (if any).
  ppo, grpo, bnpo, dr_grpo, dapo, luspo (the clipped surrogate; they differ in aggregation):
      l = max(-A r1, -A clip(r, lo, hi)), r1 = min(r, delta); for A < 0 with dual clip c,
      min(l, -A c).  g = -A (w1 [r < delta] + (1 - w1) [lo < r < hi]) r [|d| < L], times the
      min's weight of l under the dual clip (w1: torch's weight of the first argument of the max:
      1, 0, or 1/2 at a tie).  No statistic.
    importance_sampling_level="sequence" (TRL's GSPO): r = exp(clamp(mu_b, -L, L)) for every
      token of the row; g = 0; S = mu_b, q = dl/dr r [|mu_b| < L], s = m / max(n_b, 1).
  gspo (verl): the surrogate (no dual clip) of r = exp(min(mu_b, L)), L = 10, mu_b a
      stop-gradient: g = dl/dr r [mu_b < L].  Statistic mu_b.
  sapo: l = -A f(r), f = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos if A > 0 else tau_neg;
      g = -A 4 sig (1 - sig) r [|d| < L].  Sequence level: as the clipped types.
  cispo: l = -sg(clip(r, lo, hi)) A lp; g = -clip(r, lo, hi) A.  Sequence level: r of mu_b
      (a statistic, no gradient through it).
  gpg = reinforce: l = -A lp; g = -A.      dro: l = -(A lp - beta d^2 / 2); g = -A + beta d.
  dppo_tv, dppo_kl: l = -A sg(min(r, C)) lp v; g = -A min(r, C) v, with v = [p - p_old <=
      clip_high] for A > 0 else [p - p_old >= -clip_low] (tv), v = [kl <= clip_high or
      p <= p_old] for A > 0 else [kl <= clip_low or p >= p_old] (kl), p = exp(lp),
      kl = p_old (old - lp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)).
  geo_mean: per row -Abar_b rho_b sw_b (mean over the B rows), written per token as
      l = -Abar_b rho_b / n_b; rho_b = exp(S_b), S_b = sum_t m k_t / n_b,
      k_t = sgn(A) min(sgn(A) d, sgn(A) clamp(d, -clip_low, clip_high)), Abar_b = sum m A / n_b;
      g = 0, q = l, s = m k'(d) / n_b.  Statistics S_b, Abar_b; the weights per row,
      sw_b = exp(sum m log(w + 1e-10) / (n_b + 1e-8)) (verl).
  clip_cov: l = max(-A r, -A clip(r, lo, hi)) corr_t, r = exp(d); g = corr_t x the surrogate's.
      Statistic corr (batch): 0 for min(max(floor(clip_cov_ratio sum m), 1), #candidates)
      tokens drawn uniformly among those with clip_cov_lb < (A - mean A)(lp - mean lp) <
      clip_cov_ub that the clip did not already clip.
  kl_cov: l = -A r + kappa |d| sel_t, r = exp(d); g = -A r + kappa sign(d) sel_t.  Statistic sel
      (batch): 1 for the max(floor(kl_cov_ratio N), 1) largest covariances (N = #(m > 0),
      unweighted means).

Stage 1 (`statistics`) computes what needs more than the token itself: mu_b, geo_mean's S_b and
Abar_b (per sequence: every token of the row first), clip_cov's / kl_cov's selections (per batch:
every token of the batch first, and a sort). Stage 2 (`token_terms`) gives l_t, g_t, q_t, s_t and
the per-token statistic terms; `combine` folds in c_b and w into the loss and the per-token
coefficient dL/dlp_t -- what a fused op multiplies into its logits-gradient tile in the forward.
In a fused op whose chunk holds whole sequences, per-sequence statistics cost nothing extra; a
sequence longer than a chunk, and every batch statistic (clip_cov, kl_cov, batch-normalised
rollout weights, a local token-mean denominator of a mask that depends on the current log-probs),
needs its log-probs before any gradient tile can be formed: a second pass over those rows
(`stat_scope` says which).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._math import acc_dtype  # noqa: F401  (also policy_loss's pm.acc_dtype)
from .config import CLIP_TYPES, LOSS_TYPES, SEQUENCE_LEVEL_TYPES, PolicyLossConfig

# the types whose per-token gradient needs every token of the batch first (a second pass in a
# fused op whatever its chunking)
BATCH_STAT_TYPES = ("clip_cov", "kl_cov")

# (agg mode, global_batch_size default "rows" = B, loss_scale_factor default T) when agg=None
_DEFAULT_AGG = {
    "grpo": ("seq-mean-token-mean", True),  # TRL: mean over all B rows of the token mean
    "bnpo": ("token-mean", False),
    "dr_grpo": ("seq-mean-token-sum-norm", True),  # TRL: sum / (B * max_completion_length)
    "dapo": ("token-mean", False),  # TRL: sum / num_items_in_batch (global_num_tokens)
    "luspo": ("seq-mean-token-sum", True),  # TRL 1.16: mean over B rows of the token sum
    "sapo": ("seq-mean-token-mean", False),  # verl forces it (TRL: grpo's, rows = B)
    "geo_mean": ("seq-mean-token-sum", True),  # verl: torch.mean over the B per-row losses
}


def is_ppo_surrogate(cfg: PolicyLossConfig) -> bool:
    """Whether a type's per-token loss is ppo's clipped surrogate, which the fused "ppo" kernels
    compute with their statistics (verl's and TRL's): every token-level clipped type without
    `delta` (TRL's types differ only in the aggregation and the log-ratio clamp, resolved
    before the loss)."""
    return cfg.loss_type in CLIP_TYPES and not cfg.sequence_level and cfg.delta is None


def stat_scope(cfg: PolicyLossConfig) -> str:
    """What a token's gradient coefficient needs beyond the token: "token" (nothing: one pass),
    "sequence" (every token of its row: a second pass for a row longer than a chunk) or "batch"
    (every token of the batch: a second pass). Rollout correction in bypass mode can widen it
    (policy_loss.stat_scope)."""
    if cfg.loss_type in BATCH_STAT_TYPES:
        return "batch"
    if cfg.loss_type in ("gspo", "geo_mean") or (
        cfg.sequence_level and cfg.loss_type in SEQUENCE_LEVEL_TYPES
    ):
        return "sequence"
    return "token"


def default_aggregation(loss_type: str) -> tuple[str, bool]:
    """(agg mode, whether the sequence count defaults to all B rows) of `agg=None`."""
    return _DEFAULT_AGG.get(loss_type, ("token-mean", False))


class Inputs(NamedTuple):
    """[B, T] tensors in the accumulation dtype; zero (not NaN) wherever m == 0."""

    lp: Tensor
    old: Tensor
    adv: Tensor
    m: Tensor


class Stats(NamedTuple):
    """Stage 1: what the per-token terms need beyond their own token (None: not used)."""

    n: Tensor  # [B] sum_t m
    seq_log_ratio: Tensor | None = None  # [B] mu_b
    geo_log_ratio: Tensor | None = None  # [B] geo_mean's S_b
    geo_adv: Tensor | None = None  # [B] geo_mean's Abar_b
    select: Tensor | None = None  # [B, T] clip_cov: corr (1 keep, 0 drop); kl_cov: 1 = penalised


class Terms(NamedTuple):
    """Stage 2, per token: l_t, g_t, q_t / s_t (None: no gradient through a row statistic), and
    the per-token values whose masked means are the statistics."""

    loss: Tensor
    grad: Tensor | None  # None: 0
    seq_grad: Tensor | None
    seq_dstat: Tensor | None
    metrics: dict[str, Tensor]


def _max_w(a, b):
    """d max(a, b) / da under torch's rule: 1, 0, or 1/2 at a tie."""
    return torch.where(a > b, 1.0, torch.where(a < b, 0.0, 0.5)).to(a.dtype)


def prepare(logprobs, old_logprobs, advantages, mask) -> Inputs:
    """[B, T] inputs (advantages [B, T] or [B]) to the accumulation dtype, with masked-out
    positions zeroed so that NaN / inf there never reaches a sum or a sort."""
    acc = acc_dtype(logprobs.dtype)
    m = mask.to(acc)
    keep = m != 0
    zero = torch.zeros((), dtype=acc, device=logprobs.device)
    m = torch.where(keep, m, zero)
    adv = advantages.to(acc)
    if adv.dim() == logprobs.dim() - 1:
        adv = adv.unsqueeze(-1).expand(logprobs.shape)
    return Inputs(
        torch.where(keep, logprobs.to(acc), zero),
        torch.where(keep, old_logprobs.to(acc), zero),
        torch.where(keep, adv, zero),
        m,
    )


def _safe_div(a, b):
    """a / b, 0 where b == 0."""
    return torch.where(b != 0, a / torch.where(b != 0, b, 1.0), torch.zeros_like(a))


def _geo_k(cfg, d, adv):
    """geo_mean's sign-aware clipped log-ratio k_t and its derivative dk/dd (torch's tie rule)."""
    sgn = torch.sign(adv)
    dc = torch.clamp(d, -cfg.clip_low, cfg.clip_high)
    x, y = sgn * d, sgn * dc
    k = sgn * torch.minimum(x, y)
    wx = _max_w(y, x)  # weight of x in min(x, y)
    inside = ((d > -cfg.clip_low) & (d < cfg.clip_high)).to(d.dtype)
    return k, sgn * sgn * (wx + (1 - wx) * inside)


def _rank_mask(keys, count):
    """[B, T] bool: the `count` (0-dim tensor) entries of smallest key (sync-free top-k)."""
    flat = keys.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(flat.numel(), device=flat.device)
    return (rank < count).reshape(keys.shape)


def statistics(cfg: PolicyLossConfig, x: Inputs, generator: torch.Generator | None = None) -> Stats:
    """Stage 1: per-sequence and per-batch statistics of the (detached) log-probs."""
    lp, old, adv, m = (t.detach() for t in x)
    n = m.sum(-1)
    t = cfg.loss_type
    d = lp - old
    mu = geo = abar = select = None
    if t == "gspo" or (cfg.sequence_level and t in SEQUENCE_LEVEL_TYPES):
        mu = (d * m).sum(-1) / n.clamp(min=1.0)
    if t == "geo_mean":
        k, _ = _geo_k(cfg, d, adv)
        geo = _safe_div((k * m).sum(-1), n)
        abar = _safe_div((adv * m).sum(-1), n)
    if t == "clip_cov":
        r = torch.exp(d)
        keep = m > 0
        clipped = (-adv * torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high) > -adv * r) & keep
        total = m.sum()
        cov = (adv - _safe_div((adv * m).sum(), total)) * (lp - _safe_div((lp * m).sum(), total))
        cand = keep & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
        # up to clip_num candidates drawn uniformly (verl: a random permutation of them)
        keys = torch.rand(lp.shape, generator=generator, dtype=lp.dtype, device=lp.device)
        keys = torch.where(cand, keys, torch.full_like(keys, 2.0))
        clip_num = torch.floor(cfg.clip_cov_ratio * total).clamp(min=1.0)
        select = (~(cand & _rank_mask(keys, clip_num))).to(lp.dtype)
    if t == "kl_cov":
        valid = m > 0
        vf = valid.to(lp.dtype)
        cnt = vf.sum()
        cov = (adv - _safe_div((adv * vf).sum(), cnt)) * (lp - _safe_div((lp * vf).sum(), cnt))
        keys = torch.where(valid, -cov, torch.full_like(cov, math.inf))
        k = torch.floor(cnt * cfg.kl_cov_ratio).clamp(min=1.0)
        select = (valid & _rank_mask(keys, k)).to(lp.dtype)
    return Stats(n, mu, geo, abar, select)


def clip_surrogate(r, adv, lo, hi, dual_clip=None, delta=None):
    """The clipped surrogate max(-A min(r, delta), -A clip(r, lo, hi)) (dual clip for A < 0):
    (loss, dloss/dr, clipped [pg2 > pg1], clipped_lower or None) with torch's tie rules."""
    r1 = r if delta is None else torch.clamp(r, max=delta)
    dr1 = 1.0 if delta is None else (r < delta).to(r.dtype)
    pg1 = -adv * r1
    pg2 = -adv * torch.clamp(r, lo, hi)
    loss = torch.maximum(pg1, pg2)
    w1 = _max_w(pg1, pg2)
    in_clip = ((r > lo) & (r < hi)).to(r.dtype)
    g = -adv * (w1 * dr1 + (1 - w1) * in_clip)
    clipped = (pg2 > pg1).to(r.dtype)
    lower = None  # no dual clip: never
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        neg = adv < 0
        g = torch.where(neg, g * _max_w(pg3, loss), g)
        lower = ((loss > pg3) & neg).to(r.dtype)
        loss = torch.where(neg, torch.minimum(pg3, loss), loss)
    return loss, g, clipped, lower


def ratio(d, L):
    """(exp(clamp(d, -L, L)), d ratio / d d)."""
    if L == math.inf:
        r = torch.exp(d)
        return r, r
    r = torch.exp(torch.clamp(d, -L, L))
    return r, torch.where((d > -L) & (d < L), r, torch.zeros((), dtype=d.dtype, device=d.device))


def _trl_clip_metrics(out, r, adv, lo, hi):
    """TRL's / Liger's clip indicators on the ratio they clip."""
    low = ((r < lo) & (adv < 0)).to(r.dtype)
    high = ((r > hi) & (adv > 0)).to(r.dtype)
    out["clip_low_frac"] = low
    out["clip_high_frac"] = high
    out["clip_region_frac"] = torch.maximum(low, high)


def trl_clip_statistics(r, adv, m, lo, hi) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """_trl_clip_metrics' indicators summarised in one stacked pass: (their masked means, as
    masked_means gives them; the per-row min / max of the row fractions, as row_metrics gives
    them at token level). r, adv, m: [R, T] (adv may be [R, 1]); off the mask an indicator is
    0 or 1 whatever r and adv hold there (a comparison with NaN is false), which m's zeros cancel.
    The means sum the row sums: for a 0 / 1 mask bit for bit masked_means' result."""
    met: dict[str, Tensor] = {}
    _trl_clip_metrics(met, r, adv, lo, hi)
    rows = (torch.stack(tuple(met.values())).to(m.dtype) * m).sum(-1)  # [3, R]
    n = m.sum(-1)
    has = n > 0
    # _safe_div's zeros in fewer ops (no gradient flows here): an empty row's sums are 0
    total = n.sum()
    means = rows.sum(-1) / torch.where(total > 0, total, 1.0)
    frac = rows / torch.where(has, n, 1.0)
    if n.numel():
        lo_min = torch.where(has, frac[0], math.inf).amin()
        hi_max = torch.where(has, frac[1], -math.inf).amax()
    else:
        lo_min = hi_max = torch.full((), math.inf, dtype=m.dtype, device=m.device)
    return dict(zip(met, means.unbind(0))), {
        "clip_low_frac_min": torch.where(torch.isinf(lo_min), math.nan, lo_min),
        "clip_high_frac_max": torch.where(torch.isinf(hi_max), math.nan, hi_max),
    }


def token_terms(cfg: PolicyLossConfig, x: Inputs, st: Stats) -> Terms:
    """Stage 2: per-token loss, gradient coefficients and statistic terms given stage 1."""
    lp, old, adv, m = (t.detach() for t in x)
    t = cfg.loss_type
    lo, hi, L = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high, cfg.log_ratio_clamp
    d = lp - old
    seq_grad = seq_dstat = None
    met: dict[str, Tensor] = {}
    clipped = lower = None  # None: 0 everywhere
    kl_term = -d if L == math.inf else -torch.clamp(d, -L, L)  # verl's ppo_kl
    seq = cfg.sequence_level and t in SEQUENCE_LEVEL_TYPES
    if seq:
        mu = st.seq_log_ratio.unsqueeze(-1)
        r = torch.exp(torch.clamp(mu, -L, L)).expand(lp.shape)
        drdmu = r * ((mu > -L) & (mu < L)).to(lp.dtype)
        seq_dstat = m / st.n.clamp(min=1.0).unsqueeze(-1)
    else:
        r, drdlp = ratio(d, L)

    if t in CLIP_TYPES:
        loss, dl_dr, clipped, lower = clip_surrogate(r, adv, lo, hi, cfg.dual_clip, cfg.delta)
        if seq:
            grad, seq_grad = None, dl_dr * drdmu
        else:
            grad = dl_dr * drdlp
        if t != "ppo":  # TRL's / Liger's statistics of their clipped types
            _trl_clip_metrics(met, r, adv, lo, hi)
    elif t == "gspo":
        mu = st.seq_log_ratio.unsqueeze(-1)
        r = torch.exp(torch.clamp(mu, max=L)).expand(lp.shape)
        loss, dl_dr, clipped, _ = clip_surrogate(r, adv, lo, hi)
        grad = dl_dr * r * (mu < L).to(lp.dtype)
        kl_term = -d
    elif t == "sapo":
        tau = torch.where(
            adv > 0, torch.full_like(adv, cfg.tau_pos), torch.full_like(adv, cfg.tau_neg)
        )
        sig = torch.sigmoid(tau * (r - 1))
        loss = -adv * sig * (4.0 / tau)
        dl_dr = -adv * 4.0 * sig * (1 - sig)
        if seq:
            grad, seq_grad = None, dl_dr * drdmu
        else:
            grad = dl_dr * drdlp
    elif t == "cispo":
        c = torch.clamp(r, lo, hi)
        loss, grad = -c * adv * lp, -c * adv
        clipped = (r != c).to(lp.dtype)
        _trl_clip_metrics(met, r, adv, lo, hi)
    elif t in ("gpg", "reinforce"):
        loss, grad = -lp * adv, -adv
    elif t == "dro":
        beta = cfg.dro_beta
        loss, grad = -(lp * adv - 0.5 * beta * d * d), -adv + beta * d
        kl_term = -d
    elif t in ("dppo_tv", "dppo_kl"):
        C = 20.0 if cfg.dual_clip is None else cfg.dual_clip
        p, p_old = torch.exp(lp), torch.exp(old)
        if t == "dppo_tv":
            pos, neg = (p - p_old) <= cfg.clip_high, (p - p_old) >= -cfg.clip_low
        else:
            bkl = p_old * (old - lp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            pos = (bkl <= cfg.clip_high) | (p <= p_old)
            neg = (bkl <= cfg.clip_low) | (p >= p_old)
        v = torch.where(adv > 0, pos, neg).to(lp.dtype)
        tr = torch.clamp(r, max=C)
        loss, grad = -adv * tr * lp * v, -adv * tr * v
        clipped, lower = 1 - v, (r > C).to(lp.dtype) * v
    elif t == "geo_mean":
        k, dk = _geo_k(cfg, d, adv)
        rho = torch.exp(st.geo_log_ratio).unsqueeze(-1)
        inv_n = _safe_div(torch.ones_like(st.n), st.n).unsqueeze(-1)
        loss = (-st.geo_adv.unsqueeze(-1) * rho * inv_n).expand(lp.shape)
        grad, seq_grad, seq_dstat = None, loss, m * dk * inv_n
        r = rho.expand(lp.shape)
        cl = (d != torch.clamp(d, -cfg.clip_low, cfg.clip_high)).to(lp.dtype)
        clipped, lower = cl * (adv > 0).to(lp.dtype), cl * (adv < 0).to(lp.dtype)
        kl_term = -d
    elif t == "clip_cov":
        r = torch.exp(d)
        pl, dl_dr, _, _ = clip_surrogate(r, adv, lo, hi)
        corr = st.select
        loss, grad = pl * corr, dl_dr * r * corr
        clipped = 1 - corr
        kl_term = -d
    elif t == "kl_cov":
        r = torch.exp(d)
        sel = st.select
        loss = -adv * r + cfg.kl_cov_coef * d.abs() * sel
        grad = -adv * r + cfg.kl_cov_coef * torch.sign(d) * sel
        kl_term = d.abs()
    else:
        raise ValueError(f"loss_type: unknown {t!r}; expected one of {LOSS_TYPES}")
    met.update(clip_frac=clipped, clip_frac_lower=lower, approx_kl=kl_term, ratio_mean=r)
    if seq_grad is None:
        seq_dstat = None
    return Terms(loss, grad, seq_grad, seq_dstat, met)


def token_weights(
    cfg: PolicyLossConfig, x: Inputs, st: Stats, weights: Tensor | None
) -> Tensor | None:
    """The weight w of each token in the loss: the caller's (detached), geo_mean's per-row
    geometric mean of them (verl)."""
    if weights is None:
        return None
    w = weights.detach().to(x.m.dtype)
    if cfg.loss_type == "geo_mean":
        sw = torch.exp((torch.log(w + 1e-10) * x.m).sum(-1) / (st.n + 1e-8))
        return sw.unsqueeze(-1).expand(w.shape)
    return w


def combine(terms: Terms, x: Inputs, row_coef: Tensor, weights: Tensor | None = None):
    """(loss, dL/dlp [B, T]) from stage 2 and the aggregation's row coefficients [B]."""
    k = row_coef.to(x.m.dtype).unsqueeze(-1) * x.m
    if weights is not None:
        k = k * torch.where(x.m != 0, weights, torch.zeros_like(weights))
    loss = (k * terms.loss).sum()
    coef = torch.zeros_like(k) if terms.grad is None else k * terms.grad
    if terms.seq_grad is not None:
        coef = coef + (k * terms.seq_grad).sum(-1, keepdim=True) * terms.seq_dstat
    return loss, coef


def masked_means(values: dict[str, Tensor | None], m: Tensor) -> dict[str, Tensor]:
    """Masked means over the local mask (0 for an empty mask; a None value is 0), sync-free."""
    total = m.sum()
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    return {k: zero if v is None else _safe_div((v * m).sum(), total) for k, v in values.items()}


def row_metrics(values: dict[str, Tensor], m: Tensor, per_row: bool) -> dict[str, Tensor]:
    """TRL's per-sequence clip summaries: the mean over rows of the row's value (`seq_*`; per_row:
    the value is one per row, every row counts, as TRL's sequence level) and the min / max over
    rows of the row's masked fraction (`clip_low_frac_min`, `clip_high_frac_max`; rows with no
    token are skipped at token level, NaN when none is left). A None value is 0, as in
    masked_means (a batch with no rows computes none)."""
    out = {}
    n = m.sum(-1)
    has = torch.ones_like(n, dtype=torch.bool) if per_row else n > 0
    nan = torch.full((), math.nan, dtype=m.dtype, device=m.device)
    inf = torch.full((), math.inf, dtype=m.dtype, device=m.device)
    rows = {}
    for k in ("clip_low_frac", "clip_high_frac", "clip_region_frac"):
        if k in values:
            v = values[k]
            if v is None:
                v = torch.zeros_like(m)
            if per_row:  # one value per row (0 off the mask: the row's max is its value)
                rows[k] = v.amax(-1) if v.shape[-1] else torch.zeros_like(n)
            else:
                rows[k] = _safe_div((v * m).sum(-1), n)
            if per_row:
                out["seq_" + k] = rows[k].mean() if rows[k].numel() else nan
    if "clip_low_frac" in rows:
        lo = torch.where(has, rows["clip_low_frac"], inf).amin() if n.numel() else inf
        hi = torch.where(has, rows["clip_high_frac"], -inf).amax() if n.numel() else -inf
        out["clip_low_frac_min"] = torch.where(torch.isinf(lo), nan, lo)
        out["clip_high_frac_max"] = torch.where(torch.isinf(hi), nan, hi)
    return out
