"""The math of every preference-loss type on sequence log-probs, with analytic gradients: the one
home a preference head term calls per block of whole pairs (and the float64 reference's target,
preference_naive.py). Formulas, peers' conventions and what is left out: docs/ppo-math.md,
"Preference losses".

Everything here is plain torch on `[B]` tensors in the accumulation dtype (float64 stays float64,
everything else float32), with no host synchronisation and no Python branching on tensor values
(only on the configuration).

Notation (pair b): c, r = the policy's sequence log-probs of the chosen / rejected completion as
the loss sees them (masked sums, length-normalised means, or LD-DPO's weighted sums:
`sequence_token_weights`), rc, rr = the reference's (0 for the reference-free types or no
reference), x_c = c - rc, x_r = r - rr (the log-ratios), n_c, n_r = the completions' token
counts, s = f(x) the f-divergence score (reverse_kl: s = x), z = beta (s_c - s_r), P_b = the plain
masked sum of the chosen completion's token log-probs (the SFT / NLL term's input), w_b = the
pair's weight (WPO: detached; 1 without), k over the loss types with weights lambda_k.

The loss is `L = sum_k lambda_k mean_b(w_b l_k(b))` and each type gives l_k and its derivatives
d l_k / d c_b, d l_k / d r_b; the SFT term gives d L / d P_b. A fused op turns them into its
per-token coefficients with `token_coefficients` (the sequence log-probs are linear in the token
log-probs: seq_b = sum_t k_bt lp_bt).

Per type: l (per pair); the derivative (g = d l / d z, and the chain through z = beta (s_c - s_r)
gives d l / d c = g beta s'(x_c), d l / d r = -g beta s'(x_r) unless written otherwise).
  sigmoid: -log sig(z); g = -sig(-z).          hinge: relu(1 - z); g = -[z < 1].
  ipo: u^2, u = s_c / max(n_c, 1) - s_r / max(n_r, 1) - 1 / (2 beta);
      d / dc = 2 u s'(x_c) / max(n_c, 1), d / dr = -2 u s'(x_r) / max(n_r, 1).
  exo_pair (eps = label_smoothing > 0): sig(z) (log sig(z) - log(1 - eps))
      + sig(-z) (log sig(-z) - log eps); g = sig(z) sig(-z) (z - log(1 - eps) + log eps).
  nca_pair: -log sig(a) - log sig(-a) / 2 - log sig(-b) / 2, a = beta x_c, b = beta x_r;
      d / dc = beta (sig(a) / 2 - sig(-a)), d / dr = beta sig(b) / 2.
  robust (eps in [0, 1/2)): (-(1 - eps) log sig(z) + eps log sig(-z)) / (1 - 2 eps);
      g = (-(1 - eps) sig(-z) - eps sig(z)) / (1 - 2 eps).
  bco_pair: -log sig(a) - log sig(-b); d / dc = -beta sig(-a), d / dr = beta sig(b).
  sppo_hard: (x_c - 1 / (2 beta))^2 + (x_r + 1 / (2 beta))^2; d / dc = 2 (x_c - 1 / (2 beta)),
      d / dr = 2 (x_r + 1 / (2 beta)).
  aot: per rank i of the sorted batch, d_i = sort(c - r)_i - sort(rc - rr)_i,
      l_i = -(1 - eps) log sig(beta d_i) - eps log sig(-beta d_i); the gradient of rank i goes back
      to the pair sorted there: d / d(c - r) = beta (-(1 - eps) sig(-beta d_i) + eps sig(beta d_i)).
  aot_unpaired: d_i = sort(x_c)_i - sort(x_r)_i, the same l_i; rank i of each sort gets +-.
  apo_zero: 1 - sig(a) + sig(b); d / dc = -beta sig'(a), d / dr = beta sig'(b)
      (sig' = sig (1 - sig)).
  apo_down: sig(a) + 1 - sig(y), y = beta (x_c - x_r); d / dc = beta (sig'(a) - sig'(y)),
      d / dr = beta sig'(y).
  discopop (tau): mu = sig(z / tau); -log sig(z) (1 - mu) + e^-z mu;
      g = -sig(-z) (1 - mu) - e^-z mu + mu (1 - mu) (e^-z + log sig(z)) / tau.
  sft: -(sum_b P_b) / (sum_b n_c) (one value for every pair; 0 without chosen tokens);
      d L / d P_b = -lambda mean_b(w_b) / sum_b n_c.
  sigmoid_norm: -log sig(z'), z' = beta (s_c / max(n_c, 1) - s_r / max(n_r, 1)).
  orpo (Liger; c, r are means): -beta log sig(o), o = (c - r) - (log(1 - e^c) - log(1 - e^r));
      d / dc = -beta sig(-o) / (1 - e^c), d / dr = beta sig(-o) / (1 - e^r).
  simpo (Liger; gamma): -(1 - eps) log sig(y) - eps log sig(-y), y = beta (c - r) - gamma;
      d / dc = beta g, d / dr = -beta g, g = -(1 - eps) sig(-y) + eps sig(y).
  cpo (Liger): simpo with gamma = 0.
f-divergence scores (TRL's f-DPO; for the types in F_DIVERGENCE_TYPES): reverse_kl s = x;
forward_kl s = 1 - e^-x, s' = e^-x; js_divergence s = log 2 + log sig(x), s' = sig(-x);
alpha_divergence (a != 1) s = (e^t - 1) / (a - 1), t = min((a - 1) x, 80), s' = e^t [t <= 80].

Unpaired (KTO; per row i, label y_i: desirable or not, x_i = lp_i - ref_i, KL = a detached
reference point, lambda_D / lambda_U = desirable_weight / undesirable_weight):
  kto: y: lambda_D (1 - sig(beta (x - KL))), not y: lambda_U (1 - sig(beta (KL - x)));
  apo_zero_unpaired: y: lambda_D (1 - sig(beta x)), not y: lambda_U sig(beta x);
  L = mean_i l_i. KL (TRL): max(mean_j (lp_j - ref_j), 0) over the batch's mismatched
  (prompt, other completion) rows, detached (`kto_reference_point`); Liger takes it as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check_float
from .._math import acc_dtype

# TRL DPOTrainer's types, then Liger's reference-free ones (ORPO, SimPO, CPO).
TRL_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
REFERENCE_FREE_TYPES = ("orpo", "simpo", "cpo")
PAIRED_TYPES = TRL_TYPES + REFERENCE_FREE_TYPES
UNPAIRED_TYPES = ("kto", "apo_zero_unpaired")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the types TRL lets f_divergence_type change (built on the chosen - rejected score difference)
F_DIVERGENCE_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop")
# the types whose per-pair term needs every pair of the batch first (a sort): a second pass in a
# fused op whose blocks do not hold the whole batch
BATCH_STAT_TYPES = ("aot", "aot_unpaired")
# TRL clamps the alpha-divergence exponent so that exp stays finite in the input dtype
_ALPHA_CLAMP = {torch.float16: 11.0}


@dataclass(frozen=True)
class PreferenceConfig:
    """Paired preference loss: the types (summed with their weights) and their parameters."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None  # None: 1 each (TRL)
    beta: float = 0.1
    label_smoothing: float = 0.0  # robust / exo_pair / aot / simpo / cpo
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    simpo_gamma: float = 0.5  # Liger's SimPO margin gamma

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0,) * len(self.loss_types)


def check_config(cfg: PreferenceConfig, has_reference: bool, has_weights: bool = False):
    """ValueError naming the option for a configuration no peer runs or the math cannot express."""
    types = cfg.loss_types
    if not types:
        raise ValueError("loss_type: expected at least one loss type")
    for t in types:
        if t not in PAIRED_TYPES:
            raise ValueError(f"loss_type: unknown {t!r}; expected one of {PAIRED_TYPES}")
    if cfg.loss_weights is not None and len(cfg.loss_weights) != len(types):
        raise ValueError(
            f"loss_weights: expected {len(types)} weights (one per loss type), "
            f"got {len(cfg.loss_weights)}"
        )
    check_float("beta", cfg.beta, positive=True)  # finite too; traces a SymFloat
    if cfg.f_divergence_type not in F_DIVERGENCES:
        raise ValueError(
            f"f_divergence_type: unknown {cfg.f_divergence_type!r}; expected one of {F_DIVERGENCES}"
        )
    if cfg.f_divergence_type != "reverse_kl":
        bad = [t for t in types if t not in F_DIVERGENCE_TYPES + ("sft",)]
        if bad:
            raise ValueError(
                f"f_divergence_type: {cfg.f_divergence_type!r} applies only to "
                f"{F_DIVERGENCE_TYPES + ('sft',)}, not to {bad}"
            )
    eps = cfg.label_smoothing
    if "exo_pair" in types and not 0 < eps < 1:
        raise ValueError(f"label_smoothing: exo_pair needs 0 < label_smoothing < 1, got {eps}")
    if "robust" in types and not 0 <= eps < 0.5:
        raise ValueError(f"label_smoothing: robust needs 0 <= label_smoothing < 0.5, got {eps}")
    if not 0 <= eps <= 1:
        raise ValueError(f"label_smoothing: expected a value in [0, 1], got {eps}")
    if "discopop" in types and not cfg.discopop_tau > 0:
        raise ValueError(f"discopop_tau: expected a positive number, got {cfg.discopop_tau}")
    free = [t for t in types if t in REFERENCE_FREE_TYPES]
    if free and has_reference:
        raise ValueError(f"ref_chosen: {free} are reference-free; pass no reference log-probs")
    if has_weights and any(t in BATCH_STAT_TYPES for t in types):
        raise ValueError(
            "weights: aot / aot_unpaired sort the pairs, which per-pair weights cannot follow"
        )


def stat_scope(cfg: PreferenceConfig, has_weights: bool = False) -> str:
    """What a pair's gradient coefficients need beyond the pair: "pair" (its two rows: a block of
    whole pairs is one pass; the SFT term's token count comes from the mask, known before) or
    "batch" (every pair first: a second pass unless one block holds the batch): the sorted types,
    and the SFT term under WPO weights (scaled by the batch's mean weight)."""
    if any(t in BATCH_STAT_TYPES for t in cfg.loss_types):
        return "batch"
    if has_weights and "sft" in cfg.loss_types:
        return "batch"
    return "pair"


class PairResult(NamedTuple):
    loss: Tensor  # scalar
    d_chosen: Tensor  # [B] d L / d c
    d_rejected: Tensor  # [B] d L / d r
    d_chosen_sum: Tensor | None  # [B] d L / d P (the SFT term), None without one
    metrics: dict[str, Tensor]  # detached


# ---- helpers ----


def _sig_prime(x):
    s = torch.sigmoid(x)
    return s * (1 - s)


def _score(cfg: PreferenceConfig, x: Tensor, in_dtype: torch.dtype):
    """(s, ds/dx) of the f-divergence score."""
    f = cfg.f_divergence_type
    if f == "reverse_kl" or (
        f == "alpha_divergence" and abs(cfg.f_alpha_divergence_coef - 1.0) < 1e-6
    ):
        return x, torch.ones_like(x)
    if f == "forward_kl":
        e = torch.exp(-x)
        return 1 - e, e
    if f == "js_divergence":
        return math.log(2) + F.logsigmoid(x), torch.sigmoid(-x)
    a = cfg.f_alpha_divergence_coef
    t = (a - 1.0) * x
    hi = _ALPHA_CLAMP.get(in_dtype, 80.0)
    e = torch.exp(torch.clamp(t, max=hi))
    return (e - 1.0) / (a - 1.0), torch.where(t <= hi, e, torch.zeros_like(e))


def _smoothed_logsigmoid(y, eps):
    """(-(1 - eps) log sig(y) - eps log sig(-y), its derivative)."""
    loss = -(1 - eps) * F.logsigmoid(y) - eps * F.logsigmoid(-y)
    return loss, -(1 - eps) * torch.sigmoid(-y) + eps * torch.sigmoid(y)


def _mean(x: Tensor) -> Tensor:
    """Mean over the pairs; 0 for none (sync-free)."""
    return x.sum() / max(x.numel(), 1)


def sequence_token_weights(
    mask: Tensor, average: bool = False, ld_alpha: float | None = None
) -> Tensor:
    """k [R, T] with seq_r = sum_t k_rt lp_rt: the mask (sums), mask / max(n, 1) (means), or
    LD-DPO's (TRL `ld_alpha`; rows [chosen; rejected]): 1 for the first min(n_c, n_r) mask tokens of
    each row of a pair, ld_alpha after them."""
    acc = acc_dtype(mask.dtype) if mask.is_floating_point() else torch.float32
    m = (mask != 0).to(acc)
    if ld_alpha is not None:
        if average:
            raise ValueError("ld_alpha: LD-DPO weights summed log-probs, not means")
        R = m.shape[0]
        if R % 2:
            raise ValueError(f"mask: ld_alpha needs [chosen; rejected] rows, got {R} rows")
        n = m.sum(-1)
        shared = torch.minimum(n[: R // 2], n[R // 2 :]).repeat(2)
        pos = m.cumsum(-1)
        tail = pos > shared.unsqueeze(-1)
        return m * torch.where(tail, torch.full_like(m, ld_alpha), torch.ones_like(m))
    if average:
        return m / m.sum(-1, keepdim=True).clamp(min=1.0)
    return m


def token_coefficients(
    d_seq: Tensor, token_weights: Tensor, d_chosen_sum: Tensor | None, mask: Tensor
) -> Tensor:
    """d L / d lp [R, T] for rows [chosen; rejected]: d_seq_r k_rt, plus the SFT term's
    d L / d P_b on the mask tokens of chosen row b. What a fused op multiplies into its
    logits-gradient tile (onehot - p) per token."""
    coef = d_seq.unsqueeze(-1) * token_weights
    if d_chosen_sum is not None:
        B = d_chosen_sum.shape[0]
        m = (mask[:B] != 0).to(coef.dtype)
        coef = torch.cat((coef[:B] + d_chosen_sum.unsqueeze(-1) * m, coef[B:]))
    return coef


# ---- paired ----


def _type_terms(cfg, t, c, r, x_c, x_r, n_c, n_r, in_dtype):
    """(l [B], d l / d c [B], d l / d r [B], extra metrics) of one paired type (not sft)."""
    beta, eps = cfg.beta, cfg.label_smoothing
    met = {}
    if t in ("sigmoid", "hinge", "exo_pair", "robust", "discopop", "ipo", "sigmoid_norm"):
        s_c, ds_c = _score(cfg, x_c, in_dtype)
        s_r, ds_r = _score(cfg, x_r, in_dtype)
        if t in ("ipo", "sigmoid_norm"):
            nc, nr = n_c.clamp(min=1.0), n_r.clamp(min=1.0)
            s_c, ds_c, s_r, ds_r = s_c / nc, ds_c / nc, s_r / nr, ds_r / nr
        if t == "ipo":
            u = s_c - s_r - 1.0 / (2.0 * beta)
            return u * u, 2 * u * ds_c, -2 * u * ds_r, met
        z = beta * (s_c - s_r)
        if t in ("sigmoid", "sigmoid_norm"):
            loss, g = -F.logsigmoid(z), -torch.sigmoid(-z)
        elif t == "hinge":
            loss, g = torch.relu(1 - z), -(z < 1).to(z.dtype)
        elif t == "exo_pair":
            qw, ql = torch.sigmoid(z), torch.sigmoid(-z)
            log_pw, log_pl = math.log1p(-eps), math.log(eps)
            loss = qw * (F.logsigmoid(z) - log_pw) + ql * (F.logsigmoid(-z) - log_pl)
            g = qw * ql * (z - log_pw + log_pl)
        elif t == "robust":
            # the flipped term enters with a minus (cDPO's unbiased estimate)
            loss = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
            g = (-(1 - eps) * torch.sigmoid(-z) - eps * torch.sigmoid(z)) / (1 - 2 * eps)
        else:  # discopop
            tau = cfg.discopop_tau
            mu = torch.sigmoid(z / tau)
            ez, ls = torch.exp(-z), F.logsigmoid(z)
            loss = -ls * (1 - mu) + ez * mu
            g = -torch.sigmoid(-z) * (1 - mu) - ez * mu + mu * (1 - mu) * (ez + ls) / tau
        return loss, g * beta * ds_c, -g * beta * ds_r, met
    a, b = beta * x_c, beta * x_r
    if t == "nca_pair":
        loss = -F.logsigmoid(a) - 0.5 * F.logsigmoid(-a) - 0.5 * F.logsigmoid(-b)
        return (
            loss,
            beta * (0.5 * torch.sigmoid(a) - torch.sigmoid(-a)),
            beta * 0.5 * torch.sigmoid(b),
            met,
        )
    if t == "bco_pair":
        loss = -F.logsigmoid(a) - F.logsigmoid(-b)
        return loss, -beta * torch.sigmoid(-a), beta * torch.sigmoid(b), met
    if t == "sppo_hard":
        u, v = x_c - 0.5 / beta, x_r + 0.5 / beta
        return u * u + v * v, 2 * u, 2 * v, met
    if t == "apo_zero":
        loss = 1 - torch.sigmoid(a) + torch.sigmoid(b)
        return loss, -beta * _sig_prime(a), beta * _sig_prime(b), met
    if t == "apo_down":
        y = beta * (x_c - x_r)
        loss = torch.sigmoid(a) + 1 - torch.sigmoid(y)
        return loss, beta * (_sig_prime(a) - _sig_prime(y)), beta * _sig_prime(y), met
    if t in ("aot", "aot_unpaired"):
        if t == "aot":
            lr_s, idx = torch.sort(c - r, dim=0)
            ref_s, _ = torch.sort((c - x_c) - (r - x_r), dim=0)
            delta = lr_s - ref_s
        else:
            sc, idx = torch.sort(x_c, dim=0)
            sr, idx_r = torch.sort(x_r, dim=0)
            delta = sc - sr
        loss, g = _smoothed_logsigmoid(beta * delta, eps)
        g = beta * g
        dc = torch.zeros_like(g).scatter_(0, idx, g)
        dr = -dc if t == "aot" else torch.zeros_like(g).scatter_(0, idx_r, -g)
        return loss, dc, dr, met
    if t == "orpo":
        # log(1 - e^c) as log(-expm1(c)): exact where e^c is close to 1
        o = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
        ls = F.logsigmoid(o)
        g = -beta * torch.sigmoid(-o)
        met["log_odds_ratio"] = _mean(ls)
        met["log_odds_chosen"] = _mean(o)
        return -beta * ls, g / (-torch.expm1(c)), -g / (-torch.expm1(r)), met
    if t in ("simpo", "cpo"):
        gamma = cfg.simpo_gamma if t == "simpo" else 0.0
        loss, g = _smoothed_logsigmoid(beta * (c - r) - gamma, eps)
        return loss, beta * g, -beta * g, met
    raise ValueError(f"loss_type: unknown {t!r}; expected one of {PAIRED_TYPES}")


def paired_loss(
    cfg: PreferenceConfig,
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    n_chosen: Tensor | None = None,
    n_rejected: Tensor | None = None,
    chosen_sum: Tensor | None = None,
    weights: Tensor | None = None,
    num_pairs: int | Tensor | None = None,
    num_chosen_tokens: Tensor | None = None,
) -> PairResult:
    """The loss of B pairs from their sequence log-probs, its derivatives and the peers' metrics.

    chosen, rejected: [B] sequence log-probs as the loss sees them; ref_*: [B] or None (no
    reference: log-ratios are the log-probs, as Liger's use_ref_model=False); n_*: [B] token
    counts (ipo, sigmoid_norm, sft; default 1); chosen_sum: [B] plain sums of the chosen token
    log-probs (sft; default: chosen); weights: [B] detached per-pair weights (WPO: the product of
    the two rows' `wpo_weights`).

    A block of the batch: num_pairs (the batch's pair count, the mean's denominator) and
    num_chosen_tokens (the batch's chosen token count, sft's) make its loss and derivatives the
    block's share of the batch's; without them the call is the whole batch. Types of
    stat_scope "batch" need the whole batch in one call."""
    acc = acc_dtype(chosen.dtype)
    in_dtype = chosen.dtype
    c, r = chosen.detach().to(acc), rejected.detach().to(acc)
    if ref_chosen is not None:
        x_c, x_r = c - ref_chosen.detach().to(acc), r - ref_rejected.detach().to(acc)
    else:
        x_c, x_r = c, r
    one = torch.ones_like(c)
    n_c = one if n_chosen is None else n_chosen.detach().to(acc)
    n_r = one if n_rejected is None else n_rejected.detach().to(acc)
    w = None if weights is None else weights.detach().to(acc)
    B = c.shape[0]
    Bg = max(B, 1) if num_pairs is None else num_pairs
    total = torch.zeros((), dtype=acc, device=c.device)
    d_c, d_r = torch.zeros_like(c), torch.zeros_like(c)
    d_sum = None
    metrics: dict[str, Tensor] = {}
    for t, lam in zip(cfg.loss_types, cfg.weights):
        if t == "sft":
            P = c if chosen_sum is None else chosen_sum.detach().to(acc)
            N = n_c.sum() if num_chosen_tokens is None else num_chosen_tokens.to(acc)
            inv = torch.where(N > 0, 1.0 / torch.where(N > 0, N, 1.0), 0.0)
            nll = -P.sum() * inv
            scale = 1.0 if w is None else _mean(w)  # TRL: mean_b(w_b nll)
            total = total + lam * scale * nll
            d_sum = (-lam * scale * inv).expand(B) + (0.0 if d_sum is None else d_sum)
            metrics["nll_loss"] = nll
            continue
        term, gc, gr, met = _type_terms(cfg, t, c, r, x_c, x_r, n_c, n_r, in_dtype)
        metrics.update(met)
        if w is not None:
            term, gc, gr = term * w, gc * w, gr * w
        total = total + lam * term.sum() / Bg
        d_c = d_c + gc * (lam / Bg)
        d_r = d_r + gr * (lam / Bg)
    # the rewards peers report: beta times the log-ratio (the log-prob without a reference)
    cr, rr = cfg.beta * x_c, cfg.beta * x_r
    metrics.update(
        {
            "chosen_rewards": cr,
            "rejected_rewards": rr,
            "rewards/chosen": _mean(cr),
            "rewards/rejected": _mean(rr),
            "rewards/accuracies": _mean((cr > rr).to(acc)),
            "rewards/margins": _mean(cr - rr),
            "logps/chosen": _mean(c),
            "logps/rejected": _mean(r),
        }
    )
    return PairResult(total, d_c, d_r, d_sum, metrics)


def wpo_weights(logps: Tensor, log_sum_sq_probs: Tensor, mask: Tensor) -> Tensor:
    """TRL's `use_weighting` (WPO) weight of each row [R]: exp(mean over the mask of
    (lp_t - log sum_v p_v^2)), detached; a pair's weight is the product of its two rows'."""
    acc = acc_dtype(logps.dtype)
    m = (mask != 0).to(acc)
    a = ((logps.detach().to(acc) - log_sum_sq_probs.detach().to(acc)) * m).sum(-1)
    return torch.exp(a / m.sum(-1).clamp(min=1.0))
