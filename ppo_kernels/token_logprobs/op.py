"""The Python side of the registered ops `ppo_kernels::token_logprobs` and its backward ops
(`token_logprobs_backward`, `token_logprobs_backward_`), defined in C++
(csrc/ops/token_logprobs.cpp: schemas, checks, routing, autograd): their fake kernels, their
triton / eager implementations, and the per-backend kernels `forward` / `backward` that
linear_logprobs also runs on its vocabulary tiles. The cpp backend is csrc/cpu/token_logprobs.cpp
and csrc/cuda/token_logprobs.cu. Semantics and edge cases: naive.py."""

from __future__ import annotations

import torch

from .. import _backend
from .._checks import check_devices, check_labels_in_range
from .._math import acc_dtype
from . import naive

OP = _backend.register_op(
    "token_logprobs", kernel="token_logprobs_fwd", triton=True, cuda_default="triton"
)
_backend.routes_in_cpp("token_logprobs")


# The kernels, one implementation per backend with one signature (inv_temperature = 1 / T).
forward = _backend.Kernel("token_logprobs", "forward")
backward = _backend.Kernel("token_logprobs", "backward")  # writes the gradient into grad_logits


@forward.impl("cpp")
def _(logits, labels, inv_temperature, ignore_index, with_entropy):
    return _backend.cpp_ops().token_logprobs_fwd(
        logits, labels, inv_temperature, ignore_index, with_entropy
    )


@forward.impl("triton")
def _(logits, labels, inv_temperature, ignore_index, with_entropy):
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    from . import triton_kernels

    return triton_kernels.forward(logits, labels, inv_temperature, ignore_index, with_entropy)


@forward.impl("eager")
def _(logits, labels, inv_temperature, ignore_index, with_entropy):
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    lp, ent, lse = _backend.invariant_rows(
        naive.forward,
        labels.shape,
        logits,
        labels,
        1.0 / inv_temperature,
        ignore_index,
        with_entropy,
    )
    out = acc_dtype(logits.dtype)
    return lp.to(out), ent.to(out), lse.to(out)


@backward.impl("cpp")
def _(
    logits,
    grad_logprobs,
    grad_entropy,
    labels,
    lse,
    entropy,
    inv_temperature,
    ignore_index,
    grad_logits,
):
    _backend.cpp_ops().token_logprobs_bwd(
        grad_logprobs,
        grad_entropy,
        logits,
        labels,
        lse,
        entropy,
        inv_temperature,
        ignore_index,
        grad_logits,
    )


@backward.impl("triton")
def _(
    logits,
    grad_logprobs,
    grad_entropy,
    labels,
    lse,
    entropy,
    inv_temperature,
    ignore_index,
    grad_logits,
):
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    from . import triton_kernels

    triton_kernels.backward(
        grad_logprobs,
        grad_entropy,
        logits,
        labels,
        lse,
        entropy,
        inv_temperature,
        ignore_index,
        grad_logits,
    )


@backward.impl("eager")
def _(
    logits,
    grad_logprobs,
    grad_entropy,
    labels,
    lse,
    entropy,
    inv_temperature,
    ignore_index,
    grad_logits,
):
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    grad_logits.copy_(
        _backend.invariant_rows(
            naive.backward,
            labels.shape,
            grad_logprobs,
            grad_entropy,
            logits,
            labels,
            lse,
            entropy,
            1.0 / inv_temperature,
            ignore_index,
        )
    )


# ---- the registered ops' fake kernels and triton / eager implementations (the op's schemas) ----
# The fakes check devices as the C++ checks do: a meta tensor sends a call to its fake whatever
# the other arguments' devices.


def _check_backward_devices(grad_logprobs, grad_entropy, logits, labels, lse, entropy):
    check_devices(
        "logits", logits, grad_logprobs=grad_logprobs, grad_entropy=grad_entropy, labels=labels,
        lse=lse, entropy=entropy,
    )  # fmt: skip


@_backend.fake("token_logprobs")
def _(logits, labels, temperature, ignore_index, with_entropy, inplace_backward):
    check_devices("logits", logits, labels=labels)
    out = acc_dtype(logits.dtype)
    lp = logits.new_empty(labels.shape, dtype=out)
    ent = logits.new_empty(labels.shape if with_entropy else (0,), dtype=out)
    return lp, ent, logits.new_empty(labels.shape, dtype=out)


@_backend.fake("token_logprobs_backward")
def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
    _check_backward_devices(grad_logprobs, grad_entropy, logits, labels, lse, entropy)
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@_backend.fake("token_logprobs_backward_")
def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
    _check_backward_devices(grad_logprobs, grad_entropy, logits, labels, lse, entropy)
    return None


def _register(backend: str):
    # the kernels looked up per call: a test may swap one (tests/ops/test_batch_invariance.py)
    impls_f, impls_b = forward.impls, backward.impls

    @_backend.impl("token_logprobs", backend)
    def _(logits, labels, temperature, ignore_index, with_entropy, inplace_backward):
        return impls_f[backend](logits, labels, 1.0 / temperature, ignore_index, with_entropy)

    @_backend.impl("token_logprobs_backward", backend)
    def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
        grad = _backend.new_output(logits.shape, logits.dtype, logits.device)
        impls_b[backend](logits, grad_logprobs, grad_entropy, labels, lse, entropy,
                         1.0 / temperature, ignore_index, grad)  # fmt: skip
        return grad

    @_backend.impl("token_logprobs_backward_", backend)
    def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
        impls_b[backend](logits, grad_logprobs, grad_entropy, labels, lse, entropy,
                         1.0 / temperature, ignore_index, logits)  # fmt: skip


_register("triton")
_register("eager")


# Without the compiled extension: the reference itself, differentiable by autograd (the gradient
# is never written into the logits there).
@_backend.fallback("token_logprobs")
def _(logits, labels, temperature, ignore_index, with_entropy, inplace_backward):
    check_devices("logits", logits, labels=labels)
    if logits.device.type == "cpu" or _backend.strict():
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    lp, ent, lse = naive.forward(logits, labels, temperature, ignore_index, with_entropy)
    out = acc_dtype(logits.dtype)
    return lp.to(out), ent.to(out), lse.to(out)


# ---- the sampler's distribution and the head's statistics: ppo_kernels::token_logprobs_sampler ---
# (csrc/ops/token_logprobs.cpp; semantics: docs/ppo-math.md and naive.sampler_forward). The
# per-row kernels take per-token parameter tensors of labels.numel() values (or None: the scalar
# holds for every row): inverse temperatures, top-k, top-p and min-p as float64 / int64; they are
# what the fused-linear engine runs on a whole-vocabulary tile.
sampler_forward = _backend.Kernel("token_logprobs", "sampler_forward")
sampler_backward = _backend.Kernel("token_logprobs", "sampler_backward")


def _per_token(value, tensor, labels, dtype):
    """A per-token parameter with labels.shape: the tensor (its shape a leading part of
    labels.shape, broadcast over the rest), else the scalar for every token."""
    if tensor is None:
        return torch.full(labels.shape, value, dtype=dtype, device=labels.device)
    t = tensor.to(dtype)
    return t.reshape(tuple(t.shape) + (1,) * (labels.dim() - t.dim())).expand(labels.shape)


def _flat_param(tensor, labels, dtype):
    """A per-token tensor as the kernels take it: labels.numel() contiguous values (None stays)."""
    if tensor is None:
        return None
    return _per_token(None, tensor, labels, dtype).reshape(-1).contiguous()


def _kernel_param(value, flat, labels, dtype):
    """A kernel's per-token parameter (labels.numel() values, or None: the scalar) with
    labels.shape."""
    if flat is None:
        return torch.full(labels.shape, value, dtype=dtype, device=labels.device)
    return flat.to(dtype).reshape(labels.shape)


def _eager_params(labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p, top_ps, min_p,
                  min_ps):  # fmt: skip
    f64 = torch.float64
    return (
        _kernel_param(inv_temperature, inv_temperatures, labels, f64),
        _kernel_param(top_k, top_ks, labels, torch.int64),
        _kernel_param(top_p, top_ps, labels, f64),
        _kernel_param(min_p, min_ps, labels, f64),
    )


@sampler_forward.impl("cpp")
def _(logits, labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p, top_ps, min_p,
      min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
      with_is_argmax):  # fmt: skip
    return _backend.cpp_ops().token_logprobs_sampler_fwd(
        logits, labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p, top_ps, min_p,
        min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
        with_is_argmax,
    )  # fmt: skip


@sampler_forward.impl("triton")
def _(logits, labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p, top_ps, min_p,
      min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
      with_is_argmax):  # fmt: skip
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    from . import triton_sampler

    return triton_sampler.sampler_forward(
        logits, labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p, top_ps, min_p,
        min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
        with_is_argmax,
    )  # fmt: skip


@sampler_forward.impl("eager")
def _(logits, labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p, top_ps, min_p,
      min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
      with_is_argmax):  # fmt: skip
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    params = _eager_params(labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p,
                           top_ps, min_p, min_ps)  # fmt: skip
    outs = _backend.invariant_rows(
        lambda x, y, t, k, p, mp: naive.sampler_forward(
            x, y, t, k, p, mp, sampler, ignore_index, with_entropy, with_sum_p2, with_lse,
            stats_top_k, with_is_argmax,
        ),
        labels.shape,
        logits,
        labels,
        *params,
    )  # fmt: skip
    out = acc_dtype(logits.dtype)
    return tuple(o.to(out) if o.is_floating_point() else o for o in outs)


@sampler_backward.impl("cpp")
def _(logits, grad_logprobs, grad_entropy, labels, lse, entropy, cut, cut_index, inv_temperature,
      inv_temperatures, ignore_index, grad_logits):  # fmt: skip
    _backend.cpp_ops().token_logprobs_sampler_bwd(
        grad_logprobs, grad_entropy, logits, labels, lse, entropy, cut, cut_index,
        inv_temperature, inv_temperatures, ignore_index, grad_logits,
    )  # fmt: skip


@sampler_backward.impl("triton")
def _(logits, grad_logprobs, grad_entropy, labels, lse, entropy, cut, cut_index, inv_temperature,
      inv_temperatures, ignore_index, grad_logits):  # fmt: skip
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    from . import triton_sampler

    triton_sampler.sampler_backward(
        grad_logprobs, grad_entropy, logits, labels, lse, entropy, cut, cut_index,
        inv_temperature, inv_temperatures, ignore_index, grad_logits,
    )  # fmt: skip


@sampler_backward.impl("eager")
def _(logits, grad_logprobs, grad_entropy, labels, lse, entropy, cut, cut_index, inv_temperature,
      inv_temperatures, ignore_index, grad_logits):  # fmt: skip
    if logits.device.type == "cpu":
        check_labels_in_range(labels, logits.shape[-1], ignore_index)
    t = _kernel_param(inv_temperature, inv_temperatures, labels, torch.float64)
    grad_logits.copy_(
        _backend.invariant_rows(
            lambda gl, ge, x, y, ls, en, c, ci, tt: naive.sampler_backward(
                gl, ge, x, y, ls, en, c, ci, tt, ignore_index
            ),
            labels.shape,
            grad_logprobs,
            grad_entropy,
            logits,
            labels,
            lse,
            entropy,
            cut,
            cut_index,
            t,
        )
    )


def sampler_kernel_args(labels, temperature, temperatures, top_ks, top_ps, min_ps):
    """The registered op's parameters as the kernels take them: 1 / T, and per-token tensors of
    labels.numel() values (float64 / int64) for the tensors given."""
    inv_ts = None
    if temperatures is not None:
        inv_ts = _flat_param(1.0 / temperatures.to(torch.float64), labels, torch.float64)
    return (
        1.0 / temperature,
        inv_ts,
        _flat_param(top_ks, labels, torch.int64),
        _flat_param(top_ps, labels, torch.float64),
        _flat_param(min_ps, labels, torch.float64),
    )


@_backend.fake("token_logprobs_sampler")
def _(logits, labels, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps,
      sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
      with_is_argmax):  # fmt: skip
    check_devices("logits", logits, labels=labels, temperatures=temperatures, top_ks=top_ks,
                  top_ps=top_ps, min_ps=min_ps)  # fmt: skip
    out = acc_dtype(logits.dtype)
    shape = labels.shape

    def rows(on, dtype=out):
        return logits.new_empty(shape if on else (0,), dtype=dtype)

    top = (*shape, stats_top_k) if stats_top_k > 0 else (0,)
    return (
        rows(True),
        rows(with_entropy),
        rows(True),
        rows(True),
        rows(True, torch.int64),
        rows(True, torch.bool),
        rows(with_sum_p2),
        rows(with_lse),
        logits.new_empty(top, dtype=torch.int64),
        logits.new_empty(top, dtype=out),
        rows(with_is_argmax, torch.bool),
    )


@_backend.fake("token_logprobs_sampler_backward")
def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, cut, cut_index, temperature,
      temperatures, ignore_index):  # fmt: skip
    _check_backward_devices(grad_logprobs, grad_entropy, logits, labels, lse, entropy)
    check_devices("logits", logits, cut=cut, cut_index=cut_index, temperatures=temperatures)
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _register_sampler(backend: str):
    impls_f, impls_b = sampler_forward.impls, sampler_backward.impls

    @_backend.impl("token_logprobs_sampler", backend)
    def _(logits, labels, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps,
          sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
          with_is_argmax):  # fmt: skip
        inv, inv_ts, ks, ps, mps = sampler_kernel_args(
            labels, temperature, temperatures, top_ks, top_ps, min_ps
        )
        return impls_f[backend](
            logits, labels, inv, inv_ts, top_k, ks, top_p, ps, min_p, mps, sampler, ignore_index,
            with_entropy, with_sum_p2, with_lse, stats_top_k, with_is_argmax,
        )  # fmt: skip

    @_backend.impl("token_logprobs_sampler_backward", backend)
    def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, cut, cut_index, temperature,
          temperatures, ignore_index):  # fmt: skip
        inv, inv_ts, *_ = sampler_kernel_args(labels, temperature, temperatures, None, None, None)
        grad = _backend.new_output(logits.shape, logits.dtype, logits.device)
        impls_b[backend](logits, grad_logprobs, grad_entropy, labels, lse, entropy, cut,
                         cut_index, inv, inv_ts, ignore_index, grad)  # fmt: skip
        return grad


_register_sampler("triton")
_register_sampler("eager")


class _SamplerFallback(torch.autograd.Function):
    """Without the compiled extension: the eager forward and backward with autograd."""

    @staticmethod
    def forward(ctx, logits, labels, args):
        outs = _backend.python_impl("token_logprobs_sampler", "eager")(logits, labels, *args)
        ctx.save_for_backward(logits, labels, outs[2], outs[1], outs[3], outs[4])
        ctx.args = args
        ctx.mark_non_differentiable(*outs[2:])
        return outs

    @staticmethod
    def backward(ctx, glp, gent, *_):
        logits, labels, lse, ent, cut, cut_index = ctx.saved_tensors
        if glp is None:
            glp = torch.zeros_like(lse)
        a = ctx.args
        grad = _backend.python_impl("token_logprobs_sampler_backward", "eager")(
            glp, gent if ent.numel() > 0 else None, logits, labels, lse, ent, cut, cut_index,
            a[0], a[1], a[9],
        )  # fmt: skip
        return grad, None, None


@_backend.fallback("token_logprobs_sampler")
def _(logits, labels, *args):
    check_devices("logits", logits, labels=labels, temperatures=args[1], top_ks=args[3],
                  top_ps=args[5], min_ps=args[7])  # fmt: skip
    if logits.device.type == "cpu" or _backend.strict():
        check_labels_in_range(labels, logits.shape[-1], args[9])
    return _SamplerFallback.apply(logits, labels, args)
