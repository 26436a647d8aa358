"""verl adapter: verl.trainer.ppo.core_algos and verl.utils.torch_functional on ppo_kernels ops.

Semantics read from verl 0.9.1's source; what differs is listed in the README ("Use with verl / TRL /
OpenRLHF").
"""

from __future__ import annotations

import numbers
import sys

import numpy as np
import torch

import ppo_kernels as pk

from ..group_advantages.api import group_ids
from ._args import (
    NO_IGNORE,
    entropy,
    is_binary_mask,
    labels_arg,
    logits_arg,
    matmul_dtype,
    need,
    out_dtype,
    same_shape,
    softmax_dtype,
    temperature_arg,
    tensor,
)
from ._fused import FusedPair, call, swapped
from ._hidden import half_tiles, linear_logprobs
from ._patch import Fallback, Noted, Passthrough, Peer, Target
from ._verl_engine import SUM_P2, fsdp_model_inputs, fused_sum_p2_outputs
from ._verl_losses import AGG_MODES, legacy_policy_loss
from ._verl_losses import targets as loss_targets
from ._verl_sampling import STATE as SAMPLED
from ._verl_sampling import Truncated, configure, count_response, disable_adapter, for_engine
from ._verl_sampling import report_section as sampling_report

CORE = "verl.trainer.ppo.core_algos"
TF = "verl.utils.torch_functional"
FSDP = "verl.workers.engine.fsdp.transformer_impl"
EXP_TF = "verl.utils.experimental.torch_functional"
KERNEL = "verl.utils.kernel.linear_cross_entropy"
REGISTRIES = ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY")


def _labels(index, device):
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    return group_ids(np.asarray(index).reshape(-1), device)


# ------------------------------------------------------------------ advantage estimators


def gae(a, orig, o):
    r = tensor(a["token_level_rewards"], "token_level_rewards")
    v = tensor(a["values"], "values")
    m = tensor(a["response_mask"], "response_mask")
    need(r.dim() == 2, "token_level_rewards", "expected [batch, response_length]")
    same_shape(r, m, "response_mask")
    need(
        is_binary_mask(m),
        "response_mask",
        "a fractional mask: verl's recursion blends values by it",
    )
    gamma, lam = a["gamma"], a["lam"]
    for name, x in (("gamma", gamma), ("lam", lam)):
        need(
            isinstance(x, numbers.Real) or (isinstance(x, torch.Tensor) and x.numel() == 1),
            name,
            "expected a number",
        )
    gamma = float(gamma) if isinstance(gamma, torch.Tensor) else gamma
    lam = float(lam) if isinstance(lam, torch.Tensor) else lam
    adv, ret = pk.gae(r, v, m, gamma=gamma, lam=lam)
    with pk.strict_checks():  # verl raises on fewer than two action tokens; so do we (one sync)
        adv = pk.masked_whiten(adv, m)
    dt = out_dtype(r, v)
    return o.out(adv, dt), o.out(ret, dt)


def _outcome(a, kind, **kw):
    r = tensor(a["token_level_rewards"], "token_level_rewards")
    m = tensor(a["response_mask"], "response_mask")
    need(r.dim() == 2, "token_level_rewards", "expected [batch, response_length]")
    same_shape(r, m, "response_mask")
    idx = a["index"]
    need(idx is not None and len(idx) == r.shape[0], "index", "expected one group label per row")
    g = _labels(idx, r.device)
    scores = r.sum(dim=-1)
    if kind == "grpo":
        adv = pk.grpo_advantages(
            scores,
            g,
            eps=float(a["epsilon"]),
            norm_by_std=bool(a["norm_adv_by_std_in_grpo"]),
            mask=m,
        )
    else:
        adv = pk.rloo_advantages(scores, g, mask=m, **kw)
    return adv, scores.dtype


def grpo(a, orig, o):
    adv, dt = _outcome(a, "grpo")
    adv = o.out(adv, dt)
    return adv, adv


def rloo(a, orig, o):
    adv, dt = _outcome(a, "rloo", singleton="score")
    adv = o.out(adv, dt)
    return adv, adv


def rloo_vectorized(a, orig, o):
    adv, dt = _outcome(a, "rloo", singleton="zero")
    adv = o.out(adv, dt)
    return adv, adv


# ------------------------------------------------------------------ KL

_KL = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}


def kl_penalty(a, orig, o):
    est = a["kl_penalty"]
    need(isinstance(est, str), "kl_penalty", "expected an estimator name")
    lp, ref = tensor(a["logprob"], "logprob"), tensor(a["ref_logprob"], "ref_logprob")
    need(lp.shape == ref.shape, "ref_logprob", "shape differs from logprob")
    if est == "full":
        return o.out(_full_kl(lp, ref), out_dtype(lp, ref))
    need(est != "full+", "kl_penalty", "'full+': the straight-through k2 gradient is per token")
    need(est.rstrip("+") in _KL and est.count("+") <= 1, "kl_penalty", f"unknown estimator {est!r}")
    return o.out(pk.kl_penalty(lp, ref, est, clamp="verl"), out_dtype(lp, ref))


def _full_kl(logits, ref_logits):
    """kl_penalty="full" (verl raises NotImplementedError; its comment: both arguments hold the
    logits of every vocabulary token): KL(pi || pi_ref) per token with full_kl, for
    [batch, response_length, vocab] logits (or full log-probs: the same softmax). Per-token
    log-probs ([batch, response_length], what verl's own callers pass) cannot give it: a clear
    error saying what to pass, in strict and non-strict mode alike (verl's code only raises)."""
    if logits.dim() < 3 or not logits.is_floating_point():
        raise ValueError(
            "verl kl_penalty='full' (ppo_kernels.integrations): logprob and ref_logprob must be "
            "the logits (or full log-probs) of both policies over the whole vocabulary, shape "
            f"[batch, response_length, vocab]; got shape {tuple(logits.shape)}. Per-token "
            "log-probs cannot give the full KL: pass the logits where they are at hand (the "
            "actor / reference forward), call ppo_kernels.full_kl(logits, ref_logits) there "
            "(also for packed [tokens, vocab] logits), or choose a per-token estimator "
            "('k1', 'k2', 'k3', 'low_var_kl', 'abs', 'mse')"
        )
    return pk.full_kl(logits, ref_logits)


# ------------------------------------------------------------------ losses


def value_loss(a, orig, o):
    vp, ret, old = a["vpreds"], a["returns"], a["values"]
    for n, t in (("vpreds", vp), ("returns", ret), ("values", old)):
        tensor(t, n)
        same_shape(vp, t, n)
    m = tensor(a["response_mask"], "response_mask")
    same_shape(vp, m, "response_mask")
    c = a["cliprange_value"]
    need(isinstance(c, numbers.Real) and c > 0, "cliprange_value", "expected a positive number")
    mode = a["loss_agg_mode"]
    need(mode in AGG_MODES, "loss_agg_mode", f"unknown mode {mode!r}")
    loss, st = pk.ppo_value_loss(
        vp,
        old,
        ret,
        m,
        clip=float(c),
        agg=mode,
        dp_size=a["dp_size"],
        global_num_tokens=a["batch_num_tokens"],
        global_batch_size=a["global_batch_size"],
        loss_scale_factor=a["loss_scale_factor"],
        empty="nan",
    )
    return o.out(loss, vp.dtype), o.out(st["clip_frac"], vp.dtype)


def agg_loss(a, orig, o):
    x = tensor(a["loss_mat"], "loss_mat")
    m = tensor(a["loss_mask"], "loss_mask")
    same_shape(x, m, "loss_mask")
    mode = a["loss_agg_mode"]
    need(mode in AGG_MODES, "loss_agg_mode", f"unknown mode {mode!r}")
    need(x.dim() >= 1 and x.is_floating_point(), "loss_mat", "expected a float tensor")
    loss = pk.masked_aggregate(
        x,
        m,
        mode,
        dp_size=a["dp_size"],
        global_num_tokens=a["batch_num_tokens"],
        global_batch_size=a["global_batch_size"],
        loss_scale_factor=a["loss_scale_factor"],
        empty="nan",
    )
    return o.out(loss, x.dtype)


# ------------------------------------------------------------------ per-token log-probs


def logprobs_from_logits(a, orig, o):
    x = logits_arg(a)
    y = labels_arg(a, x)
    # never inplace_backward: verl's CPU path does not, and callers reuse the logits (entropy)
    lp = pk.token_logprobs(x, y, ignore_index=NO_IGNORE)
    return o.out(lp, softmax_dtype(x))


def entropy_from_logits(a, orig, o):
    x = logits_arg(a)
    return o.out(entropy(x), softmax_dtype(x))


def entropy_from_logits_chunked(a, orig, o):
    x = logits_arg(a)
    need(x.dim() == 2, "logits", "expected [tokens, vocab] (verl's chunked entropy)")
    return o.out(entropy(x), torch.float32)  # verl returns float32 whatever the input


def masked_mean(a, orig, o):
    x, m = tensor(a["values"], "values"), tensor(a["mask"], "mask")
    same_shape(x, m, "mask")
    need(x.is_floating_point(), "values", "expected a float tensor")
    return o.out(pk.masked_mean(x, m, dim=a["axis"]), x.dtype)


def masked_whiten(a, orig, o):
    x, m = tensor(a["values"], "values"), tensor(a["mask"], "mask")
    same_shape(x, m, "mask")
    need(x.is_floating_point(), "values", "expected a float tensor")
    with pk.strict_checks():  # verl raises for a mask total of 0 or 1 (it syncs; so do we, once)
        w = pk.masked_whiten(x, m, shift_mean=bool(a["shift_mean"]), unbiased=True, eps=1e-8)
    return o.out(w, x.dtype)


# ------------------------------------------------------------------ the actor forward (caller)


def fsdp_model_outputs(a, orig, o):
    """FSDPEngineWithLMHead.prepare_model_outputs (verl 0.9's actor and reference forward after
    the model): with remove-padding and entropy asked for, verl calls the engine's
    `compute_entropy_from_logits` then `logprobs_from_logits` on the same temperature-scaled
    logits; here one token_logprobs pass gives both. Everything else is verl's own code. With
    use_fused_kernels and calculate_sum_pi_squared (verl raises), the fused kernel's Σπ². With
    `apply(..., sampling=)`, the actor's outputs under the rollout's truncation."""
    self, mb = a["self"], a["micro_batch"]
    flag = sys.modules[FSDP].tu.get_non_tensor_data
    sampling = for_engine(self, o, count=True)
    if sampling is not None:
        return _sampled_outputs(a, orig, o, sampling)
    if flag(data=mb, key="use_fused_kernels", default=False):
        if flag(data=mb, key="calculate_sum_pi_squared", default=False):
            return fused_sum_p2_outputs(a, orig)
        raise Passthrough("use_fused_kernels: verl's fused kernels compute both from hidden states")
    if not flag(data=mb, key="calculate_entropy", default=False):
        raise Passthrough("calculate_entropy=False: log-probs only (one pass already)")
    if flag(data=mb, key="distillation_only", default=False):
        raise Passthrough("distillation_only: no log-probs")
    need(
        flag(data=mb, key="use_remove_padding", default=True),
        "use_remove_padding",
        "False: verl takes the entropy of the padded logits and the log-probs of the unpadded rows "
        "(two different tensors)",
    )
    cfg = self.engine_config
    need(
        not cfg.entropy_checkpointing,
        "engine_config.entropy_checkpointing",
        "verl recomputes the entropy under torch.utils.checkpoint, which the fused pass cannot "
        "share",
    )
    labels = a["output_args"].get("input_ids_rmpad_rolled")
    need(isinstance(labels, torch.Tensor), "output_args", "no 'input_ids_rmpad_rolled' tensor")
    pair = FusedPair(labels)
    chunked = bool(cfg.entropy_from_logits_with_chunking)
    ent_before, mod = self.compute_entropy_from_logits, sys.modules[FSDP]
    lp_before = mod.logprobs_from_logits

    def compute_entropy_from_logits(logits, *args, **kwargs):
        ent = pair.entropy(logits)
        if ent is None:
            return ent_before(logits, *args, **kwargs)
        return o.out(ent, torch.float32 if chunked else softmax_dtype(logits))  # chunked: float32

    def logprobs_from_logits(logits, labels, inplace_backward=True):
        lp = pair.logprobs(logits, labels)
        if lp is None:
            return lp_before(logits, labels, inplace_backward=inplace_backward)
        return o.out(lp, softmax_dtype(logits))

    return pair.run(
        orig,
        a,
        (
            (self, "compute_entropy_from_logits", compute_entropy_from_logits),
            (mod, "logprobs_from_logits", logprobs_from_logits),
        ),
    )


def _sampled_outputs(a, orig, o, sampling):
    """prepare_model_outputs for the actor under the rollout's truncation: with fused kernels,
    verl's own outputs of a fused forward whose patched kernel applied it (checked); on the
    logits path, verl's code with every entropy / log-prob / Σπ² of its logits on
    token_logprobs with the truncation. The response tokens that got -inf are counted."""
    self, mb = a["self"], a["micro_batch"]
    flag = sys.modules[FSDP].tu.get_non_tensor_data
    fused_lp = SAMPLED.take(getattr(a["output"], "log_probs", None))
    if flag(data=mb, key="distillation_only", default=False):
        raise Passthrough("distillation_only: no log-probs")
    if flag(data=mb, key="use_fused_kernels", default=False):
        need(
            fused_lp,
            "use_fused_kernels",
            "the fused forward's log-probs are not from a patched fused kernel that applied the "
            "rollout's truncation (asked by prepare_model_inputs)",
        )
        if flag(data=mb, key="calculate_sum_pi_squared", default=False):
            out = fused_sum_p2_outputs(a, orig).result
        else:
            out = call(orig, a)
    else:
        mod, tf = sys.modules[FSDP], sys.modules[TF]
        t = Truncated(sampling, a["output_args"].get("input_ids_rmpad_rolled"))
        with (
            swapped(self, "compute_entropy_from_logits", t.entropy),
            swapped(mod, "logprobs_from_logits", t.logprobs),
            swapped(tf, "entropy_from_logits", t.entropy),
            swapped(tf, "calculate_sum_pi_squared_from_logits", t.sum_p2),
        ):
            out = call(orig, a)
    count_response(o, out, mb)
    return Noted(out, "the rollout's truncation (top_k / top_p / min_p)")


# ------------------------------------------------------------------ use_fused_kernels (hidden states)


def _hidden_args(h, w, y, names):
    """hidden [..., H], weight [V, H], labels hidden.shape[:-1] (integer) or Fallback."""
    nh, nw, ny = names
    tensor(h, nh)
    tensor(w, nw)
    tensor(y, ny)
    need(h.dim() >= 1 and h.is_floating_point(), nh, "expected a float [..., hidden] tensor")
    need(w.dim() == 2 and w.shape[1] == h.shape[-1], nw, f"expected [vocab, {h.shape[-1]}]")
    need(not y.is_floating_point() and y.dtype != torch.bool, ny, f"dtype {y.dtype}")
    need(tuple(y.shape) == tuple(h.shape[:-1]), ny, "shape is not hidden_states.shape[:-1]")


def fused_linear_for_ppo(a, orig, o):
    """FusedLinearForPPO.forward (use_fused_kernels=True, backends "torch" and "liger": the fused
    forwards of verl.models.transformers call it with the last hidden states and lm_head.weight)
    -> (log_probs float32, entropy in the hidden states' dtype) on linear_token_logprobs. The "liger"
    backend (where liger-kernel imports) ignores labels -100, as Liger's kernel does (and takes a
    per-row temperature tensor, which Liger's kernel cannot); bf16 / fp16 logits tiles are rounded
    to that dtype, as verl's `hidden @ weight.T` rounds them. Σπ² kept where the engine asks."""
    self, h, w, y = a["self"], a["hidden_states"], a["vocab_weights"], a["input_ids"]
    _hidden_args(h, w, y, ("hidden_states", "vocab_weights", "input_ids"))
    need(h.dim() in (2, 3), "hidden_states", "expected [tokens, hidden] or [batch, tokens, hidden]")
    liger = self.impl_backend == "liger" and (
        sys.modules[EXP_TF]._LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY is not None
    )
    t, rows = temperature_arg(a["temperature"], tuple(y.shape))
    dt = matmul_dtype(h, w)
    out = linear_logprobs(
        h,
        w,
        y.long(),
        temperature=t,
        rows=rows,
        compute_dtype=dt,
        ignore_index=-100 if liger else NO_IGNORE,
        logits_dtype=half_tiles(dt),
        stats=SUM_P2.stats(),
        **SAMPLED.kwargs(),
    )
    lp = o.out(out[0], torch.float32)  # verl's output buffers' dtypes
    SUM_P2.keep(lp, out)
    SAMPLED.keep(lp)
    return lp, o.out(out[1], h.dtype)


def linear_cross_entropy(a, orig, o):
    """verl.utils.kernel.linear_cross_entropy (use_fused_kernels with the "triton" backend, and
    Megatron's fused forward with its tensor-parallel group) -> (log-probs, entropy), float32,
    flattened to [tokens] (the log-probs summed / averaged for reduction "sum" / "mean"), on
    linear_token_logprobs (float32 tiles, as verl's kernel accumulates them); a process group:
    this rank's vocabulary slice, the hidden gradient left to the caller's layers, as verl's. A
    per-row temperature tensor (verl asserts a float; the FSDP engine's lifted per-sample
    temperatures) is taken as FusedLinearForPPO takes it; Σπ² kept where the engine asks."""
    h, w, y = a["hidden"], a["weight"], a["labels"]
    tensor(h, "hidden")
    tensor(y, "labels")
    need(h.dim() >= 1 and y.numel() * h.shape[-1] == h.numel(), "labels", "one per hidden row")
    h2, y2 = h.reshape(-1, h.shape[-1]), y.reshape(-1)
    _hidden_args(h2, w, y2, ("hidden", "weight", "labels"))
    need(w.dtype == h.dtype, "weight", f"dtype {w.dtype} differs from the hidden's {h.dtype}")
    t, rows = temperature_arg(a["temperature"], tuple(y.shape))
    rows = None if rows is None else rows.reshape(-1)
    red = a["reduction"]
    need(
        isinstance(red, str) and red.lower() in ("none", "sum", "mean"),
        "reduction",
        f"{red!r} (verl: 'none', 'sum' or 'mean')",
    )
    pg, kw = a["dist_process_group"], SAMPLED.kwargs()
    need(
        pg is None or not kw,
        "dist_process_group",
        "the rollout's truncation needs whole vocabulary rows (not the vocab-parallel form)",
    )
    if pg is not None:
        import torch.distributed as dist

        kw = {
            "process_group": pg,
            "vocab_start": dist.get_rank(pg) * w.shape[0],  # verl's kernel: rank * its slice
            "reduce_hidden_grad": False,
        }
    lp, ent, *st = linear_logprobs(
        h2,
        w,
        y2.long(),
        temperature=t,
        rows=rows,
        compute_dtype=h.dtype,
        stats=SUM_P2.stats() if red.lower() == "none" else None,
        **kw,
    )
    if red.lower() == "sum":
        lp = lp.sum()
    elif red.lower() == "mean":
        lp = lp.mean()
    lp = o.out(lp, torch.float32)
    if st:  # kept with the log-probs the caller gets
        SUM_P2.keep(lp, st)
    SAMPLED.keep(lp)
    return lp, o.out(ent, torch.float32)


def _targets():
    core = [
        ("compute_gae_advantage_return", gae),
        ("compute_grpo_outcome_advantage", grpo),
        ("compute_grpo_vectorized_outcome_advantage", grpo),
        ("compute_rloo_outcome_advantage", rloo),
        ("compute_rloo_vectorized_outcome_advantage", rloo_vectorized),
        ("kl_penalty", kl_penalty),
        ("compute_policy_loss", legacy_policy_loss),
        ("compute_value_loss", value_loss),
        ("agg_loss", agg_loss),
    ]
    tf = [
        ("logprobs_from_logits", logprobs_from_logits),
        ("entropy_from_logits", entropy_from_logits),
        ("entropy_from_logits_with_chunking", entropy_from_logits_chunked),
        ("masked_mean", masked_mean),
        ("masked_whiten", masked_whiten),
    ]
    return (
        [Target(CORE, n, f, REGISTRIES) for n, f in core]
        + loss_targets(Target, REGISTRIES)
        + [Target(TF, n, f) for n, f in tf]
        + [
            # verl imports liger-kernel there unguarded, which needs triton (absent with a
            # CPU-only torch): then verl's fused-kernel path cannot run at all, nothing to patch
            Target(EXP_TF, "FusedLinearForPPO.forward", fused_linear_for_ppo, optional=True),
            Target(KERNEL, "linear_cross_entropy", linear_cross_entropy),
            Target(
                FSDP,
                "FSDPEngineWithLMHead.prepare_model_inputs",
                fsdp_model_inputs,
                optional=True,
            ),
            Target(
                FSDP,
                "FSDPEngineWithLMHead.prepare_model_outputs",
                fsdp_model_outputs,
                optional=True,
            ),
            Target(FSDP, "FSDPEngineWithLMHead.disable_adapter", disable_adapter, optional=True),
        ]
    )


PEER = Peer(
    "verl", "verl", ("0.9.",), _targets(), configure=configure, report_extra=sampling_report
)
__all__ = ["PEER", "Fallback"]
