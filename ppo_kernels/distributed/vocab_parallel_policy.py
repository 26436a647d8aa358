"""Vocab-parallel linear_policy_loss (Megatron's layout, as linear_token_logprobs' vocab-parallel
form in vocab_parallel_linear.py): weight / bias (and the reference head's ref_weight / ref_bias) hold
this rank's contiguous slice of the vocabulary; hidden, labels (global ids) and every per-token
input are replicated. The chunk loop is the op's own (linear_policy_loss/op.py: run) with the tile
reduction of a shard (VocabShard):

- before the loop, ONE all-gather of a small header per rank (vocab_layout.negotiate): every
  slice's start and size -- the layout negotiation of the other forms, settled there at no cost --
  and the sizes every rank must hold alike. From the sizes every rank plans the same row blocks
  (the fewest rows any rank's plan takes), so the per-block collectives match;
- per row block, ONE all-gather of the block's per-row states ([5, rows]: the slice's softmax
  statistics m, s, u, the label's logit and whether the slice owns the label; with the reference
  head 3 more, full_kl's per-slice kl, lse_z, lse_w), merged on every rank (merge_rows,
  merge_full_kl): each row's full-vocabulary log-prob, entropy, log-sum-exp and exact KL, the same
  on every rank. The per-token loss coefficients follow from them and the replicated inputs
  (identical on every rank); each rank turns its own logits tile into its gradient tile
  (elementwise given the merged statistics: tile_bwd_, full_kl's backward tile kernel) and
  multiplies it into its weight / bias gradient (its slice of the unsharded one) and its partial
  hidden gradient;
- after the loop, ONE all-reduce of the float32 hidden gradient (reduce_hidden_grad=False leaves
  it partial), only when hidden requires grad.

Statistics over more than a block (a sequence longer than a block, clip_cov / kl_cov, bypass
mode) take the op's first pass, whose blocks gather their states the same way (one collective
each). Loss, statistics and per-token outputs are identical on every rank; nothing is scaled by
the world size. clip_cov draws at random: give every rank a generator seeded alike.

Eager only: the gradients are formed in the forward and attached by an autograd.Function (as the
op's fallback without the extension does), which torch.compile does not trace into a graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _backend
from .._checks import FLOAT_DTYPES, check_arg, check_devices, check_labels_in_range
from .._math import acc_dtype
from ..fused_linear import engine, fused_op
from ..fused_linear.checks import check_args
from ..fused_linear.engine import WholeVocab
from ..fused_linear.vocab_chunks import tile_bwd_, tile_stats_
from ..linear_policy_loss import op as lpl_op
from ._comm import all_gather as _all_gather
from ._comm import all_reduce_, require_initialized
from .vocab_layout import GIVEN, negotiate
from .vocab_parallel_full_kl import merge_full_kl
from .vocab_parallel_sampler import kept_set, options
from .vocab_states import ROWS, empty_states, merge_rows, row_inverse, shared_plan


class VocabShard(engine.WholeVocab):
    """The tile reduction of a vocabulary slice [start, start + V_rank) of V: local statistics,
    one all-gather per row block, the merge; the gradient tile elementwise from the merged ones."""

    fused = False  # the per-chunk tile kernels (they take a slice's offset)
    partial = True

    def __init__(self, backend, device_type, temperature, ignore_index, start, V, rows, group,
                 inv_ts=None):  # fmt: skip
        tl, kl = lpl_op.tile_kernels(backend, device_type, temperature)
        super().__init__(backend, temperature, ignore_index, tl, kl)
        self.start, self.V, self.rows, self.group = start, V, rows, group
        self.world = dist.get_world_size(group)
        # per-row temperatures: each row's 1 / T [N] in the order the loop walks the rows (the
        # tile is scaled row by row, the kernels run at temperature 1); the block's in blk_inv_ts
        self.inv_ts, self.blk_inv_ts = inv_ts, None
        if inv_ts is not None:
            self.inv_t = 1.0
        ref_bwd = self.ref_bwd

        def slice_kl_bwd(g, z, zr, stats, out):
            return out.zero_() if z.shape[1] == 0 else ref_bwd(g, z, zr, stats, out)

        self.ref_bwd = slice_kl_bwd

    def at_block(self, r0, r1, pad):
        """The block's per-row 1 / T (rows r0:r1 of the walk), padded as its tile."""
        if self.inv_ts is not None:
            self.blk_inv_ts = pad(self.inv_ts[r0:r1], 1.0)

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        self.at_block(r0, r1, tiler.pad)  # (engine.run_units has no at_block hook)
        return super().block_stats(tiler, hc, rtiler, r0, r1, lc, with_entropy)

    def _acc_tile(self, tiler, z, scale=False):
        """z in the accumulation dtype (a float32 copy of an input-dtype tile); scale: times each
        row's 1 / T where per-row temperatures are given (a copy: z itself is kept for the
        gradient)."""
        if scale and self.inv_ts is not None:
            return z.to(tiler.acc) * self.blk_inv_ts.unsqueeze(-1)
        return z if z.dtype == tiler.acc else tiler.buf[: z.numel()].view(z.shape).copy_(z)

    def stats(self, tiler, z, zr, lc, with_entropy):
        n, Vr = z.shape
        st = empty_states(lc, self.start, Vr, self.ii, tiler.acc)
        if Vr:
            tile = self._acc_tile(tiler, z, scale=True)
            tile_stats_(tile, lc, self.start, self.inv_t, self.ii, st[0:3], st[3])
        if zr is not None:  # full_kl's per-slice (kl_r, lse_z_r, lse_w_r)
            if Vr:
                kl3 = torch.stack(self.ref_fwd(z, zr, lc)).to(tiler.acc)
            else:  # an empty slice: no mass, no cross term
                kl3 = torch.full((3, n), float("-inf"), dtype=tiler.acc, device=z.device)
                kl3[0] = 0.0
            st = torch.cat([st, kl3])
        got = _all_gather(st, self.group).view(self.world, -1, n)
        lp, ent, lse = merge_rows(got[:, :ROWS], lc, self.V, self.ii)
        return lp, ent, lse, (merge_full_kl(got[:, ROWS:]) if zr is not None else None)

    def label_inv_t(self, like):
        """The rows' 1 / T of WholeVocab.label_grad (the z-loss's term at the label, on the
        slice that holds it): each row's with per-row temperatures."""
        return self.inv_t if self.inv_ts is None else self.blk_inv_ts.to(like.dtype)

    def grad(self, tiler, z, glp, gent, lc, lse, ent, alone):
        g = self._acc_tile(tiler, z)
        its = None if self.inv_ts is None else self.blk_inv_ts.unsqueeze(-1)
        if z.shape[1]:
            if its is not None:  # z = x / T_row, and d/dx = d/dz / T_row
                g.mul_(its)
            tile_bwd_(g, lc, self.start, lse, ent, glp, gent, self.inv_t, self.ii, self.V)
            if its is not None:
                g.mul_(its)
        return tiler.to_input(g)


class SamplerShard(engine.LseBySoftmax, VocabShard):
    """A vocabulary slice's reduction under the rollout sampler's truncation: per row block the
    logits form's kept-set search on this slice's whole rows (vocab_parallel_sampler.kept_set:
    its fixed collectives), the finish, the outside flags written for the head (`bind`); the
    gradient tile elementwise from the block's kept set (the sampler's backward op). full_lse:
    the statistics carry the whole vocabulary's lse (the z-loss) instead of the kept set's."""

    def __init__(self, backend, device_type, ignore_index, start, V, rows, group, opts,
                 full_lse=False):  # fmt: skip
        super().__init__(backend, device_type, 1.0, ignore_index, start, V, rows, group)
        self.full_lse = full_lse
        self.opts, self.outside, self.blk_opts, self.kept = opts, None, None, None
        self.layout = torch.tensor([start, V], dtype=torch.int64)
        self.rank = dist.get_rank(group)

    def bind(self, outside):
        """The [N] buffer of the outside flags the head reads (the op's output)."""
        self.outside = outside

    def at_block(self, r0, r1, pad):
        self.r0, self.r1 = r0, r1
        o = self.opts.rows(r0, r1)
        fills = (1.0, float("-inf"), 0, 1.0)  # padded rows: every option off
        self.blk_opts = o._replace(**{f: pad(getattr(o, f), v) for f, v in zip(o._fields, fills)})

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        return WholeVocab.block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy)

    def stats(self, tiler, z, zr, lc, with_entropy):
        x = self._acc_tile(tiler, z)  # (read only: z is kept for the gradient)
        o = self.blk_opts
        gathered, sums, m, cut, allow = kept_set(x, lc, o, self.start, GIVEN, self.group, self.ii)
        lp, ent, log_s, outside, _, lse, *_ = torch.ops.ppo_kernels.vocab_parallel_sampler_finish(
            x, lc, gathered, sums, m, o.inv_ts, o.lmp, cut, allow, self.rank, self.ii
        )
        n = self.r1 - self.r0
        self.outside[self.r0 : self.r1] = outside[:n]
        self.kept = (m, o.inv_ts, o.lmp, cut, allow, log_s, ent, outside)
        return lp, ent, lse if self.full_lse else log_s, None

    def grad(self, tiler, z, glp, gent, lc, lse, ent, alone):
        x = self._acc_tile(tiler, z)
        if z.shape[1] == 0:
            return tiler.to_input(x)
        g = torch.ops.ppo_kernels.vocab_parallel_sampler_backward(
            glp, gent, x, lc, *self.kept, self.layout, self.ii
        )
        if self.g_lse is not None:
            engine.add_softmax_grad(g, x, *self.g_lse, self.blk_opts.inv_ts)
        return tiler.to_input(g)


def _check(a):
    """What the registered op's C++ checks would see, for a vocabulary slice (which may be
    empty); per-token shapes, scalars and options are the API's."""
    labels = a.labels.reshape(-1)
    check_args(
        a.hidden, a.weight, labels, a.bias, a.temperature, a.ignore_index,
        a.max_chunk_bytes, a.logits_dtype, vocab_slice=True,
    )  # fmt: skip
    dev = a.hidden.device
    for name in ("advantages", "old_logprobs", "ref_logprobs", "weights"):
        check_arg(name, getattr(a, name), dev, like="hidden", dtypes=FLOAT_DTYPES, allow_none=True)
    check_arg("mask", a.mask, dev, like="hidden")
    check_arg("global_denom", a.global_denom, dev, like="hidden", allow_none=True)
    check_devices(
        "hidden", dev, ref_hidden=a.ref_hidden, ref_weight=a.ref_weight, ref_bias=a.ref_bias
    )
    if (a.ref_hidden is None) != (a.ref_weight is None):
        name = "ref_weight" if a.ref_hidden is None else "ref_hidden"
        raise ValueError(f"{name}: ref_hidden and ref_weight go together (the reference LM head)")
    if a.ref_hidden is None and a.ref_bias is not None:
        raise ValueError("ref_bias: needs ref_hidden and ref_weight")
    if a.ref_hidden is not None:
        if a.ref_logprobs is not None:
            raise ValueError(
                "ref_logprobs: give either ref_logprobs (sampled KL estimators) or ref_hidden / "
                "ref_weight (the exact KL), not both"
            )
        rh = a.ref_hidden
        check_arg(
            "ref_hidden", rh, dev, like="hidden", dtypes=FLOAT_DTYPES,
            shape=(a.hidden.shape[0], rh.shape[-1]),
        )  # fmt: skip
        shape = (a.weight.shape[0], rh.shape[1])
        what = "weight's slice of the vocabulary, ref_hidden's width"
        check_arg(
            "ref_weight", a.ref_weight, dev, like="hidden", dtypes=(rh.dtype,), shape=shape,
            what=what,
        )  # fmt: skip
        check_arg(
            "ref_bias", a.ref_bias, dev, like="hidden", dtypes=(rh.dtype,), shape=shape[:1],
            what="weight.shape[0]", allow_none=True,
        )  # fmt: skip


def with_sampler_stats(names, sampled_names, stats):
    """The stats vector of the plain op's names as the sampler's op orders its names, with
    num_outside 0 (per-row temperatures alone leave no label outside the kept set)."""
    got = dict(zip(names, stats.unbind(0)))
    zero = stats.new_zeros(())
    return torch.stack([got.get(n, zero) for n in sampled_names])


def sampler_sizes(sampled) -> tuple[bool, dict]:
    """(whether the sampler op's arguments `sampled` (or None) truncate, the sizes of them that
    decide the collectives, for vocab_layout.negotiate to check alike on every rank)."""
    if sampled is None:
        return False, {}
    _, k, ks, p, ps, mp, mps, smp, _ = sampled
    on = (k != 0 or ks is not None, p != 1.0 or ps is not None, mp != 0.0 or mps is not None)
    sizes = dict(sampler=("vllm", "sglang").index(smp), top_k=int(on[0]), top_p=int(on[1]),
                 min_p=int(on[2]))  # fmt: skip
    return any(on), sizes


def global_top_k(sampled, V, rows, device):
    """The sampler op's arguments with a scalar top-k measured against the whole vocabulary V: a
    fused loss's head decides its first pass from the call (linear_policy_loss.head.truncates,
    which reads the weight's rows: a slice here), so a top-k below V becomes a per-row tensor
    ([rows], the same on every rank) and one at or above V is off."""
    _, k, ks = sampled[:3]
    if ks is None and k != 0:
        ks = torch.full((rows,), k, dtype=torch.int64, device=device) if k < V else None
        k = 0
    return (sampled[0], k, ks, *sampled[3:])


def vocab_parallel_linear_policy_loss(
    args: tuple, process_group, vocab_start, reduce_hidden_grad, sampled=None
):
    """The body of linear_policy_loss(..., process_group=...): args the registered op's arguments
    (op.ARG_NAMES order), weight / bias / ref_weight / ref_bias this rank's vocabulary slice.
    Returns the op's (loss, stats, token_stats), the gradients attached. sampled: the sampler
    op's arguments (op.SAMPLER_NAMES, checked by the API): then (loss, stats, token_stats,
    outside), as the sampler op returns them; per-row temperatures alone scale each row of the
    plain shard's tiles, a truncation runs SamplerShard's kept-set search per row block."""
    require_initialized()
    a = lpl_op.Call(*args, False, False, False)
    _check(a)
    hidden, group = a.hidden, process_group
    N, H = hidden.shape
    full = a.ref_hidden is not None
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    reduce_h = need_h and bool(reduce_hidden_grad)
    acc = acc_dtype(hidden.dtype)
    truncated, same = sampler_sizes(sampled)
    starts, sizes = negotiate(
        vocab_start, a.weight.shape[0], group, hidden.device,
        rows=N, T=a.labels.shape[-1], H=H, max_chunk_bytes=a.max_chunk_bytes,
        dtype=FLOAT_DTYPES.index(hidden.dtype), ref_hidden=int(full), reduce_hidden=int(reduce_h),
        **same,
    )  # fmt: skip
    V = sum(sizes)
    if hidden.device.type == "cpu" or _backend.strict():
        check_labels_in_range(a.labels, V, a.ignore_index)
    # the same row blocks on every rank: the fewest rows any rank's plan takes
    share = 3 if full else 1
    ldt, budget = a.logits_dtype, a.max_chunk_bytes
    rank = dist.get_rank(group)
    rows = shared_plan(hidden, sizes, rank, ldt, budget, share).rows
    backend = _backend.backend_for("linear_policy_loss", hidden)
    if truncated:
        sampled = global_top_k(sampled, V, a.labels.shape[0], hidden.device)
        opts = options(a.labels, a.temperature, *sampled[:8], acc)
        return _sampled_loss(a, args, sampled, opts, backend, starts[rank], V, rows, group,
                             reduce_h)  # fmt: skip
    inv_ts = None
    if sampled is not None:
        inv_ts = row_inverse(sampled[0], tuple(a.labels.shape), acc)
    vocab = VocabShard(
        backend, hidden.device.type, a.temperature, a.ignore_index, starts[rank], V, rows, group,
        inv_ts,
    )  # fmt: skip

    def runner(call):
        loss, stats, tok, gh, gW, gb = lpl_op.run(backend, call, vocab)
        if call.need_hidden:
            if reduce_h:  # every slice of the vocabulary contributes to dL/dh: the sum
                all_reduce_(gh, group)
            gh = gh.to(hidden.dtype)
        return loss, stats, tok, gh, gW, gb

    loss, stats, tok = lpl_op.with_grads(runner, args)
    if sampled is None:
        return loss, stats, tok
    names = lpl_op.stat_names(a)
    sampled_names = lpl_op.stat_names(lpl_op.SamplerCall(*args, *sampled, False, False, False))
    outside = torch.zeros(a.labels.shape, dtype=torch.bool, device=hidden.device)
    return loss, with_sampler_stats(names, sampled_names, stats), tok, outside


def _sampled_loss(a, args, sampled, opts, backend, start, V, rows, group, reduce_h):
    """The loss under the sampler's truncation: the op's loop (linear_policy_loss_sampler's,
    with its first pass where labels outside the kept set leave the mask) on SamplerShard."""
    vocab = SamplerShard(backend, a.hidden.device.type, a.ignore_index, start, V, rows, group,
                         opts, a.z_loss != 0)  # fmt: skip

    def runner(call):
        loss, stats, tok, outside, gh, gW, gb = lpl_op.run(backend, call, vocab)
        if call.need_hidden:
            if reduce_h:  # every slice of the vocabulary contributes to dL/dh: the sum
                all_reduce_(gh, group)
            gh = gh.to(a.hidden.dtype)
        return loss, stats, tok, outside, gh, gW, gb

    return fused_op.with_grads(runner, lpl_op.SamplerCall, 4, (*args, *sampled))
