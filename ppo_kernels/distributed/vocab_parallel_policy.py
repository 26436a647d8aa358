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
from ..fused_linear import engine
from ..fused_linear.checks import check_args
from ..fused_linear.vocab_chunks import tile_bwd_, tile_stats_
from ..linear_policy_loss import op as lpl_op
from ._comm import all_gather as _all_gather
from ._comm import all_reduce_, require_initialized
from .vocab_layout import negotiate
from .vocab_parallel_full_kl import merge_full_kl
from .vocab_states import ROWS, empty_states, merge_rows


class VocabShard(engine.WholeVocab):
    """The tile reduction of a vocabulary slice [start, start + V_rank) of V: local statistics,
    one all-gather per row block, the merge; the gradient tile elementwise from the merged ones."""

    fused = False  # the per-chunk tile kernels (they take a slice's offset)
    partial = True

    def __init__(self, backend, device_type, temperature, ignore_index, start, V, rows, group):
        tl, kl = lpl_op.tile_kernels(backend, device_type, temperature)
        super().__init__(backend, temperature, ignore_index, tl, kl)
        self.start, self.V, self.rows, self.group = start, V, rows, group
        self.world = dist.get_world_size(group)
        ref_bwd = self.ref_bwd

        def slice_kl_bwd(g, z, zr, stats, out):
            return out.zero_() if z.shape[1] == 0 else ref_bwd(g, z, zr, stats, out)

        self.ref_bwd = slice_kl_bwd

    def _acc_tile(self, tiler, z):
        """z in the accumulation dtype (a float32 copy of an input-dtype tile)."""
        return z if z.dtype == tiler.acc else tiler.buf[: z.numel()].view(z.shape).copy_(z)

    def stats(self, tiler, z, zr, lc, with_entropy):
        n, Vr = z.shape
        st = empty_states(lc, self.start, Vr, self.ii, tiler.acc)
        if Vr:
            tile = self._acc_tile(tiler, z)
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

    def grad(self, tiler, z, glp, gent, lc, lse, ent, alone):
        g = self._acc_tile(tiler, z)
        if z.shape[1]:
            tile_bwd_(g, lc, self.start, lse, ent, glp, gent, self.inv_t, self.ii, self.V)
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


def vocab_parallel_linear_policy_loss(args: tuple, process_group, vocab_start, reduce_hidden_grad):
    """The body of linear_policy_loss(..., process_group=...): args the registered op's arguments
    (op.ARG_NAMES order), weight / bias / ref_weight / ref_bias this rank's vocabulary slice.
    Returns the op's (loss, stats, token_stats), the gradients attached."""
    require_initialized()
    a = lpl_op.Call(*args, False, False, False)
    _check(a)
    hidden, group = a.hidden, process_group
    N, H = hidden.shape
    full = a.ref_hidden is not None
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    reduce_h = need_h and bool(reduce_hidden_grad)
    starts, sizes = negotiate(
        vocab_start, a.weight.shape[0], group, hidden.device,
        rows=N, T=a.labels.shape[-1], H=H, max_chunk_bytes=a.max_chunk_bytes,
        dtype=FLOAT_DTYPES.index(hidden.dtype), ref_hidden=int(full), reduce_hidden=int(reduce_h),
    )  # fmt: skip
    V = sum(sizes)
    if hidden.device.type == "cpu" or _backend.strict():
        check_labels_in_range(a.labels, V, a.ignore_index)
    # the same row blocks on every rank: the fewest rows any rank's plan takes
    share = 3 if full else 1
    ldt, budget = a.logits_dtype, a.max_chunk_bytes
    rows = min(engine.plan_rows(hidden, v, ldt, budget, share, fused=False).rows for v in sizes)
    backend = _backend.backend_for("linear_policy_loss", hidden)
    rank = dist.get_rank(group)
    vocab = VocabShard(
        backend, hidden.device.type, a.temperature, a.ignore_index, starts[rank], V, rows, group
    )

    def runner(call):
        loss, stats, tok, gh, gW, gb = lpl_op.run(backend, call, vocab)
        if call.need_hidden:
            if reduce_h:  # every slice of the vocabulary contributes to dL/dh: the sum
                all_reduce_(gh, group)
            gh = gh.to(hidden.dtype)
        return loss, stats, tok, gh, gW, gb

    return lpl_op.with_grads(runner, args)
