"""Vocab-parallel token_logprobs under the rollout sampler's distribution (top_k, top_p, min_p,
sampler="vllm" | "sglang"; docs/ppo-math.md, "The distribution the rollout sampled from"): each
rank holds a contiguous slice of the vocabulary (Megatron's layout, as
vocab_parallel_token_logprobs.py), labels are global ids, and every rank gets the log-prob and
entropy under the kept set K of the whole row, exactly as the single-device op on the gathered
logits (up to float32 rounding at a cut).

The rank order is by logit, ties by global token id; a kept set is a cut in it. The forward finds
each row's cut with a FIXED number of collectives (torch.compile traces them), whatever the data:

1. one all-gather of each rank's row maxima (behind the layout header, as the plain form's
   gather): the global max M, so every rank measures masses exp((x - M) / T) alike. min-p is then
   local: (x - M) / T >= log(min_p).
2. top-k and top-p by a radix selection over order-preserving integer keys of the logits (32 bits
   in float32, 64 in float64): per round, a histogram [N, 256] of the next 8 bits among the keys
   that match the bits found so far, summed over the ranks by one all-reduce (counts for top-k,
   masses for top-p), and every rank picks the same bucket. 4 rounds (8 for float64) give the
   exact key of the cut and the weight strictly above it. vLLM: top-k on min-p's set (every tie
   of the k-th value), then top-p on that set renormalised (a tie group kept or dropped whole).
   SGLang: each filter on the whole distribution; its cuts keep tied tokens by id, so how many of
   the cut's ties each rank keeps comes from one all-gather of the per-rank tie counts (ranks hold
   increasing ids in the order of their starts).
3. one all-reduce of the kept set's per-row sums (mass, mass times z, mass squared, the whole
   row's mass, the label's z and flags from the rank that owns the label), then the finish.
4. the top-k statistics, when asked: one all-gather of each rank's first k tokens in rank order
   (logit, global id, log q), merged.

The backward is elementwise on each slice given the kept set, the log-normaliser and the entropy
(no collective): (g_lp (onehot - q) - g_ent q (log q + H)) / T on K, 0 outside, no log-prob term
when the label is outside K. Local work runs in registered ops on row blocks of bounded size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._checks import FLOAT_DTYPES, INDEX_DTYPES, check_arg, check_devices, check_tensor
from .._math import acc_dtype
from ._comm import all_gather as _all_gather
from ._comm import all_reduce_, check_same_sizes, cross_checks
from .vocab_layout import (
    HEADER,
    check_layout,
    check_layout_device,
    gather_settled,
    layout_ints,
    resolve_vocab_start,
)
from .vocab_states import row_blocks, row_inverse

BUCKETS = 256  # 8 bits of a key per round
NO_CUT = -(2**63)  # a key below every key: the cut of a row whose option is off
SUMS = 8  # mass, mass * z, mass^2 (the kept set), the row's mass, z_label, in K, owned, argmax


def _bits(dtype) -> int:
    return 64 if dtype == torch.float64 else 32


def keys(x: Tensor) -> Tensor:
    """int64 keys whose order is the order of the float values x (float32: the 32-bit key in an
    int64; float64: 64 bits); -0.0 and +0.0 share a key."""
    x = x + 0.0  # -0.0 -> +0.0
    if x.dtype == torch.float64:
        b = x.view(torch.int64)
        return torch.where(b < 0, b ^ 0x7FFFFFFFFFFFFFFF, b)
    b = x.view(torch.int32).to(torch.int64)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def key_values(k: Tensor, dtype) -> Tensor:
    """The float values of keys (the inverse of `keys`)."""
    if dtype == torch.float64:
        return torch.where(k < 0, k ^ 0x7FFFFFFFFFFFFFFF, k).view(torch.float64)
    b = torch.where(k < 0, k ^ 0x7FFFFFFF, k).to(torch.int32)
    return b.view(torch.float32)


def rows_of(logits: Tensor) -> Tensor:
    """logits [..., V_rank] as [N, V_rank] (V_rank may be 0)."""
    return logits.reshape(logits.shape[:-1].numel(), logits.shape[-1])


def _check_rows(name, t, n, dev, dtypes):
    check_arg(name, t, dev, like="logits", dtypes=dtypes, shape=(n,), what="one per row")


def check_cut(logits, m, inv_ts, lmp, cut, allow=None, cut_name="cut"):
    """The per-row tensors of the kept set (one per row of logits); cut_name: the op's name of
    the cut."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    n, dev, acc = rows_of(logits).shape[0], logits.device, (acc_dtype(logits.dtype),)
    for name, t in (("m", m), ("inv_ts", inv_ts), ("lmp", lmp)):
        _check_rows(name, t, n, dev, acc)
    _check_rows(cut_name, cut, n, dev, (torch.int64,))
    if allow is not None:
        _check_rows("allow", allow, n, dev, (torch.float64,))


def kept_mask(x, m, inv_ts, lmp, cut, allow):
    """(z - max z, kept) of a row block x [n, V_rank] in the accumulation dtype: kept where
    min-p keeps the token and it lies above the cut, or on it within the first `allow` of the
    cut's ties on this slice (by id)."""
    z = (x - m.unsqueeze(-1)) * inv_ts.unsqueeze(-1)
    k = keys(x)
    c = cut.unsqueeze(-1)
    tie = k == c
    before = (tie.cumsum(-1) - 1).to(torch.float64)
    kept = (z >= lmp.unsqueeze(-1)) & ((k > c) | (tie & (before < allow.unsqueeze(-1))))
    return z, kept


# ---- the registered ops of the local work (fake kernels: torch.compile traces the form) ----


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_max", mutates_args=())
def _max_op(logits: Tensor, labels: Tensor) -> Tensor:
    """Each row's max of this rank's slice [N] (accumulation dtype; -inf for an empty slice, NaN
    where a logit is NaN); labels (logits.shape[:-1]) only checked, before any collective."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg("labels", labels, logits.device, like="logits", dtypes=INDEX_DTYPES,
              shape=logits.shape[:-1])  # fmt: skip
    x = rows_of(logits)
    acc = acc_dtype(logits.dtype)
    if x.shape[1] == 0:
        return torch.full((x.shape[0],), float("-inf"), dtype=acc, device=x.device)
    return x.amax(-1).to(acc)


@_max_op.register_fake
def _(logits, labels):
    check_devices("logits", logits, labels=labels)
    return logits.new_empty((rows_of(logits).shape[0],), dtype=acc_dtype(logits.dtype))


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_hist", mutates_args=())
def _hist_op(
    logits: Tensor,
    m: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    floor: Tensor,
    prefix: Tensor,
    shift: int,
    first: bool,
    mass: bool,
) -> Tensor:
    """[N, 256] float64: per row, the count (or, with `mass`, the sum of exp((x - m) / T)) of the
    candidates whose key matches `prefix` above bit shift + 8, by the 8 bits at `shift` (first:
    the top bits, signed, so no prefix). Candidates: min-p keeps them ((x - m) / T >= lmp) and
    their key is >= floor."""
    check_cut(logits, m, inv_ts, lmp, floor, cut_name="floor")
    _check_rows("prefix", prefix, m.shape[0], logits.device, (torch.int64,))
    x = rows_of(logits)
    N, V = x.shape
    acc = acc_dtype(logits.dtype)
    out = torch.zeros((N, BUCKETS), dtype=torch.float64, device=x.device)
    if V == 0:
        return out
    starts, rows = row_blocks(N, V, acc)
    for r0 in starts:
        r1 = min(N, r0 + rows)
        xb = x[r0:r1].to(acc)
        z = (xb - m[r0:r1].unsqueeze(-1)) * inv_ts[r0:r1].unsqueeze(-1)
        k = keys(xb)
        on = (z >= lmp[r0:r1].unsqueeze(-1)) & (k >= floor[r0:r1].unsqueeze(-1))
        if first:
            digit = (k >> shift) + BUCKETS // 2
        else:
            digit = (k >> shift) & (BUCKETS - 1)
            on &= (k >> (shift + 8)) == prefix[r0:r1].unsqueeze(-1)
        w = z.exp().to(torch.float64) if mass else torch.ones_like(z, dtype=torch.float64)
        out[r0:r1].scatter_add_(1, digit, torch.where(on, w, torch.zeros_like(w)))
    return out


@_hist_op.register_fake
def _(logits, m, inv_ts, lmp, floor, prefix, shift, first, mass):
    check_devices("logits", logits, m=m, inv_ts=inv_ts, lmp=lmp, floor=floor, prefix=prefix)
    return logits.new_empty((rows_of(logits).shape[0], BUCKETS), dtype=torch.float64)


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_ties", mutates_args=())
def _ties_op(logits: Tensor, cut: Tensor) -> Tensor:
    """[N] float64: how many of this slice's logits have the cut's key (its ties)."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    x = rows_of(logits)
    _check_rows("cut", cut, x.shape[0], logits.device, (torch.int64,))
    N, V = x.shape
    acc = acc_dtype(logits.dtype)
    out = torch.zeros(N, dtype=torch.float64, device=x.device)
    starts, rows = row_blocks(N, V, acc)
    for r0 in starts if V else ():
        r1 = min(N, r0 + rows)
        k = keys(x[r0:r1].to(acc))
        out[r0:r1] = (k == cut[r0:r1].unsqueeze(-1)).sum(-1).to(torch.float64)
    return out


@_ties_op.register_fake
def _(logits, cut):
    check_devices("logits", logits, cut=cut)
    return logits.new_empty((rows_of(logits).shape[0],), dtype=torch.float64)


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_states", mutates_args=())
def _states_op(
    logits: Tensor,
    labels: Tensor,
    vocab_start: Tensor,
    m: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    cut: Tensor,
    allow: Tensor,
    ignore_index: int,
) -> Tensor:
    """[SUMS, N] sums of this slice over the kept set (kept_mask), z = (x - m) / T: sum exp(z),
    sum exp(z) z, sum exp(z)^2, the whole slice's sum exp(z), the label's z where this slice
    owns the label (0 elsewhere), 1.0 where it owns the label and keeps it, 1.0 where it owns
    it, 1.0 where it owns it and the label's logit is m. vocab_start: this slice's first id, a
    0-dim tensor (read on the device: no host sync)."""
    check_cut(logits, m, inv_ts, lmp, cut, allow)
    check_arg("vocab_start", vocab_start, logits.device, like="logits", dtypes=(torch.int64,),
              shape=())  # fmt: skip
    x = rows_of(logits)
    check_arg("labels", labels, logits.device, like="logits", dtypes=INDEX_DTYPES,
              shape=logits.shape[:-1])  # fmt: skip
    N, V = x.shape
    acc = acc_dtype(logits.dtype)
    out = torch.zeros((SUMS, N), dtype=acc, device=x.device)
    y = labels.reshape(-1).long() - vocab_start
    owned = (y >= 0) & (y < V) & (labels.reshape(-1) != ignore_index)
    out[6] = owned.to(acc)
    starts, rows = row_blocks(N, V, acc)
    for r0 in starts if V else ():
        r1 = min(N, r0 + rows)
        xb = x[r0:r1].to(acc)
        mb = m[r0:r1]
        z, kept = kept_mask(xb, mb, inv_ts[r0:r1], lmp[r0:r1], cut[r0:r1], allow[r0:r1])
        e = z.exp()
        ek = torch.where(kept, e, torch.zeros_like(e))
        out[0, r0:r1] = ek.sum(-1)
        out[1, r0:r1] = torch.where(ek > 0, ek * z, torch.zeros_like(z)).sum(-1)
        out[2, r0:r1] = (ek * ek).sum(-1)
        out[3, r0:r1] = e.sum(-1)
        yb, ob = y[r0:r1].clamp(0, V - 1).unsqueeze(-1), owned[r0:r1]
        zl = z.gather(-1, yb).squeeze(-1)
        out[4, r0:r1] = torch.where(ob, zl, torch.zeros_like(zl))
        out[5, r0:r1] = (ob & kept.gather(-1, yb).squeeze(-1)).to(acc)
        out[7, r0:r1] = (ob & (xb.gather(-1, yb).squeeze(-1) == mb)).to(acc)
    return out


@_states_op.register_fake
def _(logits, labels, vocab_start, m, inv_ts, lmp, cut, allow, ignore_index):
    check_devices(
        "logits", logits, labels=labels, vocab_start=vocab_start, m=m, inv_ts=inv_ts, lmp=lmp,
        cut=cut, allow=allow,
    )  # fmt: skip
    return logits.new_empty((SUMS, labels.numel()), dtype=acc_dtype(logits.dtype))


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_finish", mutates_args=())
def _finish_op(
    logits: Tensor,
    labels: Tensor,
    gathered: Tensor,
    sums: Tensor,
    m: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    cut: Tensor,
    allow: Tensor,
    rank: int,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, entropy, log-normaliser of K relative to m, outside, sum_p2, lse, is_argmax,
    layout), each with labels.shape (layout: int64 [2] on the CPU), from the gathered headers
    (checked: vocab_layout.check_layout) and the kept set's sums over every rank. logits and the
    kept set (m, inv_ts, lmp, cut, allow) are read only by the backward."""
    check_cut(logits, m, inv_ts, lmp, cut, allow)
    acc = acc_dtype(logits.dtype)
    dev = logits.device
    check_arg("labels", labels, dev, like="logits", dtypes=INDEX_DTYPES, shape=logits.shape[:-1])
    check_arg("gathered", gathered, dev, like="logits", dtypes=(acc,))
    check_arg("sums", sums, dev, like="logits", dtypes=(acc,), shape=(SUMS, labels.numel()))
    lab = labels.reshape(-1)
    starts, sizes, ok = check_layout(gathered, lab, rank, ignore_index, logits.shape[-1])
    V = sum(sizes)
    s, u, s2, s_all, zl, in_k, _, argmax = sums.unbind(0)
    bad = ~m.isfinite()
    ignored = lab == ignore_index
    valid = (lab >= 0) & (lab < V) & ~ignored
    if ok is not None:  # a header that disagrees with the validated layout: NaN rows
        valid &= ok
    nan = torch.full_like(s, float("nan"))
    log_s = s.log()
    kept = in_k > 0

    def finish(v):
        return torch.where(valid & ~bad, v, nan).masked_fill(ignored, 0.0).view(labels.shape)

    lp = finish(torch.where(kept, zl - log_s, torch.full_like(s, float("-inf"))))
    ent = finish(log_s - u / s)
    outside = (valid & ~bad & ~kept).view(labels.shape)
    sum_p2 = finish(s2 / (s * s))
    lse = torch.where(bad, nan, m * inv_ts + s_all.log()).masked_fill(ignored, 0.0)
    is_argmax = (valid & (argmax > 0)).view(labels.shape)
    layout = torch.tensor([starts[rank], V], dtype=torch.int64)
    return (
        lp,
        ent,
        log_s.view(labels.shape),
        outside,
        sum_p2,
        lse.view(labels.shape),
        is_argmax,
        layout,
    )


@_finish_op.register_fake
def _(logits, labels, gathered, sums, m, inv_ts, lmp, cut, allow, rank, ignore_index):
    check_devices(
        "logits", logits, labels=labels, gathered=gathered, sums=sums, m=m, inv_ts=inv_ts,
        lmp=lmp, cut=cut, allow=allow,
    )  # fmt: skip
    shape, acc = labels.shape, acc_dtype(logits.dtype)
    f = [logits.new_empty(shape, dtype=acc) for _ in range(5)]
    b = [logits.new_empty(shape, dtype=torch.bool) for _ in range(2)]
    return f[0], f[1], f[2], b[0], f[3], f[4], b[1], torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_topk", mutates_args=())
def _topk_op(
    logits: Tensor,
    vocab_start: Tensor,
    m: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    cut: Tensor,
    allow: Tensor,
    log_s: Tensor,
    k: int,
) -> Tensor:
    """This slice's candidates for the top-k statistics: float64 [N, k, 3] of (logit, global id,
    log q) of its k first tokens in rank order (decreasing logit, ties by id), log q = z - log_s
    on the kept set, -inf off it. A slice of fewer than k tokens pads with (-inf, 2^53, -inf),
    after every token. Rows whose max m is not finite are read as all zeros (their ids come out
    in order; the finish gives them -1 and NaN)."""
    check_cut(logits, m, inv_ts, lmp, cut, allow)
    check_arg("vocab_start", vocab_start, logits.device, like="logits", dtypes=(torch.int64,),
              shape=())  # fmt: skip
    check_arg("log_s", log_s, logits.device, like="logits", dtypes=(m.dtype,), shape=m.shape)
    if k < 1:
        raise ValueError(f"k: expected at least 1, got {k}")
    x = rows_of(logits)
    N, V = x.shape
    f64 = torch.float64
    out = torch.empty((N, k, 3), dtype=f64, device=x.device)
    out[..., 0], out[..., 1], out[..., 2] = float("-inf"), float(2**53), float("-inf")
    kk = min(k, V)
    starts, rows = row_blocks(N, V, acc_dtype(logits.dtype))
    for r0 in starts if kk else ():
        r1 = min(N, r0 + rows)
        mb, xa = m[r0:r1], x[r0:r1].to(m.dtype)
        z, kept = kept_mask(xa, mb, inv_ts[r0:r1], lmp[r0:r1], cut[r0:r1], allow[r0:r1])
        xb = torch.where(mb.isfinite().unsqueeze(-1), xa, 0.0)
        # the kk first in rank order: every token above the kk-th value, then its ties by id
        v = xb.topk(kk, -1).values[:, -1:]
        above = xb > v
        tie = xb == v
        need = kk - above.sum(-1, keepdim=True)
        sel = above | (tie & (tie.cumsum(-1) <= need))
        idx = sel.nonzero()[:, 1].view(r1 - r0, kk)  # by id within each row
        val, order = xb.gather(-1, idx).sort(dim=-1, descending=True, stable=True)
        idx = idx.gather(-1, order)
        zq = z.gather(-1, idx) - log_s[r0:r1].unsqueeze(-1)
        lq = torch.where(kept.gather(-1, idx), zq, float("-inf"))
        out[r0:r1, :kk, 0] = val.to(f64)
        out[r0:r1, :kk, 1] = (idx + vocab_start).to(f64)
        out[r0:r1, :kk, 2] = lq.to(f64)
    return out


@_topk_op.register_fake
def _(logits, vocab_start, m, inv_ts, lmp, cut, allow, log_s, k):
    check_devices(
        "logits", logits, vocab_start=vocab_start, m=m, inv_ts=inv_ts, lmp=lmp, cut=cut,
        allow=allow, log_s=log_s,
    )  # fmt: skip
    return logits.new_empty((rows_of(logits).shape[0], k, 3), dtype=torch.float64)


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_backward", mutates_args=())
def _backward_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    logits: Tensor,
    labels: Tensor,
    m: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    cut: Tensor,
    allow: Tensor,
    log_s: Tensor,
    entropy: Tensor,
    outside: Tensor,
    layout: Tensor,
    ignore_index: int,
) -> Tensor:
    """This rank's slice of the unsharded gradient of sum(g_lp * lp + g_ent * ent): on the kept
    set (g_lp (onehot - q) - g_ent q (log q + H)) / T, q = exp(z - log_s); 0 outside it; no
    log-prob term where the label is outside K; NaN rows where the label is out of range, 0 on
    ignored rows."""
    check_cut(logits, m, inv_ts, lmp, cut, allow)
    dev, acc = logits.device, acc_dtype(logits.dtype)
    rows = logits.shape[:-1]
    check_arg("labels", labels, dev, like="logits", dtypes=INDEX_DTYPES, shape=rows)
    for name, t, dt in (
        ("grad_logprobs", grad_logprobs, FLOAT_DTYPES),
        ("grad_entropy", grad_entropy, FLOAT_DTYPES),
        ("log_s", log_s, (acc,)),
        ("entropy", entropy, (acc,)),
        ("outside", outside, (torch.bool,)),
    ):
        if t is not None:
            check_arg(name, t, dev, like="logits", dtypes=dt, shape=rows, what="rows")
    start, V = layout_ints(layout)
    x = rows_of(logits)
    N, Vr = x.shape
    lab = labels.reshape(-1)
    y = lab.long() - start
    ignored = lab == ignore_index
    valid = (lab >= 0) & (lab < V) & ~ignored
    glp = torch.where(outside.reshape(-1), 0.0, grad_logprobs.reshape(-1).to(acc))
    gent = None if grad_entropy is None else grad_entropy.reshape(-1).to(acc)
    ls, ent = log_s.reshape(-1), entropy.reshape(-1)
    grad = torch.empty(x.shape, dtype=logits.dtype, device=dev)
    starts, rows_per = row_blocks(N, Vr, acc)
    for r0 in starts if Vr else ():
        r1 = min(N, r0 + rows_per)
        xb = x[r0:r1].to(acc)
        z, kept = kept_mask(xb, m[r0:r1], inv_ts[r0:r1], lmp[r0:r1], cut[r0:r1], allow[r0:r1])
        logq = z - ls[r0:r1].unsqueeze(-1)
        q = torch.where(kept, logq.exp(), torch.zeros_like(logq))
        g = -glp[r0:r1].unsqueeze(-1) * q
        if gent is not None:
            w = torch.where(q > 0, q * (logq + ent[r0:r1].unsqueeze(-1)), torch.zeros_like(q))
            g = g - gent[r0:r1].unsqueeze(-1) * w
        yb = y[r0:r1]
        mine = (yb >= 0) & (yb < Vr)
        add = torch.where(mine, glp[r0:r1], torch.zeros_like(glp[r0:r1]))
        g = g.scatter_add(-1, yb.clamp(0, Vr - 1).unsqueeze(-1), add.unsqueeze(-1))
        g = g * inv_ts[r0:r1].unsqueeze(-1)
        vb = (valid[r0:r1] & m[r0:r1].isfinite()).unsqueeze(-1)  # (undefined rows: NaN)
        g = torch.where(vb, g, torch.full_like(g, float("nan")))
        grad[r0:r1] = g.masked_fill(ignored[r0:r1].unsqueeze(-1), 0.0)
    return grad.view(logits.shape)


@_backward_op.register_fake
def _(glp, gent, logits, labels, m, inv_ts, lmp, cut, allow, log_s, ent, outside, layout, ii):
    check_layout_device(layout)
    check_devices(
        "logits", logits, grad_logprobs=glp, grad_entropy=gent, labels=labels, m=m,
        inv_ts=inv_ts, lmp=lmp, cut=cut, allow=allow, log_s=log_s, entropy=ent, outside=outside,
    )  # fmt: skip
    return logits.new_empty(logits.shape)


_CUT_INPUTS = slice(4, 9)  # m, inv_ts, lmp, cut, allow among the finish op's inputs


def _setup(ctx, inputs, output):
    logits, labels = inputs[0], inputs[1]
    _, ent, log_s, outside, _, _, _, layout = output
    ctx.save_for_backward(logits, labels, *inputs[_CUT_INPUTS], log_s, ent, outside, layout)
    ctx.ignore_index = inputs[10]
    ctx.mark_non_differentiable(log_s, outside, *output[4:])


def _backward(ctx, grad_lp, grad_ent, *_):
    logits, labels, m, inv_ts, lmp, cut, allow, log_s, ent, outside, layout = ctx.saved_tensors
    if grad_lp is None:
        grad_lp = torch.zeros_like(log_s)
    grad = torch.ops.ppo_kernels.vocab_parallel_sampler_backward(
        grad_lp, grad_ent, logits, labels, m, inv_ts, lmp, cut, allow, log_s, ent, outside,
        layout, ctx.ignore_index,
    )  # fmt: skip
    return (grad,) + (None,) * 10


_finish_op.register_autograd(_backward, setup_context=_setup)


# ---- the selection: torch ops between the collectives ----


def _choose(hist, above, target, strict: bool, prefix, first: bool):
    """One round of the radix selection on the ranks' summed histogram [N, 256]: the highest
    bucket whose weight at or above it (plus `above`, the weight of the keys above the prefix)
    reaches target (strict: exceeds it); where none does, the lowest non-empty bucket (the cut
    keeps every candidate). Returns (the prefix extended by the bucket, the weight strictly above
    the new prefix, whether the target was reached)."""
    b = torch.arange(BUCKETS, device=hist.device)
    at_or_above = hist.flip(-1).cumsum(-1).flip(-1)
    strictly = torch.cat([at_or_above[:, 1:], torch.zeros_like(at_or_above[:, :1])], -1)
    reach = above.unsqueeze(-1) + at_or_above
    ok = reach > target.unsqueeze(-1) if strict else reach >= target.unsqueeze(-1)
    best = torch.where(ok, b, -1).amax(-1)
    lowest = torch.where(hist > 0, b, BUCKETS).amin(-1)
    found = best >= 0
    pick = torch.where(found, best, torch.where(lowest < BUCKETS, lowest, 0))
    above = above + strictly.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    prefix = pick - BUCKETS // 2 if first else prefix * BUCKETS + pick
    return prefix, above, found


def _select(x, m, inv_ts, lmp, floor, mass: bool, target, strict: bool, group):
    """The radix selection over the candidates' keys (all ranks): (the cut's key: the highest key
    c whose weight of candidate keys >= c reaches the target, the weight of the keys above c,
    whether the target was reached, the candidates' total weight). target: [N] float64, or a
    function of the total weight (top-p's share of the mass)."""
    bits = _bits(m.dtype)
    N = m.shape[0]
    prefix = torch.zeros(N, dtype=torch.int64, device=m.device)
    above = torch.zeros(N, dtype=torch.float64, device=m.device)
    found = torch.ones(N, dtype=torch.bool, device=m.device)
    total = None
    for r in range(bits // 8):
        shift = bits - 8 * (r + 1)
        h = torch.ops.ppo_kernels.vocab_parallel_sampler_hist(
            x, m, inv_ts, lmp, floor, prefix, shift, r == 0, mass
        )
        h = all_reduce_(h, group)
        if total is None:
            total = h.sum(-1)
            target = target(total) if callable(target) else target
        prefix, above, f = _choose(h, above, target, strict, prefix, r == 0)
        found = found & f
    return prefix, above, found, total


def _per_row(t, scalar, labels, dtype):
    """A per-row parameter [N] from its tensor (a leading part of labels.shape) or scalar."""
    n = labels.numel()
    if t is None:
        return torch.full((n,), scalar, dtype=dtype, device=labels.device)
    t = t.reshape(tuple(t.shape) + (1,) * (labels.dim() - t.dim())).expand(labels.shape)
    return t.reshape(n).to(dtype)


class Options(NamedTuple):
    """The sampler's options of a call as the selection takes them: per-row tensors [N] (1 / T
    and log(min_p) in the accumulation dtype, top-k int64, top-p float64) and which selections
    run (the same on every rank: they decide the collectives)."""

    inv_ts: Tensor
    lmp: Tensor
    top_k: Tensor
    top_p: Tensor
    on_k: bool
    on_p: bool
    sampler: str

    def rows(self, r0: int, r1: int) -> Options:
        return self._replace(**{f: getattr(self, f)[r0:r1] for f in self._fields[:4]})


def options(labels, temperature, temps, k, ks, p, ps, mp, mps, sampler, acc) -> Options:
    """Options from token_logprobs.api.sampler_options' results (checked) for `labels`."""
    inv_ts = row_inverse(temps, labels.shape, acc)
    if inv_ts is None:
        inv_ts = torch.full((labels.numel(),), 1.0 / temperature, dtype=acc, device=labels.device)
    mpr = _per_row(mps, mp, labels, acc)
    lmp = torch.where(mpr > 0, mpr.log(), torch.full_like(mpr, float("-inf")))
    kr = _per_row(ks, k, labels, torch.int64)
    pr = _per_row(ps, p, labels, torch.float64)
    return Options(inv_ts, lmp, kr, pr, k != 0 or ks is not None, p != 1.0 or ps is not None,
                   sampler)  # fmt: skip


def check_options(o: Options, group, dev, dtype):
    """The options that decide the collectives, alike on every rank (a ValueError naming the
    first that differs), where cross-rank checks run."""
    check_same_sizes(
        group, dev, sampler=("vllm", "sglang").index(o.sampler), top_k=int(o.on_k),
        top_p=int(o.on_p), dtype=FLOAT_DTYPES.index(dtype),
    )  # fmt: skip


def kept_set(x, labels, o: Options, start, derived, group, ignore_index):
    """Each row's kept set of this rank's slice x [..., V_rank] (labels: labels.shape), found
    with every rank: (the gathered headers and row maxima, the kept set's sums over every rank,
    the global max m, the cut, the cut's ties this slice keeps), as the finish op takes them."""
    Vr, N = x.shape[-1], labels.numel()
    dev, acc = x.device, acc_dtype(x.dtype)

    def states(_start):
        return torch.ops.ppo_kernels.vocab_parallel_sampler_max(x, labels)

    gathered = gather_settled(states, start, derived, Vr, N, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    m = gathered[:, HEADER:].amax(0)  # NaN where any rank has a NaN
    V = gathered[:, 1].sum()
    inv_ts, lmp, kr, pr = o.inv_ts, o.lmp, o.top_k, o.top_p
    k_on, p_on = (kr > 0) & (kr < V), pr < 1.0
    none = torch.full((N,), NO_CUT, dtype=torch.int64, device=dev)
    everyone = torch.full((N,), float("-inf"), dtype=acc, device=dev)
    inf = torch.full((N,), float("inf"), dtype=torch.float64, device=dev)
    cut, allow = none, inf
    if o.sampler == "vllm":
        # top-k on min-p's set, then top-p on what top-k kept, renormalised
        cut_k = none
        if o.on_k:
            c, _, _, _ = _select(x, m, inv_ts, lmp, none, False, kr.double(), False, group)
            cut_k = torch.where(k_on, c, none)
        cut = cut_k
        if o.on_p:
            c, _, _, _ = _select(
                x, m, inv_ts, lmp, cut_k, True, lambda total: pr * total, False, group
            )
            cut = torch.maximum(cut_k, torch.where(p_on, c, none))
    else:
        # each filter on the whole distribution; a cut keeps its ties by id: `allow` of them
        t = inf
        if o.on_k:
            c, above, _, _ = _select(x, m, inv_ts, everyone, none, False, kr.double(), False, group)
            cut = torch.where(k_on, c, none)
            t = torch.where(k_on, kr.double() - above, inf)
        if o.on_p:
            c, above, found, total = _select(
                x, m, inv_ts, everyone, none, True, lambda total: pr * total, True, group
            )
            e = ((key_values(c, acc) - m) * inv_ts).exp().double()
            tp = torch.where(found, ((pr * total - above) / e).floor() + 1, inf)
            c, tp = torch.where(p_on, c, none), torch.where(p_on, tp, inf)
            t = torch.where(c > cut, tp, torch.where(c < cut, t, torch.minimum(t, tp)))
            cut = torch.maximum(cut, c)
        if o.on_k or o.on_p:
            counts = _all_gather(torch.ops.ppo_kernels.vocab_parallel_sampler_ties(x, cut), group)
            counts = counts.view(world, N)
            lower = (gathered[:, 0] < gathered[rank, 0]).to(torch.float64).unsqueeze(-1)
            allow = (t - (counts * lower).sum(0)).clamp(min=0.0)
    start = gathered[rank, 0].to(torch.int64)  # (settled), a tensor: no host sync
    sums = torch.ops.ppo_kernels.vocab_parallel_sampler_states(
        x, labels, start, m, inv_ts, lmp, cut, allow, ignore_index
    )
    return gathered, all_reduce_(sums, group), m, cut, allow


def top_stats(x, labels, o: Options, gathered, m, cut, allow, log_s, k, group, ignore_index,
              check_size=True):  # fmt: skip
    """The top-k statistics (top ids int64, their log-probs under the sampler's distribution)
    [N, k] of every row, from each rank's k first tokens in rank order (one all-gather): merged
    by decreasing logit, ties by global id, as the single-device op gives them (ids -1 and
    log-probs 0 on ignored rows, -1 and NaN on undefined ones)."""
    N, world, rank = labels.numel(), dist.get_world_size(group), dist.get_rank(group)
    if check_size and cross_checks(x):  # the same on every rank: each raises alike
        V = int(gathered[:, 1].sum())
        if k > V and N > 0:
            raise ValueError(f"stats_top_k: expected at most the vocabulary size {V}, got {k}")
    start = gathered[rank, 0].to(torch.int64)
    cand = torch.ops.ppo_kernels.vocab_parallel_sampler_topk(
        x, start, m, o.inv_ts, o.lmp, cut, allow, log_s.reshape(-1), k
    )
    c = _all_gather(cand, group).view(world, N, k, 3).transpose(0, 1).reshape(N, world * k, 3)
    c = c.gather(1, c[..., 1].argsort(dim=-1, stable=True).unsqueeze(-1).expand_as(c))
    first = c[..., 0].argsort(dim=-1, descending=True, stable=True)[:, :k]
    top = c.gather(1, first.unsqueeze(-1).expand(N, k, 3))
    ids, lq = top[..., 1], top[..., 2].to(m.dtype)
    bad = ~m.isfinite().unsqueeze(-1)
    ignored = (labels.reshape(-1) == ignore_index).unsqueeze(-1)
    ids = torch.where(bad | ignored | (ids >= 2**53), -1.0, ids).to(torch.int64)
    lq = torch.where(bad, float("nan"), lq).masked_fill(ignored, 0.0)
    return ids, lq


def vocab_parallel_sampled_logprobs(
    logits, labels, temperature, temps, k, ks, p, ps, mp, mps, sampler, ignore_index,
    process_group, vocab_start, stats_top_k=0,
):  # fmt: skip
    """token_logprobs(..., process_group=..., top_k / top_p / min_p) on this rank's slice
    logits [..., V_rank]; the options as token_logprobs.api.sampler_options returns them
    (checked). Returns the sampler op's outputs (logprobs, entropy, -, -, -, outside, sum_p2,
    lse, top_ids, top_logprobs, is_argmax) flat ("-": empty; the top-k statistics [N, k] with
    stats_top_k = k > 0, else empty)."""
    group, acc = process_group, acc_dtype(logits.dtype)
    start, derived = resolve_vocab_start(vocab_start, logits.shape[-1], group)
    o = options(labels, temperature, temps, k, ks, p, ps, mp, mps, sampler, acc)
    if cross_checks(logits):  # the collectives below depend on these: the same on every rank
        check_options(o, group, logits.device, logits.dtype)
    gathered, sums, m, cut, allow = kept_set(
        logits.detach(), labels, o, start, derived, group, ignore_index
    )
    lp, ent, log_s, outside, sum_p2, lse, is_argmax, _ = (
        torch.ops.ppo_kernels.vocab_parallel_sampler_finish(
            logits,
            labels,
            gathered,
            sums,
            m,
            o.inv_ts,
            o.lmp,
            cut,
            allow,
            dist.get_rank(group),
            ignore_index,
        )  # fmt: skip
    )
    empty = lp.new_empty(0)
    ids, top_lp = empty.long(), empty
    if stats_top_k > 0:
        ids, top_lp = top_stats(
            logits.detach(), labels, o, gathered, m, cut, allow, log_s, stats_top_k, group,
            ignore_index,
        )  # fmt: skip
    return lp, ent, empty, empty, empty, outside, sum_p2, lse, ids, top_lp, is_argmax
