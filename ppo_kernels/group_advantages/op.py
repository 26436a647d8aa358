"""GRPO / RLOO group advantages as a torch op: `ppo_kernels::group_advantages`. No gradient (the
advantages are targets); the scores are detached. Backends: "cpp" (C++ on the CPU), "triton" (the
GPU default), "eager" (reference.py, and always for float64)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend, _modes
from .._checks import (
    INDEX_DTYPES,
    check_arg,
    check_bool,
    check_float,
    check_int,
    check_same_device,
    check_shape,
    check_str,
    check_tensor,
)
from . import reference

_backend.register_op(
    "group_advantages",
    kernel="group_advantages",
    triton=True,
    cuda_default="triton",
    public=("grpo_advantages", "rloo_advantages"),
)

SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MASK_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
) + SCORE_DTYPES


# The kernel, one implementation per backend with one signature. kind: a name of
# _modes.GROUP_ADVANTAGES; group_index [B] (values in [0, B)) or None and group_size > 0.
forward = _backend.Kernel("group_advantages", "forward")


@forward.impl("cpp")
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    return _backend.cpp_ops().group_advantages(
        scores, group_index, group_size, eps, norm_by_std, kind, mask
    )


@forward.impl("triton")
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    from . import triton_kernels

    return triton_kernels.group_advantages(
        scores,
        group_index,
        group_size,
        eps,
        norm_by_std,
        _modes.index("kind", _modes.GROUP_ADVANTAGES, kind),
        mask,
    )


@forward.impl("eager")
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    adv = reference.group_advantages(
        scores,
        group_index,
        group_size if group_index is None else None,
        eps,
        norm_by_std,
        mask,
        kind,
    )
    return adv.to(_backend.out_dtype(scores))


def _check_op_args(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    """What the registered op is given, whoever calls it (metadata; group ids on the CPU)."""
    check_tensor("scores", scores, dtypes=SCORE_DTYPES, dim=1)
    B, dev = scores.shape[0], scores.device
    if group_index is not None:
        check_arg(
            "group_index", group_index, dev, dtypes=INDEX_DTYPES, shape=(B,), what="like scores"
        )
        if dev.type == "cpu" or _backend.strict():
            _check_index_cpu(group_index, B)
    else:
        check_int("group_size", group_size, min_value=1)
    check_float("eps", eps, nonneg=True)
    check_bool("norm_by_std", norm_by_std)
    check_str("kind", kind, _modes.GROUP_ADVANTAGES)
    if mask is not None:
        check_arg("mask", mask, dev, dtypes=MASK_DTYPES)
        if mask.dim() != 2 or mask.shape[0] != B:
            raise ValueError(
                f"mask: expected shape ({B}, T) (one row per score), got {tuple(mask.shape)}"
            )


@torch.library.custom_op("ppo_kernels::group_advantages", mutates_args=())
def group_advantages_op(
    scores: Tensor,
    group_index: Tensor | None,
    group_size: int,
    eps: float,
    norm_by_std: bool,
    kind: str,
    mask: Tensor | None,
) -> Tensor:
    """scores [B]; group_index [B] (values in [0, B)) or group_size > 0; mask [B, T] or None;
    kind "grpo" or "rloo"."""
    _check_op_args(scores, group_index, group_size, eps, norm_by_std, kind, mask)
    return forward(scores, group_index, group_size, eps, norm_by_std, kind, mask)


@group_advantages_op.register_fake
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    shape = (scores.shape[0],) if mask is None else tuple(mask.shape)
    return scores.new_empty(shape, dtype=_backend.out_dtype(scores))


def _check_index_cpu(group_index, B):
    bad = (group_index < 0) | (group_index >= B)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        raise IndexError(
            f"group_index: value {int(group_index[pos])} at position {pos} is outside "
            f"[0, B) = [0, {B}); pass e.g. torch.unique(ids, return_inverse=True)[1]"
        )


def group_ids(labels, device=None) -> Tensor:
    """int64 group ids in [0, number of distinct labels) from any per-response labels: a numpy
    array or a sequence of hashables (verl passes prompt uid strings as a numpy object array).
    Equal labels share an id; ids follow the sorted order of the labels (numpy's unique)."""
    import numpy as np

    arr = np.asarray(labels, dtype=object) if not isinstance(labels, np.ndarray) else labels
    if arr.ndim != 1:
        raise ValueError(
            f"group_index: expected one label per response (1-D), got shape {arr.shape}"
        )
    try:
        inv = np.unique(arr, return_inverse=True)[1]
    except TypeError:  # unorderable mixture: first-appearance order
        first = {}
        inv = np.array([first.setdefault(x, len(first)) for x in arr.tolist()], dtype=np.int64)
    return torch.from_numpy(np.asarray(inv, dtype=np.int64).reshape(-1)).to(device)


def _group_advantages(
    kind, scores, group_index, group_size, eps, norm_by_std, mask, process_group=None
):
    check_tensor("scores", scores, dtypes=SCORE_DTYPES, dim=1)
    if process_group is not None:
        if group_index is not None and not isinstance(group_index, Tensor):
            raise ValueError(
                "group_index: labels are numbered per rank; with process_group pass "
                "global integer group ids"
            )
        from ..distributed.data_parallel import gather_groups

        if mask is not None:
            check_tensor("mask", mask, dtypes=MASK_DTYPES, dim=2)
            check_shape("mask", mask, (scores.shape[0], mask.shape[1]), "one row per score")
        scores, group_index, rows = gather_groups(scores, group_index, process_group)
        adv = _group_advantages(kind, scores, group_index, group_size, eps, norm_by_std, None)
        adv = adv[rows]
        return adv if mask is None else adv[:, None] * mask.to(adv.dtype)
    B = scores.shape[0]
    if group_index is not None and not isinstance(group_index, Tensor):
        group_index = group_ids(group_index, scores.device)
    if (group_index is None) == (group_size is None):
        raise ValueError(
            "pass exactly one of group_index (a group id per response) and group_size "
            "(contiguous groups of that many responses)"
        )
    if group_index is not None:
        check_tensor("group_index", group_index, dtypes=INDEX_DTYPES, dim=1)
        if group_index.shape[0] != B:
            raise ValueError(
                f"group_index: expected shape ({B},) (like scores), got {tuple(group_index.shape)}"
            )
        check_same_device(scores=scores, group_index=group_index)
        if group_index.device.type == "cpu" or _backend.strict():
            _check_index_cpu(group_index, B)  # on the GPU a host sync, by request only
        group_index = group_index.contiguous()
        gs = 0
    else:
        group_size = check_int("group_size", group_size, min_value=1)
        if B % group_size != 0:
            raise ValueError(f"group_size: {group_size} does not divide the batch size {B}")
        gs = group_size
    eps = check_float("eps", eps, nonneg=True)
    norm_by_std = check_bool("norm_by_std", norm_by_std)
    if mask is not None:
        check_tensor("mask", mask, dtypes=MASK_DTYPES, dim=2)
        if mask.shape[0] != B:
            raise ValueError(
                f"mask: expected shape ({B}, T) (one row per score), got {tuple(mask.shape)}"
            )
        check_same_device(scores=scores, mask=mask)
        mask = mask.contiguous()
    return torch.ops.ppo_kernels.group_advantages(
        scores.detach().contiguous(), group_index, gs, float(eps), bool(norm_by_std), kind, mask
    )


def grpo_advantages(
    scores: Tensor,
    group_index: Tensor | None = None,
    group_size: int | None = None,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    mask: Tensor | None = None,
    process_group=None,
) -> Tensor:
    """GRPO outcome advantages (verl's `compute_grpo_outcome_advantage`), without a Python loop.

    `A_i = (R_i - mean_g) / (std_g + eps)` with the unbiased std of the response's group
    (`R_i - mean_g` when `norm_by_std=False`, Dr. GRPO). A singleton group uses mean 0 and std 1
    (A_i = R_i / (1 + eps)); a group of equal scores gives 0.

    Args:
        scores: [B] one score per response (sum token-level rewards first), any float dtype.
        group_index: [B] int32/int64 group id per response, values in [0, B), or any labels (a
            numpy array of uid strings, a list of hashables: see `group_ids`); or
        group_size: responses come in contiguous groups of this size (B % group_size == 0).
        mask: optional [B, T] action mask: the result is `A[:, None] * mask`, float32.
        process_group: groups over the responses of every rank of this torch.distributed group
            (in rank order; every rank holds the same number B of responses): one all-gather of
            the scores (and group ids, which are then global: values in [0, world * B)); a group
            may span ranks. Each rank gets the advantages of its own responses.
    Returns float32 [B] (or [B, T]); float64 for float64 scores. No gradient.
    """
    return _group_advantages(
        "grpo", scores, group_index, group_size, eps, norm_by_std, mask, process_group
    )


def rloo_advantages(
    scores: Tensor,
    group_index: Tensor | None = None,
    group_size: int | None = None,
    *,
    mask: Tensor | None = None,
    singleton: str = "score",
    process_group=None,
) -> Tensor:
    """RLOO advantages (verl's `compute_rloo_outcome_advantage`): `A_i = R_i - mean of the other
    members of its group` = n / (n - 1) * (R_i - mean_g). A singleton keeps its score (A_i = R_i,
    as verl's `rloo`) with `singleton="score"`, or gets 0 with `"zero"` (verl's
    `rloo_vectorized`). Arguments and result as `grpo_advantages`."""
    if singleton not in ("score", "zero"):
        raise ValueError(f"singleton: expected 'score' or 'zero', got {singleton!r}")
    if singleton == "zero" and process_group is not None:
        raise ValueError("singleton: 'zero' needs the global group sizes; not with process_group")
    if group_index is not None and not isinstance(group_index, Tensor):
        group_index = group_ids(group_index, scores.device)
    adv = _group_advantages(
        "rloo", scores, group_index, group_size, 0.0, False, mask, process_group
    )
    if singleton == "zero":
        if group_index is None:
            keep = torch.full((scores.shape[0],), group_size > 1, device=scores.device)
        else:
            keep = (
                torch.bincount(group_index.long(), minlength=scores.shape[0])[group_index.long()]
                > 1
            )
        adv = adv * (keep.unsqueeze(-1) if adv.dim() == 2 else keep).to(adv.dtype)
    return adv
