"""TRL 1.16's `GRPOTrainer._compute_loss` on `linear_policy_loss`: the policy's forward runs as
TRL runs it (its fused LM head, `model(..., fused_lm_head=True)`), but the head's
`ChunkedLogProbFunction` call hands over its hidden states and labels instead of computing log-probs
(`Capture`); the loss of `loss_type` with its KL, entropy bonus, importance-sampling weights and
aggregation is then one linear_policy_loss pass over those hidden states (the logits computed once,
no [N, V] tensor), and TRL's metrics are TRL's formulas on the op's per-token log-probs / entropy.

TRL's per-token coefficients, and how they map: the policy term of row b weighs A_b (its
aggregation: 1 / (B n_b) for grpo / sapo, one scalar for the others), the KL beta A_b, the entropy
bonus entropy_coef / N (a token mean, whatever the loss type). Our op gives the KL and the entropy
the same per-token coefficients up to a scalar and the policy term extra per-token `weights`: so
without an entropy bonus the op runs the loss type's own aggregation; with one, a token mean over N
with the row coefficients in the policy weights -- exact unless grpo / sapo also has a KL term and
rows of different lengths (then TRL's own code runs: the op has no separate entropy aggregation).
"""

from __future__ import annotations

import contextvars

import torch

import ppo_kernels as pk

from ._args import NO_IGNORE, need, tensor
from ._grpo import AGG, CLIPPED, loss_kwargs, real
from ._patch import Fallback, Noted

GRPO_TRAINER = "trl.trainer.grpo_trainer"

CAPTURE: contextvars.ContextVar = contextvars.ContextVar("ppo_kernels_trl_capture", default=None)

# the multimodal inputs _compute_loss hands the forward (TRL 1.16)
_MODEL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class Capture:
    """The fused head's calls during one policy forward. Each keeps its hidden rows, labels and
    head, and returns, in place of the log-probs and the entropy, its rows' index + 1 (int64):
    the head scatters them to the positions it scored, so the forward's `log_probs` is the map
    from completion tokens to hidden rows (0: not scored), whichever rows the head kept."""

    def __init__(self):
        self.calls: list[dict] = []
        self.rows = 0
        self.failed: str | None = None

    def add(self, c: dict):
        h = c["hidden"]
        need(not hasattr(c["weight"], "ds_id"), "weight", "ZeRO-3 gathers the LM head only there")
        idx = torch.arange(self.rows + 1, self.rows + h.shape[0] + 1, device=h.device)
        self.calls.append(c)
        self.rows += h.shape[0]
        return idx, idx, None, None, None

    def gather(self, index):
        """(hidden [B, C, H], labels [B, C] with NO_IGNORE where unscored, the head's call)."""
        first = self.calls[0]
        for c in self.calls[1:]:
            same = c["weight"] is first["weight"] and c["bias"] is first["bias"]
            same = same and all(c[k] == first[k] for k in ("temperature", "softcap", "mode"))
            need(same, "model", "the fused head's calls used different heads or settings")
        cat = len(self.calls) > 1
        h = torch.cat([c["hidden"] for c in self.calls]) if cat else first["hidden"]
        y = torch.cat([c["targets"] for c in self.calls]) if cat else first["targets"]
        pos = index - 1
        rows = pos.clamp(min=0)
        labels = torch.where(pos >= 0, y[rows].long(), torch.full((), NO_IGNORE, device=y.device))
        return h[rows], labels, first


def _denominator(tr, t, m, inputs, train):
    """TRL's aggregation denominator of loss type t (a 0-dim float32 tensor), None for grpo /
    sapo (per row: n_b)."""
    B = m.shape[0]
    if t == "bnpo":
        return m.sum().clamp(min=1.0)
    if t == "dr_grpo":
        return torch.tensor(float(B * tr.max_completion_length), device=m.device)
    if t == "luspo":
        return torch.tensor(float(B), device=m.device)
    if t in ("dapo", "cispo"):
        n = tensor(inputs["num_items_in_batch"], "num_items_in_batch")
        n = n.clamp(min=1.0) / tr.accelerator.num_processes
        if train:
            n = n * tr.current_gradient_accumulation_steps / tr.args.steps_per_generation
        return n.to(torch.float32).reshape(())
    return None


def _plan(tr, inputs):
    """The checks that decide, before the forward, whether the op expresses this call."""
    args = tr.args
    t = tr.loss_type
    need(t in AGG, "loss_type", f"{t!r} has no counterpart in linear_policy_loss")
    level = tr.importance_sampling_level
    kw = loss_kwargs(
        t,
        level,
        tr.epsilon_low,
        tr.epsilon_high,
        args.delta,
        args.sapo_temperature_pos,
        args.sapo_temperature_neg,
    )
    need(
        tr.off_policy_mask_threshold is None,
        "off_policy_mask_threshold",
        "the off-policy sequence mask needs the current log-probs before the loss",
    )
    beta = real(tr.beta, "beta")
    old = inputs.get("old_per_token_logps")
    bias_kl = beta != 0 and args.use_bias_correction_kl
    if bias_kl:  # kl * ratio: on-policy, k3's value and k2's gradient lp - ref ("k3+")
        need(
            old is None,
            "use_bias_correction_kl",
            "with old_per_token_logps: the KL times the importance ratio has the per-token "
            "gradient ratio * (lp - ref), which no KL form of ours has",
        )
        need(
            level == "token",
            "use_bias_correction_kl",
            "with sequence-level importance sampling: the ratio's gradient spreads the KL over "
            "the sequence",
        )
    top = tr.top_entropy_quantile < 1.0
    need(
        not (top and level == "sequence"),
        "top_entropy_quantile",
        "with sequence-level importance sampling (TRL's sequence ratio averages over tokens the "
        "entropy mask drops from the loss)",
    )
    need(
        not (top and beta != 0),
        "top_entropy_quantile",
        "with a KL term (TRL masks the policy term and the entropy bonus by it, not the KL)",
    )
    with tr.accelerator.autocast():
        autocast = torch.is_autocast_enabled(tr.accelerator.device.type)
    need(
        not autocast or args.cast_lm_head_to_fp32,
        "mixed_precision",
        "autocast is on (TRL's head computes its tiles in the autocast dtype)",
    )
    plugin = getattr(tr.accelerator.state, "deepspeed_plugin", None)
    need(
        getattr(plugin, "zero_stage", 0) != 3,
        "deepspeed",
        "ZeRO-3 gathers the LM head only inside the head's call",
    )
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    isr = None
    if tr.use_vllm and tr.vllm_importance_sampling_correction:
        isr = tensor(inputs["importance_sampling_ratio"], "importance_sampling_ratio")
        need(
            isr.dim() == 2 and isr.shape[0] == mask.shape[0] and isr.shape[1] in (1, mask.shape[1]),
            "importance_sampling_ratio",
            f"shape {tuple(isr.shape)} (expected [B, T] or [B, 1])",
        )
    if old is None:  # TRL's ratio is exp(lp - lp.detach()): 1, with lp's gradient
        need(
            not (t in CLIPPED and args.delta is not None and args.delta < 1),
            "delta",
            "below 1 with old_per_token_logps=None (the two-sided clip is then active at ratio 1)",
        )
        need(
            not (level == "sequence" and isr is not None and isr.shape[1] != 1),
            "importance_sampling_ratio",
            "per token with sequence-level importance sampling and old_per_token_logps=None",
        )
    ent_coef = 0.0
    if tr._entropy_bonus_enabled:
        ent_coef = tr.entropy_coef
        if tr.use_adaptive_entropy and tr._last_world_entropy > args.entropy_target:
            ent_coef = 0.0
    if ent_coef != 0 and beta != 0 and t in ("grpo", "sapo"):
        n_b = mask.sum(-1)
        need(
            bool((n_b == n_b[0]).all()),
            "entropy_coef",
            f"with beta and {t} on completions of different lengths: TRL weighs the KL per "
            "sequence and the entropy per token, our op gives both one aggregation",
        )
    return dict(
        t=t,
        kw=kw,
        beta=beta,
        kl="k3+" if bias_kl else "k3",
        top=top,
        mask=mask,
        isr=isr,
        old=old,
        ent_coef=ent_coef,
    )


def compute_loss(a, orig, o):
    """GRPOTrainer._compute_loss(self, model, inputs) -> loss, TRL's metrics logged."""
    tr, model, inputs = a["self"], a["model"], a["inputs"]
    p = _plan(tr, inputs)
    t, beta, mask = p["t"], p["beta"], p["mask"]
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    C = completion_ids.size(1)
    cap = Capture()
    token = CAPTURE.set(cap)
    try:
        index, _, aux_loss = tr._get_per_token_logps_and_entropies(
            model,
            ids,
            attn,
            C,
            compute_entropy=True,
            compute_aux_loss=tr.aux_loss_enabled,
            **{k: inputs.get(k) for k in _MODEL_INPUTS},
        )
    finally:
        CAPTURE.reset(token)
    B = ids.shape[0]
    if cap.failed or not cap.calls or index.dtype != torch.int64 or index.shape != (B, C):
        raise Fallback(
            "model",
            f"its fused LM head was not captured ({cap.failed or 'not called as TRL 1.16 does'}); "
            "TRL's loss ran the forward again",
        )
    hidden, labels, head = cap.gather(index)
    notes = []
    train = tr.model.training
    m = mask.to(torch.float32)
    opmask = mask
    if p["top"]:  # TRL's entropy mask, from the entropies of a first pass (no gradient)
        with torch.no_grad():
            _, ent0 = _head_pass(hidden, labels, head)
        opmask = mask * tr.get_high_entropy_mask(ent0, mask, 1 - tr.top_entropy_quantile)
        notes.append("top_entropy_quantile: the entropies first (one more pass, no gradient)")
    adv = inputs["advantages"]
    adv_t = adv.unsqueeze(1) if adv.dim() == 1 else adv
    accum = tr.current_gradient_accumulation_steps if train else 1.0
    denom = _denominator(tr, t, m, inputs, train)
    row = 1.0 / (B * m.sum(-1).clamp(min=1.0)) if denom is None else (1.0 / denom).expand(B)
    wts = None if p["isr"] is None else p["isr"].detach().to(torch.float32).expand(B, C)
    kw = dict(p["kw"])
    old = p["old"]
    on_policy = old is None
    if on_policy:  # ratio 1: -A * lp (gpg) has TRL's gradient; its value is corrected below
        kw = dict(loss_type="gpg", importance_sampling_level="token")
        if t == "cispo":  # -clamp(1, max=epsilon_high) * A * lp: value and gradient
            f = min(1.0, tr.epsilon_high)
            wts = torch.full((B, C), f, device=m.device) if wts is None else wts * f
        old = torch.zeros_like(m)
    ent_coef = 0.0
    if p["ent_coef"] == 0 and not (denom is None and p["top"]):  # the type's own aggregation
        if denom is None:
            kw.update(agg="seq-mean-token-mean", global_batch_size=B)
        else:
            kw.update(agg="token-mean", global_num_tokens=denom)
        weights = wts
    else:  # a token mean over TRL's entropy denominator, the rows' coefficients in the weights
        # (grpo / sapo's n_b are of TRL's mask, not of the entropy-masked one the op gets)
        n_eff = opmask.to(torch.float32).sum().clamp(min=1.0)
        if denom is None:
            d = n_eff
            weights = (d * row).unsqueeze(1).expand(B, C)
            weights = weights if wts is None else weights * wts
            ent_coef = float(p["ent_coef"])
        else:
            d, weights = denom, wts
            ratio = 1.0 if t == "bnpo" and not p["top"] else float(denom / n_eff)
            ent_coef = float(p["ent_coef"]) * ratio / (accum if t in ("dapo", "cispo") else 1.0)
        kw.update(agg="token-mean", global_num_tokens=d)
    ref = None
    if beta != 0:
        ref = tensor(inputs["ref_per_token_logps"], "ref_per_token_logps").detach().float()
    loss, st = pk.linear_policy_loss(
        hidden,
        head["weight"],
        labels,
        adv.detach().float(),
        old.detach().float(),
        opmask,
        bias=head["bias"],
        ref_logprobs=ref,
        weights=weights,
        kl_coef=beta,
        kl_estimator=p["kl"],
        entropy_coef=ent_coef,
        temperature=head["temperature"],
        softcap=head["softcap"],
        ignore_index=NO_IGNORE,
        logits_dtype=head["mode"],
        **kw,
    )
    if on_policy and t != "cispo":  # TRL's value at ratio 1: -A (clipped), -A * 2 / tau (sapo)
        v = -adv_t.float()
        if t == "sapo":
            tau = torch.where(adv_t > 0, tr.args.sapo_temperature_pos, tr.args.sapo_temperature_neg)
            v = v * 2 / tau
        k = row.unsqueeze(1) * opmask.to(torch.float32)
        value = (k * v * (1.0 if wts is None else wts)).sum()
        loss = loss - st["pg_loss"] + value
    policy_loss = loss.detach() + ent_coef * st["entropy_loss"]
    if t not in ("dapo", "cispo"):
        loss = loss / accum
    lp, ent = st["logprobs"], st["entropy"]
    mode = "train" if train else "eval"
    _entropy_bookkeeping(tr, mode, policy_loss, ent, opmask)
    if tr.aux_loss_enabled:
        loss = loss + tr.router_aux_loss_coef * aux_loss / accum
        tr._metrics[mode]["aux_loss"].append(
            tr.accelerator.gather_for_metrics(aux_loss).mean().item()
        )
    _metrics(tr, mode, lp, lp if p["old"] is None else p["old"], ent, ref, adv_t, mask)
    return Noted(loss, "; ".join(notes)) if notes else loss


def _head_pass(hidden, labels, head):
    return pk.linear_token_logprobs(
        hidden,
        head["weight"],
        labels,
        bias=head["bias"],
        temperature=head["temperature"],
        ignore_index=NO_IGNORE,
        return_entropy=True,
        logits_dtype=head["mode"],
        softcap=head["softcap"],
    )


def _entropy_bookkeeping(tr, mode, policy_loss, entropies, effective_mask):
    """TRL's entropy-bonus block less the loss term (in the op): its metrics and the adaptive
    coefficient's update, on the op's entropies."""
    if not tr._entropy_bonus_enabled:
        return
    tr._metrics[mode]["policy_loss"].append(tr.accelerator.gather(policy_loss).nanmean().item())
    if tr.use_adaptive_entropy and mode == "train":
        stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
        if tr._entropy_window_stats is None:
            tr._entropy_window_stats = stats
        else:
            tr._entropy_window_stats = tr._entropy_window_stats + stats
        if tr.accelerator.sync_gradients:
            window = tr.accelerator.reduce(tr._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            a = tr.args
            if world_entropy <= a.entropy_target:
                tr.entropy_coef = min(tr.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
            else:
                tr.entropy_coef = max(tr.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
            tr._last_world_entropy = world_entropy
            tr._entropy_window_stats = None
    if mode == "train" and tr.accelerator.sync_gradients:
        tr._metrics[mode]["entropy_coef"].append(tr.entropy_coef)


def _metrics(tr, mode, lp, old, entropies, ref, advantages, mask):
    """TRL 1.16's logged metrics (kl, entropy, clip ratios), its formulas on our detached values."""
    from trl.trainer.utils import nanmax, nanmin

    log_ratio = lp - old
    if tr.importance_sampling_level == "token":
        log_iw = log_ratio
    else:
        log_iw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_iw)

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = tr.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    metrics = tr._metrics[mode]
    if ref is not None:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if tr.args.use_bias_correction_kl:
            kl = kl * coef_1
        metrics["kl"].append(global_masked_mean(kl))
    metrics["entropy"].append(global_masked_mean(entropies))
    if tr.loss_type in CLIPPED:
        if tr.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=tr.args.delta)
        low = ((coef_1 < 1 - tr.epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + tr.epsilon_high) & (advantages > 0)).float()
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
        gathered_low = tr.accelerator.gather(masked_seq_mean(low))
        metrics["clip_ratio/low_min"].append(nanmin(gathered_low).item())
        gathered_high = tr.accelerator.gather(masked_seq_mean(high))
        metrics["clip_ratio/high_max"].append(nanmax(gathered_high).item())
    elif tr.loss_type == "cispo":
        clipped = ((coef_1 > tr.epsilon_high) & (advantages > 0)).float()
        metrics["cispo_clip_ratio"].append(global_masked_mean(clipped))
