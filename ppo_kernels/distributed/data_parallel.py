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

from ._comm import all_gather as _all_gather
from ._comm import check_same_sizes, cross_checks, require_initialized


def local_moments(xf: Tensor, m: Tensor, w: Tensor | None = None) -> Tensor:
    """(count, mean / s, M2 / s^2, s) of xf over m (bool), as one tensor [4] in xf's dtype, with s
    a power of two near max |x| (masked_stats' `_pow2_scale`: exact, so that finite inputs of any
    spread give finite moments); with weights w (a float mask's values) the weighted ones."""
    from ..masked_stats.op import _pow2_scale

    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    w = m.to(xf.dtype) if w is None else torch.where(m, w.to(xf.dtype), zero)
    s = _pow2_scale(xf, m)
    xs = xf / s
    n = w.sum()
    mean = torch.where(m, xs * w, zero).sum() / torch.where(n > 0, n, torch.ones_like(n))
    dev = torch.where(m, xs - mean, zero)
    m2 = (dev.square() * w).sum()
    return torch.stack([n, mean, m2, s])


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


def whiten_global(
    xf: Tensor,
    m: Tensor,
    shift_mean: bool,
    unbiased: bool,
    eps: float,
    group,
    w: Tensor | None = None,
) -> Tensor:
    """masked_whiten with the statistics of every rank (the local op's conventions and scaling)."""
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
