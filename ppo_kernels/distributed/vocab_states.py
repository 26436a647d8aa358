"""The vocab-parallel forms' shared math (Megatron's layout: each rank of a tensor-parallel group
holds a contiguous slice of the vocabulary, labels are global ids): the per-row softmax states of
a slice ([5, N]: m, s, u, the label's logit, whether the slice owns the label), their merge across
ranks (`merge_states`, the Python mirror of csrc/common/softmax_stats.h's stats_merge) and the
finish into each row's full-vocabulary log-prob, entropy and log-sum-exp, exactly as
linear_token_logprobs finishes vocabulary chunks (a vocabulary shard is a vocabulary chunk that
lives on another rank). Used by vocab_parallel_token_logprobs.py, vocab_parallel_linear.py and
vocab_parallel_policy.py."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_devices,
    check_int,
    check_tensor,
)
from .._math import acc_dtype
from ..fused_linear import engine
from ..fused_linear.vocab_chunks import tile_stats_
from ..linear_logprobs import naive as lin_ref
from .vocab_layout import (
    HEADER,
    check_layout,
)

ROWS = 5  # m, s, u, zlabel, owned
BLOCK_BYTES = 64 << 20  # float32 row blocks of the shard handed to the tile kernels


def row_blocks(N, V, acc):
    rows = max(1, BLOCK_BYTES // max(V * acc.itemsize, 1))
    return range(0, N, rows), rows


def shared_plan(hidden, sizes, rank, logits_dtype, budget, share=1) -> engine.Plan:
    """This rank's plan of whole-row tiles (engine.plan_rows over its slice of `sizes`) with the
    row blocks every rank plans alike, the fewest rows any slice's plan takes: the per-block
    collectives then match."""
    plans = [engine.plan_rows(hidden, v, logits_dtype, budget, share, fused=False) for v in sizes]
    return dataclasses.replace(plans[rank], rows=min(p.rows for p in plans))


def row_inverse(temperatures: Tensor | None, shape, acc) -> Tensor | None:
    """Per-row temperatures (a shape that is a leading part of `shape`) as each flat row's 1 / T
    [prod(shape)] in the accumulation dtype: the reciprocal taken in float64 as the sampler's
    kernels take it (engine.sampler_params), or None."""
    if temperatures is None:
        return None
    inv = engine.sampler_params(
        tuple(shape), temperatures.device, temperatures, 0, None, 1.0, None, 0.0, None
    )[0]
    return inv.to(acc)


def scaled_tile(buf, x, r0, r1, inv_ts):
    """Rows r0:r1 of x copied into buf in the accumulation dtype, each row times its 1 / T where
    per-row temperatures are given (the tile kernels then run at temperature 1: z = x / T_row,
    the product the sampler's kernels form)."""
    V = x.shape[1]
    tile = buf[: (r1 - r0) * V].view(r1 - r0, V).copy_(x[r0:r1])
    return tile if inv_ts is None else tile.mul_(inv_ts[r0:r1].unsqueeze(-1))


def local_states(
    logits: Tensor,
    labels: Tensor,
    vocab_start: int,
    inv_t: float,
    ignore_index: int,
    inv_ts: Tensor | None = None,
) -> Tensor:
    """[ROWS, N] (m, s, u, zlabel, owned) of this rank's vocabulary slice: the softmax statistics
    of z = logits * inv_t (or * inv_ts, per row [N]) over the slice, the label's z where this
    slice owns the label (NaN elsewhere), and 1.0 where it owns it. Ignored rows keep the empty
    state."""
    N, V = logits.shape
    acc = acc_dtype(logits.dtype)
    st = empty_states(labels, vocab_start, V, ignore_index, acc)
    if V == 0 or N == 0:
        return st
    if inv_ts is not None:
        inv_t = 1.0
    starts, rows = row_blocks(N, V, acc)
    buf = torch.empty(min(rows, N) * V, dtype=acc, device=logits.device)
    for r0 in starts:
        r1 = min(N, r0 + rows)
        tile = scaled_tile(buf, logits, r0, r1, inv_ts)
        state = st[0:3, r0:r1]
        zl = st[3, r0:r1]
        s_tmp, z_tmp = state.contiguous(), zl.contiguous()
        tile_stats_(tile, labels[r0:r1], vocab_start, inv_t, ignore_index, s_tmp, z_tmp)
        state.copy_(s_tmp)
        zl.copy_(z_tmp)
    return st


def empty_states(labels: Tensor, vocab_start: int, V: int, ignore_index: int, acc) -> Tensor:
    """[ROWS, N] states of no logit yet: m = -inf, s = u = 0, zlabel NaN, and owned = 1.0 where
    the slice [vocab_start, vocab_start + V) holds the row's label."""
    st = torch.empty(ROWS, labels.numel(), dtype=acc, device=labels.device)
    st[0] = float("-inf")
    st[1:3] = 0.0
    st[3] = float("nan")
    k = labels.long() - vocab_start
    st[4] = ((k >= 0) & (k < V) & (labels != ignore_index)).to(acc)
    return st


def merge_states(states: Tensor) -> Tensor:
    """Merge per-rank softmax states [world, 3, N] -> [3, N] (csrc/common/softmax_stats.h's
    stats_merge, vectorised over ranks): rescale every state to the common (NaN-propagating) max,
    then add. Empty states (s == 0) contribute nothing."""
    m, s, u = states[:, 0], states[:, 1], states[:, 2]
    nan_any = m.isnan().any(0)
    M = m.amax(0)
    M = torch.where(nan_any, torch.full_like(M, float("nan")), M)
    empty = s == 0
    M_safe = torch.where(M.isinf() & (M < 0), torch.zeros_like(M), M)
    d = m - M_safe
    f = torch.where(empty, torch.zeros_like(d), d.exp())
    s_new = (f * s).sum(0)
    u_new = torch.where(
        empty, torch.zeros_like(u), f * (u + d.clamp_min(torch.finfo(d.dtype).min) * s)
    ).sum(0)
    return torch.stack([M, s_new, u_new])


def finish(
    gathered: Tensor,
    labels: Tensor,
    rank: int,
    ignore_index: int,
    with_entropy: bool,
    v_rank: int,
):
    """(logprobs, entropy or an empty tensor, lse, layout) from the gathered states, where layout
    is int64 [2] on the CPU = (this rank's start, V) for the backward. The gathered headers are
    checked first (vocab_layout.check_layout); where they were compared with a validated layout
    on the device, a mismatch gives NaN rows instead of an error (no host sync)."""
    world = gathered.shape[0]
    N = labels.numel()
    starts, sizes, ok = check_layout(gathered, labels, rank, ignore_index, v_rank)
    V = sum(sizes)
    lp, ent, lse = merge_finalize(gathered, labels, V, ignore_index, world, N)
    if ok is not None:
        nan = torch.full((), float("nan"), dtype=lp.dtype, device=lp.device)
        lp, ent, lse = (torch.where(ok, t, nan) for t in (lp, ent, lse))
    layout = torch.tensor([starts[rank], V], dtype=torch.int64)
    return lp, (ent if with_entropy else ent.new_empty(0)), lse, layout


def merge_finalize(gathered, labels, V, ignore_index, world, N):
    return merge_rows(gathered[:, HEADER:].view(world, ROWS, N), labels, V, ignore_index)


def merge_rows(st: Tensor, labels: Tensor, V: int, ignore_index: int):
    """(logprobs, entropy, lse) [N] from every rank's states st [world, ROWS, N] (local_states'
    rows) of a vocabulary of V: the merged softmax statistics, the label's logit from the rank
    that owns it (NaN where none does: out of range)."""
    merged = merge_states(st[:, 0:3])
    owned = st[:, 4]
    zl = torch.where(owned > 0, st[:, 3], torch.zeros_like(st[:, 3])).sum(0)
    zl = torch.where(owned.sum(0) > 0, zl, torch.full_like(zl, float("nan")))
    return lin_ref.finalize(merged, zl, labels, V, ignore_index)


def check_finish_args(labels, gathered, rank, rows, dev, acc, like):
    """The arguments every vocab-parallel op shares (metadata only); dev: the op's device, that
    of its argument `like`."""
    check_arg("labels", labels, dev, like=like, dtypes=INDEX_DTYPES, shape=rows, what="the rows")
    check_arg("gathered", gathered, dev, like=like)
    check_tensor("gathered", gathered, dtypes=(acc,), dim=2)
    n = HEADER + ROWS * labels.numel()
    if gathered.shape[1] != n:
        raise ValueError(f"gathered: expected {n} columns per rank, got {gathered.shape[1]}")
    check_int("rank", rank, min_value=0)
    if rank >= gathered.shape[0]:
        raise ValueError(f"rank: {rank} is not below the world size {gathered.shape[0]}")


def check_grads(grad_logprobs, grad_entropy, lse, entropy, rows, dev, acc, like):
    check_devices(like, dev, grad_entropy=grad_entropy, entropy=entropy)
    check_arg(
        "grad_logprobs", grad_logprobs, dev, like=like, dtypes=FLOAT_DTYPES, shape=rows, what="rows"
    )
    check_arg("lse", lse, dev, like=like, dtypes=(acc,), shape=rows, what="the rows")
    if grad_entropy is not None and grad_entropy.numel():
        check_arg(
            "grad_entropy",
            grad_entropy,
            dev,
            like=like,
            dtypes=FLOAT_DTYPES,
            shape=rows,
            what="rows",
        )
        check_arg("entropy", entropy, dev, like=like, dtypes=(acc,), shape=rows, what="the rows")
