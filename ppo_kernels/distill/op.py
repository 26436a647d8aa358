"""The Python side of the registered ops `ppo_kernels::linear_distill_loss` and
`ppo_kernels::linear_distill_loss_grads`, defined in C++ (csrc/ops/linear_distill_loss.cpp:
schemas, checks, routing, autograd): the op on each backend -- the fused-linear engine's loop
(fused_linear/engine.py) with the distillation head term (head.py) and a reduction of its own
(`TeacherTiles`: the student's and the teacher head's tiles side by side; `TopkTiles`: the
student's tile against a cached teacher's top-k) -- the fake kernels and the fallback without the
extension. Public function: api.py; float64 reference: losses/distill_naive.py; the tile kernels:
tiles.py.

One pass over row blocks, 3 student GEMMs and one teacher GEMM: per block the student's tile
and the teacher's (no gradient), the divergence, the hard-label log-prob and their log-sum-exps
per row in one kernel call (two passes over the tiles for jsd / tv, one for the KLs), the
per-token coefficients of Liger's token mean (known before the loop: the kept tokens are counted
first), then the student's gradient tile written over its logits tile by one more kernel call,
and its two GEMMs.

`linear_distill_loss_sampler` (+ `_grads`): the same loss with the student's distribution the
one the rollout engine sampled from (a temperature tensor, top-k, top-p, min-p; its arguments
follow the plain op's). Whole-row tiles: token_logprobs' sampler kernels find the student's kept
set K and the sampled token's log-prob under p_K; the student's tempered tile with -inf off K and
the teacher's tempered tile go through the same distillation tile kernels (at temperature 1: the
temperatures are applied per row first); the hard-label term stays the plain temperature-1
cross-entropy (token_logprobs' kernels on the raw tile). A label outside K is counted
(`num_outside`, the `outside` flags): its sampled reverse KL is -inf."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_labels_in_range
from .._math import acc_dtype
from ..fused_linear import engine, fused_op
from ..fused_linear.planner import DEFAULT_MAX_CHUNK_BYTES
from ..fused_linear.tiler import Tiler
from ..losses import distill_math as dm
from ..losses.config import fields, make
from ..losses.distill_config import DistillLossConfig
from ..token_logprobs import op as tl_op
from . import head as distill_head
from .tiles import DIVERGENCES, backward_, forward  # noqa: F401  (the op's tile kernels)

OP = _backend.register_op(
    "linear_distill_loss",
    kernel="distill_fwd",
    triton=True,
    cuda_default="triton",
    folder="distill",
    delegates={
        ("cpp", "cpu"): "BLAS matmuls + the distillation C++ tile kernels (a cached teacher: the "
        "token_logprobs ones)",
        ("cpp", "cuda"): "cuBLAS matmuls + no CUDA C++ distillation tile kernels: the Triton ones "
        "(eager without triton); a cached teacher: the token_logprobs CUDA kernels",
        ("triton", "cuda"): "cuBLAS matmuls (torch.mm) + the distillation Triton tile kernels",
        ("eager", "cpu"): "BLAS matmuls (torch.mm) + eager tile math",
        ("eager", "cuda"): "cuBLAS matmuls (torch.mm) + eager tile math",
    },
)
_backend.routes_in_cpp("linear_distill_loss")


# --------------------------------------------------------------------------- the registered op
# The arguments of both registered ops, in schema order (csrc/ops/linear_distill_loss.cpp; checked
# against the schema at import). linear_distill_loss_grads adds need_hidden, need_weight,
# need_bias.
ARG_NAMES = (
    "hidden",
    "weight",
    "labels",
    "mask",
    "bias",
    "teacher_hidden",
    "teacher_weight",
    "teacher_bias",
    "topk_ids",
    "topk_logprobs",
    *fields(DistillLossConfig),
    "ignore_index",
    "max_chunk_bytes",
    "logits_dtype",
)
NEED_NAMES = ("need_hidden", "need_weight", "need_bias")
Call = NamedTuple("Call", [(n, object) for n in ARG_NAMES + NEED_NAMES])
# linear_distill_loss_sampler's arguments after ARG_NAMES (then NEED_NAMES for its _grads):
# temperatures (Tensor? [N], replaces temperature), top_k / top_ks, top_p / top_ps, min_p / min_ps
# (a scalar, or a per-token tensor that replaces it), sampler.
SAMPLER_NAMES = ("temperatures", "top_k", "top_ks", "top_p", "top_ps", "min_p", "min_ps", "sampler")
SamplerCall = NamedTuple(
    "SamplerCall", [(n, object) for n in ARG_NAMES + SAMPLER_NAMES + NEED_NAMES]
)

if _backend.HAS_EXTENSION:
    _schema = _backend.registered("linear_distill_loss_grads").default._schema
    assert tuple(a.name for a in _schema.arguments) == ARG_NAMES + NEED_NAMES, (
        "csrc/ops/linear_distill_loss.cpp and op.ARG_NAMES disagree"
    )
    _schema = _backend.registered("linear_distill_loss_sampler_grads").default._schema
    assert tuple(a.name for a in _schema.arguments) == ARG_NAMES + SAMPLER_NAMES + NEED_NAMES, (
        "csrc/ops/linear_distill_loss.cpp and op.SAMPLER_NAMES disagree"
    )

TOKEN_STATS = distill_head.TOKEN_STATS
STAT_NAMES = distill_head.STAT_NAMES


def config(a) -> DistillLossConfig:
    """The DistillLossConfig of the op's arguments `a` (checked once per distinct values)."""
    return make(DistillLossConfig, **{k: getattr(a, k) for k in fields(DistillLossConfig)})


class TeacherTiles(engine.WholeVocab):
    """The reduction of a student tile and the teacher head's tile beside it (computed here, by
    a Tiler of the teacher's head planned with the student's rows; no gradient): the distillation
    tile kernels give per row the divergence, the hard-label log-prob and what the backward
    needs, and write the student's gradient over its tile. The sampled token's log-probs at
    temperature T come from the two tiles (a gather) and the kernels' log-sum-exps."""

    def __init__(self, backend, cfg, ignore_index, keep, teacher):
        super().__init__(backend, cfg.temperature, ignore_index, (None, None))
        self.div, self.beta = dm.resolve(cfg.divergence, cfg.beta), cfg.beta
        self.kfwd, self.kbwd = forward.impls[backend], backward_.impls[backend]
        self.keep, self.teacher = keep, teacher
        self.saved = None

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        V = tiler.W.shape[0]
        z = tiler.logits(hc, 0, V)
        zt = self.teacher.logits(self.teacher.rows(r0, r1), 0, V)
        km = tiler.pad(self.keep[r0:r1], False)
        val, lse_s, lse_t, aux, hard, lse_h = self.kfwd(
            z, zt, lc, km, self.inv_t, self.div, self.beta, self.ii
        )
        y = torch.where(lc == self.ii, 0, lc).long().unsqueeze(1)
        lp = z.gather(1, y).squeeze(1).to(lse_s.dtype) * self.inv_t - lse_s
        lq = zt.gather(1, y).squeeze(1).to(lse_t.dtype) * self.inv_t - lse_t
        k = dm.sampled_reverse_kl(lp, lq)[0]
        self.z, self.zr = z, zt
        self.saved = (km, lse_s, lse_t, aux, lse_h)
        return hard, None, lse_s, (val, hard, k)

    def block_grad(self, tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb):
        d_hard, _, d_value = coefs
        z, zt = self.z, self.zr
        self.z = self.zr = None
        km, lse_s, lse_t, aux, lse_h = self.saved
        if d_value is None:  # (no soft term: the kernel still forms the hard term's gradient)
            d_value = torch.zeros_like(lse_s)
        hard = d_hard is not None
        self.kbwd(z, zt, lc if hard else None, km, lse_s, lse_t, aux, lse_h if hard else None,
                  d_value, d_hard, self.inv_t, self.div, self.beta, self.ii)  # fmt: skip
        tiler.grad_matmuls(z, hc, 0, z.shape[1], ghc, gW, gb)


class TopkTiles(engine.WholeVocab):
    """The reduction of a student tile against a cached teacher (top-k ids [N, K] and log-probs
    at temperature T; -inf marks an unused slot). The token_logprobs kernels give the student's
    log-sum-exp (and the hard label's log-prob; a second call at temperature 1 when T != 1), the
    student's support log-probs are read from the tile, the divergence and its derivative come
    from distill_math.sparse_divergence, and the gradient tile is
    (sum_k c_k onehot(id_k) - p sum_k c_k) / T (+ the hard term): one token_logprobs backward
    with the row total as its coefficient, the label's entry set from its log-prob, the c_k
    added at the ids. The teacher's log-prob of the sampled token is the top-k entry holding
    it: the sampled-token reverse KL is NaN where the label is not among the ids."""

    def __init__(self, backend, cfg, ignore_index, keep, ids, teacher_lp, tl):
        super().__init__(backend, cfg.temperature, ignore_index, tl)
        self.div, self.beta, self.tail = (
            dm.resolve(cfg.divergence, cfg.beta),
            cfg.beta,
            cfg.topk_tail,
        )
        self.keep, self.ids, self.tlp = keep, ids, teacher_lp
        self.sep = cfg.temperature != 1.0  # the hard term's statistics at temperature 1 apart
        self.saved = None
        self.buf = None  # the hard term's gradient tile at temperature 1 (sep only)

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        V = tiler.W.shape[0]
        z = tiler.logits(hc, 0, V)
        lp, _, lse = self.fwd(z, lc, self.inv_t, self.ii, False)
        hard, lse1 = lp, lse
        if self.sep:
            hard, _, lse1 = self.fwd(z, lc, 1.0, self.ii, False)
        acc = lse.dtype
        ids = tiler.pad(self.ids[r0:r1])
        lq = tiler.pad(self.tlp[r0:r1], -math.inf).to(acc)
        bad = (ids < 0) | (ids >= V)  # (the CPU refused them; on a GPU: NaN, not a bad read)
        ids = torch.where(bad, 0, ids).long()
        ls = z.gather(1, ids).to(acc) * self.inv_t - lse.unsqueeze(1)
        val, d_ls = dm.sparse_divergence(self.div, self.beta, ls, lq, self.tail)
        val = torch.where(bad.any(1), math.nan, val)
        # the teacher's log-prob of the sampled token: its top-k entry, or NaN
        hit = (ids == lc.unsqueeze(1)) & (lq > -math.inf) & ~bad
        lq_y = torch.where(hit, lq, -math.inf).amax(1) if ids.shape[1] else lse * math.nan
        lq_y = torch.where(hit.any(1), lq_y, math.nan)
        k = dm.sampled_reverse_kl(lp, lq_y)[0]
        self.z = z
        self.saved = (ids, d_ls, lp, lse, lse1)
        return hard, None, lse, (val, hard, k)

    def block_grad(self, tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb):
        d_hard, _, d_value = coefs
        z = self.z
        self.z = None
        ids, d_ls, lp, lse, lse1 = self.saved
        acc = lse.dtype
        if d_value is None:
            c = torch.zeros_like(d_ls)
        else:  # (d_ls may be NaN off the kept rows, whose d_value is 0)
            c = torch.where(d_value.unsqueeze(1) != 0, d_value.unsqueeze(1).to(acc) * d_ls, 0.0)
        S = c.sum(1)
        extra = None
        glp = S
        if d_hard is not None:
            if self.sep:  # d_hard (onehot(y) - softmax(z)): at temperature 1, apart
                if self.buf is None:
                    self.buf = torch.empty(tiler.max_rows * z.shape[1], dtype=z.dtype,
                                           device=z.device)  # fmt: skip
                extra = self.buf[: z.numel()].view(z.shape)
                self.bwd(z, d_hard, None, lc, lse1, lse1, 1.0, self.ii, extra)
            else:
                glp = S + d_hard
        # the label's entry, exactly: -S p_y / T (+ d_hard (1 - p_y) at T = 1)
        p_y = lp.exp()
        y_val = -S * p_y * self.inv_t
        if d_hard is not None and not self.sep:
            y_val = y_val + d_hard.to(acc) * (1 - p_y)
        ignored = lc == self.ii
        y_val = torch.where(ignored, 0.0, y_val)
        y = torch.where(ignored, 0, lc).long().unsqueeze(1)
        self.bwd(z, glp, None, lc, lse, lse, self.inv_t, self.ii, z)  # in place
        z.scatter_(1, y, y_val.unsqueeze(1).to(z.dtype))
        z.scatter_add_(1, ids, (c * self.inv_t).to(z.dtype))
        if extra is not None:
            z += extra
        tiler.grad_matmuls(z, hc, 0, z.shape[1], ghc, gW, gb)


class SamplerTeacherTiles(TeacherTiles):
    """TeacherTiles with the student's distribution the sampler's: p_K, its tempered softmax
    truncated to the kept set K (token_logprobs' sampler kernels `sfwd` on the raw tile, with the
    per-row parameters `params`: engine.sampler_params) and renormalised; the teacher's q stays
    whole. Both tiles are tempered per row first (a temperature tensor), the student's with -inf
    off K, and the distillation kernels run on them at temperature 1, so the divergence and its
    gradient are those of p_K (0 off K). The hard-label term is the plain temperature-1
    cross-entropy of the raw tile (token_logprobs' kernels `tl`), its gradient added to the
    divergence's. `outside` [N] gets the kept tokens whose label is outside K."""

    def __init__(self, backend, cfg, ignore_index, keep, teacher, sfwd, tl, params, sampler,
                 outside):  # fmt: skip
        super().__init__(backend, cfg, ignore_index, keep, teacher)
        self.sfwd, (self.hfwd, self.hbwd) = sfwd, tl
        self.params, self.sampler, self.outside = params, sampler, outside
        self.blk = None

    def at_block(self, r0, r1, pad):
        """The per-row parameters of rows r0:r1, padded as the tile."""
        inv_ts, _, ks, _, ps, _, mps = self.params

        def rows(t, fill):
            return None if t is None else pad(t[r0:r1], fill)

        self.blk = (rows(inv_ts, 1.0), rows(ks, 0), rows(ps, 1.0), rows(mps, 0.0))

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        V = tiler.W.shape[0]
        z = tiler.logits(hc, 0, V)
        zt = self.teacher.logits(self.teacher.rows(r0, r1), 0, V)
        km = tiler.pad(self.keep[r0:r1], False)
        inv_ts, ks, ps, mps = self.blk
        _, k, _, p, _, mp, _ = self.params
        lp, _, _, cut, cut_index, out = self.sfwd(
            z, lc, self.inv_t, inv_ts, k, ks, p, ps, mp, mps, self.sampler, self.ii, False,
            False, False, 0, False,
        )[:6]  # fmt: skip
        hard, _, lse1 = self.hfwd(z, lc, 1.0, self.ii, False)
        acc = lse1.dtype
        it = self.inv_t if inv_ts is None else inv_ts.to(acc).unsqueeze(1)
        x = z.to(acc)
        j = torch.arange(V, device=z.device)
        c = cut.to(acc).unsqueeze(1)
        kept = (x > c) | ((x == c) & (j <= cut_index.unsqueeze(1)))
        zs = torch.where(kept, x * it, -math.inf)
        zq = zt.to(acc) * it
        val, lse_s, lse_t, aux, _, _ = self.kfwd(
            zs, zq, None, km, 1.0, self.div, self.beta, self.ii
        )
        y = torch.where(lc == self.ii, 0, lc).long().unsqueeze(1)
        lq = zq.gather(1, y).squeeze(1) - lse_t
        kr = dm.sampled_reverse_kl(lp, lq)[0]
        self.outside[r0:r1] = (out & km)[: r1 - r0]
        self.z, self.zs, self.zq = z, zs, zq
        self.saved = (km, lse_s, lse_t, aux, lse1, it)
        return hard, None, lse_s, (val, hard, kr)

    def block_grad(self, tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb):
        d_hard, _, d_value = coefs
        z, zs, zq = self.z, self.zs, self.zq
        self.z = self.zs = self.zq = None
        km, lse_s, lse_t, aux, lse1, it = self.saved
        if d_value is None:
            d_value = torch.zeros_like(lse_s)
        self.kbwd(zs, zq, None, km, lse_s, lse_t, aux, None, d_value, None, 1.0, self.div,
                  self.beta, self.ii)  # fmt: skip
        zs.mul_(it)  # (the tiles were tempered per row: d zs / d z = 1 / T)
        if d_hard is not None:  # d_hard (onehot(y) - softmax(z)), in place, then the divergence's
            self.hbwd(z, d_hard, None, lc, lse1, lse1, 1.0, self.ii, z)
            z.add_(zs)
        else:
            z.copy_(zs)
        tiler.grad_matmuls(z, hc, 0, z.shape[1], ghc, gW, gb)

    def release(self):
        self.z = self.zr = self.zs = self.zq = None


def _check_ids(ids, V):
    """IndexError naming the first top-k id outside [0, V) (reads them: the GPU only under
    strict_checks())."""
    bad = (ids < 0) | (ids >= V)
    if bool(bad.any()):
        pos = int(bad.flatten().nonzero()[0])
        raise IndexError(
            f"topk_ids: value {int(ids.flatten()[pos])} at flat position {pos} is outside the "
            f"vocabulary [0, {V})"
        )


# The CPU's default budget holds at least this many rows per block: a block of fewer rows runs its
# three GEMMs well below their speed (the weight-gradient product's inner dimension is the rows),
# which a large vocabulary's tiles (two of them) bring about within 64 MiB
# (bench/results/cpu_distill.md).
MIN_BLOCK_ROWS_CPU = 256


def _budget(max_chunk_bytes: int, device, V: int, share: int) -> int:
    """The chunk budget: the caller's, else the planner's default -- on the CPU raised to hold
    MIN_BLOCK_ROWS_CPU rows of `share` float32 tiles (and a quarter more for the other
    buffers)."""
    if max_chunk_bytes or device.type != "cpu":
        return max_chunk_bytes
    rows = share * MIN_BLOCK_ROWS_CPU * V * 4 * 5 // 4
    return max(DEFAULT_MAX_CHUNK_BYTES["cpu"], rows)


def run(backend: str, a) -> tuple[Tensor, ...]:
    """linear_distill_loss_grads on `backend` ("cpp", "triton", "eager"): the arguments as the
    schema names them (Call)."""
    hidden, weight, labels = a.hidden, a.weight, a.labels
    N, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    if dev.type == "cpu" or _backend.strict():
        check_labels_in_range(labels, V, a.ignore_index)
        if a.topk_ids is not None:
            _check_ids(a.topk_ids, V)
    cfg = config(a)
    acc = acc_dtype(hidden.dtype)
    keep = labels != a.ignore_index
    if a.mask is not None:
        keep = keep & (a.mask != 0)
    token_stats = _backend.new_output((3, N), acc, dev)
    head = distill_head.DistillHead(cfg, keep, token_stats)
    ldt = a.logits_dtype
    sampled = isinstance(a, SamplerCall)
    outside = _backend.new_output((N,), torch.bool, dev) if sampled else None
    if sampled:
        # whole rows: the raw student tile, the tempered one and the teacher's (and its copy)
        budget = _budget(a.max_chunk_bytes, dev, V, 4)
        plan = engine.plan_rows(hidden, V, ldt, budget, 4)
        tplan = engine.plan_rows(a.teacher_hidden, V, ldt, budget, 4)
        tplan = dataclasses.replace(tplan, rows=plan.rows, pad=plan.pad)
        teacher = Tiler(a.teacher_hidden, a.teacher_weight, a.teacher_bias, tplan, backend)
        kb = engine.sampler_kernels(hidden, backend)
        params = engine.sampler_params(
            (N,), dev, a.temperatures, a.top_k, a.top_ks, a.top_p, a.top_ps, a.min_p, a.min_ps
        )
        tl = (tl_op.forward.impls[backend], tl_op.backward.impls[backend])
        vocab = SamplerTeacherTiles(backend, cfg, a.ignore_index, keep, teacher,
                                    tl_op.sampler_forward.impls[kb], tl, params, a.sampler,
                                    outside)  # fmt: skip
    elif a.teacher_hidden is not None:
        # the student's tile and the teacher's side by side
        budget = _budget(a.max_chunk_bytes, dev, V, 2)
        plan = engine.plan_rows(hidden, V, ldt, budget, 2)
        tplan = engine.plan_rows(a.teacher_hidden, V, ldt, budget, 2)
        tplan = dataclasses.replace(tplan, rows=plan.rows, pad=plan.pad)
        teacher = Tiler(a.teacher_hidden, a.teacher_weight, a.teacher_bias, tplan, backend)
        vocab = TeacherTiles(backend, cfg, a.ignore_index, keep, teacher)
    else:
        # (+ the hard term's gradient tile at temperature 1 when T != 1)
        share = 2 if (cfg.temperature != 1.0 and cfg.weight_hard_loss != 0) else 1
        plan = engine.plan_rows(hidden, V, ldt, _budget(a.max_chunk_bytes, dev, V, share), share)
        tl = (tl_op.forward.impls[backend], tl_op.backward.impls[backend])
        vocab = TopkTiles(backend, cfg, a.ignore_index, keep, a.topk_ids, a.topk_logprobs, tl)
    gh, gW, gb = engine.run(
        head,
        vocab,
        engine.Head(hidden, weight, a.bias, labels, 1),
        plan,
        need=(a.need_hidden, a.need_weight, a.need_bias),
    )
    loss, stats = head.result()
    if sampled:
        stats = torch.cat((stats, outside.sum().to(stats.dtype).unsqueeze(0)))
        return loss, stats, token_stats, outside, gh, gW, gb
    return loss, stats, token_stats, gh, gW, gb


def _impl(backend, call, name):
    def impl(*args):
        return run(backend, call(*args))

    impl.__name__ = f"{name}_{backend}"
    return impl


for _b in _backend.BACKENDS:
    _backend.impl("linear_distill_loss_grads", _b)(_impl(_b, Call, "linear_distill_loss_grads"))
    _backend.impl("linear_distill_loss_sampler_grads", _b)(
        _impl(_b, SamplerCall, "linear_distill_loss_sampler_grads")
    )


def _fake_outputs(a):
    hidden = a.hidden
    acc = acc_dtype(hidden.dtype)
    N = hidden.shape[0]
    sampled = isinstance(a, SamplerCall)
    out = (
        hidden.new_empty((), dtype=acc),
        hidden.new_empty((len(STAT_NAMES) + sampled,), dtype=acc),
        hidden.new_empty((len(TOKEN_STATS), N), dtype=acc),
    )
    return out + (hidden.new_empty((N,), dtype=torch.bool),) if sampled else out


# The tensor arguments after hidden, each on hidden's device: the fakes and the fallback check it
# as the C++ checks do (a meta tensor sends a call to its fake whatever the other arguments').
_ON_HIDDENS_DEVICE = (
    "weight", "labels", "mask", "bias", "teacher_hidden", "teacher_weight", "teacher_bias",
    "topk_ids", "topk_logprobs",
)  # fmt: skip


def _check_devices(a):
    fused_op.check_on_hiddens_device(a, _ON_HIDDENS_DEVICE)


for _name, _call, _outputs in (
    ("linear_distill_loss", Call, _fake_outputs),
    ("linear_distill_loss_sampler", SamplerCall, _fake_outputs),
):
    _fake, _fake_grads = fused_op.fake_kernels(_call, _check_devices, _outputs)
    _backend.fake(_name)(_fake)
    _backend.fake(_name + "_grads")(_fake_grads)


# --------------------------------------------------------------------------- without the extension
@_backend.fallback("linear_distill_loss")
def _(*args):
    _check_devices(Call(*args, False, False, False))
    return fused_op.with_grads(lambda call: run("eager", call), Call, 3, args)


@_backend.fallback("linear_distill_loss_sampler")
def _(*args):
    _check_devices(SamplerCall(*args, False, False, False))
    return fused_op.with_grads(lambda call: run("eager", call), SamplerCall, 4, args)
