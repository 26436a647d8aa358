"""`masked_aggregate`: a per-token loss matrix to one scalar over a mask, with verl's aggregation
modes (`agg_loss`) plus "token-sum", differentiable, no host synchronisation.

The fused losses (`ppo_policy_loss`, `ppo_value_loss`) aggregate inside their kernels; this op is
for every other per-token term a trainer aggregates the same way (entropy bonus, KL loss, a
custom policy loss). It is a reduction over memory that is already there, so it has one eager
implementation (a few fused torch reductions) on every device; its backward is one multiply.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_tensor
from . import reference
from .op import AGG_NAMES, MASK_DTYPES, VALUE_DTYPES, _aggregation, _empty_value, _rows

_backend.register_op(
    "masked_aggregate", kernel=None, triton=False, cuda_default="eager", folder="losses"
)


def _masked_weights(mask, dtype):
    m = mask.to(dtype)
    return torch.where(m != 0, m, torch.zeros((), dtype=dtype, device=m.device))


@torch.library.custom_op("ppo_kernels::masked_aggregate", mutates_args=())
def masked_aggregate_op(
    loss_mat: Tensor,
    mask: Tensor,
    agg: str,
    scale: float,
    global_denom: Tensor | None,
    global_denom_value: float | None,
) -> tuple[Tensor, Tensor]:
    """[B, T] inputs; agg one of reference.AGG_MODES ("token-sum" arrives as token-mean over a
    denominator of 1). Returns (loss [], row_coef [B]); row_coef is d loss / d (mask * loss_mat)."""
    _backend.backend_for("masked_aggregate", loss_mat)  # eager; refuses another requested backend
    acc = reference._acc(loss_mat.dtype)
    m = _masked_weights(mask, acc)
    gd = global_denom
    if gd is None and global_denom_value is not None:
        gd = torch.tensor(global_denom_value, dtype=acc, device=loss_mat.device)
    coef = reference.row_coefficients(m, agg, scale, gd)
    x = torch.where(m != 0, loss_mat.to(acc), torch.zeros((), dtype=acc, device=m.device))
    return (coef * (x * m).sum(-1)).sum(), coef


@masked_aggregate_op.register_fake
def _(loss_mat, mask, agg, scale, global_denom, global_denom_value):
    acc = reference._acc(loss_mat.dtype)
    return loss_mat.new_empty((), dtype=acc), loss_mat.new_empty((loss_mat.shape[0],), dtype=acc)


def _setup(ctx, inputs, output):
    loss_mat, mask = inputs[0], inputs[1]
    ctx.save_for_backward(mask, output[1])
    ctx.dtype = loss_mat.dtype
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_loss, _grad_coef):
    mask, coef = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 6
    g = grad_loss * coef.unsqueeze(-1) * _masked_weights(mask, coef.dtype)
    return (g.to(ctx.dtype),) + (None,) * 5


masked_aggregate_op.register_autograd(_backward, setup_context=_setup)


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
    if tuple(mask.shape) != tuple(loss_mat.shape):
        raise ValueError(
            f"mask: expected shape {tuple(loss_mat.shape)} (like loss_mat), got {tuple(mask.shape)}"
        )
    if mask.device != loss_mat.device:
        raise ValueError(
            f"mask: expected device {loss_mat.device} (like loss_mat), got {mask.device}"
        )
    if agg not in AGG_NAMES:
        raise ValueError(f"agg: unknown mode {agg!r}; expected one of {AGG_NAMES}")
    mode, scale, gd, gdv = _aggregation(
        agg,
        loss_mat.shape[-1],
        dp_size,
        global_num_tokens,
        global_batch_size,
        loss_scale_factor,
        loss_mat.device,
    )
    if gd is not None:
        gd = gd.to(reference._acc(loss_mat.dtype))
    loss, _ = torch.ops.ppo_kernels.masked_aggregate(
        _rows(loss_mat), _rows(mask), mode, scale, gd, gdv
    )
    return _empty_value(loss, mode, mask, gd, gdv, empty)
