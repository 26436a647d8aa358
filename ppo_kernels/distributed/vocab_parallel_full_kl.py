"""Vocab-parallel full_kl: both logits vocab-sharded (Megatron's layout). Per rank, the full_kl
kernel on its slice gives (kl_r, lse_z_r, lse_w_r); one all-gather of those three per-row numbers
and the merge give the exact KL; the backward is elementwise given the global kl and log-sum-exps
(the full_kl backward op on each slice), no collective. Per-row temperatures: the slices'
statistics at each row's temperature (full_kl_row_temperature). Under the rollout sampler's
truncation (top_k / top_p / min_p): the policy's kept set from vocab_parallel_sampler.kept_set,
then the KL of the truncated policy against the whole reference (below)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    check_arg,
    check_devices,
    check_temperature,
    check_tensor,
)
from .._math import acc_dtype
from . import vocab_parallel_sampler as vs
from ._comm import all_gather as _all_gather
from ._comm import all_reduce_, cross_checks, require_initialized
from .vocab_layout import resolve_vocab_start
from .vocab_states import row_blocks

# ---- full-vocabulary KL with both logits vocab-sharded ----
# Per rank, the full_kl kernel on its slice gives (kl_r, lse_z_r, lse_w_r), where
# kl_r + lse_z_r - lse_w_r = sum_{j in r} softmax_r(z)_j (z_j - w_j). With the slice masses
# a_r = exp(lse_z_r - lse_z): KL = sum_r a_r (kl_r + lse_z_r - lse_w_r) - lse_z + lse_w. One
# all-gather of those three per-row numbers; the backward is elementwise given the global kl and
# log-sum-exps (the full_kl backward op on each slice), no collective. The per-slice forward is
# the registered full_kl op and the merge a registered op differentiable in both logits, so
# torch.compile traces the whole form.


def _logsumexp_ranks(x):
    m = x.amax(0)
    m_safe = torch.where(m.isinf(), torch.zeros_like(m), m)
    return m_safe + (x - m_safe).exp().sum(0).log()


def merge_full_kl(st: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, lse_z, lse_w) [N] from every rank's per-slice (kl_r, lse_z_r, lse_w_r), st
    [world, 3, N] (see above)."""
    lse_z, lse_w = _logsumexp_ranks(st[:, 1]), _logsumexp_ranks(st[:, 2])
    a = (st[:, 1] - lse_z).exp()
    cross = torch.where(a > 0, a * (st[:, 0] + st[:, 1] - st[:, 2]), torch.zeros_like(a))
    return cross.sum(0) - lse_z + lse_w, lse_z, lse_w


@torch.library.custom_op("ppo_kernels::vocab_parallel_full_kl", mutates_args=())
def _full_kl_op(
    logits: Tensor,
    ref_logits: Tensor,
    gathered: Tensor,
    mask: Tensor | None,
    temperature: float,
    temperatures: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, lse_z, lse_w) with logits.shape[:-1] from every rank's per-slice (kl_r, lse_z_r,
    lse_w_r), gathered [world, 3 * N]; the logits slices and the per-row temperatures (a
    leading part of logits.shape[:-1], or None) are read only by the backward."""
    rows, dev, acc = logits.shape[:-1], logits.device, acc_dtype(logits.dtype)
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg(
        "ref_logits", ref_logits, dev, like="logits", dtypes=(logits.dtype,), shape=logits.shape
    )
    check_arg("mask", mask, dev, like="logits", dtypes=(torch.bool,), shape=rows, allow_none=True)
    check_arg("gathered", gathered, dev, like="logits")
    check_tensor("gathered", gathered, dtypes=(acc,), dim=2)
    if gathered.shape[1] != 3 * rows.numel():
        raise ValueError(f"gathered: expected {3 * rows.numel()} columns per rank")
    check_temperature(temperature)
    if temperatures is not None:
        check_arg("temperatures", temperatures, dev, like="logits", dtypes=FLOAT_DTYPES)
        if tuple(temperatures.shape) != tuple(rows[: temperatures.dim()]):
            raise ValueError("temperatures: expected a leading part of logits.shape[:-1]")
    kl, lse_z, lse_w = merge_full_kl(gathered.view(gathered.shape[0], 3, -1))
    kl = kl.view(rows)
    if mask is not None:
        kl = torch.where(mask, kl, torch.zeros_like(kl))
    return kl, lse_z.view(rows), lse_w.view(rows)


@_full_kl_op.register_fake
def _(logits, ref_logits, gathered, mask, temperature, temperatures=None):
    check_devices(
        "logits", logits, ref_logits=ref_logits, gathered=gathered, mask=mask,
        temperatures=temperatures,
    )  # fmt: skip
    rows, o = logits.shape[:-1], acc_dtype(logits.dtype)
    return tuple(logits.new_empty(rows, dtype=o) for _ in range(3))


def _full_kl_setup(ctx, inputs, output):
    logits, ref_logits, _, mask, temperature, temperatures = inputs
    kl, lse_z, lse_w = output
    ctx.save_for_backward(logits, ref_logits, mask, kl, lse_z, lse_w, temperatures)
    ctx.temperature = temperature
    ctx.mark_non_differentiable(lse_z, lse_w)


def _full_kl_backward(ctx, grad, _grad_lse_z, _grad_lse_w):
    """The full_kl backward op on this rank's slice, given the global kl and log-sum-exps (the
    per-row temperatures' backward op where they are given)."""
    logits, ref_logits, mask, kl, lse_z, lse_w, temperatures = ctx.saved_tensors
    need_ref = ctx.needs_input_grad[1]
    if logits.shape[-1] == 0:  # an empty slice: nothing to differentiate
        gz = logits.new_zeros(logits.shape)
        gw = ref_logits.new_zeros(ref_logits.shape) if need_ref else None
    elif temperatures is not None:
        gz, gw = _backend.op("full_kl_row_temperature_backward")(
            grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperatures, need_ref
        )
    else:
        gz, gw = _backend.op("full_kl_backward")(
            grad, logits, ref_logits, mask, kl, lse_z, lse_w, ctx.temperature, need_ref
        )
    return gz, (gw if need_ref else None), None, None, None, None


_full_kl_op.register_autograd(_full_kl_backward, setup_context=_full_kl_setup)


def vocab_parallel_full_kl(logits, ref_logits, temperature, mask, process_group, temperatures=None):
    """The body of full_kl(..., process_group=...): both logits this rank's vocabulary slice;
    temperatures: per-row values (a leading part of logits.shape[:-1]) that replace temperature,
    or None (checked)."""
    require_initialized()
    temperature = float(temperature)
    acc = acc_dtype(logits.dtype)
    ts = None if temperatures is None else temperatures.detach()  # (no gradient to them)
    if logits.shape[-1] == 0:  # an empty slice: no mass, no cross term
        lz_r = torch.full(logits.shape[:-1], float("-inf"), dtype=acc, device=logits.device)
        kl_r, lw_r = torch.zeros_like(lz_r), lz_r.clone()
    elif ts is not None:  # the states carry no gradient: the merge op does
        kl_r, lz_r, lw_r = _backend.op("full_kl_row_temperature")(
            logits.detach(), ref_logits.detach(), ts, None
        )
    else:
        kl_r, lz_r, lw_r = _backend.op("full_kl")(
            logits.detach(), ref_logits.detach(), temperature, None
        )
    local = torch.stack([kl_r, lz_r, lw_r]).reshape(3, -1).to(acc)
    world = dist.get_world_size(process_group)
    gathered = _all_gather(local, process_group).view(world, -1)
    kl, _, _ = torch.ops.ppo_kernels.vocab_parallel_full_kl(
        logits, ref_logits, gathered, mask, temperature, ts
    )
    return kl.to(acc)


# ---- under the rollout sampler's distribution (top_k / top_p / min_p): the policy truncated ----
# to its kept set K (found with the other ranks by vocab_parallel_sampler.kept_set), the
# reference never: with z = (x - M) / T, w = (y - M_ref) / T relative to the global maxima,
# S = sum_K e^z and S_ref = sum e^w over every rank, KL = sum_K e^z (z - w) / S - log S + log S_ref.
# One more all-gather (the reference's row maxima) and one all-reduce ([2, N] sums) than the
# kept set's; the backward is elementwise on each slice given the kept set and KL.


def _check_kl(logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow):
    """The arguments every op of the sampled KL takes (the kept set's, the reference's max)."""
    vs.check_cut(logits, m, inv_ts, lmp, cut, allow)
    dev, acc = logits.device, acc_dtype(logits.dtype)
    check_arg("ref_logits", ref_logits, dev, like="logits", dtypes=(logits.dtype,),
              shape=logits.shape)  # fmt: skip
    check_arg("m_ref", m_ref, dev, like="logits", dtypes=(acc,), shape=m.shape)


def _kl_blocks(logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow):
    """Per row block of the slices: (r0, r1, z, kept, w) with z = (x - m) / T, w = (y - m_ref) / T
    in the accumulation dtype and the kept set's mask."""
    x, y = vs.rows_of(logits), vs.rows_of(ref_logits)
    N, V = x.shape
    acc = acc_dtype(logits.dtype)
    starts, rows = row_blocks(N, V, acc)
    for r0 in starts if V else ():
        r1 = min(N, r0 + rows)
        z, kept = vs.kept_mask(x[r0:r1].to(acc), m[r0:r1], inv_ts[r0:r1], lmp[r0:r1],
                               cut[r0:r1], allow[r0:r1])  # fmt: skip
        w = (y[r0:r1].to(acc) - m_ref[r0:r1].unsqueeze(-1)) * inv_ts[r0:r1].unsqueeze(-1)
        yield r0, r1, z, kept, w


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_kl_sums", mutates_args=())
def _kl_sums_op(
    logits: Tensor,
    ref_logits: Tensor,
    m: Tensor,
    m_ref: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    cut: Tensor,
    allow: Tensor,
) -> Tensor:
    """[2, N] sums of this slice: sum_K e^z (z - w) (0 where e^z is 0) and sum e^w."""
    args = (logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow)
    _check_kl(*args)
    out = torch.zeros((2, m.shape[0]), dtype=acc_dtype(logits.dtype), device=logits.device)
    for r0, r1, z, kept, w in _kl_blocks(*args):
        e = torch.where(kept, z.exp(), torch.zeros_like(z))
        out[0, r0:r1] = torch.where(e > 0, e * (z - w), torch.zeros_like(z)).sum(-1)
        out[1, r0:r1] = w.exp().sum(-1)
    return out


@_kl_sums_op.register_fake
def _(logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow):
    check_devices("logits", logits, ref_logits=ref_logits, m=m, m_ref=m_ref, inv_ts=inv_ts,
                  lmp=lmp, cut=cut, allow=allow)  # fmt: skip
    return logits.new_empty((2, vs.rows_of(logits).shape[0]), dtype=acc_dtype(logits.dtype))


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_kl", mutates_args=())
def _sampler_kl_op(
    logits: Tensor,
    ref_logits: Tensor,
    sums: Tensor,
    kl_sums: Tensor,
    m: Tensor,
    m_ref: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    cut: Tensor,
    allow: Tensor,
    mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, log S, log S_ref) with logits.shape[:-1] from the kept set's sums (`sums`: the
    sampler's [8, N], `kl_sums`: [2, N], each over every rank); masked rows 0, rows undefined
    without truncation NaN. The logits and the kept set are read only by the backward."""
    _check_kl(logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow)
    dev, acc, rows = logits.device, acc_dtype(logits.dtype), logits.shape[:-1]
    n = m.shape[0]
    check_arg("sums", sums, dev, like="logits", dtypes=(acc,), shape=(vs.SUMS, n))
    check_arg("kl_sums", kl_sums, dev, like="logits", dtypes=(acc,), shape=(2, n))
    check_arg("mask", mask, dev, like="logits", dtypes=(torch.bool,), shape=rows, allow_none=True)
    log_s, log_sr = sums[0].log(), kl_sums[1].log()
    kl = kl_sums[0] / sums[0] - log_s + log_sr
    bad = ~(m.isfinite() & m_ref.isfinite())
    kl = torch.where(bad, torch.full_like(kl, float("nan")), kl).view(rows)
    if mask is not None:
        kl = torch.where(mask, kl, torch.zeros_like(kl))
    return kl, log_s.view(rows), log_sr.view(rows)


@_sampler_kl_op.register_fake
def _(logits, ref_logits, sums, kl_sums, m, m_ref, inv_ts, lmp, cut, allow, mask):
    check_devices("logits", logits, ref_logits=ref_logits, sums=sums, kl_sums=kl_sums, m=m,
                  m_ref=m_ref, inv_ts=inv_ts, lmp=lmp, cut=cut, allow=allow, mask=mask)  # fmt: skip
    rows, acc = logits.shape[:-1], acc_dtype(logits.dtype)
    return tuple(logits.new_empty(rows, dtype=acc) for _ in range(3))


@torch.library.custom_op("ppo_kernels::vocab_parallel_sampler_kl_backward", mutates_args=())
def _sampler_kl_backward_op(
    grad: Tensor,
    logits: Tensor,
    ref_logits: Tensor,
    m: Tensor,
    m_ref: Tensor,
    inv_ts: Tensor,
    lmp: Tensor,
    cut: Tensor,
    allow: Tensor,
    kl: Tensor,
    log_s: Tensor,
    log_sr: Tensor,
    mask: Tensor | None,
    need_ref: bool,
) -> tuple[Tensor, Tensor]:
    """This rank's slices of the gradients of sum(grad * KL): to logits g q_j ((log q_j - log r_j)
    - KL) / T on K (0 outside), to ref_logits g (r_j - q_j) / T (an empty tensor unless
    need_ref); 0 on masked rows."""
    args = (logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow)
    _check_kl(*args)
    dev, acc, rows = logits.device, acc_dtype(logits.dtype), logits.shape[:-1]
    for name, t in (("grad", grad), ("kl", kl), ("log_s", log_s), ("log_sr", log_sr)):
        check_arg(name, t, dev, like="logits", dtypes=FLOAT_DTYPES, shape=rows, what="rows")
    check_arg("mask", mask, dev, like="logits", dtypes=(torch.bool,), shape=rows, allow_none=True)
    g = grad.reshape(-1).to(acc)
    if mask is not None:
        g = torch.where(mask.reshape(-1), g, torch.zeros_like(g))
    k, ls, lsr = (t.reshape(-1).to(acc) for t in (kl, log_s, log_sr))
    shape = vs.rows_of(logits).shape
    gz = torch.empty(shape, dtype=logits.dtype, device=dev)
    gw = torch.empty(shape if need_ref else (0,), dtype=ref_logits.dtype, device=dev)
    for r0, r1, z, kept, w in _kl_blocks(*args):
        it = inv_ts[r0:r1].unsqueeze(-1)
        logq = z - ls[r0:r1].unsqueeze(-1)
        q = torch.where(kept, logq.exp(), torch.zeros_like(logq))
        gb = g[r0:r1].unsqueeze(-1) * it
        d = (logq - (w - lsr[r0:r1].unsqueeze(-1))) - k[r0:r1].unsqueeze(-1)
        gz[r0:r1] = torch.where(q > 0, gb * q * d, torch.zeros_like(q)).to(logits.dtype)
        if need_ref:
            r = (w - lsr[r0:r1].unsqueeze(-1)).exp()
            gw[r0:r1] = (gb * (r - q)).to(ref_logits.dtype)
    return gz.view(logits.shape), gw.view(ref_logits.shape) if need_ref else gw


@_sampler_kl_backward_op.register_fake
def _(grad, logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow, kl, log_s, log_sr, mask,
      need_ref):  # fmt: skip
    check_devices("logits", logits, grad=grad, ref_logits=ref_logits, m=m, m_ref=m_ref,
                  inv_ts=inv_ts, lmp=lmp, cut=cut, allow=allow, kl=kl, log_s=log_s,
                  log_sr=log_sr, mask=mask)  # fmt: skip
    gw = ref_logits.new_empty(ref_logits.shape if need_ref else (0,))
    return logits.new_empty(logits.shape), gw


def _sampler_kl_setup(ctx, inputs, output):
    logits, ref_logits, _, _, m, m_ref, inv_ts, lmp, cut, allow, mask = inputs
    kl, log_s, log_sr = output
    ctx.save_for_backward(logits, ref_logits, m, m_ref, inv_ts, lmp, cut, allow, kl, log_s,
                          log_sr, mask)  # fmt: skip
    ctx.mark_non_differentiable(log_s, log_sr)


def _sampler_kl_backward(ctx, grad, *_):
    *saved, mask = ctx.saved_tensors
    need_ref = ctx.needs_input_grad[1]
    gz, gw = torch.ops.ppo_kernels.vocab_parallel_sampler_kl_backward(grad, *saved, mask, need_ref)
    return (gz, gw if need_ref else None) + (None,) * 9


_sampler_kl_op.register_autograd(_sampler_kl_backward, setup_context=_sampler_kl_setup)


def vocab_parallel_sampled_full_kl(
    logits, ref_logits, temperature, temps, k, ks, p, ps, mp, mps, sampler, mask, process_group
):
    """full_kl(..., process_group=..., top_k / top_p / min_p): both logits this rank's slice; the
    options as token_logprobs.api.sampler_options returns them (checked)."""
    group, acc = process_group, acc_dtype(logits.dtype)
    rows = logits.shape[:-1]
    start, derived = resolve_vocab_start(None, logits.shape[-1], group)
    # the kept set is the policy's; masked rows are ignored (their cut keeps the row whole)
    labels = torch.zeros(rows, dtype=torch.long, device=logits.device)
    if mask is not None:
        labels = labels.masked_fill(~mask, -100)
    o = vs.options(labels, temperature, temps, k, ks, p, ps, mp, mps, sampler, acc)
    if cross_checks(logits):  # the collectives below depend on these: the same on every rank
        vs.check_options(o, group, logits.device, logits.dtype)
    x, y = logits.detach(), ref_logits.detach()
    _, sums, m, cut, allow = vs.kept_set(x, labels, o, start, derived, group, -100)
    world = dist.get_world_size(group)
    m_ref = torch.ops.ppo_kernels.vocab_parallel_sampler_max(y, labels)
    m_ref = _all_gather(m_ref, group).view(world, -1).amax(0)
    kl_sums = torch.ops.ppo_kernels.vocab_parallel_sampler_kl_sums(
        x, y, m, m_ref, o.inv_ts, o.lmp, cut, allow
    )
    kl_sums = all_reduce_(kl_sums, group)
    kl, _, _ = torch.ops.ppo_kernels.vocab_parallel_sampler_kl(
        logits, ref_logits, sums, kl_sums, m, m_ref, o.inv_ts, o.lmp, cut, allow, mask
    )
    return kl
