"""Every per-token computation of the trainer, through one switch (`--ops`):

- `fused`: the public ppo_kernels ops on their default backends (the C++ / CUDA kernels).
- `eager`: what trainers run today, which is also what the benchmarks in bench/ compare against.
  There is one copy of that code, in the ops' naive.py files: the LM head materialises the
  logits, then upcast, log_softmax, gather, and the entropy of the full distribution
  (`linear_logprobs/naive.eager_logprobs`); verl's GAE loop (`gae/naive.py`) and
  whitening (`masked_stats/naive.py`), its KL estimators and reward placement
  (`kl/naive.py`), its policy and value losses (`losses/naive.py`) and its per-group
  GRPO loop (`group_advantages/naive.py`). For an op whose baseline has no peer formula
  (masked_mean, RLOO, the pairwise losses) the op's own eager implementation runs, through
  `use_backend("eager")`.
  This file holds no math of its own.

`PPO_TRAINER_EAGER_OPS=gae,kl_penalty` (a debugging switch) runs the named ops eager in a fused
run; they are listed in `Ops.fallbacks` (summary.json), so a run always says what it ran.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

import ppo_kernels as pk
from ppo_kernels.distill import naive as distill_ref
from ppo_kernels.gae import naive as gae_ref
from ppo_kernels.group_advantages import naive as group_ref
from ppo_kernels.kl import naive as kl_ref
from ppo_kernels.linear_logprobs import naive as linear_ref
from ppo_kernels.losses import naive as loss_ref
from ppo_kernels.masked_stats import naive as stats_ref
from ppo_kernels.token_logprobs import naive as tl_ref


def _masked_labels(labels, ignore_index=-100):
    """Eager baselines take labels in [0, V): ignored positions gather id 0 and are zeroed after."""
    valid = labels != ignore_index
    return labels.masked_fill(~valid, 0), valid


def _zero_ignored(out, valid, return_entropy):
    if return_entropy:
        lp, ent = out
        return lp * valid, ent * valid
    return out * valid


class Ops:
    """The trainer calls only these methods; `mode` picks the fused ops or today's eager code."""

    def __init__(self, mode: str = "fused"):
        if mode not in ("fused", "eager"):
            raise ValueError(f"ops: expected 'fused' or 'eager', got {mode!r}")
        self.mode = mode
        self.forced_eager = {
            x.strip() for x in os.environ.get("PPO_TRAINER_EAGER_OPS", "").split(",") if x.strip()
        }
        self.fallbacks: set[str] = set()
        self.used: set[str] = set()

    def _fused(self, name: str) -> bool:
        """Whether op `name` runs fused here (and record what ran)."""
        if self.mode == "eager":
            return False
        if name in self.forced_eager:
            self.fallbacks.add(name)
            return False
        self.used.add(name)
        return True

    def runs_fused(self, name: str) -> bool:
        """Whether the fused path named `name` runs (recorded as `_fused` does): for a caller
        that picks between two compositions before computing anything."""
        return self._fused(name)

    def _op(self, name: str, *args, **kwargs):
        """The public op `name`: default backends when fused, its eager implementation otherwise."""
        fn = getattr(pk, name)
        if self._fused(name):
            return fn(*args, **kwargs)
        with pk.use_backend("eager"):
            return fn(*args, **kwargs)

    # -- log-probs ---------------------------------------------------------------------------
    def logprobs_from_hidden(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        *,
        temperature: float,
        return_entropy: bool,
    ):
        """Log-probs (and entropy) of `labels` under the LM head applied to `hidden`; labels
        -100 give 0."""
        if self._fused("linear_token_logprobs"):
            return pk.linear_token_logprobs(
                hidden,
                weight,
                labels,
                bias=bias,
                temperature=temperature,
                return_entropy=return_entropy,
            )
        safe, valid = _masked_labels(labels)
        out = linear_ref.eager_logprobs(hidden, weight, safe, bias, temperature, return_entropy)
        return _zero_ignored(out, valid, return_entropy)

    def logprobs_from_logits(
        self, logits: Tensor, labels: Tensor, *, temperature: float, return_entropy: bool
    ):
        if self._fused("token_logprobs"):
            return pk.token_logprobs(
                logits, labels, temperature=temperature, return_entropy=return_entropy
            )
        safe, valid = _masked_labels(labels)
        out = tl_ref.eager_logprobs(logits, safe, temperature, return_entropy)
        return _zero_ignored(out, valid, return_entropy)

    def policy_loss_from_hidden(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        temperature: float,
        clip_low: float,
        clip_high: float | None,
        dual_clip: float | None,
        ent_coef: float,
        kl_coef: float = 0.0,
        ref_logprobs: Tensor | None = None,
        kl_estimator: str = "k3",
    ):
        """The actor loss `ppo_policy_loss - ent_coef * mean(entropy) + kl_coef * mean(kl)`
        (token means over mask; verl's clamps) from the hidden states and the LM head in one
        `linear_policy_loss` pass, the logits computed once: (loss, stats with per-token
        `logprobs` / `entropy`). None where it does not run fused (eager mode, or named in
        PPO_TRAINER_EAGER_OPS): the caller composes the loss from the log-probs, as today."""
        if not self._fused("linear_policy_loss"):
            return None
        return pk.linear_policy_loss(
            hidden,
            weight,
            labels,
            advantages,
            old_logprobs,
            mask,
            bias=bias,
            ref_logprobs=ref_logprobs if kl_coef else None,
            loss_type="ppo",
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip,
            agg="token-mean",
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            kl_clamp="verl",
            entropy_coef=ent_coef,
            temperature=temperature,
        )

    def preference_loss_from_hidden(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        *,
        beta: float,
        ref_hidden: Tensor | None = None,
        ref_weight: Tensor | None = None,
        ref_bias: Tensor | None = None,
        ref_logps: Tensor | None = None,
    ):
        """The DPO (sigmoid) loss of pairs of completions `[2P, T]` (chosen rows first; labels
        -100 off the completion) from the hidden states and the LM head in one
        `linear_preference_loss` pass; the Reference as its head (`ref_hidden`, `ref_weight`:
        its tile beside the policy's, no gradient) or as sequence log-prob sums `ref_logps`.
        Fused only: the caller decides with `runs_fused("linear_preference_loss")`."""
        return pk.linear_preference_loss(
            hidden,
            weight,
            labels,
            bias=bias,
            ref_hidden=ref_hidden,
            ref_weight=ref_weight,
            ref_bias=ref_bias,
            ref_logps=ref_logps,
            loss_type="sigmoid",
            beta=beta,
        )

    def distill_loss_from_hidden(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        *,
        temperature: float,
    ) -> Tensor:
        """The token mean over `labels` (the sampled tokens; -100: not in the loss) of the
        full-vocabulary reverse KL(student || teacher) at `temperature`; the teacher gets no
        gradient. Fused: one `linear_distill_loss` pass with the teacher's tile beside the
        student's; eager: both logits materialised (`distill/naive.eager_linear_distill_loss`,
        its beta 1 being the reverse KL, without the hard-label term)."""
        args = (hidden, weight, labels, teacher_hidden, teacher_weight)
        terms = dict(temperature=temperature, weight_soft_loss=1.0, weight_hard_loss=0.0)
        if self._fused("linear_distill_loss"):
            return pk.linear_distill_loss(*args, divergence="reverse_kl", **terms)[0]
        return distill_ref.eager_linear_distill_loss(*args, beta=1.0, **terms)

    # -- advantages ---------------------------------------------------------------------------
    def masked_mean(self, x, mask):
        return self._op("masked_mean", x, mask)

    def masked_whiten(self, x, mask, process_group=None):
        # data-parallel statistics exist only in the op (the eager implementation is one-process)
        if process_group is not None or self._fused("masked_whiten"):
            return pk.masked_whiten(x, mask, process_group=process_group)
        return stats_ref.verl_masked_whiten(x, mask.float())

    def gae(self, rewards, values, mask, *, gamma, lam, bootstrap_value=None):
        if self._fused("gae"):
            return pk.gae(
                rewards, values, mask, gamma=gamma, lam=lam, bootstrap_value=bootstrap_value
            )
        return gae_ref.verl_gae_loop(rewards, values, mask.float(), gamma, lam, bootstrap_value)

    def kl_penalty(self, logprobs, ref_logprobs, estimator):
        if self._fused("kl_penalty"):
            return pk.kl_penalty(logprobs, ref_logprobs, estimator, clamp="verl")
        return kl_ref.eager_kl_penalty_verl(logprobs, ref_logprobs, estimator)

    def kl_penalized_rewards(self, scores, logprobs, ref_logprobs, mask, *, beta, estimator):
        if self._fused("kl_penalized_rewards"):
            return pk.kl_penalized_rewards(
                scores, logprobs, ref_logprobs, mask, beta=beta, estimator=estimator, clamp="verl"
            )
        return kl_ref.eager_kl_rewards(
            scores, logprobs, ref_logprobs, mask.float(), beta, estimator
        )

    def grpo_advantages(self, scores, group_size):
        if self._fused("grpo_advantages"):
            return pk.grpo_advantages(scores, group_size=group_size)
        index = torch.arange(scores.shape[0], device=scores.device) // group_size
        return group_ref.eager_grpo_verl_style(scores.float(), index)

    def rloo_advantages(self, scores, group_size):
        return self._op("rloo_advantages", scores, group_size=group_size)

    # -- losses -------------------------------------------------------------------------------
    def ppo_policy_loss(
        self, logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, dual_clip=None
    ):
        """(token-mean loss, {"clipfrac", "approx_kl"})."""
        if self._fused("ppo_policy_loss"):
            loss, st = pk.ppo_policy_loss(
                logprobs,
                old_logprobs,
                advantages,
                mask,
                clip_low=clip_low,
                clip_high=clip_high,
                dual_clip=dual_clip,
                agg="token-mean",
            )
        else:
            loss, st = loss_ref.eager_policy_loss_verl_style(
                logprobs,
                old_logprobs,
                advantages,
                mask.float(),
                clip_low,
                clip_high,
                dual_clip,
                "token-mean",
                sync=False,
            )
        return loss, {"clipfrac": st["clip_frac"], "approx_kl": st["approx_kl"]}

    def ppo_value_loss(self, values, old_values, returns, mask, *, clip):
        """(token-mean loss, {"vf_clipfrac"})."""
        if self._fused("ppo_value_loss"):
            loss, st = pk.ppo_value_loss(
                values, old_values, returns, mask, clip=clip, agg="token-mean"
            )
            return loss, {"vf_clipfrac": st["clip_frac"]}
        loss, clipfrac = loss_ref.eager_value_loss_verl_style(
            values, old_values, returns, mask.float(), clip
        )
        return loss, {"vf_clipfrac": clipfrac}

    def reward_model_head_loss(self, chosen_hidden, rejected_hidden, weight, bias):
        """(loss, chosen scores, rejected scores) straight from the scalar head; fused only
        (eager keeps the scores' path: `reward_model_loss`)."""
        return pk.reward_model_head_loss(chosen_hidden, rejected_hidden, weight, bias)

    def reward_model_loss(self, chosen, rejected):
        return self._op("reward_model_loss", chosen, rejected)

    def dpo_loss(self, pc, pr, rc, rr, *, beta):
        return self._op("dpo_loss", pc, pr, rc, rr, beta=beta)
