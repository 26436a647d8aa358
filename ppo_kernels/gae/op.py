"""gae as a torch op: `ppo_kernels::gae`, with a fake kernel and an autograd rule that refuses.
Each call picks a backend (see ppo_kernels/_backend.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_bool,
    check_float,
    check_same_device,
    check_shape,
    check_tensor,
)
from . import reference

OP = _backend.register_op("gae", kernel="gae_fwd", triton=True, cuda_default="cpp")


# The kernel, one implementation per backend with one signature: flat (contiguous, 1-D) inputs,
# gamma_t / lam_t per-token tensors or None (then the floats), n_rows rows of row_len tokens or
# packed by cu_seqlens (row_len -1). Returns (adv, returns, carry_value, carry_adv), flat.
forward = _backend.Kernel("gae", "forward")


@forward.impl("cpp")
def _(
    rewards,
    values,
    mask,
    dones,
    gamma_t,
    lam_t,
    gamma,
    lam,
    init_value,
    init_adv,
    cu_seqlens,
    n_rows,
    row_len,
):
    return _backend.cpp_ops().gae_fwd(
        rewards,
        values,
        mask,
        dones,
        gamma_t,
        lam_t,
        gamma,
        lam,
        init_value,
        init_adv,
        cu_seqlens,
        n_rows,
        row_len,
    )


@forward.impl("triton")
def _(
    rewards,
    values,
    mask,
    dones,
    gamma_t,
    lam_t,
    gamma,
    lam,
    init_value,
    init_adv,
    cu_seqlens,
    n_rows,
    row_len,
):
    from . import triton_kernels

    return triton_kernels.gae(
        rewards,
        values,
        mask,
        dones,
        gamma_t,
        lam_t,
        gamma,
        lam,
        init_value,
        init_adv,
        cu_seqlens,
        n_rows,
        row_len,
    )


@forward.impl("eager")
def _(
    rewards,
    values,
    mask,
    dones,
    gamma_t,
    lam_t,
    gamma,
    lam,
    init_value,
    init_adv,
    cu_seqlens,
    n_rows,
    row_len,
):
    shape = (n_rows, row_len) if cu_seqlens is None else (-1,)

    def view(x):
        return None if x is None else x.view(shape)

    adv, ret, cv, ca = reference.gae_eager(
        view(rewards),
        view(values),
        view(mask),
        gamma if gamma_t is None else view(gamma_t),
        lam if lam_t is None else view(lam_t),
        view(dones),
        init_value,
        init_adv,
        cu_seqlens,
    )
    return adv.reshape(-1), ret.reshape(-1), cv.clone(), ca.clone()


def _check_op_args(
    rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu_seqlens
):
    """What the registered op is given, whoever calls it (metadata only; see gae() for the
    normalised form)."""
    check_tensor("rewards", rewards, dtypes=FLOAT_DTYPES, dim=1 if cu_seqlens is not None else 2)
    dev, shape = rewards.device, rewards.shape
    check_arg("values", values, dev, dtypes=(rewards.dtype,), shape=shape, what="like rewards")
    for name, t in (("mask", mask), ("dones", dones), ("gamma_t", gamma_t), ("lam_t", lam_t)):
        check_arg(name, t, dev, shape=shape, what="like rewards", allow_none=True)
    if (gamma_t is None) != (lam_t is None):
        raise ValueError("gamma_t, lam_t: per-token gamma and lam come together (both or neither)")
    check_float("gamma", gamma)
    check_float("lam", lam)
    if cu_seqlens is not None:
        check_arg("cu_seqlens", cu_seqlens, dev, dtypes=(torch.int32,))
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(
                f"cu_seqlens: expected [n + 1] offsets, got shape {tuple(cu_seqlens.shape)}"
            )
        if dev.type == "cpu":
            _check_cu_seqlens(cu_seqlens, rewards.numel())
    n_rows = cu_seqlens.numel() - 1 if cu_seqlens is not None else shape[0]
    for name, t in (("init_value", init_value), ("init_adv", init_adv)):
        check_arg(
            name,
            t,
            dev,
            dtypes=(torch.float32, torch.float64),
            shape=(n_rows,),
            what="one per row",
            allow_none=True,
        )


@torch.library.custom_op("ppo_kernels::gae", mutates_args=())
def gae_op(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor | None,
    dones: Tensor | None,
    gamma_t: Tensor | None,
    lam_t: Tensor | None,
    gamma: float,
    lam: float,
    init_value: Tensor | None,
    init_adv: Tensor | None,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Normalised inputs (see gae()): rewards/values one dtype, [B, T] or flat [N] with
    cu_seqlens; mask/dones bool; gamma_t/lam_t float32 like rewards or None (then the floats);
    init_value/init_adv float32 [rows] or None. Returns (adv, returns, carry_value, carry_adv).
    The mask may also be float32 on the CPU: the C++ kernel reads it as it is (nonzero = action),
    the other backends get it as bool."""
    _check_op_args(
        rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu_seqlens
    )
    backend = forward.backend(rewards)
    if mask is not None and mask.dtype != torch.bool and not (backend == "cpp" and mask.is_cpu):
        mask = mask != 0
    n_rows = cu_seqlens.numel() - 1 if cu_seqlens is not None else rewards.shape[0]
    row_len = rewards.shape[-1] if cu_seqlens is None else -1
    flat = [
        None if x is None else x.contiguous().view(-1)
        for x in (rewards, values, mask, dones, gamma_t, lam_t)
    ]
    adv, ret, cv, ca = forward(*flat, gamma, lam, init_value, init_adv, cu_seqlens, n_rows, row_len)
    return adv.view(rewards.shape), ret.view(rewards.shape), cv, ca


@gae_op.register_fake
def _(rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu_seqlens):
    out = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    n_rows = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else rewards.shape[0]
    return (
        rewards.new_empty(rewards.shape, dtype=out),
        rewards.new_empty(rewards.shape, dtype=out),
        rewards.new_empty((n_rows,), dtype=out),
        rewards.new_empty((n_rows,), dtype=out),
    )


def _no_backward(ctx, *grads):
    raise RuntimeError(
        "ppo_kernels.gae has no backward: advantages and returns are targets, not functions to "
        "differentiate. Call it under torch.no_grad() or pass detached rewards/values."
    )


gae_op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def _as_bool(name, t, like):
    check_tensor(name, t)
    check_shape(name, t, like.shape, "like rewards")
    return t if t.dtype == torch.bool else t != 0


def _per_token(name, x, rewards):
    """A float stays a float; a tensor broadcastable to rewards becomes float32 like rewards."""
    if isinstance(x, torch.Tensor):
        check_tensor(name, x, dtypes=FLOAT_DTYPES)
        try:
            x = x.expand(rewards.shape)
        except RuntimeError:
            raise ValueError(
                f"{name}: shape {tuple(x.shape)} does not broadcast to rewards' "
                f"{tuple(rewards.shape)}"
            ) from None
        return x.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    return check_float(name, x)


def _per_row(name, t, n_rows, rewards):
    check_tensor(name, t, dtypes=FLOAT_DTYPES)
    check_shape(name, t, (n_rows,), "one per row")
    return t.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32).contiguous()


def _check_cu_seqlens(cu: Tensor, total: int):
    c = cu.long()
    ok = bool((c[0] == 0) & (c[-1] == total) & (c[1:] >= c[:-1]).all())
    if not ok:
        raise ValueError(
            f"cu_seqlens: must be non-decreasing offsets from 0 to {total} (the number "
            f"of tokens); got {cu.tolist() if cu.numel() <= 16 else 'a violating tensor'}"
        )


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor | None = None,
    *,
    gamma: float | Tensor = 1.0,
    lam: float | Tensor = 1.0,
    dones: Tensor | None = None,
    bootstrap_value: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    carry: tuple[Tensor, Tensor] | None = None,
    return_carry: bool = False,
    process_group=None,
):
    """Generalised advantage estimation in one chunked reverse scan (no Python loop over time).

    Args:
        rewards, values: `[B, T]`, or flat `[total]` with `cu_seqlens`; float32, bfloat16 or
            float16 (math in float32, float32 outputs; float64 runs the float64 reference). Mixed
            dtypes compute in float32.
        mask: bool or numeric like rewards, nonzero = action position. Masked positions are
            skipped by the recursion and carry the next action's advantage, exactly as verl's
            compute_gae_advantage_return. None: every position is an action. For OpenRLHF's
            semantics pass `rewards * mask, values * mask` and no mask; TRL's is no mask.
        gamma, lam: floats, or per-token tensors broadcastable to rewards.
        dones: bool like rewards; the episode genuinely terminates right after t (nothing flows
            back across it).
        bootstrap_value: `[B]` (one per row) value after the last position of a *truncated* row;
            None: the row terminated (next value 0).
        cu_seqlens: int32/int64 `[n + 1]` offsets of n packed rows in the flat inputs.
        carry: `(next_value[B], next_advantage[B])` flowing in from the right edge, from the chunk
            (or rank) holding the continuation of each row. Excludes bootstrap_value (which is the
            carry `(bootstrap_value, 0)`).
        return_carry: also return the carry at the left edge, `(next_value[B], next_adv[B])`.
        process_group: sequence-parallel form: each rank of this torch.distributed group holds a
            contiguous time slice `[B, T_rank]` of the same rows (rank 0 the start); every rank
            gets its slice of the whole-row result (one all-gather of per-row affine carry maps;
            see ppo_kernels/distributed/sequence_parallel.py). bootstrap_value / carry belong to
            the last rank (the right edge); the others' are ignored. Packed: `rewards` etc.
            are this rank's contiguous slice `[N_rank]` of the packed stream (rows may span
            ranks) and `cu_seqlens` the stream's `[n + 1]` row offsets minus this rank's first
            token index (`cu_seqlens - t0`: the row boundaries at their local positions);
            bootstrap_value / carry `[n]` per row, the same on every rank; no return_carry.

    Returns:
        `(advantages, returns)` float32 like rewards, or `(advantages, returns, carry)`.
    GAE has no gradient: the outputs refuse backward. See ppo_kernels/gae/reference.py for the
    documented semantics and edge cases.
    """
    if process_group is not None:
        from ..distributed import sequence_parallel_gae

        check_tensor("rewards", rewards, dtypes=FLOAT_DTYPES, dim=2 if cu_seqlens is None else 1)
        if cu_seqlens is not None:
            check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, dim=1)
            if cu_seqlens.numel() < 1:
                raise ValueError("cu_seqlens: expected at least one entry (n + 1 offsets)")
        return sequence_parallel_gae(
            gae,
            rewards,
            values,
            mask,
            gamma=gamma,
            lam=lam,
            dones=dones,
            bootstrap_value=bootstrap_value,
            cu_seqlens=cu_seqlens,
            carry=carry,
            return_carry=return_carry,
            process_group=process_group,
        )
    check_tensor("rewards", rewards, dtypes=FLOAT_DTYPES)
    check_tensor("values", values, dtypes=FLOAT_DTYPES)
    return_carry = check_bool("return_carry", return_carry)
    if carry is not None and not (isinstance(carry, (tuple, list)) and len(carry) == 2):
        raise TypeError("carry: expected a pair (next_value, next_advantage)")
    check_shape("values", values, rewards.shape, "like rewards")
    check_same_device(
        rewards=rewards,
        values=values,
        mask=mask,
        dones=dones,
        bootstrap_value=bootstrap_value,
        cu_seqlens=cu_seqlens,
        gamma=gamma if isinstance(gamma, torch.Tensor) else None,
        lam=lam if isinstance(lam, torch.Tensor) else None,
        carry_value=carry[0] if carry is not None else None,
        carry_adv=carry[1] if carry is not None else None,
    )
    if cu_seqlens is None:
        check_tensor("rewards", rewards, dim=2)
        n_rows = rewards.shape[0]
    else:
        check_tensor("rewards", rewards, dim=1)
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, dim=1)
        if cu_seqlens.numel() < 1:
            raise ValueError("cu_seqlens: expected at least one entry (n + 1 offsets)")
        if rewards.numel() >= 2**31:
            raise ValueError(
                "rewards: packed inputs are limited to 2^31 - 1 tokens (int32 offsets)"
            )
        n_rows = cu_seqlens.numel() - 1
        # host sync on the GPU, by request; under torch.compile the op checks CPU offsets itself
        if (cu_seqlens.device.type == "cpu" or _backend.strict()) and not (
            torch.compiler.is_compiling()
        ):
            _check_cu_seqlens(cu_seqlens, rewards.numel())
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    if values.dtype != rewards.dtype:
        acc = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
        rewards, values = rewards.to(acc), values.to(acc)
    if mask is not None and mask.dtype == torch.float32 and mask.is_cpu:
        check_tensor("mask", mask)  # a float 0/1 mask (verl's) is read directly: no conversion pass
        check_shape("mask", mask, rewards.shape, "like rewards")
        m = mask
    else:
        m = None if mask is None else _as_bool("mask", mask, rewards)
    d = None if dones is None else _as_bool("dones", dones, rewards)
    g = _per_token("gamma", gamma, rewards)
    lm = _per_token("lam", lam, rewards)
    gamma_t = lam_t = None
    if isinstance(g, torch.Tensor) or isinstance(lm, torch.Tensor):
        gamma_t = g if isinstance(g, torch.Tensor) else torch.full_like(lm, g)
        lam_t = lm if isinstance(lm, torch.Tensor) else torch.full_like(gamma_t, lm)
        g = lm = 1.0
    init_value = init_adv = None
    if bootstrap_value is not None and carry is not None:
        raise ValueError(
            "bootstrap_value and carry: pass one (a bootstrap value is the carry "
            "(bootstrap_value, 0) of a truncated row)"
        )
    if bootstrap_value is not None:
        init_value = _per_row("bootstrap_value", bootstrap_value, n_rows, rewards)
    if carry is not None:
        if not (isinstance(carry, (tuple, list)) and len(carry) == 2):
            raise TypeError("carry: expected a pair (next_value, next_advantage)")
        init_value = _per_row("carry[0]", carry[0], n_rows, rewards)
        init_adv = _per_row("carry[1]", carry[1], n_rows, rewards)
    adv, ret, cv, ca = torch.ops.ppo_kernels.gae(
        rewards, values, m, d, gamma_t, lam_t, float(g), float(lm), init_value, init_adv, cu_seqlens
    )
    if return_carry:
        return adv, ret, (cv, ca)
    return adv, ret
