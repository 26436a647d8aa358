"""Output buffers the Python kernels allocate (the C++ kernels: csrc/common/alloc.h), and the test
hook that NaN-poisons them in both languages, so that an element a kernel forgets to write shows."""

from __future__ import annotations

import torch

from ._extension import HAS_EXTENSION

_poison = [False]


def set_poison(enabled: bool) -> bool:
    """Test hook: NaN-fill (ints: -1) every output buffer the kernels allocate, in C++ and Python.
    Returns the previous setting."""
    old = _poison[0]
    _poison[0] = bool(enabled)
    if HAS_EXTENSION:
        torch.ops.ppo_kernels_C.set_poison(bool(enabled))
    return old


def new_output(shape, dtype, device) -> torch.Tensor:
    """torch.empty for kernel outputs (poisoned under set_poison(True))."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _poison[0]:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t
