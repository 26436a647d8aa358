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
from .._math import acc_dtype
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
    acc = acc_dtype(chosen.dtype)
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
    out = acc_dtype(chosen.dtype)
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
    """Bradley-Terry reward-model loss on preference pairs, stable for any margin.

    `loss = -log sigmoid(r_chosen - r_rejected)` per pair, then reduced.

    Args:
        chosen_scores (Tensor): `[B]` (any shape), float32 / bfloat16 / float16 / float64. The
            reward model's score of each preferred response. The gradient flows to it.
        rejected_scores (Tensor): chosen_scores' shape, a float dtype. The score of each other
            response. The gradient flows to it.
        reduction (str): "mean" (0 for no pairs), "sum" or "none" (one loss per pair).
            Default "mean".

    Returns:
        Tensor: 0-dim, or the inputs' shape for "none"; float32 (float64 for float64 inputs).

    Why: a call holds B values, so its cost is its overhead. One op whose forward also forms
    d loss / d margin replaces the composition's chain of small autograd nodes. Formulas:
    docs/ppo-math.md ("Reward model and DPO").
    """
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
    """DPO loss on preference pairs, stable for any margin.

    `loss = -log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l)))` per pair, then reduced. Each
    input is a response's summed log-probs over its action tokens (e.g. a masked sum of
    `token_logprobs`); w is the chosen response, l the rejected one.

    Args:
        policy_chosen_lp (Tensor): `[B]` (any shape), float32 / bfloat16 / float16 / float64. The
            policy's log-prob of each chosen response. The gradient flows to it.
        policy_rejected_lp (Tensor): that shape, a float dtype. The policy's log-prob of each
            rejected response. The gradient flows to it.
        ref_chosen_lp (Tensor): that shape, a float dtype. The reference model's log-prob of each
            chosen response. Detach it: a gradient would flow to it too.
        ref_rejected_lp (Tensor): that shape, a float dtype. The reference model's log-prob of
            each rejected response, as ref_chosen_lp.
        beta (float): the inverse temperature of the implicit reward; positive. Keyword-only and
            required.
        reduction (str): "mean" (0 for no pairs), "sum" or "none" (one loss per pair).
            Default "mean".

    Returns:
        Tensor: 0-dim, or the inputs' shape for "none"; float32 (float64 for float64 inputs).

    Why: as `reward_model_loss`, one op and one autograd node for a call that is all overhead.
    It matches TRL's `sigmoid` DPO loss. Formulas: docs/ppo-math.md ("Reward model and DPO").
    """
    ref = (ref_chosen_lp, ref_rejected_lp)
    _check_pairs(reduction, _DPO_NAMES, (policy_chosen_lp, policy_rejected_lp) + ref)
    beta = check_float("beta", beta, positive=True)
    return _op(policy_chosen_lp, policy_rejected_lp, *ref, beta, reduction)[0]


def reward_model_head_loss(
    chosen_hidden: Tensor,
    rejected_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    margin: Tensor | float | None = None,
    center_rewards_coefficient: float | None = None,
    reduction: str = "mean",
) -> tuple[Tensor, Tensor, Tensor]:
    """The reward model's pairwise loss straight from a scalar head: r = hidden @ weight.T (+ bias)
    for the chosen and rejected completions' last hidden states, then
    `-log sigmoid(r_chosen - r_rejected - margin)` (TRL's RewardTrainer) plus, with
    `center_rewards_coefficient`, `coef * (r_chosen + r_rejected)^2` (its reward centring).

    Args:
        chosen_hidden, rejected_hidden: `[B, H]` float hidden states (gradient flows to both).
        weight: the head, `[1, H]` or `[H]`; bias: `[1]` or None.
        margin: per-pair `[B]` margins or one number (None: 0).
        reduction: "mean" (0 for no pairs), "sum" or "none" (per pair).

    Returns:
        (loss, chosen rewards [B], rejected rewards [B]); the rewards detached, for metrics.

    A composition (two GEMVs and the pairwise op, whose forward forms its own gradient), not an
    op of its own: the call is two GEMVs plus overhead, and a one-node autograd function over the
    whole head measured within the noise of it and of the eager composition (0.8-1.1x, fwd+bwd,
    B=8 H=1024 and B=64 H=4096, one thread: bench/bench_reward_head.py)."""
    check_tensor("chosen_hidden", chosen_hidden, dtypes=VALUE_DTYPES, dim=2)
    dev = chosen_hidden.device
    B, H = chosen_hidden.shape
    like = "chosen_hidden"
    check_arg("rejected_hidden", rejected_hidden, dev, like=like, dtypes=VALUE_DTYPES, shape=(B, H),
              what="like chosen_hidden")  # fmt: skip
    check_tensor("weight", weight, dtypes=VALUE_DTYPES)
    if weight.numel() != H or weight.dim() not in (1, 2) or weight.shape[-1] != H:
        raise ValueError(f"weight: expected shape (1, {H}) or ({H},), got {tuple(weight.shape)}")
    check_arg("weight", weight, dev, like=like, dtypes=VALUE_DTYPES)
    if bias is not None:
        check_arg("bias", bias, dev, like=like, dtypes=VALUE_DTYPES)
        if bias.numel() != 1:
            raise ValueError(f"bias: expected one value, got shape {tuple(bias.shape)}")
    if reduction not in _REDUCTIONS:
        check_str("reduction", reduction, _REDUCTIONS)
    coef = check_float("center_rewards_coefficient", center_rewards_coefficient, allow_none=True)
    w = weight.reshape(1, H)
    b = None if bias is None else bias.reshape(1)
    rc = F.linear(chosen_hidden, w, b).squeeze(-1)
    rr = F.linear(rejected_hidden, w, b).squeeze(-1)
    shifted = rc
    if margin is not None:
        if isinstance(margin, Tensor):
            check_arg(
                "margin",
                margin,
                dev,
                like=like,
                dtypes=VALUE_DTYPES,
                shape=(B,),
                what="one per pair",
            )
            shifted = rc - margin.to(rc.dtype)
        else:
            shifted = rc - check_float("margin", margin)
    loss = reward_model_loss(shifted, rr, reduction=reduction)
    if coef:
        sq = (rc + rr) ** 2
        if reduction == "none":
            loss = loss + coef * sq
        elif reduction == "sum" or B == 0:
            loss = loss + coef * sq.sum()
        else:
            loss = loss + coef * sq.mean()
    return loss, rc.detach(), rr.detach()
