"""full_kl as torch ops: `ppo_kernels::full_kl` (forward) and `ppo_kernels::full_kl_backward`, with
fake kernels, registered autograd and a backend per call. Semantics: reference.py next to this."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    check_arg,
    check_bool,
    check_same_device,
    check_temperature,
    check_tensor,
)
from . import reference

_backend.register_op("full_kl", kernel="full_kl_fwd", triton=True, cuda_default="triton")


# The kernels, one implementation per backend with one signature (inv_temperature = 1 / T).
forward = _backend.Kernel("full_kl", "forward")
backward = _backend.Kernel("full_kl", "backward")  # writes grad_logits (and grad_ref_logits)


@forward.impl("cpp")
def _(logits, ref_logits, mask, inv_temperature):
    return _backend.cpp_ops().full_kl_fwd(logits, ref_logits, mask, inv_temperature)


@forward.impl("triton")
def _(logits, ref_logits, mask, inv_temperature):
    from . import triton_kernels

    return triton_kernels.forward(logits, ref_logits, mask, inv_temperature)


@forward.impl("eager")
def _(logits, ref_logits, mask, inv_temperature):
    kl, lz, lw = _backend.invariant_rows(
        reference.forward, logits.shape[:-1], logits, ref_logits, 1.0 / inv_temperature, mask
    )
    o = _backend.out_dtype(logits)
    return kl.to(o), lz.to(o), lw.to(o)


@backward.impl("cpp")
def _(logits, grad, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref):
    _backend.cpp_ops().full_kl_bwd(
        grad, logits, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref
    )


@backward.impl("triton")
def _(logits, grad, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref):
    from . import triton_kernels

    triton_kernels.backward(
        grad, logits, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref
    )


@backward.impl("eager")
def _(logits, grad, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref):
    gz, gw = _backend.invariant_rows(
        reference.backward,
        logits.shape[:-1],
        grad,
        logits,
        ref_logits,
        kl,
        lse_z,
        lse_w,
        1.0 / inv_temperature,
        mask,
        grad_ref is not None,
    )
    grad_logits.copy_(gz)
    if grad_ref is not None:
        grad_ref.copy_(gw)


def _check_forward_args(logits, ref_logits, temperature, mask):
    """What the registered forward op is given, whoever calls it (metadata only)."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg(
        "ref_logits",
        ref_logits,
        logits.device,
        dtypes=(logits.dtype,),
        shape=logits.shape,
        what="like logits",
    )
    V = logits.shape[-1]
    for name, t in (("logits", logits), ("ref_logits", ref_logits)):
        if t.stride(-1) != 1 and V > 1:
            raise ValueError(
                f"{name}: the last (vocabulary) dimension must be contiguous (stride 1); "
                f"got strides {tuple(t.stride())}"
            )
    if V == 0 and logits.shape[:-1].numel() > 0:
        raise ValueError("logits: the vocabulary dimension (last) is empty")
    check_temperature(temperature)
    check_arg(
        "mask",
        mask,
        logits.device,
        shape=logits.shape[:-1],
        what="logits.shape[:-1]",
        allow_none=True,
    )


def _check_backward_args(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperature, need_ref):
    """The backward op's arguments: a wrong size, dtype or device is an error naming it, never an
    out-of-bounds read."""
    _check_forward_args(logits, ref_logits, temperature, mask)
    rows, dev, out = logits.shape[:-1], logits.device, (_backend.out_dtype(logits),)
    check_arg("grad", grad, dev, dtypes=FLOAT_DTYPES, shape=rows, what="logits.shape[:-1]")
    for name, t in (("kl", kl), ("lse_z", lse_z), ("lse_w", lse_w)):
        check_arg(name, t, dev, dtypes=out, shape=rows, what="logits.shape[:-1]")
    check_bool("need_ref", need_ref)


@torch.library.custom_op("ppo_kernels::full_kl", mutates_args=())
def full_kl_op(
    logits: Tensor, ref_logits: Tensor, temperature: float, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, lse_z, lse_w); the two log-sum-exps are saved for backward."""
    _check_forward_args(logits, ref_logits, temperature, mask)
    return forward(logits, ref_logits, mask, 1.0 / temperature)


@full_kl_op.register_fake
def _(logits, ref_logits, temperature, mask):
    shape, o = logits.shape[:-1], _backend.out_dtype(logits)
    return tuple(logits.new_empty(shape, dtype=o) for _ in range(3))


@torch.library.custom_op("ppo_kernels::full_kl_backward", mutates_args=())
def full_kl_backward_op(
    grad: Tensor,
    logits: Tensor,
    ref_logits: Tensor,
    mask: Tensor | None,
    kl: Tensor,
    lse_z: Tensor,
    lse_w: Tensor,
    temperature: float,
    need_ref: bool,
) -> tuple[Tensor, Tensor]:
    """(grad_logits, grad_ref_logits or an empty tensor)."""
    _check_backward_args(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperature, need_ref)
    gz = _backend.new_output(logits.shape, logits.dtype, logits.device)
    gw = (
        _backend.new_output(ref_logits.shape, ref_logits.dtype, ref_logits.device)
        if need_ref
        else ref_logits.new_empty(0)
    )
    backward(
        logits,
        grad,
        ref_logits,
        mask,
        kl,
        lse_z,
        lse_w,
        1.0 / temperature,
        gz,
        gw if need_ref else None,
    )
    return gz, gw


@full_kl_backward_op.register_fake
def _(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperature, need_ref):
    return (
        torch.empty(logits.shape, dtype=logits.dtype, device=logits.device),
        torch.empty(
            ref_logits.shape if need_ref else (0,), dtype=ref_logits.dtype, device=ref_logits.device
        ),
    )


def _setup_context(ctx, inputs, output):
    logits, ref_logits, temperature, mask = inputs
    kl, lse_z, lse_w = output
    ctx.save_for_backward(logits, ref_logits, mask, kl, lse_z, lse_w)
    ctx.temperature = temperature
    ctx.mark_non_differentiable(lse_z, lse_w)


def _backward(ctx, grad_kl, _gz, _gw):
    logits, ref_logits, mask, kl, lse_z, lse_w = ctx.saved_tensors
    need_ref = ctx.needs_input_grad[1]
    gz, gw = torch.ops.ppo_kernels.full_kl_backward(
        grad_kl, logits, ref_logits, mask, kl, lse_z, lse_w, ctx.temperature, need_ref
    )
    return gz, (gw if need_ref else None), None, None


full_kl_op.register_autograd(_backward, setup_context=_setup_context)


def full_kl(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    process_group=None,
) -> Tensor:
    """Exact KL(pi || pi_ref) per token over the whole vocabulary, in one pass over both logits
    tensors (online max and sums for both distributions; no N x V temporary).

    Args:
        logits: `[..., V]` policy logits, float32 / bfloat16 / float16 (float64 runs the float64
            reference). Leading dims may have any strides (e.g. `logits[:, :-1]`), the last must be
            contiguous. Gradient flows to it.
        ref_logits: the reference model's logits, same shape and dtype, own strides. Gradient
            flows to it only if it requires grad.
        temperature: positive float applied to both (a runtime value: no recompiles).
        mask: optional `logits.shape[:-1]` tensor; rows with mask == 0 give 0 (and no gradient)
            and are not read.

        process_group: vocab-parallel form: both logits hold this rank's contiguous slice of the
            vocabulary (the same slice); every rank gets the full-vocabulary KL (one all-gather
            of three numbers per row) and its slice of the gradients.

    Returns:
        float32 KL with shape `logits.shape[:-1]` (float64 for float64 logits).
    See ppo_kernels/full_kl/reference.py for the documented edge cases.
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_tensor("ref_logits", ref_logits, dtypes=FLOAT_DTYPES)
    check_same_device(logits=logits, ref_logits=ref_logits, mask=mask)
    if ref_logits.dtype != logits.dtype:
        raise TypeError(
            f"ref_logits: expected dtype {logits.dtype} (like logits), got {ref_logits.dtype}"
        )
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(
            f"ref_logits: expected shape {tuple(logits.shape)} (logits.shape), "
            f"got {tuple(ref_logits.shape)}"
        )
    V = logits.shape[-1]
    for name, t in (("logits", logits), ("ref_logits", ref_logits)):
        if t.stride(-1) != 1 and V > 1:
            raise ValueError(
                f"{name}: the last (vocabulary) dimension must be contiguous (stride 1); "
                f"got strides {tuple(t.stride())}"
            )
    if V == 0 and logits.shape[:-1].numel() > 0 and process_group is None:
        raise ValueError("logits: the vocabulary dimension (last) is empty")
    temperature = check_temperature(temperature)
    if mask is not None:
        check_arg("mask", mask, logits.device, shape=logits.shape[:-1], what="logits.shape[:-1]")
        mask = (mask if mask.dtype == torch.bool else mask != 0).contiguous()
    if process_group is not None:
        from ..distributed.vocab_parallel import vocab_parallel_full_kl

        return vocab_parallel_full_kl(logits, ref_logits, temperature, mask, process_group)
    _check_forward_args(logits, ref_logits, temperature, mask)
    kl, _, _ = torch.ops.ppo_kernels.full_kl(logits, ref_logits, float(temperature), mask)
    return kl
