"""Backend choice: which backend an op runs on for a device, and the C++ routing table that holds
the answer for the registered ops.

Every op runs on one of three backends:
  "cpp"    the compiled kernels of this extension (C++ on the CPU, CUDA C++ on the GPU; "cuda" is
           accepted as an alias),
  "triton" the Triton kernels (GPU; on the CPU only under TRITON_INTERPRET=1, for testing),
  "eager"  the eager PyTorch implementation next to each op.
Choice, most specific first: `use_backend(...)` context managers (innermost wins), then the
PPO_KERNELS_BACKEND environment variable ("triton", or "token_logprobs=eager,gae=cpp", or both:
"triton,gae=eager"), then the op's default for the device.

The registered ops defined in C++ (csrc/ops/route.h) read a table that `refresh_backends` fills
with what `resolve` says for every op and device type: a call then costs a table read. The table is
invalidated by use_backend and re-read when PPO_KERNELS_BACKEND changes (the C++ side compares it
per call).
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch

from . import _extension
from ._extension import has_compiled_kernel
from ._registry import BACKENDS, OPS, has_backend, op_key

_ALIASES = {"cuda": "cpp", "native": "cpp", "c++": "cpp", "auto": "auto"}


def getenv(name: str, default: str = "") -> str:
    """os.environ.get (the name the planner reads PPO_KERNELS_LINEAR_TILES through)."""
    return os.environ.get(name, default)


def triton_interpreting() -> bool:
    return getenv("TRITON_INTERPRET", "0") == "1"


def _normalise(name: str, what: str) -> str:
    b = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if b not in BACKENDS + ("auto",):
        raise ValueError(
            f"{what}: unknown backend {name!r}; expected one of {BACKENDS + ('auto',)}"
        )
    return b


def _parse_spec(spec: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" in part:
            op, b = part.split("=", 1)
            out[op_key(op, what)] = _normalise(b, what)
        else:
            out["*"] = _normalise(part, what)
    return out


_stack: list[dict[str, str]] = []
_env_cache: tuple[str, dict[str, str]] = ("", {})


def _env_table() -> dict[str, str]:
    global _env_cache
    spec = getenv("PPO_KERNELS_BACKEND")
    if spec != _env_cache[0]:
        _env_cache = (spec, _parse_spec(spec, "PPO_KERNELS_BACKEND"))
    return _env_cache[1]


@contextlib.contextmanager
def use_backend(default: str | None = None, **per_op: str):
    """Context manager: run ops on a chosen backend inside the `with` block.

    `use_backend("triton")` sets the default of every op that has a Triton kernel;
    `use_backend(gae="eager")` sets one op's. Both may be given. Blocks nest; the innermost wins.
    The setting is process-wide, not thread-local, so autograd's backward threads see it too.

    Args:
        default (str, optional): the backend of every op that has it: "cpp" (alias "cuda"),
            "triton", "eager" or "auto" (each op's own default). An op without that backend keeps
            its default. Default None: no global choice.
        **per_op (str): op name -> backend, for single ops. A name is an op's backend key or any
            public function running on it (`grpo_advantages` for `group_advantages`). An op asked
            by name for a backend it cannot run raises when it runs.

    Returns:
        ContextManager[None]: the block's scope.

    Why: tests and benchmarks run the same public op on every backend; a user pins one where the
    defaults do not suit. The environment variable PPO_KERNELS_BACKEND ("triton,gae=eager") sets
    the same at import. `python -m ppo_kernels info` shows each op's choice.
    """
    layer = {
        op_key(op, "use_backend"): _normalise(b, f"use_backend({op}=...)")
        for op, b in per_op.items()
    }
    if default is not None:
        layer["*"] = _normalise(default, "use_backend")
    _stack.append(layer)
    _invalidate()
    try:
        yield
    finally:
        _stack.remove(layer)
        _invalidate()


def available(op: str, backend: str, device_type: str) -> tuple[bool, str]:
    info = OPS[op]
    if backend == "eager":
        return True, ""
    if backend == "cpp":
        if info.kernel is None:
            return False, f"{op} has no compiled kernel"
        if not has_compiled_kernel(info.kernel, device_type):
            why = (
                _extension.EXTENSION_ERROR
                or f"the extension was built without {device_type} kernels"
            )
            return False, f"no compiled {device_type} kernel for {op} ({why})"
        return True, ""
    if backend == "triton":
        if not info.triton:
            return False, f"{op} has no Triton kernel"
        if not _extension.HAS_TRITON:
            return False, "triton is not installed"
        if device_type != "cuda" and not triton_interpreting():
            return False, "Triton runs CPU tensors only under TRITON_INTERPRET=1"
        return True, ""
    raise AssertionError(backend)


def default_backend(op: str, device_type: str) -> str:
    info = OPS[op]
    order = (
        [info.cuda_default] + [b for b in BACKENDS if b != info.cuda_default]
        if device_type == "cuda"
        else ["cpp", "eager"]
    )
    for b in order:
        if available(op, b, device_type)[0]:
            return b
    return "eager"


def backend_for(op: str, t: torch.Tensor) -> str:
    """The backend `op` runs on for input `t`. float64 inputs always take the float64 eager
    reference (the kernels accumulate in float32), which is also what gradcheck exercises."""
    if t.dtype == torch.float64:
        return "eager"
    return resolve(op, t.device.type)


def any_requested() -> bool:
    """Whether a backend was requested by name for any op (use_backend or PPO_KERNELS_BACKEND):
    an API's shortcut to a plain torch op (a call the kernels cannot beat) is taken only when
    not, so that a requested backend always runs."""
    if _stack:
        return True
    if _ENV_DATA is None:
        return bool(os.environ.get("PPO_KERNELS_BACKEND"))
    # os.environ's own dict, not its get (a KeyError raised and caught per miss): the shortcut's
    # call is all overhead (bench/bench_overhead.py, kl_penalty k1; cpu_overhead_tricks.md)
    return bool(_ENV_DATA.get(_BACKEND_KEY))


_ENV_DATA = getattr(os.environ, "_data", None)
_BACKEND_KEY = os.environ.encodekey("PPO_KERNELS_BACKEND") if _ENV_DATA is not None else None


def _choice(op: str) -> tuple[str | None, bool]:
    """(requested backend or None, whether it was requested for this op by name)."""
    for layer in reversed(_stack):
        if op in layer:
            return layer[op], True
        if "*" in layer:
            return layer["*"], False
    table = _env_table()
    if op in table:
        return table[op], True
    return table.get("*"), False


def resolve(op: str, device_type: str) -> str:
    """The backend an op runs on, right now, for a tensor on the given device type.

    A global default (`use_backend("triton")`, PPO_KERNELS_BACKEND="triton") applies to the ops
    that have that backend; an op without it keeps its default. A backend requested for the op by
    name must be available, else RuntimeError.

    Args:
        op (str): the op's backend key, e.g. "token_logprobs" or "group_advantages"
            (`python -m ppo_kernels info` lists them).
        device_type (str): "cpu" or "cuda".

    Returns:
        str: "cpp", "triton" or "eager".

    Why: to see what a call will run without running it. The kernels read the same choice from a
    cache keyed by op and device type.
    """
    choice, named = _choice(op)
    if choice is None or choice == "auto" or (not named and not has_backend(op, choice)):
        return default_backend(op, device_type)
    ok, why = available(op, choice, device_type)
    if not ok:
        raise RuntimeError(
            f"ppo_kernels: backend {choice!r} requested for {op} on {device_type}, "
            f"but it is unavailable: {why}"
        )
    return choice


class Kernel:
    """One kernel of an op (e.g. token_logprobs' forward) with one implementation per backend, all
    with the same parameters (names and meaning). Calling it runs the implementation of the
    backend `backend_for(op, first argument)` picks: the op bodies never branch on backends."""

    def __init__(self, op: str, name: str, *, eager_if_empty: bool = False):
        self.op, self.name = op, name
        self.eager_if_empty = eager_if_empty  # an empty input needs no kernel
        self.impls: dict[str, object] = {}
        self.params: tuple[str, ...] | None = None
        KERNELS.append(self)

    def impl(self, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")

        def register(fn):
            params = tuple(inspect.signature(fn).parameters)
            if self.params is None:
                self.params = params
            elif params != self.params:
                raise TypeError(
                    f"{self.op}.{self.name}: the {backend} implementation takes "
                    f"{params}, the others take {self.params}"
                )
            self.impls[backend] = fn
            return fn

        return register

    def backend(self, like: torch.Tensor) -> str:
        if self.eager_if_empty and like.numel() == 0:
            return "eager"
        return backend_for(self.op, like)

    def __call__(self, *args):
        return self.impls[self.backend(args[0])](*args)


KERNELS: list[Kernel] = []


# ---- the C++ routing table (csrc/ops/route.h) ----


def _invalidate():
    if _extension.HAS_EXTENSION and _TABLE_OPS:
        torch.ops.ppo_kernels_C.set_resolved(False)


_TABLE_OPS: list[str] = []  # backend keys whose registered ops route in C++


def routes_in_cpp(key: str):
    """Declare that backend key `key` has C++-registered ops that read the backend table."""
    _TABLE_OPS.append(key)


def refresh_backends():
    """Resolve every C++-routed op for both device types into the C++ table (see above)."""
    C = torch.ops.ppo_kernels_C
    for key in _TABLE_OPS:
        for device in ("cpu", "cuda"):
            try:
                C.set_backend(key, device, resolve(key, device), "")
            except RuntimeError as e:
                C.set_backend(key, device, "", str(e))
    C.set_resolved(True)


if _extension.HAS_EXTENSION:
    # the C++ routing calls this when its table is stale
    _py_lib = torch.library.Library("ppo_kernels_py", "DEF")
    _py_lib.define("refresh_backends() -> ()")
    _py_lib.impl("refresh_backends", refresh_backends, "CompositeImplicitAutograd")
