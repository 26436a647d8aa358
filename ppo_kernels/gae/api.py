"""The public API of GAE: `gae` (typed arguments, defaults, the sequence-parallel routing). Tensor
checks (dtype, shape, device, CPU offsets) run once, in the registered op (csrc/ops/gae.cpp); this
layer checks what only it sees (Python scalars, per-token gamma / lam, the carry's form, dtype
promotion) and names the public arguments (bootstrap_value, carry)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bool,
    check_float,
    check_shape,
    check_tensor,
    device_error,
)
from . import op  # noqa: F401  (registers the op's Python side)

_gae = _backend.op("gae")


def _per_token(name, x, rewards):
    """A float stays a float; a tensor is broadcast to rewards' shape (the op converts its dtype)."""
    if not isinstance(x, Tensor):
        return check_float(name, x)
    check_tensor(name, x, dtypes=FLOAT_DTYPES)
    check_tensor("rewards", rewards)
    if x.device != rewards.device:
        raise device_error(name, x, rewards.device, "rewards")
    try:
        return x.expand(rewards.shape)
    except RuntimeError:
        raise ValueError(
            f"{name}: shape {tuple(x.shape)} does not broadcast to rewards' {tuple(rewards.shape)}"
        ) from None


def _per_row(name, t, n_rows, rewards):
    check_tensor(name, t, dtypes=FLOAT_DTYPES)
    check_shape(name, t, (n_rows,), "one per row")
    if t.device != rewards.device:
        raise device_error(name, t, rewards.device, "rewards")
    return t


def _check_cu_seqlens(cu: Tensor, total: int):
    """Offsets on the GPU, read on the host (a sync) under strict_checks(); the op checks CPU
    offsets itself."""
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
    GAE has no gradient: the outputs refuse backward. See ppo_kernels/gae/naive.py for the
    documented semantics and edge cases.
    """
    if (
        type(gamma) is float
        and type(lam) is float
        and return_carry is False
        and carry is None
        and bootstrap_value is None
        and cu_seqlens is None
        and process_group is None
        and type(rewards) is Tensor
        and type(values) is Tensor
        and rewards.dtype is values.dtype
    ):
        # the common call: nothing for this layer to check or convert (the op checks the tensors
        # and that gamma / lam are finite, naming them); ~2 us of the 2 x 8 call
        adv, ret, _, _ = _gae(
            rewards, values, mask, dones, None, None, gamma, lam, None, None, None
        )
        return adv, ret
    return_carry = check_bool("return_carry", return_carry)
    if carry is not None and not (isinstance(carry, (tuple, list)) and len(carry) == 2):
        raise TypeError("carry: expected a pair (next_value, next_advantage)")
    if bootstrap_value is not None and carry is not None:
        raise ValueError(
            "bootstrap_value and carry: pass one (a bootstrap value is the carry "
            "(bootstrap_value, 0) of a truncated row)"
        )
    if (
        isinstance(values, Tensor)
        and isinstance(rewards, Tensor)
        and values.dtype != rewards.dtype
        and values.dtype in FLOAT_DTYPES
        and rewards.dtype in FLOAT_DTYPES
    ):
        acc = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
        rewards, values = rewards.to(acc), values.to(acc)
    g = _per_token("gamma", gamma, rewards)
    lm = _per_token("lam", lam, rewards)
    gamma_t = lam_t = None
    if isinstance(g, Tensor) or isinstance(lm, Tensor):
        gamma_t = g if isinstance(g, Tensor) else torch.full_like(lm, g)
        lam_t = lm if isinstance(lm, Tensor) else torch.full_like(gamma_t, lm)
        g = lm = 1.0
    init_value = init_adv = None
    if bootstrap_value is not None or carry is not None or process_group is not None:
        check_tensor(
            "rewards", rewards, dtypes=FLOAT_DTYPES, dim=1 if cu_seqlens is not None else 2
        )
        if cu_seqlens is not None:
            check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, dim=1)
            if cu_seqlens.shape[0] < 1:
                raise ValueError("cu_seqlens: expected at least one entry (n + 1 offsets)")
        n_rows = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else rewards.shape[0]
        if bootstrap_value is not None:
            init_value = _per_row("bootstrap_value", bootstrap_value, n_rows, rewards)
        if carry is not None:
            init_value = _per_row("carry[0]", carry[0], n_rows, rewards)
            init_adv = _per_row("carry[1]", carry[1], n_rows, rewards)
    args = (rewards, values, mask, dones, gamma_t, lam_t, g, lm, init_value, init_adv, cu_seqlens)
    if process_group is not None:
        from ..distributed.sequence_parallel import sequence_parallel_gae

        return sequence_parallel_gae(*args, return_carry=return_carry, process_group=process_group)
    if (
        cu_seqlens is not None
        and _backend.strict()
        and isinstance(cu_seqlens, Tensor)
        and cu_seqlens.device.type != "cpu"
        and not torch.compiler.is_compiling()
    ):
        _check_cu_seqlens(cu_seqlens, rewards.numel())  # a host sync, by request
    adv, ret, cv, ca = _gae(*args)
    if return_carry:
        return adv, ret, (cv, ca)
    return adv, ret
