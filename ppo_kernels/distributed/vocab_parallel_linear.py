"""Vocab-parallel linear_token_logprobs: a vocab-sharded LM head (Megatron's layout, as
vocab_parallel_token_logprobs.py for logits): each rank holds the rows [start, start + V_rank) of
the head's weight (and bias), the hidden states and labels (global ids) are replicated, and the
logits are still never built. Forward: each rank's softmax states of its slice by the fused-linear
engine's vocabulary-chunk kernels (fused_linear/vocab_chunks.py), one all-gather, the merge and
finish (vocab_states.py). Backward: no collective for the weight (each rank's gradient is its
slice of the unsharded one: the engine's loop with the merged statistics), one all-reduce of the
float32 hidden gradient (unless reduce_hidden_grad=False). torch.compile traces it as the logits
form (see vocab_parallel_token_logprobs.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._checks import (
    check_devices,
    check_int,
)
from .._math import acc_dtype
from ..fused_linear import engine
from ..fused_linear.checks import check_args
from ..fused_linear.planner import plan_call
from ..fused_linear.tiler import Tiler
from ..fused_linear.vocab_chunks import VocabChunks, chunk_states
from ._comm import all_reduce_
from .vocab_layout import (
    check_layout_device,
    gather_settled,
    layout_ints,
    resolve_vocab_start,
)
from .vocab_parallel_token_logprobs import check_temperatures
from .vocab_states import (
    ROWS,
    check_finish_args,
    check_grads,
    empty_states,
    finish,
    row_inverse,
)

# ---- from hidden states: a vocab-sharded LM head (the logits are still never built) ----


def _check_linear_args(hidden, weight, labels, bias, temperature, ignore_index, budget, ldt):
    """linear_logprobs' checks of a weight slice, which may be empty (labels are global ids)."""
    check_args(
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
    temperatures: Tensor | None = None,
) -> Tensor:
    """[ROWS, N] states of the logits hidden [N, H] @ weight[V_rank, H].T (+ bias) of this
    rank's vocabulary slice, computed in chunks (linear_logprobs' chunk_states); temperatures
    [N]: per-row values that replace temperature."""
    _check_linear_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    check_int("vocab_start", vocab_start, min_value=0)
    check_temperatures(temperatures, labels, hidden.device, "hidden")
    N, H = hidden.shape
    Vr = weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    inv_t = 1.0 / temperature
    inv_ts = row_inverse(temperatures, (N,), acc)
    local = empty_states(labels, vocab_start, Vr, ignore_index, acc)
    if N and Vr:
        plan = plan_call(
            N, Vr, H, hidden.dtype, hidden.device, max_chunk_bytes, logits_dtype, False
        )
        tiler = Tiler(hidden, weight, bias, plan, False)
        for r0 in range(0, N, plan.rows):
            r1 = min(N, r0 + plan.rows)
            st, zl = chunk_states(
                tiler,
                plan,
                tiler.rows(r0, r1),
                tiler.pad(labels[r0:r1], ignore_index),  # (padded rows in batch-invariant mode)
                Vr,
                inv_t,
                ignore_index,
                v_offset=vocab_start,
                inv_ts=None if inv_ts is None else tiler.pad(inv_ts[r0:r1], 1.0),
            )
            local[0:3, r0:r1] = st[:, : r1 - r0]
            local[3, r0:r1] = zl[: r1 - r0]
    return local


@_linear_states_op.register_fake
def _(hidden, weight, labels, bias, vocab_start, temperature, ignore, budget, logits_dtype,
      temperatures=None):  # fmt: skip
    check_devices(
        "hidden", hidden, weight=weight, labels=labels, bias=bias, temperatures=temperatures
    )
    return hidden.new_empty((ROWS, hidden.shape[0]), dtype=acc_dtype(hidden.dtype))


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
    temperatures: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, entropy or an empty tensor, lse, layout) [N] from the gathered states of every
    rank; hidden / weight / bias (and the per-row temperatures [N], or None) are read only by the
    backward, which all-reduces the hidden gradient over the process group named reduce_group
    (None: leave it partial)."""
    _check_linear_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    check_temperatures(temperatures, labels, hidden.device, "hidden")
    check_finish_args(
        labels, gathered, rank, labels.shape, hidden.device, acc_dtype(hidden.dtype), "hidden"
    )
    return finish(gathered, labels, rank, ignore_index, with_entropy, weight.shape[0])


@_linear_op.register_fake
def _(hidden, weight, labels, bias, gathered, rank, temperature, ignore, with_entropy, budget, ldt,
      group, temperatures=None):  # fmt: skip
    check_devices(
        "hidden", hidden, weight=weight, labels=labels, bias=bias, gathered=gathered,
        temperatures=temperatures,
    )  # fmt: skip
    acc, N = acc_dtype(hidden.dtype), hidden.shape[0]
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
    temperatures: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of this rank's slice, float32 (float64 for float64),
    an empty tensor where not needed; grad_hidden is this slice's share (partial, not reduced).
    temperatures [N]: per row."""
    _check_linear_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    dev, acc = hidden.device, acc_dtype(hidden.dtype)
    check_grads(grad_logprobs, grad_entropy, lse, entropy, labels.shape, dev, acc, "hidden")
    check_temperatures(temperatures, labels, dev, "hidden")
    vocab_start, V = layout_ints(layout)
    N, H = hidden.shape
    Vr = weight.shape[0]
    glp = grad_logprobs.to(acc)
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    gent = grad_entropy.to(acc) if with_ent else None
    gh = torch.zeros((N, H) if need_hidden else (0,), dtype=acc, device=dev)
    gW = torch.zeros((Vr, H) if need_weight else (0,), dtype=acc, device=dev)
    gb = torch.zeros((Vr,) if (need_bias and bias is not None) else (0,), dtype=acc, device=dev)
    if N and Vr:
        plan = plan_call(N, Vr, H, hidden.dtype, dev, max_chunk_bytes, logits_dtype, False)
        inv_ts = row_inverse(temperatures, (N,), acc)
        vocab = VocabChunks(
            plan, None, temperature, ignore_index, vocab_start, V, partial=True, inv_ts=inv_ts
        )
        head = engine.GivenGrads(glp, gent, lse, entropy if with_ent else None)
        lm = engine.Head(hidden, weight, bias, labels)
        gh, gW, gb = engine.run(head, vocab, lm, plan, need=(need_hidden, need_weight, need_bias))
    return gh, gW, gb


@_linear_backward_op.register_fake
def _(glp, gent, hidden, weight, labels, bias, lse, ent, layout, t, ig, budget, ldt, nh, nw, nb,
      temperatures=None):  # fmt: skip
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
        temperatures=temperatures,
    )
    acc = acc_dtype(hidden.dtype)
    N, H = hidden.shape
    Vr = weight.shape[0]
    gh = hidden.new_empty((N, H) if nh else (0,), dtype=acc)
    gW = hidden.new_empty((Vr, H) if nw else (0,), dtype=acc)
    gb = hidden.new_empty((Vr,) if (nb and bias is not None) else (0,), dtype=acc)
    return gh, gW, gb


def _linear_setup(ctx, inputs, output):
    hidden, weight, labels, bias, _, _, temperature, ignore_index, _, budget, ldt, group, ts = (
        inputs
    )
    _, ent, lse, layout = output
    ctx.save_for_backward(hidden, weight, labels, bias, lse, ent, layout, ts)
    ctx.args = (temperature, ignore_index, budget, ldt)
    ctx.reduce_group = group
    ctx.mark_non_differentiable(lse, layout)


def _linear_backward(ctx, grad_lp, grad_ent, _grad_lse, _grad_layout):
    hidden, weight, labels, bias, lse, ent, layout, temperatures = ctx.saved_tensors
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    need_b = need_b and bias is not None
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_ent is not None and grad_ent.numel() == 0:
        grad_ent = None
    gh, gW, gb = torch.ops.ppo_kernels.vocab_parallel_linear_token_logprobs_backward(
        grad_lp, grad_ent, hidden, weight, labels, bias, lse, ent, layout, *ctx.args,
        need_h, need_w, need_b, temperatures,
    )  # fmt: skip
    if need_h and ctx.reduce_group is not None:
        # every rank's slice of the vocabulary contributes to dL/dh: the sum is the gradient
        gh = all_reduce_(gh, ctx.reduce_group)
    return (
        gh.to(hidden.dtype) if need_h else None,
        gW.to(weight.dtype) if need_w else None,
        None,
        gb.to(bias.dtype) if need_b else None,
        *(None,) * 9,
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
    temperatures=None,
):
    """The body of linear_token_logprobs(..., process_group=...): hidden [N, H] (replicated),
    weight [V_rank, H] and bias [V_rank] this rank's vocabulary rows; temperatures: per-row
    values [N] that replace temperature, or None; arguments checked. Returns (logprobs,
    entropy) [N]."""
    start, derived = resolve_vocab_start(vocab_start, weight.shape[0], process_group)
    temperature, ignore_index, budget = float(temperature), int(ignore_index), int(budget or 0)
    h, w = hidden2d.detach(), weight.detach()  # the states carry no gradient: the finish op does
    b = None if bias is None else bias.detach()
    ts = None if temperatures is None else temperatures.detach()  # (no gradient to them)

    def states(s):
        return torch.ops.ppo_kernels.vocab_parallel_linear_states(
            h, w, labels, b, s, temperature, ignore_index, budget, logits_dtype, ts
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
        ts,
    )
    out = acc_dtype(hidden2d.dtype)
    return lp.to(out), ent.to(out)
