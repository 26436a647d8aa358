"""TRL adapter: trl.trainer.utils' per-token log-prob / entropy functions and the fused LM head's
`ChunkedLogProbFunction` (the path GRPOTrainer / RLOOTrainer take in TRL 1.16 with
`model(..., fused_lm_head=True)`) on ppo_kernels ops, GRPOTrainer's loss computation on
linear_policy_loss (_trl_grpo) and DPOTrainer's on linear_preference_loss (_trl_dpo). Semantics
read from TRL 1.16.0."""

from __future__ import annotations

import numbers

import torch

import ppo_kernels as pk

from ._args import NO_IGNORE, entropy, logits_arg, need, tensor
from ._patch import Fallback, Peer, Target
from ._trl_dpo import DPO_TRAINER
from ._trl_dpo import compute_loss as dpo_compute_loss
from ._trl_grpo import CAPTURE, GRPO_TRAINER, compute_loss

UTILS = "trl.trainer.utils"
CHUNKED = "trl.kernels.chunked_logprob"


def _index(a, x):
    y = tensor(a["index"], "index")
    need(y.dtype in (torch.int64, torch.int32), "index", f"dtype {y.dtype}")
    need(
        tuple(y.shape) == tuple(x.shape[:-1]),
        "index",
        f"shape {tuple(y.shape)}: only one label per row (shape logits.shape[:-1]); top-K gathers "
        "are not supported",
    )
    rm = a["row_mask"]
    if rm is not None:  # TRL: rows with row_mask == 0 give 0 (and no gradient): our ignore label
        rm = tensor(rm, "row_mask")
        need(tuple(rm.shape) == tuple(y.shape), "row_mask", "shape is not that of index")
        y = torch.where(rm != 0, y, torch.full((), NO_IGNORE, dtype=torch.int64, device=y.device))
    return y


def _temperature(a):
    t = a["temperature"]
    need(isinstance(t, numbers.Real) and t > 0, "temperature", "expected a positive number")
    return float(t)


def selective_log_softmax(a, orig, o):
    x = logits_arg(a)
    y = _index(a, x)
    lp = pk.token_logprobs(x, y, temperature=_temperature(a), ignore_index=NO_IGNORE)
    return o.out(lp, x.dtype)


def entropy_from_logits(a, orig, o):
    x = logits_arg(a)
    return o.out(entropy(x), x.dtype)


def selective_log_softmax_and_entropy(a, orig, o):
    x = logits_arg(a)
    y = _index(a, x)
    lp, ent = pk.token_logprobs(
        x, y, temperature=_temperature(a), ignore_index=NO_IGNORE, return_entropy=True
    )
    if not a["entropy_requires_grad"]:
        ent = ent.detach()
    return o.out(lp, x.dtype), o.out(ent, x.dtype)


_PROVIDED = ("log_probs", "entropy")


def _chunked_args(a, provided=_PROVIDED) -> dict:
    """ChunkedLogProbFunction's arguments as linear_token_logprobs takes them (or Fallback);
    `provided`: the per-token outputs the caller computes (a capture's may be more)."""
    h, w = tensor(a["hidden"], "hidden"), tensor(a["weight"], "weight")
    y = tensor(a["targets"], "targets")
    cap = a["final_logit_softcapping"]
    need(
        cap is None or (isinstance(cap, numbers.Real) and cap > 0),
        "final_logit_softcapping",
        "expected None or a positive number",
    )
    outputs = tuple(a["outputs"] or ())
    extra = sorted(set(outputs) - set(provided))
    need(not extra, "outputs", f"{extra} are not computed by linear_token_logprobs")
    scale = a["logit_scale"]
    need(
        isinstance(scale, numbers.Real) and scale > 0 and (cap is None or scale == 1),
        "logit_scale",
        "only a positive scale (folded into the temperature), and not with soft-capping (TRL "
        "scales before the cap)",
    )
    need(
        not torch.is_autocast_enabled(h.device.type),
        "hidden",
        "autocast is on (TRL computes the tiles in the autocast dtype)",
    )
    need(h.dim() == 2 and w.dim() == 2 and y.dim() == 1, "hidden", "expected [N, H], [V, H], [N]")
    need(w.dtype == h.dtype, "weight", f"dtype {w.dtype} differs from the hidden states' {h.dtype}")
    return dict(
        hidden=h,
        weight=w,
        bias=a["bias"],
        targets=y,
        temperature=_temperature(a) / float(scale),  # z = scale * logits / T
        softcap=None if cap is None else float(cap),
        # bf16 / fp16: TRL rounds each logits tile to the input dtype, as logits_dtype="input" does
        mode="input" if h.dtype in (torch.bfloat16, torch.float16) else "float32",
        entropy="entropy" in outputs,
    )


def chunked_logprob_apply(a, orig, o):
    """ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
    final_logit_softcapping, logit_scale, outputs) -> (log_probs, entropy, log_sum_sq_probs,
    mean_logits, is_top1) on linear_token_logprobs (chunk_size: ours plans its own tiles). Inside
    GRPOTrainer._compute_loss's forward the call is captured instead (its hidden states go to the
    fused loss: _trl_grpo.Capture)."""
    capture = CAPTURE.get()
    try:
        c = _chunked_args(a, getattr(capture, "provides", _PROVIDED))
        if capture is not None:
            return capture.add(c)
    except Fallback as f:
        if capture is not None:
            capture.failed = f"{f.argument}: {f.reason}"
        raise
    res = pk.linear_token_logprobs(
        c["hidden"],
        c["weight"],
        c["targets"],
        bias=c["bias"],
        temperature=c["temperature"],
        ignore_index=NO_IGNORE,
        return_entropy=c["entropy"],
        logits_dtype=c["mode"],
        softcap=c["softcap"],
    )
    lp, ent = res if c["entropy"] else (res, None)
    return lp.float(), (ent.float() if ent is not None else None), None, None, None


PEER = Peer(
    "trl",
    "trl",
    ("1.16.",),
    [
        Target(UTILS, "selective_log_softmax", selective_log_softmax),
        Target(UTILS, "entropy_from_logits", entropy_from_logits),
        Target(UTILS, "selective_log_softmax_and_entropy", selective_log_softmax_and_entropy),
        Target(CHUNKED, "ChunkedLogProbFunction", chunked_logprob_apply),
        Target(GRPO_TRAINER, "GRPOTrainer._compute_loss", compute_loss, optional=True),
        Target(DPO_TRAINER, "DPOTrainer._compute_loss", dpo_compute_loss, optional=True),
    ],
)
