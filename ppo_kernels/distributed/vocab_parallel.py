"""Vocab-parallel token log-probs and entropy (Megatron's layout, which verl uses): each rank of a
tensor-parallel group holds the logits of its contiguous slice of the vocabulary, labels are
global ids, and every rank gets the full-vocabulary log-prob and entropy.

Forward, per rank: the softmax statistics (m, s, u) of its slice (csrc/common/softmax_stats.h) and
the label's logit where it owns the label -- computed by the same per-tile kernels that
linear_token_logprobs uses for vocabulary chunks (a vocabulary shard is a vocabulary chunk that
lives on another rank), on float32 row blocks of bounded size. ONE collective: an all-gather of
those per-row states ([5, N] float32 per rank plus a 3-value header: the slice's start, size and
N, checked; a different N across ranks is caught before, by _comm.check_same_sizes). Each rank
then merges the states with `merge_states` (the Python mirror of stats_merge) and finishes
exactly like linear_token_logprobs.

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

from .. import _backend
from .._checks import check_labels_in_range
from ..linear_logprobs import reference as lin_ref
from ..linear_logprobs.op import tile_bwd_, tile_stats_
from ._comm import all_gather as _all_gather
from ._comm import all_reduce_, check_same_sizes, cross_checks, require_initialized

_HEADER = 4  # vocab_start, V_rank, N, derived (1: vocab_start not given, see _settle_start)
_ROWS = 5  # m, s, u, zlabel, owned
_BLOCK_BYTES = 64 << 20  # float32 row blocks of the shard handed to the tile kernels


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_blocks(N, V, acc):
    rows = max(1, _BLOCK_BYTES // max(V * acc.itemsize, 1))
    return range(0, N, rows), rows


def local_states(
    logits: Tensor, labels: Tensor, vocab_start: int, inv_t: float, ignore_index: int
) -> Tensor:
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
    u_new = torch.where(
        empty, torch.zeros_like(u), f * (u + d.clamp_min(torch.finfo(d.dtype).min) * s)
    ).sum(0)
    return torch.stack([M, s_new, u_new])


def _gather(local: Tensor, header: list[int], group) -> Tensor:
    """One all-gather of [header | local states] -> [world, _HEADER + _ROWS * N] (after a tiny
    one of N where cross-rank checks run: the payload's size depends on it)."""
    world = dist.get_world_size(group)
    if cross_checks(local):
        check_same_sizes(group, local.device, labels=header[2])
    flat = torch.cat(
        [torch.tensor(header, dtype=local.dtype, device=local.device), local.reshape(-1)]
    )
    return _all_gather(flat, group).view(world, -1)


def _finish(gathered: Tensor, labels: Tensor, vocab_start: int, ignore_index: int, check_cpu: bool):
    """(logprobs, entropy, lse, V) from the gathered states; checks the slices tile [0, V)."""
    world = gathered.shape[0]
    header = gathered[:, :_HEADER].to(torch.int64).cpu()  # 3 * world numbers
    starts, sizes, ns = header[:, 0].tolist(), header[:, 1].tolist(), header[:, 2].tolist()
    N = labels.numel()
    if any(n != N for n in ns):
        raise ValueError(
            f"labels: ranks hold different numbers of rows {ns}; every rank of the "
            "vocab-parallel group needs the same tokens"
        )
    order = sorted(range(world), key=lambda r: starts[r])
    pos = 0
    for r in order:
        if starts[r] != pos:
            raise ValueError(
                f"vocab_start: the ranks' vocabulary slices (start, size) = "
                f"{[(starts[i], sizes[i]) for i in range(world)]} do not tile "
                "[0, V) contiguously"
            )
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
        x = logits.reshape(labels.numel(), logits.shape[-1])
        y = labels.reshape(-1)
        inv_t = 1.0 / temperature
        vocab_start, derived = vocab_start
        gathered, vocab_start = _gather_settled(
            lambda start: local_states(x, y, start, inv_t, ignore_index),
            vocab_start,
            derived,
            x.shape[1],
            y.numel(),
            group,
        )
        lp, ent, lse, V = _finish(
            gathered, y, vocab_start, ignore_index, logits.device.type == "cpu"
        )
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
        x = logits.reshape(labels.numel(), logits.shape[-1])
        y = labels.reshape(-1)
        N, Vr = x.shape
        glp = (
            torch.zeros(N, dtype=acc, device=x.device)
            if grad_lp is None
            else grad_lp.reshape(-1).to(acc)
        )
        gent = None if grad_ent is None else grad_ent.reshape(-1).to(acc)
        grad = _backend.new_output(x.shape, logits.dtype, logits.device)
        if N and Vr:
            starts, rows = _row_blocks(N, Vr, acc)
            buf = torch.empty(min(rows, N) * Vr, dtype=acc, device=x.device)
            for r0 in starts:
                r1 = min(N, r0 + rows)
                tile = buf[: (r1 - r0) * Vr].view(r1 - r0, Vr).copy_(x[r0:r1])
                tile_bwd_(
                    tile,
                    y[r0:r1],
                    vocab_start,
                    lse.reshape(-1)[r0:r1],
                    ent.reshape(-1)[r0:r1] if gent is not None else None,
                    glp[r0:r1],
                    gent[r0:r1] if gent is not None else None,
                    inv_t,
                    ignore_index,
                    V,
                )
                grad[r0:r1] = tile
        return grad.view(logits.shape), None, None, None, None, None


# (id(group), rank, slice size) -> the slice start learned from a gather (see _settle_start)
_start_cache: dict[tuple[int, int, int], int] = {}


def _resolve_vocab_start(vocab_start, v_rank: int, group) -> tuple[int, bool]:
    """(start, derived): the given first vocabulary id of this rank (checked; derived False), or,
    when not given, a provisional start (derived True): the one learned by an earlier call for
    this (group, slice size), else rank * slice size (right for even shards). No collective here:
    a collective only some ranks ran (those whose cache missed) would hang the others, so the
    start is settled from the forward's own gather (_settle_start)."""
    require_initialized()
    if vocab_start is None:
        rank = dist.get_rank(group)
        return _start_cache.get((id(group), rank, v_rank), rank * v_rank), True
    if not (isinstance(vocab_start, int) and vocab_start >= 0):
        raise ValueError(f"vocab_start: expected a non-negative int, got {vocab_start!r}")
    return vocab_start, False


def _settle_start(gathered: Tensor, group) -> tuple[int, bool]:
    """After the gather of headers [start, size, N, derived]: (this rank's start, redo). Where no
    rank was given vocab_start, slices are contiguous in rank order (Megatron's layout); a given
    start must fit that layout when other ranks derive theirs. redo: some derived start was wrong,
    so every rank recomputes its states and gathers again -- decided from the gathered headers
    alone, hence the same on every rank (at most once per new layout: the start is cached)."""
    header = gathered[:, :_HEADER].to(torch.int64).cpu()
    starts, sizes, derived = header[:, 0].tolist(), header[:, 1].tolist(), header[:, 3].tolist()
    rank = dist.get_rank(group)
    if not any(derived):
        return starts[rank], False
    expected = [sum(sizes[:r]) for r in range(len(sizes))]
    for r, (st, ex, d) in enumerate(zip(starts, expected, derived)):
        if not d and st != ex:
            raise ValueError(
                f"vocab_start: rank {r} was given {st} but other ranks derive theirs from the "
                f"rank-order layout, where rank {r} starts at {ex} (slice sizes {sizes}); give "
                "vocab_start on every rank or on none"
            )
    if derived[rank]:
        _start_cache[(id(group), rank, sizes[rank])] = expected[rank]
    redo = any(d and st != ex for st, ex, d in zip(starts, expected, derived))
    return expected[rank], redo


def _gather_settled(states, start: int, derived: bool, v_rank: int, n: int, group):
    """(gathered, start): gather states(start) with its header; when a derived start turns out
    wrong (_settle_start), every rank recomputes with the settled start and gathers once more."""
    gathered = _gather(states(start), [start, v_rank, n, int(derived)], group)
    settled, redo = _settle_start(gathered, group)
    if redo:
        gathered = _gather(states(settled), [settled, v_rank, n, int(derived)], group)
    return gathered, settled


def vocab_parallel_token_logprobs(
    logits: Tensor,
    labels: Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    process_group,
    vocab_start: int | None,
):
    """The body of token_logprobs(..., process_group=...); arguments already checked."""
    start = _resolve_vocab_start(vocab_start, logits.shape[-1], process_group)
    lp, ent, _ = _VocabParallelTokenLogprobs.apply(
        logits, labels, float(temperature), int(ignore_index), start, process_group
    )
    return (lp, ent) if return_entropy else lp


# ---- from hidden states: a vocab-sharded LM head (the logits are still never built) ----


class _VocabParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        bias,
        temperature,
        ignore_index,
        vocab_start,
        group,
        budget,
        logits_dtype,
        reduce_hidden_grad,
    ):
        from ..linear_logprobs import op as lop

        N, H = hidden.shape
        Vr = weight.shape[0]
        acc = _acc(hidden.dtype)
        inv_t = 1.0 / temperature

        def states(start):
            local = torch.empty(_ROWS, N, dtype=acc, device=hidden.device)
            local[0], local[1:3], local[3] = float("-inf"), 0.0, float("nan")
            k = labels.long() - start
            local[4] = ((k >= 0) & (k < Vr) & (labels != ignore_index)).to(acc)
            if N and Vr:
                plan = lop.plan_chunks(
                    N,
                    Vr,
                    H,
                    hidden.dtype,
                    hidden.device.type,
                    lop._resolve_budget(budget, hidden.device),
                    logits_dtype=logits_dtype,
                    fused=False,
                )
                tiler = lop.Tiler(hidden, weight, bias, plan, False)
                for r0 in range(0, N, plan.rows):
                    r1 = min(N, r0 + plan.rows)
                    st, zl = lop.chunk_states(
                        tiler,
                        plan,
                        tiler.rows(r0, r1),
                        labels[r0:r1],
                        Vr,
                        inv_t,
                        ignore_index,
                        v_offset=start,
                    )
                    local[0:3, r0:r1] = st
                    local[3, r0:r1] = zl
            return local

        vocab_start, derived = vocab_start
        gathered, vocab_start = _gather_settled(states, vocab_start, derived, Vr, N, group)
        lp, ent, lse, V = _finish(
            gathered, labels, vocab_start, ignore_index, hidden.device.type == "cpu"
        )
        ctx.save_for_backward(hidden, weight, labels, bias, lse, ent)
        ctx.args = (
            inv_t,
            ignore_index,
            vocab_start,
            V,
            group,
            budget,
            logits_dtype,
            reduce_hidden_grad,
        )
        ctx.mark_non_differentiable(lse)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, _grad_lse):
        from ..linear_logprobs import op as lop

        hidden, weight, labels, bias, lse, ent = ctx.saved_tensors
        inv_t, ignore_index, vocab_start, V, group, budget, logits_dtype, reduce_h = ctx.args
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        N, H = hidden.shape
        Vr = weight.shape[0]
        acc = _acc(hidden.dtype)
        dev = hidden.device
        glp = torch.zeros(N, dtype=acc, device=dev) if grad_lp is None else grad_lp.to(acc)
        gent = None if grad_ent is None else grad_ent.to(acc)
        gh = torch.zeros((N, H) if need_h else (0,), dtype=acc, device=dev)
        gW = torch.zeros((Vr, H) if need_w else (0,), dtype=acc, device=dev)
        gb = torch.zeros((Vr,) if (need_b and bias is not None) else (0,), dtype=acc, device=dev)
        if N and Vr:
            plan = lop.plan_chunks(
                N,
                Vr,
                H,
                hidden.dtype,
                dev.type,
                lop._resolve_budget(budget, dev),
                logits_dtype=logits_dtype,
                fused=False,
            )
            tiler = lop.Tiler(hidden, weight, bias, plan, False, backward=True)
            for r0 in range(0, N, plan.rows):
                r1 = min(N, r0 + plan.rows)
                lop.chunk_backward(
                    tiler,
                    plan,
                    False,
                    tiler.rows(r0, r1),
                    labels[r0:r1],
                    glp[r0:r1],
                    gent[r0:r1] if gent is not None else None,
                    lse[r0:r1],
                    ent[r0:r1] if gent is not None else None,
                    inv_t,
                    ignore_index,
                    Vr,
                    gh[r0:r1] if need_h else gh,
                    gW,
                    gb,
                    v_offset=vocab_start,
                    v_total=V,
                )
        if need_h and reduce_h:
            # every rank's slice of the vocabulary contributes to dL/dh: the sum is the gradient
            all_reduce_(gh, group)
        return (
            gh.to(hidden.dtype) if need_h else None,
            gW.to(weight.dtype) if need_w else None,
            None,
            gb.to(bias.dtype) if gb.numel() else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def vocab_parallel_linear_token_logprobs(
    hidden2d,
    weight,
    labels,
    bias,
    temperature,
    ignore_index,
    process_group,
    vocab_start,
    budget,
    logits_dtype,
    reduce_hidden_grad,
):
    """The body of linear_token_logprobs(..., process_group=...): hidden [N, H] (replicated),
    weight [V_rank, H] and bias [V_rank] this rank's vocabulary rows; arguments checked.
    Returns (logprobs, entropy) [N]."""
    start = _resolve_vocab_start(vocab_start, weight.shape[0], process_group)
    lp, ent, _ = _VocabParallelLinear.apply(
        hidden2d,
        weight,
        labels,
        bias,
        float(temperature),
        int(ignore_index),
        start,
        process_group,
        int(budget or 0),
        logits_dtype,
        bool(reduce_hidden_grad),
    )
    out = _backend.out_dtype(hidden2d)
    return lp.to(out), ent.to(out)


# ---- full-vocabulary KL with both logits vocab-sharded ----
# Per rank, the full_kl kernel on its slice gives (kl_r, lse_z_r, lse_w_r), where
# kl_r + lse_z_r - lse_w_r = sum_{j in r} softmax_r(z)_j (z_j - w_j). With the slice masses
# a_r = exp(lse_z_r - lse_z): KL = sum_r a_r (kl_r + lse_z_r - lse_w_r) - lse_z + lse_w. One
# all-gather of those three per-row numbers; the backward is elementwise given the global kl and
# log-sum-exps (the full_kl backward kernel on each slice), no collective.


def _logsumexp_ranks(x):
    m = x.amax(0)
    m_safe = torch.where(m.isinf(), torch.zeros_like(m), m)
    return m_safe + (x - m_safe).exp().sum(0).log()


class _VocabParallelFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_logits, mask, temperature, group):
        from ..full_kl import op as fop

        inv_t = 1.0 / temperature
        if logits.shape[-1] == 0:  # an empty slice: no mass, no cross term
            lz_r = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
            kl_r, lw_r = torch.zeros_like(lz_r), lz_r.clone()
        else:
            kl_r, lz_r, lw_r = fop.forward(logits, ref_logits, None, inv_t)
        world = dist.get_world_size(group)
        local = (
            torch.stack([kl_r, lz_r, lw_r])
            .reshape(3, -1)
            .to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        )
        st = _all_gather(local, group).view(world, 3, -1)
        lse_z, lse_w = _logsumexp_ranks(st[:, 1]), _logsumexp_ranks(st[:, 2])
        a = (st[:, 1] - lse_z).exp()
        cross = torch.where(a > 0, a * (st[:, 0] + st[:, 1] - st[:, 2]), torch.zeros_like(a))
        kl = cross.sum(0) - lse_z + lse_w
        shape = logits.shape[:-1]
        kl, lse_z, lse_w = kl.view(shape), lse_z.view(shape), lse_w.view(shape)
        if mask is not None:
            kl = torch.where(mask, kl, torch.zeros_like(kl))
        ctx.save_for_backward(logits, ref_logits, mask, kl, lse_z, lse_w)
        ctx.inv_t = inv_t
        return kl

    @staticmethod
    def backward(ctx, grad):
        from ..full_kl import op as fop

        logits, ref_logits, mask, kl, lse_z, lse_w = ctx.saved_tensors
        need_ref = ctx.needs_input_grad[1]
        gz = _backend.new_output(logits.shape, logits.dtype, logits.device)
        gw = (
            _backend.new_output(ref_logits.shape, ref_logits.dtype, ref_logits.device)
            if need_ref
            else None
        )
        if logits.shape[-1]:
            fop.backward(
                logits, grad.contiguous(), ref_logits, mask, kl, lse_z, lse_w, ctx.inv_t, gz, gw
            )
        return gz, gw, None, None, None


def vocab_parallel_full_kl(logits, ref_logits, temperature, mask, process_group):
    """The body of full_kl(..., process_group=...): both logits this rank's vocabulary slice."""
    require_initialized()
    kl = _VocabParallelFullKL.apply(logits, ref_logits, mask, float(temperature), process_group)
    return kl.to(_backend.out_dtype(logits))
