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
from .._math import acc_dtype
from ..fused_linear.vocab_chunks import tile_bwd_
from .vocab_layout import (
    check_layout_device,
    gather_settled,
    layout_ints,
    resolve_vocab_start,
)
from .vocab_states import (
    ROWS,
    check_finish_args,
    check_grads,
    finish,
    local_states,
    row_blocks,
    row_inverse,
    scaled_tile,
)

# ---- token_logprobs on a vocabulary slice of the logits ----
# Three registered ops (fake kernels, registered autograd), so that torch.compile traces the whole
# form, the functional all-gather between them included: the local states of the slice, the
# finish (checks, merge, finalize; differentiable in the logits) and its backward.


def check_temperatures(temperatures, labels, dev, like):
    """A per-row temperature tensor as the vocab-parallel ops take it: one value per flat row
    [N] (the public function expands a leading part of labels.shape), or None."""
    check_arg(
        "temperatures", temperatures, dev, like=like, dtypes=FLOAT_DTYPES,
        shape=(labels.numel(),), what="one per row", allow_none=True,
    )  # fmt: skip


@torch.library.custom_op("ppo_kernels::vocab_parallel_states", mutates_args=())
def _states_op(
    logits: Tensor,
    labels: Tensor,
    vocab_start: int,
    temperature: float,
    ignore_index: int,
    temperatures: Tensor | None = None,
) -> Tensor:
    """[ROWS, N] states (local_states) of this rank's slice logits [..., V_rank] (N rows);
    temperatures [N]: per-row values that replace temperature."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg(
        "labels", labels, logits.device, like="logits", dtypes=INDEX_DTYPES, shape=logits.shape[:-1]
    )
    check_int("vocab_start", vocab_start, min_value=0)
    check_temperature(temperature)
    check_int("ignore_index", ignore_index)
    check_temperatures(temperatures, labels, logits.device, "logits")
    x = logits.reshape(labels.numel(), logits.shape[-1])
    inv_ts = row_inverse(temperatures, (labels.numel(),), acc_dtype(logits.dtype))
    return local_states(x, labels.reshape(-1), vocab_start, 1.0 / temperature, ignore_index, inv_ts)


@_states_op.register_fake
def _(logits, labels, vocab_start, temperature, ignore_index, temperatures=None):
    check_devices("logits", logits, labels=labels, temperatures=temperatures)
    return logits.new_empty((ROWS, labels.numel()), dtype=acc_dtype(logits.dtype))


@torch.library.custom_op("ppo_kernels::vocab_parallel_token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: Tensor,
    labels: Tensor,
    gathered: Tensor,
    rank: int,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    temperatures: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, entropy or an empty tensor, lse, layout) of labels [...] from the states of
    every rank, gathered [world, HEADER + ROWS * N]; logits [..., V_rank] (this rank's slice)
    and the per-row temperatures [N] (or None) are read only by the backward."""
    acc = acc_dtype(logits.dtype)
    check_finish_args(labels, gathered, rank, logits.shape[:-1], logits.device, acc, "logits")
    check_temperature(temperature)
    check_temperatures(temperatures, labels, logits.device, "logits")
    lp, ent, lse, layout = finish(
        gathered, labels.reshape(-1), rank, ignore_index, with_entropy, logits.shape[-1]
    )
    shape = labels.shape
    return lp.view(shape), ent.view(shape if with_entropy else (0,)), lse.view(shape), layout


@_token_logprobs_op.register_fake
def _(logits, labels, gathered, rank, temperature, ignore_index, with_entropy, temperatures=None):
    check_devices("logits", logits, labels=labels, gathered=gathered, temperatures=temperatures)
    acc, shape = acc_dtype(logits.dtype), labels.shape
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
    temperatures: Tensor | None = None,
) -> Tensor:
    """This rank's slice of the unsharded gradient: d(sum(g_lp * lp + g_ent * ent)) / d logits,
    elementwise given the merged lse and entropy (no collective); temperatures [N]: per row."""
    acc, dev, rows = acc_dtype(logits.dtype), logits.device, logits.shape[:-1]
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
    check_grads(grad_logprobs, grad_entropy, lse, entropy, rows, dev, acc, "logits")
    check_temperatures(temperatures, labels, dev, "logits")
    vocab_start, V = layout_ints(layout)
    inv_t = 1.0 / check_temperature(temperature)
    inv_ts = row_inverse(temperatures, (labels.numel(),), acc)
    if inv_ts is not None:  # the tile holds z = x / T_row: the kernel runs at temperature 1
        inv_t = 1.0
    x = logits.reshape(labels.numel(), logits.shape[-1])
    y = labels.reshape(-1)
    N, Vr = x.shape
    glp = grad_logprobs.reshape(-1).to(acc)
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    gent = grad_entropy.reshape(-1).to(acc) if with_ent else None
    ent = entropy.reshape(-1) if with_ent else None
    grad = _backend.new_output(x.shape, logits.dtype, dev)
    if N and Vr:
        starts, rows_per = row_blocks(N, Vr, acc)
        buf = torch.empty(min(rows_per, N) * Vr, dtype=acc, device=dev)
        for r0 in starts:
            r1 = min(N, r0 + rows_per)
            tile = scaled_tile(buf, x, r0, r1, inv_ts)
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
            if inv_ts is not None:  # d/dx = d/dz / T_row
                tile.mul_(inv_ts[r0:r1].unsqueeze(-1))
            grad[r0:r1] = tile
    return grad.view(logits.shape)


@_token_logprobs_backward_op.register_fake
def _(grad_logprobs, grad_entropy, logits, labels, lse, entropy, layout, temperature, ignore,
      temperatures=None):  # fmt: skip
    check_layout_device(layout)
    check_devices(
        "logits",
        logits,
        grad_logprobs=grad_logprobs,
        grad_entropy=grad_entropy,
        labels=labels,
        lse=lse,
        entropy=entropy,
        temperatures=temperatures,
    )
    return logits.new_empty(logits.shape)


def _token_logprobs_setup(ctx, inputs, output):
    logits, labels, _, _, temperature, ignore_index, _, temperatures = inputs
    _, ent, lse, layout = output
    ctx.save_for_backward(logits, labels, lse, ent, layout, temperatures)
    ctx.args = (temperature, ignore_index)
    ctx.mark_non_differentiable(lse, layout)


def _token_logprobs_backward(ctx, grad_lp, grad_ent, _grad_lse, _grad_layout):
    logits, labels, lse, ent, layout, temperatures = ctx.saved_tensors
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_ent is not None and grad_ent.numel() == 0:
        grad_ent = None
    grad = torch.ops.ppo_kernels.vocab_parallel_token_logprobs_backward(
        grad_lp, grad_ent, logits, labels, lse, ent, layout, *ctx.args, temperatures
    )
    return grad, None, None, None, None, None, None, None


_token_logprobs_op.register_autograd(_token_logprobs_backward, setup_context=_token_logprobs_setup)


def vocab_parallel_token_logprobs(
    logits: Tensor,
    labels: Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    process_group,
    vocab_start: int | None,
    temperatures: Tensor | None = None,
):
    """The body of token_logprobs(..., process_group=...); arguments already checked.
    temperatures: per-row values [N] (one per label) that replace temperature, or None."""
    start, derived = resolve_vocab_start(vocab_start, logits.shape[-1], process_group)
    temperature, ignore_index = float(temperature), int(ignore_index)
    x = logits.detach()  # the states carry no gradient: the finish op does
    ts = None if temperatures is None else temperatures.detach()  # (no gradient to them)

    def states(s):
        return torch.ops.ppo_kernels.vocab_parallel_states(
            x, labels, s, temperature, ignore_index, ts
        )

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
        ts,
    )
    return (lp, ent) if return_entropy else lp
