"""The policy losses' options as typed configurations: small frozen objects, each checked once
when it is made (a bad value is an error naming its field, which is also the flat keyword
argument's name).

- `PolicyLossConfig`: the loss type and its options (clip range, dual clip, ratio clamp,
  importance-sampling level, each type's own parameters).
- `AggregationConfig`: how per-token terms become the loss (`agg` and its normalisers).
- `RolloutCorrectionConfig`: importance weights and rejection between the rollout's log-probs
  and the trainer's.
- `KLTermConfig`, `EntropyTermConfig`: the KL penalty and the entropy bonus of the fused loss.

The preference and distillation losses' configurations are in preference_config.py and
distill_config.py, on the same machinery (`listed`, `make`, `takes_configs`).

Each field's name, default and meaning are written once, in its class. `ppo_policy_loss` and
`linear_policy_loss` take a configuration by keyword (`loss_config=`, ...) or its fields as flat
keyword arguments (`loss_type="grpo", clip_low=0.2`): `takes_configs` turns the flat form into
the configuration, so a changed default is one line of this module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import check_bool, check_float, check_int, check_str

# the policy-loss types: the clipped surrogate's first (a table the C++ routing shares)
from .._modes import AGG_MODES
from .._modes import CLIP_LOSS_TYPES as CLIP_TYPES

LOSS_TYPES = CLIP_TYPES + (
    "gspo",
    "sapo",
    "cispo",
    "gpg",
    "reinforce",
    "dro",
    "dppo_tv",
    "dppo_kl",
    "geo_mean",
    "clip_cov",
    "kl_cov",
)
# the types TRL / Liger run at importance_sampling_level="sequence" (GSPO as TRL writes it)
SEQUENCE_LEVEL_TYPES = CLIP_TYPES + ("sapo", "cispo")
_RATIO_CLIP_TYPES = CLIP_TYPES + ("gspo", "clip_cov")
_DUAL_CLIP_TYPES = CLIP_TYPES + ("dppo_tv", "dppo_kl")
# the log-ratio clamp each peer applies when log_ratio_clamp=None (inf: none)
_DEFAULT_LOG_RATIO_CLAMP = {
    "ppo": 20.0,
    "sapo": 20.0,
    "cispo": 20.0,
    "dppo_tv": 20.0,
    "dppo_kl": 20.0,
    "gspo": 10.0,  # one-sided, on the log sequence ratio
}

# each type's own options and their checks (check_float's keywords)
_OPTION_CHECKS = {
    "tau_pos": dict(positive=True),
    "tau_neg": dict(positive=True),
    "dro_beta": dict(positive=True, allow_none=True),
    "clip_cov_ratio": dict(positive=True),
    "clip_cov_lb": dict(finite=False),
    "clip_cov_ub": dict(finite=False),
    "kl_cov_ratio": dict(positive=True),
    "kl_cov_coef": {},
}


def default_log_ratio_clamp(loss_type: str) -> float:
    return _DEFAULT_LOG_RATIO_CLAMP.get(loss_type, math.inf)


CONFIGS: list[type] = []  # every configuration class, in the order its module defines it


def listed(cls):
    """Class decorator: the configuration class `cls` in CONFIGS (the tests and the reference
    docs read every configuration from there)."""
    CONFIGS.append(cls)
    return cls


def _set(obj, **values):
    """Resolved values on a frozen configuration (while it is being made)."""
    for k, v in values.items():
        object.__setattr__(obj, k, v)


@listed
@dataclass(frozen=True)
class PolicyLossConfig:
    """A policy-loss type and its options (formulas: docs/ppo-math.md, losses/policy_math.py).

    Args:
        loss_type: "ppo" (verl's clipped surrogate), TRL's / Liger's "grpo", "bnpo",
            "dr_grpo", "dapo", "luspo", and verl's "gspo", "sapo", "cispo", "gpg" (=
            "reinforce"), "dro", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov".
            Default "ppo".
        clip_low: the ratio's lower clip, 1 - clip_low (dppo: the divergence threshold for
            A < 0; geo_mean: the log-ratio's lower bound). Default 0.2.
        clip_high: the upper clip, 1 + clip_high. Default None: clip_low.
        dual_clip: the dual clip c > 1 for A < 0 (clipped types), or dppo's ratio truncation.
            Default None: off (dppo: 20).
        delta: TRL's two-sided clip, min(ratio, delta) in the unclipped branch (clipped types).
            Default None: off.
        log_ratio_clamp: clamp of the log-ratio before exp. Default None: the peer's clamp of
            the type (20 for ppo / sapo / cispo / dppo, 10 on gspo's log sequence ratio, none
            otherwise).
        importance_sampling_level: "token" or "sequence" (TRL's GSPO: the ratio of the row's
            mean log-ratio; clipped types, sapo, cispo). Default "token".
        tau_pos: sapo's temperature for A > 0. Default 1.0.
        tau_neg: sapo's temperature for A <= 0. Default 1.05.
        dro_beta: dro's quadratic penalty; required for "dro". Default None.
        clip_cov_ratio: clip_cov's share of tokens. Default 2e-4.
        clip_cov_lb: the lower end of clip_cov's covariance band. Default 1.0.
        clip_cov_ub: the upper end of clip_cov's covariance band. Default 5.0.
        kl_cov_ratio: kl_cov's share of tokens. Default 2e-4.
        kl_cov_coef: kl_cov's penalty coefficient. Default 0.1.

    Made once per distinct set of values and checked then; clip_high and log_ratio_clamp hold
    their resolved values afterwards.
    """

    loss_type: str = "ppo"
    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    delta: float | None = None
    log_ratio_clamp: float | None = None
    importance_sampling_level: str = "token"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: float | None = None
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 0.1

    def __post_init__(self):
        t = check_str("loss_type", self.loss_type, LOSS_TYPES)
        clip_low = check_float("clip_low", self.clip_low, nonneg=True)
        clip_high = self.clip_high
        clip_high = clip_low if clip_high is None else check_float("clip_high", clip_high)
        if t in _RATIO_CLIP_TYPES and not (clip_low < 1):
            raise ValueError(f"clip_low: expected a number in [0, 1), got {clip_low!r}")
        if t == "cispo":  # TRL's / Liger's upper-only bound: clip_low=1, clip_high=eps-1
            if not (clip_low <= 1):
                raise ValueError(
                    f"clip_low: expected a number in [0, 1] for cispo, got {clip_low!r}"
                )
            if not (clip_high > -1):
                raise ValueError(f"clip_high: expected a number > -1 for cispo, got {clip_high!r}")
        elif not (clip_high >= 0):
            raise ValueError(f"clip_high: expected a non-negative number, got {clip_high!r}")
        dual_clip = check_float("dual_clip", self.dual_clip, allow_none=True)
        if dual_clip is not None:
            if t not in _DUAL_CLIP_TYPES:
                raise ValueError(f"dual_clip: loss_type {t!r} has no dual clip / truncation")
            if t in CLIP_TYPES and not (dual_clip > 1):
                raise ValueError(f"dual_clip: expected None or a number > 1, got {dual_clip!r}")
            if not (dual_clip > 0):
                raise ValueError(f"dual_clip: expected a positive truncation, got {dual_clip!r}")
        delta = check_float("delta", self.delta, allow_none=True)
        if delta is not None:
            if t not in CLIP_TYPES:
                raise ValueError(f"delta: only the clipped types {CLIP_TYPES} take delta")
            if not (delta > 0):
                raise ValueError(f"delta: expected a positive number, got {delta!r}")
        lrc = self.log_ratio_clamp
        lrc = default_log_ratio_clamp(t) if lrc is None else lrc
        lrc = check_float("log_ratio_clamp", lrc, positive=True, finite=False)
        level = check_str(
            "importance_sampling_level", self.importance_sampling_level, ("token", "sequence")
        )
        if level == "sequence" and t not in SEQUENCE_LEVEL_TYPES:
            raise ValueError(
                f"importance_sampling_level: 'sequence' applies to {SEQUENCE_LEVEL_TYPES}, not "
                f"{t!r} (gspo and geo_mean are sequence-level by definition)"
            )
        opts = {k: check_float(k, getattr(self, k), **c) for k, c in _OPTION_CHECKS.items()}
        if t == "dro" and opts["dro_beta"] is None:
            raise ValueError("dro_beta: required (a positive number) for loss_type='dro'")
        if not (opts["kl_cov_ratio"] <= 1):
            raise ValueError(
                f"kl_cov_ratio: expected a fraction in (0, 1], got {opts['kl_cov_ratio']!r}"
            )
        _set(self, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta)
        _set(self, log_ratio_clamp=lrc, **opts)

    @property
    def sequence_level(self) -> bool:
        return self.importance_sampling_level == "sequence"


AGG_NAMES = AGG_MODES + ("token-sum",)  # verl's agg_loss modes and token-sum


def _denominator(name, value):
    """A data-parallel total: None, a number, or a one-element tensor (no host sync)."""
    if value is None or isinstance(value, Tensor):
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(f"{name}: expected a single value, got shape {tuple(value.shape)}")
        return value
    return check_float(name, value, nonneg=True)


@listed
@dataclass(frozen=True, eq=False)
class AggregationConfig:
    """How per-token terms become the loss (verl's `agg_loss`; formulas in `ppo_policy_loss`).

    Args:
        agg: "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
            "seq-mean-token-sum-norm" or "token-sum". Default None: the loss type's own
            (TRL's normalisations for its types, "token-mean" otherwise).
        dp_size: data-parallel world size the loss is scaled by, as verl does. Default 1.
        global_num_tokens: data-parallel total of action tokens (token modes), a number or a
            one-element tensor (no host sync). Required when dp_size > 1. Default None.
        global_batch_size: data-parallel total of non-empty sequences (sequence modes), as
            global_num_tokens. Default None.
        loss_scale_factor: seq-mean-token-sum-norm's divisor. Default None: T.

    Compared by identity (it may hold tensors).
    """

    agg: str | None = None
    dp_size: int = 1
    global_num_tokens: int | float | Tensor | None = None
    global_batch_size: int | float | Tensor | None = None
    loss_scale_factor: float | None = None

    def __post_init__(self):
        if self.agg is not None:
            check_str("agg", self.agg, AGG_NAMES)
        _set(self, dp_size=check_int("dp_size", self.dp_size, min_value=1))
        gnt = _denominator("global_num_tokens", self.global_num_tokens)
        gbs = _denominator("global_batch_size", self.global_batch_size)
        lsf = self.loss_scale_factor
        if lsf is not None:
            lsf = check_float("loss_scale_factor", lsf, positive=True)
        _set(self, global_num_tokens=gnt, global_batch_size=gbs, loss_scale_factor=lsf)


@listed
@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection between the rollout's log-probs and the trainer's
    (verl's rollout correction; `ppo_kernels.rollout_correction` documents each option).

    Args:
        rollout_is: None, "token" or "sequence": the importance weights' level. Default None.
        rollout_is_threshold: the weights' upper bound, or "lower_upper" / (lower, upper) to
            reject outside the band. Default 2.0.
        rollout_is_batch_normalize: weights divided by their masked batch mean. Default False.
        rollout_rs: None or comma-separated rejection criteria ("token_k1", "seq_mean_k3",
            ...). Default None.
        rollout_rs_threshold: their thresholds, one per criterion. Default None.
        bypass_mode: old_logprobs are the rollout's: weights and rejection from the current
            log-probs (detached). Default False.
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str | tuple[float, float] | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False

    def __post_init__(self):
        from .rollout_correction import check_options

        check_bool("bypass_mode", self.bypass_mode)
        check_bool("rollout_is_batch_normalize", self.rollout_is_batch_normalize)
        parsed = check_options(
            self.rollout_is, self.rollout_is_threshold, self.rollout_rs, self.rollout_rs_threshold
        )
        object.__setattr__(self, "parsed", parsed)  # (level, is_spec, rs_specs): not a field

    @property
    def active(self) -> bool:
        """Whether any correction is asked for."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


@listed
@dataclass(frozen=True)
class KLTermConfig:
    """The KL penalty `kl_coef * agg(kl)` of the fused policy loss.

    Args:
        kl_coef: its coefficient. Default 0.0 (no term).
        kl_estimator: the sampled estimator against ref_logprobs: "k1", "k2", "k3", "abs"
            or their aliases, "+" for straight-through (the k2 gradient). Default "k3".
        kl_clamp: "none", "verl", "openrlhf" or a `KLClamp`. Default None: no clamp.
    """

    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: object = None

    def __post_init__(self):
        from ..kl.naive import parse_estimator, resolve_clamp

        _set(self, kl_coef=check_float("kl_coef", self.kl_coef))
        est, _ = parse_estimator(self.kl_estimator)
        resolve_clamp(self.kl_clamp, est)


@listed
@dataclass(frozen=True)
class EntropyTermConfig:
    """The entropy bonus `- entropy_coef * agg(entropy)` of the fused policy loss.

    Args:
        entropy_coef: its coefficient. Default 0.0 (no term; the entropy is still reported).
    """

    entropy_coef: float = 0.0

    def __post_init__(self):
        _set(self, entropy_coef=check_float("entropy_coef", self.entropy_coef))


def fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


_MADE: dict = {}  # configurations made from flat arguments, per class and values


def make(cls, **values):
    """cls(**values), remembered per class and argument values *and types* (True and 1 are equal
    keys, only 1 is a number): a repeated call skips the checks. Never while tracing, never for
    unhashable values or tensors; a raising call is not remembered."""
    if torch.compiler.is_compiling():
        return cls(**values)
    key = (cls, tuple(values.items()), tuple(map(type, values.values())))
    try:
        hit = _MADE.get(key)
    except TypeError:  # an unhashable value (a list threshold, ...)
        return cls(**values)
    if hit is not None:
        return hit
    out = cls(**values)
    if len(_MADE) < 512 and not any(isinstance(v, Tensor) for v in values.values()):
        _MADE[key] = out
    return out


def takes_configs(**params: type):
    """Decorator: the function's keyword-only parameters `params` (name -> config class, each
    defaulting to None) are also reachable as their fields, flat keyword arguments: a call
    giving any field of a class gets that class made from them (`make`), a call giving none gets
    the class's defaults. Giving both the configuration and one of its fields is a TypeError. The
    function's signature (help(), inspect) lists the flat fields after its own parameters, with
    the defaults of the class."""

    owner: dict[str, str] = {}
    for pname, cls in params.items():
        for f in fields(cls):
            if f in owner:
                raise TypeError(f"takes_configs: field {f!r} in two configurations")
            owner[f] = pname
    defaults = {pname: cls() for pname, cls in params.items()}

    def wrap(fn):
        sig = inspect.signature(fn)
        for pname in params:
            p = sig.parameters.get(pname)
            if p is None or p.kind != p.KEYWORD_ONLY or p.default is not None:
                raise TypeError(f"{fn.__name__}: {pname} must be keyword-only with default None")
        extra = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
            for cls in params.values()
            for f in dataclasses.fields(cls)
        ]
        plain = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
        signature = sig.replace(parameters=plain + extra)

        made: dict = {}  # call spelling -> {parameter: configuration}, as make remembers one

        def configs_of(names: list, kwargs: dict) -> dict:
            """{parameter: configuration} of the flat fields `names` (popped from kwargs)."""
            flat = {k: kwargs.pop(k) for k in names}
            key = None
            if not torch.compiler.is_compiling():
                vals = tuple(flat.values())
                key = (tuple(names), vals, tuple(map(type, vals)))
                try:
                    hit = made.get(key)
                except TypeError:  # an unhashable value: made uncached (same errors)
                    key = hit = None
                if hit is not None:
                    return hit
            grouped: dict[str, dict] = {}
            for k, v in flat.items():
                grouped.setdefault(owner[k], {})[k] = v
            out = {p: make(params[p], **values) for p, values in grouped.items()}
            if key is not None and len(made) < 512:
                if not any(isinstance(v, Tensor) for v in flat.values()):
                    made[key] = out
            return out

        items = tuple(params.items())

        @functools.wraps(fn)
        def call(*args, **kwargs):
            names = [k for k in kwargs if k in owner]
            if not names:
                for pname, cls in items:
                    given = kwargs.get(pname)
                    if given is None:
                        kwargs[pname] = defaults[pname]
                    elif not isinstance(given, cls):
                        raise TypeError(
                            f"{pname}: expected a {cls.__name__}, got {type(given).__name__}"
                        )
                return fn(*args, **kwargs)
            built = configs_of(names, kwargs)
            for pname, cls in items:
                given = kwargs.get(pname)
                mine = built.get(pname)
                if given is None:
                    kwargs[pname] = defaults[pname] if mine is None else mine
                elif mine is not None:
                    values = sorted(k for k in names if owner[k] == pname)
                    raise TypeError(
                        f"{pname}: give either {pname}= or its fields {values}, not both"
                    )
                elif not isinstance(given, cls):
                    raise TypeError(
                        f"{pname}: expected a {cls.__name__}, got {type(given).__name__}"
                    )
            return fn(*args, **kwargs)

        call.__signature__ = signature
        call.config_params = dict(params)
        return call

    return wrap
