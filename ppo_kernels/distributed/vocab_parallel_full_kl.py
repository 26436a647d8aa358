"""Vocab-parallel full_kl: both logits vocab-sharded (Megatron's layout). Per rank, the full_kl
kernel on its slice gives (kl_r, lse_z_r, lse_w_r); one all-gather of those three per-row numbers
and the merge give the exact KL; the backward is elementwise given the global kl and log-sum-exps
(the full_kl backward op on each slice), no collective."""

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
from ._comm import all_gather as _all_gather
from ._comm import require_initialized

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
