"""The Python side of the registered ops `ppo_kernels::linear_policy_loss` and
`ppo_kernels::linear_policy_loss_grads`, defined in C++ (csrc/ops/linear_policy_loss.cpp: schemas,
checks, routing, autograd): the op on each backend -- the fused-linear engine's loop
(fused_linear/engine.py) with the policy loss's head term (head.py) -- the fake kernels and the
fallback without the extension. Semantics: naive.py; public function: api.py.

The loop computes the loss and its gradients in one pass over the hidden-state rows ("3 GEMMs":
the logits tile, then grad_hidden = G W and grad_W = G^T h for the logits gradient G formed in the
forward; autograd's backward only scales them). The registered op hands the cpp backend's CPU
calls of the clipped types in float32 or with bf16 / fp16 input tiles (no weights, bypass mode,
soft-cap or reference head) to the same loop written in C++ (csrc/cpu/linear_policy_loss.cpp,
routed in csrc/ops/linear_policy_loss.cpp): without the small torch ops the Python loop spends
around the kernels, and with each row reduced in cache, statistics to gradient.

`linear_policy_loss_sampler` (+ `_grads`): the same loss under the rollout sampler's distribution
(a temperature tensor, top-k, top-p, min-p; its arguments follow the plain op's). The loop's
tiles hold whole rows and are reduced by token_logprobs' sampler kernels (engine.SamplerVocab):
log-probs and entropy of the kept set renormalised, the gradient through the kept set only. A label
outside the kept set is masked out of the loss (mask_outside, the default) -- the aggregation's
normalisers count the tokens that stay, so a first pass finds the outside labels before any
coefficient (4 GEMMs; the second pass reuses the first's statistics) -- and counted
(`num_outside`; the `outside` output flags each token).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_labels_in_range
from .._math import acc_dtype
from ..full_kl import op as fk_op
from ..fused_linear import engine, fused_op
from ..token_logprobs import op as tl_op
from . import head as policy_head

OP = _backend.register_op(
    "linear_policy_loss",
    kernel="token_logprobs_fwd",
    triton=True,
    cuda_default="triton",
    folder="linear_policy_loss",
    delegates={
        ("cpp", "cpu"): "BLAS matmuls + the token_logprobs and loss C++ kernels (ppo-surrogate "
        "types in float32 or with bf16 / fp16 input tiles: one C++ loop, each row reduced in "
        "cache, csrc/cpu/linear_policy_loss.cpp)",
        ("cpp", "cuda"): "cuBLAS matmuls (torch.mm) + the token_logprobs CUDA kernels",
        ("triton", "cuda"): "cuBLAS matmuls (torch.mm) + the token_logprobs Triton kernels",
        ("eager", "cpu"): "BLAS matmuls (torch.mm) + eager tile math",
        ("eager", "cuda"): "cuBLAS matmuls (torch.mm) + eager tile math",
    },
)
_backend.routes_in_cpp("linear_policy_loss")

CONFIG_FIELDS = policy_head.CONFIG_FIELDS  # loss_type ... kl_cov_coef

# The arguments of both registered ops, in schema order (csrc/ops/linear_policy_loss.cpp;
# checked against the schema at import). linear_policy_loss_grads adds need_hidden, need_weight,
# need_bias.
ARG_NAMES = (
    "hidden",
    "weight",
    "labels",
    "advantages",
    "old_logprobs",
    "mask",
    "bias",
    "ref_logprobs",
    "weights",
    "global_denom",
    "ref_hidden",
    "ref_weight",
    "ref_bias",
    *CONFIG_FIELDS,
    "agg",
    "scale",
    "global_denom_value",
    "kl_coef",
    "kl_estimator",
    "kl_straight_through",
    "kl_in_lo",
    "kl_in_hi",
    "kl_out_lo",
    "kl_out_hi",
    "entropy_coef",
    "z_loss",
    "temperature",
    "softcap",
    "ignore_index",
    "max_chunk_bytes",
    "logits_dtype",
    "bypass_mode",
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "generator",
)
NEED_NAMES = ("need_hidden", "need_weight", "need_bias")
Call = NamedTuple("Call", [(n, object) for n in ARG_NAMES + NEED_NAMES])
# linear_policy_loss_sampler's arguments after ARG_NAMES (then NEED_NAMES for its _grads):
# temperatures (Tensor? [B] / [B, T], replaces temperature), top_k / top_ks, top_p / top_ps,
# min_p / min_ps (a scalar, or a per-row tensor that replaces it), sampler, mask_outside.
SAMPLER_NAMES = (
    "temperatures", "top_k", "top_ks", "top_p", "top_ps", "min_p", "min_ps", "sampler",
    "mask_outside",
)  # fmt: skip
SamplerCall = NamedTuple(
    "SamplerCall", [(n, object) for n in ARG_NAMES + SAMPLER_NAMES + NEED_NAMES]
)

if _backend.HAS_EXTENSION:
    _schema = _backend.registered("linear_policy_loss_grads").default._schema
    assert tuple(a.name for a in _schema.arguments) == ARG_NAMES + NEED_NAMES, (
        "csrc/ops/linear_policy_loss.cpp and op.ARG_NAMES disagree"
    )
    _schema = _backend.registered("linear_policy_loss_sampler_grads").default._schema
    assert tuple(a.name for a in _schema.arguments) == ARG_NAMES + SAMPLER_NAMES + NEED_NAMES, (
        "csrc/ops/linear_policy_loss.cpp and op.SAMPLER_NAMES disagree"
    )

# the per-token outputs (token_stats rows)
TOKEN_STATS = ("logprobs", "entropy", "kl")
stat_names = policy_head.stat_names


def _full_kl_kernels(backend: str, device_type: str, temperature: float):
    """full_kl's tile kernels (full_kl/op.py) for `backend` on a pair of logits tiles, as
    engine.WholeVocab's `ref`: fwd(z, zr, labels) -> (kl, lse_z, lse_w) and
    bwd(g, z, zr, (kl, lse_z, lse_w), out) -> dKL/dz scaled per row by g, written into `out`."""
    inv_t = 1.0 / temperature
    if backend == "cpp" and not _backend.has_compiled_kernel("full_kl_fwd", device_type):
        backend = "eager"
    f, b = fk_op.forward.impls[backend], fk_op.backward.impls[backend]

    def fwd(z, zr, labels):
        return f(z, zr, None, inv_t)

    def bwd(g, z, zr, stats, out):
        kl, lse_z, lse_w = stats
        b(z, g, zr, None, kl, lse_z, lse_w, inv_t, out, None)
        return out

    return fwd, bwd


def tile_kernels(backend: str, device_type: str, temperature: float):
    """The whole-vocabulary tile kernels on `backend`: token_logprobs' (forward, backward) and
    full_kl's (forward, backward), as engine.WholeVocab takes them."""
    tl = (tl_op.forward.impls[backend], tl_op.backward.impls[backend])
    return tl, _full_kl_kernels(backend, device_type, temperature)


def whole_vocab(backend: str, device_type: str, temperature: float, ignore_index: int):
    """The engine's reduction of whole-vocabulary tiles on `backend`."""
    tl, kl = tile_kernels(backend, device_type, temperature)
    return engine.WholeVocab(backend, temperature, ignore_index, tl, kl)


def run(backend: str, a, vocab: engine.WholeVocab | None = None) -> tuple[Tensor, ...]:
    """linear_policy_loss_grads on `backend` ("cpp", "triton", "eager"): the arguments as the
    schema names them (Call). vocab: how a tile is reduced (default whole_vocab; the
    vocab-parallel form passes its shard's, whose labels it has checked against the whole
    vocabulary). A SamplerCall runs linear_policy_loss_sampler_grads: the sampler's reduction
    (or the given shard's, told the `outside` buffer by its `bind`), and the `outside` flags
    [B, T] follow token_stats in the outputs."""
    hidden, labels = a.hidden, a.labels
    B, T = labels.shape
    dev = hidden.device
    sampled = isinstance(a, SamplerCall)
    if vocab is None and (dev.type == "cpu" or _backend.strict()):
        check_labels_in_range(labels, a.weight.shape[0], a.ignore_index)
    token_stats = _backend.new_output((3, B, T), acc_dtype(hidden.dtype), dev)
    token_stats[2].zero_()  # the KL row stays 0 without ref_logprobs
    outside = _backend.new_output((B, T), torch.bool, dev) if sampled else None
    head = policy_head.PolicyHead(a, backend, token_stats, outside)
    hidden, V = a.hidden, a.weight.shape[0]
    ldt, budget = a.logits_dtype, a.max_chunk_bytes
    ref = ref_plan = None
    if sampled and vocab is None:
        plan = engine.sampler_plan(hidden, V, budget, ldt)
        vocab = _sampler_vocab(backend, a, plan, head, token_stats, outside)
    else:
        if sampled:  # a vocabulary shard's sampler reduction writes the outside flags
            vocab.bind(outside.view(-1))
        if vocab is None:
            vocab = whole_vocab(backend, dev.type, a.temperature, a.ignore_index)
        # whole-vocabulary tiles; with the reference head its tile and its gradient tile beside
        share = 3 if a.ref_hidden is not None else 1
        plan = engine.plan_rows(hidden, V, ldt, budget, share, vocab.fused)
        if vocab.rows is not None:
            plan = dataclasses.replace(plan, rows=vocab.rows)
        if a.ref_hidden is not None:
            ref = (a.ref_hidden, a.ref_weight, a.ref_bias)
            ref_plan = engine.plan_rows(a.ref_hidden, V, ldt, budget, share)
            ref_plan = dataclasses.replace(ref_plan, rows=plan.rows)
    gh, gW, gb = engine.run(
        head,
        vocab,
        engine.Head(hidden, a.weight, a.bias, labels.reshape(-1), T),
        plan,
        ref=ref,
        ref_plan=ref_plan,
        softcap=a.softcap,
        need=(a.need_hidden, a.need_weight, a.need_bias),
        lp_out=token_stats[0].view(-1),
        ent_out=token_stats[1].view(-1),
    )
    loss, stats = head.result()
    if sampled:
        return loss, stats, token_stats, outside, gh, gW, gb
    return loss, stats, token_stats, gh, gW, gb


def _sampler_vocab(backend, a, plan, head, token_stats, outside) -> engine.SamplerVocab:
    """The sampler's reduction of the call `a` (a SamplerCall) on `backend`'s sampler kernels
    (eager for float64 or without compiled ones), writing the outside flags into `outside`. In a
    two-pass loop (labels outside the kept set masked: head.passes) the first pass keeps every
    row's statistics and kept set, and the second reuses them."""
    hidden, V = a.hidden, a.weight.shape[0]
    B, T = a.labels.shape
    N, dev = B * T, hidden.device
    kb = engine.sampler_kernels(hidden, backend)
    params = engine.sampler_params(
        (B, T), dev, a.temperatures, a.top_k, a.top_ks, a.top_p, a.top_ps, a.min_p, a.min_ps
    )
    acc = acc_dtype(hidden.dtype)
    outs, saved = (None, None, outside.view(-1)), None
    if head.passes(plan.rows, T) == 2:
        outs = (torch.empty(N, dtype=acc, device=dev), torch.empty(N, dtype=torch.int64,
                device=dev), outside.view(-1))  # fmt: skip
        saved = (token_stats[0].view(-1), token_stats[1].view(-1), torch.empty_like(outs[0]))
    gbuf = None
    if a.need_hidden or a.need_weight or (a.need_bias and a.bias is not None):
        tile_rows = plan.rows if plan.pad else min(plan.rows, N)
        gdt = hidden.dtype if plan.input_tiles else acc
        gbuf = torch.empty(tile_rows * V, dtype=gdt, device=dev)
    full_lse = torch.empty(N, dtype=acc, device=dev) if a.z_loss != 0 else None  # the z-loss's
    return engine.SamplerVocab(
        kb, 1.0 / a.temperature, params, a.sampler, a.ignore_index,
        (tl_op.sampler_forward.impls[kb], tl_op.sampler_backward.impls[kb]), outs=outs,
        gbuf=gbuf, saved=saved, full_lse=full_lse,
    )  # fmt: skip


def _impl(backend):
    def impl(*args):
        return run(backend, Call(*args))

    impl.__name__ = f"linear_policy_loss_grads_{backend}"
    return impl


def _sampler_impl(backend):
    def impl(*args):
        return run(backend, SamplerCall(*args))

    impl.__name__ = f"linear_policy_loss_sampler_grads_{backend}"
    return impl


for _b in _backend.BACKENDS:
    _backend.impl("linear_policy_loss_grads", _b)(_impl(_b))
    _backend.impl("linear_policy_loss_sampler_grads", _b)(_sampler_impl(_b))


def _fake_outputs(a):
    hidden = a.hidden
    acc = acc_dtype(hidden.dtype)
    B, T = a.labels.shape
    loss = hidden.new_empty((), dtype=acc)
    stats = hidden.new_empty((len(stat_names(a)),), dtype=acc)
    return loss, stats, hidden.new_empty((3, B, T), dtype=acc)


# The tensor arguments after hidden, each on hidden's device: the fakes and the fallback check it
# as the C++ checks do (a meta tensor sends a call to its fake whatever the other arguments').
_ON_HIDDENS_DEVICE = (
    "weight", "labels", "advantages", "old_logprobs", "mask", "bias", "ref_logprobs", "weights",
    "global_denom", "ref_hidden", "ref_weight", "ref_bias",
)  # fmt: skip


def _check_devices(a):
    fused_op.check_on_hiddens_device(a, _ON_HIDDENS_DEVICE)


def _fake_sampler_outputs(a):
    return (*_fake_outputs(a), fused_op.fake_outside(a))


for _name, _call, _outputs in (
    ("linear_policy_loss", Call, _fake_outputs),
    ("linear_policy_loss_sampler", SamplerCall, _fake_sampler_outputs),
):
    _fake, _fake_grads = fused_op.fake_kernels(_call, _check_devices, _outputs)
    _backend.fake(_name)(_fake)
    _backend.fake(_name + "_grads")(_fake_grads)


# --------------------------------------------------------------------------- without the extension
def with_grads(runner, args) -> tuple[Tensor, ...]:
    """(loss, stats, token_stats) of the op's arguments `args` by runner(Call) (run's
    outputs), the gradients of hidden / weight / bias that require grad attached to the loss."""
    return fused_op.with_grads(runner, Call, 3, args)


@_backend.fallback("linear_policy_loss")
def _(*args):
    _check_devices(Call(*args, False, False, False))
    return with_grads(lambda call: run("eager", call), args)


@_backend.fallback("linear_policy_loss_sampler")
def _(*args):
    _check_devices(SamplerCall(*args, False, False, False))
    return fused_op.with_grads(lambda call: run("eager", call), SamplerCall, 4, args)
