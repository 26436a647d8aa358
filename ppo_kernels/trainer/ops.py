"""Every per-token computation of the trainer, as our fused op (`fused`) or plain eager PyTorch
(`eager`, written here from ../shared/ppo-math.md: what a user would write without ppo-kernels).

`Ops("fused")` uses the public ppo_kernels op where the package exports it; an op that has not
landed in this build falls back to the eager code and is listed in `Ops.fallbacks` (reported in
summary.json), so a run always says what it actually used.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

import ppo_kernels


# ----------------------------------------------------------------------------------------------
# Eager references (float32 math, like a peer's trainer)
# ----------------------------------------------------------------------------------------------
def eager_logprobs_from_hidden(hidden, weight, bias, labels, temperature, return_entropy,
                               ignore_index=-100):
    logits = F.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    if not return_entropy:
        return lp
    ent = -(logp.exp() * logp).sum(-1) * valid
    return lp, ent


def eager_masked_mean(x, mask, dim=None):
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def eager_masked_whiten(x, mask, shift_mean=True):
    """verl's convention: unbiased variance over mask = 1, `(x - mean) * rsqrt(var + 1e-8)`."""
    mean = eager_masked_mean(x, mask)
    n = mask.sum()
    var = (((x - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def eager_gae(rewards, values, mask, gamma, lam, bootstrap_value=None):
    """The reverse loop over time, skipping mask = 0 positions (verl's loop; see ppo-math.md).
    `bootstrap_value` [B]: V_next after the last action of each row (0 for terminated rows)."""
    B, T = rewards.shape
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    a_next = rewards.new_zeros(B)
    v_next = rewards.new_zeros(B) if bootstrap_value is None else bootstrap_value.float().clone()
    adv = torch.empty_like(rewards)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * v_next - values[:, t]
        a_t = delta + gamma * lam * a_next
        a_next = m * a_t + (1 - m) * a_next
        v_next = m * values[:, t] + (1 - m) * v_next
        adv[:, t] = a_next
    return adv, adv + values


def eager_kl_penalty(logprobs, ref_logprobs, estimator="k1"):
    """verl's convention (the trainer passes clamp="verl" to the fused op too)."""
    d = logprobs.float() - ref_logprobs.float()
    if estimator in ("k1", "kl"):
        return d
    if estimator == "abs":
        return d.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * d * d
    if estimator in ("k3", "low_var_kl"):
        x = (-d).clamp(-20, 20)  # verl's clamps
        return (x.exp() - x - 1).clamp(-10, 10)
    raise ValueError(f"kl estimator: unknown {estimator!r}")


def eager_kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, beta, estimator="k1"):
    mask = mask.float()
    kl = eager_kl_penalty(logprobs, ref_logprobs, estimator) * mask
    rewards = -beta * kl
    # the score goes on the last action position of each row
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, pos, -1).amax(1)
    has = last >= 0
    rewards[has.nonzero().squeeze(1), last[has]] += scores.float()[has]
    mean_kl = kl.sum(1) / mask.sum(1).clamp(min=1)
    return rewards, kl, mean_kl


def eager_ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high,
                          dual_clip=None):
    mask = mask.float()
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    stats = {"clipfrac": eager_masked_mean((pg2 > pg1).float(), mask),
             "approx_kl": eager_masked_mean(-log_ratio, mask)}
    return eager_masked_mean(loss, mask), stats


def eager_ppo_value_loss(values, old_values, returns, mask, clip):
    mask = mask.float()
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    stats = {"vf_clipfrac": eager_masked_mean((l2 > l1).float(), mask)}
    return 0.5 * eager_masked_mean(torch.maximum(l1, l2), mask), stats


def eager_grpo_advantages(scores, group_size, norm_by_std=True, eps=1e-6):
    g = scores.float().view(-1, group_size)
    a = g - g.mean(1, keepdim=True)
    if norm_by_std:
        a = a / (g.std(1, keepdim=True) + eps)
    return a.reshape(-1)


def eager_rloo_advantages(scores, group_size):
    g = scores.float().view(-1, group_size)
    return (g - (g.sum(1, keepdim=True) - g) / (group_size - 1)).reshape(-1)


def eager_reward_model_loss(chosen, rejected):
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def eager_dpo_loss(pc, pr, rc, rr, beta):
    return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()


# ----------------------------------------------------------------------------------------------
# The switch
# ----------------------------------------------------------------------------------------------
class Ops:
    """The trainer calls only these methods; `mode` picks fused ops or the eager references."""

    def __init__(self, mode: str = "fused"):
        if mode not in ("fused", "eager"):
            raise ValueError(f"ops: expected 'fused' or 'eager', got {mode!r}")
        self.mode = mode
        # debugging switch: ops named here run eager even in fused mode (reported as fallbacks)
        self.forced_eager = {x.strip() for x in
                             os.environ.get("PPO_TRAINER_EAGER_OPS", "").split(",") if x.strip()}
        self.fallbacks: set[str] = set()
        self.used: set[str] = set()

    def _fused(self, name: str):
        """The package's op, or None (eager mode, or the op is not in this build)."""
        if self.mode == "eager":
            return None
        fn = None if name in self.forced_eager else getattr(ppo_kernels, name, None)
        if fn is None:
            self.fallbacks.add(name)
        else:
            self.used.add(name)
        return fn

    # -- log-probs ---------------------------------------------------------------------------
    def logprobs_from_hidden(self, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                             labels: Tensor, *, temperature: float, return_entropy: bool):
        """Log-probs (and entropy) of `labels` under the LM head applied to `hidden`."""
        if self.mode == "fused":
            fn = self._fused("linear_token_logprobs")
            if fn is not None:
                return fn(hidden, weight, labels, bias=bias, temperature=temperature,
                          return_entropy=return_entropy)
            tl = self._fused("token_logprobs")
            if tl is not None:
                if "linear_token_logprobs" not in self.used:
                    self.fallbacks.add("linear_token_logprobs")
                return tl(F.linear(hidden, weight, bias), labels, temperature=temperature,
                          return_entropy=return_entropy)
        return eager_logprobs_from_hidden(hidden, weight, bias, labels, temperature,
                                          return_entropy)

    def logprobs_from_logits(self, logits: Tensor, labels: Tensor, *, temperature: float,
                             return_entropy: bool):
        fn = self._fused("token_logprobs")
        if fn is not None:
            return fn(logits, labels, temperature=temperature, return_entropy=return_entropy)
        valid = labels != -100
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
        return (lp, -(logp.exp() * logp).sum(-1) * valid) if return_entropy else lp

    # -- advantages ---------------------------------------------------------------------------
    def masked_mean(self, x, mask):
        fn = self._fused("masked_mean")
        return fn(x, mask) if fn is not None else eager_masked_mean(x, mask)

    def masked_whiten(self, x, mask):
        fn = self._fused("masked_whiten")
        return fn(x, mask) if fn is not None else eager_masked_whiten(x, mask)

    def gae(self, rewards, values, mask, *, gamma, lam, bootstrap_value=None):
        fn = self._fused("gae")
        if fn is not None:
            return fn(rewards, values, mask, gamma=gamma, lam=lam, bootstrap_value=bootstrap_value)
        return eager_gae(rewards, values, mask, gamma, lam, bootstrap_value)

    def kl_penalty(self, logprobs, ref_logprobs, estimator):
        fn = self._fused("kl_penalty")
        if fn is not None:
            return fn(logprobs, ref_logprobs, estimator, clamp="verl")
        return eager_kl_penalty(logprobs, ref_logprobs, estimator)

    def kl_penalized_rewards(self, scores, logprobs, ref_logprobs, mask, *, beta, estimator):
        fn = self._fused("kl_penalized_rewards")
        if fn is not None:
            return fn(scores, logprobs, ref_logprobs, mask, beta=beta, estimator=estimator,
                      clamp="verl")
        return eager_kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, beta, estimator)

    def grpo_advantages(self, scores, group_size):
        fn = self._fused("grpo_advantages")
        if fn is not None:
            return fn(scores, group_size=group_size)
        return eager_grpo_advantages(scores, group_size)

    def rloo_advantages(self, scores, group_size):
        fn = self._fused("rloo_advantages")
        if fn is not None:
            return fn(scores, group_size=group_size)
        return eager_rloo_advantages(scores, group_size)

    # -- losses -------------------------------------------------------------------------------
    def ppo_policy_loss(self, logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high,
                        dual_clip=None):
        fn = self._fused("ppo_policy_loss")
        if fn is not None:
            loss, stats = fn(logprobs, old_logprobs, advantages, mask, clip_low=clip_low,
                             clip_high=clip_high, dual_clip=dual_clip, agg="token-mean")
            return loss, {"clipfrac": stats["clip_frac"], "approx_kl": stats["approx_kl"]}
        return eager_ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low,
                                     clip_high, dual_clip)

    def ppo_value_loss(self, values, old_values, returns, mask, *, clip):
        fn = self._fused("ppo_value_loss")
        if fn is not None:
            loss, stats = fn(values, old_values, returns, mask, clip=clip, agg="token-mean")
            return loss, {"vf_clipfrac": stats["clip_frac"]}
        return eager_ppo_value_loss(values, old_values, returns, mask, clip)

    def reward_model_loss(self, chosen, rejected):
        fn = self._fused("reward_model_loss")
        if fn is not None:
            return fn(chosen, rejected)
        return eager_reward_model_loss(chosen, rejected)

    def dpo_loss(self, pc, pr, rc, rr, *, beta):
        fn = self._fused("dpo_loss")
        if fn is not None:
            return fn(pc, pr, rc, rr, beta=beta)
        return eager_dpo_loss(pc, pr, rc, rr, beta)
