"""Property-based: full_kl on every CPU backend against the float64 reference, forward and the
gradients to both logits, on random shapes, dtypes, strided views, temperatures and row masks
(budget: tests/support/prop.py)."""

import pytest
import torch
from hypothesis import strategies as st
from support.prop import (
    EPS32,
    LOW_PRECISION,
    backend_ctx,
    embed,
    masks,
    pads_for,
    run,
    small,
    values,
)
from support.utils import GRAD_TOL, TOL, cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels.full_kl import naive


@st.composite
def cases(draw, backend):
    lead = draw(st.lists(st.integers(0, small(backend, 4, 2)), min_size=1, max_size=3))
    V = draw(st.integers(1, small(backend, 70, 20)))
    scale = draw(st.sampled_from([1e-2, 1.0, 8.0]))
    x = draw(values(lead + [V], scale=scale, extremes=False))
    y = x + draw(values(lead + [V], scale=draw(st.sampled_from([1e-4, 0.1, 3.0])), extremes=False))
    mask = draw(masks(lead, kinds=("bool", "float"))) if draw(st.booleans()) else None
    return (
        x,
        y,
        mask,
        draw(st.sampled_from(LOW_PRECISION)),
        draw(st.sampled_from([1.0, 0.6, 2.0])),
        pads_for(draw, len(lead) + 1),
        draw(st.booleans()),
        draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("backend", cpu_backends("full_kl"))
def test_full_kl_matches_float64(backend):
    def body(case):
        x, y, mask, dtype, temperature, pads, ref_grad, seed = case
        zl, zr = x.to(dtype), y.to(dtype)
        leaf, view = embed(zl, pads, requires_grad=True)
        rleaf = zr.clone().requires_grad_(ref_grad)
        with poisoned(), backend_ctx("full_kl", backend):
            kl = pk.full_kl(view, rleaf, temperature=temperature, mask=mask)
        a = zl.double().requires_grad_()
        b = zr.double().requires_grad_()
        want, _, _ = naive.forward(a, b, temperature, None if mask is None else mask != 0)
        zmax = (
            max(zl.abs().amax().item(), zr.abs().amax().item()) / temperature if zl.numel() else 0.0
        )
        atol = TOL[dtype]["atol"] + 16 * EPS32 * zmax
        torch.testing.assert_close(kl.double(), want.detach(), atol=atol, rtol=1e-4)
        g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(seed))
        with poisoned(), backend_ctx("full_kl", backend):
            (kl * g).sum().backward()
        (want * g.double()).sum().backward()
        got = leaf.grad[tuple(slice(0, n) for n in x.shape[:-1])]
        gatol = GRAD_TOL[dtype]["atol"] + 32 * EPS32 * zmax / temperature
        torch.testing.assert_close(
            got.double(), a.grad.to(dtype).double(), atol=gatol, rtol=GRAD_TOL[dtype]["rtol"]
        )
        if ref_grad:
            torch.testing.assert_close(
                rleaf.grad.double(),
                b.grad.to(dtype).double(),
                atol=gatol,
                rtol=GRAD_TOL[dtype]["rtol"],
            )

    run(backend, cases(backend), body)
