"""The Python side of the registered ops defined in C++ (csrc/ops/<op>.cpp: schema, checks,
routing, autograd), through torch.library: their fake kernels, their triton / eager (and Python
cpp) implementations as ops of the same schema, the fallbacks the public API calls without the
compiled extension, and `op(name)`, what the public API calls."""

from __future__ import annotations

import torch

from ._extension import HAS_EXTENSION
from ._registry import BACKENDS

_IMPL_LIBS: dict[str, torch.library.Library] = {}


def _impl_lib(backend: str) -> torch.library.Library:
    if backend not in _IMPL_LIBS:
        _IMPL_LIBS[backend] = torch.library.Library(f"ppo_kernels_{backend}", "DEF")
    return _IMPL_LIBS[backend]


def registered(name: str):
    """`torch.ops.ppo_kernels.<name>` (defined in C++)."""
    return getattr(torch.ops.ppo_kernels, name)


_FALLBACKS: dict[str, object] = {}
_PY_IMPLS: dict[tuple[str, str], object] = {}


def fallback(name: str):
    """Register `fn` as what the public API calls for the registered op `<name>` when the
    compiled extension is not loaded: the op's eager implementation with the op's signature,
    differentiable by autograd (there is no registered op, hence no registered autograd)."""

    def register(fn):
        _FALLBACKS[name] = fn
        return fn

    return register


def python_impl(name: str, backend: str):
    """The Python function registered with `impl(name, backend)`."""
    return _PY_IMPLS[(name, backend)]


def op(name: str):
    """What the public API calls for the registered op `<name>`: `torch.ops.ppo_kernels.<name>`
    (its `.default` overload: no overload resolution per call), or without the extension the
    op's `fallback`."""
    if HAS_EXTENSION:
        return registered(name).default
    if name not in _FALLBACKS:
        raise RuntimeError(f"ppo_kernels: {name} has no fallback without the compiled extension")
    return _FALLBACKS[name]


def impl(name: str, backend: str):
    """Register `fn` as the `backend` ("triton" or "eager") implementation of the registered op
    `ppo_kernels::<name>`: a Python op `ppo_kernels_<backend>::<name>` with the same schema, which
    the op's C++ routing calls. `fn` takes the op's arguments (names and order of its schema).
    "cpp" too for an op whose cpp backend is a Python loop around the compiled kernels (the
    hidden-state ops' chunk loop: `ppo_kernels_cpp::<name>`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")

    def register(fn):
        _PY_IMPLS[(name, backend)] = fn
        if not HAS_EXTENSION:
            return fn
        schema = str(registered(name).default._schema)
        lib = _impl_lib(backend)
        lib.define(schema.split("::", 1)[1])
        lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def fake(name: str):
    """Register `fn` as the fake (meta) kernel of `ppo_kernels::<name>` (torch.compile, opcheck)."""

    def register(fn):
        if HAS_EXTENSION:
            torch.library.register_fake(f"ppo_kernels::{name}", fn, _stacklevel=2)
        return fn

    return register


def constant_result(fn):
    """`torch.compiler.assume_constant_result` without its import of torch._dynamo (1.3 s of
    `import ppo_kernels`): the marker that decorator sets (test_package checks it still is).
    torch.compile calls fn while tracing and keeps its result as a constant of the graph."""
    fn._dynamo_marked_constant = True
    return fn
