"""The preference losses' options as a typed configuration (`PreferenceLossConfig`: the loss
types, their weights and options), checked once when made; the machinery in config.py."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_bool, check_float, check_str
from . import preference_math as prm
from . import preference_unpaired as prpu
from .config import _set, listed


@listed
@dataclass(frozen=True)
class PreferenceLossConfig:
    """A preference loss: its types (summed with their weights) and their options (formulas:
    docs/ppo-math.md "Preference losses", losses/preference_math.py).

    Args:
        loss_type: one type or several (a tuple, a list or a comma-separated string), summed
            with `loss_weights`: TRL's paired "sigmoid" (DPO), "hinge", "ipo", "exo_pair",
            "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero",
            "apo_down", "discopop", "sft" (the NLL of the chosen rows), "sigmoid_norm"; Liger's
            reference-free "orpo", "simpo", "cpo"; or one unpaired type, "kto" or
            "apo_zero_unpaired" (rows flagged desirable or not). Default "sigmoid". Held as a
            tuple.
        loss_weights: one weight per type (TRL's MPO; ("sigmoid", "sft") with (1, alpha) is
            RPO and Liger's `compute_nll_loss`). Default None: 1 each.
        beta: the implicit reward's inverse temperature (ORPO: the odds-ratio term's weight).
            Default 0.1.
        label_smoothing: robust / exo_pair / aot / simpo / cpo's epsilon. Default 0.0.
        discopop_tau: discopop's modulation temperature. Default 0.05.
        f_divergence_type: TRL's f-DPO score: "reverse_kl", "forward_kl", "js_divergence" or
            "alpha_divergence". Default "reverse_kl".
        f_alpha_divergence_coef: alpha_divergence's alpha. Default 0.5.
        simpo_gamma: SimPO's target margin. Default 0.5.
        average_log_prob: sequence log-probs as means over the completion instead of sums.
            Default None: means for orpo / simpo (Liger's defaults), sums otherwise. Held
            resolved.
        ld_alpha: LD-DPO's weight of the tokens past the shorter completion of a pair (TRL).
            Default None: off.
        desirable_weight: KTO's weight of the desirable rows. Default 1.0.
        undesirable_weight: KTO's weight of the undesirable rows. Default 1.0.
    """

    loss_type: str | tuple[str, ...] = "sigmoid"
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    simpo_gamma: float = 0.5
    average_log_prob: bool | None = None
    ld_alpha: float | None = None
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self):
        t = self.loss_type
        if isinstance(t, str):
            t = tuple(s.strip() for s in t.split(","))
        elif isinstance(t, (tuple, list)) and all(isinstance(s, str) for s in t):
            t = tuple(t)
        else:
            raise TypeError(f"loss_type: expected a str or a sequence of str, got {t!r}")
        w = self.loss_weights
        if w is not None:
            if not isinstance(w, (tuple, list)):
                raise TypeError(f"loss_weights: expected a sequence of numbers, got {w!r}")
            w = tuple(check_float("loss_weights", x) for x in w)
        opts = {
            k: check_float(k, getattr(self, k))
            for k in ("beta", "label_smoothing", "discopop_tau", "f_alpha_divergence_coef",
                      "simpo_gamma", "desirable_weight", "undesirable_weight")
        }  # fmt: skip
        check_str("f_divergence_type", self.f_divergence_type)
        ld = check_float("ld_alpha", self.ld_alpha, nonneg=True, allow_none=True)
        known = prm.PAIRED_TYPES + prm.UNPAIRED_TYPES
        for x in t:
            if x not in known:
                raise ValueError(f"loss_type: unknown {x!r}; expected one of {known}")
        unpaired = [x for x in t if x in prm.UNPAIRED_TYPES]
        avg = self.average_log_prob
        if avg is None:
            avg = any(x in ("orpo", "simpo") for x in t)
        avg = check_bool("average_log_prob", avg)
        _set(self, loss_type=t, loss_weights=w, ld_alpha=ld, average_log_prob=avg, **opts)
        if unpaired:
            if len(t) != 1:
                raise ValueError(
                    f"loss_type: the unpaired {unpaired} cannot be combined with other types"
                )
            if w is not None and len(w) != 1:
                raise ValueError(f"loss_weights: expected 1 weight, got {len(w)}")
            if ld is not None:
                raise ValueError("ld_alpha: LD-DPO weights the tokens of a pair (paired types)")
            prpu.check_unpaired_config(self.unpaired_config())
        else:
            if ld is not None and avg:
                raise ValueError("ld_alpha: LD-DPO weights summed log-probs, not means")
            prm.check_config(self.paired_config(), has_reference=False)

    @property
    def unpaired(self) -> bool:
        """An unpaired type (KTO): rows flagged desirable or not, no pairs."""
        return self.loss_type[0] in prm.UNPAIRED_TYPES

    def paired_config(self):
        """The math's PreferenceConfig (paired types)."""
        return prm.PreferenceConfig(
            self.loss_type, self.loss_weights, self.beta, self.label_smoothing,
            self.discopop_tau, self.f_divergence_type, self.f_alpha_divergence_coef,
            self.simpo_gamma,
        )  # fmt: skip

    def unpaired_config(self):
        """The math's UnpairedConfig (kto, apo_zero_unpaired)."""
        w = 1.0 if self.loss_weights is None else self.loss_weights[0]
        return prpu.UnpairedConfig(
            self.loss_type[0], self.beta, w * self.desirable_weight, w * self.undesirable_weight
        )
