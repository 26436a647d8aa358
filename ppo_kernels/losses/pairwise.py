"""The pairwise `-log sigmoid` losses: `reward_model_loss` (Bradley-Terry) and `dpo_loss`.

B values, not B x T: a composition of torch ops is all they need (no kernel, no custom op);
torch's logsigmoid and its gradient are finite for any margin. Semantics: reference.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _backend
from .._checks import check_arg, check_float, check_str, check_tensor
from .aggregate import VALUE_DTYPES

_backend.register_op(
    "pairwise_logsigmoid_loss",
    kernel=None,
    triton=False,
    cuda_default="eager",
    public=("reward_model_loss", "dpo_loss"),
    folder="losses",
)

_REDUCTIONS = ("mean", "sum", "none")
_RM_NAMES = ("chosen_scores", "rejected_scores")
_DPO_NAMES = ("policy_chosen_lp", "policy_rejected_lp", "ref_chosen_lp", "ref_rejected_lp")


def _check_pairs(reduction, names, tensors):
    """Float tensors of one shape on one device and the reduction; returns the result's dtype.
    One cheap comparison per tensor on the happy path (these losses cost a few torch ops: the
    checks must not cost as much); the first failure is named by the full checks."""
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
            check_arg(n, t, x.device, dtypes=VALUE_DTYPES, shape=x.shape, what=f"like {names[0]}")
    if reduction not in _REDUCTIONS:
        check_str("reduction", reduction, _REDUCTIONS)
    _backend.check_eager_only("pairwise_logsigmoid_loss", x)
    return _backend.out_dtype(x)


def _acc(t: Tensor, acc: torch.dtype) -> Tensor:
    return t if t.dtype == acc else t.to(acc)


def _neg_logsigmoid(z: Tensor, reduction: str) -> Tensor:
    """-log sigmoid(z), reduced before the negation (one pass fewer than reference._reduce's; the
    mean of no pairs is 0). Measured against softplus(-z) and the binary cross-entropy with
    logits (one op each): both slower per call, fwd+bwd, than logsigmoid (its forward saves the
    buffer its backward reads)."""
    ls = F.logsigmoid(z)
    if reduction == "none":
        return -ls
    if reduction == "sum" or ls.numel() == 0:
        return -ls.sum()
    return -ls.mean()


def reward_model_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, *, reduction: str = "mean"
) -> Tensor:
    """Bradley-Terry reward-model loss `-log sigmoid(r_chosen - r_rejected)`, stable for any margin.

    reduction: "mean" (0 for no pairs), "sum" or "none" (per pair). float32 result (float64 for
    float64 inputs); gradients to both scores."""
    acc = _check_pairs(reduction, _RM_NAMES, (chosen_scores, rejected_scores))
    return _neg_logsigmoid(_acc(chosen_scores, acc) - _acc(rejected_scores, acc), reduction)


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
    acc = _check_pairs(
        reduction,
        _DPO_NAMES,
        (policy_chosen_lp, policy_rejected_lp, ref_chosen_lp, ref_rejected_lp),
    )
    beta = check_float("beta", beta, positive=True)
    chosen = _acc(policy_chosen_lp, acc) - _acc(ref_chosen_lp, acc)
    rejected = _acc(policy_rejected_lp, acc) - _acc(ref_rejected_lp, acc)
    return _neg_logsigmoid(beta * (chosen - rejected), reduction)
