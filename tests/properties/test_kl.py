"""Property-based: kl_penalty (values and gradients, every estimator and clamp preset) and
kl_penalized_rewards (bool / int / float masks, float or per-row beta) on every CPU backend
against the float64 reference (budget: tests/support/prop.py)."""

import pytest
import torch
from hypothesis import strategies as st
from support.prop import LOW_PRECISION, backend_ctx, masks, run, small, values
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels.kl import naive
from ppo_kernels.kl.naive import parse_estimator, resolve_clamp

ESTIMATORS = ["k1", "abs", "k2", "k3", "k1+", "k3+", "low_var_kl", "mse"]


@st.composite
def pairs(draw, backend, dim=None):
    shape = draw(
        st.lists(st.integers(0, small(backend, 9, 4)), min_size=dim or 1, max_size=dim or 3)
    )
    lp = draw(values(shape, scale=draw(st.sampled_from([0.1, 1.0, 10.0])), extremes=False))
    d = draw(values(shape, scale=draw(st.sampled_from([1e-5, 1e-2, 1.0, 30.0]))))
    return shape, lp, (lp - d).clamp(-1e3, 1e3), draw(st.sampled_from(LOW_PRECISION))


def _ref64(lp, ref, est, clamp):
    name, st_ = parse_estimator(est)
    return naive.kl_penalty(lp, ref, name, st_, resolve_clamp(clamp, name))


@pytest.mark.parametrize("backend", cpu_backends("kl_penalty"))
def test_kl_penalty_matches_float64(backend):
    @st.composite
    def cases(draw):
        return (
            draw(pairs(backend)),
            draw(st.sampled_from(ESTIMATORS)),
            draw(st.sampled_from(["none", "verl", "openrlhf"])),
            draw(st.integers(0, 2**31 - 1)),
        )

    def body(case):
        (shape, lp, ref, dtype), est, clamp, seed = case
        a, b = lp.to(dtype).requires_grad_(), ref.to(dtype).requires_grad_()
        with poisoned(), backend_ctx("kl_penalty", backend):
            v = pk.kl_penalty(a, b, est, clamp=clamp)
        a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
        want = _ref64(a64, b64, est, clamp)
        # float32 evaluation of d = lp - ref and of exp(-d): relative error ~ 1e-6 of the terms
        tol = {
            "atol": 1e-5 + 1e-6 * (a64.detach() - b64.detach()).abs().max().item()
            if a64.numel()
            else 1e-5,
            "rtol": 1e-4,
        }
        # k3 overflows float32 at d < -88 without a value clamp: documented +inf
        finite = want.detach().abs() < 3e38
        torch.testing.assert_close(v.double()[finite], want.detach()[finite], **tol)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        with poisoned(), backend_ctx("kl_penalty", backend):
            (v * g).sum().backward()
        (want * g.double()).sum().backward()
        ok = finite & a64.grad.isfinite()
        gtol = {"atol": tol["atol"] * 4, "rtol": 2e-2 if dtype != torch.float32 else 1e-4}
        torch.testing.assert_close(a.grad.double()[ok], a64.grad.to(dtype).double()[ok], **gtol)
        torch.testing.assert_close(b.grad.double()[ok], b64.grad.to(dtype).double()[ok], **gtol)

    run(backend, cases(), body)


@pytest.mark.parametrize("backend", cpu_backends("kl_penalized_rewards"))
def test_kl_penalized_rewards_matches_float64(backend):
    @st.composite
    def cases(draw):
        shape, lp, ref, dtype = draw(pairs(backend, dim=2))
        mask = draw(masks(shape))
        beta = draw(st.sampled_from(["float", "scalar", "row"]))
        return (
            shape,
            lp,
            ref,
            dtype,
            mask,
            beta,
            draw(st.sampled_from(ESTIMATORS[:4])),
            draw(st.sampled_from(["none", "verl", "openrlhf"])),
            draw(st.integers(0, 2**31 - 1)),
        )

    def body(case):
        shape, lp, ref, dtype, mask, beta_kind, est, clamp, seed = case
        g = torch.Generator().manual_seed(seed)
        B = shape[0]
        scores = torch.randn(B, generator=g)
        beta = {"float": 0.05, "scalar": torch.tensor(0.1), "row": torch.rand(B, generator=g)}[
            beta_kind
        ]
        a, b = lp.to(dtype), ref.to(dtype)
        with poisoned(), backend_ctx("kl_penalized_rewards", backend):
            r, k, m = pk.kl_penalized_rewards(
                scores, a, b, mask, beta=beta, estimator=est, clamp=clamp
            )
        name, _ = parse_estimator(est)
        b64 = beta if isinstance(beta, float) else beta.double()
        wr, wk, wm = naive.kl_penalized_rewards(
            scores.double(), a.double(), b.double(), mask, b64, name, resolve_clamp(clamp, name)
        )
        fin = wk.abs() < 3e38
        tol = {
            "atol": 1e-5 + 1e-6 * wk[fin].abs().max().item() if fin.any() else 1e-5,
            "rtol": 1e-4,
        }
        torch.testing.assert_close(k.double()[fin], wk[fin], **tol)
        torch.testing.assert_close(r.double()[fin], wr[fin], **tol)
        rows = fin.all(-1)
        torch.testing.assert_close(m.double()[rows], wm[rows], **tol)

    run(backend, cases(), body)
