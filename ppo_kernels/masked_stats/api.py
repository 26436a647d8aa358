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
    """Mean of x over the positions where mask != 0 (over `dim`, or everything when None),
    weighted by the mask's values when it is a float mask: `sum(x * mask) / sum(mask)`.
    Masked-out entries never contribute, even when NaN. A set with no position (zero total weight)
    gives 0 with `empty="zero"` (verl divides by count + 1e-8 and gets 0 too) and NaN with
    `empty="nan"` (OpenRLHF's 0 / 0). Differentiable in x. float32 (float64 for float64 x).
    process_group: the mean over the data of every rank of this torch.distributed group (dim must
    be None), with one all-gather of four numbers per rank and no host sync."""
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
    """`(x - mean) * rsqrt(var + eps)` with the mean and variance over mask != 0 (one set for
    the whole tensor, as verl and OpenRLHF do); `shift_mean=False` adds the mean back.
    `unbiased` uses the n - 1 (Bessel) variance like verl; False the biased one. A float mask
    weights each position by its value, n being the total weight (verl's formulas).
    verl raises when unbiased and the mask total is 0 or 1; that needs a host sync, so
    here the result is NaN instead, and `ppo_kernels.strict_checks()` raises like verl.
    Every position is whitened (masked ones too), as in verl. float32 (float64 for float64 x).
    Differentiable in x. Any finite input gives a finite, correct result (statistics accumulated
    in float64 by the CPU kernel; the float32 eager code scales by a power of two near max |x|).
    process_group: mean and variance over the data of every rank of this torch.distributed group
    (global whitening), with one all-gather of three numbers per rank and no host sync."""
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
