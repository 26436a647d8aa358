"""The Python side of the registered op `ppo_kernels::gae`, defined in C++ (csrc/ops/gae.cpp:
schema, checks, routing, and a backward that refuses): its fake kernel and its triton / eager
implementations. The cpp backend is csrc/cpu/gae.cpp and csrc/cuda/gae.cu. Semantics and edge
cases: ppo_kernels/gae/naive.py.

The implementations get what the C++ op passes on: rewards / values [B, T] of one dtype, or flat
[N] with int32 cu_seqlens; mask / dones bool or None; gamma_t / lam_t per-token tensors (both or
neither) in the accumulation dtype; init_value / init_adv [rows] in the accumulation dtype or
None. They return (advantages, returns, carry_value, carry_adv)."""

from __future__ import annotations

from .. import _backend
from .._checks import check_devices
from .._math import acc_dtype
from . import naive

# CUDA: the cpp kernel (a chunked scan with a carry pass), the fastest in
# bench/results/gpu_H200.md.
_backend.register_op("gae", kernel="gae_fwd", triton=True, cuda_default="cpp", folder="gae")
_backend.routes_in_cpp("gae")


def _rows(rewards, cu_seqlens):
    """(n_rows, row_len): row_len -1 for packed rows."""
    if cu_seqlens is not None:
        return cu_seqlens.shape[0] - 1, -1
    return rewards.shape[0], rewards.shape[-1]


def _check_devices(rewards, values, mask, dones, gamma_t, lam_t, init_value, init_adv, cu_seqlens):
    """As the C++ checks (a meta tensor sends a call to the fake whatever the other arguments'
    devices)."""
    check_devices(
        "rewards", rewards, values=values, mask=mask, dones=dones, gamma_t=gamma_t, lam_t=lam_t,
        init_value=init_value, init_adv=init_adv, cu_seqlens=cu_seqlens,
    )  # fmt: skip


@_backend.fake("gae")
def _(rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu_seqlens):
    _check_devices(rewards, values, mask, dones, gamma_t, lam_t, init_value, init_adv, cu_seqlens)
    out = acc_dtype(rewards.dtype)
    n_rows, _ = _rows(rewards, cu_seqlens)
    return (
        rewards.new_empty(rewards.shape, dtype=out),
        rewards.new_empty(rewards.shape, dtype=out),
        rewards.new_empty((n_rows,), dtype=out),
        rewards.new_empty((n_rows,), dtype=out),
    )


@_backend.impl("gae", "triton")
def _(rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu_seqlens):
    from . import triton_kernels

    n_rows, row_len = _rows(rewards, cu_seqlens)

    def flat(x):
        return None if x is None else x.contiguous().view(-1)

    adv, ret, cv, ca = triton_kernels.gae(
        flat(rewards),
        flat(values),
        flat(mask),
        flat(dones),
        flat(gamma_t),
        flat(lam_t),
        gamma,
        lam,
        None if init_value is None else init_value.contiguous(),
        None if init_adv is None else init_adv.contiguous(),
        cu_seqlens,
        n_rows,
        row_len,
    )
    return adv.view(rewards.shape), ret.view(rewards.shape), cv, ca


@_backend.impl("gae", "eager")
def _(rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu_seqlens):
    adv, ret, cv, ca = naive.gae_eager(
        rewards,
        values,
        mask,
        gamma if gamma_t is None else gamma_t,
        lam if lam_t is None else lam_t,
        dones,
        init_value,
        init_adv,
        cu_seqlens,
    )
    return adv.contiguous(), ret.contiguous(), cv.clone(), ca.clone()


# Without the compiled extension: the eager implementation on detached inputs (GAE has no gradient).
@_backend.fallback("gae")
def _(rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu_seqlens):
    _check_devices(rewards, values, mask, dones, gamma_t, lam_t, init_value, init_adv, cu_seqlens)

    def d(t):
        return None if t is None else t.detach()

    eager = _backend.python_impl("gae", "eager")
    dones = None if dones is None else dones != 0
    args = (d(gamma_t), d(lam_t), gamma, lam, d(init_value), d(init_adv), cu_seqlens)
    return eager(d(rewards), d(values), mask, dones, *args)
