"""GPU check for linear_distill_loss (run by bench/gpu_check.py).

Correctness: tests/cuda/test_cuda_linear_distill_loss.py.
Sanitizer: small calls of the CUDA path (the cpp backend: cuBLAS GEMMs, the Triton distillation
tile kernels -- there are no CUDA C++ ones -- and, for a cached teacher, the CUDA token_logprobs
kernels), a teacher head and a top-k teacher, whole tiles and several row blocks.
Timing: the issue's size N=16384, H=4096, V=152064 bf16 (student and teacher heads of the same
width), Liger's defaults (generalised JSD, beta 0.5, temperature 1, weights 0.5 / 0.5), forward +
backward, against Liger 0.8's LigerFusedLinearJSDLoss (compiled, its default), the materialised
loss (both [N, V] logits in bf16, float32 softmax math, autograd) and the four GEMMs alone
(cuBLAS bf16: the floor of a step with a teacher head).
"""

from __future__ import annotations

import torch
from bench_distill import BETA, TEMPERATURE, W_HARD, W_SOFT
from gpu_checks._heads import four_gemms, fwd_bwd, leaves, profile_fwd_bwd

import ppo_kernels as pk
from ppo_kernels.distill.naive import eager_linear_distill_loss

OP = "linear_distill_loss"
DEVICE = "cuda"


def _inputs(N, H, V, dtype, seed=0):
    """Student and teacher heads of width H (the teacher near the student), 10% ignored labels
    (the baselines index with labels in [0, V) only: -100 goes to the op, which ignores it)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = (torch.randn(N, H, device=DEVICE, generator=g) * 0.5).to(dtype)
    W = (torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype)
    th = (h.float() + 0.3 * torch.randn(N, H, device=DEVICE, generator=g)).to(dtype)
    tW = (W.float() + 0.3 * torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    ignored = torch.where(torch.rand(N, device=DEVICE, generator=g) < 0.1, -100, labels)
    return dict(h=h, W=W, th=th, tW=tW, labels=labels, ignored=ignored)


def _fused(x, h, W, **kw):
    loss, _ = pk.linear_distill_loss(
        h, W, x["ignored"], x["th"], x["tW"], beta=BETA, temperature=TEMPERATURE,
        weight_hard_loss=W_HARD, weight_soft_loss=W_SOFT, **kw,
    )  # fmt: skip
    return loss


def sanitize_workload():
    g = torch.Generator().manual_seed(0)
    N, H, V, K = 77, 67, 1001, 6
    for dtype in (torch.float32, torch.bfloat16):
        for budget in (None, 60_000):
            h = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
            W = (torch.randn(V, H, generator=g) / H**0.5).to(DEVICE, dtype).requires_grad_()
            b = torch.randn(V, generator=g).to(DEVICE, dtype).requires_grad_()
            labels = torch.randint(0, V, (N,), generator=g).to(DEVICE)
            labels[::7] = -100
            mask = (torch.rand(N, generator=g) > 0.2).to(DEVICE)
            th = torch.randn(N, 33, generator=g).to(DEVICE, dtype)
            tW = torch.randn(V, 33, generator=g).to(DEVICE, dtype)
            tlp, ids = torch.log_softmax((th.float() @ tW.float().T) / 0.8, -1).topk(K, -1)
            with pk.use_backend(**{OP: "cpp"}):
                for kw in (
                    dict(teacher_hidden=th, teacher_weight=tW, divergence="jsd", beta=0.3),
                    dict(teacher_hidden=th, teacher_weight=tW, divergence="tv", temperature=0.8),
                    dict(topk_ids=ids, topk_logprobs=tlp, divergence="reverse_kl", temperature=0.8),
                ):
                    loss, _ = pk.linear_distill_loss(
                        h, W, labels, bias=b, mask=mask, max_chunk_bytes=budget, **kw
                    )
                    loss.backward()


def _liger(compiled=True):
    """Liger's loss as it runs by default (compiled, chunks of 1024 rows), or None."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except ImportError:
        return None
    return LigerFusedLinearJSDLoss(compiled=compiled)


def timing(ctx, N=16384, H=4096, V=152064):
    x = _inputs(N, H, V, torch.bfloat16)
    h, W = leaves(x)
    step = fwd_bwd(h, W)
    fns = {
        "linear_distill_loss": step(lambda: _fused(x, h, W)),
        'linear_distill_loss logits_dtype="input"': step(
            lambda: _fused(x, h, W, logits_dtype="input")
        ),
    }
    liger = _liger()
    if liger is not None:  # (labels in [0, V): see _inputs)
        fns["liger FusedLinearJSDLoss (compiled)"] = step(
            lambda: liger(h, W, x["th"], x["tW"], x["labels"])
        )
    fns["materialised logits (bf16 GEMMs, float32 math)"] = step(
        lambda: eager_linear_distill_loss(
            h,
            W,
            x["labels"],
            x["th"],
            x["tW"],
            beta=BETA,
            temperature=TEMPERATURE,
            weight_hard_loss=W_HARD,
            weight_soft_loss=W_SOFT,
        )  # fmt: skip
    )
    fns["cuBLAS: the 4 GEMMs alone (floor)"] = four_gemms(h, W, x["th"], x["tW"])
    ctx.bench(OP, f"N={N} H={H} V={V} bf16 jsd(0.5) fwd+bwd", fns, warmup=1, rep=5)


def profile(ctx, N=16384, H=4096, V=152064):
    """The top kernels of one bf16 fwd+bwd of linear_distill_loss (its default backend)."""
    x = _inputs(N, H, V, torch.bfloat16)
    case = f"N={N} H={H} V={V} bf16 jsd(0.5) fwd+bwd"
    profile_fwd_bwd(ctx, OP, case, x, lambda h, W: _fused(x, h, W), DEVICE)
