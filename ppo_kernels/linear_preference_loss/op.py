"""The Python side of the registered ops `ppo_kernels::linear_preference_loss` and
`ppo_kernels::linear_preference_loss_grads`, defined in C++ (csrc/ops/linear_preference_loss.cpp:
schemas, checks, routing, autograd): the op on each backend -- the fused-linear engine's loop
(fused_linear/engine.py) with the preference loss's head term (head.py) -- the fake kernels and the
fallback without the extension. Semantics: naive.py; public function: api.py.

One pass over the hidden-state rows computes the loss and its gradients ("3 GEMMs": the logits
tile, then grad_hidden = G W and grad_W = G^T h for the logits gradient G formed in the forward;
a reference head adds its tile's GEMM, no gradient). A pair longer than a block: the default
budget grows the block to the pair, or runs the loop by pairs (engine.run_units: per-row gradient
accumulators, 3 GEMMs) where those take less memory than the pair's tile (`by_units`); a given
budget, and the sorted types (aot, aot_unpaired), take the engine's first pass of log-probs (4
GEMMs; a reference head then runs one pass of its own before).

`linear_preference_loss_sampler` (+ `_grads`): the same loss under the rollout sampler's
distribution (a temperature tensor, top-k, top-p, min-p; its arguments follow the plain op's).
Each head's tiles hold whole rows and are reduced by token_logprobs' sampler kernels
(engine.SamplerVocab), each head with its own kept set; the reference head always runs its pass
first, so its outside flags are known when a block's pairs are. A label outside either kept set
leaves its completion's sums (mask_outside, the default): a block of whole pairs knows its flags
after its own reduction, so one pass is enough unless the plain op needs a first pass anyway, or
the SFT term's batch token count depends on every block's flags.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_labels_in_range
from .._math import acc_dtype
from ..fused_linear import engine, fused_op
from ..fused_linear.planner import Plan, resolve_budget
from ..token_logprobs import op as tl_op
from . import head as pref_head

OP = _backend.register_op(
    "linear_preference_loss",
    kernel="token_logprobs_fwd",
    triton=True,
    cuda_default="triton",
    folder="linear_preference_loss",
    delegates={
        ("cpp", "cpu"): "BLAS matmuls + the token_logprobs C++ kernels",
        ("cpp", "cuda"): "cuBLAS matmuls (torch.mm) + the token_logprobs CUDA kernels",
        ("triton", "cuda"): "cuBLAS matmuls (torch.mm) + the token_logprobs Triton kernels",
        ("eager", "cpu"): "BLAS matmuls (torch.mm) + eager tile math",
        ("eager", "cuda"): "cuBLAS matmuls (torch.mm) + eager tile math",
    },
)
_backend.routes_in_cpp("linear_preference_loss")

CONFIG_FIELDS = pref_head.CONFIG_FIELDS  # loss_type ... undesirable_weight

# The arguments of both registered ops, in schema order (csrc/ops/linear_preference_loss.cpp;
# checked against the schema at import). linear_preference_loss_grads adds need_hidden,
# need_weight, need_bias.
ARG_NAMES = (
    "hidden",
    "weight",
    "labels",
    "mask",
    "bias",
    "pairs",
    "desirable",
    "ref_logps",
    "ref_hidden",
    "ref_weight",
    "ref_bias",
    "reference_point",
    *CONFIG_FIELDS,
    "temperature",
    "softcap",
    "ignore_index",
    "max_chunk_bytes",
    "logits_dtype",
    "with_entropy",
    "with_logit_stats",
)
NEED_NAMES = ("need_hidden", "need_weight", "need_bias")
Call = NamedTuple("Call", [(n, object) for n in ARG_NAMES + NEED_NAMES])

# linear_preference_loss_sampler's arguments after ARG_NAMES (then NEED_NAMES for its _grads):
# temperatures (Tensor? [R] / [R, T], replaces temperature), top_k / top_ks, top_p / top_ps,
# min_p / min_ps (a scalar, or a per-row tensor that replaces it), sampler, mask_outside.
SAMPLER_NAMES = (
    "temperatures", "top_k", "top_ks", "top_p", "top_ps", "min_p", "min_ps", "sampler",
    "mask_outside",
)  # fmt: skip
SamplerCall = NamedTuple(
    "SamplerCall", [(n, object) for n in ARG_NAMES + SAMPLER_NAMES + NEED_NAMES]
)

if _backend.HAS_EXTENSION:
    _schema = _backend.registered("linear_preference_loss_grads").default._schema
    assert tuple(a.name for a in _schema.arguments) == ARG_NAMES + NEED_NAMES, (
        "csrc/ops/linear_preference_loss.cpp and op.ARG_NAMES disagree"
    )
    _schema = _backend.registered("linear_preference_loss_sampler_grads").default._schema
    assert tuple(a.name for a in _schema.arguments) == ARG_NAMES + SAMPLER_NAMES + NEED_NAMES, (
        "csrc/ops/linear_preference_loss.cpp and op.SAMPLER_NAMES disagree"
    )

stat_names = pref_head.stat_names
ROW_STATS, TOKEN_STATS = pref_head.ROW_STATS, pref_head.TOKEN_STATS


def _ref_kernel(backend: str, temperature: float, ignore_index: int):
    """engine.WholeVocab's `ref` for a reference head: its tile's token log-probs (the
    token_logprobs forward kernel on the reference tile), no gradient."""
    f = tl_op.forward.impls[backend]
    inv_t = 1.0 / temperature

    def fwd(z, zr, labels):
        return (f(zr, labels, inv_t, ignore_index, False)[0],)

    return fwd, None


class PreferenceVocab(engine.WholeVocab):
    """WholeVocab, the reference tile's token log-probs beside the policy tile's, and optionally
    each token's logit statistics TRL's DPOTrainer reports (`logit_stats` [2, N], walk order:
    the mean of the token's logits over the vocabulary at the temperature, and whether the
    label is the first largest logit; 0 for an ignored token) -- one more pass over the tile.
    Soft-capping and the temperature keep the order of the logits: the tile's argmax is theirs."""

    logit_stats: Tensor | None = None

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        st = super().block_stats(tiler, hc, rtiler, r0, r1, lc, with_entropy)
        if self.logit_stats is not None:
            _store_logit_stats(self, r0, r1, lc, self.inv_t)
        return st


def _store_logit_stats(vocab, r0, r1, lc, inv_t):
    """The block's logit statistics from its tile vocab.z (inv_t: a float, or the block's
    per-row [n] tensor) into vocab.logit_stats."""
    z, n, out = vocab.z, r1 - r0, vocab.logit_stats
    keep = (lc[:n] != vocab.ii).to(out.dtype)
    mean = z[:n].sum(1, dtype=out.dtype) * (inv_t / max(z.shape[1], 1))
    top1 = (z[:n].argmax(1) == lc[:n]).to(keep.dtype) if z.shape[1] else keep * 0
    out[0, r0:r1] = mean * keep
    out[1, r0:r1] = top1 * keep


class SamplerPreferenceVocab(engine.SamplerVocab):
    """SamplerVocab with PreferenceVocab's logit statistics (the mean at each row's temperature;
    the tile of a second pass that reuses the first's statistics has them already)."""

    logit_stats: Tensor | None = None

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        st = super().block_stats(tiler, hc, rtiler, r0, r1, lc, with_entropy)
        if self.logit_stats is not None and self.z is not None:
            inv_ts = self.blk[2]
            if inv_ts is not None:
                inv_ts = self.inv_t * inv_ts[: r1 - r0].to(self.logit_stats.dtype)
            inv_t = self.inv_t if inv_ts is None else inv_ts
            _store_logit_stats(self, r0, r1, lc, inv_t)
        return st


def whole_vocab(backend: str, temperature: float, ignore_index: int) -> PreferenceVocab:
    """The engine's reduction of whole-vocabulary tiles on `backend`, the reference tile's token
    log-probs beside the policy tile's."""
    tl = (tl_op.forward.impls[backend], tl_op.backward.impls[backend])
    return PreferenceVocab(
        backend, temperature, ignore_index, tl, _ref_kernel(backend, temperature, ignore_index)
    )


def check_pairs(pairs: Tensor, R: int):
    """ValueError unless `pairs` [P, 2] holds every row once (reads it: a host sync on the GPU,
    so GPU callers run it under strict_checks() only)."""
    seen = torch.zeros(R, dtype=torch.long, device=pairs.device)
    flat = pairs.reshape(-1).long()
    if bool(((flat < 0) | (flat >= R)).any()):
        raise ValueError(f"pairs: a row index outside [0, {R})")
    seen.index_add_(0, flat, torch.ones_like(flat))
    if not bool((seen == 1).all()):
        raise ValueError("pairs: every row must be in exactly one pair (chosen or rejected)")


# The default budget grows a block to one pair (2T rows, the chunk Liger's losses materialise)
# when its rows hold less, up to this many bytes of logits tile: a pair longer than a block costs
# a first pass, one more GEMM per block. A given max_chunk_bytes is kept.
PAIR_BLOCK_MAX_BYTES = {"cpu": 4 << 30, "cuda": 16 << 30}


def plan_blocks(head, a, V: int, vocab) -> tuple[Plan, bool, bool]:
    """(the row plan, whether a reference head's tile sits beside the policy tile, whether the
    loop runs by pairs: engine.run_units). The reference tile goes beside the policy tile
    (WholeVocab's `ref`: both tiles within the budget) when the blocks then still hold whole
    pairs; otherwise the reference head runs a pass of its own first (the same GEMMs, one tile
    at a time) and the policy's blocks get the whole budget. vocab.rows (a shard's reduction:
    the rows common to every rank) fixes the rows and vocab.ref_beside the choice."""
    hidden, ldt, budget = a.hidden, a.logits_dtype, a.max_chunk_bytes
    full = a.ref_hidden is not None
    if vocab.rows is not None:
        p = engine.plan_rows(hidden, V, ldt, budget, 1, vocab.fused)
        beside = full and getattr(vocab, "ref_beside", False)
        return dataclasses.replace(p, rows=vocab.rows), beside, False
    if full:
        p = engine.plan_rows(hidden, V, ldt, budget, 2, vocab.fused)
        if not head.needs_first_pass(p.rows):
            return p, True, False
    p = engine.plan_rows(hidden, V, ldt, budget, 1, vocab.fused)
    acc_bytes = units_bytes(head, a, p, V, vocab)
    if acc_bytes is not None:  # the tiles may take what the accumulators take
        q = engine.plan_rows(hidden, V, ldt, max(acc_bytes, resolve_budget(0, hidden.device)), 1,
                             vocab.fused)  # fmt: skip
        return (q if q.rows < head.group else p), False, True
    return grown(p, head.group, head.batch_scope, hidden, V, budget), False, False


def units_bytes(head, a, p: Plan, V: int, vocab) -> int | None:
    """The memory of the per-row accumulators when the default budget's blocks, smaller than a
    pair, run by pairs (engine.run_units: each row's gradient GEMMs into accumulators of its own,
    scaled by its coefficient once the pair is reduced) instead of growing to a pair, else None:
    by pairs when those accumulators (a [V, H] grad_weight per row of the pair: none for a
    frozen head) take less memory than the pair's tile, e.g. H < T. The coefficients must be one
    scalar per row times its mask (not LD-DPO's weights) and the reduction the plain
    whole-vocabulary one."""
    if a.max_chunk_bytes or _backend.invariant() or head.batch_scope or head.group <= p.rows:
        return None
    if type(vocab) is not PreferenceVocab or head.cfg.ld_alpha is not None:
        return None
    hidden = a.hidden
    acc = acc_dtype(hidden.dtype).itemsize
    per_row = V * hidden.shape[1] * acc * bool(a.need_weight)
    per_row += V * acc * bool(a.need_bias and a.bias is not None)
    elem = hidden.dtype.itemsize if p.input_tiles else 4
    cap = PAIR_BLOCK_MAX_BYTES.get(hidden.device.type, PAIR_BLOCK_MAX_BYTES["cuda"])
    total = (head.group // head.T) * per_row
    return total if total < min(head.group * V * elem, cap) else None


def grown(p: Plan, group: int, batch_scope: bool, hidden: Tensor, V: int, budget: int) -> Plan:
    """The default budget's plan grown to hold one pair (`group` rows, head.unit_rows) within
    PAIR_BLOCK_MAX_BYTES of tile, or p (a given budget, batch-invariant mode, a sorted type)."""
    if budget or _backend.invariant() or batch_scope or group <= p.rows:
        return p
    elem = hidden.dtype.itemsize if p.input_tiles else 4
    cap = PAIR_BLOCK_MAX_BYTES.get(hidden.device.type, PAIR_BLOCK_MAX_BYTES["cuda"])
    if group * V * elem > cap:
        return p
    return dataclasses.replace(p, rows=min(group, hidden.shape[0]))


def run(backend: str, a, vocab: engine.WholeVocab | None = None) -> tuple[Tensor, ...]:
    """linear_preference_loss_grads on `backend` ("cpp", "triton", "eager"): the arguments as
    the schema names them (Call). vocab: how a tile is reduced (default whole_vocab; the
    vocab-parallel form passes its shard's, whose labels it has checked against the whole
    vocabulary). Returns (loss, stats, row_stats, token_stats, grad_hidden, grad_weight,
    grad_bias); a SamplerCall runs linear_preference_loss_sampler_grads: the sampler's
    reduction, and the `outside` flags [R, T] follow token_stats. With a SamplerCall, `vocab`
    (the vocab-parallel form's) plans each head's blocks (`sampler_plan(hidden, budget,
    logits_dtype)`) and gives each head's reduction (`head_vocab(order, outside)`)."""
    hidden, labels = a.hidden, a.labels
    R, T = labels.shape
    N = R * T
    dev = hidden.device
    acc = acc_dtype(hidden.dtype)
    ii = a.ignore_index
    cpu_or_strict = dev.type == "cpu" or _backend.strict()
    sampled = isinstance(a, SamplerCall)
    shards = vocab if sampled else None  # the vocab-parallel form's sampled reductions
    if vocab is None:
        if cpu_or_strict:
            check_labels_in_range(labels, a.weight.shape[0], ii)
        if not sampled:
            vocab = whole_vocab(backend, a.temperature, ii)
    if a.pairs is not None and cpu_or_strict:
        check_pairs(a.pairs, R)
    cfg = pref_head.config(a)
    pref_head.check_reference(cfg, a.ref_logps is not None or a.ref_hidden is not None)
    if a.mask is not None:  # off the mask: no log-prob, no gradient (the kernels skip the row)
        labels = torch.where(
            a.mask != 0, labels, torch.full((), ii, dtype=labels.dtype, device=dev)
        )
    layout = pref_head.Layout(cfg, a.pairs, R, T, dev)
    V = a.weight.shape[0]
    full = a.ref_hidden is not None
    flat = labels.reshape(-1)
    order = layout.order
    outside = None  # the sampler's: the policy's and the reference head's flags (walk order)
    if sampled:
        outside = tuple(
            torch.zeros(N, dtype=torch.bool, device=dev) if on else None for on in (True, full)
        )
    head = pref_head.PreferenceHead(a, cfg, layout, labels, acc, outside)
    if sampled:  # whole rows; the reference head's pass first (never beside)
        plan = (engine.sampler_plan(hidden, V, a.max_chunk_bytes, a.logits_dtype) if shards is None
                else shards.sampler_plan(hidden, a.max_chunk_bytes, a.logits_dtype))  # fmt: skip
        beside = units = False
    else:
        plan, beside, units = plan_blocks(head, a, V, vocab)
    token_stats = _backend.new_output((len(TOKEN_STATS), R, T), acc, dev)
    walked = order is not None
    lp_w = torch.empty(N, dtype=acc, device=dev) if walked else token_stats[0].view(-1)
    ent_w = None
    if head.with_entropy:
        ent_w = torch.empty(N, dtype=acc, device=dev) if walked else token_stats[1].view(-1)
    else:
        token_stats[1].zero_()
    if sampled and shards is None:
        vocab = _sampler_vocab(backend, a, plan, head, order, lp_w, ent_w, outside[0])
    elif sampled:
        vocab = shards.head_vocab(order, outside[0])
    stats_w = logit_stats = None
    if a.with_logit_stats:
        if not isinstance(vocab, (PreferenceVocab, SamplerPreferenceVocab)):
            raise ValueError("return_logit_stats: not in the vocab-parallel form")
        stats_w = torch.empty((2, N), dtype=acc, device=dev) if walked else None
        logit_stats = token_stats[3:5].view(2, N) if stats_w is None else stats_w
    else:
        token_stats[3:5].zero_()
    ref = ref_plan = None
    if full:
        rhead = (a.ref_hidden, a.ref_weight, a.ref_bias)
        head.ref_tok = torch.empty(N, dtype=acc, device=dev)  # (walk order)
        if sampled:  # its own kept set, with the same parameters
            if shards is None:
                ref_plan = engine.sampler_plan(a.ref_hidden, V, a.max_chunk_bytes, a.logits_dtype)
                ref_vocab = _sampler_vocab(backend, a, ref_plan, None, order, None, None,
                                           outside[1])  # fmt: skip
            else:
                ref_plan = shards.sampler_plan(a.ref_hidden, a.max_chunk_bytes, a.logits_dtype)
                ref_vocab = shards.head_vocab(order, outside[1])
            engine.run(
                engine.StoreStats(False),
                ref_vocab,
                engine.Head(*rhead, flat, T, order),
                ref_plan,
                softcap=a.softcap,
                lp_out=head.ref_tok,
            )
        else:
            ref_plan = engine.plan_rows(a.ref_hidden, V, a.logits_dtype, a.max_chunk_bytes)
            ref_plan = dataclasses.replace(ref_plan, rows=plan.rows)
            if not beside:  # the reference head's pass first (the first pass, if any, needs it)
                engine.run(
                    engine.StoreStats(False),
                    vocab,
                    engine.Head(*rhead, flat, T, order),
                    ref_plan,
                    softcap=a.softcap,
                    lp_out=head.ref_tok,
                )
            else:
                ref = rhead
    if isinstance(vocab, (PreferenceVocab, SamplerPreferenceVocab)):
        vocab.logit_stats = logit_stats  # (the policy's tiles only)
    lm = engine.Head(hidden, a.weight, a.bias, flat, T, order)
    need = (a.need_hidden, a.need_weight, a.need_bias)
    if units:  # the token weights of engine.run_units: each row's mask (walk order)
        gh, gW, gb = engine.run_units(
            head, vocab, lm, plan, head.group, head.m.reshape(-1), softcap=a.softcap,
            need=need, lp_out=lp_w, ent_out=ent_w,
        )  # fmt: skip
    else:
        gh, gW, gb = engine.run(
            head, vocab, lm, plan, ref=ref, ref_plan=ref_plan, softcap=a.softcap, need=need,
            lp_out=lp_w, ent_out=ent_w,
        )  # fmt: skip
    if walked:
        layout.unwalk_(token_stats[0].view(-1), lp_w)
        if ent_w is not None:
            layout.unwalk_(token_stats[1].view(-1), ent_w)
    if stats_w is not None:
        layout.unwalk_(token_stats[3].view(-1), stats_w[0])
        layout.unwalk_(token_stats[4].view(-1), stats_w[1])
    if full:  # the reference's token log-probs (0 off the mask)
        layout.unwalk_(token_stats[2].view(-1), head.ref_tok)
    else:
        token_stats[2].zero_()
    loss, stats = head.result()
    row_stats = _backend.new_output((3, R), acc, dev)
    layout.unwalk_(row_stats, torch.stack((head.seq, head.ref_seq, head.rewards)))
    if not sampled:
        return loss, stats, row_stats, token_stats, gh, gW, gb
    out = _backend.new_output((R, T), torch.bool, dev)
    layout.unwalk_(out.view(-1), outside[0] if outside[1] is None else outside[0] | outside[1])
    stats = torch.cat((stats, out.sum().to(acc).reshape(1)))  # num_outside
    return loss, stats, row_stats, token_stats, out, gh, gW, gb


def _sampler_vocab(backend, a, plan, head, order, lp_w, ent_w, outside) -> SamplerPreferenceVocab:
    """The sampler's reduction of one head of the call `a` (a SamplerCall; rows in walk order:
    `order`) on `backend`'s sampler kernels (eager for float64 or without compiled ones),
    writing its outside flags into `outside` [N]. head: the policy's (None: the reference head,
    no gradient); in its two-pass loop the first pass keeps every row's statistics and kept set
    (into lp_w, ent_w) and the second reuses them."""
    hidden, V = a.hidden, a.weight.shape[0]
    R, T = a.labels.shape
    N, dev = R * T, hidden.device
    kb = engine.sampler_kernels(hidden if head is not None else a.ref_hidden, backend)
    params = engine.sampler_params(
        (R, T), dev, a.temperatures, a.top_k, a.top_ks, a.top_p, a.top_ps, a.min_p, a.min_ps
    )
    if order is not None:  # the loop walks the rows pair by pair
        params = tuple(t.index_select(0, order) if isinstance(t, Tensor) else t for t in params)
    tl = (tl_op.sampler_forward.impls[kb], tl_op.sampler_backward.impls[kb])
    acc = acc_dtype(hidden.dtype)
    outs, saved, gbuf = (None, None, outside), None, None
    if head is not None and head.passes(plan.rows, T) == 2:
        outs = (torch.empty(N, dtype=acc, device=dev), torch.empty(N, dtype=torch.int64,
                device=dev), outside)  # fmt: skip
        ent = ent_w if ent_w is not None else torch.empty_like(outs[0])
        saved = (lp_w, ent, torch.empty_like(outs[0]))
    if head is not None and (
        a.need_hidden or a.need_weight or (a.need_bias and a.bias is not None)
    ):
        tile_rows = plan.rows if plan.pad else min(plan.rows, N)
        gdt = hidden.dtype if plan.input_tiles else acc
        gbuf = torch.empty(tile_rows * V, dtype=gdt, device=dev)
    return SamplerPreferenceVocab(
        kb, 1.0 / a.temperature, params, a.sampler, a.ignore_index, tl, outs=outs, gbuf=gbuf,
        saved=saved,
    )  # fmt: skip


def _impl(backend):
    def impl(*args):
        return run(backend, Call(*args))

    impl.__name__ = f"linear_preference_loss_grads_{backend}"
    return impl


def _sampler_impl(backend):
    def impl(*args):
        return run(backend, SamplerCall(*args))

    impl.__name__ = f"linear_preference_loss_sampler_grads_{backend}"
    return impl


for _b in _backend.BACKENDS:
    _backend.impl("linear_preference_loss_grads", _b)(_impl(_b))
    _backend.impl("linear_preference_loss_sampler_grads", _b)(_sampler_impl(_b))


def _fake_outputs(a):
    hidden = a.hidden
    acc = acc_dtype(hidden.dtype)
    R, T = a.labels.shape
    loss = hidden.new_empty((), dtype=acc)
    stats = hidden.new_empty((len(stat_names(a)),), dtype=acc)
    rows = hidden.new_empty((len(ROW_STATS), R), dtype=acc)
    return loss, stats, rows, hidden.new_empty((len(TOKEN_STATS), R, T), dtype=acc)


# The tensor arguments after hidden, each on hidden's device: the fakes and the fallback check it
# as the C++ checks do (a meta tensor sends a call to its fake whatever the other arguments').
_ON_HIDDENS_DEVICE = (
    "weight", "labels", "mask", "bias", "pairs", "desirable", "ref_logps", "ref_hidden",
    "ref_weight", "ref_bias", "reference_point",
)  # fmt: skip


def _check_devices(a):
    fused_op.check_on_hiddens_device(a, _ON_HIDDENS_DEVICE)


def _fake_sampler_outputs(a):
    return (*_fake_outputs(a), fused_op.fake_outside(a))


for _name, _call, _outputs in (
    ("linear_preference_loss", Call, _fake_outputs),
    ("linear_preference_loss_sampler", SamplerCall, _fake_sampler_outputs),
):
    _fake, _fake_grads = fused_op.fake_kernels(_call, _check_devices, _outputs)
    _backend.fake(_name)(_fake)
    _backend.fake(_name + "_grads")(_fake_grads)


# --------------------------------------------------------------------------- without the extension
def with_grads(runner, args) -> tuple[Tensor, ...]:
    """(loss, stats, row_stats, token_stats) of the op's arguments `args` by runner(Call) (run's
    outputs), the gradients of hidden / weight / bias that require grad attached to the loss."""
    return fused_op.with_grads(runner, Call, 4, args)


@_backend.fallback("linear_preference_loss")
def _(*args):
    _check_devices(Call(*args, False, False, False))
    return with_grads(lambda call: run("eager", call), args)


@_backend.fallback("linear_preference_loss_sampler")
def _(*args):
    _check_devices(SamplerCall(*args, False, False, False))
    return fused_op.with_grads(lambda call: run("eager", call), SamplerCall, 5, args)
