"""Vocab-parallel token log-probs and entropy (Megatron's layout, which verl uses): each rank of a
tensor-parallel group holds the logits of its contiguous slice of the vocabulary, labels are
global ids, and every rank gets the full-vocabulary log-prob and entropy.

Forward, per rank: the softmax statistics (m, s, u) of its slice (csrc/common/softmax_stats.h) and
the label's logit where it owns the label -- computed by the same per-tile kernels that
linear_token_logprobs uses for vocabulary chunks (a vocabulary shard is a vocabulary chunk that
lives on another rank), on float32 row blocks of bounded size. ONE collective: an all-gather of
those per-row states ([5, N] float32 per rank plus a 3-value header: the slice's start, size and N,
so mismatched shapes are detected). Each rank then merges the states with `merge_states` (the
Python mirror of stats_merge) and finishes exactly like linear_token_logprobs.

Backward, per rank, no collective: with the merged log-sum-exp and entropy, the gradient of a
slice is elementwise (d lp / d z_j = onehot_j - p_j, d H / d z_j = -p_j (log p_j + H), / T), so
each rank writes its slice of the unsharded gradient with the same tile kernel. Every rank
computes the same loss from the replicated outputs; nothing is scaled by the world size.

Bytes per token moved by the collective: (5 * 4) * world bytes gathered (vs 2 * V for gathering
bf16 logits); see bench/bench_distributed.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._comm import all_gather as _all_gather

from .. import _backend
from .._checks import check_labels_in_range
from ..linear_logprobs import reference as lin_ref
from ..linear_logprobs.op import tile_bwd_, tile_stats_

_HEADER = 3           # vocab_start, V_rank, N
_ROWS = 5             # m, s, u, zlabel, owned
_BLOCK_BYTES = 64 << 20  # float32 row blocks of the shard handed to the tile kernels


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_blocks(N, V, acc):
    rows = max(1, _BLOCK_BYTES // max(V * acc.itemsize, 1))
    return range(0, N, rows), rows


def local_states(logits: Tensor, labels: Tensor, vocab_start: int, inv_t: float,
                 ignore_index: int) -> Tensor:
    """[_ROWS, N] (m, s, u, zlabel, owned) of this rank's vocabulary slice: the softmax statistics
    of z = logits * inv_t over the slice, the label's z where this slice owns the label (NaN
    elsewhere), and 1.0 where it owns it. Ignored rows keep the empty state."""
    N, V = logits.shape
    acc = _acc(logits.dtype)
    st = torch.empty(_ROWS, N, dtype=acc, device=logits.device)
    st[0] = float("-inf")
    st[1:3] = 0.0
    st[3] = float("nan")
    k = labels.long() - vocab_start
    st[4] = ((k >= 0) & (k < V) & (labels != ignore_index)).to(acc)
    if V == 0 or N == 0:
        return st
    starts, rows = _row_blocks(N, V, acc)
    buf = torch.empty(min(rows, N) * V, dtype=acc, device=logits.device)
    for r0 in starts:
        r1 = min(N, r0 + rows)
        tile = buf[: (r1 - r0) * V].view(r1 - r0, V).copy_(logits[r0:r1])
        state = st[0:3, r0:r1]
        zl = st[3, r0:r1]
        s_tmp, z_tmp = state.contiguous(), zl.contiguous()
        tile_stats_(tile, labels[r0:r1], vocab_start, inv_t, ignore_index, s_tmp, z_tmp)
        state.copy_(s_tmp)
        zl.copy_(z_tmp)
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
    u_new = torch.where(empty, torch.zeros_like(u), f * (u + d.clamp_min(torch.finfo(d.dtype).min) * s)).sum(0)
    return torch.stack([M, s_new, u_new])


def _gather(local: Tensor, header: list[int], group) -> Tensor:
    """One all-gather of [header | local states] -> [world, _HEADER + _ROWS * N]."""
    world = dist.get_world_size(group)
    flat = torch.cat([torch.tensor(header, dtype=local.dtype, device=local.device),
                      local.reshape(-1)])
    out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather(out, flat, group=group)
    return out.view(world, -1)


def _finish(gathered: Tensor, labels: Tensor, vocab_start: int, ignore_index: int,
            check_cpu: bool):
    """(logprobs, entropy, lse, V) from the gathered states; checks the slices tile [0, V)."""
    world = gathered.shape[0]
    header = gathered[:, :_HEADER].to(torch.int64).cpu()  # 3 * world numbers
    starts, sizes, ns = header[:, 0].tolist(), header[:, 1].tolist(), header[:, 2].tolist()
    N = labels.numel()
    if any(n != N for n in ns):
        raise ValueError(f"labels: ranks hold different numbers of rows {ns}; every rank of the "
                         "vocab-parallel group needs the same tokens")
    order = sorted(range(world), key=lambda r: starts[r])
    pos = 0
    for r in order:
        if starts[r] != pos:
            raise ValueError(f"vocab_start: the ranks' vocabulary slices (start, size) = "
                             f"{[(starts[i], sizes[i]) for i in range(world)]} do not tile "
                             "[0, V) contiguously")
        pos += sizes[r]
    V = pos
    if check_cpu:
        check_labels_in_range(labels, V, ignore_index)
    st = gathered[:, _HEADER:].view(world, _ROWS, N)
    merged = merge_states(st[:, 0:3])
    owned = st[:, 4]
    zl = torch.where(owned > 0, st[:, 3], torch.zeros_like(st[:, 3])).sum(0)
    zl = torch.where(owned.sum(0) > 0, zl, torch.full_like(zl, float("nan")))
    lp, ent, lse = lin_ref.finalize(merged, zl, labels, V, ignore_index)
    return lp, ent, lse, V


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, vocab_start, group):
        shape = labels.shape
        x = logits.reshape(-1, logits.shape[-1])
        y = labels.reshape(-1)
        inv_t = 1.0 / temperature
        local = local_states(x, y, vocab_start, inv_t, ignore_index)
        gathered = _gather(local, [vocab_start, x.shape[1], y.numel()], group)
        lp, ent, lse, V = _finish(gathered, y, vocab_start, ignore_index, logits.device.type == "cpu")
        out = _backend.out_dtype(logits)
        lp, ent, lse = lp.to(out), ent.to(out), lse.to(out)
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.args = (inv_t, ignore_index, vocab_start, V)
        ctx.mark_non_differentiable(lse)
        return lp.view(shape), ent.view(shape), lse.view(shape)

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, _grad_lse):
        logits, labels, lse, ent = ctx.saved_tensors
        inv_t, ignore_index, vocab_start, V = ctx.args
        acc = _acc(logits.dtype)
        x = logits.reshape(-1, logits.shape[-1])
        y = labels.reshape(-1)
        N, Vr = x.shape
        glp = (torch.zeros(N, dtype=acc, device=x.device) if grad_lp is None
               else grad_lp.reshape(-1).to(acc))
        gent = None if grad_ent is None else grad_ent.reshape(-1).to(acc)
        grad = _backend.new_output(x.shape, logits.dtype, logits.device)
        if N and Vr:
            starts, rows = _row_blocks(N, Vr, acc)
            buf = torch.empty(min(rows, N) * Vr, dtype=acc, device=x.device)
            for r0 in starts:
                r1 = min(N, r0 + rows)
                tile = buf[: (r1 - r0) * Vr].view(r1 - r0, Vr).copy_(x[r0:r1])
                tile_bwd_(tile, y[r0:r1], vocab_start, lse.reshape(-1)[r0:r1],
                          ent.reshape(-1)[r0:r1] if gent is not None else None, glp[r0:r1],
                          gent[r0:r1] if gent is not None else None, inv_t, ignore_index, V)
                grad[r0:r1] = tile
        return grad.view(logits.shape), None, None, None, None, None


_size_cache: dict[tuple[int, int, int], int] = {}


def default_vocab_start(v_rank: int, group) -> int:
    """This rank's slice start, from every rank's slice size (one all-gather of sizes the first
    time for a (group, size) pair; cached after that, so steady-state calls stay at one collective).
    Ranks hold contiguous slices in rank order (Megatron's layout)."""
    key = (id(group), dist.get_rank(group), v_rank)
    if key not in _size_cache:
        world = dist.get_world_size(group)
        mine = torch.tensor([v_rank], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            mine = mine.cuda()
        sizes = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(sizes, mine, group=group)
        rank = dist.get_rank(group)
        _size_cache[key] = int(sum(int(s) for s in sizes[:rank]))
    return _size_cache[key]


def vocab_parallel_token_logprobs(logits: Tensor, labels: Tensor, temperature: float,
                                  ignore_index: int, return_entropy: bool, process_group,
                                  vocab_start: int | None):
    """The body of token_logprobs(..., process_group=...); arguments already checked."""
    if not dist.is_initialized():
        raise RuntimeError("process_group: torch.distributed is not initialised")
    if vocab_start is None:
        vocab_start = default_vocab_start(logits.shape[-1], process_group)
    elif not (isinstance(vocab_start, int) and vocab_start >= 0):
        raise ValueError(f"vocab_start: expected a non-negative int, got {vocab_start!r}")
    lp, ent, _ = _VocabParallelTokenLogprobs.apply(logits, labels, float(temperature),
                                                   int(ignore_index), int(vocab_start),
                                                   process_group)
    return (lp, ent) if return_entropy else lp
