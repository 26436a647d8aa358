"""The public API of the fused distillation loss from hidden states: `linear_distill_loss` (typed
arguments, defaults, shapes flattened). Tensor checks (dtype, shape, device) run in the registered
op (csrc/ops/linear_distill_loss.cpp); this layer checks what only it sees (scalars, the options,
shapes before they are flattened)."""

from __future__ import annotations

import math

from torch import Tensor

from .. import _backend
from .._checks import check_int, check_same_device, check_str, check_tensor
from ..fused_linear.planner import resolve_logits_dtype
from ..losses import distill_math as dm
from ..losses.config import fields, takes_configs
from ..losses.distill_config import DistillLossConfig
from ..token_logprobs.api import check_sampler_unused, sampler_options
from ..token_logprobs.naive import SAMPLERS
from . import op

_op = _backend.op("linear_distill_loss")
_sampler_op = _backend.op("linear_distill_loss_sampler")
_FIELDS = fields(DistillLossConfig)  # (a constant: torch.compile does not trace dataclasses.fields)


def _like_labels(name, t, shape, n, extra=()):
    """t [*shape, *extra] flattened to [n, *extra]."""
    check_tensor(name, t)
    want = tuple(shape) + tuple(extra)
    if tuple(t.shape) != want:
        what = "labels.shape + " + repr(tuple(extra)) if extra else "like labels"
        raise ValueError(f"{name}: expected shape {want} ({what}), got {tuple(t.shape)}")
    return t.reshape((n,) + tuple(extra))


def _sampler_args(labels, n, V, cfg, top_k, top_p, min_p, sampler, cached):
    """The op's sampler arguments (op.SAMPLER_NAMES) of a call with the sampler's options (the
    config's temperature a tensor, or top_k / top_p / min_p given), checked; per-row tensors
    broadcast to one value per token [n]."""
    if cached:
        raise ValueError(
            "topk_ids: a cached teacher is not supported with the sampler's options (temperature "
            "tensor, top_k, top_p, min_p); give the teacher's head (teacher_hidden / "
            "teacher_weight)"
        )
    sampler = check_str("sampler", sampler, SAMPLERS)
    _, _, _, temps, k, ks, p, ps, mp, mps = sampler_options(
        labels, cfg.temperature, top_k, top_p, min_p, None, 0
    )
    truncated = 0 < k < V or p < 1 or mp > 0 or any(t is not None for t in (ks, ps, mps))
    if truncated and dm.resolve(cfg.divergence, cfg.beta) == "forward_kl":
        raise ValueError(
            "divergence: forward_kl (and jsd with beta 0) is +inf under the sampler's truncation "
            "(top_k, top_p, min_p) wherever the teacher has mass outside the student's kept set; "
            "use reverse_kl, jsd with beta > 0 or tv"
        )
    L = labels.dim()

    def flat(t):
        if t is None:
            return None
        return t.reshape(tuple(t.shape) + (1,) * (L - t.dim())).expand(labels.shape).reshape(n)

    return (flat(temps), k, flat(ks), p, flat(ps), mp, flat(mps), sampler)


@takes_configs(distill_config=DistillLossConfig)
def linear_distill_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    mask: Tensor | None = None,
    topk_ids: Tensor | None = None,
    topk_logprobs: Tensor | None = None,
    distill_config: DistillLossConfig | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int | None = None,
    logits_dtype: str | None = "auto",
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    sampler: str = "vllm",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation loss between a student LM head and a teacher from the hidden states in
    one chunked pass: both logits tiles, the exact full-vocabulary divergence per token, the
    hard-label term and the student's gradients, never building the [N, V] logits of either.

    loss = weight_soft_loss * sum_t D_t / n + weight_hard_loss * sum_t (-log p_1(y_t)) / n

    over the n kept tokens (label not ignore_index, mask set; at least 1), as Liger's
    `LigerFusedLinearJSDLoss`: D_t the divergence (`divergence`: forward_kl, reverse_kl, jsd
    with `beta`, tv) between the student's p = softmax(z_s / T) and the teacher's
    q = softmax(z_t / T), p_1 the student's softmax at temperature 1 (the hard-label
    cross-entropy). The teacher gets no gradient. The student's gradients are formed in the
    forward (3 GEMMs of the student's head and one of the teacher's); `loss.backward()` only
    scales them.

    Args:
        hidden (Tensor): `[..., H]`, float32 / bfloat16 / float16 (float64 runs the float64
            eager loop). The student's last hidden states; gradients flow to it, to weight and
            to bias, each only when it requires grad.
        weight (Tensor): `[V, H]`, hidden's dtype. The student's LM head.
        labels (Tensor): `[...]` = `hidden.shape[:-1]`, int64 / int32. The token each position
            predicts: the hard-label target and the sampled token of on-policy distillation.
        teacher_hidden (Tensor, optional): `[..., H_t]` (labels.shape + (H_t,)), hidden's dtype.
            The teacher's hidden states, with `teacher_weight`; its tile is computed beside the
            student's in the same pass. Default None: the teacher is given by topk_ids /
            topk_logprobs.
        teacher_weight (Tensor, optional): `[V, H_t]`, the teacher's LM head over the same
            vocabulary. Default None.
        bias (Tensor, optional): `[V]`, the student head's bias. Default None.
        teacher_bias (Tensor, optional): `[V]`, the teacher head's bias. Default None.
        mask (Tensor, optional): labels' shape, bool / integer / float; nonzero = in the loss
            (e.g. the completion's tokens). Default None: every token whose label is not
            ignore_index.
        topk_ids (Tensor, optional): `[..., K]` (labels.shape + (K,)), int64 / int32: a cached
            teacher, its top-k token ids per position (instead of a teacher head). The
            divergence is then taken on that support, the mass outside it per `topk_tail`.
            Default None.
        topk_logprobs (Tensor, optional): topk_ids' shape, float: the teacher's log-probs at
            those ids, at temperature T; -inf marks an unused slot. Default None.
        distill_config (DistillLossConfig, optional): `divergence`, `beta`, `temperature`,
            `weight_soft_loss`, `weight_hard_loss`, `topk_tail` (flat fields too). Default:
            Liger's defaults (jsd, beta 0.5, T 1, weights 0.5 / 0.5). `temperature` may be a
            float tensor of per-row values, positive, its shape a leading part of labels.shape
            (per sequence or per token: the rollout's per-request temperatures), dividing both
            heads' logits per token as the float does; the hard-label term stays at 1. (It is
            the config's field: giving it flat and a config too is a TypeError.)
        ignore_index (int): a label with this value is not in the loss. Default -100.
        max_chunk_bytes (int, optional): the chunk buffers' memory budget. Default None: 64 MiB
            on the CPU, 2 GiB on a GPU.
        logits_dtype (str, optional): "float32", "input" (GEMMs in the input dtype, float32
            reductions) or "auto" (`default_logits_dtype`). Default "auto".
        top_k (int or Tensor, optional): on-policy distillation samples from the student with
            the engine's parameters; with this option (or top_p, min_p, a temperature tensor)
            the student's distribution is the one the engine sampled from (`token_logprobs`'
            sampler rules: temperature, then min-p, top-k, top-p): p_K, the tempered softmax
            truncated to its kept set K and renormalised. The engine's top-k (0 or >= V: off),
            a scalar or a per-row int tensor shaped like a temperature tensor. The teacher's q
            stays whole (docs/ppo-math.md, "Distillation losses"). D_t is then the divergence of
            p_K and q (reverse_kl, jsd, tv: finite; forward_kl and jsd at beta 0, +inf wherever
            q has mass off K, are refused under a truncation), its gradient on K only;
            `sampled_reverse_kl` is log p_K(y) - log q(y), -inf for a label outside K. The
            hard-label term stays the plain temperature-1 cross-entropy. Not with a cached
            teacher (topk_ids). Default None.
        top_p (float or Tensor, optional): the engine's top-p, in (0, 1] (1: off), scalar or per
            row. Default None.
        min_p (float or Tensor, optional): the engine's min-p, in [0, 1] (0: off), scalar or per
            row. Default None.
        sampler (str): whose truncation rules, "vllm" or "sglang". Default "vllm".

    Returns:
        `(loss, stats)`: a 0-dim float32 loss (float64 for float64 hidden) and a dict, detached
        and without host syncs: `soft_loss` (sum D / n), `hard_loss` (sum -log p_1(y) / n), and
        per token (labels' shape, 0 off the kept tokens) `divergence` D_t, `hard_logprobs`
        log p_1(y_t) and `sampled_reverse_kl` log p(y_t) - log q(y_t) at temperature T:
        on-policy distillation's one-sample reverse KL, whose negative is the token's
        advantage (with a cached teacher: NaN where y_t is not among the top-k ids). With the
        sampler's options (a temperature tensor, top_k, top_p, min_p) also `num_outside` (the
        kept tokens whose label is outside the student's kept set) and `outside` (labels'
        shape, bool: those tokens).

    Why: distillation from a teacher's logits costs two [N, V] logits tensors and their
    softmaxes when materialised; here each row block's two tiles are reduced and turned into
    the student's gradient in cache, Liger's loss in about a tenth of the memory. Formulas:
    docs/ppo-math.md ("Distillation losses"); the engine: ppo_kernels/fused_linear/.
    """
    check_tensor("hidden", hidden, min_dim=1)
    check_tensor("weight", weight)
    check_tensor("labels", labels, min_dim=1)
    shape = tuple(labels.shape)
    if tuple(hidden.shape[:-1]) != shape:
        raise ValueError(
            f"hidden: expected shape {shape + (hidden.shape[-1],)} (labels.shape + (H,)), "
            f"got {tuple(hidden.shape)}"
        )
    check_same_device(hidden=hidden, weight=weight, labels=labels)
    n = math.prod(shape)
    h2 = hidden.reshape(n, hidden.shape[-1])
    lab = labels.reshape(n)
    msk = None if mask is None else _like_labels("mask", mask, shape, n)
    th = None
    if teacher_hidden is not None:
        check_tensor("teacher_hidden", teacher_hidden, min_dim=1)
        th = _like_labels(
            "teacher_hidden", teacher_hidden, shape, n, (teacher_hidden.shape[-1],)
        ).detach()
    ids = tlp = None
    if topk_ids is not None:
        check_tensor("topk_ids", topk_ids, min_dim=1)
        ids = _like_labels("topk_ids", topk_ids, shape, n, (topk_ids.shape[-1],))
    if topk_logprobs is not None:
        check_tensor("topk_logprobs", topk_logprobs, min_dim=1)
        k = topk_logprobs.shape[-1] if topk_ids is None else topk_ids.shape[-1]
        tlp = _like_labels("topk_logprobs", topk_logprobs, shape, n, (k,)).detach()
    cfg = distill_config
    temp_tensor = isinstance(cfg.temperature, Tensor)
    sampled = None  # the op's sampler arguments (op.SAMPLER_NAMES), or None: none given
    if temp_tensor or top_k is not None or top_p is not None or min_p is not None:
        cached = topk_ids is not None or topk_logprobs is not None
        sampled = _sampler_args(
            labels, n, weight.shape[0], cfg, top_k, top_p, min_p, sampler, cached
        )
    elif sampler != "vllm":
        check_sampler_unused(sampler, 0)
    ignore_index = check_int("ignore_index", ignore_index)
    max_chunk_bytes = check_int("max_chunk_bytes", max_chunk_bytes, min_value=1, allow_none=True)
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    args = (
        h2,
        weight,
        lab,
        msk,
        bias,
        th,
        None if teacher_weight is None else teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
        ids,
        tlp,
        # (a temperature tensor goes as the sampler's `temperatures`, replacing the float)
        *(1.0 if k == "temperature" and temp_tensor else getattr(cfg, k) for k in _FIELDS),
        ignore_index,
        int(max_chunk_bytes or 0),
        logits_dtype,
    )
    outside = None
    if sampled is None:
        loss, st, tok = _op(*args)
        names = op.STAT_NAMES
    else:
        loss, st, tok, outside = _sampler_op(*args, *sampled)
        names = op.STAT_NAMES + ("num_outside",)
    out = dict(zip(names, st.unbind(0)))
    for name, t in zip(op.TOKEN_STATS, tok.unbind(0)):
        out[name] = t.view(shape)
    if outside is not None:
        out["outside"] = outside.view(shape)
    return loss, out
