"""Shared pieces of the `cuda` tests: the GPU correctness checks that bench/gpu_check.py runs
(`pytest -m cuda tests/cuda`). Each compares the GPU backends (CUDA C++ as `cpp`, and Triton)
against the float64 reference computed on the GPU, with the tolerances of support/utils.py and
NaN-poisoned outputs, at sizes up to the production ones.

Without a GPU they skip. PPO_KERNELS_CUDA_TESTS_DEVICE=cpu runs their logic on the CPU instead (the
C++ CPU kernels and Triton through the interpreter; the large cases and the CUDA-graph captures
skip): a check of the tests themselves on a machine without a GPU.
"""

import os

import pytest
import torch

from ppo_kernels import _backend

from .skips import CUDA_DRY_RUN, requires_cuda

DEVICE = os.environ.get("PPO_KERNELS_CUDA_TESTS_DEVICE", "cuda")
DRY_RUN = DEVICE != "cuda"

# The `pytestmark` of every module here.
MARKS = [pytest.mark.cuda] + ([] if DRY_RUN else [requires_cuda])


def big(*values):
    """A parametrize case too large for the CPU dry run (it still runs on the GPU)."""
    return pytest.param(*values, marks=pytest.mark.skipif(DRY_RUN, reason=CUDA_DRY_RUN))


def require(op, backend):
    """The backend must run here: on the GPU a missing kernel is a failure, not a skip."""
    ok, why = _backend.available(op, backend, DEVICE)
    assert ok, f"{backend} backend of {op} unavailable on {DEVICE}: {why}"


def close(got, want, atol, rtol):
    """`got` (any float dtype) against the float64 reference: NaN and +-inf must match too."""
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, equal_nan=True)


def close_scaled(got, want, atol, rtol, scale=None):
    """As close(), with atol relative to the largest |reference| (e.g. gradients of a mean over
    many tokens, which are all far below an absolute tolerance meant for O(1) values), or to
    `scale` when given (where the reference can be all zero: a one-token vocabulary's gradient is
    exactly 0 in float64 and 1 - p rounds to ~1e-7 in float32)."""
    s = float(want.abs().max()) if scale is None else float(scale)
    close(got, want, atol * s, rtol)


def graph_replay(fn, change_inputs=None, capture_error_mode="global"):
    """Capture fn() in a CUDA graph (after a warm-up on a side stream, where Triton compiles),
    optionally change the inputs in place, replay, and return the outputs of the replay. A host
    sync inside fn makes the capture fail. capture_error_mode "thread_local" tolerates
    capture-unsafe calls made by other threads (e.g. autograd's device thread runs the backward),
    for telling those apart from unsafe calls in the capturing thread."""
    if DRY_RUN:
        pytest.skip(CUDA_DRY_RUN)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # a host sync in the warm-up raises here, naming the op (in the capture it only invalidates
    # the capture: "operation failed due to a previous error during capture")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        out = fn()
    if change_inputs is not None:
        change_inputs()
    graph.replay()
    torch.cuda.synchronize()
    return out
