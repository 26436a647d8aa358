"""The distillation loss's options as a typed configuration (`DistillLossConfig`: divergence,
its weights, temperature, the cached teacher's tail), checked once when made; the machinery in
config.py."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .._checks import FLOAT_DTYPES, check_float, check_str, check_temperature, check_tensor
from .config import _set, listed

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tv")  # = csrc/common/distill_host.h's
TOPK_TAILS = ("bucket", "renormalize")


@listed
@dataclass(frozen=True)
class DistillLossConfig:
    """The distillation loss between a student and a teacher (formulas: docs/ppo-math.md,
    "Distillation losses"; Liger's `LigerFusedLinearJSDLoss` defaults).

    Args:
        divergence: the per-token divergence over the whole vocabulary, p the student's and q
            the teacher's distribution: "forward_kl" KL(q || p), "reverse_kl" KL(p || q),
            "jsd" the generalised Jensen-Shannon divergence of weight `beta`, "tv" the total
            variation. Default "jsd".
        beta: jsd's weight of the teacher, in [0, 1]; as Liger and TRL, beta 0 is forward_kl
            and beta 1 reverse_kl. Ignored by the other divergences. Default 0.5.
        temperature: both heads' logits are divided by it before the divergence (the
            hard-label term and nothing else stays at temperature 1, as Liger's). A float, or a
            float tensor of per-row values (a leading part of labels.shape: per sequence or per
            token; values checked by the op), which `linear_distill_loss` applies per token
            under the sampler's distribution (its `top_k` / `top_p` / `min_p`). Default 1.0.
        weight_soft_loss: the divergence term's weight. Default 0.5.
        weight_hard_loss: the hard-label term's weight (the student's cross-entropy on the
            labels). Default 0.5.
        topk_tail: a cached teacher (top-k ids and log-probs): "bucket" adds the mass outside
            the top-k as one more entry of both distributions, "renormalize" renormalises both
            over the top-k. Default "bucket".

    A weight of 0 drops its term (an infinite value there does not make the loss NaN).
    """

    divergence: str = "jsd"
    beta: float = 0.5
    temperature: float | Tensor = 1.0
    weight_soft_loss: float = 0.5
    weight_hard_loss: float = 0.5
    topk_tail: str = "bucket"

    def __post_init__(self):
        check_str("divergence", self.divergence, DIVERGENCES)
        beta = check_float("beta", self.beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta: expected a value in [0, 1], got {beta!r}")
        t = self.temperature
        if isinstance(t, Tensor):
            check_tensor("temperature", t, dtypes=FLOAT_DTYPES)
        else:
            t = check_temperature(t)
        ws = check_float("weight_soft_loss", self.weight_soft_loss)
        wh = check_float("weight_hard_loss", self.weight_hard_loss)
        check_str("topk_tail", self.topk_tail, TOPK_TAILS)
        _set(self, beta=beta, temperature=t, weight_soft_loss=ws, weight_hard_loss=wh)
