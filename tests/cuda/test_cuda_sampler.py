"""token_logprobs under the sampler's distribution and full_kl with per-row temperatures on the GPU:
the CUDA (cpp) and Triton kernels against the documented rules and the float64 values on their
kept set (tests/support/sampler.py), every output NaN-poisoned, up to the Qwen vocabulary."""

import math

import pytest
import torch
from support.gpu import DEVICE, MARKS, big, close, close_scaled, require
from support.sampler import check_against_truth, kept_from_cut, kl64, sampler_op
from support.utils import GRAD_TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend

pytestmark = MARKS
BACKENDS = ["cpp", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
# (rows, V)
CASES = [(6, 40), big(8, 4099), big(3, 152064)]
SETTINGS = [
    # (T, top_k, top_p, min_p, sampler)
    (0.7, 5, 1.0, 0.0, "vllm"),
    (1.0, 0, 0.9, 0.02, "vllm"),
    (1.3, 20, 0.9, 0.0, "sglang"),
    (1.0, 0, 0.5, 0.1, "sglang"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,V", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_follows_the_rules(backend, N, V, dtype):
    require("token_logprobs", backend)
    logits = (torch.randn(N, V) * 2).to(dtype)
    labels = torch.randint(0, V, (N,))
    labels[::3] = -100
    for T, k, p, mp, sampler in SETTINGS:
        with use_backend(backend), poisoned():
            outs = sampler_op(
                logits.to(DEVICE), labels.to(DEVICE), T, k, p, mp, sampler, stats_top_k=min(V, 5)
            )
        outs = [o.cpu() for o in outs]
        check_against_truth(logits.float(), labels, T, k, p, mp, sampler, outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_gradients_per_row_parameters(backend, dtype):
    require("token_logprobs", backend)
    N, V = 10, 200
    logits = (torch.randn(N, V) * 2).to(dtype)
    labels = torch.randint(0, V, (N,))
    labels[::4] = -100
    T = torch.rand(N) + 0.5
    k = torch.randint(0, 40, (N,))
    p = torch.rand(N) * 0.8 + 0.2
    x = logits.to(DEVICE, copy=True).requires_grad_(True)
    with use_backend(backend), poisoned():
        lp, ent = pk.token_logprobs(
            x, labels.to(DEVICE), temperature=T.to(DEVICE), top_k=k.to(DEVICE),
            top_p=p.to(DEVICE), return_entropy=True,
        )  # fmt: skip
        g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
        (torch.where(torch.isfinite(lp), lp, 0) * g_lp + ent * g_ent).sum().backward()
        outs = sampler_op(x.detach(), labels.to(DEVICE), 1.0, 0, 1.0, 0.0, "vllm",
                          temps=T.to(DEVICE), ks=k.to(DEVICE), ps=p.to(DEVICE))  # fmt: skip
    kept = kept_from_cut(logits, outs[3].cpu(), outs[4].cpu())
    x64 = logits.double().requires_grad_(True)
    z = x64 / T.double().unsqueeze(-1)
    lse = torch.logsumexp(torch.where(kept, z, torch.full_like(z, -math.inf)), -1, keepdim=True)
    logq = torch.where(kept, z - lse, torch.zeros_like(z))
    q = torch.where(kept, logq.exp(), torch.zeros_like(z))
    valid = labels != -100
    lab = labels.clamp(min=0).unsqueeze(-1)
    use = valid & kept.gather(-1, lab).squeeze(-1)
    lp64 = torch.where(use, logq.gather(-1, lab).squeeze(-1), 0)
    ent64 = torch.where(valid, -(q * logq).sum(-1), 0)
    (lp64 * g_lp.cpu().double() + ent64 * g_ent.cpu().double()).sum().backward()
    assert torch.equal(torch.isfinite(lp.cpu()), use | ~valid)
    close_scaled(x.grad.cpu(), x64.grad, **GRAD_TOL[dtype], scale=float(x64.grad.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_kl_per_row_temperature(backend, dtype):
    require("full_kl", backend)
    B, T, V = 3, 5, 300
    x = (torch.randn(B, T, V) * 2).to(dtype)
    y = (torch.randn(B, T, V) * 2).to(dtype)
    temps = torch.rand(B, T) + 0.5
    xg = x.to(DEVICE, copy=True).requires_grad_(True)
    with use_backend(backend), poisoned():
        kl = pk.full_kl(xg, y.to(DEVICE), temperature=temps.to(DEVICE))
        g = torch.randn_like(kl)
        (kl * g).sum().backward()
    x64 = x.double().requires_grad_(True)
    want = kl64(x64, y, temps.double().unsqueeze(-1))
    (want * g.cpu().double()).sum().backward()
    close(kl.cpu(), want.detach(), atol=5e-5, rtol=2e-5)
    close(xg.grad.cpu(), x64.grad, **GRAD_TOL[dtype])
