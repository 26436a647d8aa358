"""GPU check for linear_preference_loss (run by bench/gpu_check.py).

Correctness: tests/cuda/test_cuda_linear_preference_loss.py.
Sanitizer: small calls of the CUDA path (the cpp backend: cuBLAS GEMMs and the CUDA token_logprobs
kernels): paired types with a reference head, given reference log-probs and none, an unpaired
type, float32 and bf16, whole pairs per block and pairs longer than a block (a first pass).
Timing: N=16384 tokens (32 completions of 512, the first 32 positions of each the prompt), H=4096,
V=152064 bf16, sigmoid DPO (beta 0.1) with a reference head of the same width, forward + backward,
against Liger 0.8's LigerFusedLinearDPOLoss (compiled, its default), the materialised loss (both
heads' [N, V] logits, float32 log_softmax, autograd: bench/bench_preference.py's) and the four
GEMMs alone (cuBLAS bf16: the floor of a step with a reference head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_preference import BETA, PROMPT
from gpu_checks._heads import four_gemms, fwd_bwd, leaves, profile_fwd_bwd

import ppo_kernels as pk

OP = "linear_preference_loss"
DEVICE = "cuda"
T = 512  # tokens per completion: N=16384 is 16 pairs


def _inputs(N, H, V, dtype, seed=0):
    """2P completions of T tokens (the first half chosen), a reference head near the policy,
    labels in [0, V) after the prompt (the baselines index with labels in [0, V) only; the prompt's
    -100 the op and Liger ignore, the materialised loss masks)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    R = N // T
    h = (torch.randn(R, T, H, device=DEVICE, generator=g) * 0.5).to(dtype)
    W = (torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype)
    rh = (h.float() + 0.05 * torch.randn(R, T, H, device=DEVICE, generator=g)).to(dtype)
    rW = (W.float() + 0.01 * torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (R, T), device=DEVICE, generator=g)
    labels[:, : min(PROMPT, T // 2)] = -100
    return dict(h=h, W=W, rh=rh, rW=rW, labels=labels)


def _fused(x, h, W, **kw):
    loss, _ = pk.linear_preference_loss(
        h, W, x["labels"], ref_hidden=x["rh"], ref_weight=x["rW"], beta=BETA, **kw
    )
    return loss


def sanitize_workload():
    g = torch.Generator().manual_seed(0)
    P, Tq, H, V = 3, 9, 67, 1001
    R = 2 * P
    for dtype in (torch.float32, torch.bfloat16):
        # None: every pair in one block; 20_000 bytes: ~4 rows of float32 tiles per block, a pair
        # (2 x 9 tokens) longer than a block
        for budget in (None, 20_000):
            h = torch.randn(R, Tq, H, generator=g).to(DEVICE, dtype).requires_grad_()
            W = (torch.randn(V, H, generator=g) / H**0.5).to(DEVICE, dtype).requires_grad_()
            b = (0.2 * torch.randn(V, generator=g)).to(DEVICE, dtype).requires_grad_()
            labels = torch.randint(0, V, (R, Tq), generator=g).to(DEVICE)
            labels[:, :2] = -100
            mask = (torch.rand(R, Tq, generator=g) > 0.1).to(DEVICE)
            rh = torch.randn(R, Tq, 33, generator=g).to(DEVICE, dtype)
            rW = (torch.randn(V, 33, generator=g) / 33**0.5).to(DEVICE, dtype)
            ref = torch.randn(R, generator=g).to(DEVICE) - 20
            desirable = (torch.rand(R, generator=g) > 0.5).to(DEVICE)
            with pk.use_backend(**{OP: "cpp"}):
                for kw in (
                    dict(ref_hidden=rh, ref_weight=rW, loss_type="sigmoid"),
                    dict(ref_logps=ref, loss_type="ipo", beta=0.5),
                    dict(loss_type=("orpo", "sft"), return_entropy=True),
                    dict(ref_hidden=rh, ref_weight=rW, loss_type="aot", label_smoothing=0.2),
                    dict(ref_logps=ref, loss_type="kto", desirable=desirable),
                ):
                    loss, _ = pk.linear_preference_loss(
                        h, W, labels, mask, bias=b, max_chunk_bytes=budget, **kw
                    )
                    loss.backward()


def _liger(compiled=True):
    """Liger's loss as it runs by default (compiled, chunks of 1 pair), or None."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    except ImportError:
        return None
    return LigerFusedLinearDPOLoss(beta=BETA, compiled=compiled)


def _seq_logps(logits, labels):
    keep = labels != -100
    lp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1))
    return (lp.squeeze(-1) * keep).sum(-1)


def _materialised(x, h, W):
    """bench_preference.materialised on the GPU: both heads' logits whole (the reference's under
    no_grad), float32 log_softmax, autograd."""
    with torch.no_grad():
        ref = _seq_logps(x["rh"] @ x["rW"].T, x["labels"])
    seq = _seq_logps(h @ W.T, x["labels"])
    P = seq.shape[0] // 2
    z = BETA * ((seq[:P] - ref[:P]) - (seq[P:] - ref[P:]))
    return -F.logsigmoid(z).mean()


def _fits(N, V):
    """Whether the materialised loss fits: its peak holds about three float32 [N, V] tensors
    (the log_softmax, its gradient, the upcast logits) beside the bf16 logits."""
    if DEVICE != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return free > 1.3 * (3 * 4 + 2 * 2) * N * V


def timing(ctx, N=16384, H=4096, V=152064):
    # Estimates at H100 speed: a GEMM of 2 N H V = 20.4 TFLOP, ~41 ms at 500 TFLOP/s. The fused
    # step runs 4 (policy and reference tiles, the two gradient GEMMs) + the reductions over
    # ~10 GB float32 tiles: ~180 ms; Liger and the materialised loss ~200-300 ms (Liger's first
    # call compiles its chunk: ~30-60 s); the floor ~165 ms. Each row ~8 calls (the peak's, 5 for
    # do_bench's estimate, warmup 1, rep 5 ms = 1): ~2 s per row, 5 rows + Liger's compile:
    # ~1-1.5 min.
    x = _inputs(N, H, V, torch.bfloat16)
    h, W = leaves(x)
    step = fwd_bwd(h, W)
    fns = {
        "linear_preference_loss": step(lambda: _fused(x, h, W)),
        'linear_preference_loss logits_dtype="input"': step(
            lambda: _fused(x, h, W, logits_dtype="input")
        ),
    }
    liger = _liger()
    if liger is not None:  # its arguments: (lm_head weight, hidden, labels, bias, ref hidden,
        # ref weight, ref bias); the first half of the rows chosen, as here
        fns["liger FusedLinearDPOLoss (compiled)"] = step(
            lambda: liger(W, h, x["labels"], None, x["rh"], x["rW"], None)[0]
        )
    if _fits(N, V):
        fns["materialised logits (bf16 GEMMs, float32 log_softmax)"] = step(
            lambda: _materialised(x, h, W)
        )
    fns["cuBLAS: the 4 GEMMs alone (floor)"] = four_gemms(h, W, x["rh"], x["rW"])
    ctx.bench(OP, f"N={N} (2x{N // T // 2} x {T}) H={H} V={V} bf16 sigmoid DPO + ref head fwd+bwd",
              fns, warmup=1, rep=5)  # fmt: skip


def profile(ctx, N=16384, H=4096, V=152064):
    """The top kernels of one bf16 fwd+bwd of linear_preference_loss (its default backend)."""
    x = _inputs(N, H, V, torch.bfloat16)
    case = f"N={N} H={H} V={V} bf16 sigmoid DPO + ref head fwd+bwd"
    profile_fwd_bwd(ctx, OP, case, x, lambda h, W: _fused(x, h, W), DEVICE)
