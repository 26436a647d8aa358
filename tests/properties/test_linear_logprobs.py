"""Property-based: linear_token_logprobs on every CPU backend against float64 log-probs of the
materialised logits (hidden @ W^T + b), forward and the gradients to hidden, weight and bias, on
random shapes (H = 0 and empty batches included), dtypes, chunk budgets small enough to chunk the
vocabulary, temperatures and ignored labels (budget: tests/support/prop.py)."""

import pytest
import torch
from hypothesis import strategies as st
from support.prop import EPS32, backend_ctx, run, small, values
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels.token_logprobs import naive as tlp_reference


@st.composite
def cases(draw, backend):
    lead = draw(st.lists(st.integers(0, small(backend, 5, 3)), min_size=1, max_size=2))
    H = draw(st.integers(0, small(backend, 12, 4)))
    V = draw(st.integers(1, small(backend, 40, 12)))
    h = draw(values(lead + [H], scale=1.0, extremes=False))
    w = draw(values([V, H], scale=draw(st.sampled_from([0.1, 1.0, 3.0])), extremes=False))
    b = draw(values([V], scale=1.0, extremes=False)) if draw(st.booleans()) else None
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, lead, generator=g)
    if labels.numel() and draw(st.booleans()):
        labels = labels.masked_fill(torch.rand(lead, generator=g) < 0.3, -100)
    return (
        h,
        w,
        b,
        labels,
        draw(st.sampled_from([torch.float32, torch.bfloat16])),
        draw(st.sampled_from([1.0, 0.7])),
        draw(st.sampled_from([None, 256, 4096])),
        seed,
    )


@pytest.mark.parametrize("backend", cpu_backends("linear_token_logprobs"))
def test_linear_token_logprobs_matches_float64(backend):
    def body(case):
        h, w, b, labels, dtype, temperature, budget, seed = case
        hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        bb = b.to(dtype).requires_grad_() if b is not None else None
        with poisoned(), backend_ctx("linear_token_logprobs", backend):
            lp, ent = pk.linear_token_logprobs(
                hh,
                ww,
                labels,
                bias=bb,
                temperature=temperature,
                return_entropy=True,
                max_chunk_bytes=budget,
            )
        h64, w64 = hh.detach().double().requires_grad_(), ww.detach().double().requires_grad_()
        b64 = bb.detach().double().requires_grad_() if bb is not None else None
        z = h64 @ w64.T + (b64 if b64 is not None else 0.0)
        lp_r, ent_r, _ = tlp_reference.forward(z, labels, temperature, -100, True)
        zmax = (z.detach().abs().max().item() if z.numel() else 0.0) / temperature
        atol = 2e-5 + 16 * EPS32 * zmax * max(h.shape[-1], 1)
        torch.testing.assert_close(lp.double(), lp_r.detach(), atol=atol, rtol=1e-4)
        torch.testing.assert_close(ent.double(), ent_r.detach(), atol=atol, rtol=1e-4)
        g = torch.Generator().manual_seed(seed)
        glp, gent = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
        with poisoned(), backend_ctx("linear_token_logprobs", backend):
            (lp * glp + ent * gent).sum().backward()
        (lp_r * glp.double() + ent_r * gent.double()).sum().backward()
        rtol = 1e-4 if dtype == torch.float32 else 2e-2
        gatol = 1e-4 + 64 * EPS32 * zmax * max(labels.numel(), 1)
        torch.testing.assert_close(
            hh.grad.double(), h64.grad.to(dtype).double(), atol=gatol, rtol=rtol
        )
        torch.testing.assert_close(
            ww.grad.double(), w64.grad.to(dtype).double(), atol=gatol, rtol=rtol
        )
        if bb is not None:
            torch.testing.assert_close(
                bb.grad.double(), b64.grad.to(dtype).double(), atol=gatol, rtol=rtol
            )

    run(backend, cases(backend), body)
