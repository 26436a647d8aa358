"""kl_penalty and kl_penalized_rewards on the GPU (Triton; no CUDA C++ kernel: an elementwise op
gains nothing from one), and the eager composition, against the float64 formulas: every estimator
and clamp preset, forward and gradient, log-ratios up to 40 (clamps and overflow)."""

import pytest
import torch
from support.gpu import DEVICE, MARKS, close, require
from support.utils import GRAD_TOL, TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.kl import naive as R

pytestmark = MARKS
BACKENDS = ["triton", "eager"]


def _inputs(B, T, dtype):
    """Log-probs and reference log-probs whose differences cycle through 1e-3, 1, 12 and 40."""
    lp = -torch.rand(B, T, device=DEVICE) * 8
    spread = torch.tensor([1e-3, 1.0, 12.0, 40.0], device=DEVICE).repeat(T // 4 + 1)[:T]
    d = torch.randn(B, T, device=DEVICE) * spread
    return lp.to(dtype), (lp - d).to(dtype)


@pytest.mark.parametrize("clamp", ["none", "verl", "openrlhf"])
@pytest.mark.parametrize("est", ["k1", "abs", "k2", "k3", "k3+"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty(backend, dtype, est, clamp):
    require("kl_penalty", backend)
    lp, ref = _inputs(64, 1001, dtype)
    code, straight = R.parse_estimator(est)
    a = lp.double().requires_grad_()
    want = R.kl_penalty(a, ref.double(), code, straight, R.resolve_clamp(clamp, code))
    g = torch.randn_like(want)
    (want_g,) = torch.autograd.grad(want, a, g)
    x = lp.clone().requires_grad_()
    with use_backend(kl_penalty=backend), poisoned():
        v = pk.kl_penalty(x, ref, est, clamp=clamp)
        (got_g,) = torch.autograd.grad(v, x, g.float())
    # beyond float32's range the kernels give inf where float64 is finite: compare the rest
    fin = want.abs() < 3e38
    close(v[fin], want[fin].detach(), **TOL[dtype])
    gfin = want_g.abs() < 1e30
    close(got_g[gfin], want_g[gfin], **GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalized_rewards(backend):
    require("kl_penalized_rewards", backend)
    lp, ref = _inputs(37, 3000, torch.float32)
    mask = torch.rand(37, 3000, device=DEVICE) > 0.3
    mask[3] = False
    scores = torch.randn(37, device=DEVICE)
    beta = torch.rand(37, device=DEVICE)
    code = R.parse_estimator("k3")[0]
    want = R.kl_penalized_rewards(
        scores.double(),
        lp.double(),
        ref.double(),
        mask,
        beta.double(),
        code,
        R.resolve_clamp("verl", code),
    )
    with use_backend(kl_penalized_rewards=backend), poisoned():
        got = pk.kl_penalized_rewards(
            scores, lp, ref, mask, beta=beta, estimator="k3", clamp="verl"
        )
    assert len(got) == len(want) == 3  # rewards, kl, mean kl
    for g, w in zip(got, want):
        close(g, w, **TOL[torch.float32])
