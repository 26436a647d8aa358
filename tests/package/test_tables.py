"""The hand-kept tables of the test suite checked against what is registered: adding an op
without its compile case, its bad-input cases or (for a CUDA kernel) its SIMT registration and
test fails here, naming what is missing. The DEVELOPING.md op table is checked by
package/test_contract.py (test_developing_md_lists_every_op)."""

import glob
import os
import re

import pytest
from support import ROOT, TESTS
from support.skips import requires_extension
from support.utils import load_test_file, registered_ops

# every module that registers ops (tests/conftest.py imports them too, before the first test):
# the check below must see the same ops whichever test files ran before it
import ppo_kernels  # noqa: F401
import ppo_kernels.distributed  # noqa: F401  (the vocab-parallel ops)
from ppo_kernels import _backend

test_bad_inputs = load_test_file("ops/test_bad_inputs.py")
test_edge_cases = load_test_file("ops/test_edge_cases.py")

PUBLIC = sorted({name for info in _backend.OPS.values() for name in info.public})


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_op_has_a_compile_case(name):
    cases = test_edge_cases._compile_cases()
    assert name in cases or any(c.startswith(name + "_") for c in cases), (
        f"tests/ops/test_edge_cases.py _compile_cases: no case for {name}"
    )


def _bad_input_calls() -> set[str]:
    calls = set()
    for case in test_bad_inputs.CASES:
        calls |= set(re.findall(r"(?:pk|ops)\.(\w+)\(", case[3]))
    return calls


@requires_extension
def test_every_registered_op_has_a_bad_input_case():
    """Each `ppo_kernels::<op>` takes tensors straight from users or autograd: a wrong one must be
    an error naming it, never a crash (ops/test_bad_inputs.py runs each case in a child)."""
    missing = sorted(set(registered_ops("ppo_kernels")) - _bad_input_calls())
    assert not missing, f"tests/ops/test_bad_inputs.py CASES: no case calls ops.{missing}"


def _cuda_kernels() -> set[str]:
    names = set()
    for path in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")):
        names |= set(re.findall(r'm\.impl\("(\w+)"', open(path).read()))
    return names


def test_every_cuda_kernel_runs_under_the_simt_emulator():
    """Every CUDA kernel registered in csrc/cuda/*.cu is also registered by the SIMT emulator
    (csrc/testing/simt_ops.cpp) and exercised by tests/simt/test_kernels.py."""
    cuda = _cuda_kernels()
    assert cuda, "no CUDA kernel found in csrc/cuda/*.cu"
    simt = open(os.path.join(ROOT, "csrc", "testing", "simt_ops.cpp")).read()
    emulated = set(re.findall(r'impls\.impl\("(\w+)"', simt))
    assert cuda <= emulated, f"simt_ops.cpp does not register {sorted(cuda - emulated)}"
    tests = open(os.path.join(TESTS, "simt", "test_kernels.py")).read()
    # the kernel's op (token_logprobs_fwd -> token_logprobs) has a test of its own
    untested = sorted(
        k for k in cuda if not re.search(rf"def test_{k.rsplit('_', 1)[0]}\w*\(", tests)
    )
    assert not untested, f"tests/simt/test_kernels.py: no test_<op> for {untested}"
