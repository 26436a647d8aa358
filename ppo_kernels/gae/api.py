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
    """Generalised advantage estimation in one chunked reverse scan, with no Python loop over time.

    Only action positions (mask != 0) take part in the recursion. For an action t with next action
    n(t) in its row: `delta = r[t] + gamma * V[n(t)] - V[t]` and
    `A[t] = delta + gamma * lam * A[n(t)]`, with `returns = A + V`. A done at t cuts both links.
    A masked position carries the next action's advantage, as verl's
    `compute_gae_advantage_return`.

    Args:
        rewards (Tensor): `[B, T]`, or `[total]` with `cu_seqlens`. float32 / bfloat16 / float16
            (float64 runs the float64 eager path). The math runs in float32.
        values (Tensor): rewards' shape, a float dtype (mixed dtypes compute in float32). The
            critic's values.
        mask (Tensor, optional): rewards' shape, bool / integer / float; nonzero marks an action.
            Default None: every position is an action. For OpenRLHF's semantics pass
            `rewards * mask, values * mask` and no mask; TRL's is no mask.
        gamma (float | Tensor): the discount. A float, or a float tensor broadcastable to rewards
            (per-token discounting). Default 1.0.
        lam (float | Tensor): the GAE lambda, as gamma. Default 1.0.
        dones (Tensor, optional): rewards' shape, bool. True where the episode terminates right
            after t: nothing flows back across it. Default None.
        bootstrap_value (Tensor, optional): `[B]` (`[n]` when packed), a float dtype. The value
            after the last position of a truncated row. Not with `carry`. Default None: every row
            terminated (next value 0).
        cu_seqlens (Tensor, optional): `[n + 1]`, int32 / int64. Offsets of n packed rows in the
            1-D inputs. Default None.
        carry (tuple[Tensor, Tensor], optional): `(next_value, next_advantage)`, each `[B]` (`[n]`
            when packed). The state flowing in from the right edge, from the chunk or rank that
            holds each row's continuation. `bootstrap_value` is the carry `(bootstrap_value, 0)`.
            Default None.
        return_carry (bool): also return the carry at the left edge, in that form. Default False.
        process_group (ProcessGroup, optional): the sequence-parallel form. Each rank holds a
            contiguous time slice `[B, T_rank]` of the same rows, rank 0 the start. Every rank gets
            its slice of the whole-row result, from one all-gather of per-row affine carry maps.
            `bootstrap_value` / `carry` belong to the last rank. Packed: each rank holds a
            contiguous slice `[N_rank]` of the stream (rows may span ranks); `cu_seqlens` is the
            stream's offsets minus this rank's first token index; `bootstrap_value` / `carry` are
            per row, the same on every rank; no `return_carry`. Default None.

    Returns:
        tuple[Tensor, Tensor]: `(advantages, returns)`, rewards' shape, float32 (float64 for
        float64 input). With `return_carry=True`, `(advantages, returns, carry)`. GAE has no
        gradient: the outputs refuse backward.

    Why: verl, OpenRLHF and TRL run GAE as a Python loop over T, one small kernel per token. The
    recursion is affine in the carry, so chunks of the row are scanned in parallel and joined by
    their carries; the same carry crosses ranks. Formulas: docs/ppo-math.md ("GAE"). Edge cases:
    ppo_kernels/gae/naive.py. Sequence-parallel form: ppo_kernels/distributed/sequence_parallel.py.
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
        # and that gamma / lam are finite, naming them): a small call is mostly this overhead
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
