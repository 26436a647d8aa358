"""Argument validation shared by the public ops: metadata only, never a host sync."""

from __future__ import annotations

import numbers

import torch

try:
    from numpy import bool_ as numpy_bool
except ImportError:  # numpy is optional

    class numpy_bool:  # never an instance
        pass


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)


def check_tensor(name: str, t, *, dtypes=None, dim=None, min_dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported "
            f"(expected one of {allowed})"
        )
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if min_dim is not None and t.dim() < min_dim:
        raise ValueError(
            f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(t.shape)}"
        )


def device_error(name: str, t, device, like: str) -> ValueError:
    """The one form of a device mismatch, as the C++ checks write it (csrc/common/tensor_checks.h):
    `mask: expected a tensor on cpu (like logprobs), got meta`."""
    return ValueError(f"{name}: expected a tensor on {device} (like {like}), got {t.device}")


def check_devices(like: str, x, **tensors):
    """Every tensor of `tensors` (None skipped; a tuple / list: each of its tensors) on the device
    of `x` (a tensor, or a torch.device), the op's main tensor named `like`: a ValueError naming
    the argument and both devices otherwise. Empty tensors too. Metadata only."""
    device = x if isinstance(x, torch.device) else x.device
    for name, t in tensors.items():
        if t is None:
            continue
        if isinstance(t, (tuple, list)):
            for i, u in enumerate(t):
                if u is not None and u.device != device:
                    raise device_error(f"{name}[{i}]", u, device, like)
        elif t.device != device:
            raise device_error(name, t, device, like)


def check_same_device(**tensors):
    """Tensors (None skipped) on the device of the first one, each a torch.Tensor."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    for k, v in items:
        check_tensor(k, v)
    dev0 = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev0:
            raise device_error(k, v, dev0, items[0][0])


def check_shape(name: str, t, shape, what: str):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def check_positive(name: str, x: float):
    return check_float(name, x, positive=True)


# Scalar arguments: a string, bool or tensor where a number belongs is a TypeError naming the
# argument (float("0.7") would accept a string). Symbolic values (torch.compile with dynamic
# shapes) pass; their range checks use comparisons only (math.isnan cannot trace a SymFloat).
_SYM_FLOAT = (torch.SymFloat, torch.SymInt)
_INF = float("inf")


def _type_name(x) -> str:
    return type(x).__name__


def check_float(
    name: str,
    x,
    *,
    positive: bool = False,
    nonneg: bool = False,
    finite: bool = True,
    allow_none: bool = False,
):
    """A real number (int or float, not bool / str / tensor), returned as a float; None passes
    through when allow_none. positive: > 0; nonneg: >= 0; finite: not inf / NaN (NaN never
    passes a range check)."""
    if x is None and allow_none:
        return None
    if type(x) is float or type(x) is int:  # the common case, without numbers.Real's ABC check
        v = float(x)
    elif isinstance(x, _SYM_FLOAT):
        v = x
    elif isinstance(x, numbers.Real) and not isinstance(x, (bool, numpy_bool)):
        v = float(x)
    else:
        raise TypeError(f"{name}: expected a number, got {_type_name(x)} {x!r}")
    if v != v:  # NaN (no math.isnan: it cannot trace a SymFloat)  # noqa: PLR0124
        raise ValueError(f"{name}: expected a number, got NaN")
    if finite and not (-_INF < v < _INF):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if positive and not (v > 0):
        raise ValueError(f"{name}: expected a positive number, got {v}")
    if nonneg and not (v >= 0):
        raise ValueError(f"{name}: expected a non-negative number, got {v}")
    return v


def check_int(name: str, x, *, min_value: int | None = None, allow_none: bool = False):
    """An integer (not bool / float / str), returned as an int."""
    if x is None and allow_none:
        return None
    if type(x) is int:  # the common case, without numbers.Integral's ABC check
        v = x
    elif isinstance(x, torch.SymInt):
        v = x
    elif isinstance(x, numbers.Integral) and not isinstance(x, (bool, numpy_bool)):
        v = int(x)
    else:
        raise TypeError(f"{name}: expected an int, got {_type_name(x)} {x!r}")
    if min_value is not None and not (v >= min_value):
        raise ValueError(f"{name}: expected an int >= {min_value}, got {v}")
    return v


def check_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, numpy_bool)):
        raise TypeError(f"{name}: expected a bool, got {_type_name(x)} {x!r}")
    return bool(x)


def check_str(name: str, x, choices=None) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{name}: expected a string, got {_type_name(x)} {x!r}")
    if choices is not None and x not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {x!r}")
    return x


# float32 is what the kernels compute in: 1 / temperature must be finite there.
FLOAT32_MAX = torch.finfo(torch.float32).max


def check_temperature(x) -> float:
    """A positive finite temperature whose inverse is finite in float32 (> ~2.9e-39)."""
    t = check_float("temperature", x, positive=True)
    if not isinstance(t, _SYM_FLOAT) and not (1.0 / t <= FLOAT32_MAX):
        raise ValueError(
            f"temperature: {t} is too small (1 / temperature overflows float32; "
            f"the smallest accepted is {1.0 / FLOAT32_MAX:.3g})"
        )
    return t


def check_arg(
    name: str,
    t,
    device,
    *,
    like: str,
    dtypes=None,
    shape=None,
    what: str = "",
    allow_none: bool = False,
):
    """One tensor argument of a registered op (forward or backward): type, dtype, device (the
    op's, that of its argument `like`), shape. Metadata only (no sync), so the backward ops can
    run it on every call."""
    if t is None and allow_none:
        return
    check_tensor(name, t, dtypes=dtypes)
    if t.device != device:
        raise device_error(name, t, device, like)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name}: expected shape {tuple(shape)}{f' ({what})' if what else ''}, "
            f"got {tuple(t.shape)}"
        )


def check_labels_in_range(labels, V: int, ignore_index: int):
    """IndexError naming the first label outside [0, V) that is not ignore_index. Reads the
    labels: a host sync on the GPU, so GPU callers only run it under strict_checks()."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        pos = int(bad.flatten().nonzero()[0])
        raise IndexError(
            f"labels: value {int(labels.flatten()[pos])} at flat position {pos} is "
            f"outside the vocabulary [0, {V}) and is not ignore_index ({ignore_index})"
        )
