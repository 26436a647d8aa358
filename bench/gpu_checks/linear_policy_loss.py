"""GPU check for linear_policy_loss (run by bench/gpu_check.py).

Correctness: tests/cuda/test_cuda_linear_policy_loss.py.
Sanitizer: small calls of the CUDA path (whole-vocabulary tiles and vocabulary chunks, a
sequence-level loss, the exact KL to a reference head).
Timing: the issue's size N=32768, H=4096, V=152064 bf16, bnpo with a k3 KL (beta 0.04), forward +
backward, against our composition (linear_token_logprobs + ppo_policy_loss + kl_penalty, four
GEMMs), Liger 0.8's LigerFusedLinearGRPOLoss (compiled, its default), TRL 1.16's fused LM head + its
bnpo loss, and the three GEMMs alone (cuBLAS bf16: the floor of a three-GEMM step). The targets:
at most 200 ms, ahead of Liger and TRL.
"""

from __future__ import annotations

import torch
from bench_linear_policy_loss import (
    composition_loss,
    fused_loss,
    liger_loss,
    liger_module,
    trl_bnpo_loss,
)
from gpu_checks._heads import fwd_bwd, leaves, profile_fwd_bwd

import ppo_kernels as pk

OP = "linear_policy_loss"
DEVICE = "cuda"
T = 1024  # tokens per sequence (32 sequences at N=32768)


def _inputs(N, H, V, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    B = N // T
    h = (torch.randn(B, T, H, device=DEVICE, generator=g) * 0.5).to(dtype)
    W = (torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (B, T), device=DEVICE, generator=g)
    adv = torch.randn(B, device=DEVICE, generator=g)
    with torch.no_grad():
        lp = pk.linear_token_logprobs(h, W, labels)
    old = lp + torch.randn(B, T, device=DEVICE, generator=g) * 0.1
    ref = lp + torch.randn(B, T, device=DEVICE, generator=g) * 0.1
    mask = torch.rand(B, T, device=DEVICE, generator=g) > 0.1
    return dict(h=h, W=W, labels=labels, adv=adv, old=old, ref=ref, mask=mask)


def sanitize_workload():
    g = torch.Generator().manual_seed(0)
    B_, T_, H, V = 3, 37, 67, 1001
    for dtype in (torch.float32, torch.bfloat16):
        for budget in (None, 20_000):
            h = torch.randn(B_, T_, H, generator=g).to(DEVICE, dtype).requires_grad_()
            W = (torch.randn(V, H, generator=g) / H**0.5).to(DEVICE, dtype).requires_grad_()
            b = torch.randn(V, generator=g).to(DEVICE, dtype).requires_grad_()
            labels = torch.randint(0, V, (B_, T_), generator=g).to(DEVICE)
            labels[:, ::7] = -100
            adv, old, ref = (torch.randn(B_, T_, generator=g).to(DEVICE) for _ in range(3))
            mask = (torch.rand(B_, T_, generator=g) > 0.2).to(DEVICE)
            ref_h = torch.randn(B_, T_, 33, generator=g).to(DEVICE, dtype)
            ref_w = torch.randn(V, 33, generator=g).to(DEVICE, dtype)
            with pk.use_backend(**{OP: "cpp"}):  # the CUDA C++ reductions
                for kw in (
                    dict(ref_logprobs=old - 1, kl_coef=0.1, entropy_coef=0.01),
                    dict(loss_type="grpo", importance_sampling_level="sequence"),
                    dict(ref_hidden=ref_h, ref_weight=ref_w, kl_coef=0.1, softcap=30.0),
                ):
                    loss, _ = pk.linear_policy_loss(
                        h, W, labels, adv, old - 0.5, mask, bias=b, max_chunk_bytes=budget, **kw
                    )
                    loss.backward()


def _liger():
    """Liger's loss as it runs by default (compiled chunks of its default size), or None."""
    try:
        return liger_module(True)
    except ImportError:
        return None


def timing(ctx, N=32768, H=4096, V=152064):
    x = _inputs(N, H, V, torch.bfloat16)
    h, W = leaves(x)
    step = fwd_bwd(h, W)
    fns = {
        "linear_policy_loss": step(lambda: fused_loss(x, h, W)),
        'linear_policy_loss logits_dtype="input"': step(
            lambda: fused_loss(x, h, W, logits_dtype="input")
        ),
        'linear_policy_loss logits_dtype="float32"': step(
            lambda: fused_loss(x, h, W, logits_dtype="float32")
        ),
        "composition (4 GEMMs)": step(lambda: composition_loss(x, h, W)),
    }
    liger = _liger()  # (its eager chunks are the same math, slower)
    if liger is not None:
        fns["liger FusedLinearGRPOLoss (compiled)"] = step(lambda: liger_loss(liger, x, h, W))
    try:
        from gpu_checks.linear_logprobs import _trl_chunked_logprob

        trl_head = _trl_chunked_logprob(("log_probs",))
    except ImportError:
        trl_head = None
    if trl_head is not None:
        fns["trl ChunkedLogProbFunction + bnpo loss"] = step(
            lambda: trl_bnpo_loss(x, trl_head(h.view(-1, H), W, x["labels"].view(-1))[0])
        )

    hf = h.detach().view(-1, H)
    Wd = W.detach()

    def three_gemms():
        z = hf @ Wd.T  # the logits, then the same [N, V] tile as the gradient
        z @ Wd, z.T @ hf

    fns["cuBLAS: the 3 GEMMs alone (floor)"] = three_gemms
    ctx.bench(OP, f"N={N} H={H} V={V} bf16 bnpo+k3 fwd+bwd", fns, warmup=1, rep=5)


def profile(ctx, N=32768, H=4096, V=152064):
    """The top kernels of one bf16 fwd+bwd of linear_policy_loss (bnpo + k3 KL, its default
    backend)."""
    x = _inputs(N, H, V, torch.bfloat16)
    case = f"N={N} H={H} V={V} bf16 bnpo+k3 fwd+bwd"
    profile_fwd_bwd(ctx, OP, case, x, lambda h, W: fused_loss(x, h, W), DEVICE)
