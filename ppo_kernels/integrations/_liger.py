"""Liger adapter: `liger_kernel.chunked_loss`'s fused linear GRPO loss (`LigerFusedLinearGRPOFunction`,
which `LigerFusedLinearGRPOLoss` calls, and its functional alias `liger_fused_linear_grpo`) on
`linear_policy_loss`: the same arguments, the same `(loss, (kl_mean?, clip_fraction))`, gradients to
the input, the weight and the bias. Semantics read from Liger-Kernel 0.8.5's source; the mapping of
its loss types to ours is in docs/ppo-math.md, what falls back (and why) in the README.

Liger's `compiled` and `chunk_size` only choose how it computes (ours plans its own chunks).
The fused distillation loss (`LigerFusedLinearJSDLoss`) is _liger_distill.py's."""

from __future__ import annotations

import torch

import ppo_kernels as pk

from . import _liger_distill
from ._args import NO_IGNORE, need, tensor
from ._grpo import AGG, loss_kwargs, real
from ._liger_preference import TARGETS as PREFERENCE_TARGETS
from ._patch import Noted, Peer, Target

GRPO = "liger_kernel.chunked_loss.grpo_loss"
FUNCTIONAL = "liger_kernel.chunked_loss.functional"


def _per_row_ratio(v, B, T, loss_type, level):
    """vllm_is_ratio [B, T] / [B, 1] / [B] as our per-token weights [B, T] (Liger multiplies the
    policy term by it, not the KL term: so do our weights)."""
    v = tensor(v, "vllm_is_ratio")
    need(v.is_floating_point(), "vllm_is_ratio", f"dtype {v.dtype}")
    ok = (v.dim() == 1 and v.shape[0] == B) or (v.dim() == 2 and tuple(v.shape) in ((B, 1), (B, T)))
    need(ok, "vllm_is_ratio", f"shape {tuple(v.shape)} (expected [B], [B, 1] or [B, T])")
    per_token = v.dim() == 2 and v.shape[1] == T and T != 1
    need(
        not (loss_type == "luspo" and per_token),
        "vllm_is_ratio",
        "per token with luspo: Liger then sums the policy term over masked positions too",
    )
    return v.detach().reshape(B, -1).expand(B, T)


def _mask_ok(m):
    """Liger divides by clamp(count, 1), ours by the count: the same for every bool / integer
    mask, and for a float mask whose row totals are each 0 or at least 1 (one host sync)."""
    if not m.is_floating_point():
        return True
    n = m.sum(-1)
    return bool(((n == 0) | (n >= 1)).all())


def _dapo_normalizer(num_items, device):
    """Liger's dapo / cispo denominator as our global_num_tokens: num_items_in_batch over the
    processes (at least 1); without it the local mask total, which our token-mean takes itself."""
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    if num_items is None:
        need(
            world == 1,
            "num_items_in_batch",
            "None under torch.distributed: Liger all-reduces the mask total across the ranks",
        )
        return None
    if isinstance(num_items, torch.Tensor):
        need(num_items.numel() == 1, "num_items_in_batch", "expected a single value")
        return torch.clamp(num_items.detach().to(device, torch.float32).reshape(()) / world, min=1)
    return max(real(num_items, "num_items_in_batch") / world, 1.0)


def grpo_apply(a, orig, o):
    """LigerFusedLinearGRPOFunction.apply(_input [B, T, H], weight [V, H], selected_token_ids,
    attention_mask, advantages [B], bias, ref_per_token_logps, old_per_token_logps, ref_input,
    ref_weight, ref_bias, beta, epsilon_low, epsilon_high, loss_type, max_completion_length,
    importance_sampling_level, sapo_temperature_pos / _neg, temperature, compiled, use_ref_model,
    chunk_size, vllm_is_ratio, delta, use_bias_correction_kl, vespo_*, num_items_in_batch)."""
    h, w = tensor(a["_input"], "_input"), tensor(a["weight"], "weight")
    ids = tensor(a["selected_token_ids"], "selected_token_ids")
    mask = tensor(a["attention_mask"], "attention_mask")
    adv = tensor(a["advantages"], "advantages")
    t = a["loss_type"]
    need(isinstance(t, str) and t in AGG, "loss_type", f"{t!r} is not a loss type of ours")
    level = a["importance_sampling_level"]
    need(level in ("token", "sequence"), "importance_sampling_level", f"{level!r}")
    need(
        not (level == "sequence" and t in ("cispo", "sapo")),
        "importance_sampling_level",
        f"Liger refuses sequence level for {t}",
    )
    need(h.dim() == 3, "_input", f"expected [B, T, H], got shape {tuple(h.shape)}")
    B, T, H = h.shape
    need(w.dim() == 2 and w.shape[1] == H, "weight", f"expected [V, {H}]")
    need(tuple(ids.shape) == (B, T), "selected_token_ids", "expected [B, T]")
    need(ids.dtype in (torch.int64, torch.int32), "selected_token_ids", f"dtype {ids.dtype}")
    need(tuple(mask.shape) == (B, T), "attention_mask", "expected [B, T]")
    need(tuple(adv.shape) == (B,), "advantages", "expected one per sequence, [B]")
    need(adv.is_floating_point(), "advantages", f"dtype {adv.dtype}")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    need(h.dtype in dtypes, "_input", f"dtype {h.dtype}")
    need(w.dtype == h.dtype, "weight", f"dtype {w.dtype} differs from the input's {h.dtype}")
    bias = a["bias"]
    if bias is not None:
        need(tensor(bias, "bias").dtype == h.dtype, "bias", "dtype differs from the input's")
    need(
        not torch.is_autocast_enabled(h.device.type),
        "_input",
        "autocast is on (Liger's logits GEMMs run in the autocast dtype)",
    )
    need(_mask_ok(mask), "attention_mask", "a float mask with a row total in (0, 1)")

    beta = real(a["beta"], "beta")
    temperature = real(a["temperature"], "temperature", lambda v: v > 0, "a positive number")
    kw = loss_kwargs(
        t,
        level,
        a["epsilon_low"],
        a["epsilon_high"],
        a["delta"],
        a["sapo_temperature_pos"],
        a["sapo_temperature_neg"],
    )
    agg, all_rows = AGG[t]
    kw["agg"] = agg
    if all_rows:
        kw["global_batch_size"] = B
    if t == "dr_grpo":
        mcl = a["max_completion_length"]
        kw["loss_scale_factor"] = real(
            mcl, "max_completion_length", lambda v: v > 0, "a positive number (dr_grpo)"
        )
    if t in ("dapo", "cispo"):
        kw["global_num_tokens"] = _dapo_normalizer(a["num_items_in_batch"], h.device)

    # KL: Liger's k3 against the reference log-probs, given or from the reference head
    use_ref = bool(a["use_ref_model"])
    ref, ref_in = a["ref_per_token_logps"], a["ref_input"]
    need(
        not use_ref or ref is not None or ref_in is not None,
        "use_ref_model",
        "neither ref_per_token_logps nor ref_input given",
    )
    kl_on = beta != 0 and use_ref
    need(
        not (kl_on and a["use_bias_correction_kl"]),
        "use_bias_correction_kl",
        "the KL times the (differentiated) importance ratio is not a KL form of ours",
    )
    need(
        not (kl_on and t == "luspo"),
        "beta",
        "luspo with a KL term: Liger sums the KL over masked positions too",
    )
    need(
        not (t == "luspo" and level == "token"),
        "importance_sampling_level",
        "token-level luspo: Liger sums the policy term over masked positions too",
    )
    notes = []
    # masked positions are never read by Liger: our ignore label there (any value may stand in them)
    labels = torch.where(mask != 0, ids.long(), torch.full((), NO_IGNORE, device=ids.device))
    mode = "input" if h.dtype in (torch.bfloat16, torch.float16) else "float32"
    if kl_on:
        if ref is None:
            rh, rw = tensor(ref_in, "ref_input"), tensor(a["ref_weight"], "ref_weight")
            need(tuple(rh.shape[:2]) == (B, T) and rh.dim() == 3, "ref_input", "expected [B, T, H]")
            need(rw.dtype == rh.dtype, "ref_weight", "dtype differs from ref_input's")
            rb = a["ref_bias"]
            need(rb is None or rb.dtype == rh.dtype, "ref_bias", "dtype differs from ref_input's")
            with torch.no_grad():
                ref = pk.linear_token_logprobs(
                    rh,
                    rw,
                    labels,
                    bias=rb,
                    temperature=temperature,
                    ignore_index=NO_IGNORE,
                    logits_dtype=mode,
                )
            notes.append("the reference log-probs from ref_input first (linear_token_logprobs)")
        ref = tensor(ref, "ref_per_token_logps")
        need(tuple(ref.shape) == (B, T), "ref_per_token_logps", "expected [B, T]")
        kw.update(ref_logprobs=ref.detach().float(), kl_coef=beta, kl_estimator="k3")
    if a["vllm_is_ratio"] is not None:
        kw["weights"] = _per_row_ratio(a["vllm_is_ratio"], B, T, t, level)
    old = a["old_per_token_logps"]
    if old is None:  # Liger's ratio is then exactly 1: the current log-probs, detached, first
        with torch.no_grad():
            old = pk.linear_token_logprobs(
                h.detach(),
                w.detach(),
                labels,
                bias=None if bias is None else bias.detach(),
                temperature=temperature,
                ignore_index=NO_IGNORE,
                logits_dtype=mode,
            )
        notes.append("old_per_token_logps=None: the current log-probs first (one more pass)")
    old = tensor(old, "old_per_token_logps")
    need(tuple(old.shape) == (B, T), "old_per_token_logps", "expected [B, T]")

    loss, st = pk.linear_policy_loss(
        h,
        w,
        labels,
        adv.detach(),
        old.detach().float(),
        mask,
        bias=bias,
        temperature=temperature,
        ignore_index=NO_IGNORE,
        logits_dtype=mode,
        **kw,
    )
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    metrics = []
    if beta != 0:  # without a reference model Liger's KL is of the policy to itself: 0
        metrics.append(st["kl_mean"] if kl_on else zero)
    # Liger's clip fraction: TRL's clipped region (none for sapo)
    metrics.append(st.get("clip_region_frac", zero))
    out = (o.out(loss, torch.float32), tuple(o.out(m, torch.float32) for m in metrics))
    return Noted(out, "; ".join(notes)) if notes else out


PEER = Peer(
    "liger",
    "liger_kernel",
    ("0.8.",),
    [
        Target(GRPO, "LigerFusedLinearGRPOFunction", grpo_apply),
        Target(FUNCTIONAL, "liger_fused_linear_grpo", grpo_apply),
        *PREFERENCE_TARGETS,  # DPO, ORPO, SimPO, CPO, KTO (_liger_preference.py)
    ],
)
PEER.targets.extend(_liger_distill.targets())  # LigerFusedLinearJSDLoss
