"""Process-wide settings the kernels read, mirrored into C++: strict input checks and
batch-invariant mode, with the helpers that make the eager kernels batch-invariant.

Process-wide, not thread-local: autograd's backward threads see them too. (The mode names that
cross the op schemas as strings are in _modes.py.)"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from ._extension import HAS_EXTENSION

_strict = [os.environ.get("PPO_KERNELS_STRICT", "0") == "1"]


@contextlib.contextmanager
def strict_checks(enabled: bool = True):
    """Context manager: check data-dependent inputs on the GPU too, at the cost of a host sync.

    Label ranges, group ids and packed offsets are checked on the CPU always. On the GPU such a
    check needs a host sync. So by default the GPU kernels give the documented NaN instead, never
    reading out of bounds; under `strict_checks()` they raise, naming the argument. It also makes
    `masked_whiten(unbiased=True)` raise on fewer than two unmasked positions, as verl does.
    Process-wide; blocks nest. Also PPO_KERNELS_STRICT=1.

    Args:
        enabled (bool): turn the checks on (True) or off (False) inside the block. Default True.

    Returns:
        ContextManager[None]: the block's scope.

    Why: a training step without host syncs stays fast and capturable; strict checks are for
    debugging a bad batch.
    """
    _strict.append(enabled)
    _mirror_strict()
    try:
        yield
    finally:
        _strict.pop()
        _mirror_strict()


def _mirror_strict():
    """The registered ops defined in C++ read the setting there (csrc/ops/route.h)."""
    if HAS_EXTENSION:
        torch.ops.ppo_kernels_C.set_strict(_strict[-1])


def strict() -> bool:
    return _strict[-1]


_mirror_strict()


_invariant = [os.environ.get("PPO_KERNELS_BATCH_INVARIANT", "0") == "1"]


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Context manager: batch-invariant mode, per-token outputs independent of the rest of the call.

    It covers every per-token output of `token_logprobs`, `linear_token_logprobs` /
    `causal_lm_logprobs`, `full_kl` and `linear_policy_loss` (its per-token statistics). Each is
    bitwise the same whatever else is in the call: other rows, padding, layout, micro-batch
    split, chunk budget, ignored rows, CPU threads. Process-wide, like `strict_checks`
    (autograd's backward threads see it). Also PPO_KERNELS_BATCH_INVARIANT=1.

    Args:
        enabled (bool): turn the mode on (True) or off (False) inside the block. Default True.

    Returns:
        ContextManager[None]: the block's scope.

    Why: on-policy PPO / GRPO assume a token's log-prob at rollout scoring equals its log-prob in
    the first update. Kernels whose tiling follows the batch differ in the last bits, so the first
    ratio is not 1 and clipping fires on noise. Fixed tile shapes remove that. Its cost:
    bench/results/cpu_batch_invariant.md; the README's "Batch-invariant mode".
    """
    _invariant.append(bool(enabled))
    _sync_invariant()
    try:
        yield
    finally:
        _invariant.pop()
        _sync_invariant()


def _sync_invariant():
    """The C++ side's copy of the mode (the CUDA launchers read it)."""
    if HAS_EXTENSION and hasattr(torch.ops.ppo_kernels_C, "set_batch_invariant"):
        torch.ops.ppo_kernels_C.set_batch_invariant(_invariant[-1])


def invariant() -> bool:
    """Whether batch-invariant mode is on."""
    return _invariant[-1]


if _invariant[-1]:
    _sync_invariant()


# Rows per block of the eager kernels in batch-invariant mode: a multiple of 32, so that a block of
# float32 rows never ends in the scalar remainder of a vectorised loop (8 or 16 lanes, two vectors
# per step), whatever V is.
EAGER_ROW_BLOCK = 64


@contextlib.contextmanager
def invariant_threads():
    """In batch-invariant mode, torch's intra-op threads set to 1 for the block (the eager math): a
    parallel elementwise op splits its flat range at thread-count-dependent points, and each piece
    ends in a scalar remainder whose exp / log may differ in the last bit from the vectorised
    loop's. Outside the mode: nothing."""
    n = torch.get_num_threads()
    if n == 1 or not invariant():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def invariant_rows(fn, rows: tuple, *args):
    """fn(*args) for the eager kernels; in batch-invariant mode computed in blocks of exactly
    EAGER_ROW_BLOCK rows (the last one padded with zero rows) on one thread, so that no row's
    result depends on the other rows, their number or the layout. Tensor arguments whose leading
    dims are `rows` are split (the others pass whole); each output of fn is a tensor whose
    leading dim is the block's rows, an empty tensor or None (passed through)."""
    rows = tuple(rows)
    k, n = len(rows), math.prod(rows)
    if not invariant() or n == 0:
        return fn(*args)
    split = [
        isinstance(a, torch.Tensor) and a.numel() > 0 and tuple(a.shape[:k]) == rows for a in args
    ]
    flat = [a.reshape((n,) + tuple(a.shape[k:])) if s else a for a, s in zip(args, split)]
    B = EAGER_ROW_BLOCK
    pieces = []
    with invariant_threads():
        for r0 in range(0, n, B):
            m = min(n - r0, B)
            block = []
            for a, s in zip(flat, split):
                if s:
                    padded = a.new_zeros((B,) + tuple(a.shape[1:]))
                    padded[:m] = a[r0 : r0 + m]
                    a = padded
                block.append(a)
            out = fn(*block)
            outs = out if isinstance(out, tuple) else (out,)
            pieces.append([o[:m] if _nonempty(o) else o for o in outs])
    joined = tuple(
        torch.cat([p[i] for p in pieces]).reshape(rows + tuple(o.shape[1:])) if _nonempty(o) else o
        for i, o in enumerate(pieces[0])
    )
    return joined if isinstance(out, tuple) else joined[0]


def _nonempty(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() > 0
