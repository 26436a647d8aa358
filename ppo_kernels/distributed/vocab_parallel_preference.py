"""Vocab-parallel linear_preference_loss (Megatron's layout, as the vocab-parallel
linear_policy_loss in vocab_parallel_policy.py): weight / bias (and the reference head's
ref_weight / ref_bias) hold this rank's contiguous slice of the vocabulary; hidden, labels (global
ids), the mask and every per-row input are replicated. The chunk loop is the op's own
(linear_preference_loss/op.py: run, with its head term) with the tile reduction of a shard
(PreferenceShard, vocab_parallel_policy.VocabShard's reduction):

- before the loop, ONE all-gather of a small header per rank (vocab_layout.negotiate): every
  slice's start and size, and the sizes every rank must hold alike. From the sizes every rank
  plans the same row blocks (the fewest rows any rank's plan takes) and makes the same choice of
  where the reference tile goes, so the per-block collectives match;
- per row block, ONE all-gather of the block's per-row states ([5, rows]: the slice's softmax
  statistics and the label's logit; with the reference tile beside the policy tile, its 5 more),
  merged on every rank: each token's full-vocabulary log-prob (and the reference's), the same on
  every rank. The sequence log-probs, the preference math and the per-token coefficients follow
  from them (identical on every rank); each rank turns its own logits tile into its gradient tile
  and multiplies it into its weight / bias gradient (its slice of the unsharded one) and its
  partial hidden gradient. A reference head whose tile does not fit beside the policy tile runs
  its own pass first (one gather per block);
- after the loop, ONE all-reduce of the float32 hidden gradient (reduce_hidden_grad=False leaves
  it partial), only when hidden requires grad.

A pair longer than a block and the sorted types take the op's first pass, whose blocks gather
their states the same way. Loss, statistics and per-row / per-token outputs are identical on every
rank; nothing is scaled by the world size.

Eager only: the gradients are formed in the forward and attached by an autograd.Function (as the
op's fallback without the extension does), which torch.compile does not trace into a graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_devices,
    check_labels_in_range,
)
from .._math import acc_dtype
from ..fused_linear import engine, fused_op
from ..fused_linear.checks import check_args
from ..fused_linear.vocab_chunks import tile_stats_
from ..linear_preference_loss import head as pref_head
from ..linear_preference_loss import op as pref_op
from ._comm import all_gather as _all_gather
from ._comm import all_reduce_, require_initialized
from .vocab_layout import negotiate
from .vocab_parallel_policy import (
    SamplerShard,
    VocabShard,
    global_top_k,
    sampler_sizes,
    with_sampler_stats,
)
from .vocab_parallel_sampler import options
from .vocab_states import ROWS, empty_states, merge_rows, row_inverse, shared_plan


class PreferenceShard(VocabShard):
    """A vocabulary slice's reduction for the preference loss: the policy tile's states and,
    with the reference tile beside it, the reference tile's, in one all-gather per row block;
    the reference adds no gradient."""

    def __init__(self, backend, device_type, temperature, ignore_index, start, V, rows, group,
                 ref_beside, inv_ts=None):  # fmt: skip
        super().__init__(
            backend, device_type, temperature, ignore_index, start, V, rows, group, inv_ts
        )
        self.ref_fwd = self.ref_bwd = None  # (stats below; no reference gradient)
        self.ref_beside = ref_beside

    def _states(self, tiler, z, lc):
        st = empty_states(lc, self.start, z.shape[1], self.ii, tiler.acc)
        if z.shape[1]:
            tile = self._acc_tile(tiler, z, scale=True)
            tile_stats_(tile, lc, self.start, self.inv_t, self.ii, st[0:3], st[3])
        return st

    def stats(self, tiler, z, zr, lc, with_entropy):
        n = z.shape[0]
        st = self._states(tiler, z, lc)
        if zr is not None:  # (an input-dtype tile goes through the same float32 buffer after z)
            st = torch.cat([st, self._states(tiler, zr, lc)])
        got = _all_gather(st, self.group).view(self.world, -1, n)
        lp, ent, lse = merge_rows(got[:, :ROWS], lc, self.V, self.ii)
        ref = None if zr is None else (merge_rows(got[:, ROWS:], lc, self.V, self.ii)[0],)
        return lp, ent, lse, ref


class SamplerShards:
    """The sampled run's reductions of this rank's slices (linear_preference_loss/op.py's run
    asks for them): each head's row blocks, the same on every rank, and each head's
    SamplerShard (its kept set found with the other ranks per block, its outside flags)."""

    def __init__(self, backend, device_type, ignore_index, start, V, sizes, group, opts):
        self.args = (backend, device_type, ignore_index, start, V, None, group, opts)
        self.sizes, self.rank = sizes, dist.get_rank(group)

    def sampler_plan(self, hidden, budget, logits_dtype):
        return shared_plan(hidden, self.sizes, self.rank, logits_dtype, budget)

    def head_vocab(self, order, outside):
        """A head's reduction (order: the walk's, which the options already follow)."""
        vocab = SamplerShard(*self.args)
        vocab.bind(outside)
        return vocab


def _check(a):
    """What the registered op's C++ checks would see, for a vocabulary slice (which may be
    empty); the per-row shapes, scalars and options are the API's."""
    R, T = a.labels.shape
    check_args(
        a.hidden, a.weight, a.labels.reshape(-1), a.bias, a.temperature, a.ignore_index,
        a.max_chunk_bytes, a.logits_dtype, vocab_slice=True,
    )  # fmt: skip
    dev = a.hidden.device
    check_arg("mask", a.mask, dev, like="hidden", shape=(R, T), what="like labels", allow_none=True)
    check_arg("ref_logps", a.ref_logps, dev, like="hidden", dtypes=FLOAT_DTYPES, shape=(R,), allow_none=True,
              what="one per row")  # fmt: skip
    check_arg("pairs", a.pairs, dev, like="hidden", dtypes=INDEX_DTYPES, shape=(R // 2, 2), allow_none=True,
              what="(rows / 2, 2)")  # fmt: skip
    check_arg(
        "desirable",
        a.desirable,
        dev,
        like="hidden",
        shape=(R,),
        allow_none=True,
        what="one per row",
    )
    check_devices(
        "hidden", dev, ref_hidden=a.ref_hidden, ref_weight=a.ref_weight, ref_bias=a.ref_bias
    )
    if (a.ref_hidden is None) != (a.ref_weight is None):
        name = "ref_weight" if a.ref_hidden is None else "ref_hidden"
        raise ValueError(f"{name}: ref_hidden and ref_weight go together (the reference LM head)")
    if a.ref_hidden is None and a.ref_bias is not None:
        raise ValueError("ref_bias: needs ref_hidden and ref_weight")
    if a.ref_hidden is not None:
        if a.ref_logps is not None:
            raise ValueError(
                "ref_logps: give either ref_logps or ref_hidden / ref_weight (the reference "
                "head), not both"
            )
        rh = a.ref_hidden
        check_arg(
            "ref_hidden",
            rh,
            dev,
            like="hidden",
            dtypes=FLOAT_DTYPES,
            shape=(a.hidden.shape[0], rh.shape[-1]),
        )
        shape = (a.weight.shape[0], rh.shape[1])
        what = "weight's slice of the vocabulary, ref_hidden's width"
        check_arg(
            "ref_weight",
            a.ref_weight,
            dev,
            like="hidden",
            dtypes=(rh.dtype,),
            shape=shape,
            what=what,
        )
        check_arg(
            "ref_bias", a.ref_bias, dev, like="hidden", dtypes=(rh.dtype,), shape=shape[:1],
            what="weight.shape[0]", allow_none=True,
        )  # fmt: skip


def vocab_parallel_linear_preference_loss(
    args: tuple, process_group, vocab_start, reduce_hidden_grad, sampled=None
):
    """The body of linear_preference_loss(..., process_group=...): args the registered op's
    arguments (op.ARG_NAMES order), weight / bias / ref_weight / ref_bias this rank's vocabulary
    slice. Returns the op's (loss, stats, row_stats, token_stats), the gradients attached.
    sampled: the sampler op's arguments (op.SAMPLER_NAMES) of a call with per-row temperatures
    and no truncation (checked by the API), applied to both heads: then (loss, stats, row_stats,
    token_stats, outside), as the sampler op returns them."""
    require_initialized()
    a = pref_op.Call(*args, False, False, False)
    _check(a)
    hidden, group = a.hidden, process_group
    N, H = hidden.shape
    R, T = a.labels.shape
    full = a.ref_hidden is not None
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    reduce_h = need_h and bool(reduce_hidden_grad)
    truncated, same = sampler_sizes(sampled)
    starts, sizes = negotiate(
        vocab_start, a.weight.shape[0], group, hidden.device,
        rows=N, T=T, H=H, max_chunk_bytes=a.max_chunk_bytes,
        dtype=FLOAT_DTYPES.index(hidden.dtype), ref_hidden=int(full), reduce_hidden=int(reduce_h),
        **same,
    )  # fmt: skip
    V = sum(sizes)
    if hidden.device.type == "cpu" or _backend.strict():
        check_labels_in_range(a.labels, V, a.ignore_index)
    # the same row blocks and the same place of the reference tile on every rank
    cfg = pref_head.config(a)
    group_rows, batch = pref_head.unit_rows(cfg, T), pref_head.is_batch_scope(cfg)
    ldt, budget = a.logits_dtype, a.max_chunk_bytes

    def rows_of(share, grow):
        plans = (engine.plan_rows(hidden, v, ldt, budget, share, fused=False) for v in sizes)
        if grow:
            plans = (pref_op.grown(p, group_rows, batch, hidden, v, budget)
                     for p, v in zip(plans, sizes))  # fmt: skip
        return min(p.rows for p in plans)

    beside = False
    if full:
        rows = rows_of(2, False)
        beside = not batch and group_rows <= rows
    if not beside:
        rows = rows_of(1, True)
    backend = _backend.backend_for("linear_preference_loss", hidden)
    rank = dist.get_rank(group)
    if truncated:
        return _sampled_loss(a, args, sampled, cfg, backend, starts[rank], V, sizes, group,
                             reduce_h)  # fmt: skip
    inv_ts = None
    if sampled is not None:  # each token's 1 / T in the order the loop walks the rows
        inv_ts = row_inverse(sampled[0], (R, T), acc_dtype(hidden.dtype))
        order = pref_head.Layout(cfg, a.pairs, R, T, hidden.device).order
        if order is not None:
            inv_ts = inv_ts.index_select(0, order)
    vocab = PreferenceShard(backend, hidden.device.type, a.temperature, a.ignore_index,
                            starts[rank], V, rows, group, beside, inv_ts)  # fmt: skip

    def runner(call):
        out = pref_op.run(backend, call, vocab)
        loss, stats, rows_, tok, gh, gW, gb = out
        if call.need_hidden:
            if reduce_h:  # every slice of the vocabulary contributes to dL/dh: the sum
                all_reduce_(gh, group)
            gh = gh.to(hidden.dtype)
        return loss, stats, rows_, tok, gh, gW, gb

    out = pref_op.with_grads(runner, args)
    if sampled is None:
        return out
    loss, stats, rows_, tok = out
    names = pref_head.stat_names(a)
    sampled_names = pref_head.stat_names(pref_op.SamplerCall(*args, *sampled, False, False, False))
    outside = torch.zeros((R, T), dtype=torch.bool, device=hidden.device)
    return loss, with_sampler_stats(names, sampled_names, stats), rows_, tok, outside


def _sampled_loss(a, args, sampled, cfg, backend, start, V, sizes, group, reduce_h):
    """The loss under the sampler's truncation: the op's sampled run (each head's kept set, the
    reference head's pass first, mask_outside) on SamplerShards."""
    hidden = a.hidden
    R, T = a.labels.shape
    sampled = global_top_k(sampled, V, R, hidden.device)
    opts = options(a.labels, a.temperature, *sampled[:8], acc_dtype(hidden.dtype))
    order = pref_head.Layout(cfg, a.pairs, R, T, hidden.device).order
    if order is not None:  # the loop walks the rows pair by pair
        opts = opts._replace(**{f: getattr(opts, f).index_select(0, order)
                                for f in opts._fields[:4]})  # fmt: skip
    shards = SamplerShards(backend, hidden.device.type, a.ignore_index, start, V, sizes, group,
                           opts)  # fmt: skip

    def runner(call):
        loss, stats, rows_, tok, outside, gh, gW, gb = pref_op.run(backend, call, shards)
        if call.need_hidden:
            if reduce_h:  # every slice of the vocabulary contributes to dL/dh: the sum
                all_reduce_(gh, group)
            gh = gh.to(hidden.dtype)
        return loss, stats, rows_, tok, outside, gh, gW, gb

    return fused_op.with_grads(runner, pref_op.SamplerCall, 5, (*args, *sampled))
