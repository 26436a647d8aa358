"""The public API of full_kl (typed arguments, defaults, the vocab-parallel form). Tensor checks
(dtype, shape, device, strides) run once, in the registered op (csrc/ops/full_kl.cpp); this layer
checks the Python scalars, normalises the mask and routes `process_group=` to
ppo_kernels/distributed/vocab_parallel.py."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import FLOAT_DTYPES, check_arg, check_temperature, check_tensor
from . import op  # noqa: F401  (registers the ops' Python side)

_full_kl = _backend.op("full_kl")
_full_kl_rows = _backend.op("full_kl_row_temperature")


def _check_args(logits, ref_logits, temperature, vocab_parallel):
    """The registered op's checks, where it does not run them: the vocab-parallel form (whose
    slice may be empty) and the fallback without the compiled extension."""
    check_temperature(temperature)
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_tensor("ref_logits", ref_logits, dtypes=(logits.dtype,))
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
    if V == 0 and logits.shape[:-1].numel() > 0 and not vocab_parallel:
        raise ValueError("logits: the vocabulary dimension (last) is empty")


def full_kl(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float | Tensor = 1.0,
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
        temperature: positive float applied to both (a runtime value: no recompiles), or a float
            tensor of per-row values whose shape is a leading part of logits.shape[:-1] (`[B]`
            per sequence or `[B, T]` per token for `[B, T, V]` logits), e.g. a rollout's
            per-request temperatures. No gradient flows to it.
        mask: optional `logits.shape[:-1]` tensor; rows with mask == 0 give 0 (and no gradient)
            and are not read.

        process_group: vocab-parallel form: both logits hold this rank's contiguous slice of the
            vocabulary (the same slice); every rank gets the full-vocabulary KL (one all-gather
            of three numbers per row) and its slice of the gradients.

    Returns:
        float32 KL with shape `logits.shape[:-1]` (float64 for float64 logits).
    See ppo_kernels/full_kl/naive.py for the documented edge cases.
    """
    per_row = isinstance(temperature, Tensor)
    if type(temperature) is not float and not per_row:  # the op checks the value (floats: free)
        temperature = check_temperature(temperature)
    if not (isinstance(logits, Tensor) and isinstance(ref_logits, Tensor)):
        check_tensor("logits", logits)
        check_tensor("ref_logits", ref_logits)
    # devices before dispatch: a meta tensor would pick the fake kernel (two CPU tensors: no
    # device objects to build)
    if not (logits.is_cpu and ref_logits.is_cpu) and ref_logits.device != logits.device:
        raise ValueError(
            f"ref_logits: expected device {logits.device} (like logits), got {ref_logits.device}"
        )
    if mask is not None:
        check_arg("mask", mask, logits.device, shape=logits.shape[:-1], what="logits.shape[:-1]")
        if mask.dtype != torch.bool:
            mask = mask != 0
        mask = mask.contiguous()
    if per_row:
        check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES)
        rows = tuple(logits.shape[:-1])
        if temperature.device != logits.device:
            raise ValueError(
                f"temperature: expected device {logits.device} (like logits), "
                f"got {temperature.device}"
            )
        if tuple(temperature.shape) != rows[: temperature.dim()]:
            raise ValueError(
                "temperature: expected a shape that is a leading part of logits.shape[:-1] "
                f"{rows} (per row or per token), got {tuple(temperature.shape)}"
            )
        if process_group is not None:
            raise ValueError(
                "process_group: per-row temperatures are not supported with the vocab-parallel "
                "form yet"
            )
        if not _backend.HAS_EXTENSION:
            _check_args(logits, ref_logits, 1.0, vocab_parallel=False)
            if not bool((temperature > 0).all()):
                raise ValueError("temperature: expected positive values")
        kl, _, _ = _full_kl_rows(logits, ref_logits, temperature, mask)
        return kl
    if process_group is not None:
        _check_args(logits, ref_logits, temperature, vocab_parallel=True)
        from ..distributed.vocab_parallel import vocab_parallel_full_kl

        return vocab_parallel_full_kl(logits, ref_logits, temperature, mask, process_group)
    if not _backend.HAS_EXTENSION:
        _check_args(logits, ref_logits, temperature, vocab_parallel=False)
    kl, _, _ = _full_kl(logits, ref_logits, float(temperature), mask)
    return kl
