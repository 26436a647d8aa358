"""GPU check for ppo_policy_loss, ppo_value_loss, grpo/rloo_advantages (Triton on the GPU; no CUDA
C++ kernel: a fused elementwise pass plus a tiny combine gains nothing from one): timing against the
verl-style eager compositions. Correctness and the CUDA-graph capture:
tests/cuda/test_cuda_losses.py."""

from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels.group_advantages import naive as GR
from ppo_kernels.losses import naive as R

AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _inputs(B, T, dtype=torch.float32, spread=0.3):
    g = torch.Generator(device="cuda").manual_seed(0)
    lp = -torch.rand(B, T, generator=g, device="cuda") * 3
    old = lp + torch.randn(B, T, generator=g, device="cuda") * spread
    old[:, ::97] = lp[:, ::97] - 35.0  # extreme log-ratios: clamped
    adv = torch.randn(B, T, generator=g, device="cuda")
    mask = torch.rand(B, T, generator=g, device="cuda") > 0.25
    mask[1] = False
    return lp.to(dtype), old.to(dtype), adv, mask


def timing(ctx):
    B, T = 256, 8192
    lp, old, adv, mask = _inputs(B, T)
    m = mask.float()
    x = lp.clone().requires_grad_(True)
    tok = B * T
    for agg in ("token-mean", "seq-mean-token-mean"):
        fns = {
            "triton": lambda: torch.autograd.grad(
                pk.ppo_policy_loss(x, old, adv, mask, dual_clip=3.0, agg=agg)[0], x
            ),
            "eager (verl-style, 3 .item())": lambda: torch.autograd.grad(
                R.eager_policy_loss_verl_style(x, old, adv, m, 0.2, 0.2, 3.0, agg)[0], x
            ),
            "eager (no .item())": lambda: torch.autograd.grad(
                R.eager_policy_loss_verl_style(x, old, adv, m, 0.2, 0.2, 3.0, agg, sync=False)[0], x
            ),
        }
        # forward reads lp, old, adv (4 B) + mask (1 B); backward reads them again and writes the grad
        ctx.bench(
            "ppo_policy_loss",
            f"B={B} T={T} f32 {agg} fwd+bwd",
            fns,
            bytes_moved=tok * (13 + 13 + 4),
        )
    fv = {
        "triton": lambda: torch.autograd.grad(pk.ppo_value_loss(x, old, adv, mask, clip=0.2)[0], x),
        "eager (verl-style)": lambda: torch.autograd.grad(
            R.eager_value_loss_verl_style(x, old, adv, m, 0.2)[0], x
        ),
    }
    ctx.bench("ppo_value_loss", f"B={B} T={T} f32 fwd+bwd", fv, bytes_moved=tok * (13 + 13 + 4))
    g = torch.Generator(device="cuda").manual_seed(0)
    for Bg in (1024, 8192):
        s = torch.randint(0, 2, (Bg,), generator=g, device="cuda").float()
        idx = torch.arange(Bg, device="cuda") // 8
        fg = {
            "triton (group_size)": lambda: pk.grpo_advantages(s, group_size=8),
            "triton (group_index)": lambda: pk.grpo_advantages(s, idx),
            "eager (scatter, float64)": lambda: GR.group_advantages(s, idx).float(),
        }
        if Bg <= 1024:
            fg["eager (verl-style loop)"] = lambda: GR.eager_grpo_verl_style(s, idx)
        ctx.bench("grpo_advantages", f"B={Bg} groups of 8", fg)
