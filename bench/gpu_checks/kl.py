"""GPU check for kl_penalty and kl_penalized_rewards (Triton on the GPU; no CUDA C++ kernel: an
elementwise op gains nothing from one): against the float64 formulas, and timed against the
verl-style eager compositions."""
from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.kl import reference as R


def _inputs(B, T, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    lp = (-torch.rand(B, T, generator=g, device="cuda") * 8)
    d = torch.randn(B, T, generator=g, device="cuda") * torch.tensor([1e-3, 1.0, 12.0, 40.0], device="cuda").repeat(T // 4 + 1)[:T]
    return lp.to(dtype), (lp - d).to(dtype)


def correctness(ctx):
    for dtype in (torch.float32, torch.bfloat16):
        lp, ref = _inputs(64, 1001, dtype)
        for est in ("k1", "abs", "k2", "k3", "k3+"):
            for clamp in ("none", "verl", "openrlhf"):
                code, st = R.parse_estimator(est)
                bounds = R.resolve_clamp(clamp, code)
                a = lp.double().requires_grad_()
                b = ref.double().requires_grad_()
                want = R.kl_penalty(a, b, code, st, bounds)
                g = torch.randn_like(want)
                ga_w, = torch.autograd.grad(want, a, g)
                finite = want.abs() < 3e38
                for backend in ("triton", "eager"):
                    x = lp.clone().requires_grad_()
                    with use_backend(kl_penalty=backend):
                        v = pk.kl_penalty(x, ref, est, clamp=clamp)
                        ga, = torch.autograd.grad(v, x, g.float())
                    case = f"{str(dtype)[6:]} {est} clamp={clamp}"
                    ctx.compare("kl_penalty", case, backend, v[finite], want[finite].detach(), 2e-6, 2e-5)
                    gt = (2e-6, 2e-5) if dtype == torch.float32 else (1e-5, 2 ** -7)
                    gfin = ga_w.abs() < 1e30
                    ctx.compare("kl_penalty", case + " grad", backend, ga[gfin], ga_w[gfin], *gt)
    lp, ref = _inputs(37, 3000, torch.float32)
    mask = torch.rand(37, 3000, device="cuda") > 0.3
    mask[3] = False
    scores = torch.randn(37, device="cuda")
    beta = torch.rand(37, device="cuda")
    want = R.kl_penalized_rewards(scores.double(), lp.double(), ref.double(), mask, beta.double(), "k3",
                                  R.resolve_clamp("verl", "k3"))
    for backend in ("triton", "eager"):
        with use_backend(kl_penalized_rewards=backend):
            got = pk.kl_penalized_rewards(scores, lp, ref, mask, beta=beta, estimator="k3", clamp="verl")
        for name, gv, wv in zip(("rewards", "kl", "mean_kl"), got, want):
            ctx.compare("kl_penalized_rewards", f"B=37 T=3000 k3 verl {name}", backend, gv, wv, 1e-5, 1e-5)


def timing(ctx):
    B, T = 512, 8192
    lp, ref = _inputs(B, T, torch.float32)
    mask = torch.rand(B, T, device="cuda") > 0.2
    scores = torch.randn(B, device="cuda")
    beta = torch.tensor(0.05, device="cuda")
    nbytes = lp.numel() * 4
    x = lp.clone().requires_grad_()
    fns = {"triton": lambda: pk.kl_penalty(lp, ref, "k3", clamp="verl"),
           "eager (verl-style)": lambda: R.eager_kl_penalty_verl(lp, ref, "k3")}
    ctx.bench("kl_penalty", f"B={B} T={T} f32 k3 forward", fns, bytes_moved=3 * nbytes)
    fb = {"triton": lambda: torch.autograd.grad(pk.kl_penalty(x, ref, "k3+", clamp="verl").sum(), x),
          "eager (verl-style)": lambda: torch.autograd.grad(R.eager_kl_penalty_verl(x, ref, "k3+").sum(), x)}
    ctx.bench("kl_penalty", f"B={B} T={T} f32 k3+ fwd+bwd", fb)
    rw = {"triton": lambda: pk.kl_penalized_rewards(scores, lp, ref, mask, beta=beta, estimator="k3", clamp="verl"),
          "eager (verl/OpenRLHF-style)": lambda: R.eager_kl_rewards(scores, lp, ref, mask.float(), beta, "k3")}
    ctx.bench("kl_penalized_rewards", f"B={B} T={T} f32 k3", rw, bytes_moved=4 * nbytes + mask.numel())
