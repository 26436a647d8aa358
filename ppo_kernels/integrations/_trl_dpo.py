"""TRL 1.16's `DPOTrainer._compute_loss` on `linear_preference_loss`: the policy's forward runs as
TRL runs it (its fused LM head, `model(..., fused_lm_head=True)`), but the head's
`ChunkedLogProbFunction` call hands over its hidden states and labels instead of computing
per-token outputs (`_trl_grpo.Capture`); the reference model's forward likewise, unless its
sequence log-probs were precomputed. The loss of TRL's `loss_type` list (with `loss_weights`,
`f_divergence_type`, `ld_alpha`, ...) is then one linear_preference_loss pass over those hidden
states with the reference head's tile beside the policy's (no [N, V] logits of either model), and
TRL's metrics are TRL's formulas on the op's outputs: the entropy, the mean logit and whether the
label is the argmax come from the op's tiles (`return_entropy`, `return_logit_stats`).

What keeps TRL's own code (Fallback, naming the argument): `use_weighting` (WPO's weights need
log sum_v p_v^2 per token, a tile statistic the op does not compute), `return_outputs`, autocast
without `cast_lm_head_to_fp32`, ZeRO-3, the edge cases where TRL divides 0 by 0 (an `sft` term
without chosen tokens), and `ipo` / `sigmoid_norm` on completions that start at the first position
(TRL counts their tokens on the unshifted mask there).
"""

from __future__ import annotations

import torch

import ppo_kernels as pk

from ._args import NO_IGNORE, need, tensor
from ._grpo import real
from ._patch import Fallback
from ._trl_grpo import CAPTURE, Capture

DPO_TRAINER = "trl.trainer.dpo_trainer"
_NON_MODEL = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}


class PreferenceCapture(Capture):
    """The fused head's calls of one forward, which may ask for the per-token outputs the
    preference op also gives (entropy, mean logit, top-1)."""

    provides = ("log_probs", "entropy", "mean_logits", "is_top1")


def _plan(tr, inputs, return_outputs):
    """The checks that decide, before any forward, whether the op expresses this call."""
    need(not return_outputs, "return_outputs", "the deprecated logits output recomputes them")
    need(not tr.use_weighting, "use_weighting",
         "WPO's weights need log sum_v p_v^2 per token, a tile statistic the op does not compute")  # fmt: skip
    with tr.accelerator.autocast():
        autocast = torch.is_autocast_enabled(tr.accelerator.device.type)
    need(not autocast, "mixed_precision", "autocast is on (TRL's head runs in the autocast dtype)")
    plugin = getattr(tr.accelerator.state, "deepspeed_plugin", None)
    need(getattr(plugin, "zero_stage", 0) != 3, "deepspeed", "ZeRO-3 gathers the LM head inside")
    types = tuple(tr.loss_types)
    cm = tensor(inputs["completion_mask"], "completion_mask")
    P = cm.shape[0] // 2
    if "sft" in types:
        need(bool(cm[:P, 1:].any()), "loss_type", "sft without a chosen token (TRL: NaN)")
    if any(t in ("ipo", "sigmoid_norm") for t in types):
        need(
            not bool(cm[:, 0].any()),
            "completion_mask",
            "a completion at the first position: TRL's ipo / sigmoid_norm count its tokens on "
            "the unshifted mask",
        )
    kw = dict(
        loss_type=types,
        loss_weights=tuple(float(w) for w in tr.loss_weights),
        beta=real(tr.beta, "beta", lambda v: v > 0, "a positive number"),
        label_smoothing=real(tr.label_smoothing, "label_smoothing"),
        discopop_tau=real(tr.args.discopop_tau, "discopop_tau"),
        f_divergence_type=tr.f_divergence_type,
        f_alpha_divergence_coef=real(tr.f_alpha_divergence_coef, "f_alpha_divergence_coef"),
        ld_alpha=None if tr.ld_alpha is None else real(tr.ld_alpha, "ld_alpha"),
    )
    return kw, cm


def _captured(forward, index_of):
    """(hidden [R, C, H], labels [R, C], head) of the fused head's call inside `forward()`, whose
    per-token output `index_of(outputs)` is the capture's row map."""
    cap = PreferenceCapture()
    token = CAPTURE.set(cap)
    try:
        outputs = forward()
    finally:
        CAPTURE.reset(token)
    index = index_of(outputs)
    if cap.failed or not cap.calls or index.dtype != torch.int64:
        raise Fallback(
            "model",
            f"its fused LM head was not captured ({cap.failed or 'not called as TRL 1.16 does'})",
        )
    return (*cap.gather(index), outputs)


def compute_loss(a, orig, o):
    """DPOTrainer._compute_loss(self, model, inputs, return_outputs) -> loss, TRL's metrics
    logged."""
    from trl.trainer import dpo_trainer as D

    tr, model, inputs = a["self"], a["model"], a["inputs"]
    kw, cm = _plan(tr, inputs, a["return_outputs"])
    mode = "train" if tr.model.training else "eval"
    model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL}
    model_kwargs["use_cache"] = False
    if tr.aux_loss_enabled:
        model_kwargs["output_router_logits"] = True
    shift_cm = cm[..., 1:]
    labels = inputs["input_ids"].masked_fill(cm == 0, -100)
    seq_len = shift_cm.size(1)
    hidden, lab, head, outputs = _captured(
        lambda: model(**model_kwargs, labels=labels, fused_lm_head=True),
        lambda out: out.log_probs[:, -seq_len:],
    )
    ref_kw = {}
    if tr.precompute_ref_logps:
        ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
        ref_kw["ref_logps"] = tensor(ref, "ref_chosen_logps").detach().float()
    else:
        ref_model_kwargs = {k: v for k, v in model_kwargs.items() if k != "output_router_logits"}
        peft_ref = D.is_peft_model(tr.model) and tr.ref_model is None

        def ref_forward():
            grad_ckpt = D.disable_gradient_checkpointing(
                tr.model, tr.args.gradient_checkpointing_kwargs
            )
            with torch.no_grad(), grad_ckpt:
                if peft_ref:
                    unwrapped = tr.accelerator.unwrap_model(tr.model)
                    name = "ref" if "ref" in unwrapped.peft_config else None
                    with D.use_adapter(unwrapped, adapter_name=name):
                        return tr.model(**ref_model_kwargs, labels=labels, fused_lm_head=True)
                return tr.ref_model(**ref_model_kwargs, labels=labels, fused_lm_head=True)

        rh, rlab, rhead, _ = _captured(ref_forward, lambda out: out.log_probs[:, -seq_len:])
        same = all(rhead[k] == head[k] for k in ("temperature", "softcap", "mode"))
        need(same, "ref_model", "its fused head runs at other settings than the policy's")
        need(bool((rlab == lab).all()), "ref_model", "it scored other positions")
        ref_kw.update(ref_hidden=rh, ref_weight=rhead["weight"], ref_bias=rhead["bias"])
    loss, st = pk.linear_preference_loss(
        hidden, head["weight"], lab, bias=head["bias"], temperature=head["temperature"],
        softcap=head["softcap"], ignore_index=NO_IGNORE, logits_dtype=head["mode"],
        return_entropy=True, return_logit_stats=True, **ref_kw, **kw,
    )  # fmt: skip
    if tr.aux_loss_enabled:
        aux = outputs.aux_loss
        loss = loss + tr.router_aux_loss_coef * aux
        tr._metrics[mode]["aux_loss"].append(tr.accelerator.gather_for_metrics(aux).mean().item())
    _metrics(tr, mode, inputs, st, shift_cm)
    return loss


def _metrics(tr, mode, inputs, st, mask):
    """TRL 1.16's logged metrics, its formulas on the op's detached outputs."""
    acc = tr.accelerator
    m = mask.to(torch.float32)
    ent_sum = acc.gather_for_metrics((st["entropy"] * m).sum()).sum()
    total = acc.gather_for_metrics(mask.sum()).sum()
    tr._metrics[mode]["entropy"].append((ent_sum / total).item() if total > 0 else 0.0)
    if mode == "train":
        n = acc.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        tr._total_train_tokens += n // tr._tp_size
    tr._metrics[mode]["num_tokens"] = [tr._total_train_tokens]
    c_mask, r_mask = mask.chunk(2, dim=0)
    c_logits, r_logits = st["mean_logits"].chunk(2, dim=0)
    for name, lg, mk in (("chosen", c_logits, c_mask), ("rejected", r_logits, r_mask)):
        s = acc.gather_for_metrics(lg[mk.bool()].sum()).sum().item()
        k = acc.gather_for_metrics(mk.sum()).sum().item()
        tr._metrics[mode][f"logits/{name}"].append(s / k if k > 0 else 0.0)
    c_top1, _ = st["is_top1"].chunk(2, dim=0)
    correct = acc.gather_for_metrics((c_top1 & c_mask.bool()).sum())
    tokens = acc.gather_for_metrics(c_mask.sum())
    k = tokens.sum()
    tr._metrics[mode]["mean_token_accuracy"].append((correct.sum() / k).item() if k > 0 else 0.0)
    cr, rr = st["chosen_rewards"], st["rejected_rewards"]
    tr._metrics[mode]["rewards/chosen"].append(acc.gather(cr).mean().item())
    tr._metrics[mode]["rewards/rejected"].append(acc.gather(rr).mean().item())
    tr._metrics[mode]["rewards/accuracies"].append(acc.gather((cr > rr).float()).mean().item())
    tr._metrics[mode]["rewards/margins"].append(acc.gather(cr - rr).mean().item())
    tr._metrics[mode]["logps/chosen"].append(acc.gather(st["chosen_logps"]).mean().item())
    tr._metrics[mode]["logps/rejected"].append(acc.gather(st["rejected_logps"]).mean().item())
