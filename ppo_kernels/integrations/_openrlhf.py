"""OpenRLHF adapter: openrlhf.models.utils, openrlhf.models.loss (PolicyLoss / ValueLoss) and the
experience maker's GAE / returns on ppo_kernels ops. Semantics read from OpenRLHF 0.11.2."""

from __future__ import annotations

import contextlib
import math
import numbers
import sys

import torch

import ppo_kernels as pk

from ._args import (
    NO_IGNORE,
    entropy,
    is_binary_mask,
    labels_arg,
    logits_arg,
    need,
    out_dtype,
    same_shape,
    tensor,
)
from ._fused import FusedPair, call, swapped
from ._hidden import HeadCapture, lm_head
from ._patch import Noted, Passthrough, Peer, Target, Unfused

UTILS = "openrlhf.models.utils"
LOSS = "openrlhf.models.loss"
EXP = "openrlhf.trainer.ppo_utils.experience_maker"
ACTOR = "openrlhf.models.actor"


def compute_approx_kl(a, orig, o):
    lp, base = tensor(a["log_probs"], "log_probs"), tensor(a["log_probs_base"], "log_probs_base")
    same_shape(lp, base, "log_probs_base")
    est = a["kl_estimator"]
    need(est in ("k1", "k2", "k3"), "kl_estimator", f"unknown estimator {est!r}")
    old = a["log_probs_old"]
    if not a["unbiased_gradient"]:
        kl = pk.kl_penalty(lp, base, est, clamp="openrlhf")
    else:
        if old is not None:
            same_shape(lp, tensor(old, "log_probs_old"), "log_probs_old")
        kl = pk.kl_penalty(lp, base, est + "+", clamp="openrlhf", is_logprobs=old, is_clip=10.0)
    return o.out(kl, torch.float32)  # OpenRLHF computes in float32 whatever the input


def compute_reward(a, orig, o):
    kl = a["kl"]
    need(isinstance(kl, torch.Tensor), "kl", "a list of packed per-sample KLs")
    m = a["action_mask"]
    need(isinstance(m, torch.Tensor), "action_mask", "required")
    need(kl.dim() == 2, "kl", "expected [batch, response_length]")
    same_shape(kl, m, "action_mask")
    need(
        is_binary_mask(m), "action_mask", "a fractional mask (OpenRLHF thresholds it with .long())"
    )
    r = a["r"]
    need(
        isinstance(r, torch.Tensor) and r.shape == (kl.shape[0],), "r", "expected a [batch] tensor"
    )
    coef = a["kl_coef"]
    need(isinstance(coef, numbers.Real), "kl_coef", "expected a number")
    coef = max(float(coef), 0.0)
    if a["reward_clip_range"]:
        lo, hi = a["reward_clip_range"]
        r = r.clamp(min=lo, max=hi)
    rew, _, _ = pk.kl_penalized_rewards(r, None, None, m, beta=coef, kl=kl, convention="openrlhf")
    return o.out(rew, kl.dtype)


def log_probs_from_logits(a, orig, o):
    x = logits_arg(a)
    y = labels_arg(a, x)
    t = a["temperature"]
    need(isinstance(t, numbers.Real) and t > 0, "temperature", "expected a positive number")
    if t != 1.0:
        x.div_(t)  # OpenRLHF divides the caller's logits in place; callers may rely on it
    return o.out(pk.token_logprobs(x, y, ignore_index=NO_IGNORE), x.dtype)


def compute_entropy(a, orig, o):
    x = logits_arg(a)
    return o.out(entropy(x), x.dtype)


def masked_mean(a, orig, o):
    x, m = tensor(a["tensor"], "tensor"), a["mask"]
    need(m is not None, "mask", "None (a plain mean)")
    same_shape(x, tensor(m, "mask"), "mask")
    need(x.is_floating_point(), "tensor", "expected a float tensor")
    return o.out(pk.masked_mean(x, m, dim=a["dim"], empty="nan"), out_dtype(x, m))


def _agg(token_level, dp, n_tok, n_seq):
    """OpenRLHF's aggregate_loss: token-mean / seq-mean-token-mean; without the global total the
    local masked mean, where dp_size does not enter."""
    if token_level:
        return {
            "agg": "token-mean",
            "global_num_tokens": n_tok,
            "dp_size": int(dp) if n_tok is not None else 1,
        }
    return {
        "agg": "seq-mean-token-mean",
        "global_batch_size": n_seq,
        "dp_size": int(dp) if n_seq is not None else 1,
    }


# log-ratios beyond +-20 enter rollout_correction clamped (verl's SAFETY_BOUND): a ratio band
# inside [e^-20, e^20] makes that clamp invisible to the band test
_RATIO_BAND = (math.exp(-20.0), math.exp(20.0))


def _is_correction(self, lp, old, roll, m):
    """OpenRLHF's train / rollout IS correction of the ppo loss (is_correction_level token or
    seq, mode "mask", gating "ratio") on rollout_correction: per-token weights exp(old - rollout),
    zeroed where the token's ratio (token) or the row's geometric-mean ratio (seq) leaves
    [low, high]; the mask is unchanged (a dropped token still counts in the denominator).
    -> (weights, vllm_kl, is_filter_ratio)."""
    level, mode = self.is_correction_level, self.is_correction_mode
    need(
        self.is_correction_gating == "ratio",
        "is_correction_gating",
        f"{self.is_correction_gating!r}: the binary-KL / TV gates are not rollout_correction's "
        "estimators (k1 / k2 / k3 of the log-ratio)",
    )
    need(
        mode == "mask",
        "is_correction_mode",
        f"{mode!r}: clamping the weight from below too is not rollout_correction's truncation "
        "(TIS: from above)",
    )
    low, high = (float(x) for x in self.is_correction_threshold)
    need(
        _RATIO_BAND[0] < low <= high < _RATIO_BAND[1],
        "is_correction_threshold",
        f"({low}, {high}): expected e^-20 < low <= high < e^20",
    )
    need(is_binary_mask(m), "action_mask", "a fractional mask (it would scale the IS weights)")
    some = (m != 0).any()  # OpenRLHF's masked means of nothing are 0 / 0 = NaN, ours 0

    def nan_if_empty(x):
        return torch.where(some, x, torch.full_like(x, math.nan))

    if level == "token":  # IcePop: the weight where low <= ratio <= high, else 0
        rc = pk.rollout_correction(
            old, roll, m, rollout_is="token", rollout_is_threshold=(low, high)
        )
        oob = rc.metrics["rollout_is_oob_ratio"]
        return rc.weights, nan_if_empty(rc.metrics["kl"]), nan_if_empty(oob)
    # seq: rows whose mean log-ratio leaves [log low, log high] rejected by seq_mean_k1 (the mean
    # of -log-ratio within [log 1/high, log 1/low]); weights untruncated (bound above e^20)
    rc = pk.rollout_correction(
        old,
        roll,
        m,
        rollout_is="token",
        rollout_is_threshold=_RATIO_BAND[1] * 2,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=(f"{1.0 / high!r}_{1.0 / low!r}"),
    )
    kept = rc.mask != 0
    # OpenRLHF's fraction is over every row, a row with no action counting as filtered
    filtered = (~kept.any(-1)).float().mean()
    return rc.weights * kept, nan_if_empty(rc.metrics["kl"]), filtered


def policy_loss_forward(a, orig, o):
    """PolicyLoss.forward: "ppo" on the fused ppo_policy_loss (with the train / rollout IS
    correction as per-token weights), "gspo" on ppo_policy_loss's clipped loss at sequence level
    (the ratio of the row's mean log-ratio, gradient through the mean; against the rollout
    log-probs when is_correction_level is set, as OpenRLHF's)."""
    self = a["self"]
    kind = self.policy_loss_type
    need(kind in ("ppo", "gspo"), "policy_loss_type", f"{kind!r} (OpenRLHF: 'ppo' or 'gspo')")
    lp = tensor(a["log_probs"], "log_probs")
    m = a["action_mask"]
    need(m is not None, "action_mask", "None")
    for n in ("old_log_probs", "advantages", "action_mask"):
        same_shape(lp, tensor(a[n], n), n)
    old, adv = a["old_log_probs"], a["advantages"]
    lo, hi = self.clip_eps_low, self.clip_eps_high
    need(0 <= float(lo) < 1, "clip_eps_low", "expected a number in [0, 1)")
    corrected = self.is_correction_level != "off"
    roll = a["rollout_log_probs"]
    if corrected:
        need(
            self.is_correction_level in ("token", "seq"),
            "is_correction_level",
            f"{self.is_correction_level!r}",
        )
        same_shape(lp, tensor(roll, "rollout_log_probs"), "rollout_log_probs")
    agg = _agg(self.token_level_loss, a["dp_size"], a["batch_num_tokens"], a["global_batch_size"])
    dt = out_dtype(lp, adv)
    common = dict(
        clip_low=float(lo),
        clip_high=float(hi),
        dual_clip=self.dual_clip,
        empty="nan",
        empty_stats="nan",
        **agg,
    )
    if kind == "gspo":  # no IS weights: the ratio itself is against the rollout policy
        loss, st = pk.ppo_policy_loss(
            lp,
            roll if corrected else old,
            adv,
            m,
            loss_type="grpo",
            importance_sampling_level="sequence",
            **common,
        )
        ppo_kl = pk.masked_mean((old.detach() - lp.detach()).float(), m, empty="nan")
        return o.out(loss, dt), o.out(st["clip_frac"], torch.float32), o.out(ppo_kl, dt), None, None
    w = vllm_kl = filtered = None
    if corrected:
        w, vllm_kl, filtered = _is_correction(self, lp, old, roll, m)
    loss, st = pk.ppo_policy_loss(
        lp, old, adv, m, log_ratio_clamp=20.0, approx_kl="raw", weights=w, **common
    )
    return (
        o.out(loss, dt),
        o.out(st["clip_frac"], torch.float32),
        o.out(st["approx_kl"], dt),
        None if vllm_kl is None else o.out(vllm_kl, out_dtype(roll, old)),
        None if filtered is None else o.out(filtered, torch.float32),
    )


def value_loss_forward(a, orig, o):
    self = a["self"]
    v = tensor(a["values"], "values")
    m = a["action_mask"]
    need(m is not None, "action_mask", "None")
    for n in ("old_values", "returns", "action_mask"):
        same_shape(v, tensor(a[n], n), n)
    c = self.clip_eps
    need(c is None or float(c) > 0, "clip_eps", "expected None or a positive number")
    loss, _ = pk.ppo_value_loss(
        v,
        a["old_values"],
        a["returns"],
        m,
        clip=None if c is None else float(c),
        empty="nan",
        **_agg(self.token_level_loss, a["dp_size"], a["batch_num_tokens"], a["global_batch_size"]),
    )
    return o.out(loss, out_dtype(v, a["returns"]))


def _gamma(a, name):
    g = a[name]
    need(isinstance(g, numbers.Real), name, "expected a number")
    return float(g)


def get_advantages_and_returns(a, orig, o):
    v, r = tensor(a["values"], "values"), tensor(a["rewards"], "rewards")
    need(r.dim() == 2, "rewards", "expected [batch, response_length]")
    same_shape(r, v, "values")
    m = a["action_mask"]
    dt = out_dtype(v, r)
    if m is not None:  # OpenRLHF's semantics: masked steps are zero-reward, zero-value steps
        same_shape(r, tensor(m, "action_mask"), "action_mask")
        dt = out_dtype(v, r, m)
        v, r = m * v, m * r
    adv, ret = pk.gae(r, v, None, gamma=_gamma(a, "gamma"), lam=_gamma(a, "lambd"))
    return o.out(adv, dt), o.out(ret, dt)


def get_cumulative_returns(a, orig, o):
    r = tensor(a["rewards"], "rewards")
    need(r.dim() == 2, "rewards", "expected [batch, response_length]")
    m = a["action_mask"]
    if m is not None:
        same_shape(r, tensor(m, "action_mask"), "action_mask")
        r = m * r
    # discounted return-to-go = GAE with zero values and lambda = 1
    ret, _ = pk.gae(r, torch.zeros_like(r), None, gamma=_gamma(a, "gamma"), lam=1.0)
    return o.out(ret, a["rewards"].dtype)


def _logits_path(a, orig, o, self, mod, seq, packing):
    """Actor.forward with return_entropy on the model's logits: OpenRLHF calls compute_entropy
    then log_probs_from_logits on the same (float32, temperature-scaled) logits; here one
    token_logprobs pass gives both (FusedPair)."""
    pair = FusedPair(None if packing else torch.roll(seq, shifts=-1, dims=1))
    before = {n: getattr(mod, n) for n in ("compute_entropy", "log_probs_from_logits")}
    unpad_before = mod.unpad_and_slice_tensor

    def unpad_and_slice_tensor(*args, **kwargs):
        res = unpad_before(*args, **kwargs)
        pair.labels = res[2]  # (sequences, position_ids, rolled_sequences, pad_len, indices)
        return res

    def compute_entropy(logits):
        ent = pair.entropy(logits)
        return before["compute_entropy"](logits) if ent is None else o.out(ent, logits.dtype)

    def log_probs_from_logits(logits, labels, temperature=1.0):
        lp = pair.logprobs(logits, labels) if temperature == 1.0 else None
        if lp is None:
            return before["log_probs_from_logits"](logits, labels, temperature)
        return o.out(lp, logits.dtype)

    return pair.run(
        orig,
        a,
        (
            (mod, "unpad_and_slice_tensor", unpad_and_slice_tensor),
            (mod, "compute_entropy", compute_entropy),
            (mod, "log_probs_from_logits", log_probs_from_logits),
        ),
    )


def _hidden_path(a, orig, o, self, mod, seq, packing, head, softcap):
    """Actor.forward with log-probs asked for, from the hidden states: the model runs with its LM
    head keeping its input and returning logits with an empty vocabulary (HeadCapture), and
    OpenRLHF's compute_entropy / log_probs_from_logits on those run linear_token_logprobs (one
    pass for both); OpenRLHF's own code does the rest (labels, packing, slicing, the mask)."""
    t = self.temperature
    need(isinstance(t, numbers.Real) and t > 0, "temperature", "expected a positive number")
    cap = HeadCapture(
        self.model, head, softcap, float(t), None if packing else torch.roll(seq, -1, dims=1)
    )
    before = {n: getattr(mod, n) for n in ("compute_entropy", "log_probs_from_logits")}
    unpad_before = mod.unpad_and_slice_tensor

    def unpad_and_slice_tensor(*args, **kwargs):
        res = unpad_before(*args, **kwargs)
        cap.labels = res[2]
        return res

    def unexpected(logits):
        if isinstance(logits, torch.Tensor) and logits.shape[-1] == 0 and cap.hidden is not None:
            raise RuntimeError(
                "ppo_kernels.integrations (openrlhf): Actor.forward handed the LM head's "
                "placeholder logits to an unexpected call; apply('openrlhf') does not match "
                "this OpenRLHF's Actor.forward"
            )

    def compute_entropy(logits):
        ent = cap.entropy(logits)
        if ent is None:
            unexpected(logits)
            return before["compute_entropy"](logits)
        return o.out(ent, logits.dtype)

    def log_probs_from_logits(logits, labels, temperature=1.0):
        lp = cap.logprobs(logits, labels, temperature)
        if lp is None:
            unexpected(logits)
            return before["log_probs_from_logits"](logits, labels, temperature)
        return o.out(lp, logits.dtype)

    with cap.active():
        with contextlib.ExitStack() as stack:
            for name, fn in (
                ("unpad_and_slice_tensor", unpad_and_slice_tensor),
                ("compute_entropy", compute_entropy),
                ("log_probs_from_logits", log_probs_from_logits),
            ):
                stack.enter_context(swapped(mod, name, fn))
            out = call(orig, a)
    if cap.rerun:
        raise Unfused("model", cap.rerun + ": ran again with its own head (the logits path)", out)
    return out


def actor_forward(a, orig, o):
    """Actor.forward when log-probs are asked for (action_mask or return_logprobs): from the
    hidden states, the logits never built (`_hidden_path`; `output.logits` of return_output is
    then an empty [batch, seqlen, 0] tensor); a model whose LM head is not a plain Linear takes
    the logits path (`_logits_path` with return_entropy, else OpenRLHF's own calls)."""
    want_lp = a["action_mask"] is not None or a["return_logprobs"]
    if not want_lp:
        raise Passthrough(
            "no log-probs asked for: entropy only"
            if a["return_entropy"]
            else "no log-probs asked for: the logits are returned"
        )
    seq = tensor(a["sequences"], "sequences")
    need(seq.dim() == 2, "sequences", "expected [batch, seqlen]")
    self, mod = a["self"], sys.modules[ACTOR]
    packing = bool(getattr(self, "packing_samples", False))
    head, why = lm_head(self.model)
    if head is not None:
        return _hidden_path(a, orig, o, self, mod, seq, packing, head, why)
    if not a["return_entropy"]:
        raise Passthrough(f"log-probs only, from the logits (one pass already): {why}")
    return Noted(_logits_path(a, orig, o, self, mod, seq, packing), f"the logits path: {why}")


PEER = Peer(
    "openrlhf",
    "openrlhf",
    ("0.11.",),
    [
        Target(UTILS, "compute_approx_kl", compute_approx_kl),
        Target(UTILS, "compute_reward", compute_reward),
        Target(UTILS, "log_probs_from_logits", log_probs_from_logits),
        Target(UTILS, "compute_entropy", compute_entropy),
        Target(UTILS, "masked_mean", masked_mean),
        Target(LOSS, "PolicyLoss.forward", policy_loss_forward),
        Target(LOSS, "ValueLoss.forward", value_loss_forward),
        Target(EXP, "RemoteExperienceMaker.get_advantages_and_returns", get_advantages_and_returns),
        Target(EXP, "RemoteExperienceMaker.get_cumulative_returns", get_cumulative_returns),
        Target(ACTOR, "Actor.forward", actor_forward, optional=True),
    ],
)
