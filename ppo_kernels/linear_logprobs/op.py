"""The Python side of the registered ops `ppo_kernels::linear_token_logprobs` (+
`linear_token_logprobs_backward`), defined in C++ (csrc/ops/linear_logprobs.cpp: schemas, checks,
routing, autograd): their fake kernels, their implementation on each backend -- all three are the
fused-linear engine's loop (fused_linear/engine.py), which plans the blocks, runs the BLAS /
cuBLAS matmuls and hands each tile to that backend's kernels (a call whose logits fit one tile
runs in C++ on the cpp backend, without the loop) -- and the fallback without the compiled
extension. linear_token_logprobs is the engine's trivial head term: the forward stores each
token's statistics, the backward's coefficients are the upstream gradients."""

from __future__ import annotations

import torch

from .. import _backend
from .._checks import check_devices, check_labels_in_range
from .._math import acc_dtype
from ..fused_linear import engine
from ..fused_linear.checks import check_args, check_backward_args
from ..fused_linear.planner import plan_call
from ..fused_linear.vocab_chunks import VocabChunks
from ..token_logprobs import op as tl_op

# "cpp" = the compiled token_logprobs kernels reduce whole-vocabulary tiles (CPU and CUDA); tiles of
# vocabulary chunks go to csrc/cpu/linear_logprobs.cpp on the CPU and to the Triton kernels on CUDA
# (there is no CUDA C++ version of those). "triton" = the Triton token_logprobs kernels reduce
# whole-vocabulary tiles. Default on CUDA: triton (bench/results/gpu_H200.md): the
# Triton token_logprobs kernels reach a larger share of the memory bandwidth than the CUDA C++
# ones, and only the Triton backward writes the bf16 gradient tile the backward matmuls read
# without a float32 round trip. On every backend the chunk loop itself is Python
# (fused_linear/engine.py): the C++ op routes to `ppo_kernels_<backend>::linear_token_logprobs`.
OP = _backend.register_op(
    "linear_token_logprobs",
    kernel="token_logprobs_fwd",
    triton=True,
    cuda_default="triton",
    public=("linear_token_logprobs", "causal_lm_logprobs"),
    folder="linear_logprobs",
    delegates={
        ("cpp", "cpu"): "Python chunk loop: BLAS matmuls (torch.mm) + C++ tile kernels",
        ("cpp", "cuda"): "Python chunk loop: cuBLAS matmuls (torch.mm); whole-vocabulary tiles: "
        "token_logprobs CUDA kernels; vocabulary-chunk tiles: Triton (eager without triton)",
        ("triton", "cuda"): "Python chunk loop: cuBLAS matmuls (torch.mm); whole-vocabulary "
        "tiles: token_logprobs Triton kernels; vocabulary-chunk tiles: Triton tile kernels",
        ("eager", "cpu"): "Python chunk loop: BLAS matmuls (torch.mm) + eager tile math",
        ("eager", "cuda"): "Python chunk loop: cuBLAS matmuls (torch.mm) + eager tile math",
    },
)
_backend.routes_in_cpp("linear_token_logprobs")


# The fakes check devices as the C++ checks do: a meta tensor sends a call to its fake whatever
# the other arguments' devices.
@_backend.fake("linear_token_logprobs")
def _(
    hidden,
    weight,
    labels,
    bias,
    temperature,
    ignore_index,
    with_entropy,
    max_chunk_bytes,
    logits_dtype="float32",
    softcap=None,
):
    check_devices("hidden", hidden, weight=weight, labels=labels, bias=bias)
    acc = acc_dtype(hidden.dtype)
    N = hidden.shape[0]
    lp = hidden.new_empty((N,), dtype=acc)
    ent = hidden.new_empty((N,) if with_entropy else (0,), dtype=acc)
    return lp, ent, hidden.new_empty((N,), dtype=acc)


def _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias):
    """A backward op's outputs (grad_hidden, grad_weight, grad_bias) as the fakes give them."""
    acc = acc_dtype(hidden.dtype)
    N, H = hidden.shape
    V = weight.shape[0]
    gh = hidden.new_empty((N, H) if need_hidden else (0,))
    gW = hidden.new_empty((V, H) if need_weight else (0,), dtype=acc)
    gb = hidden.new_empty((V,) if (need_bias and bias is not None) else (0,), dtype=acc)
    return gh, gW, gb


@_backend.fake("linear_token_logprobs_backward")
def _(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight,
    labels,
    bias,
    lse,
    entropy,
    temperature,
    ignore_index,
    max_chunk_bytes,
    need_hidden,
    need_weight,
    need_bias,
    logits_dtype="float32",
    softcap=None,
):
    check_devices(
        "hidden", hidden, grad_logprobs=grad_logprobs, grad_entropy=grad_entropy, weight=weight,
        labels=labels, bias=bias, lse=lse, entropy=entropy,
    )  # fmt: skip
    return _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _reduction(hidden, V, temperature, ignore_index, max_chunk_bytes, logits_dtype, backend, tl):
    """(plan, the engine's reduction): whole-vocabulary tiles reduced by `backend`'s fused
    token_logprobs kernels (tl: forward / backward) when they fit the budget, else vocabulary
    chunks."""
    N, H = hidden.shape
    fused = engine.fused_backend(hidden, backend)
    plan = plan_call(N, V, H, hidden.dtype, hidden.device, max_chunk_bytes, logits_dtype, fused)
    if plan.vocab == V and fused:
        kernels = (tl[0].impls[fused], tl[1].impls[fused])
        return plan, engine.WholeVocab(fused, temperature, ignore_index, kernels)
    return plan, VocabChunks(plan, backend, temperature, ignore_index)


def run_forward(
    hidden, weight, labels, bias, temperature, ignore_index, with_entropy, max_chunk_bytes,
    logits_dtype, softcap, backend,
):  # fmt: skip
    """The registered op `linear_token_logprobs` on `backend` (arguments checked): (logprobs,
    entropy or an empty tensor, lse) [N], float32 (float64 for float64 input)."""
    N = hidden.shape[0]
    acc = acc_dtype(hidden.dtype)
    dev = hidden.device
    lp = _backend.new_output((N,), acc, dev)
    ent = _backend.new_output((N,) if with_entropy else (0,), acc, dev)
    lse = _backend.new_output((N,), acc, dev)
    if N == 0:
        return lp, ent, lse
    plan, vocab = _reduction(
        hidden, weight.shape[0], temperature, ignore_index, max_chunk_bytes, logits_dtype,
        backend, (tl_op.forward, tl_op.backward),
    )  # fmt: skip
    engine.run(
        engine.StoreStats(with_entropy), vocab, engine.Head(hidden, weight, bias, labels), plan,
        softcap=softcap, lp_out=lp, ent_out=ent if with_entropy else None, lse_out=lse,
    )  # fmt: skip
    return lp, ent, lse


def _run_backward(grad_logprobs, grad_entropy, lse, entropy, vocab, plan, hidden, weight, bias,
                  labels, softcap, need):  # fmt: skip
    """The engine's loop of a backward op: the upstream gradients are the coefficients."""
    acc = acc_dtype(hidden.dtype)
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    head = engine.GivenGrads(
        grad_logprobs.to(acc),
        grad_entropy.to(acc) if with_ent else None,
        lse,
        entropy if with_ent else None,
    )
    return engine.run(
        head, vocab, engine.Head(hidden, weight, bias, labels), plan, softcap=softcap, need=need
    )


def _no_rows_grads(hidden, V, bias, need_hidden, need_weight, need_bias):
    """The backward of a call without rows: zero gradients (empty where not needed)."""
    H, acc, dev = hidden.shape[1], acc_dtype(hidden.dtype), hidden.device
    need_bias = need_bias and bias is not None
    gh_out = _backend.new_output((0, H) if need_hidden else (0,), hidden.dtype, dev)
    gW = torch.zeros((V, H) if need_weight else (0,), dtype=acc, device=dev)
    gb = torch.zeros((V,) if need_bias else (0,), dtype=acc, device=dev)
    return gh_out.zero_(), gW, gb


def run_backward(
    grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse, entropy, temperature,
    ignore_index, max_chunk_bytes, need_hidden, need_weight, need_bias, logits_dtype, softcap,
    backend,
):  # fmt: skip
    """The registered op `linear_token_logprobs_backward` on `backend` (arguments checked):
    (grad_hidden in hidden's dtype, grad_weight float32, grad_bias float32), an empty tensor
    where not needed."""
    N = hidden.shape[0]
    V = weight.shape[0]
    if N == 0:
        return _no_rows_grads(hidden, V, bias, need_hidden, need_weight, need_bias)
    plan, vocab = _reduction(
        hidden, V, temperature, ignore_index, max_chunk_bytes, logits_dtype, backend,
        (tl_op.forward, tl_op.backward),
    )  # fmt: skip
    return _run_backward(
        grad_logprobs, grad_entropy, lse, entropy, vocab, plan, hidden, weight, bias, labels,
        softcap, (need_hidden, need_weight, need_bias),
    )  # fmt: skip


def _strict_labels(labels, V, ignore_index):
    """The label range on the GPU under strict_checks() (a host sync, by request); the C++ op
    checks CPU labels."""
    if labels.device.type != "cpu" and _backend.strict():
        check_labels_in_range(labels, V, ignore_index)


def _register(backend: str):
    """The chunk loop as the `backend` implementation of both ops (arguments checked in C++).
    The schema's defaults are repeated: the dispatcher leaves out trailing default values."""

    @_backend.impl("linear_token_logprobs", backend)
    def forward(
        hidden,
        weight,
        labels,
        bias,
        temperature,
        ignore_index,
        with_entropy,
        max_chunk_bytes,
        logits_dtype="float32",
        softcap=None,
    ):
        _strict_labels(labels, weight.shape[0], ignore_index)
        return run_forward(
            hidden, weight, labels, bias, temperature, ignore_index, with_entropy,
            max_chunk_bytes, logits_dtype, softcap, backend,
        )  # fmt: skip

    @_backend.impl("linear_token_logprobs_backward", backend)
    def backward(
        grad_logprobs,
        grad_entropy,
        hidden,
        weight,
        labels,
        bias,
        lse,
        entropy,
        temperature,
        ignore_index,
        max_chunk_bytes,
        need_hidden,
        need_weight,
        need_bias,
        logits_dtype="float32",
        softcap=None,
    ):
        _strict_labels(labels, weight.shape[0], ignore_index)
        return run_backward(
            grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse, entropy, temperature,
            ignore_index, max_chunk_bytes, need_hidden, need_weight, need_bias, logits_dtype,
            softcap, backend,
        )  # fmt: skip


for _b in _backend.BACKENDS:
    _register(_b)


def _head_needs(ctx, bias) -> tuple[bool, bool, bool]:
    """Which of hidden, weight and bias (the op's arguments 0, 1 and 3) need a gradient."""
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    return need_h, need_w, need_b and bias is not None


def _head_grads(gh, gW, gb, need, weight, bias) -> tuple:
    """The gradients of (hidden, weight, labels, bias), None where not needed; weight's and
    bias's back in their dtype (the kernels accumulate them in float32)."""
    need_h, need_w, need_b = need
    return (
        gh if need_h else None,
        gW.to(weight.dtype) if need_w else None,
        None,
        gb.to(bias.dtype) if need_b else None,
    )


class _Fallback(torch.autograd.Function):
    """Without the compiled extension (no registered op): the same chunk loop on the backend
    `_backend.backend_for` picks (eager on the CPU, Triton on the GPU), its arguments checked in
    Python, differentiable through this Function (the C++ op's autograd, in Python)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, temperature, ignore_index, with_entropy,
                max_chunk_bytes, logits_dtype, softcap):  # fmt: skip
        args = (temperature, ignore_index, max_chunk_bytes, logits_dtype)
        check_args(hidden, weight, labels, bias, *args)
        backend = _backend.backend_for("linear_token_logprobs", hidden)
        lp, ent, lse = run_forward(
            hidden, weight, labels, bias, temperature, ignore_index, with_entropy,
            max_chunk_bytes, logits_dtype, softcap, backend,
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, labels, bias, lse, ent)
        ctx.args = (*args, softcap)
        ctx.mark_non_differentiable(lse)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, _grad_lse):
        hidden, weight, labels, bias, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = _head_needs(ctx, bias)
        none = (None,) * 6
        if not (need_h or need_w or need_b):
            return None, None, None, None, *none
        if grad_ent is not None and grad_ent.numel() == 0:
            grad_ent = None
        temperature, ignore_index, budget, logits_dtype, softcap = ctx.args
        check_backward_args(
            grad_lp, grad_ent, hidden, weight, labels, bias, lse, entropy, temperature,
            ignore_index, budget, logits_dtype,
        )  # fmt: skip
        gh, gW, gb = run_backward(
            grad_lp, grad_ent, hidden, weight, labels, bias, lse, entropy, temperature,
            ignore_index, budget, need_h, need_w, need_b, logits_dtype, softcap,
            _backend.backend_for("linear_token_logprobs", hidden),
        )  # fmt: skip
        return (*_head_grads(gh, gW, gb, (need_h, need_w, need_b), weight, bias), *none)


_backend.fallback("linear_token_logprobs")(_Fallback.apply)


# ---- The sampler's distribution: ppo_kernels::linear_token_logprobs_sampler (+ backward) ----------
# token_logprobs_sampler of hidden @ weight.T + bias (csrc/ops/linear_logprobs.cpp). Every tile
# holds the whole vocabulary (a top-k / top-p selection needs the whole row) and is reduced by the
# sampler kernels of the op's backend (engine.SamplerVocab): cpp / triton where they run, else
# (float64, no compiled kernels) the eager ones.


def run_sampler_forward(
    hidden, weight, labels, bias, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p,
    min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
    with_is_argmax, max_chunk_bytes, logits_dtype, softcap, backend,
):  # fmt: skip
    """The registered op `linear_token_logprobs_sampler` on `backend` (arguments checked): the
    outputs of token_logprobs_sampler on the logits, each [N] (top_* [N, stats_top_k])."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    dev = hidden.device

    def rows(on, dtype=acc, shape=(N,)):
        return _backend.new_output(shape if on else (0,), dtype, dev)

    top = (N, stats_top_k) if stats_top_k > 0 else (0,)
    lp, ent, lse = rows(True), rows(with_entropy), rows(True)
    extra = (
        rows(True), rows(True, torch.int64), rows(True, torch.bool), rows(with_sum_p2),
        rows(with_lse), _backend.new_output(top, torch.int64, dev),
        _backend.new_output(top, acc, dev), rows(with_is_argmax, torch.bool),
    )  # fmt: skip
    if N == 0:
        return (lp, ent, lse, *extra)
    kb = engine.sampler_kernels(hidden, backend)
    plan = engine.sampler_plan(hidden, V, max_chunk_bytes, logits_dtype)
    params = engine.sampler_params(
        (N,), dev, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps
    )
    vocab = engine.SamplerVocab(
        kb, 1.0 / temperature, params, sampler, ignore_index,
        (tl_op.sampler_forward.impls[kb], None),
        extra=(with_sum_p2, with_lse, stats_top_k, with_is_argmax), outs=extra,
    )  # fmt: skip
    engine.run(
        engine.StoreStats(with_entropy), vocab, engine.Head(hidden, weight, bias, labels), plan,
        softcap=softcap, lp_out=lp, ent_out=ent if with_entropy else None, lse_out=lse,
    )  # fmt: skip
    return (lp, ent, lse, *extra)


def run_sampler_backward(
    grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse, entropy, cut, cut_index,
    temperature, temperatures, ignore_index, max_chunk_bytes, need_hidden, need_weight, need_bias,
    logits_dtype, softcap, backend,
):  # fmt: skip
    """The registered op `linear_token_logprobs_sampler_backward` on `backend` (arguments
    checked): (grad_hidden, grad_weight float32, grad_bias float32), empty where not needed."""
    N, H = hidden.shape
    V = weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    dev = hidden.device
    if N == 0:
        return _no_rows_grads(hidden, V, bias, need_hidden, need_weight, need_bias)
    kb = engine.sampler_kernels(hidden, backend)
    plan = engine.sampler_plan(hidden, V, max_chunk_bytes, logits_dtype)
    params = engine.sampler_params((N,), dev, temperatures, 0, None, 1.0, None, 0.0, None)
    tile_rows = plan.rows if plan.pad else min(plan.rows, N)
    gdt = hidden.dtype if plan.input_tiles else acc
    vocab = engine.SamplerVocab(
        kb, 1.0 / temperature, params, "vllm", ignore_index,
        (None, tl_op.sampler_backward.impls[kb]), kept=(cut, cut_index),
        gbuf=torch.empty(tile_rows * V, dtype=gdt, device=dev),
    )  # fmt: skip
    return _run_backward(
        grad_logprobs, grad_entropy, lse, entropy, vocab, plan, hidden, weight, bias, labels,
        softcap, (need_hidden, need_weight, need_bias),
    )  # fmt: skip


@_backend.fake("linear_token_logprobs_sampler")
def _(hidden, weight, labels, bias, temperature, temperatures, top_k, top_ks, top_p, top_ps,
      min_p, min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
      with_is_argmax, max_chunk_bytes, logits_dtype, softcap):  # fmt: skip
    check_devices("hidden", hidden, weight=weight, labels=labels, bias=bias,
                  temperatures=temperatures, top_ks=top_ks, top_ps=top_ps,
                  min_ps=min_ps)  # fmt: skip
    acc = acc_dtype(hidden.dtype)
    N = hidden.shape[0]

    def rows(on, dtype=acc):
        return hidden.new_empty((N,) if on else (0,), dtype=dtype)

    top = (N, stats_top_k) if stats_top_k > 0 else (0,)
    return (
        rows(True), rows(with_entropy), rows(True), rows(True), rows(True, torch.int64),
        rows(True, torch.bool), rows(with_sum_p2), rows(with_lse),
        hidden.new_empty(top, dtype=torch.int64), hidden.new_empty(top, dtype=acc),
        rows(with_is_argmax, torch.bool),
    )  # fmt: skip


@_backend.fake("linear_token_logprobs_sampler_backward")
def _(grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse, entropy, cut, cut_index,
      temperature, temperatures, ignore_index, max_chunk_bytes, need_hidden, need_weight,
      need_bias, logits_dtype, softcap):  # fmt: skip
    check_devices(
        "hidden", hidden, grad_logprobs=grad_logprobs, grad_entropy=grad_entropy, weight=weight,
        labels=labels, bias=bias, lse=lse, entropy=entropy, cut=cut, cut_index=cut_index,
        temperatures=temperatures,
    )  # fmt: skip
    return _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _register_sampler(backend: str):
    @_backend.impl("linear_token_logprobs_sampler", backend)
    def forward(hidden, weight, labels, bias, *args):
        _strict_labels(labels, weight.shape[0], args[9])
        return run_sampler_forward(hidden, weight, labels, bias, *args, backend)

    @_backend.impl("linear_token_logprobs_sampler_backward", backend)
    def backward(grad_logprobs, grad_entropy, hidden, weight, labels, *args):
        _strict_labels(labels, weight.shape[0], args[7])
        return run_sampler_backward(grad_logprobs, grad_entropy, hidden, weight, labels, *args,
                                    backend)  # fmt: skip


for _b in _backend.BACKENDS:
    _register_sampler(_b)


class _SamplerFallback(torch.autograd.Function):
    """Without the compiled extension: the chunk loop with autograd (the C++ op's, in Python)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, args):
        (temperature, temperatures, *_, ignore_index, with_entropy, _s, _l, _k, _a,
         budget, logits_dtype, softcap) = args  # fmt: skip
        check_args(hidden, weight, labels, bias, temperature, ignore_index, budget, logits_dtype)
        backend = _backend.backend_for("linear_token_logprobs", hidden)
        outs = run_sampler_forward(hidden, weight, labels, bias, *args, backend)
        ctx.save_for_backward(hidden, weight, labels, bias, outs[2], outs[1], outs[3], outs[4],
                              temperatures)  # fmt: skip
        ctx.args = (temperature, ignore_index, budget, logits_dtype, softcap)
        ctx.mark_non_differentiable(*outs[2:])
        return outs

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, *_):
        hidden, weight, labels, bias, lse, ent, cut, cut_index, temps = ctx.saved_tensors
        need_h, need_w, need_b = _head_needs(ctx, bias)
        if not (need_h or need_w or need_b):
            return None, None, None, None, None
        if grad_lp is None:
            grad_lp = torch.zeros_like(lse)
        if grad_ent is not None and grad_ent.numel() == 0:
            grad_ent = None
        temperature, ignore_index, budget, logits_dtype, softcap = ctx.args
        gh, gW, gb = run_sampler_backward(
            grad_lp, grad_ent, hidden, weight, labels, bias, lse, ent, cut, cut_index,
            temperature, temps, ignore_index, budget, need_h, need_w, need_b, logits_dtype,
            softcap, _backend.backend_for("linear_token_logprobs", hidden),
        )  # fmt: skip
        return (*_head_grads(gh, gW, gb, (need_h, need_w, need_b), weight, bias), None)


@_backend.fallback("linear_token_logprobs_sampler")
def _(hidden, weight, labels, bias, *args):
    return _SamplerFallback.apply(hidden, weight, labels, bias, args)
