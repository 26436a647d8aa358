"""The chunk loop every loss from hidden states runs on: one pass over row blocks of the hidden
states, each block's logits tile h W^T (+ b) computed once (tiler.py, planned by planner.py) and
reduced at once, the logits gradient formed in the same pass from per-token coefficients, then
the two gradient GEMMs -- "3 GEMMs", the logits never built whole.

Two pieces plug into the loop:

- a **head term** (`HeadTerm`): what the loss makes of each token's statistics. Per block it
  receives the log-probs, entropy and log-sum-exp of its tokens (and, with a reference head, the
  exact KL against it), stores what it reports, and returns the coefficients of the gradient:
  dL/dlogprob, dL/dentropy and dL/dKL per token. linear_policy_loss's head is
  linear_policy_loss/head.py; linear_token_logprobs's backward is the trivial head whose
  coefficients are the upstream gradients.
- a **vocabulary reduction** (`WholeVocab` here, and `SamplerVocab`, its form under a rollout
  sampler's distribution; `vocab_chunks.VocabChunks` for tiles of
  vocabulary chunks; the vocab-parallel forms' shard reductions in ppo_kernels/distributed/):
  how a block's statistics come out of its tile(s) and how its gradient tile is made and
  multiplied into the gradients.

A head term whose coefficients need statistics of more than a block (a sequence longer than a
block, a batch statistic) asks for two passes: the first computes the log-probs only (one GEMM
per block), the head then forms every coefficient, and the second pass makes the gradient tiles
(4 GEMMs instead of 3). Where a unit's coefficients are per-row scalars times token weights
known before (a preference pair: dL/dlogprob = alpha_row * w_t), `run_units` keeps 3 GEMMs
instead: the gradient GEMMs run on the weights alone into per-row accumulators, scaled by each
row's alpha once the unit is reduced.

Batch-invariant mode: the blocks come from planner.plan_invariant and the tiler pads each to the
plan's rows; per-token tensors handed to the head are padded the same way (`Block.pad`), so that
a token's statistics never depend on the rest of the call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend
from .._math import acc_dtype
from .planner import _MIN_ROWS, Plan, plan_chunks, plan_invariant, resolve_budget
from .tiler import Tiler


def plan_rows(
    hidden: Tensor, V: int, logits_dtype: str, max_chunk_bytes: int, share: int = 1, fused=True
) -> Plan:
    """The row plan with whole-vocabulary tiles (at least one row per block) within 1 / share of
    the budget (share tiles side by side); in batch-invariant mode plan_invariant (the call's N
    and max_chunk_bytes play no part). fused=False: input-dtype tiles get a float32 copy (the
    per-chunk tile kernels of a vocabulary shard)."""
    N, H = hidden.shape
    dt, dev = hidden.dtype, hidden.device
    if _backend.invariant():
        p = plan_invariant(V, H, dt, dev.type, "rows", logits_dtype, fused, budget_share=share)
    else:
        budget = max(1, resolve_budget(max_chunk_bytes, dev) // share)
        p = plan_chunks(N, V, H, dt, dev.type, budget, "rows", logits_dtype, fused=fused)
    return p if p.vocab == V else dataclasses.replace(p, vocab=V)


def fused_backend(hidden, backend: str) -> str | None:
    """The backend ("cpp" or "triton") whose token_logprobs kernels reduce whole-vocabulary tiles
    in one pass each when the op runs on `backend`, or None: the per-chunk tile kernels do (eager,
    float64)."""
    if hidden.dtype == torch.float64:
        return None
    if backend == "triton":
        return backend
    if backend == "cpp" and _backend.has_compiled_kernel("token_logprobs_fwd", hidden.device.type):
        return backend
    return None


def pad_to(t: Tensor | None, n: int) -> Tensor | None:
    """t with its leading dimension zero-padded to n rows (batch-invariant mode)."""
    if t is None or t.shape[0] == n:
        return t
    out = t.new_zeros((n,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


class WholeVocab:
    """The reduction of a tile that holds the whole vocabulary: the token_logprobs kernels give
    the row statistics and turn the tile into its gradient; the full_kl kernels give the exact KL
    against a reference tile and its gradient. The kernels are handed in by the registered op
    (`tl`: token_logprobs' forward / backward; `ref`: what a reference (or teacher) tile beside
    the policy tile gives -- `fwd(z, zr, labels) -> tuple of per-row tensors` and
    `bwd(g, z, zr, stats, out) -> out`, the policy tile's gradient of `g * stats[0]` per row,
    or None when the reference tile adds no gradient). A vocabulary shard's reduction (the
    vocab-parallel form) overrides `stats` and `grad`."""

    fused = True  # the fused whole-vocabulary kernels reduce the tiles (planned as such)
    partial = False  # grad_hidden is a partial sum (reduced by the caller, kept in float32)
    start = 0  # the tile's first column's id (a vocabulary slice's)
    rows = None  # the plan's rows per block (a shard: the rows common to every rank)

    def __init__(self, backend: str, temperature: float, ignore_index: int, tl, ref=None):
        self.backend, self.inv_t, self.ii = backend, 1.0 / temperature, ignore_index
        self.fwd, self.bwd = tl
        self.ref_fwd, self.ref_bwd = ref if ref is not None else (None, None)
        self.z = self.zr = None

    @property
    def tiler_fused(self):
        """What the Tiler is told of the kernels that reduce its whole-vocabulary tiles."""
        return self.backend if self.fused else False

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        """The block's tile (and the reference tile), kept for block_grad, and `stats`."""
        V = tiler.W.shape[0]
        self.z = tiler.logits(hc, 0, V)
        self.zr = rtiler.logits(rtiler.rows(r0, r1), 0, V) if rtiler is not None else None
        return self.stats(tiler, self.z, self.zr, lc, with_entropy)

    def release(self):
        """Drops the tiles kept for block_grad: views of a Tiler's buffer, they would keep it
        alive after the run (a run without gradient never consumes them)."""
        self.z = self.zr = None

    def stats(self, tiler, z, zr, lc, with_entropy):
        """(logprobs, entropy, lse, the reference tile's statistics or None) of a row block from
        its logits tile z (and the reference head's zr, or None)."""
        lp, ent, lse = self.fwd(z, lc, self.inv_t, self.ii, with_entropy)
        return lp, ent, lse, (None if zr is None else self.ref_fwd(z, zr, lc))

    def block_grad(self, tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb):
        """The block's gradient tile from the coefficients (glp, gent, g_full[, g_lse]) and the
        statistics st (lp, ent, lse, klt), multiplied into ghc, gW, gb. The tile of block_stats
        is consumed (or computed here when the statistics were given). g_lse: dL/dlse of the
        whole vocabulary's log-sum-exp (the z-loss), through lse = z_label - lp: a log-prob
        term less and the label's own logit."""
        glp, gent, g_full, *rest = coefs
        g_lse = rest[0] if rest else None
        if g_lse is not None:
            glp = glp - g_lse
        _, ent, lse, klt = st
        z, zr = self.z, self.zr
        self.z = self.zr = None
        if z is None:
            z = tiler.logits(hc, 0, tiler.W.shape[0])
        gk = None
        if g_full is not None:
            gk = self.ref_bwd(g_full, z, zr, klt, gk_buf[: z.numel()].view(z.shape))
        tiler.softcap_grad(z)
        g = self.grad(tiler, z, glp, gent, lc, lse, ent, gk is None and g_lse is None)
        if gk is not None:
            g += gk
        if g_lse is not None:
            self.label_grad(g, lc, g_lse)
        tiler.apply_softcap_grad(g)
        tiler.grad_matmuls(g, hc, 0, z.shape[1], ghc, gW, gb)

    def label_grad(self, g, lc, g_label):
        """Adds d(sum(g_label * z_label)) / dx to the gradient tile g: g_label / T at each row's
        label (z = x / T: the label's own tempered logit, e.g. lse = z_label - lp, the z-loss);
        nothing on rows without a label, or whose label is not among the tile's columns
        [start, start + width) (a vocabulary slice's)."""
        if g.shape[1] == 0:  # an empty slice holds no label
            return
        y = lc.long() - self.start
        owned = (lc != self.ii) & (y >= 0) & (y < g.shape[1])
        c = torch.where(owned, g_label * self.label_inv_t(g_label), torch.zeros_like(g_label))
        g.scatter_add_(1, torch.where(owned, y, 0).unsqueeze(-1), c.to(g.dtype).unsqueeze(-1))

    def label_inv_t(self, like):
        """1 / T of the block's rows for label_grad (a float, or per row like `like`)."""
        return self.inv_t

    def grad(self, tiler, z, glp, gent, lc, lse, ent, alone):
        """The tile's gradient d(sum(glp * lp + gent * ent)) / dz (z is consumed); alone: no
        other term is added to it (Triton may then round it to the input dtype as it stores)."""
        g = tiler.grad_tile(z, rounds_on_store=self.backend == "triton" and alone)
        self.bwd(z, glp, gent, lc, lse, ent if gent is not None else lse, self.inv_t, self.ii, g)
        return g


def add_softmax_grad(g, z, g_lse, lse, inv_t, sub_rows=8):
    """g += g_lse exp(z / T - lse) / T row by row (inv_t: 1 / T, a float or per row): the
    untruncated softmax's term of dL/dlse, the whole vocabulary's log-sum-exp (the z-loss), for
    the sampler's reductions, whose backward forms q on the kept set only. A few rows at a time:
    a float32 temporary of sub_rows rows."""
    it = torch.full_like(lse, inv_t) if not isinstance(inv_t, Tensor) else inv_t.to(lse.dtype)
    c = g_lse * it
    lse = torch.where(c != 0, lse, float("inf"))  # rows without the term (an ignored label's
    # lse is 0): exp(-inf) = 0, never inf * 0
    for s0 in range(0, z.shape[0], sub_rows):
        s1 = min(z.shape[0], s0 + sub_rows)
        t = torch.addcmul(-lse[s0:s1, None], z[s0:s1], it[s0:s1, None]).exp_()  # (acc dtype)
        g[s0:s1].addcmul_(t, c[s0:s1, None])


class LseBySoftmax:
    """For a sampler's reduction (before WholeVocab in the bases): the head's fourth coefficient
    dL/dlse is kept with the block's lse (the statistics' third, the whole vocabulary's when the
    reduction is told so) for `grad`, which adds it by add_softmax_grad, instead of WholeVocab's
    route through the label (lse = z_label - lp holds for the untruncated softmax only)."""

    g_lse = None  # (dL/dlse, lse) of the block, or None

    def block_grad(self, tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb):
        glp, gent, g_full, *rest = coefs
        self.g_lse = (rest[0], st[2]) if rest else None
        super().block_grad(tiler, hc, lc, (glp, gent, g_full), st, gk_buf, ghc, gW, gb)


class SamplerVocab(LseBySoftmax, WholeVocab):
    """The whole-vocabulary reduction under a rollout sampler's distribution: each tile is reduced
    by token_logprobs' sampler kernels (`tl`: forward / backward of one backend) with the per-row
    parameters of its rows (`at_block` slices them), and its gradient goes through the kept set
    only. The forward's extra outputs (the kept set (cut, cut_index), `outside` and the head's
    statistics) are written into `outs` [N] (`extra`: the kernels' flags); the backward takes the
    kept set of the forward (`kept`: (cut, cut_index) [N]), or, in a loop that forms the gradient
    in its forward (a fused loss), that of the block's own forward. Only whole-vocabulary tiles: a
    top-k / top-p selection needs the whole row. The kernels write the gradient into a tile of its
    own (gbuf): the CPU kernel reads the logits again after writing a row.

    saved: (logprobs, entropy, lse) [N] buffers for a two-pass loop (`outs` then holds the kept
    set's [N] buffers): the first pass stores each block's statistics (entropy included) and its
    kept set, and the second reuses them (`after_first_pass`) -- it runs no sampler forward, and
    computes a tile only for the gradient.

    full_lse: an [N] buffer for the whole vocabulary's log-sum-exp (the z-loss), or None. With
    it the block's statistics carry that lse (the kernels' `with_lse`) in place of the kept
    set's, which only the gradient reads, and a fourth coefficient dL/dlse adds
    g_lse p / T to the gradient tile (p the untruncated softmax of the tempered logits: the
    sampler's kernels form only q on the kept set)."""

    def __init__(self, backend, inv_t, params, sampler, ignore_index, tl, extra=None,
                 outs=None, kept=None, gbuf=None, saved=None, full_lse=None):  # fmt: skip
        super().__init__(backend, 1.0, ignore_index, tl)
        self.inv_t = inv_t
        self.params = params  # (inv_ts, top_k, top_ks, top_p, top_ps, min_p, min_ps): tensors [N]
        extra = extra or (False, False, 0, False)
        if full_lse is not None:
            extra = (extra[0], True, *extra[2:])
        self.sampler, self.extra, self.outs, self.kept, self.gbuf = (
            sampler, extra, outs or (), kept, gbuf
        )  # fmt: skip
        self.saved, self.reuse, self.full_lse = saved, False, full_lse
        self.blk = self.blk_kept = self.blk_lse = None

    @property
    def tiler_fused(self):
        return self.backend  # the sampler kernels read input-dtype tiles themselves

    def at_block(self, r0, r1, pad):
        """The per-row parameters (and saved kept set) of rows r0:r1, padded as the tile."""
        inv_ts, k, ks, p, ps, mp, mps = self.params

        def rows(t, fill):
            return None if t is None else pad(t[r0:r1], fill)

        kept = None
        if self.kept is not None:
            kept = (rows(self.kept[0], 0.0), rows(self.kept[1], 0))
        self.blk = (r0, r1, rows(inv_ts, 1.0), rows(ks, 0), rows(ps, 1.0), rows(mps, 0.0), kept)
        self.pad = pad

    def after_first_pass(self):
        """The engine's hook between the passes: the second pass reuses the first's statistics
        and kept set (with `saved`)."""
        if self.saved is not None:
            self.reuse = True
            self.kept = (self.outs[0], self.outs[1])

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        if self.reuse:  # the first pass's statistics; block_grad computes the tile if needed
            self.z = self.zr = None
            return self.stats(tiler, None, None, lc, with_entropy)
        return super().block_stats(tiler, hc, rtiler, r0, r1, lc, with_entropy)

    def stats(self, tiler, z, zr, lc, with_entropy):
        r0, r1, inv_ts, ks, ps, mps, _ = self.blk
        n = r1 - r0
        if self.reuse:
            lp, ent, self.blk_lse = (self.pad(t[r0:r1]) for t in self.saved)
            full = None if self.full_lse is None else self.pad(self.full_lse[r0:r1])
            return lp, ent, self.blk_lse if full is None else full, None
        _, k, _, p, _, mp, _ = self.params
        outs = self.fwd(
            z, lc, self.inv_t, inv_ts, k, ks, p, ps, mp, mps, self.sampler, self.ii,
            with_entropy or self.saved is not None, *self.extra,
        )  # fmt: skip
        for i, o in enumerate(self.outs):  # cut, cut_index, outside, then the statistics
            if o is not None and o.numel() > 0:
                o[r0:r1] = outs[3 + i][:n]
        if self.saved is not None:
            for buf, o in zip(self.saved, outs[:3]):
                buf[r0:r1] = o[:n]
        self.blk_kept = (outs[3], outs[4])  # the block's kept set, for its gradient
        self.blk_lse = outs[2]
        if self.full_lse is None:
            return outs[0], outs[1], outs[2], None
        self.full_lse[r0:r1] = outs[7][:n]  # (for a second pass)
        return outs[0], outs[1], outs[7], None

    def grad(self, tiler, z, glp, gent, lc, lse, ent, alone):
        _, _, inv_ts, _, _, _, kept = self.blk
        cut, cut_index = kept if kept is not None else self.blk_kept
        g = self.gbuf[: z.numel()].view(z.shape)
        # the kept set's lse (with full_lse the statistics carry the whole vocabulary's)
        lse_k = lse if self.full_lse is None else self.blk_lse
        self.bwd(
            z, glp, gent, lc, lse_k, ent if gent is not None else lse_k, cut, cut_index,
            self.inv_t, inv_ts, self.ii, g,
        )  # fmt: skip
        if self.g_lse is not None:
            add_softmax_grad(g, z, *self.g_lse, self.inv_t if inv_ts is None else inv_ts)
        return g


def sampler_kernels(hidden, backend):
    """The backend whose token_logprobs sampler kernels reduce the tiles of an op running on
    `backend`: cpp / triton where they run, else (float64, no compiled kernels) eager."""
    if hidden.dtype == torch.float64 or fused_backend(hidden, backend) is None:
        return "eager"
    return backend


def sampler_plan(hidden, V, max_chunk_bytes, logits_dtype):
    """Whole-vocabulary row blocks within half the budget (the sampler's gradient tile sits beside
    the logits tile): as many rows as fit, at least one, else a ValueError naming max_chunk_bytes.
    A forward and its backward plan alike (the same blocks)."""
    N, H = hidden.shape
    dt, dev = hidden.dtype, hidden.device
    if _backend.invariant():
        p = plan_invariant(V, H, dt, dev.type, "rows", logits_dtype, True, budget_share=2)
        if p.vocab == V:
            return p
        budget = resolve_budget(0, dev)
    else:
        budget = resolve_budget(max_chunk_bytes, dev)
        half = max(1, budget // 2)
        for n in (N, *range(min(N, _MIN_ROWS) - 1, 0, -1)):
            p = plan_chunks(n, V, H, dt, dev.type, half, "rows", logits_dtype, fused=True)
            if p.vocab == V:
                return p
    raise ValueError(
        f"max_chunk_bytes: {budget} bytes cannot hold one row's whole-vocabulary logits tile "
        f"(V = {V}, H = {H}, twice: the tile and its gradient); the sampler's options "
        "(temperature tensor, top_k, top_p, min_p) and the head's statistics need whole rows. "
        "Give a larger max_chunk_bytes."
    )


def sampler_params(shape, dev, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps):
    """The per-row parameters as the kernels take them: (1 / temperatures, top_k, top_ks, top_p,
    top_ps, min_p, min_ps), each tensor [N] float64 / int64 or None (the scalar holds). A tensor's
    shape is a leading part of `shape` (the op's labels, N tokens): it is broadcast over the
    rest."""
    N = math.prod(shape)

    def flat(t, dtype):
        if t is None:
            return None
        t = t.to(dtype)
        t = t.reshape(tuple(t.shape) + (1,) * (len(shape) - t.dim()))
        return t.expand(shape).reshape(N).contiguous()

    f64, i64 = torch.float64, torch.int64
    inv_ts = None if temperatures is None else flat(1.0 / temperatures.to(f64), f64)
    return (inv_ts, top_k, flat(top_ks, i64), top_p, flat(top_ps, f64), min_p, flat(min_ps, f64))


class Block(NamedTuple):
    """One row block as a head term sees it: rows r0:r1 of the call and its tokens' statistics,
    padded to the tile's rows in batch-invariant mode (`pad` pads a per-token tensor alike)."""

    r0: int
    r1: int
    lp: Tensor
    ent: Tensor
    lse: Tensor  # of the whole vocabulary (the distribution's own normaliser for a sampler's)
    kl: tuple | None  # (kl, lse_z, lse_w) against the reference head
    pad: object


class HeadTerm:
    """What a fused-linear loss adds to the loop (these defaults: no loss, one pass, every block
    as the planner cut it). A subclass overrides:

    - `step(rows, T)`: rows per block of the one-pass loop (e.g. whole sequences of T tokens);
    - `passes(rows, T)`: 2 when a coefficient needs statistics beyond a block;
    - `after_first_pass(lp)`: with every token's log-prob (flat [N]), before the second pass;
    - `coefficients(block)`: the block's (dL/dlogprob, dL/dentropy, dL/dKL) per token, each a
      tensor of the block's (padded) rows or None, after storing what the loss reports;
      the gradient tile follows from them. A fourth, dL/dlse (the whole vocabulary's
      log-sum-exp of the tempered logits: the z-loss), is taken by the whole-vocabulary
      reductions (`WholeVocab`, `SamplerVocab` told `full_lse`);
    - `with_entropy`: whether the reduction computes the entropy;
    - `given(r0, r1, pad)`: (entropy, lse) of a block known before the loop (a backward of saved
      statistics: no reduction runs), or None (the default: the reduction computes them).
    """

    with_entropy = True

    def given(self, r0: int, r1: int, pad):
        return None

    def step(self, rows: int, T: int) -> int:
        return rows

    def passes(self, rows: int, T: int) -> int:
        return 1

    def after_first_pass(self, lp: Tensor) -> None:
        pass

    def coefficients(self, block: Block):
        return None, None, None


class StoreStats(HeadTerm):
    """linear_token_logprobs' forward: each token's statistics stored, no gradient."""

    def __init__(self, with_entropy: bool):
        self.with_entropy = with_entropy


class GivenGrads(HeadTerm):
    """A backward of saved statistics (lse, entropy [N]): the coefficients are given gradients
    (dL/dlogprob, dL/dentropy [N] or None), as linear_token_logprobs' backward has them."""

    def __init__(self, grad_logprobs, grad_entropy, lse, entropy):
        self.glp, self.gent, self.lse, self.ent = grad_logprobs, grad_entropy, lse, entropy

    def given(self, r0, r1, pad):
        return (None if self.gent is None else pad(self.ent[r0:r1])), pad(self.lse[r0:r1])

    def coefficients(self, blk):
        r0, r1, pad = blk.r0, blk.r1, blk.pad
        gent = None if self.gent is None else pad(self.gent[r0:r1])
        return pad(self.glp[r0:r1]), gent, None


@dataclasses.dataclass
class Head:
    """The LM head of one call: hidden [N, H], weight [V, H], bias [V] or None, labels [N]
    (flat), and the tokens per sequence (rows are sequences of T tokens)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    labels: Tensor
    T: int = 1
    # the order the loop walks the rows in (int64 [N], a permutation), or None: 0..N-1. A loss
    # whose coefficient ties rows that are far apart (a preference pair: chosen row i, rejected
    # row i + P) walks them side by side; the block positions r0:r1 the head term sees are
    # positions in this order, the hidden gradient rows are put back in place.
    order: Tensor | None = None


def _setup(lm: Head, vocab, plan: Plan, need, softcap):
    """A loop's (need, the gradients (empty tensors where not needed; grad_hidden in hidden's
    dtype, or float32 partial sums when the reduction says so), the labels in walk order, the
    Tiler)."""
    hidden, weight, bias = lm.hidden, lm.weight, lm.bias
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    acc = acc_dtype(hidden.dtype)
    need_h, need_w, need_b = need
    need_b = need_b and bias is not None
    gh_dtype = acc if vocab.partial else hidden.dtype
    gh_out = _backend.new_output((N, H) if need_h else (0,), gh_dtype, dev)
    gW = torch.zeros((V, H) if need_w else (0,), dtype=acc, device=dev)
    gb = torch.zeros((V,) if need_b else (0,), dtype=acc, device=dev)
    labels = lm.labels if lm.order is None else lm.labels[lm.order]
    tiler = Tiler(
        hidden, weight, bias, plan, vocab.tiler_fused, backward=need_h or need_w or need_b,
        softcap=softcap, order=lm.order,
    )  # fmt: skip
    return (need_h, need_w, need_b), (gh_out, gW, gb), labels, tiler


def run(
    head: HeadTerm,
    vocab,
    lm: Head,
    plan: Plan,
    *,
    ref: tuple | None = None,
    ref_plan: Plan | None = None,
    softcap: float | None = None,
    need: tuple[bool, bool, bool] = (False, False, False),
    lp_out: Tensor | None = None,
    ent_out: Tensor | None = None,
    lse_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The loop over row blocks of `plan`: per block the tile(s) and their statistics (stored
    into lp_out / ent_out / lse_out, flat [N] views, where given), the head term's
    coefficients, the gradient tile and its GEMMs (`vocab`: the reduction, `WholeVocab` or
    vocab_chunks.VocabChunks). ref: (ref_hidden, ref_weight, ref_bias) of the reference head,
    planned by ref_plan (its tile beside the policy tile, no gradient), or None. need: which of
    grad_hidden, grad_weight, grad_bias to form. Returns them (empty tensors where not needed;
    grad_hidden in hidden's dtype, or float32 partial sums when the reduction says so;
    grad_weight / grad_bias float32)."""
    hidden, weight = lm.hidden, lm.weight
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    acc = acc_dtype(hidden.dtype)
    (need_h, need_w, need_b), (gh_out, gW, gb), labels, tiler = _setup(
        lm, vocab, plan, need, softcap
    )
    any_grad = need_h or need_w or need_b
    order = lm.order
    pad = tiler.pad  # batch-invariant mode: per-token tensors of a block to the tile's rows
    rtiler = gk_buf = None
    if ref is not None:
        rtiler = Tiler(*ref, ref_plan, vocab.backend, softcap=softcap, order=order)
        # the reference tile's gradient term (none when it only gives statistics)
        ref_grad = any_grad and getattr(vocab, "ref_bwd", None) is not None
        gk_buf = torch.empty(
            tiler.max_rows * V if ref_grad else 0,
            dtype=tiler.buf_in.dtype if plan.input_tiles else acc,
            device=dev,
        )
    ii = vocab.ii
    gh = torch.empty((tiler.max_rows, H) if need_h else (0,), dtype=acc, device=dev)
    T = lm.T
    at_block = getattr(vocab, "at_block", None)  # a reduction with per-row parameters
    two_pass = head.passes(plan.rows, T) == 2
    if two_pass:
        # first pass: the log-probs of every row (one GEMM per block), then every coefficient
        for r0 in range(0, N, plan.rows):
            r1 = min(N, r0 + plan.rows)
            if at_block is not None:
                at_block(r0, r1, pad)
            hc, lc = tiler.rows(r0, r1), pad(labels[r0:r1], ii)
            lp_out[r0:r1] = vocab.block_stats(tiler, hc, None, r0, r1, lc, False)[0][: r1 - r0]
        if hasattr(vocab, "after_first_pass"):
            vocab.after_first_pass()
        head.after_first_pass(lp_out)
        step = plan.rows
    else:
        step = head.step(plan.rows, T)

    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        n = r1 - r0
        if at_block is not None:
            at_block(r0, r1, pad)
        # (in batch-invariant mode every per-token tensor below has the tile's rows: padded)
        hc, lc = tiler.rows(r0, r1), pad(labels[r0:r1], ii)
        given = head.given(r0, r1, pad)
        if given is None:
            st = vocab.block_stats(tiler, hc, rtiler, r0, r1, lc, head.with_entropy)
            lp, ent, lse, _ = st
            if ent_out is not None:
                ent_out[r0:r1] = ent[:n]
            if lse_out is not None:
                lse_out[r0:r1] = lse[:n]
            if two_pass:
                lp = pad(lp_out[r0:r1])  # the first pass's (the same rows: the same values)
                st = (lp, *st[1:])
            elif lp_out is not None:
                lp_out[r0:r1] = lp[:n]
        else:
            st = (None, *given, None)
        coefs = head.coefficients(Block(r0, r1, *st, pad))
        if not any_grad:
            continue
        ghc = gh[: hc.shape[0]].zero_() if need_h else gh
        vocab.block_grad(tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb)
        if need_h:
            if order is None:
                gh_out[r0:r1] = ghc[:n]
            else:
                gh_out.index_copy_(0, order[r0:r1], ghc[:n].to(gh_out.dtype))
    if isinstance(vocab, WholeVocab):
        vocab.release()
    return gh_out, gW, gb


def run_units(
    head: HeadTerm,
    vocab: WholeVocab,
    lm: Head,
    plan: Plan,
    unit: int,
    weights: Tensor,
    *,
    softcap: float | None = None,
    need: tuple[bool, bool, bool] = (False, False, False),
    lp_out: Tensor,
    ent_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """run's loop for a head whose units (`unit` consecutive tokens: whole rows of lm.T tokens,
    e.g. a pair's two completions) are longer than a block, and whose coefficients within a row
    are one scalar times known token weights: dL/dlogprob_t = alpha_row * weights_t (flat [N],
    walk order), alpha known only once the whole unit is reduced. Each block of a row makes its
    gradient tile from the weights alone; its GEMMs go into that row's accumulators (grad_weight
    [V, H] and grad_bias [V] per row of the unit, grad_hidden unscaled); at the unit's end
    head.coefficients gives the coefficients, each row's alpha is read at its first weighted
    token, and the accumulators are scaled into the gradients. So the tile never holds a whole
    unit and no GEMM is repeated (3 GEMMs, not a first pass's 4), at the memory of the per-row
    accumulators. No reference tile beside (its pass runs first), no batch-invariant padding, no
    entropy coefficient."""
    hidden, weight = lm.hidden, lm.weight
    N, H = hidden.shape
    V = weight.shape[0]
    T = lm.T
    dev = hidden.device
    acc = acc_dtype(hidden.dtype)
    (need_h, need_w, need_b), (gh_out, gW, gb), labels, tiler = _setup(
        lm, vocab, plan, need, softcap
    )
    any_grad = need_h or need_w or need_b
    order = lm.order
    per = unit // T  # rows per unit
    slot_w = torch.empty((per, V, H) if need_w else (per, 0), dtype=acc, device=dev)
    slot_b = torch.empty((per, V) if need_b else (per, 0), dtype=acc, device=dev)
    gh = torch.empty((unit, H) if need_h else (0,), dtype=acc, device=dev)

    def same(t, fill=0):
        return t

    for u0 in range(0, N, unit):
        u1 = min(N, u0 + unit)
        for j, q0 in enumerate(range(u0, u1, T)):  # a row of the unit, in blocks of plan.rows
            if need_w:
                slot_w[j].zero_()
            if need_b:
                slot_b[j].zero_()
            for r0 in range(q0, q0 + T, plan.rows):
                r1 = min(q0 + T, r0 + plan.rows)
                hc, lc = tiler.rows(r0, r1), labels[r0:r1]
                st = vocab.block_stats(tiler, hc, None, r0, r1, lc, head.with_entropy)
                lp_out[r0:r1] = st[0]
                if ent_out is not None:
                    ent_out[r0:r1] = st[1]
                if not any_grad:
                    continue
                ghc = gh[r0 - u0 : r1 - u0].zero_() if need_h else gh
                w = weights[r0:r1].to(acc)
                vocab.block_grad(tiler, hc, lc, (w, None, None), st, None, ghc, slot_w[j],
                                 slot_b[j])  # fmt: skip
        blk = Block(u0, u1, lp_out[u0:u1], None, None, None, same)
        coef = head.coefficients(blk)[0].view(-1, T)
        if not any_grad:
            continue
        w = weights[u0:u1].view(-1, T)
        first = (w != 0).to(torch.int8).argmax(-1, keepdim=True)  # 0 for a row without any
        alpha = (coef.gather(-1, first) / w.gather(-1, first).to(acc)).squeeze(-1)
        alpha = torch.where(torch.isfinite(alpha), alpha, torch.zeros_like(alpha))
        rows = u1 - u0
        if need_h:
            ghu = (gh[:rows].view(-1, T, H) * alpha.view(-1, 1, 1)).view(rows, H)
            if order is None:
                gh_out[u0:u1] = ghu
            else:
                gh_out.index_copy_(0, order[u0:u1], ghu.to(gh_out.dtype))
        for j in range(rows // T):
            if need_w:
                gW.addcmul_(slot_w[j], alpha[j])
            if need_b:
                gb.addcmul_(slot_b[j], alpha[j])
    vocab.release()
    return gh_out, gW, gb
