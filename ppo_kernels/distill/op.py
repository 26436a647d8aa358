"""The distillation tile kernels as `_backend.Kernel` objects, one implementation per backend with
one signature: `forward` (the divergence per row and what the backward needs) and `backward_`
(the student tile's gradient, written over the student tile). The cpp backend is
csrc/cpu/distill.cpp (`ppo_kernels_C::distill_fwd` / `distill_bwd_`); there is no CUDA C++
version: on CUDA the Triton kernels run (the cpp implementation hands a CUDA tile to them, or to
the eager math without triton, and says so once). Semantics and edge cases: naive.py.

The fused distillation loss from hidden states (its registered op and public function) will run
these on its row blocks' tiles; until then the backend key `distill` has no public name."""

from __future__ import annotations

import math

import torch

from .. import _backend
from .._checks import check_devices, check_labels_in_range, device_error
from . import naive

DIVERGENCES = naive.DIVERGENCES  # = csrc/common/distill_host.h distill_divergence_names()

OP = _backend.register_op(
    "distill",
    kernel="distill_fwd",
    triton=True,
    cuda_default="triton",
    public=(),
    folder="distill",
    delegates={
        ("cpp", "cuda"): "no CUDA C++ distillation tile kernels: the Triton ones (eager without "
        "triton)",
    },
)

forward = _backend.Kernel("distill", "forward")
backward_ = _backend.Kernel("distill", "backward_")  # writes the gradient over the student tile

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _tensor(name, t, device, floating):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if floating and t.dtype not in _FLOATS:
        raise TypeError(
            f"{name}: expected a float dtype (float32, bfloat16, float16, float64), got {t.dtype}"
        )
    if t.device != device:
        raise device_error(name, t, device, "student")


def _rows(name, t, N):
    if t.numel() != N:
        raise ValueError(
            f"{name}: expected {N} elements (student.shape[0]), got shape {tuple(t.shape)}"
        )


def check_tiles(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index):
    """The raw kernels' checks (csrc/common/distill_host.h) for the triton and eager
    implementations: every backend refuses the same calls with the same errors."""
    _tensor("student", student, getattr(student, "device", None), True)
    dev = student.device
    _tensor("teacher", teacher, dev, True)
    if student.dim() != 2:
        raise ValueError(f"student: expected a [N, V] tile, got shape {tuple(student.shape)}")
    if teacher.shape != student.shape:
        raise ValueError(
            f"teacher: expected shape {tuple(student.shape)} (like student), got {tuple(teacher.shape)}"
        )
    if teacher.dtype != student.dtype:
        raise TypeError(
            f"teacher: expected dtype {student.dtype} (like student), got {teacher.dtype}"
        )
    N, V = student.shape
    if V > 1 and (student.stride(1) != 1 or teacher.stride(1) != 1):
        raise ValueError("student, teacher: the vocabulary (last) dimension must be contiguous")
    if V == 0 and N > 0:
        raise ValueError(f"student: the vocabulary dimension is empty but there are {N} rows")
    inv = float(inv_temperature)
    if not (inv > 0 and math.isfinite(inv) and inv <= torch.finfo(torch.float32).max):
        raise ValueError(
            f"inv_temperature: expected a positive value finite in float32, got {inv_temperature}"
        )
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence: unknown mode {divergence!r}; expected one of {DIVERGENCES}")
    if divergence == "jsd" and not 0 < beta < 1:
        raise ValueError(
            f"beta: jsd needs 0 < beta < 1 (beta 0 is forward_kl, 1 is reverse_kl), got {beta}"
        )
    if labels is not None:
        _tensor("labels", labels, dev, False)
        if labels.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"labels: expected dtype int64 or int32, got {labels.dtype}")
        _rows("labels", labels, N)
        if labels.is_cpu:
            check_labels_in_range(labels, V, ignore_index)
    if mask is not None:
        _tensor("mask", mask, dev, False)
        _rows("mask", mask, N)


def _check_rows(student, **rows):
    N = student.shape[0] if student.dim() == 2 else -1
    for name, t in rows.items():
        if t is None:
            continue
        _tensor(name, t, student.device, True)
        _rows(name, t, N)


def _delegate(device_type):
    to = "triton" if device_type == "cuda" and _backend.HAS_TRITON else "eager"
    _backend.note_delegation("distill", "cpp", device_type, f"the tiles run on the {to} kernels")
    return to


@forward.impl("cpp")
def _(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index):
    # The C++ kernels are registered for the CPU only: a tensor on another device would send the
    # call to a dispatch key without a kernel, so the devices are compared first (metadata only).
    check_devices("student", student, teacher=teacher, labels=labels, mask=mask)
    if not _backend.has_compiled_kernel("distill_fwd", student.device.type):
        return forward.impls[_delegate(student.device.type)](
            student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index
        )
    return _backend.cpp_ops().distill_fwd(
        student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index
    )


@forward.impl("triton")
def _(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index):
    from . import triton_kernels

    check_tiles(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index)
    return triton_kernels.forward(
        student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index
    )


@forward.impl("eager")
def _(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index):
    check_tiles(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index)
    with _backend.invariant_threads():
        return _backend.invariant_rows(
            naive.forward, student.shape[:1], student, teacher, labels, mask, inv_temperature,
            divergence, beta, ignore_index,
        )  # fmt: skip


def _check_backward(student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
                    inv_temperature, divergence, beta, ignore_index):  # fmt: skip
    check_tiles(student, teacher, labels, mask, inv_temperature, divergence, beta, ignore_index)
    _check_rows(student, lse_student=lse_s, lse_teacher=lse_t, aux=aux, grad=grad)
    if grad_hard is not None:
        if labels is None:
            raise ValueError("labels: a hard-label gradient (grad_hard) needs them")
        if lse_hard is None:
            raise ValueError("lse_hard: a hard-label gradient (grad_hard) needs it (the forward's)")
        _check_rows(student, grad_hard=grad_hard, lse_hard=lse_hard)


@backward_.impl("cpp")
def _(student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
      inv_temperature, divergence, beta, ignore_index):  # fmt: skip
    args = (student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
            inv_temperature, divergence, beta, ignore_index)  # fmt: skip
    check_devices("student", student, teacher=teacher, labels=labels, mask=mask,
                  lse_student=lse_s, lse_teacher=lse_t, aux=aux, lse_hard=lse_hard, grad=grad,
                  grad_hard=grad_hard)  # fmt: skip
    if not _backend.has_compiled_kernel("distill_bwd_", student.device.type):
        return backward_.impls[_delegate(student.device.type)](*args)
    _backend.cpp_ops().distill_bwd_(*args)


@backward_.impl("triton")
def _(student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
      inv_temperature, divergence, beta, ignore_index):  # fmt: skip
    from . import triton_kernels

    args = (student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
            inv_temperature, divergence, beta, ignore_index)  # fmt: skip
    _check_backward(*args)
    triton_kernels.backward_(*args)


@backward_.impl("eager")
def _(student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
      inv_temperature, divergence, beta, ignore_index):  # fmt: skip
    args = (student, teacher, labels, mask, lse_s, lse_t, aux, lse_hard, grad, grad_hard,
            inv_temperature, divergence, beta, ignore_index)  # fmt: skip
    _check_backward(*args)
    with _backend.invariant_threads():
        (g,) = _backend.invariant_rows(lambda *a: (naive.grad_tile(*a),), student.shape[:1], *args)
    student.copy_(g)
