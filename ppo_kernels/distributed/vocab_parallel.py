"""Vocab-parallel token log-probs and entropy (Megatron's layout, which verl uses): each rank of a
tensor-parallel group holds the logits of its contiguous slice of the vocabulary, labels are
global ids, and every rank gets the full-vocabulary log-prob and entropy.

Forward, per rank: the softmax statistics (m, s, u) of its slice (csrc/common/softmax_stats.h) and
the label's logit where it owns the label -- computed by the same per-tile kernels that
linear_token_logprobs uses for vocabulary chunks (a vocabulary shard is a vocabulary chunk that
lives on another rank), on float32 row blocks of bounded size. ONE collective: an all-gather of
those per-row states ([5, N] float32 per rank plus a header: the slice's start, size and N,
checked, and how the start was derived -- the layout negotiation lives in vocab_layout.py; a
different N across ranks is caught before, by _comm.check_same_sizes). Each rank
then merges the states with `merge_states` (the Python mirror of stats_merge) and finishes
exactly like linear_token_logprobs.

Backward, per rank, no collective: with the merged log-sum-exp and entropy, the gradient of a
slice is elementwise (d lp / d z_j = onehot_j - p_j, d H / d z_j = -p_j (log p_j + H), / T), so
each rank writes its slice of the unsharded gradient with the same tile kernel. Every rank
computes the same loss from the replicated outputs; nothing is scaled by the world size.

Bytes per token moved by the collective: (5 * 4) * world bytes gathered (vs 2 * V for gathering
bf16 logits); see bench/bench_distributed.py.

torch.compile (fullgraph=True works for all three forms): the per-rank work is registered ops
with fake kernels -- the local states (`vocab_parallel_states` / `vocab_parallel_linear_states`,
or full_kl on the slice), then the finish (checks, merge, finalize), differentiable through
register_autograd, and its backward op -- and the all-gather between them (and the linear form's
all-reduce of the hidden gradient) is a functional collective, so dynamo traces one graph. The
checks that read gathered numbers on the host run inside the finish op, at run time, compiled or
not. Not available under compile (the number of collectives cannot depend on data): settling a
derived vocab_start with a second gather. There the start that is not given is the one an earlier
eager call cached for this group and slice size, else rank * slice size (even shards), and the
finish op raises a ValueError on every rank if it is not the rank-order layout (never a silently
wrong answer): give vocab_start for uneven shards under compile. As everywhere under compile, the
tiny cross-rank size check before the gather (_comm.cross_checks) is skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_devices,
    check_int,
    check_temperature,
    check_tensor,
)
from ..fused_linear import chunks
from ..fused_linear.chunks import tile_bwd_, tile_stats_
from ..fused_linear.tiler import Tiler
from ..linear_logprobs import naive as lin_ref
from ._comm import all_gather as _all_gather
from ._comm import all_reduce_, require_initialized
from .vocab_layout import (
    HEADER,
    check_layout,
    check_layout_device,
    gather_settled,
    layout_ints,
    resolve_vocab_start,
)

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
    st = empty_states(labels, vocab_start, V, ignore_index, acc)
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


def empty_states(labels: Tensor, vocab_start: int, V: int, ignore_index: int, acc) -> Tensor:
    """[_ROWS, N] states of no logit yet: m = -inf, s = u = 0, zlabel NaN, and owned = 1.0 where
    the slice [vocab_start, vocab_start + V) holds the row's label."""
    st = torch.empty(_ROWS, labels.numel(), dtype=acc, device=labels.device)
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


def _finish(
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
    lp, ent, lse = _merge_finalize(gathered, labels, V, ignore_index, world, N)
    if ok is not None:
        nan = torch.full((), float("nan"), dtype=lp.dtype, device=lp.device)
        lp, ent, lse = (torch.where(ok, t, nan) for t in (lp, ent, lse))
    layout = torch.tensor([starts[rank], V], dtype=torch.int64)
    return lp, (ent if with_entropy else ent.new_empty(0)), lse, layout


def _merge_finalize(gathered, labels, V, ignore_index, world, N):
    return merge_rows(gathered[:, HEADER:].view(world, _ROWS, N), labels, V, ignore_index)


def merge_rows(st: Tensor, labels: Tensor, V: int, ignore_index: int):
    """(logprobs, entropy, lse) [N] from every rank's states st [world, _ROWS, N] (local_states'
    rows) of a vocabulary of V: the merged softmax statistics, the label's logit from the rank
    that owns it (NaN where none does: out of range)."""
    merged = merge_states(st[:, 0:3])
    owned = st[:, 4]
    zl = torch.where(owned > 0, st[:, 3], torch.zeros_like(st[:, 3])).sum(0)
    zl = torch.where(owned.sum(0) > 0, zl, torch.full_like(zl, float("nan")))
    return lin_ref.finalize(merged, zl, labels, V, ignore_index)


def _check_finish_args(labels, gathered, rank, rows, dev, acc, like):
    """The arguments every vocab-parallel op shares (metadata only); dev: the op's device, that
    of its argument `like`."""
    check_arg("labels", labels, dev, like=like, dtypes=INDEX_DTYPES, shape=rows, what="the rows")
    check_arg("gathered", gathered, dev, like=like)
    check_tensor("gathered", gathered, dtypes=(acc,), dim=2)
    n = HEADER + _ROWS * labels.numel()
    if gathered.shape[1] != n:
        raise ValueError(f"gathered: expected {n} columns per rank, got {gathered.shape[1]}")
    check_int("rank", rank, min_value=0)
    if rank >= gathered.shape[0]:
        raise ValueError(f"rank: {rank} is not below the world size {gathered.shape[0]}")


def _check_grads(grad_logprobs, grad_entropy, lse, entropy, rows, dev, acc, like):
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


# ---- token_logprobs on a vocabulary slice of the logits ----
# Three registered ops (fake kernels, registered autograd), so that torch.compile traces the whole
# form, the functional all-gather between them included: the local states of the slice, the
# finish (checks, merge, finalize; differentiable in the logits) and its backward.


@torch.library.custom_op("ppo_kernels::vocab_parallel_states", mutates_args=())
def _states_op(
    logits: Tensor, labels: Tensor, vocab_start: int, temperature: float, ignore_index: int
) -> Tensor:
    """[_ROWS, N] states (local_states) of this rank's slice logits [..., V_rank] (N rows)."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg(
        "labels", labels, logits.device, like="logits", dtypes=INDEX_DTYPES, shape=logits.shape[:-1]
    )
    check_int("vocab_start", vocab_start, min_value=0)
    check_temperature(temperature)
    check_int("ignore_index", ignore_index)
    x = logits.reshape(labels.numel(), logits.shape[-1])
    return local_states(x, labels.reshape(-1), vocab_start, 1.0 / temperature, ignore_index)


@_states_op.register_fake
def _(logits, labels, vocab_start, temperature, ignore_index):
    check_devices("logits", logits, labels=labels)
    return logits.new_empty((_ROWS, labels.numel()), dtype=_acc(logits.dtype))


@torch.library.custom_op("ppo_kernels::vocab_parallel_token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: Tensor,
    labels: Tensor,
    gathered: Tensor,
    rank: int,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, entropy or an empty tensor, lse, layout) of labels [...] from the states of
    every rank, gathered [world, HEADER + _ROWS * N]; logits [..., V_rank] (this rank's slice)
    is read only by the backward."""
    acc = _acc(logits.dtype)
    _check_finish_args(labels, gathered, rank, logits.shape[:-1], logits.device, acc, "logits")
    check_temperature(temperature)
    lp, ent, lse, layout = _finish(
        gathered, labels.reshape(-1), rank, ignore_index, with_entropy, logits.shape[-1]
    )
    shape = labels.shape
    return lp.view(shape), ent.view(shape if with_entropy else (0,)), lse.view(shape), layout


@_token_logprobs_op.register_fake
def _(logits, labels, gathered, rank, temperature, ignore_index, with_entropy):
    check_devices("logits", logits, labels=labels, gathered=gathered)
    acc, shape = _acc(logits.dtype), labels.shape
    ent = logits.new_empty(shape if with_entropy else (0,), dtype=acc)
    out = [logits.new_empty(shape, dtype=acc) for _ in range(2)]
    return out[0], ent, out[1], torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("ppo_kernels::vocab_parallel_token_logprobs_backward", mutates_args=())
def _token_logprobs_backward_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    layout: Tensor,
    temperature: float,
    ignore_index: int,
) -> Tensor:
    """This rank's slice of the unsharded gradient: d(sum(g_lp * lp + g_ent * ent)) / d logits,
    elementwise given the merged lse and entropy (no collective)."""
    acc, dev, rows = _acc(logits.dtype), logits.device, logits.shape[:-1]
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg(
        "labels",
        labels,
        dev,
        like="logits",
        dtypes=INDEX_DTYPES,
        shape=rows,
        what="logits.shape[:-1]",
    )
    _check_grads(grad_logprobs, grad_entropy, lse, entropy, rows, dev, acc, "logits")
    vocab_start, V = layout_ints(layout)
    inv_t = 1.0 / check_temperature(temperature)
    x = logits.reshape(labels.numel(), logits.shape[-1])
    y = labels.reshape(-1)
    N, Vr = x.shape
    glp = grad_logprobs.reshape(-1).to(acc)
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    gent = grad_entropy.reshape(-1).to(acc) if with_ent else None
    ent = entropy.reshape(-1) if with_ent else None
    grad = _backend.new_output(x.shape, logits.dtype, dev)
    if N and Vr:
        starts, rows_per = _row_blocks(N, Vr, acc)
        buf = torch.empty(min(rows_per, N) * Vr, dtype=acc, device=dev)
        for r0 in starts:
            r1 = min(N, r0 + rows_per)
            tile = buf[: (r1 - r0) * Vr].view(r1 - r0, Vr).copy_(x[r0:r1])
            tile_bwd_(
                tile,
                y[r0:r1],
                vocab_start,
                lse.reshape(-1)[r0:r1],
                ent[r0:r1] if with_ent else None,
                glp[r0:r1],
                gent[r0:r1] if with_ent else None,
                inv_t,
                ignore_index,
                V,
            )
            grad[r0:r1] = tile
    return grad.view(logits.shape)


@_token_logprobs_backward_op.register_fake
def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, layout, temperature, ignore):
    check_layout_device(layout)
    check_devices(
        "logits",
        logits,
        grad_logprobs=grad_logprobs,
        grad_entropy=grad_entropy,
        labels=labels,
        lse=lse,
        entropy=entropy,
    )
    return logits.new_empty(logits.shape)


def _token_logprobs_setup(ctx, inputs, output):
    logits, labels, _, _, temperature, ignore_index, _ = inputs
    _, ent, lse, layout = output
    ctx.save_for_backward(logits, labels, lse, ent, layout)
    ctx.args = (temperature, ignore_index)
    ctx.mark_non_differentiable(lse, layout)


def _token_logprobs_backward(ctx, grad_lp, grad_ent, _grad_lse, _grad_layout):
    logits, labels, lse, ent, layout = ctx.saved_tensors
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_ent is not None and grad_ent.numel() == 0:
        grad_ent = None
    grad = torch.ops.ppo_kernels.vocab_parallel_token_logprobs_backward(
        grad_lp, grad_ent, logits, labels, lse, ent, layout, *ctx.args
    )
    return grad, None, None, None, None, None, None


_token_logprobs_op.register_autograd(_token_logprobs_backward, setup_context=_token_logprobs_setup)


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
    start, derived = resolve_vocab_start(vocab_start, logits.shape[-1], process_group)
    temperature, ignore_index = float(temperature), int(ignore_index)
    x = logits.detach()  # the states carry no gradient: the finish op does

    def states(s):
        return torch.ops.ppo_kernels.vocab_parallel_states(x, labels, s, temperature, ignore_index)

    gathered = gather_settled(
        states, start, derived, logits.shape[-1], labels.numel(), process_group
    )
    lp, ent, _, _ = torch.ops.ppo_kernels.vocab_parallel_token_logprobs(
        logits,
        labels,
        gathered,
        dist.get_rank(process_group),
        temperature,
        ignore_index,
        bool(return_entropy),
    )
    return (lp, ent) if return_entropy else lp


# ---- from hidden states: a vocab-sharded LM head (the logits are still never built) ----


def _check_linear_args(hidden, weight, labels, bias, temperature, ignore_index, budget, ldt):
    """linear_logprobs' checks of a weight slice, which may be empty (labels are global ids)."""
    chunks.check_args(
        hidden, weight, labels, bias, temperature, ignore_index, budget, ldt, vocab_slice=True
    )


@torch.library.custom_op("ppo_kernels::vocab_parallel_linear_states", mutates_args=())
def _linear_states_op(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    vocab_start: int,
    temperature: float,
    ignore_index: int,
    max_chunk_bytes: int,
    logits_dtype: str,
) -> Tensor:
    """[_ROWS, N] states of the logits hidden [N, H] @ weight[V_rank, H].T (+ bias) of this
    rank's vocabulary slice, computed in chunks (linear_logprobs' chunk_states)."""
    _check_linear_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    check_int("vocab_start", vocab_start, min_value=0)
    N, H = hidden.shape
    Vr = weight.shape[0]
    acc = _acc(hidden.dtype)
    inv_t = 1.0 / temperature
    local = empty_states(labels, vocab_start, Vr, ignore_index, acc)
    if N and Vr:
        plan = chunks.plan_for(hidden, Vr, max_chunk_bytes, logits_dtype, fused=False)
        tiler = Tiler(hidden, weight, bias, plan, False)
        for r0 in range(0, N, plan.rows):
            r1 = min(N, r0 + plan.rows)
            st, zl = chunks.chunk_states(
                tiler,
                plan,
                tiler.rows(r0, r1),
                tiler.pad(labels[r0:r1], ignore_index),  # (padded rows in batch-invariant mode)
                Vr,
                inv_t,
                ignore_index,
                v_offset=vocab_start,
            )
            local[0:3, r0:r1] = st[:, : r1 - r0]
            local[3, r0:r1] = zl[: r1 - r0]
    return local


@_linear_states_op.register_fake
def _(hidden, weight, labels, bias, vocab_start, temperature, ignore, budget, logits_dtype):
    check_devices("hidden", hidden, weight=weight, labels=labels, bias=bias)
    return hidden.new_empty((_ROWS, hidden.shape[0]), dtype=_acc(hidden.dtype))


@torch.library.custom_op("ppo_kernels::vocab_parallel_linear_token_logprobs", mutates_args=())
def _linear_op(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    gathered: Tensor,
    rank: int,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    max_chunk_bytes: int,
    logits_dtype: str,
    reduce_group: str | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, entropy or an empty tensor, lse, layout) [N] from the gathered states of every
    rank; hidden / weight / bias are read only by the backward, which all-reduces the hidden
    gradient over the process group named reduce_group (None: leave it partial)."""
    _check_linear_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    _check_finish_args(
        labels, gathered, rank, labels.shape, hidden.device, _acc(hidden.dtype), "hidden"
    )
    return _finish(gathered, labels, rank, ignore_index, with_entropy, weight.shape[0])


@_linear_op.register_fake
def _(hidden, weight, labels, bias, gathered, rank, temperature, ignore, with_entropy, *rest):
    check_devices("hidden", hidden, weight=weight, labels=labels, bias=bias, gathered=gathered)
    acc, N = _acc(hidden.dtype), hidden.shape[0]
    ent = hidden.new_empty((N,) if with_entropy else (0,), dtype=acc)
    out = [hidden.new_empty((N,), dtype=acc) for _ in range(2)]
    return out[0], ent, out[1], torch.empty(2, dtype=torch.int64)


@torch.library.custom_op(
    "ppo_kernels::vocab_parallel_linear_token_logprobs_backward", mutates_args=()
)
def _linear_backward_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    entropy: Tensor,
    layout: Tensor,
    temperature: float,
    ignore_index: int,
    max_chunk_bytes: int,
    logits_dtype: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of this rank's slice, float32 (float64 for float64),
    an empty tensor where not needed; grad_hidden is this slice's share (partial, not reduced)."""
    _check_linear_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    dev, acc = hidden.device, _acc(hidden.dtype)
    _check_grads(grad_logprobs, grad_entropy, lse, entropy, labels.shape, dev, acc, "hidden")
    vocab_start, V = layout_ints(layout)
    N, H = hidden.shape
    Vr = weight.shape[0]
    inv_t = 1.0 / temperature
    glp = grad_logprobs.to(acc)
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    gent = grad_entropy.to(acc) if with_ent else None
    gh = torch.zeros((N, H) if need_hidden else (0,), dtype=acc, device=dev)
    gW = torch.zeros((Vr, H) if need_weight else (0,), dtype=acc, device=dev)
    gb = torch.zeros((Vr,) if (need_bias and bias is not None) else (0,), dtype=acc, device=dev)
    if N and Vr:
        plan = chunks.plan_for(hidden, Vr, max_chunk_bytes, logits_dtype, fused=False)
        tiler = Tiler(hidden, weight, bias, plan, False, backward=True)
        pad = tiler.pad  # the padded rows of batch-invariant mode (ignored labels, no gradient)
        for r0 in range(0, N, plan.rows):
            r1 = min(N, r0 + plan.rows)
            hc = tiler.rows(r0, r1)
            ghc = gh
            if need_hidden:  # a buffer only for padded rows: else the rows of gh themselves
                padded = hc.shape[0] != r1 - r0
                ghc = gh.new_zeros((hc.shape[0], H)) if padded else gh[r0:r1]
            chunks.chunk_backward(
                tiler,
                plan,
                False,
                hc,
                pad(labels[r0:r1], ignore_index),
                pad(glp[r0:r1]),
                pad(gent[r0:r1]) if with_ent else None,
                pad(lse[r0:r1]),
                pad(entropy[r0:r1]) if with_ent else None,
                inv_t,
                ignore_index,
                Vr,
                ghc,
                gW,
                gb,
                v_offset=vocab_start,
                v_total=V,
            )
            if need_hidden and padded:
                gh[r0:r1] = ghc[: r1 - r0]
    return gh, gW, gb


@_linear_backward_op.register_fake
def _(glp, gent, hidden, weight, labels, bias, lse, ent, layout, t, ig, budget, ldt, nh, nw, nb):
    check_layout_device(layout)
    check_devices(
        "hidden",
        hidden,
        grad_logprobs=glp,
        grad_entropy=gent,
        weight=weight,
        labels=labels,
        bias=bias,
        lse=lse,
        entropy=ent,
    )
    acc = _acc(hidden.dtype)
    N, H = hidden.shape
    Vr = weight.shape[0]
    gh = hidden.new_empty((N, H) if nh else (0,), dtype=acc)
    gW = hidden.new_empty((Vr, H) if nw else (0,), dtype=acc)
    gb = hidden.new_empty((Vr,) if (nb and bias is not None) else (0,), dtype=acc)
    return gh, gW, gb


def _linear_setup(ctx, inputs, output):
    hidden, weight, labels, bias, _, _, temperature, ignore_index, _, budget, ldt, group = inputs
    _, ent, lse, layout = output
    ctx.save_for_backward(hidden, weight, labels, bias, lse, ent, layout)
    ctx.args = (temperature, ignore_index, budget, ldt)
    ctx.reduce_group = group
    ctx.mark_non_differentiable(lse, layout)


def _linear_backward(ctx, grad_lp, grad_ent, _grad_lse, _grad_layout):
    hidden, weight, labels, bias, lse, ent, layout = ctx.saved_tensors
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    need_b = need_b and bias is not None
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_ent is not None and grad_ent.numel() == 0:
        grad_ent = None
    gh, gW, gb = torch.ops.ppo_kernels.vocab_parallel_linear_token_logprobs_backward(
        grad_lp, grad_ent, hidden, weight, labels, bias, lse, ent, layout, *ctx.args,
        need_h, need_w, need_b,
    )  # fmt: skip
    if need_h and ctx.reduce_group is not None:
        # every rank's slice of the vocabulary contributes to dL/dh: the sum is the gradient
        gh = all_reduce_(gh, ctx.reduce_group)
    return (
        gh.to(hidden.dtype) if need_h else None,
        gW.to(weight.dtype) if need_w else None,
        None,
        gb.to(bias.dtype) if need_b else None,
        *(None,) * 8,
    )


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


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
    start, derived = resolve_vocab_start(vocab_start, weight.shape[0], process_group)
    temperature, ignore_index, budget = float(temperature), int(ignore_index), int(budget or 0)
    h, w = hidden2d.detach(), weight.detach()  # the states carry no gradient: the finish op does
    b = None if bias is None else bias.detach()

    def states(s):
        return torch.ops.ppo_kernels.vocab_parallel_linear_states(
            h, w, labels, b, s, temperature, ignore_index, budget, logits_dtype
        )

    gathered = gather_settled(
        states, start, derived, weight.shape[0], labels.numel(), process_group
    )
    lp, ent, _, _ = torch.ops.ppo_kernels.vocab_parallel_linear_token_logprobs(
        hidden2d,
        weight,
        labels,
        bias,
        gathered,
        dist.get_rank(process_group),
        temperature,
        ignore_index,
        True,
        budget,
        logits_dtype,
        process_group.group_name if reduce_hidden_grad else None,
    )
    out = _backend.out_dtype(hidden2d)
    return lp.to(out), ent.to(out)


# ---- full-vocabulary KL with both logits vocab-sharded ----
# Per rank, the full_kl kernel on its slice gives (kl_r, lse_z_r, lse_w_r), where
# kl_r + lse_z_r - lse_w_r = sum_{j in r} softmax_r(z)_j (z_j - w_j). With the slice masses
# a_r = exp(lse_z_r - lse_z): KL = sum_r a_r (kl_r + lse_z_r - lse_w_r) - lse_z + lse_w. One
# all-gather of those three per-row numbers; the backward is elementwise given the global kl and
# log-sum-exps (the full_kl backward op on each slice), no collective. The per-slice forward is
# the registered full_kl op and the merge a registered op differentiable in both logits, so
# torch.compile traces the whole form.


def _logsumexp_ranks(x):
    m = x.amax(0)
    m_safe = torch.where(m.isinf(), torch.zeros_like(m), m)
    return m_safe + (x - m_safe).exp().sum(0).log()


def merge_full_kl(st: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, lse_z, lse_w) [N] from every rank's per-slice (kl_r, lse_z_r, lse_w_r), st
    [world, 3, N] (see above)."""
    lse_z, lse_w = _logsumexp_ranks(st[:, 1]), _logsumexp_ranks(st[:, 2])
    a = (st[:, 1] - lse_z).exp()
    cross = torch.where(a > 0, a * (st[:, 0] + st[:, 1] - st[:, 2]), torch.zeros_like(a))
    return cross.sum(0) - lse_z + lse_w, lse_z, lse_w


@torch.library.custom_op("ppo_kernels::vocab_parallel_full_kl", mutates_args=())
def _full_kl_op(
    logits: Tensor, ref_logits: Tensor, gathered: Tensor, mask: Tensor | None, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, lse_z, lse_w) with logits.shape[:-1] from every rank's per-slice (kl_r, lse_z_r,
    lse_w_r), gathered [world, 3 * N]; the logits slices are read only by the backward."""
    rows, dev, acc = logits.shape[:-1], logits.device, _backend.out_dtype(logits)
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg(
        "ref_logits", ref_logits, dev, like="logits", dtypes=(logits.dtype,), shape=logits.shape
    )
    check_arg("mask", mask, dev, like="logits", dtypes=(torch.bool,), shape=rows, allow_none=True)
    check_arg("gathered", gathered, dev, like="logits")
    check_tensor("gathered", gathered, dtypes=(acc,), dim=2)
    if gathered.shape[1] != 3 * rows.numel():
        raise ValueError(f"gathered: expected {3 * rows.numel()} columns per rank")
    check_temperature(temperature)
    kl, lse_z, lse_w = merge_full_kl(gathered.view(gathered.shape[0], 3, -1))
    kl = kl.view(rows)
    if mask is not None:
        kl = torch.where(mask, kl, torch.zeros_like(kl))
    return kl, lse_z.view(rows), lse_w.view(rows)


@_full_kl_op.register_fake
def _(logits, ref_logits, gathered, mask, temperature):
    check_devices("logits", logits, ref_logits=ref_logits, gathered=gathered, mask=mask)
    rows, o = logits.shape[:-1], _backend.out_dtype(logits)
    return tuple(logits.new_empty(rows, dtype=o) for _ in range(3))


def _full_kl_setup(ctx, inputs, output):
    logits, ref_logits, _, mask, temperature = inputs
    kl, lse_z, lse_w = output
    ctx.save_for_backward(logits, ref_logits, mask, kl, lse_z, lse_w)
    ctx.temperature = temperature
    ctx.mark_non_differentiable(lse_z, lse_w)


def _full_kl_backward(ctx, grad, _grad_lse_z, _grad_lse_w):
    """The full_kl backward op on this rank's slice, given the global kl and log-sum-exps."""
    logits, ref_logits, mask, kl, lse_z, lse_w = ctx.saved_tensors
    need_ref = ctx.needs_input_grad[1]
    if logits.shape[-1] == 0:  # an empty slice: nothing to differentiate
        gz = logits.new_zeros(logits.shape)
        gw = ref_logits.new_zeros(ref_logits.shape) if need_ref else None
    else:
        gz, gw = _backend.op("full_kl_backward")(
            grad, logits, ref_logits, mask, kl, lse_z, lse_w, ctx.temperature, need_ref
        )
    return gz, (gw if need_ref else None), None, None, None


_full_kl_op.register_autograd(_full_kl_backward, setup_context=_full_kl_setup)


def vocab_parallel_full_kl(logits, ref_logits, temperature, mask, process_group):
    """The body of full_kl(..., process_group=...): both logits this rank's vocabulary slice."""
    require_initialized()
    temperature = float(temperature)
    acc = _backend.out_dtype(logits)
    if logits.shape[-1] == 0:  # an empty slice: no mass, no cross term
        lz_r = torch.full(logits.shape[:-1], float("-inf"), dtype=acc, device=logits.device)
        kl_r, lw_r = torch.zeros_like(lz_r), lz_r.clone()
    else:  # the states carry no gradient: the merge op does
        kl_r, lz_r, lw_r = _backend.op("full_kl")(
            logits.detach(), ref_logits.detach(), temperature, None
        )
    local = torch.stack([kl_r, lz_r, lw_r]).reshape(3, -1).to(acc)
    world = dist.get_world_size(process_group)
    gathered = _all_gather(local, process_group).view(world, -1)
    kl, _, _ = torch.ops.ppo_kernels.vocab_parallel_full_kl(
        logits, ref_logits, gathered, mask, temperature
    )
    return kl.to(acc)
