"""Liger adapter, preference half: `liger_kernel.chunked_loss`'s fused linear DPO, ORPO, SimPO, CPO
and KTO losses (the autograd Functions their `LigerFusedLinear*Loss` modules call, and the
functional aliases) on `linear_preference_loss`: the same arguments, the same `(loss, aux)` --
each aux output in Liger's order -- and gradients to the input, the weight and the bias. Semantics
read from Liger-Kernel 0.8.5's source (chunked_loss/fused_linear_preference.py,
fused_linear_unpaired_preference.py and each loss's file); the mapping is docs/ppo-math.md's
("Preference losses"). `_liger.py` adds these targets to the Liger peer.

Liger's `compiled` and `chunk_size` only choose how it computes (ours plans its own blocks); its
metrics do not depend on them. Liger's logits means / sums are of the raw logits h W^T + b over
every position of the rows, ignored ones too: they are linear in h, so they come from one GEMV
of the summed hidden states, not from the tiles. What falls back (and why): an `nll_target`
(an NLL on a second label per token, which the row kernels do not take), a row without tokens
under `average_log_prob` or no chosen token under the NLL term (Liger divides 0 by 0: NaN, ours
gives 0), a per-row KTO `kl`, autocast, a loss type or option value Liger itself refuses (its
own error then)."""

from __future__ import annotations

import torch

import ppo_kernels as pk

from .._math import acc_dtype
from ._args import need, tensor
from ._grpo import real
from ._patch import Target

PREFIX = "liger_kernel.chunked_loss."
FUNCTIONAL = PREFIX + "functional"

# Liger's DPO types (LigerFusedLinearDPOLoss._SUPPORTED_LOSS_TYPES; "ipo" raises there)
DPO_TYPES = (
    "sigmoid",
    "hinge",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
)


def _head(a, kto=False):
    """(hidden [R, T, H], weight, labels [R, T], bias, ignore_index) of Liger's call, checked."""
    h, w = tensor(a["_input"], "_input"), tensor(a["weight"], "weight")
    y = tensor(a["target"], "target")
    need(h.dim() == 3, "_input", f"expected [rows, T, H], got shape {tuple(h.shape)}")
    R, T, H = h.shape
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    need(h.dtype in dtypes, "_input", f"dtype {h.dtype}")
    need(w.dim() == 2 and w.shape[1] == H, "weight", f"expected [V, {H}]")
    need(w.dtype == h.dtype, "weight", f"dtype {w.dtype} differs from the input's {h.dtype}")
    need(tuple(y.shape) == (R, T), "target", "expected [rows, T]")
    need(y.dtype in (torch.int64, torch.int32), "target", f"dtype {y.dtype}")
    need(kto or R % 2 == 0, "_input", "an odd number of rows (chosen; rejected)")
    b = a["bias"]
    if b is not None:
        need(tensor(b, "bias").dtype == h.dtype, "bias", "dtype differs from the input's")
    need(
        not torch.is_autocast_enabled(h.device.type),
        "_input",
        "autocast is on (Liger's logits GEMMs run in the autocast dtype)",
    )
    ii = a["ignore_index"]
    need(isinstance(ii, int) and not isinstance(ii, bool), "ignore_index", "expected an int")
    return h, w, y, b, ii


def _reference(a, h, use_ref):
    """ref_hidden / ref_weight / ref_bias keyword arguments of the reference head, or {}."""
    if not use_ref:
        return {}
    rh, rw, rb = a["ref_input"], a["ref_weight"], a["ref_bias"]
    need(rh is not None and rw is not None, "use_ref_model", "no ref_input / ref_weight given")
    rh, rw = tensor(rh, "ref_input"), tensor(rw, "ref_weight")
    need(tuple(rh.shape[:2]) == tuple(h.shape[:2]) and rh.dim() == 3, "ref_input", "shape")
    need(rw.dtype == rh.dtype, "ref_weight", "dtype differs from ref_input's")
    need(rb is None or tensor(rb, "ref_bias").dtype == rh.dtype, "ref_bias", "dtype")
    return dict(ref_hidden=rh, ref_weight=rw, ref_bias=rb)


def _rows_have_tokens(y, ii, argument="average_log_prob"):
    """Liger's mean of a row without tokens is 0 / 0 (NaN); ours is 0 (one host sync)."""
    need(bool(((y != ii).sum(-1) > 0).all()), argument, "a row without tokens (Liger: NaN)")


def _logits_sums(h, w, b):
    """The sum over every position of each row of the raw logits h W^T + b, [R]: linear in h,
    so (sum_t h_t) . (sum_v W_v) + T sum_v b_v (one GEMV; no tile)."""
    with torch.no_grad():
        acc = acc_dtype(h.dtype)
        s = h.detach().to(acc).sum(1) @ w.detach().to(acc).sum(0)
        if b is not None:
            s = s + h.shape[1] * b.detach().to(acc).sum()
    return s


def _mode(h):
    # bf16 / fp16: Liger's logits tile is a GEMM in the input dtype, as logits_dtype="input"
    return "input" if h.dtype in (torch.bfloat16, torch.float16) else "float32"


def _paired(a, o, types, kw, *, use_ref=False, compute_nll=False, alpha=1.0, average=True,
            extra=()):  # fmt: skip
    """The paired losses' common path: Liger's (loss, (chosen_logps, rejected_logps,
    chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_rewards, rejected_rewards,
    *extra))."""
    need(a.get("nll_target") is None, "nll_target", "an NLL on a second label per token")
    h, w, y, b, ii = _head(a)
    R, T, _ = h.shape
    P = R // 2
    if average:
        _rows_have_tokens(y, ii)
    if compute_nll:
        need(bool((y[:P] != ii).any()), "compute_nll_loss", "no chosen token (Liger: NaN)")
        types, kw = types + ("sft",), dict(kw, loss_weights=(1.0, alpha))
    loss, st = pk.linear_preference_loss(
        h, w, y, bias=b, ignore_index=ii, loss_type=types, average_log_prob=average,
        logits_dtype=_mode(h), **_reference(a, h, use_ref), **kw,
    )  # fmt: skip
    V = w.shape[0]
    sums = _logits_sums(h, w, b)
    denom = P * T * V
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    aux = [
        st["chosen_logps"],
        st["rejected_logps"],
        sums[:P].sum() / denom,
        sums[P:].sum() / denom,
        st["nll_loss"] if compute_nll else zero,
        st["chosen_rewards"],
        st["rejected_rewards"],
    ] + [st[k] for k in extra]
    f32 = torch.float32
    return o.out(loss, f32), tuple(o.out(t, f32) for t in aux)


def dpo_apply(a, orig, o):
    """LigerFusedLinearDPOFunction.apply(_input, weight, target, bias, ref_input, ref_weight,
    ref_bias, ignore_index, beta, compute_nll_loss, compiled, use_ref_model, average_log_prob,
    chunk_size, loss_type, label_smoothing, discopop_tau, alpha)."""
    t = a["loss_type"]
    need(t in DPO_TYPES, "loss_type", f"{t!r} is not one of Liger's DPO types (its own error)")
    eps = real(a["label_smoothing"], "label_smoothing")
    need(t != "exo_pair" or eps > 0, "label_smoothing", "exo_pair needs > 0 (Liger's error)")
    need(t != "robust" or 0 <= eps < 0.5, "label_smoothing", "robust needs [0, 0.5) (Liger's)")
    kw = dict(
        beta=real(a["beta"], "beta", lambda v: v > 0, "a positive number"),
        label_smoothing=eps,
        discopop_tau=real(a["discopop_tau"], "discopop_tau", lambda v: v > 0, "positive"),
    )
    return _paired(
        a, o, (t,), kw, use_ref=bool(a["use_ref_model"]), compute_nll=bool(a["compute_nll_loss"]),
        alpha=real(a["alpha"], "alpha"), average=bool(a["average_log_prob"]),
    )  # fmt: skip


def orpo_apply(a, orig, o):
    """LigerFusedLinearORPOFunction.apply(_input, weight, target, bias, ignore_index, beta,
    compute_nll_loss, nll_target, compiled, chunk_size): mean log-probs, NLL weight 1 (the base's
    defaults); aux + (log_odds_ratio, log_odds_chosen)."""
    kw = dict(beta=real(a["beta"], "beta", lambda v: v > 0, "a positive number"))
    return _paired(a, o, ("orpo",), kw, compute_nll=bool(a["compute_nll_loss"]),
                   extra=("log_odds_ratio", "log_odds_chosen"))  # fmt: skip


def simpo_apply(a, orig, o):
    """LigerFusedLinearSimPOFunction.apply(_input, weight, target, bias, ignore_index, beta,
    alpha, label_smoothing, compute_nll_loss, compiled, gamma, chunk_size): mean log-probs (the
    base's default)."""
    kw = dict(
        beta=real(a["beta"], "beta", lambda v: v > 0, "a positive number"),
        label_smoothing=real(a["label_smoothing"], "label_smoothing", lambda v: 0 <= v <= 1),
        simpo_gamma=real(a["gamma"], "gamma"),
    )
    return _paired(a, o, ("simpo",), kw, compute_nll=bool(a["compute_nll_loss"]),
                   alpha=real(a["alpha"], "alpha"))  # fmt: skip


def cpo_apply(a, orig, o):
    """LigerFusedLinearCPOFunction.apply(_input, weight, target, bias, ignore_index, beta, alpha,
    label_smoothing, compute_nll_loss, compiled, average_log_prob, chunk_size)."""
    kw = dict(
        beta=real(a["beta"], "beta", lambda v: v > 0, "a positive number"),
        label_smoothing=real(a["label_smoothing"], "label_smoothing", lambda v: 0 <= v <= 1),
    )
    return _paired(a, o, ("cpo",), kw, compute_nll=bool(a["compute_nll_loss"]),
                   alpha=real(a["alpha"], "alpha"), average=bool(a["average_log_prob"]))  # fmt: skip


def kto_apply(a, orig, o):
    """LigerFusedLinearKTOFunction.apply(_input, weight, target, preference_labels, bias,
    ref_input, ref_weight, ref_bias, kl, ignore_index, beta, compiled, use_ref_model,
    average_log_prob, chunk_size) -> (loss, (chosen_logps_sum, rejected_logps_sum,
    chosen_logits_sum, rejected_logits_sum, chosen_rewards_sum, rejected_rewards_sum))."""
    h, w, y, b, ii = _head(a, kto=True)
    R = h.shape[0]
    lab = tensor(a["preference_labels"], "preference_labels")
    need(lab.dtype == torch.bool and tuple(lab.shape) == (R,), "preference_labels", "[rows] bool")
    average = bool(a["average_log_prob"])
    if average:
        _rows_have_tokens(y, ii)
    kl = a["kl"]
    if kl is not None:
        kl = tensor(kl, "kl", "expected a tensor or None")
        need(kl.numel() == 1, "kl", "one value per row (ours: one reference point)")
    loss, st = pk.linear_preference_loss(
        h, w, y, bias=b, ignore_index=ii, loss_type="kto", desirable=lab, reference_point=kl,
        beta=real(a["beta"], "beta", lambda v: v > 0, "a positive number"),
        average_log_prob=average, logits_dtype=_mode(h),
        **_reference(a, h, bool(a["use_ref_model"])),
    )  # fmt: skip
    sums = _logits_sums(h, w, b)
    labf = lab.to(sums.dtype)
    aux = (
        st["chosen_logps_sum"],
        st["rejected_logps_sum"],
        (sums * labf).sum(),
        (sums * (1 - labf)).sum(),
        st["chosen_rewards_sum"],
        st["rejected_rewards_sum"],
    )
    f32 = torch.float32
    return o.out(loss, f32), tuple(o.out(t, f32) for t in aux)


_LOSSES = {
    "dpo": ("LigerFusedLinearDPOFunction", dpo_apply),
    "orpo": ("LigerFusedLinearORPOFunction", orpo_apply),
    "simpo": ("LigerFusedLinearSimPOFunction", simpo_apply),
    "cpo": ("LigerFusedLinearCPOFunction", cpo_apply),
    "kto": ("LigerFusedLinearKTOFunction", kto_apply),
}

TARGETS = [Target(f"{PREFIX}{k}_loss", cls, impl) for k, (cls, impl) in _LOSSES.items()] + [
    Target(FUNCTIONAL, f"liger_fused_linear_{k}", impl) for k, (_, impl) in _LOSSES.items()
]
