"""Extension loading and backend selection.

Every public op runs through one of three backends:
  "cpp"    the compiled kernels of this extension (C++ on the CPU, CUDA C++ on the GPU; "cuda" is
           accepted as an alias),
  "triton" the Triton kernels (GPU; on the CPU only under TRITON_INTERPRET=1, for testing),
  "eager"  the eager PyTorch reference next to each op.
Choice, most specific first: `use_backend(...)` context managers (innermost wins), then the
PPO_KERNELS_BACKEND environment variable ("triton", or "token_logprobs=eager,gae=cpp", or both:
"triton,gae=eager"), then the op's default for the device.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import warnings
from dataclasses import dataclass

import torch

BACKENDS = ("cpp", "triton", "eager")
_ALIASES = {"cuda": "cpp", "native": "cpp", "c++": "cpp", "auto": "auto"}


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


def getenv(name: str, default: str = "") -> str:
    """os.environ.get for the per-call reads: os.environ's Mapping.get raises and catches a
    KeyError on every miss, a visible share of a small call's cost; its underlying dict does
    not (bench/bench_overhead.py measures the per-call cost)."""
    data = getattr(os.environ, "_data", None)
    if data is None:  # not CPython's os._Environ
        return os.environ.get(name, default)
    v = data.get(os.environ.encodekey(name))
    return default if v is None else os.environ.decodevalue(v)


def triton_interpreting() -> bool:
    return getenv("TRITON_INTERPRET", "0") == "1"


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


@dataclass(frozen=True)
class OpInfo:
    name: str  # the backend key: what use_backend / PPO_KERNELS_BACKEND take
    kernel: str | None  # the ppo_kernels_C kernel whose presence means "cpp" is available
    triton: bool  # has Triton kernels
    cuda_default: str  # the fastest backend on CUDA in the latest GPU report under bench/results
    public: tuple[str, ...]  # public API functions (ppo_kernels.<name>) that run on this key
    folder: str  # ppo_kernels/<folder>/: naive.py, op.py, triton_kernels.py
    # what else runs under a backend on a device, e.g. {("cpp", "cuda"): "cuBLAS matmuls + ..."}
    delegates: tuple[tuple[str, str, str], ...] = ()


OPS: dict[str, OpInfo] = {}
PUBLIC: dict[str, str] = {}  # public name -> backend key (the alias table)


def register_op(
    name: str,
    *,
    kernel: str | None,
    triton: bool,
    cuda_default: str = "cpp",
    public: tuple[str, ...] | None = None,
    folder: str | None = None,
    delegates: dict[tuple[str, str], str] | None = None,
) -> OpInfo:
    """Declare an op's backend key. `public` lists the ppo_kernels functions that run on it
    (default: the key itself); each of them is accepted by use_backend / PPO_KERNELS_BACKEND."""
    public = (name,) if public is None else tuple(public)
    info = OpInfo(
        name,
        kernel,
        triton,
        cuda_default,
        public,
        folder or name,
        tuple((b, d, w) for (b, d), w in (delegates or {}).items()),
    )
    OPS[name] = info
    for p in public + (name,):
        if PUBLIC.get(p, name) != name:
            raise RuntimeError(f"public name {p!r} already maps to backend key {PUBLIC[p]!r}")
        PUBLIC[p] = name
    return info


def op_key(name: str, what: str) -> str:
    """The backend key of a public op name or key; a clear error for unknown names."""
    key = PUBLIC.get(name.strip())
    if key is None:
        raise ValueError(f"{what}: unknown op {name!r}; known ops: {sorted(PUBLIC)}")
    return key


def delegation(op: str, backend: str, device_type: str) -> str | None:
    """What else runs when `op` uses `backend` on `device_type` (None: nothing else)."""
    for b, d, what in OPS[op].delegates:
        if b == backend and d == device_type:
            return what
    return None


_delegations: dict[tuple[str, str, str], str] = {}


def note_delegation(op: str, backend: str, device_type: str, what: str):
    """Record (and warn once) that part of `op` on `backend` ran elsewhere: nothing falls back
    silently. `python -m ppo_kernels info` and `delegations()` list what was recorded."""
    key = (op, backend, device_type)
    if _delegations.get(key) != what:
        _delegations[key] = what
        warnings.warn(
            f"ppo_kernels: {op} on the {backend} backend ({device_type}): {what}",
            RuntimeWarning,
            stacklevel=3,
        )


def delegations() -> dict[tuple[str, str, str], str]:
    """What ran on another backend so far in this process: {(op, backend, device): what}."""
    return dict(_delegations)


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
            import inspect

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
            why = EXTENSION_ERROR or f"the extension was built without {device_type} kernels"
            return False, f"no compiled {device_type} kernel for {op} ({why})"
        return True, ""
    if backend == "triton":
        if not info.triton:
            return False, f"{op} has no Triton kernel"
        if not HAS_TRITON:
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
    return bool(_ENV_DATA.get(_BACKEND_KEY))  # the dict os.environ writes through: no KeyError


_ENV_DATA = getattr(os.environ, "_data", None)
_BACKEND_KEY = os.environ.encodekey("PPO_KERNELS_BACKEND") if _ENV_DATA is not None else None


def check_eager_only(op: str, t: torch.Tensor) -> None:
    """For an op that is a composition of torch ops (eager only): raise as `backend_for` does if
    another backend was requested for it by name. Free when nothing was requested at all."""
    if _stack or getenv("PPO_KERNELS_BACKEND"):
        backend_for(op, t)


def out_dtype(t: torch.Tensor) -> torch.dtype:
    """Per-token outputs are float32, float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def has_backend(op: str, backend: str) -> bool:
    """Whether `op` has an implementation on `backend` at all (on some machine)."""
    info = OPS[op]
    return (
        backend == "eager"
        or (backend == "cpp" and info.kernel is not None)
        or (backend == "triton" and info.triton)
    )


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


_strict = [os.environ.get("PPO_KERNELS_STRICT", "0") == "1"]


@contextlib.contextmanager
def strict_checks(enabled: bool = True):
    """Context manager: check data-dependent inputs on the GPU too, at the cost of a host sync.

    Label ranges, group ids and packed offsets are checked on the CPU always. On the GPU such a
    check needs a host sync. So by default the GPU kernels give the documented NaN instead, never
    reading out of bounds; under `strict_checks()` they raise, naming the argument. It also makes
    `masked_whiten(unbiased=True)` raise on fewer than two unmasked positions, as verl does.
    Process-wide; blocks nest. Also PPO_KERNELS_STRICT=1.

    Args:
        enabled (bool): turn the checks on (True) or off (False) inside the block. Default True.

    Returns:
        ContextManager[None]: the block's scope.

    Why: a training step without host syncs stays fast and capturable; strict checks are for
    debugging a bad batch.
    """
    _strict.append(enabled)
    _mirror_strict()
    try:
        yield
    finally:
        _strict.pop()
        _mirror_strict()


def _mirror_strict():
    """The registered ops defined in C++ read the setting there (csrc/ops/route.h)."""
    if HAS_EXTENSION:
        torch.ops.ppo_kernels_C.set_strict(_strict[-1])


def strict() -> bool:
    return _strict[-1]


_mirror_strict()


_invariant = [os.environ.get("PPO_KERNELS_BATCH_INVARIANT", "0") == "1"]


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Context manager: batch-invariant mode, per-token outputs independent of the rest of the call.

    It covers every per-token output of `token_logprobs`, `linear_token_logprobs` /
    `causal_lm_logprobs`, `full_kl` and `linear_policy_loss` (its per-token statistics). Each is
    bitwise the same whatever else is in the call: other rows, padding, layout, micro-batch
    split, chunk budget, ignored rows, CPU threads. Process-wide, like `strict_checks`
    (autograd's backward threads see it). Also PPO_KERNELS_BATCH_INVARIANT=1.

    Args:
        enabled (bool): turn the mode on (True) or off (False) inside the block. Default True.

    Returns:
        ContextManager[None]: the block's scope.

    Why: on-policy PPO / GRPO assume a token's log-prob at rollout scoring equals its log-prob in
    the first update. Kernels whose tiling follows the batch differ in the last bits, so the first
    ratio is not 1 and clipping fires on noise. Fixed tile shapes remove that. Its cost:
    bench/results/cpu_batch_invariant.md; the README's "Batch-invariant mode".
    """
    _invariant.append(bool(enabled))
    _sync_invariant()
    try:
        yield
    finally:
        _invariant.pop()
        _sync_invariant()


def _sync_invariant():
    """The C++ side's copy of the mode (the CUDA launchers read it)."""
    if HAS_EXTENSION and hasattr(torch.ops.ppo_kernels_C, "set_batch_invariant"):
        torch.ops.ppo_kernels_C.set_batch_invariant(_invariant[-1])


def constant_result(fn):
    """`torch.compiler.assume_constant_result` without its import of torch._dynamo (a slow
    import `import ppo_kernels` avoids): the marker that decorator sets (test_package checks it
    still is).
    torch.compile calls fn while tracing and keeps its result as a constant of the graph."""
    fn._dynamo_marked_constant = True
    return fn


def invariant() -> bool:
    """Whether batch-invariant mode is on."""
    return _invariant[-1]


if _invariant[-1]:
    _sync_invariant()


# Rows per block of the eager kernels in batch-invariant mode: a multiple of 32, so that a block of
# float32 rows never ends in the scalar remainder of a vectorised loop (8 or 16 lanes, two vectors
# per step), whatever V is.
EAGER_ROW_BLOCK = 64


@contextlib.contextmanager
def invariant_threads():
    """In batch-invariant mode, torch's intra-op threads set to 1 for the block (the eager math): a
    parallel elementwise op splits its flat range at thread-count-dependent points, and each piece
    ends in a scalar remainder whose exp / log may differ in the last bit from the vectorised
    loop's. Outside the mode: nothing."""
    n = torch.get_num_threads()
    if n == 1 or not invariant():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def invariant_rows(fn, rows: tuple, *args):
    """fn(*args) for the eager kernels; in batch-invariant mode computed in blocks of exactly
    EAGER_ROW_BLOCK rows (the last one padded with zero rows) on one thread, so that no row's
    result depends on the other rows, their number or the layout. Tensor arguments whose leading
    dims are `rows` are split (the others pass whole); each output of fn is a tensor whose
    leading dim is the block's rows, an empty tensor or None (passed through)."""
    rows = tuple(rows)
    k, n = len(rows), math.prod(rows)
    if not invariant() or n == 0:
        return fn(*args)
    split = [
        isinstance(a, torch.Tensor) and a.numel() > 0 and tuple(a.shape[:k]) == rows for a in args
    ]
    flat = [a.reshape((n,) + tuple(a.shape[k:])) if s else a for a, s in zip(args, split)]
    B = EAGER_ROW_BLOCK
    pieces = []
    with invariant_threads():
        for r0 in range(0, n, B):
            m = min(n - r0, B)
            block = []
            for a, s in zip(flat, split):
                if s:
                    padded = a.new_zeros((B,) + tuple(a.shape[1:]))
                    padded[:m] = a[r0 : r0 + m]
                    a = padded
                block.append(a)
            out = fn(*block)
            outs = out if isinstance(out, tuple) else (out,)
            pieces.append([o[:m] if _nonempty(o) else o for o in outs])
    joined = tuple(
        torch.cat([p[i] for p in pieces]).reshape(rows + tuple(o.shape[1:])) if _nonempty(o) else o
        for i, o in enumerate(pieces[0])
    )
    return joined if isinstance(out, tuple) else joined[0]


def _nonempty(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() > 0


_poison = [False]


def set_poison(enabled: bool) -> bool:
    """Test hook: NaN-fill (ints: -1) every output buffer the kernels allocate, in C++ and Python,
    so an element a kernel forgets to write shows. Returns the previous setting."""
    old = _poison[0]
    _poison[0] = bool(enabled)
    if HAS_EXTENSION:
        torch.ops.ppo_kernels_C.set_poison(bool(enabled))
    return old


def new_output(shape, dtype, device) -> torch.Tensor:
    """torch.empty for kernel outputs (poisoned under set_poison(True))."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _poison[0]:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


# ---------------------------------------------------------------------------------------------
# Registered ops defined in C++ (csrc/ops/<op>.cpp: schema, checks, routing, autograd). Python
# adds their fake kernels and their triton / eager implementations, and fills the C++ backend
# table (csrc/ops/route.h) with what `resolve` says for every op and device type: a call then
# costs a table read. The table is invalidated by use_backend and re-read when
# PPO_KERNELS_BACKEND changes (the C++ side compares it per call).

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


def _invalidate():
    if HAS_EXTENSION and _TABLE_OPS:
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


if HAS_EXTENSION:
    _py_lib = torch.library.Library("ppo_kernels_py", "DEF")
    _py_lib.define("refresh_backends() -> ()")
    _py_lib.impl("refresh_backends", refresh_backends, "CompositeImplicitAutograd")
