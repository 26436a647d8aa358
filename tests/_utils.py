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
    torch.float16: dict(atol=1e-6, rtol=2e-3),  # rounding to fp16: 2^-11 relative
}


@contextlib.contextmanager
def poisoned():
    """Every output buffer a kernel allocates starts NaN-filled (ints: -1)."""
    old = _backend.set_poison(True)
    try:
        yield
    finally:
        _backend.set_poison(old)


# Op-specific bounds, looser than TOL for a reason of the computation:
# gae: a float32 scan against float64. With gamma * lam < 1 a rounding error decays within about
# 1 / (1 - gamma * lam) steps; with gamma = lam = 1 the scan is a plain running sum over the whole
# row (up to 20000 positions in tests/cuda), where rounding accumulates.
SCAN_TOL = dict(atol=1e-4, rtol=1e-4)
SUM_SCAN_TOL = dict(atol=1e-2, rtol=1e-4)
# linear_token_logprobs: the logits come out of a GEMM (float32 accumulation over H in an order of
# the GPU's choosing), then the same float32 reductions as token_logprobs.
GEMM_TOL = dict(atol=1e-4, rtol=1e-4)
# ... and its gradients, with atol relative to the largest |gradient| (tests/cuda/_gpu.close_scaled):
# bf16/fp16 round the logits-gradient tile to the input dtype before the backward GEMMs, an error
# of up to 2^-8 relative on each of the V (or N) terms of a sum.
GEMM_GRAD_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
}


class PassThroughMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that changes nothing: calls under it take an op's traceable autograd path
    (its torch::autograd::Function and registered backward op) instead of a hand-built graph
    node (csrc/ops/plain_node.h)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
