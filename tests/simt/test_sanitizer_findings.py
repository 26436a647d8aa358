"""What the sanitizer stage (scripts/sanitize.sh: the C++ kernels and the SIMT emulator built with
-fsanitize=address,undefined) sees that the other checks cannot. The cases that need the sanitized
build run in a child process (an ASan report ends the process) and skip without it; each provokes
one report and names it, so that a stage that silently lost a check fails here."""

import os
import subprocess
import sys

import pytest
from support.simt import HAS_SIMT
from support.skips import NO_SANITIZER, NO_SIMT

try:
    with open("/proc/self/maps") as f:
        UNDER_ASAN = "libasan" in f.read()  # the runtime is preloaded: the sanitized build
except OSError:
    UNDER_ASAN = False

needs_asan = pytest.mark.skipif(not UNDER_ASAN, reason=NO_SANITIZER)


def _child(code):
    """Runs `code` in a fresh interpreter under the same sanitizers; the report goes to its stderr
    (not to the stage's log files, which would fail the stage)."""
    opts = [o for o in os.environ.get("ASAN_OPTIONS", "").split(":") if o]
    opts = [o for o in opts if not o.startswith("log_path=")]
    env = dict(os.environ, ASAN_OPTIONS=":".join(opts))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


SELFTEST = """
import torch
from ppo_kernels import _simt  # noqa: F401
torch.ops.ppo_kernels_simt.selftest({name!r}, torch.randn(128), 1)
print("no report")
"""


@needs_asan
@pytest.mark.simt
@pytest.mark.skipif(not HAS_SIMT, reason=NO_SIMT)
@pytest.mark.parametrize(
    "kernel,report",
    [
        # shared memory of a template kernel: UBSan's bounds check (GCC gives the statics of
        # templates no ASan redzones)
        ("shared_off_by_one", "runtime error: index 128 out of bounds for type 'float [128]'"),
        # a local array through a pointer, after a barrier: ASan, with the fiber's stack redzones
        # kept across the switch
        ("local_off_by_one", "ERROR: AddressSanitizer: stack-buffer-overflow"),
    ],
)
def test_emulated_kernel_overflow_is_a_sanitizer_report(kernel, report):
    proc = _child(SELFTEST.format(name=kernel))
    assert proc.returncode != 0 and "no report" not in proc.stdout, proc.stdout + proc.stderr
    assert report in proc.stderr, proc.stderr
    assert kernel in proc.stderr, proc.stderr  # the report's stack names the kernel
