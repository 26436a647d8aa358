"""One reason string per cause of a skip. Every skip of the suite takes its reason from here, so
that the skip summary (support/skip_summary.py) lists each cause once, in words that say what
would run the skipped tests."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from ppo_kernels import _backend

NO_CUDA = "needs a CUDA GPU"
NO_EXTENSION = (
    "the compiled extension is not built (scripts/dev.sh builds it; or "
    "`python setup.py build_ext --inplace`)"
)
NO_SIMT = "ppo_kernels._simt is not built (build with PPO_KERNELS_BUILD_SIMT=1)"
NO_SANITIZER = "needs the sanitized build: bash scripts/sanitize.sh runs this file under it"
NO_GLOO = "torch.distributed with gloo is not available"
NO_GLIBC = "needs glibc (the trainer's heap setting is glibc's mallopt)"
NOT_INTERPRETED = (
    "Triton's interpreter only (TRITON_INTERPRET=1, the suite's setting without a GPU)"
)
PEER_TESTS_NOT_ON_PYPI = (
    "the peer's own tests are not on PyPI (TRL, OpenRLHF, Liger): "
    "PPO_KERNELS_PEER_SRC_<PEER>=DIR, a checkout or a bare git mirror, runs them"
)
UNPLACED_MODULE = (
    "the module has no layer: package/test_layers.py::test_every_module_has_a_layer fails"
)
CUDA_DRY_RUN = (
    "GPU only: the CPU dry run of the cuda tests (PPO_KERNELS_CUDA_TESTS_DEVICE=cpu) leaves out "
    "the large cases and the CUDA graphs"
)

# How scripts/dev.sh installs each optional package (the import name), for the reason of a skip
# where one is missing.
_HOW = {
    "verl": "scripts/dev.sh installs the peers, unless PPO_KERNELS_NO_PEERS=1",
    "trl": "scripts/dev.sh installs the peers, unless PPO_KERNELS_NO_PEERS=1",
    "openrlhf": "scripts/dev.sh installs the peers, unless PPO_KERNELS_NO_PEERS=1",
    "ray": "scripts/dev.sh installs it with the peers",
    "datasets": "scripts/dev.sh installs it with the peers",
    "pandas": "scripts/dev.sh installs it with the peers (datasets needs it)",
    "pyarrow": "scripts/dev.sh installs it with the peers (datasets needs it)",
    "liger_kernel": "scripts/dev.sh installs it only where triton is: it needs triton",
    "transformers": "scripts/dev.sh installs it",
    "tokenizers": "scripts/dev.sh installs it (transformers needs it)",
    "tqdm": "scripts/dev.sh installs it (the train extras)",
    "triton": "the CUDA build of torch brings it; with it, the Triton kernels run here through "
    "TRITON_INTERPRET=1",
}


def missing(pkg: str) -> str:
    """The reason of a skip where the package `pkg` (its import name) is not installed."""
    return f"{pkg} is not installed ({_HOW.get(pkg, 'an optional dependency')})"


NO_TRITON = missing("triton")


def need(pkg: str):
    """Import `pkg`, or skip the calling test with the shared reason (pytest.importorskip with a
    reason that says how the package gets installed)."""
    if importlib.util.find_spec(pkg) is None:
        pytest.skip(missing(pkg))
    return importlib.import_module(pkg)


def unavailable(backend: str, why: str) -> str:
    """The reason of a skip where `backend` does not run an op here, from `why` (what
    `_backend.available` or the op's error said): one string for each cause the whole backend
    shares."""
    if backend == "triton" and not _backend.HAS_TRITON:
        return NO_TRITON
    if backend == "cpp" and not _backend.HAS_EXTENSION:
        return NO_EXTENSION
    return why


def backend_reason(op: str, backend: str, device_type: str = "cpu") -> str | None:
    """None where `backend` runs `op` on `device_type` here, else the reason (one per cause)."""
    ok, why = _backend.available(op, backend, device_type)
    if ok:
        return None
    return unavailable(
        backend, f"the {backend} backend of {op} does not run on {device_type}: {why}"
    )


def need_backend(op: str, backend: str, device_type: str = "cpu") -> None:
    """Skip the calling test where `backend` cannot run `op` here."""
    reason = backend_reason(op, backend, device_type)
    if reason is not None:
        pytest.skip(reason)


def requires_backend(op: str, backend: str, device_type: str = "cpu"):
    """A skipif marker: skip where `backend` cannot run `op` here (pytest wants a reason string
    even where the condition is false)."""
    reason = backend_reason(op, backend, device_type)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
requires_extension = pytest.mark.skipif(not _backend.HAS_EXTENSION, reason=NO_EXTENSION)
requires_triton = pytest.mark.skipif(not _backend.HAS_TRITON, reason=NO_TRITON)
requires_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason=NO_GLOO,
)
