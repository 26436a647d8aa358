import os
import random

import torch

# Without a GPU, Triton kernels run through the interpreter; this must be set before triton is
# imported (our Triton modules are imported lazily, on first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# logits_dtype="auto" (the default of the fused-head ops) resolves by the machine's bf16 support;
# the suite pins it to float32 tiles so that every test means the same on every machine. Each
# mode is tested by name, and "auto" itself in ops/test_linear_logprobs.py
# (test_auto_logits_dtype_*).
os.environ.setdefault("PPO_KERNELS_LOGITS_DTYPE", "float32")

import pytest  # noqa: E402

# Every module that registers ops, imported before the first test: the registered ops a test
# sees must not depend on which files ran before it (ppo_kernels.distributed registers the
# vocab-parallel ops on import). support/state.py fails a test file that registers more.
import ppo_kernels  # noqa: E402,F401
import ppo_kernels.distributed  # noqa: E402,F401

try:  # the SIMT emulator's ops (torch.ops.ppo_kernels_simt), where built
    import ppo_kernels._simt  # noqa: F401
except ImportError:
    pass

pytest_plugins = [
    "support.skip_summary",
    "support.file_order",
    "support.state",
    "support.progress",
    "support.deadline",
    "support.triton_interpreter",
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)
