"""Test helpers: NaN-poisoning of kernel outputs and the documented tolerances."""
import contextlib
import os
import sys

import torch

from ppo_kernels import _backend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from _common import peak_extra_bytes  # noqa: E402,F401  (the benchmarks' exact peak-memory probe)

# Tolerances of a float32-accumulating kernel against the float64 reference, per input dtype. The
# inputs are rounded to the dtype before the reference sees them, so forward outputs (float32)
# only carry float32 accumulation error; gradients are also rounded to the input dtype on output.
TOL = {
    torch.float32: dict(atol=5e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=5e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-5, rtol=2e-5),
}
GRAD_TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),  # rounding to bf16: 2^-8 relative
    torch.float16: dict(atol=1e-6, rtol=2e-3),     # rounding to fp16: 2^-11 relative
}


@contextlib.contextmanager
def poisoned():
    """Every output buffer a kernel allocates starts NaN-filled (ints: -1)."""
    old = _backend.set_poison(True)
    try:
        yield
    finally:
        _backend.set_poison(old)
