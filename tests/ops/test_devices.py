"""Mixed devices: a tensor argument on another device than the op's is a ValueError naming the
argument and both devices (`mask: expected a tensor on cpu (like logprobs), got meta`), never a
result read from memory nobody wrote nor a CPU tensor handed to a CUDA kernel.

This machine has two devices, cpu and meta: each case moves one tensor argument to meta and
leaves the rest on the CPU. Three layers are checked:
- every public op, called as a user calls it, with the compiled extension and without it
  (`PPO_KERNELS_NO_EXTENSION=1`: the fallbacks). With a meta argument the dispatcher picks an
  op's Meta kernel (its fake) whatever the other devices, so the fakes check too;
- every registered op (`torch.ops.ppo_kernels`, backward ops included), called plainly (its
  fake) and redispatched to its CPU kernel (`OpOverload.redispatch`): that is where a CUDA call
  with a CPU mask lands, and where the C++ checks run;
- every raw kernel (`torch.ops.ppo_kernels_C`), redispatched to its CPU kernel (its own checks).
The cases come from one table of public calls (`public_calls`); the registered ops and raw
kernels those calls reach, with their arguments, are recorded by a dispatch mode (`record`), so
a new op needs one row here and nothing else. The vocab-parallel forms run in a child with a
one-rank gloo group (`process_group=`), their custom ops recorded the same way.

Calls run in child processes (a missing check can read a meta tensor's null pointer and crash):
one child per layer; if it dies, the cases it did not report run again one child each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple

import pytest
import torch
from support.skips import NO_GLOO, requires_extension

import ppo_kernels as pk
import ppo_kernels.distill.tiles  # noqa: F401  (pk.distill.tiles: the tile kernels' rows)
from ppo_kernels import _backend

HERE = os.path.dirname(os.path.abspath(__file__))
OTHER = "meta"  # where the moved argument goes; every other tensor stays on the CPU
IN_CHILD = os.environ.get("PPO_KERNELS_DEVICES_CHILD") == "1"

# The one form of the error, C++ and Python alike.
MESSAGE = re.compile(
    r"^(?P<arg>[\w.\[\]]+): expected a tensor on (?P<want>\S+) \(like (?P<like>[\w.\[\] ]+)\), "
    r"got (?P<got>\S+)$"
)


class Row(NamedTuple):
    id: str
    fn: str  # the public function's name
    tensors: dict  # the tensor arguments, each moved in turn (a tuple moves whole: gae's carry)
    kwargs: dict  # the other arguments
    grad: tuple = ()  # tensors that require grad (the recording runs the backward too)


def public_calls(group=None) -> list[Row]:
    """One row per route of every public op (the registered op, the API's shortcuts, the Python
    loops, the C++ loops); with `group`, the distributed forms (`process_group=group`)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    def ints(hi, *shape):
        return torch.randint(0, hi, shape, generator=g)

    B, T, V, H = 2, 4, 5, 4
    lp, old, adv, ref = randn(B, T), randn(B, T), randn(B, T), randn(B, T)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    scores = randn(B)
    logits, ref_logits, labels = randn(B, T, V), randn(B, T, V), ints(V, B, T)
    hidden, weight, bias = randn(B * T, H), randn(V, H), randn(V)
    hidden3 = hidden.view(B, T, H)
    if group is not None:
        dist = dict(process_group=group)
        return [
            Row("token_logprobs_vp", "token_logprobs", dict(logits=logits, labels=labels),
                dict(return_entropy=True, vocab_start=0, **dist), ("logits",)),
            Row("linear_token_logprobs_vp", "linear_token_logprobs",
                dict(hidden=hidden, weight=weight, labels=labels.view(-1), bias=bias),
                dict(return_entropy=True, vocab_start=0, **dist), ("hidden", "weight", "bias")),
            Row("token_logprobs_temperature_vp", "token_logprobs",
                dict(logits=logits, labels=labels, temperature=randn(B).abs() + 0.5),
                dict(return_entropy=True, vocab_start=0, **dist), ("logits",)),
            Row("token_logprobs_sampler_vp", "token_logprobs",
                dict(logits=logits, labels=labels, temperature=randn(B).abs() + 0.5,
                     top_k=ints(V, B, T), top_p=randn(B).abs() / 4 + 0.5,
                     min_p=randn(B).abs() / 10),
                dict(return_entropy=True, stats=("outside", "sum_p2", "lse", "topk", "is_argmax"),
                     stats_top_k=2, sampler="sglang", vocab_start=0, **dist), ("logits",)),
            Row("linear_token_logprobs_temperature_vp", "linear_token_logprobs",
                dict(hidden=hidden, weight=weight, labels=labels.view(-1), bias=bias,
                     temperature=randn(B * T).abs() + 0.5),
                dict(return_entropy=True, vocab_start=0, **dist), ("hidden", "weight", "bias")),
            Row("full_kl_vp", "full_kl", dict(logits=logits, ref_logits=ref_logits, mask=mask),
                dist, ("logits", "ref_logits")),
            Row("full_kl_sampler_vp", "full_kl",
                dict(logits=logits, ref_logits=ref_logits, mask=mask,
                     temperature=randn(B, T).abs() + 0.5, top_k=ints(V, B),
                     top_p=(randn(B, T).abs() / 4 + 0.5).clamp(max=1.0)),
                dict(sampler="sglang", **dist), ("logits", "ref_logits")),
            Row("full_kl_temperature_vp", "full_kl",
                dict(logits=logits, ref_logits=ref_logits, mask=mask,
                     temperature=randn(B, T).abs() + 0.5), dist, ("logits", "ref_logits")),
            Row("linear_token_logprobs_sampler_vp", "linear_token_logprobs",
                dict(hidden=hidden, weight=weight, labels=labels.view(-1), bias=bias,
                     top_k=ints(V, B * T), min_p=randn(B * T).abs() / 10),
                dict(return_entropy=True, stats=("outside", "topk"), stats_top_k=2,
                     vocab_start=0, **dist), ("hidden", "weight", "bias")),
            Row("linear_policy_loss_sampler_vp", "linear_policy_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, advantages=adv,
                     old_logprobs=old, mask=mask, bias=bias, top_k=ints(V, B),
                     top_p=(randn(B, T).abs() / 4 + 0.5).clamp(max=1.0)),
                dict(entropy_coef=0.1, sampler="sglang", vocab_start=0, **dist),
                ("hidden", "weight")),
            Row("linear_preference_loss_sampler_vp", "linear_preference_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, mask=mask, bias=bias,
                     ref_hidden=randn(B, T, 3), ref_weight=randn(V, 3), top_k=ints(V, B, T)),
                dict(vocab_start=0, **dist), ("hidden", "weight")),
            Row("linear_policy_loss_temperature_vp", "linear_policy_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, advantages=adv,
                     old_logprobs=old, mask=mask, bias=bias, temperature=randn(B).abs() + 0.5),
                dict(entropy_coef=0.1, vocab_start=0, **dist), ("hidden", "weight")),
            Row("linear_preference_loss_temperature_vp", "linear_preference_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, mask=mask, bias=bias,
                     ref_logps=scores, temperature=randn(B, T).abs() + 0.5),
                dict(vocab_start=0, **dist), ("hidden", "weight")),
            Row("linear_policy_loss_vp", "linear_policy_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, advantages=adv,
                     old_logprobs=old, mask=mask, bias=bias, ref_logprobs=ref),
                dict(kl_coef=0.1, entropy_coef=0.1, vocab_start=0, **dist), ("hidden", "weight")),
            Row("linear_policy_loss_ref_head_vp", "linear_policy_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, advantages=adv,
                     old_logprobs=old, mask=mask, ref_hidden=randn(B, T, 3),
                     ref_weight=randn(V, 3), ref_bias=randn(V)),
                dict(kl_coef=0.1, vocab_start=0, **dist), ("hidden",)),
            Row("linear_preference_loss_vp", "linear_preference_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, mask=mask, bias=bias,
                     ref_logps=scores),
                dict(loss_type=("sigmoid", "sft"), vocab_start=0, **dist), ("hidden", "weight")),
            Row("linear_preference_loss_ref_head_vp", "linear_preference_loss",
                dict(hidden=hidden3, weight=weight, labels=labels, mask=mask,
                     ref_hidden=randn(B, T, 3), ref_weight=randn(V, 3), ref_bias=randn(V)),
                dict(vocab_start=0, **dist), ("hidden",)),
            Row("gae_sp", "gae", dict(rewards=lp, values=old, mask=mask, bootstrap_value=scores),
                dist),
            Row("masked_whiten_dp", "masked_whiten", dict(x=lp, mask=mask), dist, ("x",)),
            Row("masked_mean_dp", "masked_mean", dict(x=lp, mask=mask), dist, ("x",)),
            Row("grpo_advantages_dp", "grpo_advantages", dict(scores=randn(4), mask=randn(4, 3)),
                dict(group_size=2, **dist)),
            Row("rloo_advantages_dp", "rloo_advantages", dict(scores=randn(4), mask=randn(4, 3)),
                dict(group_size=2, **dist)),
        ]  # fmt: skip
    from support.utils import TinyCausalLM

    ids = ints(7, B, T + 1)
    gidx = torch.tensor([0, 1, 0, 1])
    pol = dict(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask)
    lpl = dict(hidden=hidden3, weight=weight, labels=labels, advantages=adv, old_logprobs=old,
               mask=mask)  # fmt: skip
    return [
        Row("token_logprobs", "token_logprobs", dict(logits=logits, labels=labels),
            dict(return_entropy=True), ("logits",)),
        Row("token_logprobs_inplace", "token_logprobs", dict(logits=logits, labels=labels),
            dict(inplace_backward=True), ("logits",)),
        Row("token_logprobs_sampler", "token_logprobs",
            dict(logits=logits, labels=labels, temperature=randn(B).abs() + 0.5,
                 top_k=ints(V, B, T), top_p=randn(B).abs() / 4 + 0.5, min_p=randn(B).abs() / 10),
            dict(return_entropy=True, stats=("outside", "sum_p2", "lse", "topk", "is_argmax"),
                 stats_top_k=2), ("logits",)),
        Row("linear_token_logprobs", "linear_token_logprobs",
            dict(hidden=hidden, weight=weight, labels=labels.view(-1), bias=bias),
            dict(return_entropy=True), ("hidden", "weight", "bias")),
        Row("linear_token_logprobs_sampler", "linear_token_logprobs",
            dict(hidden=hidden, weight=weight, labels=labels.view(-1), bias=bias,
                 temperature=randn(B * T).abs() + 0.5, top_k=ints(V, B * T),
                 top_p=randn(B * T).abs().clamp(max=1) / 4 + 0.5,
                 min_p=randn(B * T).abs().clamp(max=1) / 10),
            dict(return_entropy=True, stats=("outside", "sum_p2", "lse", "topk", "is_argmax"),
                 stats_top_k=2), ("hidden", "weight", "bias")),
        Row("linear_token_logprobs_chunked", "linear_token_logprobs",
            dict(hidden=hidden, weight=weight, labels=labels.view(-1), bias=bias),
            dict(return_entropy=True, max_chunk_bytes=64), ("hidden", "weight", "bias")),
        Row("linear_token_logprobs_bf16_tiles", "linear_token_logprobs",
            dict(hidden=hidden.bfloat16(), weight=weight.bfloat16(), labels=labels.view(-1)),
            dict(logits_dtype="input", max_chunk_bytes=64), ("hidden", "weight")),
        Row("causal_lm_logprobs", "causal_lm_logprobs",
            dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids),
            dict(model=TinyCausalLM(7, H))),
        Row("linear_policy_loss", "linear_policy_loss", dict(lpl, bias=bias, ref_logprobs=ref),
            dict(kl_coef=0.1, entropy_coef=0.1), ("hidden", "weight", "bias")),
        Row("linear_policy_loss_python_loop", "linear_policy_loss",
            dict(lpl, bias=bias, weights=randn(B, T).abs(), rollout_logprobs=ref),
            dict(loss_type="cispo", rollout_is="token", global_num_tokens=torch.tensor(5.0)),
            ("hidden", "weight", "bias")),
        Row("linear_policy_loss_no_grad", "linear_policy_loss", lpl, {}),
        Row("linear_policy_loss_sampler", "linear_policy_loss",
            dict(lpl, bias=bias, ref_logprobs=ref, temperature=randn(B).abs() + 0.5,
                 top_k=ints(V, B), top_p=randn(B, T).abs().clamp(max=1) / 4 + 0.5),
            dict(kl_coef=0.1, entropy_coef=0.1, min_p=0.05), ("hidden", "weight", "bias")),
        Row("linear_policy_loss_ref_head", "linear_policy_loss",
            dict(lpl, ref_hidden=randn(B, T, 3), ref_weight=randn(V, 3), ref_bias=randn(V)),
            dict(kl_coef=0.1), ("hidden", "weight")),
        Row("linear_preference_loss", "linear_preference_loss",
            dict(hidden=hidden3, weight=weight, labels=labels, mask=mask, bias=bias,
                 ref_logps=scores), dict(loss_type=("sigmoid", "sft")),
            ("hidden", "weight", "bias")),
        Row("linear_preference_loss_ref_head", "linear_preference_loss",
            dict(hidden=hidden3, weight=weight, labels=labels, mask=mask,
                 pairs=torch.tensor([[1, 0]]), ref_hidden=randn(B, T, 3), ref_weight=randn(V, 3),
                 ref_bias=randn(V)), dict(max_chunk_bytes=64), ("hidden", "weight")),
        Row("linear_preference_loss_sampler", "linear_preference_loss",
            dict(hidden=hidden3, weight=weight, labels=labels, mask=mask, bias=bias,
                 ref_hidden=randn(B, T, 3), ref_weight=randn(V, 3),
                 temperature=randn(B, T).abs() + 0.5, top_k=ints(V, B)),
            dict(top_p=0.9, min_p=0.05), ("hidden", "weight", "bias")),
        Row("linear_preference_loss_kto", "linear_preference_loss",
            dict(hidden=hidden3, weight=weight, labels=labels, mask=mask,
                 desirable=torch.tensor([True, False]), ref_logps=scores,
                 reference_point=torch.tensor(0.1)), dict(loss_type="kto"), ("hidden",)),
        Row("full_kl", "full_kl", dict(logits=logits, ref_logits=ref_logits, mask=mask), {},
            ("logits", "ref_logits")),
        Row("full_kl_row_temperature", "full_kl",
            dict(logits=logits, ref_logits=ref_logits, mask=mask,
                 temperature=randn(B, T).abs() + 0.5), {}, ("logits", "ref_logits")),
        Row("full_kl_sampler", "full_kl",
            dict(logits=logits, ref_logits=ref_logits, mask=mask, temperature=randn(B).abs() + 0.5,
                 top_k=torch.tensor([3, 0])), dict(top_p=0.9), ("logits", "ref_logits")),
        Row("kl_penalty", "kl_penalty", dict(logprobs=lp, ref_logprobs=ref), {},
            ("logprobs", "ref_logprobs")),
        Row("kl_penalty_k3", "kl_penalty", dict(logprobs=lp, ref_logprobs=ref),
            dict(estimator="k3", clamp="verl"), ("logprobs", "ref_logprobs")),
        Row("kl_penalty_is", "kl_penalty", dict(logprobs=lp, ref_logprobs=ref, is_logprobs=old),
            dict(estimator="k1+"), ("logprobs",)),
        Row("kl_penalized_rewards", "kl_penalized_rewards",
            dict(scores=scores, logprobs=lp, ref_logprobs=ref, mask=mask, beta=randn(B).abs()),
            dict(estimator="k3")),
        Row("kl_penalized_rewards_kl", "kl_penalized_rewards",
            dict(scores=scores, mask=mask, kl=ref, beta=torch.tensor(0.1)),
            dict(logprobs=None, ref_logprobs=None, convention="openrlhf")),
        Row("gae", "gae", dict(rewards=lp, values=old, mask=mask, dones=~mask), dict(gamma=0.9)),
        Row("gae_per_token", "gae",
            dict(rewards=lp, values=old, mask=mask, gamma=randn(B, T).sigmoid(),
                 lam=randn(B, T).sigmoid(), bootstrap_value=scores), {}),
        Row("gae_carry", "gae", dict(rewards=lp, values=old, carry=(scores, scores)),
            dict(return_carry=True)),
        Row("gae_packed", "gae",
            dict(rewards=lp.view(-1), values=old.view(-1), mask=mask.view(-1),
                 cu_seqlens=torch.tensor([0, 3, 8])), {}),
        Row("masked_mean", "masked_mean", dict(x=lp, mask=mask), {}, ("x",)),
        Row("masked_mean_dim", "masked_mean", dict(x=lp, mask=mask), dict(dim=1), ("x",)),
        Row("masked_whiten", "masked_whiten", dict(x=lp, mask=mask), {}, ("x",)),
        Row("ppo_policy_loss", "ppo_policy_loss", dict(pol, entropy=ref),
            dict(global_num_tokens=torch.tensor(5.0)), ("logprobs",)),
        Row("ppo_policy_loss_weights", "ppo_policy_loss", dict(pol, weights=randn(B, T).abs()),
            {}, ("logprobs",)),
        Row("ppo_policy_loss_rollout", "ppo_policy_loss", dict(pol, rollout_logprobs=ref),
            dict(loss_type="cispo", rollout_is="token", rollout_rs="token_k1",
                 rollout_rs_threshold=2.0), ("logprobs",)),
        Row("ppo_policy_loss_seq", "ppo_policy_loss", pol,
            dict(loss_type="geo_mean", global_batch_size=torch.tensor(2.0)), ("logprobs",)),
        Row("ppo_value_loss", "ppo_value_loss",
            dict(values=lp, old_values=old, returns=adv, mask=mask),
            dict(clip=0.2, global_num_tokens=torch.tensor(5.0)), ("values",)),
        Row("ppo_value_loss_weights", "ppo_value_loss",
            dict(values=lp, old_values=old, returns=adv, mask=mask, weights=randn(B, T).abs()),
            {}, ("values",)),
        Row("grpo_advantages", "grpo_advantages", dict(scores=randn(4), group_index=gidx), {}),
        Row("grpo_advantages_mask", "grpo_advantages", dict(scores=randn(4), mask=randn(4, 3)),
            dict(group_size=2)),
        Row("rloo_advantages", "rloo_advantages",
            dict(scores=randn(4), group_index=gidx, mask=randn(4, 3)), {}),
        Row("rollout_correction", "rollout_correction",
            dict(logprobs=lp, rollout_logprobs=ref, mask=mask), dict(rollout_is="token")),
        Row("masked_aggregate", "masked_aggregate", dict(loss_mat=lp, mask=mask), {},
            ("loss_mat",)),
        Row("masked_aggregate_global", "masked_aggregate", dict(loss_mat=lp, mask=mask),
            dict(agg="seq-mean-token-sum-norm", global_num_tokens=torch.tensor(5.0),
                 global_batch_size=torch.tensor(2.0)), ("loss_mat",)),
        Row("reward_model_loss", "reward_model_loss",
            dict(chosen_scores=scores, rejected_scores=randn(B)), {},
            ("chosen_scores", "rejected_scores")),
        # the distillation tile kernels (positional; no public function of their own)
        Row("distill_tiles", "distill.tiles.forward",
            dict(student=randn(3, V), teacher=randn(3, V), labels=ints(V, 3),
                 mask=torch.tensor([True, True, False])), dict(t=1.25, div="jsd", b=0.5, ii=-100)),
        Row("distill_tiles_grad", "distill.tiles.backward_",
            dict(student=randn(3, V), teacher=randn(3, V), labels=ints(V, 3),
                 mask=torch.tensor([True, True, False]), lse_student=randn(3),
                 lse_teacher=randn(3), aux=randn(3), lse_hard=randn(3), grad=randn(3),
                 grad_hard=randn(3)), dict(t=1.25, div="jsd", b=0.5, ii=-100)),
        # linear_distill_loss: a teacher head, a cached teacher's top-k
        Row("linear_distill_loss", "linear_distill_loss",
            dict(hidden=hidden, weight=weight, labels=labels.view(-1), teacher_hidden=randn(B * T, 3),
                 teacher_weight=randn(V, 3), bias=bias, teacher_bias=randn(V), mask=mask.view(-1)),
            dict(divergence="jsd", temperature=1.25), ("hidden", "weight", "bias")),
        Row("linear_distill_loss_sampler", "linear_distill_loss",
            dict(hidden=hidden, weight=weight, labels=labels.view(-1), teacher_hidden=randn(B * T, 3),
                 teacher_weight=randn(V, 3), bias=bias, mask=mask.view(-1),
                 temperature=randn(B * T).abs() + 0.5, top_k=ints(V, B * T),
                 top_p=randn(B * T).abs().clamp(max=1) / 4 + 0.5),
            dict(divergence="tv", min_p=0.05), ("hidden", "weight", "bias")),
        Row("linear_distill_loss_topk", "linear_distill_loss",
            dict(hidden=hidden, weight=weight, labels=labels.view(-1), topk_ids=ints(V, B * T, 2),
                 topk_logprobs=-randn(B * T, 2).abs() - 1, mask=mask.view(-1)),
            dict(divergence="forward_kl", max_chunk_bytes=64), ("hidden", "weight")),
        Row("dpo_loss", "dpo_loss",
            dict(policy_chosen_lp=scores, policy_rejected_lp=randn(B), ref_chosen_lp=randn(B),
                 ref_rejected_lp=randn(B)), dict(beta=0.1),
            ("policy_chosen_lp", "policy_rejected_lp")),
    ]  # fmt: skip


def _moved(x):
    if isinstance(x, (tuple, list)):
        return type(x)(_moved(t) for t in x)
    return x.detach().to(OTHER)


def _call(row: Row, moved: str | None = None, grad: bool = False):
    tensors = {}
    for k, v in row.tensors.items():
        if k == moved:
            v = _moved(v)
        elif grad and k in row.grad:
            v = v.detach().clone().requires_grad_()
        tensors[k] = v
    fn = pk
    for part in row.fn.split("."):
        fn = getattr(fn, part)
    if isinstance(fn, _backend.Kernel):  # a raw tile kernel: positional arguments only
        out = fn(*tensors.values(), *row.kwargs.values())
    else:
        out = fn(**tensors, **row.kwargs)
    if grad:  # the backward ops, with a gradient for every floating output
        outs = [o for o in _leaves(out) if o.is_floating_point() and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return out


def _leaves(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _leaves(v)]
    return [t for v in vars(x).values() for t in _leaves(v)] if hasattr(x, "__dict__") else []


# ---- the registered ops and raw kernels the public calls reach ----
_NAMESPACES = ("ppo_kernels", "ppo_kernels_C")
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class Recorded(NamedTuple):
    op: object  # the OpOverload
    args: tuple
    kwargs: dict


def record(rows) -> list[Recorded]:
    """Every call of a `ppo_kernels::` / `ppo_kernels_C::` op while the rows run (forward and
    backward), with its arguments: the calls from Python (a function mode: an op whose Autograd
    kernel calls another op is seen too) and those below autograd (a dispatch mode). The
    dispatch mode redispatches a call to its CPU kernel with the mode still on, so the calls it
    makes in turn (the C++ routing to the raw kernels, the Python backends' calls) are seen."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    def ours(func):
        return isinstance(func, torch._ops.OpOverload) and func.namespace in _NAMESPACES

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            op = func.default if isinstance(func, torch._ops.OpOverloadPacket) else func
            if ours(op):
                calls.append(Recorded(op, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    class Below(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not func.namespace.startswith("ppo_kernels"):
                return func(*args, **kwargs)
            if ours(func):
                calls.append(Recorded(func, args, kwargs))
            with self:
                return func.redispatch(_CPU, *args, **kwargs)

    for row in rows:
        with Calls(), Below():
            _call(row, grad=True)
    return calls


def _schema_tensors(op, args, kwargs):
    """(argument name, position) of each tensor argument of a recorded call (None skipped)."""
    out = []
    for i, a in enumerate(op._schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append((a.name, i))
    return out


def op_cases(calls) -> dict[str, tuple]:
    """{case id: (recorded call, argument name, position, how)}: each tensor argument of each op
    once (its first recorded call with that argument given); how = "dispatch" (a plain call:
    the fake of a registered op) or "kernel" (redispatched to the CPU kernel)."""
    cases = {}
    for c in calls:
        name = f"{c.op.namespace}::{c.op._schema.name.split('::')[1]}"
        hows = ("kernel",) if c.op.namespace == "ppo_kernels_C" else ("dispatch", "kernel")
        tensors = _schema_tensors(c.op, c.args, c.kwargs)
        if len(tensors) < 2:  # one tensor moved: nothing is on another device
            continue
        for arg, pos in tensors:
            for how in hows:
                cases.setdefault(f"{name}-{arg}-{how}", (c, arg, pos, how))
    return cases


def _run_op_case(case):
    c, arg, pos, how = case
    args, kwargs = list(c.args), dict(c.kwargs)
    if pos < len(args):
        args[pos] = _moved(args[pos])
    else:
        kwargs[arg] = _moved(kwargs[arg])
    if how == "kernel":
        return c.op.redispatch(_CPU, *args, **kwargs)
    return c.op(*args, **kwargs)


def public_cases(rows) -> dict[str, tuple]:
    return {f"{r.id}-{k}": (r, k) for r in rows if len(r.tensors) > 1 for k in r.tensors}


# ---- the child processes ----
def _outcome(cid, fn):
    try:
        fn()
        return {"id": cid, "raised": None}
    except Exception as e:  # noqa: BLE001  (the type is the result)
        return {"id": cid, "raised": type(e).__name__, "msg": str(e)}


def _init_group():
    import torch.distributed as dist

    path = os.path.join(tempfile.mkdtemp(prefix="ppo_devices_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    return dist.group.WORLD


def _child(layer: str):
    """Run the cases of `layer` whose ids come on stdin (JSON; null: all), one JSON line each."""
    want = json.loads(sys.stdin.read())
    group = _init_group() if layer == "vocab_parallel" else None
    rows = public_calls(group)
    if layer == "ops":
        cases = {k: (lambda c=c: _run_op_case(c)) for k, c in op_cases(record(rows)).items()}
    elif layer == "vocab_parallel":
        calls = [c for c in record(rows) if c.op._schema.name.startswith("ppo_kernels::vocab_")]
        ops = {k: (lambda c=c: _run_op_case(c)) for k, c in op_cases(calls).items()}
        pub = {k: (lambda r=r, a=a: _call(r, a)) for k, (r, a) in public_cases(rows).items()}
        cases = {**pub, **{f"op:{k}": v for k, v in ops.items()}}
        print(json.dumps({"id": "registered", "ops": _vocab_parallel_ops()}), flush=True)
    else:
        cases = {k: (lambda r=r, a=a: _call(r, a)) for k, (r, a) in public_cases(rows).items()}
    for cid, fn in cases.items():
        if want is None or cid in want:
            print(json.dumps(_outcome(cid, fn)), flush=True)


def _vocab_parallel_ops():
    return sorted(
        n.split("::")[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("ppo_kernels::vocab_parallel")
    )


def _spawn(layer, ids, **env):
    code = f"import sys; sys.path[:0] = [{HERE!r}, {os.path.dirname(HERE)!r}]; import test_devices; test_devices._child({layer!r})"
    e = dict(os.environ, PPO_KERNELS_DEVICES_CHILD="1", OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(ids),
        capture_output=True,
        text=True,
        timeout=900,
        env=e,
        check=False,
    )
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["id"]] = r
    return proc, out


def _results(layer, ids, **env):
    """Every case's outcome; a case that crashed its child has "crash" (exit status, stderr)."""
    proc, res = _spawn(layer, None, **env)
    missing = [c for c in ids if c not in res]
    if len(missing) == len(ids):  # the child failed before any case: say why, once
        assert proc.returncode == 0 and ids, proc.stderr[-4000:]
    for cid in missing:  # the shared child died: one child per remaining case
        p, r = _spawn(layer, [cid], **env)
        res[cid] = r.get(cid, {"id": cid, "crash": p.returncode, "stderr": p.stderr[-2000:]})
    return res


# Schema names whose messages use the public argument's name (the API passes it on as it is).
_SAYS = {"beta_t": "beta"}


def _check_refused(r, moved: str):
    """A ValueError whose first line is the one form, naming `moved` and both devices."""
    moved = _SAYS.get(moved, moved)
    assert "crash" not in r, f"crashed the process (rc {r['crash']}): {r['stderr']}"
    assert r["raised"] is not None, f"{moved} on {OTHER} was accepted"
    first = r["msg"].strip().splitlines()[0] if r["msg"].strip() else ""
    assert r["raised"] == "ValueError", f"{r['raised']}: {first}"
    m = MESSAGE.match(first)
    assert m, f"not the form 'NAME: expected a tensor on D (like NAME), got D': {first!r}"
    names = (m["arg"], m["like"])
    assert any(n == moved or n.startswith(moved + "[") for n in names), (moved, first)
    assert {m["want"], m["got"]} == {"cpu", OTHER}, first


# ---- the tests ----
PUBLIC = public_calls()
PUBLIC_CASES = sorted(public_cases(PUBLIC))
OP_CASES = (
    sorted(op_cases(record(PUBLIC))) if _backend.HAS_EXTENSION and not IN_CHILD else []
)  # fmt: skip
needs_extension = requires_extension


def test_every_public_op_has_a_row():
    names = {n for info in _backend.OPS.values() for n in info.public}
    assert names <= {r.fn for r in PUBLIC}, sorted(names - {r.fn for r in PUBLIC})


@needs_extension
def test_every_registered_op_and_raw_kernel_is_reached():
    """The rows reach every `ppo_kernels::` op and every raw kernel that takes a tensor."""
    reached = {c.split("-")[0] for c in OP_CASES}
    for ns in _NAMESPACES:
        for name in torch._C._dispatch_get_all_op_names():
            if not name.startswith(ns + "::") or "vocab_parallel" in name:
                continue
            op = getattr(getattr(torch.ops, ns), name.split("::")[1]).default
            if any(a.type.isSubtypeOf(torch._C.TensorType.get()) for a in op._schema.arguments):
                assert name in reached, f"no row of public_calls reaches {name}"


@pytest.fixture(scope="module")
def public_results():
    return _results("public", PUBLIC_CASES)


@pytest.fixture(scope="module")
def fallback_results():
    return _results("public", PUBLIC_CASES, PPO_KERNELS_NO_EXTENSION="1")


@pytest.fixture(scope="module")
def op_results():
    return _results("ops", OP_CASES)


@pytest.mark.parametrize("cid", PUBLIC_CASES)
def test_public_op(public_results, cid):
    _check_refused(public_results[cid], cid.rsplit("-", 1)[1])


@pytest.mark.parametrize("cid", PUBLIC_CASES)
def test_public_op_without_the_extension(fallback_results, cid):
    _check_refused(fallback_results[cid], cid.rsplit("-", 1)[1])


@needs_extension
@pytest.mark.parametrize("cid", OP_CASES)
def test_registered_op_and_raw_kernel(op_results, cid):
    _check_refused(op_results[cid], cid.split("-")[1])


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason=NO_GLOO,
)
def test_vocab_parallel_and_distributed_forms():
    """The `process_group=` forms (one rank) and the vocab-parallel custom ops they reach."""
    ids = sorted(public_cases(public_calls(group=object())))
    proc, res = _spawn("vocab_parallel", None)
    assert "registered" in res, proc.stderr[-4000:]
    reached = {k.split(":", 1)[1].split("-")[0] for k in res if k.startswith("op:")}
    missing = {f"ppo_kernels::{n}" for n in res["registered"]["ops"]} - reached
    assert not missing, f"no distributed row reaches {sorted(missing)}"
    failures = []
    for cid in ids + sorted(k for k in res if k.startswith("op:")):
        r = res.get(cid) or {"crash": proc.returncode, "stderr": proc.stderr[-2000:]}
        moved = cid.rsplit("-", 1)[1] if not cid.startswith("op:") else cid.split("-")[1]
        try:
            _check_refused(r, moved)
        except AssertionError as e:
            failures.append(f"{cid}: {str(e).splitlines()[0]}")
    assert not failures, "\n".join(failures)


# ---- one shape format ----
def _message(fn) -> str:
    with pytest.raises((ValueError, TypeError, IndexError)) as e:
        fn()
    return str(e.value).splitlines()[0]


def test_shapes_print_as_python_tuples():
    """Shapes in errors read as `tensor.shape` prints them: (2, 4), (4,), () -- from the public
    API, the registered ops' C++ checks and the raw kernels' alike."""
    a, b = torch.randn(2, 4), torch.randn(2, 3)
    m = torch.ones(2, 4, dtype=torch.bool)
    cases = [  # the public API's own checks
        (lambda: pk.masked_aggregate(a, m[:, :3]), "(2, 4)", "(2, 3)"),
        (lambda: pk.gae(a, a, bootstrap_value=torch.zeros(())), "(2,)", "()"),
    ]
    if _backend.HAS_EXTENSION:  # the registered ops' (through the public API, then directly)
        ops, C = torch.ops.ppo_kernels, torch.ops.ppo_kernels_C
        inf = float("inf")
        bounds = (-inf, inf, -inf, inf)
        cases += [
            (lambda: pk.kl_penalty(a, b, "k3"), "(2, 4)", "(2, 3)"),
            (lambda: pk.masked_whiten(a, m[:, :3]), "(2, 4)", "(2, 3)"),
            (lambda: pk.grpo_advantages(torch.randn(4), torch.zeros(3, dtype=torch.long)),
             "(4,)", "(3,)"),
            (lambda: ops.masked_aggregate_backward(torch.ones(1), m, torch.ones(2), a.dtype),
             "()", "(1,)"),
            (lambda: ops.group_advantages(a, None, 2, 0.0, True, "grpo", None), "(2, 4)"),
            (lambda: C.kl_penalty_fwd(a, b, "k3", False, *bounds), "(2, 4)", "(2, 3)"),
            (lambda: C.masked_whiten_fwd(a, m[:, :3], True, True, 1e-8), "(2, 4)", "(2, 3)"),
        ]  # fmt: skip
    for fn, *shapes in cases:
        msg = _message(fn)
        assert "[" not in msg, msg
        for shape in shapes:
            assert shape in msg, (shape, msg)


def test_an_empty_tensor_on_another_device_is_refused():
    """No element is read, and still the call is refused: the caller's mistake is the same."""
    e, m = torch.randn(0, 3), torch.ones(0, 3, dtype=torch.bool)
    calls = [
        (lambda: pk.kl_penalty(e, e.to(OTHER), "k3"), "ref_logprobs"),
        (lambda: pk.masked_mean(e, m.to(OTHER)), "mask"),
        (lambda: pk.gae(e, e.to(OTHER)), "values"),
        (lambda: pk.token_logprobs(torch.randn(0, 5), torch.zeros(0, dtype=torch.long).to(OTHER)),
         "labels"),
    ]  # fmt: skip
    if _backend.HAS_EXTENSION:
        inf = float("inf")
        args = (e, e.to(OTHER), "k3", False, -inf, inf, -inf, inf)
        calls += [
            (lambda: torch.ops.ppo_kernels.kl_penalty.default.redispatch(_CPU, *args), "ref"),
            (lambda: torch.ops.ppo_kernels_C.kl_penalty_fwd.default.redispatch(_CPU, *args), "ref"),
        ]
    for fn, name in calls:
        with pytest.raises(ValueError, match=rf"{name}\w*: expected a tensor on cpu .* got meta"):
            fn()
