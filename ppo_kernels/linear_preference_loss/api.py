"""The public API of the fused hidden-states preference loss: `linear_preference_loss` (typed
arguments, defaults, the layout of chosen / rejected rows). Tensor checks (dtype, shape, device)
run in the registered op (csrc/ops/linear_preference_loss.cpp); this layer checks what only it
sees (scalars, the loss type's options, shapes before they are flattened)."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    check_bool,
    check_float,
    check_int,
    check_same_device,
    check_temperature,
    check_tensor,
)
from ..fused_linear.planner import resolve_logits_dtype
from ..linear_policy_loss.api import sampler_args, wants_sampler
from ..losses.config import takes_configs
from ..losses.preference_config import PreferenceLossConfig
from . import op
from .head import check_reference

_op = _backend.op("linear_preference_loss")
_sampler_op = _backend.op("linear_preference_loss_sampler")
_CAPTURE: list = []  # arguments(): the calls whose op arguments are kept instead of run


def _per_row(name, t, rows_shape, R):
    check_tensor(name, t)
    if tuple(t.shape) != tuple(rows_shape):
        raise ValueError(
            f"{name}: expected shape {tuple(rows_shape)} (labels.shape[:-1]: one per row), got "
            f"{tuple(t.shape)}"
        )
    return t.reshape(R)


@takes_configs(loss_config=PreferenceLossConfig)
def linear_preference_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    mask: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    pairs: Tensor | None = None,
    desirable: Tensor | None = None,
    ref_logps: Tensor | None = None,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_bias: Tensor | None = None,
    reference_point: Tensor | float | None = None,
    loss_config: PreferenceLossConfig | None = None,
    temperature: float | Tensor = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int | None = None,
    logits_dtype: str | None = "auto",
    return_entropy: bool = False,
    return_logit_stats: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    reduce_hidden_grad: bool = True,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    sampler: str = "vllm",
    mask_outside: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A preference loss (DPO and TRL's other paired types, ORPO / SimPO / CPO, KTO) from the
    hidden states and the LM head in one chunked pass: logits, token log-probs, the completions'
    sequence log-probs, the loss and its gradients, never building the [N, V] logits.

    Rows are completions of T tokens (labels `[..., T]`; the leading dimensions are the rows).
    Paired types take chosen and rejected completions in one call: the first half of the rows
    chosen, the second half rejected, pair i = (row i, row i + R / 2) as TRL and Liger lay them
    out, or an explicit `pairs`. A completion's sequence log-prob is the masked sum of its token
    log-probs (the mean with `average_log_prob`, LD-DPO's weighted sum with `ld_alpha`); the
    loss of each type is docs/ppo-math.md's ("Preference losses").

    The gradients of hidden, weight and bias are formed in the same pass (3 GEMMs: the logits
    tile, then grad_hidden = G W and grad_weight = G^T h for the logits gradient G; a reference
    head adds its tile's GEMM, no gradient); `loss.backward()` only scales them. The loop walks a
    pair's two rows side by side, so a block of whole pairs knows its coefficients at once. A
    pair longer than a block (2T tokens beyond `max_chunk_bytes`): under the default budget the
    block grows to the pair, or, where that takes less memory (H < T: two [V, H] accumulators
    instead of the pair's tile), each row's gradient GEMMs go into accumulators of its own,
    scaled by its coefficient once the pair is reduced (still 3 GEMMs; not with LD-DPO's
    weights); under a given budget, and for the sorted types (aot, aot_unpaired), a first pass
    of log-probs only (4 GEMMs). A reference head too large to sit beside the policy's tile runs
    a pass of its own first.

    Args:
        hidden (Tensor): `[..., T, H]`, float32 / bfloat16 / float16 (float64 runs the float64
            eager loop). Gradients flow to it, to weight and to bias, each only when it
            requires grad.
        weight (Tensor): `[V, H]`, hidden's dtype. The LM head.
        labels (Tensor): `hidden.shape[:-1]`, int64 / int32: each token's next-token id,
            ignore_index where no loss is taken (the prompt, padding).
        mask (Tensor, optional): labels' shape, bool / integer / float: nonzero on the
            completion's tokens (TRL's completion mask), on top of ignore_index. Default None.
        bias (Tensor, optional): `[V]`. Default None.
        pairs (Tensor, optional): `[P, 2]` int64 / int32 with P = rows / 2: each pair's (chosen
            row, rejected row), every row once (paired types). Default None: the halves.
        desirable (Tensor, optional): `labels.shape[:-1]`, bool: each row's label for the
            unpaired types (kto, apo_zero_unpaired). Default None.
        ref_logps (Tensor, optional): `labels.shape[:-1]`: the reference model's sequence
            log-probs, reduced as the policy's are (TRL's precomputed `ref_*_logps`).
            Default None.
        ref_hidden (Tensor, optional): `[..., T, H_ref]` with `ref_weight` `[V, H_ref]` and
            optional `ref_bias` `[V]`: the reference head, whose token log-probs are reduced in
            the same pass (its tile beside the policy tile, no gradient). Default None.
        ref_weight (Tensor, optional): see ref_hidden. Default None.
        ref_bias (Tensor, optional): see ref_hidden. Default None.
        reference_point (Tensor | float, optional): KTO's detached reference point (TRL's KL
            of the mismatched rows, `preference_unpaired.kto_reference_point`). Default None: 0.
        loss_config (PreferenceLossConfig, optional): the loss types and their options; its
            fields are accepted as flat keyword arguments (`loss_type="ipo", beta=0.5`, ...).
            Default: sigmoid (DPO), beta 0.1.
        temperature (float or Tensor): divides the logits (both heads); positive. A float
            tensor gives per-row values (the rollout's per-request temperatures): one per
            completion (`labels.shape[:-1]`) or per token (labels' shape). Default 1.0.
        softcap (float, optional): `softcap * tanh(z / softcap)` on the logits (both heads).
            Default None.
        ignore_index (int): a label with this value has no log-prob and no loss. Default -100.
        max_chunk_bytes (int, optional): the chunk buffers' memory budget. Default None: 64 MiB
            on the CPU, 2 GiB on a GPU.
        logits_dtype (str, optional): "float32", "input" or "auto" (`default_logits_dtype`).
            Default "auto".
        return_entropy (bool): also each token's entropy (the reduction computes it).
            Default False.
        return_logit_stats (bool): also each token's mean logit over the vocabulary (at the
            temperature, soft-capped) and whether its label is the first largest logit (TRL's
            `logits/*` and `mean_token_accuracy` metrics): one more pass over each tile. Not in
            the vocab-parallel form. Default False.
        process_group (ProcessGroup, optional): the vocab-parallel form: `weight` / `bias`
            (and the reference head's) hold this rank's contiguous slice of the vocabulary;
            everything else is replicated; labels are global ids. Eager only. Default None.
        vocab_start (int, optional): this rank's first vocabulary id. Default None: from the
            slice sizes, in rank order.
        reduce_hidden_grad (bool): all-reduce the hidden gradient across the group. Default
            True.
        top_k (int or Tensor, optional): the rollout engine's top-k (0 or >= V: off), a scalar
            or an int tensor of per-row values (shape a leading part of labels.shape). With it
            (or top_p, min_p, a temperature tensor) each token's log-prob and entropy are those
            of the distribution the engine sampled from (docs/ppo-math.md, "The distribution the
            rollout sampled from"), for each head under its own kept set with the same
            parameters (a given `ref_logps` is used as given); the gradient flows through the
            kept tokens only. Every tile then holds whole rows: `max_chunk_bytes` must hold two
            rows' tiles (the tile and its gradient); a reference head runs its pass first. With
            `process_group` whole rows of each head's slice, the kept set found with the other
            ranks per row block (docs/ppo-math.md). Default None: off.
        top_p (float or Tensor, optional): the engine's top-p, in (0, 1] (1: off), scalar or per
            row. Default None: off.
        min_p (float or Tensor, optional): the engine's min-p, in [0, 1] (0: off), scalar or per
            row. Default None: off.
        sampler (str): whose truncation rules, "vllm" or "sglang". Default "vllm".
        mask_outside (bool): a token whose label is outside the policy's or the reference
            head's kept set (log-prob -inf: the engine could not have sampled it) leaves its
            completion for both heads: out of the sequence log-probs, the token counts and the
            means' and LD-DPO's lengths (with `sft`, a first pass finds these tokens before the
            batch's chosen-token count). False keeps it: the -inf enters the sequence log-prob
            and the loss is what the type's formula gives (often inf or NaN); a pair whose
            coefficient is not finite gets no gradient, so the gradients stay finite. Either way
            `num_outside` counts them. Default True.

    Returns:
        `(loss, stats)`: a 0-dim float32 loss (float64 for float64 hidden) and a dict, detached
        and without host syncs: the metrics the peers report (paired: `rewards/chosen`,
        `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`,
        `logps/rejected`, `nll_loss` with sft, `log_odds_ratio` / `log_odds_chosen` with orpo;
        unpaired: `kl`, the sums `chosen_rewards_sum`, `rejected_rewards_sum`,
        `chosen_logps_sum`, `rejected_logps_sum` and their means); per row (`labels.shape[:-1]`)
        `logps` (the sequence log-probs the loss sees), `ref_logps` and `rewards` (beta times
        the log-ratio; the log-prob without a reference); per pair `chosen_logps`,
        `rejected_logps`, `chosen_rewards`, `rejected_rewards`; per token (labels' shape)
        `token_logprobs` (0 off the completion), with `return_entropy` `entropy`, with
        `return_logit_stats` `mean_logits` and `is_top1` (bool), with a reference head
        `ref_token_logprobs`. With the sampler's options: `num_outside` (the completion
        tokens whose label is outside either head's kept set) and the per-token bool `outside`
        (labels' shape; `token_logprobs` is -inf there for the policy's).

    Why: the preference step's loss, gradients and metrics in one pass over the head, without
    the N x V logits (nor a second model's) that dominate its memory. Semantics:
    docs/ppo-math.md ("Preference losses", "The preference loss from hidden states").
    """
    check_tensor("hidden", hidden, min_dim=2)
    if process_group is None and vocab_start is not None:
        raise ValueError("vocab_start: needs process_group (the vocab-parallel form)")
    if process_group is not None and return_logit_stats is True:
        raise ValueError("return_logit_stats: not in the vocab-parallel form")
    check_bool("reduce_hidden_grad", reduce_hidden_grad)
    check_bool("return_entropy", return_entropy)
    check_bool("return_logit_stats", return_logit_stats)
    check_tensor("weight", weight)
    check_tensor("labels", labels, min_dim=1)
    shape = tuple(labels.shape)
    if tuple(hidden.shape[:-1]) != shape:
        raise ValueError(
            f"hidden: expected shape {shape + (hidden.shape[-1],)} (labels.shape + (H,)), "
            f"got {tuple(hidden.shape)}"
        )
    check_same_device(hidden=hidden, weight=weight, labels=labels)
    T = shape[-1]
    rows_shape = shape[:-1]
    R = math.prod(rows_shape)
    h2 = hidden.reshape(R * T, hidden.shape[-1])
    lab = labels.reshape(R, T)
    msk = None
    if mask is not None:
        check_tensor("mask", mask)
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask: expected shape {shape} (like labels), got {tuple(mask.shape)}")
        msk = mask.reshape(R, T)
    cfg = loss_config
    if pairs is not None:
        check_tensor("pairs", pairs)
        if cfg.unpaired:
            raise ValueError(f"pairs: {cfg.loss_type[0]} is unpaired (give desirable)")
    des = None
    if desirable is not None:
        des = _per_row("desirable", desirable, rows_shape, R)
    ref = None if ref_logps is None else _per_row("ref_logps", ref_logps, rows_shape, R)
    rh = None
    if ref_hidden is not None:
        check_tensor("ref_hidden", ref_hidden, min_dim=2)
        if tuple(ref_hidden.shape[:-1]) != shape:
            raise ValueError(
                f"ref_hidden: expected shape {shape} + (H_ref,) (like labels), got "
                f"{tuple(ref_hidden.shape)}"
            )
        rh = ref_hidden.detach().reshape(R * T, ref_hidden.shape[-1])
    check_reference(cfg, ref_logps is not None or ref_hidden is not None)
    rp = reference_point
    if rp is not None:
        if isinstance(rp, Tensor):
            check_tensor("reference_point", rp)
        elif isinstance(rp, numbers.Real) and not isinstance(rp, bool):
            rp = torch.tensor(float(check_float("reference_point", rp)), device=hidden.device)
        else:
            raise TypeError(f"reference_point: expected a tensor or a number, got {rp!r}")
        rp = rp.detach()
    sampled = None  # the sampler's arguments of the op (op.SAMPLER_NAMES), or None: none given
    if wants_sampler(temperature, top_k, top_p, min_p, sampler, mask_outside):
        temperature, sampled = sampler_args(
            labels, R, T, temperature, top_k, top_p, min_p, sampler, mask_outside, process_group
        )
    temperature = check_temperature(temperature)
    softcap = check_float("softcap", softcap, positive=True, allow_none=True)
    ignore_index = check_int("ignore_index", ignore_index)
    max_chunk_bytes = check_int("max_chunk_bytes", max_chunk_bytes, min_value=1, allow_none=True)
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    call = op.Call(
        h2,
        weight,
        lab,
        msk,
        bias,
        pairs,
        des,
        None if ref is None else ref.detach(),
        rh,
        None if ref_weight is None else ref_weight.detach(),
        None if ref_bias is None else ref_bias.detach(),
        rp,
        list(cfg.loss_type),
        None if cfg.loss_weights is None else list(cfg.loss_weights),
        *(getattr(cfg, k) for k in op.CONFIG_FIELDS[2:]),
        float(temperature),
        softcap,
        ignore_index,
        int(max_chunk_bytes or 0),
        logits_dtype,
        bool(return_entropy),
        bool(return_logit_stats),
        False,
        False,
        False,
    )
    if sampled is not None:
        call = op.SamplerCall(*call[: len(op.ARG_NAMES)], *sampled, False, False, False)
    if _CAPTURE:
        _CAPTURE[-1] = (call, shape)
        return None
    args = call[: len(op.ARG_NAMES)]
    if sampled is not None:
        if process_group is not None:
            from ..distributed.vocab_parallel_preference import (
                vocab_parallel_linear_preference_loss,
            )

            loss, st, rows, tok, outside = vocab_parallel_linear_preference_loss(
                args, process_group, vocab_start, reduce_hidden_grad, sampled
            )
        else:
            loss, st, rows, tok, outside = _sampler_op(
                *call[: len(op.ARG_NAMES) + len(op.SAMPLER_NAMES)]
            )
        out = _outputs(call, st, rows, tok, shape, cfg)
        out["outside"] = outside.view(shape)
        return loss, out
    if process_group is not None:
        from ..distributed.vocab_parallel_preference import vocab_parallel_linear_preference_loss

        loss, st, rows, tok = vocab_parallel_linear_preference_loss(
            args, process_group, vocab_start, reduce_hidden_grad
        )
    else:
        loss, st, rows, tok = _op(*args)
    return loss, _outputs(call, st, rows, tok, shape, cfg)


def _outputs(call, st, rows, tok, shape, cfg) -> dict[str, Tensor]:
    out = dict(zip(op.stat_names(call), st.unbind(0)))
    rows_shape = shape[:-1]
    logps, ref, rewards = rows.unbind(0)
    out["logps"] = logps.view(rows_shape)
    if call.ref_logps is not None or call.ref_hidden is not None:
        out["ref_logps"] = ref.view(rows_shape)
    out["rewards"] = rewards.view(rows_shape)
    if not cfg.unpaired:
        if call.pairs is None:
            P = logps.shape[0] // 2
            c, r = slice(0, P), slice(P, 2 * P)
        else:
            c, r = call.pairs[:, 0].long(), call.pairs[:, 1].long()
        out["chosen_logps"], out["rejected_logps"] = _pick(logps, c), _pick(logps, r)
        out["chosen_rewards"], out["rejected_rewards"] = _pick(rewards, c), _pick(rewards, r)
    out["token_logprobs"] = tok[0].view(shape)
    if call.with_entropy:
        out["entropy"] = tok[1].view(shape)
    if call.ref_hidden is not None:
        out["ref_token_logprobs"] = tok[2].view(shape)
    if call.with_logit_stats:
        out["mean_logits"] = tok[3].view(shape)
        out["is_top1"] = tok[4].view(shape) != 0
    return out


def _pick(t, rows):
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def arguments(*args, **kwargs) -> tuple[op.Call, tuple[int, ...]]:
    """What linear_preference_loss(*args, **kwargs) hands the registered op, without running it:
    (its arguments as op.Call -- op.SamplerCall with the sampler's options --, need_* False;
    labels' shape). The tests feed the same Call to
    naive.linear_preference_loss."""
    _CAPTURE.append(None)
    try:
        linear_preference_loss(*args, **kwargs)
        return _CAPTURE[-1]
    finally:
        _CAPTURE.pop()
