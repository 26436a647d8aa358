"""`rollout_correction`: importance weights, rejection masks and their metrics for the mismatch
between the rollout engine's log-probs and the training policy's, with verl's semantics
(`verl.trainer.ppo.rollout_corr_helper`), sync-free: every metric is a 0-dim tensor.

With lr = logprobs - rollout_logprobs per token (logprobs: the training policy's -- the old
policy's in verl's trainer, the current one, detached, in bypass mode), m the mask weight:
- IS weights, `rollout_is="token"`: raw_t = exp(clamp(lr_t, -20, 20)) m_t; `"sequence"`:
  raw_t = exp(clamp(sum_t m lr, -20, 20)) m_t. A single threshold U truncates (TIS:
  min(raw, U)); a pair (lower, upper) (verl's "lower_upper" string) zeroes the weights outside
  [lower, upper] (IcePop). `rollout_is_batch_normalize` divides by their mean (per token, or per
  sequence of row means) when that mean exceeds 1e-8. Weights never carry a gradient.
- Rejection, `rollout_rs` (comma-separated, every option must pass): with lrs = clamp(lr, -20, 20),
  k1 = -lrs, k2 = lrs^2 / 2, k3 = exp(lrs) - 1 - lrs; `token_kN` tests each token, `seq_sum_kN` /
  `seq_mean_kN` / `seq_max_kN` (k2, k3 only) the row's masked sum / mean / max, rejecting the whole
  row. k1 options keep log(lower) <= stat <= log(upper) (one number U means lower = 1 / U), the
  others stat <= U. The returned mask is mask * keep (mask's dtype).
- Metrics: verl's names, unprefixed (its unified helper adds "rollout_corr/"): the IS statistics
  (mean / max / min / std / effective sample size / fractions beyond the bounds / per-sequence
  summaries / oob ratio / batch-norm factor), per rejection option and in total the masked
  fractions and the statistic's summaries, and the off-policy diagnostics (kl, k3_kl, ppl,
  log-ppl differences, chi^2 at token and sequence level).

Differences from verl, all at degenerate inputs: an all-masked batch gives 0 metrics (verl raises);
an all-zero IcePop batch gives an effective sample size of inf (verl divides by zero in Python);
verl's masked means add 1e-8 to the token count (we divide exactly; where verl adds an explicit
1e-8 to a weight mean, we do too); under torch.distributed verl batch-normalises with an
all-reduced mean, we with the local one (pass the normalisation yourself across ranks).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_bool, check_same_device, check_tensor
from .._math import acc_dtype

_backend.register_op(
    "rollout_correction", kernel=None, triton=False, cuda_default="eager", folder="losses"
)

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class RolloutCorrection(NamedTuple):
    """The result of `rollout_correction`: a named tuple.

    Attributes:
        weights (Tensor | None): `[..., T]`, float32 (float64 for float64 input). The detached
            importance weights, 0 off the mask; None without `rollout_is`.
        mask (Tensor): `[..., T]`, the mask's dtype. The mask with rejected tokens set to 0.
        metrics (dict[str, Tensor]): 0-dim tensors under verl's metric names.
    """

    weights: Tensor | None  # [..., T] detached IS weights (0 off the mask); None without rollout_is
    mask: Tensor  # [..., T] the mask with rejected tokens set to 0 (mask's dtype)
    metrics: dict[str, Tensor]  # 0-dim tensors under verl's metric names


# --------------------------------------------------------------------------- argument parsing
def _number(name, s):
    try:
        v = float(s)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: invalid threshold {s!r}") from None
    if not (v > 0) or v == math.inf:
        raise ValueError(f"{name}: thresholds must be positive and finite, got {s!r}")
    return v


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """(upper, lower or None) from a number, "lower_upper" or (lower, upper)."""
    name = "rollout_is_threshold"
    if isinstance(spec, bool) or spec is None:
        raise TypeError(
            f"{name}: expected a number, a 'lower_upper' string or a pair, got {spec!r}"
        )
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"{name}: expected a pair (lower, upper), got {spec!r}")
        lower, upper = _number(name, spec[0]), _number(name, spec[1])
    elif isinstance(spec, str):
        s = spec.strip()
        if "_" in s:
            a, b = s.split("_", 1)
            lower, upper = _number(name, a), _number(name, b)
        else:
            lower, upper = None, _number(name, s)
    elif isinstance(spec, (int, float)):
        lower, upper = None, _number(name, spec)
    else:
        raise TypeError(
            f"{name}: expected a number, a 'lower_upper' string or a pair, got {spec!r}"
        )
    if lower is not None and lower > upper:
        raise ValueError(f"{name}: lower bound {lower} exceeds upper bound {upper}")
    return upper, lower


def parse_rs(options, thresholds) -> list[tuple[str, float | None, float]]:
    """[(option, lower or None, upper)] from verl's comma-separated strings (or sequences)."""
    if isinstance(options, str):
        opts = [o.strip() for o in options.split(",") if o.strip()]
    elif isinstance(options, (tuple, list)) and all(isinstance(o, str) for o in options):
        opts = [o.strip() for o in options]
    else:
        raise TypeError(f"rollout_rs: expected a comma-separated string, got {options!r}")
    if not opts:
        raise ValueError("rollout_rs: expected at least one option")
    for o in opts:
        if o not in RS_OPTIONS:
            raise ValueError(f"rollout_rs: unknown option {o!r}; expected some of {RS_OPTIONS}")
    opts = list(dict.fromkeys(opts))
    name = "rollout_rs_threshold"
    if thresholds is None:
        raise ValueError(f"{name}: required with rollout_rs")
    if isinstance(thresholds, bool):
        raise TypeError(f"{name}: expected a number or a string, got {thresholds!r}")
    if isinstance(thresholds, (int, float)):
        specs = [str(float(thresholds))]
    elif isinstance(thresholds, str):
        specs = [p.strip() for p in thresholds.split(",") if p.strip()]
    elif isinstance(thresholds, (tuple, list)):
        specs = [str(p) for p in thresholds]
    else:
        raise TypeError(f"{name}: expected a number or a string, got {thresholds!r}")
    if len(specs) not in (1, len(opts)):
        raise ValueError(f"{name}: expected 1 or {len(opts)} thresholds, got {len(specs)}")
    specs = specs * len(opts) if len(specs) == 1 else specs
    out = []
    for o, s in zip(opts, specs):
        if o.endswith("k1"):
            if "_" in s:
                a, b = s.split("_", 1)
                lower, upper = _number(name, a), _number(name, b)
            else:
                upper = _number(name, s)
                lower = 1.0 / upper
            if lower > upper:
                raise ValueError(f"{name}: lower bound {lower} exceeds upper bound for {o}")
        else:
            if "_" in s:
                raise ValueError(f"{name}: option {o} takes a single upper bound, got {s!r}")
            lower, upper = None, _number(name, s)
        out.append((o, lower, upper))
    return out


# --------------------------------------------------------------------------- the math
def _div(a, b):
    return torch.where(b != 0, a / torch.where(b != 0, b, 1.0), torch.zeros_like(a))


def _mmean(x, m, axis=None):
    return _div((x * m).sum(axis), m.sum(axis))


def _mmax(x, keep):
    neg = torch.full((), -math.inf, dtype=x.dtype, device=x.device)
    return torch.where(keep, x, neg).amax() if x.numel() else neg


def _mmin(x, keep):
    pos = torch.full((), math.inf, dtype=x.dtype, device=x.device)
    return torch.where(keep, x, pos).amin() if x.numel() else pos


def _row_summary(v, keep):
    """mean, unbiased std (0 for fewer than 2), max, min of v[keep] (v: [B]); 0 when empty."""
    cnt = keep.to(v.dtype).sum()
    mean = _div(torch.where(keep, v, 0.0).sum(), cnt)
    var = _div(torch.where(keep, (v - mean) ** 2, 0.0).sum(), cnt - 1)
    std = torch.where(cnt > 1, var.sqrt(), torch.zeros_like(var))
    some = cnt > 0
    zero = torch.zeros_like(mean)
    return (
        mean,
        std,
        torch.where(some, _mmax(v, keep), zero),
        torch.where(some, _mmin(v, keep), zero),
    )


def _clamped_std(x, m, lo, hi):
    s = x.clamp(lo, hi)
    mu = _mmean(s, m)
    sd = torch.sqrt(torch.clamp(_mmean(s * s, m) - mu * mu, min=0.0))
    return torch.where(m.sum() > 1, sd, torch.zeros_like(sd))


def importance_weights(lr, m, level, upper, lower, batch_normalize):
    """(weights, metrics) of verl's compute_rollout_correction_weights (see module docstring)."""
    keep = m != 0
    rows = m.shape[0]
    met: dict[str, Tensor] = {}
    lower_m = 1.0 / upper if lower is None else lower
    if level == "token":
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    else:
        lsum = (lr * m).sum(-1, keepdim=True)
        raw = torch.exp(lsum.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand(lr.shape) * m
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    met["rollout_is_mean"] = _mmean(w, m)
    if level == "sequence":
        if rows:
            met["rollout_is_max"] = torch.exp(lsum.amax().clamp(max=SAFETY_BOUND))
            met["rollout_is_min"] = torch.exp(lsum.amin())
            met["rollout_is_ratio_fraction_high"] = (lsum > math.log(upper)).to(lr.dtype).mean()
            met["rollout_is_ratio_fraction_low"] = (lsum < math.log(lower_m)).to(lr.dtype).mean()
        else:
            for k in ("max", "min", "ratio_fraction_high", "ratio_fraction_low"):
                met[f"rollout_is_{k}"] = torch.zeros((), dtype=lr.dtype, device=lr.device)
    else:
        met["rollout_is_ratio_fraction_high"] = _mmean((raw > upper).to(lr.dtype), m)
        met["rollout_is_ratio_fraction_low"] = _mmean((raw < lower_m).to(lr.dtype), m)
        met["rollout_is_max"] = _mmax(w, keep)
        met["rollout_is_min"] = _mmin(w, keep)
    met["rollout_is_std"] = _clamped_std(w, m, 0.0, upper)
    wfe = w.clamp(0.0, upper)
    norm = wfe / (_mmean(wfe, m) + 1e-8)
    met["rollout_is_eff_sample_size"] = 1.0 / _mmean(norm * norm, m)
    seq_w = _mmean(w, m, -1)
    every = torch.ones(rows, dtype=torch.bool, device=lr.device)
    mean, std, mx, mn = _row_summary(seq_w, every)
    met["rollout_is_seq_mean"], met["rollout_is_seq_std"] = mean, std
    met["rollout_is_seq_max"], met["rollout_is_seq_min"] = mx, mn
    dev = (seq_w - 1.0).abs()
    met["rollout_is_seq_max_deviation"] = dev.amax() if rows else torch.zeros_like(mean)
    raw_seq = _mmean(raw, m, -1)
    met["rollout_is_seq_fraction_high"] = _div((raw_seq > upper).to(lr.dtype).sum(), every.sum())
    met["rollout_is_seq_fraction_low"] = _div((raw_seq < lower_m).to(lr.dtype).sum(), every.sum())
    if lower is not None:
        oob = ((raw < lower) | (raw > upper)).to(lr.dtype)
        met["rollout_is_oob_ratio"] = _mmean(oob, m)
    if batch_normalize:
        if level == "token":
            mean_w = _mmean(w, m)
        else:
            sm = (m.sum(-1) > 0).to(lr.dtype)
            mean_w = (seq_w * sm).sum() / sm.sum().clamp(min=1e-8)
        ok = mean_w > 1e-8
        w = torch.where(ok, w / torch.where(ok, mean_w, 1.0), w)
        met["rollout_is_batch_norm_factor"] = torch.where(ok, mean_w, torch.ones_like(mean_w))
    return w, met


def rejection_keep(lr, m, specs):
    """(keep [B, T] float, metrics) of verl's compute_rollout_rejection_mask."""
    met: dict[str, Tensor] = {}
    keep_b = m != 0
    seq_valid = m.sum(-1) > 0
    lrs = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ks = {"k1": -lrs, "k2": 0.5 * lrs * lrs, "k3": torch.exp(lrs) - 1.0 - lrs}
    final = torch.ones_like(lr)
    for opt, lower, upper in specs:
        est = ks[opt[-2:]]
        k1 = opt.endswith("k1")
        up = math.log(upper) if k1 else upper
        lo = math.log(lower) if k1 else 0.0
        if opt.startswith("token"):
            stat, seq_stat = est, None
        else:
            if opt.startswith("seq_sum"):
                seq_stat = (est * m).sum(-1)
            elif opt.startswith("seq_mean"):
                seq_stat = _mmean(est, m, -1)
            else:
                mx = torch.where(keep_b, est, torch.full_like(est, -math.inf)).amax(-1)
                seq_stat = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
            stat = seq_stat.unsqueeze(-1).expand(lr.shape)
        ok = (stat >= lo) & (stat <= up) if k1 else stat <= up
        kf = ok.to(lr.dtype)
        final = final * kf
        p = f"rollout_rs_{opt}"
        seq_values = _mmean(stat, m, -1) if seq_stat is None else seq_stat
        met[f"{p}_mean"] = _mmean(stat, m)
        sv_mean, sv_std, sv_max, sv_min = _row_summary(seq_values, seq_valid)
        if seq_stat is not None:  # verl: the row values (there is a valid row when any token is)
            met[f"{p}_max"], met[f"{p}_min"] = sv_max, sv_min
            nv = seq_valid.to(lr.dtype).sum()
            fh = _div(((seq_values > up) & seq_valid).to(lr.dtype).sum(), nv)
            fl = _div(((seq_values < lo) & seq_valid).to(lr.dtype).sum(), nv)
        else:
            met[f"{p}_max"], met[f"{p}_min"] = _mmax(stat, keep_b), _mmin(stat, keep_b)
            fh = _mmean((stat > up).to(lr.dtype), m)
            fl = _mmean((stat < lo).to(lr.dtype), m)
        met[f"{p}_fraction_high"] = fh
        met[f"{p}_fraction_low"] = fl if k1 else torch.zeros_like(fh)
        met[f"{p}_std"] = _clamped_std(stat, m, lo, up)
        met[f"{p}_seq_mean"], met[f"{p}_seq_std"] = sv_mean, sv_std
        met[f"{p}_seq_max"], met[f"{p}_seq_min"] = sv_max, sv_min
        met[f"{p}_seq_max_deviation"] = _row_summary(seq_values.abs(), seq_valid)[2]
        nv = seq_valid.to(lr.dtype).sum()
        met[f"{p}_seq_fraction_high"] = _div(((seq_values > up) & seq_valid).to(lr.dtype).sum(), nv)
        if k1:
            met[f"{p}_seq_fraction_low"] = _div(
                ((seq_values < lo) & seq_valid).to(lr.dtype).sum(), nv
            )
        met[f"{p}_masked_fraction"] = _mmean(1 - kf, m)
        seq_keep = (ok | ~keep_b).all(-1)
        met[f"{p}_seq_masked_fraction"] = _div(((~seq_keep) & seq_valid).to(lr.dtype).sum(), nv)
    met["rollout_rs_masked_fraction"] = _mmean(1 - final, m)
    has_masked = (~((final > 0.5) & keep_b) & keep_b).any(-1)
    met["rollout_rs_seq_masked_fraction"] = (
        has_masked.to(lr.dtype).mean() if m.shape[0] else torch.zeros((), dtype=lr.dtype)
    )
    return final, met


def offpolicy_metrics(lp, roll, m):
    """verl's compute_offpolicy_metrics: training / rollout perplexities, KL estimates, chi^2."""
    rows = m.shape[0]
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)

    def rmean(x):
        return x.mean() if rows else zero

    out = {}
    mt = _mmean(lp, m, -1)
    out["training_ppl"] = rmean(torch.exp(-mt))
    out["training_log_ppl"] = rmean(-mt)
    out["kl"] = _mmean(roll - lp, m)
    lr = lp - roll
    out["k3_kl"] = _mmean(torch.exp(lr) - lr - 1, m)
    mr = _mmean(roll, m, -1)
    out["rollout_ppl"] = rmean(torch.exp(-mr))
    out["rollout_log_ppl"] = rmean(-mr)
    diff = mr - mt
    out["log_ppl_diff"] = rmean(diff)
    out["log_ppl_abs_diff"] = rmean(diff.abs())
    out["log_ppl_diff_max"] = diff.amax() if rows else zero
    out["log_ppl_diff_min"] = diff.amin() if rows else zero
    out["ppl_ratio"] = rmean(torch.exp(diff))
    rho = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    out["chi2_token"] = _mmean(rho * rho, m) - 1.0
    lsum = ((lr * m).sum(-1)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out["chi2_seq"] = rmean(torch.exp(2.0 * lsum)) - 1.0
    return out


def compute(lp, roll, m, rollout_is, is_spec, batch_normalize, rs_specs, offpolicy=True):
    """Everything on [B, T] accumulation-dtype tensors, zero off the mask: (weights, keep, metrics).
    The layer a fused op calls (it already has the rows)."""
    lr = lp - roll
    met: dict[str, Tensor] = {}
    w = None
    if rollout_is is not None and is_spec is not None:
        w, im = importance_weights(lr, m, rollout_is, *is_spec, batch_normalize)
        met.update(im)
    keep = None
    if rs_specs:
        keep, rm = rejection_keep(lr, m, rs_specs)
        met.update(rm)
    if offpolicy:
        met.update(offpolicy_metrics(lp, roll, m))
    return w, keep, met


# --------------------------------------------------------------------------- public API
def rollout_correction(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | tuple[float, float] | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    offpolicy_metrics: bool = True,
) -> RolloutCorrection:
    """Rollout-correction weights, rejection mask and metrics as verl's, with no host sync.

    With `lr = logprobs - rollout_logprobs` per token (clamped to +-20), the importance weights
    are `exp(lr)` per token, or `exp(sum of the row's lr)` per sequence. A threshold U truncates
    them (TIS); a pair (lower, upper) zeroes them outside the band (IcePop). Rejection tests the
    k1 / k2 / k3 statistics of lr per token or per row and zeroes rejected tokens in the mask.
    This is verl's `compute_rollout_correction_and_rejection_mask`.

    Args:
        logprobs (Tensor): `[..., T]`, float32 / bfloat16 / float16 / float64. The training
            policy's log-probs (verl's `old_log_prob`; the current policy's in bypass mode).
            Detached: nothing here carries a gradient.
        rollout_logprobs (Tensor): logprobs' shape, a float dtype. The rollout engine's log-probs.
        mask (Tensor): logprobs' shape, bool / integer / float. A float mask weights tokens.
        rollout_is (str, optional): the weights' level, "token" or "sequence". Default None: no
            weights.
        rollout_is_threshold (float | str | tuple, optional): U, or `(lower, upper)` / the string
            "lower_upper". None: no weights, as verl. Default 2.0.
        rollout_is_batch_normalize (bool): divide the weights by their mean over this batch
            (local, not all-reduced). Default False.
        rollout_rs (str, optional): rejection options, comma-separated; every one must pass:
            "token_k1", "token_k2", "token_k3", "seq_sum_kN", "seq_mean_kN", "seq_max_k2",
            "seq_max_k3". Default None: no rejection.
        rollout_rs_threshold (float | str, optional): one threshold for every option, or one per
            option (comma-separated). "lower_upper" for the k1 options. Required with rollout_rs.
            Default None.
        offpolicy_metrics (bool): add verl's off-policy diagnostics (kl, k3_kl, ppl, chi^2).
            Default True.

    Returns:
        RolloutCorrection: `(weights, mask, metrics)`. weights: logprobs' shape, float32 (float64
        for float64 input), 0 off the mask, or None without rollout_is. mask: the mask with
        rejected tokens set to 0, in mask's dtype. metrics: 0-dim tensors under verl's names.

    Why: verl's helper turns some metrics into Python numbers (host syncs); here every metric stays
    a 0-dim tensor on the device. The differences at degenerate inputs are listed in this
    module's docstring. `ppo_policy_loss` applies the same correction (its `rollout_config`).
    """
    for n, t in (("logprobs", logprobs), ("rollout_logprobs", rollout_logprobs)):
        check_tensor(n, t, dtypes=_VALUE_DTYPES, min_dim=1)
    check_tensor("mask", mask)
    for n, t in (("rollout_logprobs", rollout_logprobs), ("mask", mask)):
        if tuple(t.shape) != tuple(logprobs.shape):
            raise ValueError(
                f"{n}: expected shape {tuple(logprobs.shape)} (like logprobs), got {tuple(t.shape)}"
            )
    check_same_device(logprobs=logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    level, is_spec, rs_specs = check_options(
        rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold
    )
    batch_normalize = check_bool("rollout_is_batch_normalize", rollout_is_batch_normalize)
    offpolicy = check_bool("offpolicy_metrics", offpolicy_metrics)
    _backend.backend_for("rollout_correction", logprobs)  # eager; refuses another backend
    lp, roll, m = rows_of(logprobs, rollout_logprobs, mask)
    w, keep, met = compute(lp, roll, m, level, is_spec, batch_normalize, rs_specs, offpolicy)
    shape = logprobs.shape
    new_mask = mask if keep is None else (mask * keep.reshape(shape)).to(mask.dtype)
    return RolloutCorrection(None if w is None else w.reshape(shape), new_mask, met)


def check_options(rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold):
    """(level or None, (upper, lower) or None, rejection specs) from the public options."""
    if rollout_is is not None and rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is: expected None, 'token' or 'sequence', got {rollout_is!r}")
    is_spec = None
    if rollout_is is not None and rollout_is_threshold is not None:
        is_spec = parse_is_threshold(rollout_is_threshold)
    rs_specs = parse_rs(rollout_rs, rollout_rs_threshold) if rollout_rs is not None else []
    return rollout_is, is_spec, rs_specs


def rows_of(logprobs, rollout_logprobs, mask):
    """[B, T] detached accumulation-dtype rows, zero off the mask."""
    acc = acc_dtype(logprobs.dtype)
    T = logprobs.shape[-1]
    B = logprobs.shape[:-1].numel()
    m = mask.reshape(B, T).to(acc)
    keep = m != 0
    z = torch.zeros((), dtype=acc, device=logprobs.device)
    m = torch.where(keep, m, z)
    lp = torch.where(keep, logprobs.detach().reshape(B, T).to(acc), z)
    roll = torch.where(keep, rollout_logprobs.detach().reshape(B, T).to(acc), z)
    return lp, roll, m
