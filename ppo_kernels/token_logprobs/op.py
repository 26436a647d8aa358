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
