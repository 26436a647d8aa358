"""Argument validation shared by the public ops: metadata only, never a host sync."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)


def check_tensor(name: str, t, *, dtypes=None, dim=None, min_dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported "
                        f"(expected one of {allowed})")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if min_dim is not None and t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(t.shape)}")


def check_same_device(**tensors):
    items = [(k, v) for k, v in tensors.items() if v is not None]
    dev0 = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev0:
            raise ValueError(f"{k}: expected device {dev0} (like {items[0][0]}), got {v.device}")


def check_shape(name: str, t, shape, what: str):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def check_positive(name: str, x: float):
    if not (x > 0 and x < float("inf")):
        raise ValueError(f"{name}: expected a positive finite number, got {x}")


def check_labels_in_range(labels, V: int, ignore_index: int):
    """IndexError naming the first label outside [0, V) that is not ignore_index. Reads the
    labels: a host sync on the GPU, so GPU callers only run it under strict_checks()."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        pos = int(bad.flatten().nonzero()[0])
        raise IndexError(f"labels: value {int(labels.flatten()[pos])} at flat position {pos} is "
                         f"outside the vocabulary [0, {V}) and is not ignore_index ({ignore_index})")
