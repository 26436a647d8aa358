"""Data-parallel masked statistics: the mean and variance over the mask = 1 positions of every
rank, with ONE collective and no host synchronisation: each rank reduces its data to
(count, mean, M2, scale) -- M2 = sum of squared deviations from its own mean, so nothing cancels,
both relative to a power-of-two scale, so nothing overflows -- an all-gather exchanges those four
numbers, and every rank combines them with Chan et al.'s
pairwise update (exact in real arithmetic, stable in floating point)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _backend, _math
from .._checks import FLOAT_DTYPES, check_devices, check_shape, check_tensor, device_error
from ._comm import all_gather as _all_gather
from ._comm import check_same_sizes, cross_checks, require_initialized

local_moments = _math.local_moments  # (count, mean / s, M2 / s^2, s): ppo_kernels/_math.py


def _prep(x: Tensor, mask: Tensor):
    """The local op's checks and (x in the accumulation dtype, selection, weights)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask)
    if mask.dtype.is_complex:
        raise TypeError("mask: complex masks are not supported")
    check_shape("mask", mask, x.shape, "like x")
    if mask.device != x.device:
        raise device_error("mask", mask, x.device, "x")
    return _math.masked_weights(x, mask)


def combine_moments(moments: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[world, 4] (count, mean / s_r, M2 / s_r^2, s_r) -> global (count, mean / S, M2 / S^2, S)
    with S = max s_r (every ratio s_r / S is an exact power of two <= 1), Chan et al.'s pairwise
    update in rank order (deterministic)."""
    S = moments[:, 3].amax()
    r = moments[:, 3] / S
    n, mean, m2 = moments[0, 0], moments[0, 1] * r[0], moments[0, 2] * r[0] * r[0]
    for k in range(1, moments.shape[0]):
        nb, mb, m2b = moments[k, 0], moments[k, 1] * r[k], moments[k, 2] * r[k] * r[k]
        tot = n + nb
        safe = torch.where(tot > 0, tot, torch.ones_like(tot))
        delta = mb - mean
        mean = torch.where(tot > 0, mean + delta * nb / safe, mean)
        m2 = m2 + m2b + delta * delta * n * nb / safe
        n = tot
    return n, mean, m2, S


def global_moments(xf: Tensor, m: Tensor, group, w: Tensor | None = None):
    """Global (count, mean / S, M2 / S^2, S) over the ranks of `group` (one all-gather of four
    numbers per rank)."""
    require_initialized()
    local = local_moments(xf, m, w)
    return combine_moments(_all_gather(local, group).view(-1, 4))


def mean_global(x: Tensor, mask: Tensor, empty: str, group) -> Tensor:
    """masked_mean over the data of every rank (the local op's conventions)."""
    xf, m, w = _prep(x, mask)
    n, mean, _, scale = global_moments(xf, m, group, w)
    mean = mean * scale
    return mean if empty == "zero" else torch.where(n != 0, mean, float("nan"))


def whiten_global(
    x: Tensor, mask: Tensor, shift_mean: bool, unbiased: bool, eps: float, group
) -> Tensor:
    """masked_whiten with the statistics of every rank (the local op's conventions and scaling)."""
    xf, m, w = _prep(x, mask)
    n, mean, m2, S = global_moments(xf, m, group, w)
    if unbiased:
        # NaN for a total weight of 0 or 1, as the local op (the same as n >= 2 for counts)
        ok = (n != 0) & (n != 1)
        var = torch.where(ok, m2 / torch.where(ok, n - 1, 1.0), torch.full_like(m2, float("nan")))
    else:
        var = m2 / torch.where(n > 0, n, 1.0)
    y = xf / S - mean
    out = y / torch.hypot(var.sqrt(), (eps**0.5) / S)
    return out + mean * S if not shift_mean else out


def group_advantages_global(
    scores: Tensor,
    group_index: Tensor | None,
    group_size: int,
    eps: float,
    norm_by_std: bool,
    kind: str,
    mask: Tensor | None,
    group,
) -> Tensor:
    """The registered op `ppo_kernels::group_advantages` over the responses of every rank (groups
    may span ranks): each rank's advantages, `[B]` or `A[:, None] * mask`."""
    check_tensor("scores", scores, dtypes=FLOAT_DTYPES, dim=1)
    check_devices("scores", scores, group_index=group_index, mask=mask)
    if mask is not None:
        check_tensor("mask", mask, dim=2)
        if mask.dtype.is_complex:
            raise TypeError("mask: complex masks are not supported")
        check_shape("mask", mask, (scores.shape[0], mask.shape[1]), "one row per score")
    all_scores, all_ids, rows = gather_groups(scores, group_index, group)
    if group_size and all_scores.shape[0] % group_size != 0:
        raise ValueError(
            f"group_size: {group_size} does not divide the batch size {all_scores.shape[0]} "
            "(every rank's responses)"
        )
    op = _backend.op("group_advantages")
    adv = op(all_scores, all_ids, group_size, eps, norm_by_std, kind, None)[rows]
    return adv if mask is None else adv[:, None] * mask.to(adv.dtype)


def gather_groups(scores: Tensor, group_index: Tensor | None, group):
    """Every rank's scores (and group ids) in rank order, for group statistics whose groups may
    span ranks: one all-gather of [2 B] float64 per rank (scores and ids; float64 holds ids
    exactly). Returns (scores of all ranks, their group ids or None, this rank's rows)."""
    require_initialized()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    B = scores.shape[0]
    if cross_checks(scores):  # the payload's size depends on B
        check_same_sizes(group, scores.device, scores=B)
    ids = (
        group_index.double()
        if group_index is not None
        else torch.zeros_like(scores, dtype=torch.float64)
    )
    out = _all_gather(torch.cat([scores.double(), ids.to(scores.device)]), group).view(world, -1)
    all_scores = out[:, :B].reshape(-1).to(scores.dtype)
    all_ids = out[:, B:].reshape(-1).long() if group_index is not None else None
    rows = torch.arange(rank * B, (rank + 1) * B, device=scores.device)
    return all_scores, all_ids, rows
