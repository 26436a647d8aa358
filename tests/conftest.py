import os

import torch

# Without a GPU, Triton kernels run through the interpreter; this must be set before triton is
# imported (our Triton modules are imported lazily, on first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# logits_dtype="auto" (the default of the fused-head ops) resolves by the machine's bf16 support;
# the suite pins it to float32 tiles so that every test means the same on every machine. Each
# mode is tested by name, and "auto" itself in test_linear_logprobs.py (test_auto_logits_dtype_*).
os.environ.setdefault("PPO_KERNELS_LOGITS_DTYPE", "float32")

import pytest  # noqa: E402
from _skip_summary import pytest_configure, pytest_terminal_summary  # noqa: E402,F401

from ppo_kernels import _backend  # noqa: E402


def cpu_backends(op):
    """Backends that can run `op` on CPU tensors here (triton only through the interpreter)."""
    out = []
    for b in _backend.BACKENDS:
        if _backend.available(op, b, "cpu")[0]:
            out.append(b)
    return out


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
