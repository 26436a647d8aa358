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
from .._modes import AGG_MODES
from . import op  # noqa: F401  (registers the ops' Python side)
from . import policy_loss as ext

_masked_aggregate = _backend.op("masked_aggregate")

AGG_NAMES = AGG_MODES + ("token-sum",)
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


_CONFIGS: dict = {}  # the checked configurations seen so far


def checked_config(**arguments) -> ext.pm.LossConfig:
    """The checked LossConfig of a policy-loss call from its arguments (exactly ext.CONFIG_ARGS,
    by name), remembered per argument values (a repeated call skips the checks): ppo_policy_loss
    and linear_policy_loss build theirs here. The callers name each argument (not `locals()`:
    torch 2.11's Dynamo cannot trace that, and fullgraph compiles would break)."""
    if len(arguments) != len(ext.CONFIG_ARGS):
        raise TypeError(f"checked_config: expected the arguments {ext.CONFIG_ARGS}")
    return memo(_CONFIGS, _make_config, *[arguments[k] for k in ext.CONFIG_ARGS])


def _make_config(*args):
    return ext.make_config(*args[:7], **dict(zip(ext.OPTION_CHECKS, args[7:])))


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
        return m.sum(dtype=torch.float64 if m.dtype == torch.float64 else torch.float32)
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
    """Aggregate a per-token loss `[..., T]` over `mask` into a scalar, as verl's `agg_loss`:

      token-mean               sum(mask * l) / N * dp_size   (N = global_num_tokens or sum(mask))
      token-sum                sum(mask * l) * dp_size
      seq-mean-token-sum       sum_b sum_t(mask * l) / S * dp_size
      seq-mean-token-mean      sum_b [sum_t(mask * l) / sum_t mask] / S * dp_size
      seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor   (default: T)

    S = global_batch_size or the number of rows with a non-empty mask. Normalisers a mode does not
    use are ignored (verl passes them all); with dp_size > 1 the mode's one is required.
    A float mask weights tokens; positions with mask == 0 never contribute, even when NaN (verl's
    seq-mean modes would propagate such a NaN). `empty="zero"` gives 0 over a zero denominator,
    `"nan"` NaN (verl's 0 / 0 without global normalisers; the gradient stays 0).
    Returns a 0-dim float32 tensor (float64 for float64 input); the gradient flows to loss_mat.
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
