"""The op registry: each op's backend key, what it can run on, its public names (the alias table
`use_backend` / PPO_KERNELS_BACKEND accept), and the delegations (part of an op's work on another
backend) declared up front or recorded at run time."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

BACKENDS = ("cpp", "triton", "eager")


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


def has_backend(op: str, backend: str) -> bool:
    """Whether `op` has an implementation on `backend` at all (on some machine)."""
    info = OPS[op]
    return (
        backend == "eager"
        or (backend == "cpp" and info.kernel is not None)
        or (backend == "triton" and info.triton)
    )


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
