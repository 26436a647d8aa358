"""Shared by the SIMT-emulator tests (tests/simt/, marker `simt`): the CUDA kernels of
csrc/cuda/*.cuh compiled by g++ into ppo_kernels._simt (PPO_KERNELS_BUILD_SIMT=1) and run on the
CPU by the emulator of csrc/testing/. `emulated(...)` routes the public ops' `cpp` backend to them
(torch.ops.ppo_kernels_simt), so a test exercises the op, its argument checks and its autograd
around the CUDA kernels, with every output NaN-poisoned."""

import contextlib

import pytest
import torch

from ppo_kernels import _backend

from .skips import NO_SIMT
from .utils import poisoned

try:
    from ppo_kernels import _simt  # noqa: F401  (registers torch.ops.ppo_kernels_simt.*)

    HAS_SIMT = True
except ImportError:
    HAS_SIMT = False

# Every test of these modules: marker `simt`, skipped (not failed) without the extension.
MARKS = [
    pytest.mark.simt,
    pytest.mark.skipif(not HAS_SIMT, reason=NO_SIMT),
]

# Seeds of the fiber order, the block order and the guard-page side: each kernel test runs under
# every one of them.
SEEDS = (0, 1)


@contextlib.contextmanager
def emulated(seed, *, sm_count=4, max_row_blocks=1 << 20, **backends):
    """The `cpp` backend's kernels are the emulated CUDA kernels for the duration. sm_count is the
    multiprocessor count GAE plans its chunks with; max_row_blocks the grid-stride threshold of
    the one-block-per-row kernels (2^20 on a GPU)."""
    ops = torch.ops.ppo_kernels_simt
    ops.set_seed(seed)
    ops.set_geometry(sm_count, max_row_blocks)
    ops.launches()  # clear the launch log
    try:
        with (
            _backend.use_cpp_namespace("ppo_kernels_simt"),
            _backend.use_backend(**(backends or {"default": "cpp"})),
            poisoned(),
        ):
            yield
    finally:
        ops.set_geometry()


def launches():
    """["kernel grid=G block=B", ...] of the emulated launches since the last call."""
    return list(torch.ops.ppo_kernels_simt.launches())
