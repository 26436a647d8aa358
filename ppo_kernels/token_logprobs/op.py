"""token_logprobs as torch ops: `ppo_kernels::token_logprobs` (forward) and its backward ops, with
fake kernels and registered autograd. Each call picks a backend (see ppo_kernels/_backend.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_bool,
    check_int,
    check_labels_in_range,
    check_same_device,
    check_temperature,
    check_tensor,
)
from . import reference

OP = _backend.register_op(
    "token_logprobs", kernel="token_logprobs_fwd", triton=True, cuda_default="triton"
)


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
        reference.forward,
        labels.shape,
        logits,
        labels,
        1.0 / inv_temperature,
        ignore_index,
        with_entropy,
    )
    out = _backend.out_dtype(logits)
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
            reference.backward,
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


def _check_forward_args(logits, labels, temperature, ignore_index):
    """What the registered forward op is given, whoever calls it (metadata only)."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg(
        "labels",
        labels,
        logits.device,
        dtypes=INDEX_DTYPES,
        shape=logits.shape[:-1],
        what="logits.shape[:-1]",
    )
    if logits.shape[-1] == 0 and labels.numel() > 0:
        raise ValueError("logits: the vocabulary dimension (last) is empty")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            "logits: the last (vocabulary) dimension must be contiguous (stride 1); "
            f"got strides {tuple(logits.stride())}"
        )
    check_temperature(temperature)
    check_int("ignore_index", ignore_index)


def _check_backward_args(
    grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index
):
    """The backward ops' arguments (shapes, dtypes, devices): a wrong one is an error naming it,
    never an out-of-bounds read. Label ranges are checked where the forward checks them: by every
    CPU kernel (an IndexError), on the GPU only under strict_checks() (else NaN rows)."""
    _check_forward_args(logits, labels, temperature, ignore_index)
    rows, dev = logits.shape[:-1], logits.device
    check_arg(
        "grad_logprobs",
        grad_logprobs,
        dev,
        dtypes=FLOAT_DTYPES,
        shape=rows,
        what="logits.shape[:-1]",
    )
    check_arg(
        "lse", lse, dev, dtypes=(_backend.out_dtype(logits),), shape=rows, what="logits.shape[:-1]"
    )
    if grad_entropy is not None and grad_entropy.numel() > 0:
        check_arg(
            "grad_entropy",
            grad_entropy,
            dev,
            dtypes=FLOAT_DTYPES,
            shape=rows,
            what="logits.shape[:-1]",
        )
        check_arg(
            "entropy",
            entropy,
            dev,
            dtypes=(_backend.out_dtype(logits),),
            shape=rows,
            what="logits.shape[:-1]",
        )
    if logits.device.type == "cuda" and _backend.strict():  # the CPU kernels check it themselves
        check_labels_in_range(labels, logits.shape[-1], ignore_index)


@torch.library.custom_op("ppo_kernels::token_logprobs", mutates_args=())
def token_logprobs_op(
    logits: Tensor,
    labels: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    inplace_backward: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (logprobs, entropy or an empty tensor, lse); lse is saved for backward."""
    _check_forward_args(logits, labels, temperature, ignore_index)
    return forward(logits, labels, 1.0 / temperature, ignore_index, with_entropy)


@token_logprobs_op.register_fake
def _(logits, labels, temperature, ignore_index, with_entropy, inplace_backward):
    out = _backend.out_dtype(logits)
    lp = logits.new_empty(labels.shape, dtype=out)
    ent = logits.new_empty(labels.shape if with_entropy else (0,), dtype=out)
    return lp, ent, logits.new_empty(labels.shape, dtype=out)


def _run_backward(
    grad_logprobs,
    grad_entropy,
    logits,
    labels,
    lse,
    entropy,
    temperature,
    ignore_index,
    grad_logits,
):
    _check_backward_args(
        grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index
    )
    backward(
        logits,
        grad_logprobs,
        grad_entropy,
        labels,
        lse,
        entropy,
        1.0 / temperature,
        ignore_index,
        grad_logits,
    )


@torch.library.custom_op("ppo_kernels::token_logprobs_backward", mutates_args=())
def token_logprobs_backward_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    temperature: float,
    ignore_index: int,
) -> Tensor:
    grad = _backend.new_output(logits.shape, logits.dtype, logits.device)
    _run_backward(
        grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index, grad
    )
    return grad


@token_logprobs_backward_op.register_fake
def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("ppo_kernels::token_logprobs_backward_", mutates_args=("logits",))
def token_logprobs_backward_inplace_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    temperature: float,
    ignore_index: int,
) -> None:
    """Overwrites `logits` with the gradient (flash-attn's inplace_backward)."""
    _run_backward(
        grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index, logits
    )


@token_logprobs_backward_inplace_op.register_fake
def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
    return None


def _setup_context(ctx, inputs, output):
    logits, labels, temperature, ignore_index, with_entropy, inplace_backward = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, labels, lse, entropy)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.inplace = inplace_backward
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_lp, grad_ent, grad_lse):
    logits, labels, lse, entropy = ctx.saved_tensors
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse, dtype=torch.float32)
    if grad_ent is not None and grad_ent.numel() == 0:
        grad_ent = None
    args = (grad_lp, grad_ent, logits, labels, lse, entropy, ctx.temperature, ctx.ignore_index)
    if ctx.inplace:
        torch.ops.ppo_kernels.token_logprobs_backward_(*args)
        grad = logits
    else:
        grad = torch.ops.ppo_kernels.token_logprobs_backward(*args)
    return grad, None, None, None, None, None


token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    process_group=None,
    vocab_start: int | None = None,
):
    """Log-probability of each label under softmax(logits / temperature), fused in one pass.

    Args:
        logits: `[..., V]` float32, bfloat16 or float16 (float64 runs the float64 reference). The
            leading dimensions may have any strides (e.g. `logits[:, :-1]` is read without a
            copy); the last dimension must be contiguous.
        labels: int64 or int32 with shape `logits.shape[:-1]`.
        temperature: positive float, a runtime value (no kernel recompiles).
        ignore_index: positions with this label give 0 (log-prob and entropy) and no gradient.
        return_entropy: also return the entropy of softmax(logits / temperature).
        inplace_backward: write the gradient into the logits buffer instead of allocating one
            (the logits must not be needed by anything else afterwards).
        process_group: vocab-parallel (tensor-parallel) form: `logits` is this rank's contiguous
            slice `[..., V_rank]` of the vocabulary (slices may be uneven), `labels` are global
            ids; every rank gets the full-vocabulary results (one all-gather of per-row softmax
            statistics; see ppo_kernels/distributed/vocab_parallel.py). The gradient of each
            rank's slice is its slice of the unsharded gradient.
        vocab_start: this rank's first vocabulary id; default: slices contiguous in rank order,
            settled from the forward's own gather (a new uneven layout costs one more gather,
            then it is cached; under torch.compile it cannot: give vocab_start for uneven
            shards there, or a clear error says so).

    Returns:
        float32 log-probs with `labels.shape` (float64 for float64 logits), or the pair
        `(logprobs, entropy)` when `return_entropy=True`.
    See ppo_kernels/token_logprobs/reference.py for the documented edge cases.
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_tensor("labels", labels, dtypes=INDEX_DTYPES)
    check_same_device(logits=logits, labels=labels)
    temperature = check_temperature(temperature)
    ignore_index = check_int("ignore_index", ignore_index)
    return_entropy = check_bool("return_entropy", return_entropy)
    inplace_backward = check_bool("inplace_backward", inplace_backward)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
            f"got {tuple(labels.shape)}"
        )
    if logits.shape[-1] == 0 and labels.numel() > 0 and process_group is None:
        raise ValueError("logits: the vocabulary dimension (last) is empty")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            "logits: the last (vocabulary) dimension must be contiguous (stride 1); "
            f"got strides {tuple(logits.stride())}"
        )
    if logits.device.type == "cuda" and _backend.strict():
        check_labels_in_range(labels, logits.shape[-1], ignore_index)  # host sync, by request
    if process_group is not None:
        if inplace_backward:
            raise ValueError("inplace_backward: not supported with process_group")
        from ..distributed import vocab_parallel_token_logprobs

        return vocab_parallel_token_logprobs(
            logits, labels, temperature, ignore_index, return_entropy, process_group, vocab_start
        )
    _check_forward_args(logits, labels, temperature, ignore_index)
    lp, ent, _ = torch.ops.ppo_kernels.token_logprobs(
        logits, labels, float(temperature), ignore_index, return_entropy, inplace_backward
    )
    return (lp, ent) if return_entropy else lp
