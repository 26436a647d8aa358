"""GPU check for kl_penalty and kl_penalized_rewards (Triton on the GPU; no CUDA C++ kernel: an
elementwise op gains nothing from one): timed against the verl-style eager compositions.
Correctness: tests/cuda/test_cuda_kl.py."""

from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels.kl import naive as R


def _inputs(B, T, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    lp = -torch.rand(B, T, generator=g, device="cuda") * 8
    d = (
        torch.randn(B, T, generator=g, device="cuda")
        * torch.tensor([1e-3, 1.0, 12.0, 40.0], device="cuda").repeat(T // 4 + 1)[:T]
    )
    return lp.to(dtype), (lp - d).to(dtype)


def timing(ctx):
    B, T = 512, 8192
    lp, ref = _inputs(B, T, torch.float32)
    mask = torch.rand(B, T, device="cuda") > 0.2
    scores = torch.randn(B, device="cuda")
    beta = torch.tensor(0.05, device="cuda")
    nbytes = lp.numel() * 4
    x = lp.clone().requires_grad_()
    fns = {
        "triton": lambda: pk.kl_penalty(lp, ref, "k3", clamp="verl"),
        "eager (verl-style)": lambda: R.eager_kl_penalty_verl(lp, ref, "k3"),
    }
    ctx.bench("kl_penalty", f"B={B} T={T} f32 k3 forward", fns, bytes_moved=3 * nbytes)
    fb = {
        "triton": lambda: torch.autograd.grad(pk.kl_penalty(x, ref, "k3+", clamp="verl").sum(), x),
        "eager (verl-style)": lambda: torch.autograd.grad(
            R.eager_kl_penalty_verl(x, ref, "k3+").sum(), x
        ),
    }
    ctx.bench("kl_penalty", f"B={B} T={T} f32 k3+ fwd+bwd", fb)
    rw = {
        "triton": lambda: pk.kl_penalized_rewards(
            scores, lp, ref, mask, beta=beta, estimator="k3", clamp="verl"
        ),
        "eager (verl/OpenRLHF-style)": lambda: R.eager_kl_rewards(
            scores, lp, ref, mask.float(), beta, "k3"
        ),
    }
    ctx.bench(
        "kl_penalized_rewards", f"B={B} T={T} f32 k3", rw, bytes_moved=4 * nbytes + mask.numel()
    )
