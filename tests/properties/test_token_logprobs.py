"""Property-based: token_logprobs on every CPU backend against the float64 reference, forward and
backward, on random shapes, dtypes, strided views (leading dims that may not collapse),
temperatures, ignored labels, -inf entries and large magnitudes (budget: tests/support/prop.py)."""

import pytest
import torch
from hypothesis import strategies as st
from support.prop import EPS32, LOW_PRECISION, backend_ctx, embed, pads_for, run, small, values
from support.utils import GRAD_TOL, TOL, cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels.token_logprobs import naive


@st.composite
def cases(draw, backend):
    lead = draw(st.lists(st.integers(0, small(backend, 4, 2)), min_size=0, max_size=3))
    V = draw(st.integers(1, small(backend, 70, 20)))
    x = draw(values(lead + [V]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if x.numel() > 0 and draw(st.booleans()):  # some -inf entries, never the row max
        hole = (torch.rand(x.shape, generator=g) < 0.2) & (x < x.amax(-1, keepdim=True))
        x = x.masked_fill(hole, float("-inf"))
    labels = torch.randint(0, V, lead, generator=g)
    if labels.numel() > 0 and draw(st.booleans()):
        labels = labels.masked_fill(torch.rand(lead, generator=g) < 0.3, -100)
    dtype = draw(st.sampled_from(LOW_PRECISION))
    temperature = draw(st.sampled_from([1.0, 0.7, 0.3, 2.5]))
    return x, labels, dtype, temperature, pads_for(draw, len(lead) + 1), draw(st.booleans()), seed


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
def test_token_logprobs_matches_float64(backend):
    def body(case):
        x, labels, dtype, temperature, pads, with_grad_ent, seed = case
        logits = x.clamp(-6e4, 6e4).to(dtype)
        xr = logits.double()
        finite = xr[xr.isfinite()]
        zmax = (finite.abs().max().item() if finite.numel() else 0.0) / temperature
        atol = TOL[dtype]["atol"] + 8 * EPS32 * zmax  # float32 rounding of z = x / T
        leaf, view = embed(logits, pads, requires_grad=True)
        with poisoned(), backend_ctx("token_logprobs", backend):
            lp, ent = pk.token_logprobs(view, labels, temperature=temperature, return_entropy=True)
        ref = xr.clone().requires_grad_()
        lp_r, ent_r, _ = naive.forward(ref, labels, temperature, -100, True)
        torch.testing.assert_close(lp.double(), lp_r.detach(), atol=atol, rtol=TOL[dtype]["rtol"])
        torch.testing.assert_close(ent.double(), ent_r.detach(), atol=atol, rtol=TOL[dtype]["rtol"])
        g = torch.Generator().manual_seed(seed + 1)
        glp = torch.randn(labels.shape, generator=g)
        gent = torch.randn(labels.shape, generator=g) * with_grad_ent
        with poisoned(), backend_ctx("token_logprobs", backend):
            (lp * glp + ent * gent).sum().backward()
        (
            torch.where(lp_r.isfinite(), lp_r, 0.0) * glp.double()
            + torch.where(ent_r.isfinite(), ent_r, 0.0) * gent.double()
        ).sum().backward()
        got = leaf.grad[tuple(slice(0, n) for n in x.shape[:-1])]
        gatol = GRAD_TOL[dtype]["atol"] + 32 * EPS32 * zmax / temperature
        torch.testing.assert_close(
            got.double(), ref.grad.to(dtype).double(), atol=gatol, rtol=GRAD_TOL[dtype]["rtol"]
        )

    run(backend, cases(backend), body)


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
def test_token_logprobs_overflowing_scaled_logits(backend):
    """Finite logits near float32's limit at temperatures < 1: finite, exact log-probs."""

    @st.composite
    def huge(draw):
        V = draw(st.integers(2, small(backend, 40, 12)))
        x = draw(values([3, V], scale=1.0, extremes=False))
        big = draw(st.sampled_from([1e38, 3e38, -3e38]))
        x = (x.sign() * big * draw(st.sampled_from([1.0, 0.5]))).clamp(-3.4e38, 3.4e38)
        return x, torch.randint(0, V, (3,)), draw(st.sampled_from([0.5, 0.25, 0.9]))

    def body(case):
        x, labels, temperature = case
        logits = x.float()
        with poisoned(), backend_ctx("token_logprobs", backend):
            lp, ent = pk.token_logprobs(
                logits, labels, temperature=temperature, return_entropy=True
            )
        lp_r, ent_r, _ = naive.forward(logits.double(), labels, temperature, -100, True)
        torch.testing.assert_close(lp.double(), lp_r.float().double(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ent.double(), ent_r, rtol=1e-5, atol=1e-4)

    run(backend, huge(), body)
