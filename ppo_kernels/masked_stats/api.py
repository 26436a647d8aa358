"""The public API of the masked statistics: `masked_mean` and `masked_whiten`, with no host
synchronisation (verl's versions check the mask count on the host twice per call). Tensor checks
(dtype, shape, device) run once, in the registered ops (csrc/ops/masked_stats.cpp); this layer
checks the Python scalars and routes `process_group=` to the data-parallel form."""

from __future__ import annotations

from torch import Tensor

from .. import _backend
from .._checks import check_bool, check_float
from . import op  # noqa: F401  (registers the ops' Python side)

_mean = _backend.op("masked_mean")
_whiten = _backend.op("masked_whiten")
_EMPTY = ("zero", "nan")


def _dims(dim):
    """None, or the dims as a list (an int or a sequence of ints)."""
    if dim is None:
        return None
    return [dim] if isinstance(dim, int) else list(dim)


def masked_mean(
    x: Tensor, mask: Tensor, dim=None, *, empty: str = "zero", process_group=None
) -> Tensor:
    """Mean of x over the positions where mask != 0, with no host sync.

    `sum(x * mask) / sum(mask)` over `dim` (everything when None). A float mask weights each
    position by its value. A masked-out entry never contributes, even when it is NaN.

    Args:
        x (Tensor): `[...]`, float32 / bfloat16 / float16 / float64. The gradient flows to it.
        mask (Tensor): x's shape, bool / integer / float.
        dim (int | Sequence[int], optional): the dimensions to reduce. Default None: all of them.
        empty (str): the result over no position (zero total weight): "zero" gives 0, as verl's
            division by `count + 1e-8`; "nan" gives NaN, as OpenRLHF's 0 / 0. Default "zero".
        process_group (ProcessGroup, optional): the mean over the data of every rank of this
            group (`dim` must be None), from one all-gather of four numbers per rank.
            Default None.

    Returns:
        Tensor: `x.shape` without the reduced dimensions (0-dim for dim=None), float32 (float64
        for float64 x).

    Why: verl's `masked_mean` reads the mask count on the host; this one keeps the count on the
    device, so a training step stays free of syncs. Formulas: docs/ppo-math.md
    ("Advantage post-processing"). Data-parallel form: ppo_kernels/distributed/data_parallel.py.
    """
    if empty not in _EMPTY:
        raise ValueError(f"empty: expected one of {_EMPTY}, got {empty!r}")
    if process_group is not None:
        if dim is not None:
            raise ValueError(
                "dim: a data-parallel masked_mean (process_group) reduces everything; pass dim=None"
            )
        from ..distributed.data_parallel import mean_global

        return mean_global(x, mask, empty, process_group)
    return _mean(x, mask, _dims(dim), empty)


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
    process_group=None,
) -> Tensor:
    """Whiten x with the mean and variance of its unmasked positions, with no host sync.

    `(x - mean) * rsqrt(var + eps)`, one mean and variance over all mask != 0 positions, as verl
    and OpenRLHF do. Every position is whitened, masked ones too. A float mask weights each
    position, n being the total weight.

    Args:
        x (Tensor): `[...]`, float32 / bfloat16 / float16 / float64. The gradient flows to it.
        mask (Tensor): x's shape, bool / integer / float.
        shift_mean (bool): subtract the mean. False adds it back after scaling (verl's
            `shift_mean=False`). Default True.
        unbiased (bool): the n - 1 (Bessel) variance, as verl. False: the biased one, as OpenRLHF.
            With n <= 1 the unbiased result is NaN; under `strict_checks()` it raises, as verl does.
            Default True.
        eps (float): added to the variance; non-negative. Default 1e-8.
        process_group (ProcessGroup, optional): mean and variance over the data of every rank of
            this group (global whitening), from one all-gather of three numbers per rank.
            Default None.

    Returns:
        Tensor: x's shape, float32 (float64 for float64 x). Any finite input gives a finite
        result: the CPU kernel sums in float64 and the float32 eager path scales by a power of two.

    Why: verl's `masked_whiten` checks the mask count on the host twice per call; raising needs
    that sync, so here an undefined variance is NaN unless strict checks are on. Formulas:
    docs/ppo-math.md ("Advantage post-processing").
    """
    shift_mean = check_bool("shift_mean", shift_mean)
    unbiased = check_bool("unbiased", unbiased)
    eps = check_float("eps", eps, nonneg=True)
    if process_group is not None:
        from ..distributed.data_parallel import whiten_global

        return whiten_global(x, mask, shift_mean, unbiased, eps, process_group)
    out = _whiten(x, mask, shift_mean, unbiased, eps)
    if unbiased and _backend.strict():  # a host sync, by request
        n = float(mask.double().sum() if mask.is_floating_point() else (mask != 0).sum())
        if n in (0.0, 1.0):
            raise ValueError(
                f"mask: masked_whiten with unbiased=True needs at least two unmasked "
                f"positions, got {n:g}"
            )
    return out
