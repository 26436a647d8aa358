"""Vocab-parallel linear_token_logprobs under the rollout sampler's distribution (top_k, top_p,
min_p, both samplers' rules): a vocab-sharded LM head (Megatron's layout, as
vocab_parallel_linear.py), the logits never built. The selection needs each row whole, so the
loop holds whole rows of this rank's slice: per row block, the tile hidden @ W_r^T (+ b) of the
fused-linear engine's Tiler, then the logits form's kept-set search on it
(vocab_parallel_sampler.kept_set: the same fixed collectives, per row block) and its finish.

- before the loop, ONE all-gather of a small header (vocab_layout.negotiate): every slice's start
  and size, and the sizes and options every rank must hold alike. From the sizes every rank plans
  the same row blocks (the fewest rows any rank's plan takes), so the per-block collectives
  match;
- per row block, the logits form's collectives on the block's rows;
- backward: no collective for the weight (each rank's gradient is its slice of the unsharded
  one: the engine's loop recomputes each tile and turns it into its gradient with the block's
  kept set, elementwise), one all-reduce of the float32 hidden gradient (unless
  reduce_hidden_grad=False).

Eager only (an autograd.Function around the loop: the number of collectives follows the row
blocks), and the header is read on the host: one sync per call on the GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _backend
from .._checks import FLOAT_DTYPES, check_labels_in_range
from .._math import acc_dtype
from ..fused_linear import engine
from ..fused_linear.checks import check_args
from ..fused_linear.tiler import Tiler
from ._comm import all_reduce_, require_initialized
from .vocab_layout import GIVEN, negotiate
from .vocab_parallel_sampler import NO_CUT, kept_set, options, top_stats
from .vocab_states import shared_plan

KEPT = ("m", "inv_ts", "lmp", "cut", "allow", "log_s", "ent", "outside")  # saved per row [N]
_PAD = dict(m=0.0, inv_ts=1.0, lmp=float("-inf"), cut=NO_CUT, allow=float("inf"), log_s=0.0,
            ent=0.0, outside=False)  # fmt: skip


class _KeptSetGrad:
    """The engine's reduction in the backward: each block's tile (recomputed) turned into its
    gradient by the sampler's backward op with the block's kept set, then the gradient GEMMs."""

    fused = False
    partial = True  # grad_hidden is this slice's share (reduced by the caller)
    rows = None
    tiler_fused = False

    def __init__(self, backend, ignore_index, kept: dict, layout):
        self.backend, self.ii, self.kept, self.layout = backend, ignore_index, kept, layout
        self.blk = None

    def at_block(self, r0, r1, pad):
        self.blk = {k: pad(t[r0:r1], _PAD[k]) for k, t in self.kept.items()}

    def block_grad(self, tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb):
        glp, gent, _ = coefs
        Vr = tiler.W.shape[0]
        if Vr == 0:  # an empty slice: no gradient, no share of grad_hidden
            return
        z = tiler.logits_acc(hc, 0, Vr)
        k = self.blk
        g = torch.ops.ppo_kernels.vocab_parallel_sampler_backward(
            glp, gent, z, lc, *(k[n] for n in KEPT[:5]), k["log_s"], k["ent"], k["outside"],
            self.layout, self.ii,
        )  # fmt: skip
        tiler.grad_matmuls(tiler.to_input(g), hc, 0, Vr, ghc, gW, gb)


class _LinearSampled(torch.autograd.Function):
    """The outputs of `forward_fn` (every per-row tensor of the kept set saved by it), and the
    gradients of hidden / weight / bias from the engine's loop with _KeptSetGrad."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, forward_fn, backward_fn):
        outs, saved = forward_fn()
        ctx.backward_fn, ctx.saved = backward_fn, saved
        ctx.mark_non_differentiable(*outs[2:])
        return outs

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, *_):
        gh, gW, gb = ctx.backward_fn(grad_lp, grad_ent, ctx.saved, ctx.needs_input_grad[:3])
        return gh, gW, gb, None, None


def vocab_parallel_linear_sampled(
    hidden, weight, labels, bias, temperature, temps, k, ks, p, ps, mp, mps, sampler,
    ignore_index, process_group, vocab_start, max_chunk_bytes, logits_dtype, reduce_hidden_grad,
    stats_top_k=0,
):  # fmt: skip
    """linear_token_logprobs(..., process_group=..., top_k / top_p / min_p): hidden [N, H]
    (replicated), weight [V_rank, H] and bias [V_rank] this rank's vocabulary rows, labels [N]
    global ids; the options as token_logprobs.api.sampler_options returns them (checked).
    Returns (logprobs, entropy, outside, sum_p2, lse, is_argmax) [N] and (top_ids,
    top_logprobs) [N, stats_top_k] (empty without them), the gradients attached to the first
    two."""
    require_initialized()
    group = process_group
    budget = int(max_chunk_bytes or 0)
    check_args(hidden, weight, labels, bias, temperature, ignore_index, budget, logits_dtype,
               vocab_slice=True)  # fmt: skip
    N, H = hidden.shape
    Vr, dev, acc = weight.shape[0], hidden.device, acc_dtype(hidden.dtype)
    o = options(labels, temperature, temps, k, ks, p, ps, mp, mps, sampler, acc)
    starts, sizes = negotiate(
        vocab_start, Vr, group, dev, rows=N, H=H, max_chunk_bytes=budget,
        dtype=FLOAT_DTYPES.index(hidden.dtype), sampler=("vllm", "sglang").index(sampler),
        top_k=int(o.on_k), top_p=int(o.on_p),
    )  # fmt: skip
    V, rank = sum(sizes), dist.get_rank(group)
    if stats_top_k > V and N > 0:  # (the sizes are every rank's: each raises alike)
        raise ValueError(
            f"stats_top_k: expected at most the vocabulary size {V}, got {stats_top_k}"
        )
    if dev.type == "cpu" or _backend.strict():
        check_labels_in_range(labels, V, ignore_index)
    # the same row blocks on every rank: whole rows of the slice, a tile and its gradient tile
    plan = shared_plan(hidden, sizes, rank, logits_dtype, budget, 2)
    rows = plan.rows
    h, w = hidden.detach(), weight.detach()
    b = None if bias is None else bias.detach()
    layout = torch.tensor([starts[rank], V], dtype=torch.int64)

    def forward_fn():
        out = {n: torch.empty(N, dtype=acc, device=dev) for n in ("lp", "ent", "sum_p2", "lse")}
        for n in ("outside", "is_argmax"):
            out[n] = torch.empty(N, dtype=torch.bool, device=dev)
        kk = stats_top_k
        out["top_ids"] = torch.empty((N, kk) if kk else (0,), dtype=torch.int64, device=dev)
        out["top_lp"] = torch.empty((N, kk) if kk else (0,), dtype=acc, device=dev)
        kept = {n: torch.empty(N, dtype=acc, device=dev) for n in ("m", "log_s")}
        kept.update(cut=torch.empty(N, dtype=torch.int64, device=dev),
                    allow=torch.empty(N, dtype=torch.float64, device=dev))  # fmt: skip
        tiler = Tiler(h, w, b, plan, False)
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            n = r1 - r0
            if Vr:
                z = tiler.logits_acc(tiler.rows(r0, r1), 0, Vr)[:n]
            else:
                z = torch.empty((n, 0), dtype=acc, device=dev)
            lab, ob = labels[r0:r1], o.rows(r0, r1)
            gathered, sums, m, cut, allow = kept_set(z, lab, ob, starts[rank], GIVEN, group,
                                                     ignore_index)  # fmt: skip
            lp, ent, log_s, outside, sum_p2, lse, is_argmax, _ = (
                torch.ops.ppo_kernels.vocab_parallel_sampler_finish(
                    z, lab, gathered, sums, m, ob.inv_ts, ob.lmp, cut, allow, rank, ignore_index
                )
            )
            for name, t in (("lp", lp), ("ent", ent), ("outside", outside), ("sum_p2", sum_p2),
                            ("lse", lse), ("is_argmax", is_argmax)):  # fmt: skip
                out[name][r0:r1] = t
            for name, t in (("m", m), ("cut", cut), ("allow", allow), ("log_s", log_s)):
                kept[name][r0:r1] = t
            if kk:
                ids, top_lp = top_stats(z, lab, ob, gathered, m, cut, allow, log_s, kk, group,
                                        ignore_index, check_size=False)  # fmt: skip
                out["top_ids"][r0:r1], out["top_lp"][r0:r1] = ids, top_lp
        kept.update(inv_ts=o.inv_ts, lmp=o.lmp, ent=out["ent"], outside=out["outside"])
        names = ("lp", "ent", "outside", "sum_p2", "lse", "is_argmax", "top_ids", "top_lp")
        outs = tuple(out[n] for n in names)
        return outs, kept

    def backward_fn(grad_lp, grad_ent, kept, need):
        need_h, need_w, need_b = need
        glp = torch.zeros(N, dtype=acc, device=dev) if grad_lp is None else grad_lp.to(acc)
        gent = None if grad_ent is None else grad_ent.to(acc)
        backend = _backend.backend_for("linear_token_logprobs", hidden)
        shard = _KeptSetGrad(backend, ignore_index, kept, layout)
        head = engine.GivenGrads(glp, gent, kept["log_s"], kept["ent"])
        gh, gW, gb = engine.run(head, shard, engine.Head(h, w, b, labels), plan,
                                need=(need_h, need_w, need_b and b is not None))  # fmt: skip
        if need_h and reduce_hidden_grad:  # every slice contributes to dL/dh: the sum
            all_reduce_(gh, group)
        return (
            gh.to(hidden.dtype) if need_h else None,
            gW.to(weight.dtype) if need_w else None,
            gb.to(bias.dtype) if need_b and bias is not None else None,
        )

    return _LinearSampled.apply(hidden, weight, bias, forward_fn, backward_fn)
