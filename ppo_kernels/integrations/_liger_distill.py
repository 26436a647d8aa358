"""Liger adapter, distillation: `liger_kernel.chunked_loss`'s fused linear JSD loss
(`LigerFusedLinearJSDFunction`, which `LigerFusedLinearJSDLoss` calls, and its functional alias
`liger_fused_linear_jsd`) on `linear_distill_loss`: the same arguments, the same loss (or
`(loss, soft_loss, hard_loss)`), gradients to the student's input, weight and bias, none to the
teacher. Semantics read from Liger-Kernel 0.8.5's source (docs/ppo-math.md, "Distillation
losses"): its generalised JSD with beta 0 = forward KL and beta 1 = reverse KL, the hard loss at
temperature 1, both over the tokens whose label is not ignore_index.

What falls back: a teacher vocabulary larger than the student's (Liger pads the student's logits
with zeros), different student and teacher dtypes, a temperature <= 0, beta outside [0, 1],
non-finite weights, autocast. bf16 / fp16 heads run the GEMMs in the input dtype as Liger does
and the softmax math in float32 (Liger's soft loss runs in the input dtype): a note in `report`.
Liger's `compiled` and `chunk_size` only choose how it computes (ours plans its own chunks)."""

from __future__ import annotations

import math

import torch

import ppo_kernels as pk

from ._args import need, tensor
from ._grpo import real
from ._patch import Noted, Target

JSD = "liger_kernel.chunked_loss.jsd_loss"
FUNCTIONAL = "liger_kernel.chunked_loss.functional"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def jsd_apply(a, orig, o):
    """LigerFusedLinearJSDFunction.apply(student_input [..., H_s], student_weight [V, H_s],
    teacher_input [..., H_t], teacher_weight [V, H_t], true_labels [...], student_bias,
    teacher_bias, weight_hard_loss, weight_soft_loss, beta, ignore_index, temperature,
    compiled, chunk_size, return_soft_hard_loss)."""
    h, w = (
        tensor(a["student_input"], "student_input"),
        tensor(a["student_weight"], "student_weight"),
    )
    th = tensor(a["teacher_input"], "teacher_input")
    tw = tensor(a["teacher_weight"], "teacher_weight")
    y = tensor(a["true_labels"], "true_labels")
    need(h.dtype in _FLOATS, "student_input", f"dtype {h.dtype}")
    need(w.dtype == h.dtype, "student_weight", "dtype differs from the student's input")
    need(th.dtype == h.dtype, "teacher_input", "dtype differs from the student's input")
    need(tw.dtype == h.dtype, "teacher_weight", "dtype differs from the student's input")
    need(h.dim() >= 2 and w.dim() == 2 and w.shape[1] == h.shape[-1], "student_weight",
         "expected [V, H] of the input's width")  # fmt: skip
    need(th.dim() == h.dim() and tw.dim() == 2 and tw.shape[1] == th.shape[-1], "teacher_weight",
         "expected [V, H_t] of the teacher input's width")  # fmt: skip
    need(
        tw.shape[0] == w.shape[0],
        "teacher_weight",
        f"vocabulary {tw.shape[0]} differs from the student's {w.shape[0]} (Liger pads the "
        "student's logits with zeros to a larger teacher vocabulary)",
    )
    need(y.dtype in (torch.int64, torch.int32), "true_labels", f"dtype {y.dtype}")
    need(tuple(y.shape) == tuple(h.shape[:-1]), "true_labels", "shape is not the input's rows")
    need(tuple(th.shape[:-1]) == tuple(h.shape[:-1]), "teacher_input", "rows differ")
    for name in ("student_bias", "teacher_bias"):
        b = a[name]
        if b is not None:
            need(tensor(b, name).dtype == h.dtype, name, "dtype differs from the input's")
    need(
        not torch.is_autocast_enabled(h.device.type),
        "student_input",
        "autocast is on (Liger's logits GEMMs run in the autocast dtype)",
    )
    finite = "a finite number"
    w_hard = real(a["weight_hard_loss"], "weight_hard_loss", math.isfinite, finite)
    w_soft = real(a["weight_soft_loss"], "weight_soft_loss", math.isfinite, finite)
    beta = real(a["beta"], "beta", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
    temperature = real(
        a["temperature"], "temperature", lambda v: 0 < v < math.inf, "a positive number"
    )
    ii = a["ignore_index"]
    need(isinstance(ii, int) and not isinstance(ii, bool), "ignore_index", "an integer")
    low = h.dtype in (torch.bfloat16, torch.float16)
    loss, st = pk.linear_distill_loss(
        h,
        w,
        y,
        th,
        tw,
        bias=a["student_bias"],
        teacher_bias=a["teacher_bias"],
        divergence="jsd",
        beta=beta,
        temperature=temperature,
        weight_soft_loss=w_soft,
        weight_hard_loss=w_hard,
        ignore_index=ii,
        logits_dtype="input" if low else "float32",
    )
    loss = o.out(loss, torch.float32)
    if a["return_soft_hard_loss"]:
        out = (loss, o.out(st["soft_loss"], torch.float32), o.out(st["hard_loss"], torch.float32))
    else:
        out = loss
    if low:
        return Noted(out, "the divergence in float32 (Liger's in the input dtype)")
    return out


def targets() -> list[Target]:
    """The distillation loss's targets of the Liger peer (_liger.PEER adds them)."""
    return [
        Target(JSD, "LigerFusedLinearJSDFunction", jsd_apply),
        Target(FUNCTIONAL, "liger_fused_linear_jsd", jsd_apply),
    ]
