"""The compiled extension: loaded once at import, never under another torch, and the questions
about it (is a kernel compiled for this device type, which op namespace the `cpp` backend calls).

HAS_EXTENSION, EXTENSION_ERROR and HAS_TRITON are fixed at import: a run without the extension is
a process started with PPO_KERNELS_NO_EXTENSION=1 (as tests/package/test_package.py does)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch


def _built_against():
    """The torch version the extension was compiled against (setup.py writes it next to it)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_C.torch_version")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _load_extension():
    built = _built_against()
    if (
        built is not None
        and built != torch.__version__
        and os.environ.get("PPO_KERNELS_NO_EXTENSION") != "1"
    ):
        # never dlopen it: another torch's ABI can crash instead of failing cleanly
        msg = (
            f"ppo_kernels: the compiled extension was built against torch {built} but torch "
            f"{torch.__version__} is running; it is not loaded (ops run through Triton on the "
            f"GPU and eager PyTorch on the CPU). Rebuild it against this torch: `pip install "
            f"--no-build-isolation .` (or `python setup.py build_ext --inplace`)."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return False, msg
    try:
        if os.environ.get("PPO_KERNELS_NO_EXTENSION") == "1":
            raise ImportError("disabled by PPO_KERNELS_NO_EXTENSION=1")
        from ppo_kernels import _C  # noqa: F401  (importing registers torch.ops.ppo_kernels_C.*)

        return True, None
    except ImportError as e:
        warnings.warn(
            f"ppo_kernels: the compiled extension is not available ({e}); ops run through Triton "
            "on the GPU and eager PyTorch on the CPU. Reinstall with `pip install "
            "--no-build-isolation .` to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False, str(e)


HAS_EXTENSION, EXTENSION_ERROR = _load_extension()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def has_compiled_kernel(kernel: str, device_type: str) -> bool:
    """Whether `torch.ops.ppo_kernels_C.<kernel>` (or the namespace `use_cpp_namespace` routes
    to) has a compiled kernel for this device type."""
    if not HAS_EXTENSION:
        return False
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(device_type)
    if key is None:
        return False
    name = f"{_cpp_namespace[-1]}::{kernel}"
    if (name, key) in _HAS_KERNEL:  # a registration is never taken back: only hits are kept
        return True
    try:
        found = torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    except RuntimeError:  # an extension built before this kernel existed: not registered at all
        return False
    if found:
        _HAS_KERNEL.add((name, key))
    return found


_HAS_KERNEL: set = set()
_cpp_namespace = ["ppo_kernels_C"]


def cpp_ops():
    """The op namespace the `cpp` backend calls: `torch.ops.ppo_kernels_C`, unless a test routes
    it elsewhere with `use_cpp_namespace` (e.g. the SIMT emulator's CUDA kernels run on the CPU)."""
    return getattr(torch.ops, _cpp_namespace[-1])


@contextlib.contextmanager
def use_cpp_namespace(name: str):
    """Route the `cpp` backend's raw-kernel calls to `torch.ops.<name>` (same schemas), in Python
    and in the registered ops' C++ routing (csrc/ops/route.h)."""
    _cpp_namespace.append(name)
    if HAS_EXTENSION:
        torch.ops.ppo_kernels_C.set_cpp_namespace(name)
    try:
        yield
    finally:
        _cpp_namespace.pop()
        if HAS_EXTENSION:
            torch.ops.ppo_kernels_C.set_cpp_namespace(_cpp_namespace[-1])
