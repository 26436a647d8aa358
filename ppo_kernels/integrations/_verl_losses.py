"""verl's policy losses and rollout correction on ppo_kernels ops: every entry of
`core_algos.POLICY_LOSS_REGISTRY` (verl 0.9.1: vanilla, dppo_tv, dppo_kl, gspo, sapo, gpg,
clip_cov, kl_cov, geo_mean, dro, cispo, bypass_mode) on `ppo_policy_loss(loss_type=...)`, and
`rollout_corr_helper`'s weights / rejection / metrics functions on `rollout_correction`.

verl returns its metrics as Python floats (one `.item()` each); here they come from 0-dim tensors
in one host sync per call. Semantics read from verl 0.9.1's source; what differs is listed in the
README ("Use with verl / TRL / OpenRLHF").
"""

from __future__ import annotations

import numbers
import sys

import torch

import ppo_kernels as pk

from ._args import need, same_shape, tensor
from ._patch import Fallback

CORE = "verl.trainer.ppo.core_algos"
RCH = "verl.trainer.ppo.rollout_corr_helper"

# verl's agg_loss modes
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# verl's actor metric -> our statistic
_STAT = {
    "actor/pg_clipfrac": "clip_frac",
    "actor/ppo_kl": "approx_kl",
    "actor/pg_clipfrac_lower": "clip_frac_lower",
}
_THREE = tuple(_STAT)
_EMPTY_MASK = "response_mask must contain at least one valid token (1)."


def floats(values: dict, then=None) -> dict:
    """{name: 0-dim tensor} -> {name: float} in one host sync. `then`: an extra 0-dim bool tensor
    synced with them (returned as the second item; e.g. whether the mask has a valid token)."""
    names = list(values)
    ts = [values[k].detach().reshape(()).to(torch.float64) for k in names]
    if then is not None:
        ts.append(then.detach().reshape(()).to(torch.float64))
    if not ts:
        return {} if then is None else ({}, None)
    vals = torch.stack(ts).tolist()
    out = dict(zip(names, vals))
    return out if then is None else (out, bool(vals[-1]))


def _agg_kwargs(info):
    info = dict(info or {})
    unknown = set(info) - {"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"}
    need(not unknown, "config.global_batch_info", f"unknown keys {sorted(unknown)}")
    return {
        "dp_size": int(info.get("dp_size", 1) or 1),
        "global_num_tokens": info.get("batch_num_tokens"),
        "global_batch_size": info.get("global_batch_size"),
        "loss_scale_factor": info.get("loss_scale_factor"),
    }


def _inputs(a):
    """(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights) checked."""
    lp = tensor(a["log_prob"], "log_prob")
    for n in ("old_log_prob", "advantages", "response_mask"):
        same_shape(lp, tensor(a[n], n), n)
    need(lp.dim() >= 1 and lp.is_floating_point(), "log_prob", "expected a float tensor")
    w = a.get("rollout_is_weights")
    if w is not None:
        same_shape(lp, tensor(w, "rollout_is_weights"), "rollout_is_weights")
    return lp, a["old_log_prob"], a["advantages"], a["response_mask"], w


def _anything(v):
    return True


def _number(x, argument, ok, what):
    need(isinstance(x, numbers.Real) and not isinstance(x, bool) and ok(float(x)), argument, what)
    return float(x)


def _clip_range(cfg, lo_max=1.0):
    """verl's clip_ratio_low / _high (each defaulting to clip_ratio)."""
    clip = cfg.clip_ratio
    lo = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else clip
    hi = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else clip
    lo = _number(
        lo, "clip_ratio_low", lambda v: 0 <= v < lo_max, f"expected a number in [0, {lo_max})"
    )
    hi = _number(hi, "clip_ratio_high", lambda v: v >= 0, "expected a non-negative number")
    return {"clip_low": lo, "clip_high": hi}


def _policy_cfg(cfg, key, default):
    pl = getattr(cfg, "policy_loss", None)
    need(pl is not None, "config.policy_loss", "required (verl asserts it)")
    v = getattr(pl, key, None)
    return default if v is None else v


# per registry name: (our loss_type, its options from verl's config, the metrics verl returns)
def _vanilla(cfg):
    c = cfg.get("clip_ratio_c", 3.0)
    c = _number(c, "clip_ratio_c", lambda v: v > 1, "expected a number > 1 (verl asserts it)")
    return {**_clip_range(cfg), "dual_clip": c}


def _dppo(cfg):  # clip_ratio*: divergence thresholds; clip_ratio_c: the ratio's truncation
    c = _number(cfg.get("clip_ratio_c", 20.0), "clip_ratio_c", lambda v: v > 0, "expected > 0")
    return {**_clip_range(cfg, lo_max=float("inf")), "dual_clip": c}


def _sapo(cfg):
    return {
        "tau_pos": _number(cfg.tau_pos, "tau_pos", lambda v: v > 0, "expected > 0"),
        "tau_neg": _number(cfg.tau_neg, "tau_neg", lambda v: v > 0, "expected > 0"),
    }


def _clip_cov(cfg):
    return {
        **_clip_range(cfg),
        "clip_cov_ratio": _number(
            _policy_cfg(cfg, "clip_cov_ratio", 2e-4),
            "config.policy_loss.clip_cov_ratio",
            lambda v: v > 0,
            "expected > 0 (verl asserts it)",
        ),
        "clip_cov_lb": _number(
            _policy_cfg(cfg, "clip_cov_lb", 1.0), "config.policy_loss.clip_cov_lb", _anything, ""
        ),
        "clip_cov_ub": _number(
            _policy_cfg(cfg, "clip_cov_ub", 5.0), "config.policy_loss.clip_cov_ub", _anything, ""
        ),
    }


def _kl_cov(cfg):
    return {
        "kl_cov_ratio": _number(
            _policy_cfg(cfg, "kl_cov_ratio", 2e-4),
            "config.policy_loss.kl_cov_ratio",
            lambda v: 0 < v <= 1,
            "expected a fraction in (0, 1]",
        ),
        "kl_cov_coef": _number(
            _policy_cfg(cfg, "ppo_kl_coef", 1.0), "config.policy_loss.ppo_kl_coef", _anything, ""
        ),
    }


def _dro(cfg):
    beta = _policy_cfg(cfg, "dro_beta", None)
    need(
        beta is not None and float(beta) > 0,
        "config.policy_loss.dro_beta",
        "must be a positive value when using DRO (verl raises)",
    )
    return {"dro_beta": float(beta)}


REGISTRY = {
    "vanilla": ("ppo", _vanilla, _THREE),
    "dppo_tv": ("dppo_tv", _dppo, _THREE),
    "dppo_kl": ("dppo_kl", _dppo, _THREE),
    "gspo": ("gspo", _clip_range, _THREE),
    "sapo": ("sapo", _sapo, _THREE),
    "gpg": ("gpg", lambda cfg: {}, ()),
    "clip_cov": ("clip_cov", _clip_cov, _THREE[:2]),
    "kl_cov": ("kl_cov", _kl_cov, _THREE[1:2]),
    "geo_mean": ("geo_mean", _clip_range, _THREE),
    "dro": ("dro", _dro, _THREE[1:2]),
    "cispo": ("cispo", _clip_range, _THREE),
}
# the registry's functions, by name (verl 0.9.1)
FUNCTIONS = {
    "vanilla": "compute_policy_loss_vanilla",
    "dppo_tv": "compute_policy_loss_dppo_tv",
    "dppo_kl": "compute_policy_loss_dppo_kl",
    "gspo": "compute_policy_loss_gspo",
    "sapo": "compute_policy_loss_sapo",
    "gpg": "compute_policy_loss_gpg",
    "clip_cov": "compute_policy_loss_clip_cov",
    "kl_cov": "compute_policy_loss_kl_cov",
    "geo_mean": "compute_policy_loss_geo_mean",
    "dro": "compute_policy_loss_dro",
    "cispo": "compute_policy_loss_cispo",
    "bypass_mode": "compute_policy_loss_bypass_mode",
}


def _agg(name, mode, cfg):
    """(agg, aggregation keywords) as verl's function aggregates: sapo always by
    seq-mean-token-mean, geo_mean by a mean over the local rows whatever the mode."""
    need(isinstance(mode, str) and mode in AGG_MODES, "loss_agg_mode", f"unknown mode {mode!r}")
    if name == "geo_mean":
        return None, {}  # verl's geo_mean ignores loss_agg_mode and global_batch_info
    kw = _agg_kwargs(getattr(cfg, "global_batch_info", None))
    if name == "sapo":
        kw.pop("loss_scale_factor")  # its mode takes none
        return "seq-mean-token-mean", kw
    return mode, kw


def registry_loss(name, metrics=None):
    """The replacement of verl's registry function `name`: (loss, {metric: float})."""
    loss_type, options, default_metrics = REGISTRY[name]
    metrics = default_metrics if metrics is None else metrics

    def impl(a, orig, o):
        cfg = a["config"]
        need(cfg is not None, "config", "required (verl asserts it)")
        lp, old, adv, mask, w = _inputs(a)
        agg, agg_kw = _agg(name, a["loss_agg_mode"], cfg)
        loss, st = pk.ppo_policy_loss(
            lp,
            old,
            adv,
            mask,
            loss_type=loss_type,
            agg=agg,
            empty="nan",
            weights=w,
            **options(cfg),
            **agg_kw,
        )
        return o.out(loss, lp.dtype), floats({k: st[_STAT[k]] for k in metrics})

    impl.__name__ = f"policy_loss_{name}"
    return impl


def reinforce(a, orig, o):
    """compute_policy_loss_reinforce (bypass mode's "reinforce", not in the registry): gpg with
    the rollout IS weights, its ppo_kl against the rollout log-probs."""
    a = dict(a, old_log_prob=a["rollout_log_prob"])
    return registry_loss("gpg", metrics=_THREE[1:2])(a, orig, o)


def legacy_policy_loss(a, orig, o):
    """The pre-registry compute_policy_loss (cliprange arguments, no global batch info) ->
    (loss, clip_frac, ppo_kl, clip_frac_lower) as tensors."""
    lp, old, adv, mask, _ = _inputs(a)
    clip = a["cliprange"]
    lo = a["cliprange_low"] if a["cliprange_low"] is not None else clip
    hi = a["cliprange_high"] if a["cliprange_high"] is not None else clip
    mode = a["loss_agg_mode"]
    need(isinstance(mode, str) and mode in AGG_MODES, "loss_agg_mode", f"unknown mode {mode!r}")
    loss, st = pk.ppo_policy_loss(
        lp,
        old,
        adv,
        mask,
        clip_low=_number(lo, "cliprange_low", lambda v: 0 <= v < 1, "expected a number in [0, 1)"),
        clip_high=_number(hi, "cliprange_high", lambda v: v >= 0, "expected a number >= 0"),
        dual_clip=_number(a["clip_ratio_c"], "clip_ratio_c", lambda v: v > 1, "expected > 1"),
        agg=mode,
        log_ratio_clamp=20.0,
        empty="nan",
    )
    dt = lp.dtype
    return tuple(o.out(t, dt) for t in (loss, *(st[_STAT[k]] for k in _THREE)))


def _dist_normalised(rollout_is, batch_normalize):
    """verl batch-normalises the IS weights by an all-reduced mean under torch.distributed."""
    dist = torch.distributed
    need(
        not (
            rollout_is is not None
            and batch_normalize
            and dist.is_available()
            and dist.is_initialized()
        ),
        "rollout_is_batch_normalize",
        "under torch.distributed verl normalises by the mean over every rank (ours: the local "
        "mean)",
    )


def _rc_options(rc):
    """verl's RolloutCorrectionConfig -> rollout_correction's keywords."""
    return {
        "rollout_is": rc.get("rollout_is", None),
        "rollout_is_threshold": rc.get("rollout_is_threshold", 2.0),
        "rollout_is_batch_normalize": bool(rc.get("rollout_is_batch_normalize", False)),
        "rollout_rs": rc.get("rollout_rs", None),
        "rollout_rs_threshold": rc.get("rollout_rs_threshold", None),
    }


_RC_ARGS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
)


def _checked(fn, *args, **kw):
    """Our op, its option errors (raised before any computation) as a Fallback naming the option."""
    try:
        return fn(*args, **kw)
    except (TypeError, ValueError) as e:
        arg = str(e).split(":", 1)[0]
        raise Fallback(arg if arg in _RC_ARGS else "rollout options", str(e)) from None


def bypass_mode(a, orig, o):
    """compute_policy_loss_bypass_mode: old_log_prob are the rollout log-probs; IS weights and
    rejection from the current (detached) log-probs, then vanilla (ppo_clip: no weights) or
    REINFORCE (weights applied), with verl's rollout-correction metrics."""
    cfg = a["config"]
    need(cfg is not None, "config", "required (verl asserts it)")
    pl = getattr(cfg, "policy_loss", None)
    rc = pl.get("rollout_correction", None) if pl is not None else None
    need(rc is not None, "config.policy_loss.rollout_correction", "missing (verl raises)")
    kind = rc.get("loss_type", "ppo_clip")
    need(kind in ("ppo_clip", "reinforce"), "rollout_correction.loss_type", f"{kind!r}")
    lp, old, adv, mask, _ = _inputs(a)  # verl ignores rollout_is_weights here
    opts = _rc_options(rc)
    _dist_normalised(opts["rollout_is"], opts["rollout_is_batch_normalize"])
    agg, agg_kw = _agg("vanilla", a["loss_agg_mode"], cfg)
    typed = ("ppo", _vanilla(cfg), _THREE) if kind == "ppo_clip" else ("gpg", {}, _THREE[1:2])
    loss, st = _checked(
        pk.ppo_policy_loss,
        lp,
        old,
        adv,
        mask,
        loss_type=typed[0],
        agg=agg,
        empty="nan",
        bypass_mode=True,
        **typed[1],
        **opts,
        **agg_kw,
    )
    met = {k: st[_STAT[k]] for k in typed[2]}
    met.update({k: v for k, v in st.items() if k.startswith("rollout_corr/")})
    met, valid = floats(met, then=(mask != 0).any())
    if not valid:
        raise ValueError(_EMPTY_MASK)  # verl's rollout correction refuses an empty mask
    return o.out(loss, lp.dtype), met


# ------------------------------------------------------------------ rollout_corr_helper


def _rc_tensors(x, roll, mask, names):
    tensor(x, names[0])
    need(x.is_floating_point() and x.dim() >= 1, names[0], "expected a float tensor")
    if roll is not None:
        same_shape(x, tensor(roll, names[1]), names[1])
    same_shape(x, tensor(mask, names[2]), names[2])


def _valid(mask, metrics, prefix=""):
    """(metrics as floats with prefix, one sync), verl's error for a mask with no valid token."""
    out, valid = floats(metrics, then=(mask != 0).any())
    if not valid:
        raise ValueError(_EMPTY_MASK)
    return {prefix + k: v for k, v in out.items()}


def correction_and_rejection_mask(a, orig, o):
    """compute_rollout_correction_and_rejection_mask -> (DataProto of the IS weights or None, the
    mask with rejected tokens zeroed, {"rollout_corr/<metric>": float})."""
    old, roll, mask = a["old_log_prob"], a["rollout_log_prob"], a["response_mask"]
    _rc_tensors(old, roll, mask, ("old_log_prob", "rollout_log_prob", "response_mask"))
    opts = {k: a[k] for k in _RC_ARGS}
    opts["rollout_is_batch_normalize"] = bool(opts["rollout_is_batch_normalize"])
    _dist_normalised(opts["rollout_is"], opts["rollout_is_batch_normalize"])
    got = _checked(pk.rollout_correction, old, roll, mask, **opts)
    metrics = _valid(mask, got.metrics, "rollout_corr/")
    weights = None
    if got.weights is not None:
        w = o.out(got.weights, torch.promote_types(old.dtype, roll.dtype))
        weights = sys.modules[RCH].DataProto.from_dict(tensors={"rollout_is_weights": w})
    new_mask = got.mask.clone() if got.mask is mask else got.mask  # verl returns a new tensor
    return weights, new_mask, metrics


def correction_weights(a, orig, o):
    """compute_rollout_correction_weights(log_ratio, ...) -> (weights, {metric: float})."""
    lr, mask = a["log_ratio"], a["response_mask"]
    _rc_tensors(lr, None, mask, ("log_ratio", None, "response_mask"))
    level = a["rollout_is"]
    need(level in ("token", "sequence"), "rollout_is", f"{level!r} (verl raises)")
    bn = bool(a["rollout_is_batch_normalize"])
    _dist_normalised(level, bn)
    got = _checked(
        pk.rollout_correction,
        lr,
        torch.zeros_like(lr),  # logprobs - rollout_logprobs = the log-ratio, exactly
        mask,
        rollout_is=level,
        rollout_is_threshold=a["rollout_is_threshold"],
        rollout_is_batch_normalize=bn,
        offpolicy_metrics=False,
    )
    need(got.weights is not None, "rollout_is_threshold", "None")
    return o.out(got.weights, lr.dtype), _valid(mask, got.metrics)


def rejection_mask(a, orig, o):
    """compute_rollout_rejection_mask(log_ratio, ...) -> (mask, {metric: float})."""
    lr, mask = a["log_ratio"], a["response_mask"]
    _rc_tensors(lr, None, mask, ("log_ratio", None, "response_mask"))
    rs, th = a["rollout_rs"], a["rollout_rs_threshold"]
    need(isinstance(rs, str) and th is not None, "rollout_rs", "verl raises without both")
    if lr.shape[0] == 0:
        return mask, {}
    got = _checked(
        pk.rollout_correction,
        lr,
        torch.zeros_like(lr),
        mask,
        rollout_rs=rs,
        rollout_rs_threshold=th,
        offpolicy_metrics=False,
    )
    return got.mask, _valid(mask, got.metrics)


_TRAINING_ONLY = ("training_ppl", "training_log_ppl")


def _offpolicy(lp, roll, mask, names, prefix):
    _rc_tensors(lp, roll, mask, names)
    got = pk.rollout_correction(lp, lp if roll is None else roll, mask)
    met = got.metrics
    if roll is None:
        met = {k: met[k] for k in _TRAINING_ONLY}
    out, valid = floats(met, then=(mask != 0).any())
    if not valid:  # verl asserts it
        raise AssertionError("Expected at least one valid token in response_mask")
    return {prefix + k: v for k, v in out.items()}


def offpolicy_metrics(a, orig, o):
    """compute_offpolicy_metrics -> {metric: float} (training perplexity only without rollout)."""
    return _offpolicy(
        a["old_log_prob"],
        a["rollout_log_prob"],
        a["response_mask"],
        ("old_log_prob", "rollout_log_prob", "response_mask"),
        "",
    )


def metrics_from_logprobs(a, orig, o):
    """compute_rollout_corr_metrics_from_logprobs (the actor, per micro-batch) -> prefixed."""
    roll = tensor(a["rollout_log_prob"], "rollout_log_prob")
    return _offpolicy(
        a["log_prob"],
        roll,
        a["response_mask"],
        ("log_prob", "rollout_log_prob", "response_mask"),
        "rollout_corr/",
    )


def targets(Target, registries):
    """The Targets of this module: the registry (core_algos) and the helper (rollout_corr_helper,
    optional: it imports verl.protocol, which needs tensordict)."""
    core = [(FUNCTIONS[n], registry_loss(n)) for n in REGISTRY]
    core += [(FUNCTIONS["bypass_mode"], bypass_mode), ("compute_policy_loss_reinforce", reinforce)]
    rch = [
        ("compute_rollout_correction_and_rejection_mask", correction_and_rejection_mask),
        ("compute_rollout_correction_weights", correction_weights),
        ("compute_rollout_rejection_mask", rejection_mask),
        ("compute_offpolicy_metrics", offpolicy_metrics),
        ("compute_rollout_corr_metrics_from_logprobs", metrics_from_logprobs),
    ]
    return [Target(CORE, n, f, registries) for n, f in core] + [
        Target(RCH, n, f, optional=True) for n, f in rch
    ]
