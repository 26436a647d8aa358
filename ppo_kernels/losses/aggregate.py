"""Aggregation over a mask, verl's `agg_loss` modes plus "token-sum": the public
`masked_aggregate` and the aggregation arguments every loss API shares (`aggregation`,
`apply_empty`, `apply_empty_stats`).

`masked_aggregate` is for every per-token term a trainer aggregates the way the fused losses do
inside their kernels (entropy bonus, KL loss, a custom policy loss). It runs the registered op
`ppo_kernels::masked_aggregate` (ppo_kernels/losses/op.py, csrc/ops/losses.cpp): on the CPU one
C++ pass for the forward and one for the backward (d loss / d loss_mat = row_coef[b] * mask, zero
where mask == 0); on the GPU a composition of torch ops (a memory-bound reduction).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_devices, check_float, check_int, check_str, check_tensor
from .._math import acc_dtype
from . import op  # noqa: F401  (registers the ops' Python side)
from .config import AGG_NAMES, AggregationConfig
from .policy_math import default_aggregation

_masked_aggregate = _backend.op("masked_aggregate")
VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MASK_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
) + VALUE_DTYPES


def rows(t: Tensor) -> Tensor:
    """[..., T] -> [B, T] (not (-1, T): T may be 0)."""
    return t if t.dim() == 2 else t.reshape(t.shape[:-1].numel(), t.shape[-1])


def memo(cache: dict, fn, *args):
    """fn(*args) for checked scalar arguments, remembered per argument values *and types* (True
    and 1 are equal keys, but only 1 is a number): a repeated call skips its argument checks.
    Never while tracing (symbolic values), never for unhashable arguments; fn must return an
    immutable value and raise on every bad argument (a raising call is not remembered)."""
    if torch.compiler.is_compiling():
        return fn(*args)
    types = tuple(map(type, args))
    try:
        hit = cache.get(args)
    except TypeError:
        return fn(*args)
    if hit is not None and hit[0] == types:
        return hit[1]
    out = fn(*args)
    if len(cache) < 256:
        cache[args] = (types, out)
    return out


def policy_aggregation(cfg: AggregationConfig, loss_type: str, B: int, T: int, device, like):
    """`aggregation` of a policy loss over B rows of T tokens (on `device`, that of its argument
    `like`): agg=None takes the loss type's default (and TRL's types count every row); geo_mean
    takes no other."""
    agg, gbs = cfg.agg, cfg.global_batch_size
    if agg is None:
        agg, all_rows = default_aggregation(loss_type)
        if all_rows and gbs is None:
            gbs = B  # TRL: every row counts
    elif loss_type == "geo_mean":
        raise ValueError(
            "agg: geo_mean averages its per-sequence losses over the rows; leave agg None"
        )
    return aggregation(
        agg, T, cfg.dp_size, cfg.global_num_tokens, gbs, cfg.loss_scale_factor, device, like
    )


_AGGREGATIONS: dict = {}


def aggregation(
    agg, T, dp_size, global_num_tokens, global_batch_size, loss_scale_factor, device, like
):
    """(agg, scale, global_denom tensor or None, global_denom value or None), remembered per
    argument set when no denominator is a tensor.

    "token-sum" is token-mean over a denominator of 1. A normaliser the mode does not use
    (global_batch_size for the token modes, global_num_tokens for the sequence modes,
    loss_scale_factor outside seq-mean-token-sum-norm) is ignored, as verl's agg_loss does: verl
    passes all of them whatever the mode; tensors are on the loss's device (`device`, that of its
    argument `like`) all the same."""
    args = (agg, T, dp_size, global_num_tokens, global_batch_size, loss_scale_factor, device)
    if isinstance(global_num_tokens, Tensor) or isinstance(global_batch_size, Tensor):
        check_devices(
            like,
            device,
            global_num_tokens=global_num_tokens if isinstance(global_num_tokens, Tensor) else None,
            global_batch_size=global_batch_size if isinstance(global_batch_size, Tensor) else None,
        )
        return _aggregation(*args)
    return memo(_AGGREGATIONS, _aggregation, *args)


def _aggregation(agg, T, dp_size, global_num_tokens, global_batch_size, loss_scale_factor, device):
    check_str("agg", agg, AGG_NAMES)
    dp_size = check_int("dp_size", dp_size, min_value=1)
    if loss_scale_factor is not None:
        loss_scale_factor = check_float("loss_scale_factor", loss_scale_factor, positive=True)
    if agg == "token-sum":
        return "token-mean", float(dp_size), None, 1.0
    token = agg == "token-mean"
    denom, name = (
        (global_num_tokens, "global_num_tokens")
        if token
        else (global_batch_size, "global_batch_size")
    )
    if denom is None and dp_size > 1:
        raise ValueError(
            f"{name}: required when dp_size > 1 (the data-parallel total of "
            f"{'action tokens' if token else 'non-empty sequences'})"
        )
    scale = float(dp_size)
    if agg == "seq-mean-token-sum-norm":
        # default: T, as verl; T = 0 has no token, the loss is 0 whatever the factor
        lsf = max(T, 1) if loss_scale_factor is None else loss_scale_factor
        scale /= float(lsf)
    if isinstance(denom, Tensor):
        if denom.numel() != 1:
            raise ValueError(f"{name}: expected a single value, got shape {tuple(denom.shape)}")
        return agg, scale, denom.reshape(()), None
    if denom is not None:
        return agg, scale, None, check_float(name, denom, nonneg=True)
    return agg, scale, None, None


def _denominator(agg, mask, gd, gdv):
    """The aggregation's denominator as a 0-dim tensor (no host sync): the global one when given,
    else the mask total (token-mean) or the number of non-empty rows (sequence modes)."""
    if gd is not None:
        return gd
    if gdv is not None:
        return torch.full((), gdv, device=mask.device)
    m = rows(mask)
    if agg == "token-mean":
        return m.sum(dtype=acc_dtype(m.dtype))
    return (m != 0).any(-1).sum()


def apply_empty(loss, agg, mask, gd, gdv, empty):
    """empty="zero": as computed (0 over a zero denominator); "nan": NaN there, as verl's and
    OpenRLHF's 0 / 0."""
    if empty == "zero":
        return loss
    if empty != "nan":
        raise ValueError(f"empty: expected 'zero' or 'nan', got {empty!r}")
    d = _denominator(agg, mask, gd, gdv)
    return torch.where(
        d != 0, loss, torch.full((), float("nan"), dtype=loss.dtype, device=loss.device)
    )


def apply_empty_stats(stats, mask, empty):
    """empty="zero": the statistics as computed (0 over an empty mask); "nan": NaN there."""
    if empty == "zero":
        return stats
    if empty != "nan":
        raise ValueError(f"empty_stats: expected 'zero' or 'nan', got {empty!r}")
    some = (mask != 0).any()
    return {
        k: torch.where(some, v, torch.full((), float("nan"), dtype=v.dtype, device=v.device))
        for k, v in stats.items()
    }


def masked_aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    *,
    dp_size: int = 1,
    global_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
    empty: str = "zero",
) -> Tensor:
    """Aggregate a per-token loss over the mask into one number, as verl's `agg_loss`.

    With l the per-token loss and S the number of rows with a non-empty mask (or
    `global_batch_size`):

      token-mean               sum(mask * l) / N * dp_size     (N = global_num_tokens or sum(mask))
      token-sum                sum(mask * l) * dp_size
      seq-mean-token-sum       sum_b sum_t(mask * l) / S * dp_size
      seq-mean-token-mean      sum_b [sum_t(mask * l) / sum_t mask] / S * dp_size
      seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor   (default: T)

    A position with mask 0 never contributes, even when l is NaN there.

    Args:
        loss_mat (Tensor): `[..., T]`, float32 / bfloat16 / float16 / float64. The per-token
            loss; the leading dimensions are the sequences. The gradient flows to it.
        mask (Tensor): loss_mat's shape, bool / integer / float. A float mask weights tokens.
        agg (str): one of the modes above. Default "token-mean".
        dp_size (int): the data-parallel world size the loss is scaled by, as verl. Default 1.
        global_num_tokens (float | Tensor, optional): the data-parallel total of mask tokens
            (token modes), a number or a one-element tensor (no host sync). Required when
            dp_size > 1 for a token mode. Default None: sum(mask).
        global_batch_size (float | Tensor, optional): the data-parallel total of non-empty
            sequences (sequence modes), as global_num_tokens. Default None: S of this batch.
        loss_scale_factor (float, optional): seq-mean-token-sum-norm's divisor; positive.
            Default None: T.
        empty (str): the result over a zero denominator: "zero" gives 0; "nan" gives NaN, as
            verl's 0 / 0 without global normalisers (the gradient stays 0). Default "zero".

    Returns:
        Tensor: 0-dim, float32 (float64 for float64 loss_mat).

    Why: torch's NaN-safe masked select costs several passes on the CPU; the C++ kernel is one
    (bench/bench_overhead.py, results in bench/results/cpu_overhead*.md). On CUDA it runs that
    composition. A normaliser the mode does not use is ignored, since verl passes them all.
    Formulas: docs/ppo-math.md ("PPO losses").
    """
    check_tensor("loss_mat", loss_mat, dtypes=VALUE_DTYPES, min_dim=1)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    if mask.shape != loss_mat.shape:
        raise ValueError(
            f"mask: expected shape {tuple(loss_mat.shape)} (like loss_mat), got {tuple(mask.shape)}"
        )
    check_devices("loss_mat", loss_mat, mask=mask)
    mode, scale, gd, gdv = aggregation(
        agg,
        loss_mat.shape[-1],
        dp_size,
        global_num_tokens,
        global_batch_size,
        loss_scale_factor,
        loss_mat.device,
        "loss_mat",
    )
    loss, _ = _masked_aggregate(rows(loss_mat), rows(mask), mode, scale, gd, gdv)
    return apply_empty(loss, mode, mask, gd, gdv, empty)
