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
    if built is not None and built != torch.__version__ and \
            os.environ.get("PPO_KERNELS_NO_EXTENSION") != "1":
        # never dlopen it: another torch's ABI can crash instead of failing cleanly
        msg = (f"ppo_kernels: the compiled extension was built against torch {built} but torch "
               f"{torch.__version__} is running; it is not loaded (ops run through Triton on the "
               f"GPU and eager PyTorch on the CPU). Rebuild it against this torch: `pip install "
               f"--no-build-isolation .` (or `python setup.py build_ext --inplace`).")
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
            "--no-build-isolation .` to build it.", RuntimeWarning, stacklevel=3)
        return False, str(e)


HAS_EXTENSION, EXTENSION_ERROR = _load_extension()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def has_compiled_kernel(kernel: str, device_type: str) -> bool:
    """Whether `torch.ops.ppo_kernels_C.<kernel>` has a compiled kernel for this device type."""
    if not HAS_EXTENSION:
        return False
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(device_type)
    if key is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_kernels_C::{kernel}", key)
    except RuntimeError:  # an extension built before this kernel existed: not registered at all
        return False


_cpp_namespace = ["ppo_kernels_C"]


def cpp_ops():
    """The op namespace the `cpp` backend calls: `torch.ops.ppo_kernels_C`, unless a test routes
    it elsewhere with `use_cpp_namespace` (e.g. the SIMT emulator's CUDA kernels run on the CPU)."""
    return getattr(torch.ops, _cpp_namespace[-1])


@contextlib.contextmanager
def use_cpp_namespace(name: str):
    """Route the `cpp` backend's raw-kernel calls to `torch.ops.<name>` (same schemas)."""
    _cpp_namespace.append(name)
    try:
        yield
    finally:
        _cpp_namespace.pop()


@dataclass(frozen=True)
class OpInfo:
    name: str
    kernel: str | None   # the ppo_kernels_C kernel whose presence means "cpp" is available
    triton: bool         # has Triton kernels
    cuda_default: str    # the measured-fastest backend on CUDA (see bench/results)


OPS: dict[str, OpInfo] = {}


def register_op(name: str, *, kernel: str | None, triton: bool, cuda_default: str = "cpp") -> OpInfo:
    info = OpInfo(name, kernel, triton, cuda_default)
    OPS[name] = info
    return info


def _normalise(name: str, what: str) -> str:
    b = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if b not in BACKENDS + ("auto",):
        raise ValueError(f"{what}: unknown backend {name!r}; expected one of {BACKENDS + ('auto',)}")
    return b


def _parse_spec(spec: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" in part:
            op, b = part.split("=", 1)
            out[op.strip()] = _normalise(b, what)
        else:
            out["*"] = _normalise(part, what)
    return out


_stack: list[dict[str, str]] = []
_env_cache: tuple[str, dict[str, str]] = ("", {})


def _env_choice(op: str) -> str | None:
    global _env_cache
    spec = os.environ.get("PPO_KERNELS_BACKEND", "")
    if spec != _env_cache[0]:
        _env_cache = (spec, _parse_spec(spec, "PPO_KERNELS_BACKEND"))
    table = _env_cache[1]
    return table.get(op, table.get("*"))


@contextlib.contextmanager
def use_backend(default: str | None = None, **per_op: str):
    """Run ops on a backend: `use_backend("triton")`, `use_backend(gae="eager")`, or both.

    Process-wide (not thread-local) so that autograd's backward threads see it too."""
    layer = {op: _normalise(b, f"use_backend({op}=...)") for op, b in per_op.items()}
    for op in layer:
        if op not in OPS:
            raise ValueError(f"use_backend: unknown op {op!r}; known ops: {sorted(OPS)}")
    if default is not None:
        layer["*"] = _normalise(default, "use_backend")
    _stack.append(layer)
    try:
        yield
    finally:
        _stack.remove(layer)


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
    order = ([info.cuda_default] + [b for b in BACKENDS if b != info.cuda_default]
             if device_type == "cuda" else ["cpp", "eager"])
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


def out_dtype(t: torch.Tensor) -> torch.dtype:
    """Per-token outputs are float32, float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def resolve(op: str, device_type: str) -> str:
    """The backend `op` runs on for a tensor on `device_type` right now."""
    choice = None
    for layer in reversed(_stack):
        choice = layer.get(op, layer.get("*"))
        if choice is not None:
            break
    if choice is None:
        choice = _env_choice(op)
    if choice is None or choice == "auto":
        return default_backend(op, device_type)
    ok, why = available(op, choice, device_type)
    if not ok:
        raise RuntimeError(f"ppo_kernels: backend {choice!r} requested for {op} on {device_type}, "
                           f"but it is unavailable: {why}")
    return choice


_strict = [os.environ.get("PPO_KERNELS_STRICT", "0") == "1"]


@contextlib.contextmanager
def strict_checks(enabled: bool = True):
    """Validate data-dependent input (label ranges, ...) on the GPU too, at the cost of a host sync.

    Without it GPU kernels never read out of bounds and give the documented NaN instead."""
    _strict.append(enabled)
    try:
        yield
    finally:
        _strict.pop()


def strict() -> bool:
    return _strict[-1]


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
