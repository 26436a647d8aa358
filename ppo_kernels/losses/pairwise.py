"""The pairwise `-log sigmoid` losses: `reward_model_loss` (Bradley-Terry) and `dpo_loss`, on the
registered op `ppo_kernels::pairwise_logsigmoid_loss` (csrc/ops/losses.cpp: checks, routing and
one autograd node; the CPU kernel in csrc/cpu/losses.cpp).

B values, not B x T: the cost of a call is its overhead. The composition of torch ops (sub, mul,
logsigmoid, mean: four autograd nodes) costs more per call than one C++ op whose forward also
forms d loss / d z per pair, so that the backward is one multiply. On the GPU (and for float64)
the op runs that composition (eager). Semantics: naive.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _backend
from .._checks import check_arg, check_devices, check_float, check_str, check_tensor
from .aggregate import VALUE_DTYPES

_backend.register_op(
    "pairwise_logsigmoid_loss",
    kernel="pairwise_logsigmoid_loss_fwd",
    triton=False,
    cuda_default="eager",
    public=("reward_model_loss", "dpo_loss"),
    folder="losses",
)
_backend.routes_in_cpp("pairwise_logsigmoid_loss")

_REDUCTIONS = ("mean", "sum", "none")
_RM_NAMES = ("chosen_scores", "rejected_scores")
_DPO_NAMES = ("policy_chosen_lp", "policy_rejected_lp", "ref_chosen_lp", "ref_rejected_lp")


def _check_pairs(reduction, names, tensors):
    """Float tensors of one shape on one device and the reduction, named as the API names them
    (the registered op checks them again under its own names, for direct calls). One cheap
    comparison per tensor on the happy path; the first failure is named by the full checks."""
    x = tensors[0]
    if isinstance(x, Tensor):
        shape, dev = x.shape, x.device
        ok = all(
            isinstance(t, Tensor)
            and t.dtype in VALUE_DTYPES
            and t.shape == shape
            and t.device == dev
            for t in tensors
        )
    else:
        ok = False
    if not ok:
        check_tensor(names[0], x, dtypes=VALUE_DTYPES)
        for n, t in zip(names[1:], tensors[1:]):
            like = names[0]
            check_arg(
                n, t, x.device, like=like, dtypes=VALUE_DTYPES, shape=x.shape, what=f"like {like}"
            )
    if reduction not in _REDUCTIONS:
        check_str("reduction", reduction, _REDUCTIONS)


def _z(chosen, rejected, ref_chosen, ref_rejected, beta):
    acc = _backend.out_dtype(chosen)
    c, r = chosen.to(acc), rejected.to(acc)
    if ref_chosen is not None:
        c, r = c - ref_chosen.to(acc), r - ref_rejected.to(acc)
    return beta * (c - r)


def _composition(chosen, rejected, ref_chosen, ref_rejected, beta, reduction):
    """(loss, coef): -log sigmoid(z) reduced (the mean of no pairs is 0) and d loss / d z."""
    z = _z(chosen, rejected, ref_chosen, ref_rejected, beta)
    ls = F.logsigmoid(z)
    coef = -torch.sigmoid(-z.detach())
    if reduction == "none":
        return -ls, coef
    if reduction == "sum" or ls.numel() == 0:
        return -ls.sum(), coef
    return -ls.mean(), coef / ls.numel()


# The fakes and the fallback check devices as the C++ checks do (a meta tensor sends a call to its
# fake whatever the other arguments' devices).
@_backend.fake("pairwise_logsigmoid_loss")
def _(chosen, rejected, ref_chosen, ref_rejected, beta, reduction):
    check_devices(
        "chosen", chosen, rejected=rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected
    )
    out = _backend.out_dtype(chosen)
    shape = chosen.shape if reduction == "none" else ()
    return chosen.new_empty(shape, dtype=out), chosen.new_empty(chosen.shape, dtype=out)


@_backend.impl("pairwise_logsigmoid_loss", "eager")
def _(chosen, rejected, ref_chosen, ref_rejected, beta, reduction):
    d = (None if t is None else t.detach() for t in (chosen, rejected, ref_chosen, ref_rejected))
    return _composition(*d, beta, reduction)


@_backend.fake("pairwise_logsigmoid_loss_backward")
def _(grad, coef, beta, chosen_dtype, rejected_dtype):
    check_devices("coef", coef, grad_loss=grad)
    return coef.new_empty(coef.shape, dtype=chosen_dtype), coef.new_empty(
        coef.shape, dtype=rejected_dtype
    )


@_backend.impl("pairwise_logsigmoid_loss_backward", "eager")
def _(grad, coef, beta, chosen_dtype, rejected_dtype):
    g = grad.to(coef.dtype) * coef * beta
    return g.to(chosen_dtype), (-g).to(rejected_dtype)


@_backend.fallback("pairwise_logsigmoid_loss")  # no extension: autograd through the composition
def _(chosen, rejected, ref_chosen, ref_rejected, beta, reduction):
    check_devices(
        "chosen", chosen, rejected=rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected
    )
    return _composition(chosen, rejected, ref_chosen, ref_rejected, beta, reduction)


_op = _backend.op("pairwise_logsigmoid_loss")


def reward_model_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, *, reduction: str = "mean"
) -> Tensor:
    """Bradley-Terry reward-model loss `-log sigmoid(r_chosen - r_rejected)`, stable for any margin.

    reduction: "mean" (0 for no pairs), "sum" or "none" (per pair). float32 result (float64 for
    float64 inputs); gradients to both scores."""
    _check_pairs(reduction, _RM_NAMES, (chosen_scores, rejected_scores))
    return _op(chosen_scores, rejected_scores, None, None, 1.0, reduction)[0]


def dpo_loss(
    policy_chosen_lp: Tensor,
    policy_rejected_lp: Tensor,
    ref_chosen_lp: Tensor,
    ref_rejected_lp: Tensor,
    *,
    beta: float,
    reduction: str = "mean",
) -> Tensor:
    """DPO loss `-log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l)))`, stable for any margin.

    The inputs are the summed log-probs of each response's action tokens (e.g. a masked sum of
    `token_logprobs`). Gradients flow to all four (detach the reference ones as usual)."""
    ref = (ref_chosen_lp, ref_rejected_lp)
    _check_pairs(reduction, _DPO_NAMES, (policy_chosen_lp, policy_rejected_lp) + ref)
    beta = check_float("beta", beta, positive=True)
    return _op(policy_chosen_lp, policy_rejected_lp, *ref, beta, reduction)[0]
