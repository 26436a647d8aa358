"""Property-based: gae on every CPU backend against the float64 step-by-step oracle
(naive.gae_sequential) on random shapes (empty ones included), dtypes, masks, dones, float or
per-token gamma / lam, bootstrap values, carries and packed rows (budget: tests/support/prop.py)."""

import pytest
import torch
from hypothesis import strategies as st
from support.prop import LOW_PRECISION, backend_ctx, masks, run, small, values
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels.gae import naive


@st.composite
def cases(draw, backend):
    packed = draw(st.booleans())
    if packed:
        lens = draw(st.lists(st.integers(0, small(backend, 12, 5)), min_size=1, max_size=4))
        shape, cu = [sum(lens)], torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        n_rows = len(lens)
    else:
        shape = [
            draw(st.integers(0, small(backend, 4, 2))),
            draw(st.integers(0, small(backend, 20, 6))),
        ]
        cu, n_rows = None, shape[0]
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    r = draw(values(shape, scale=draw(st.sampled_from([1e-3, 1.0, 100.0])), extremes=False))
    v = draw(values(shape, scale=1.0, extremes=False))
    mask = draw(masks(shape)) if draw(st.booleans()) else None
    dones = (torch.rand(shape, generator=g) < 0.15) if draw(st.booleans()) else None

    def coef(name):
        kind = draw(st.sampled_from(["float", "float", "tensor", "broadcast"]))
        if kind == "float":
            return draw(st.sampled_from([1.0, 0.99, 0.9, 0.0]))
        if kind == "broadcast" and not packed:
            return torch.rand(shape[0], 1, generator=g) * 0.5 + 0.5
        return torch.rand(shape, generator=g) * 0.5 + 0.5

    gamma, lam = coef("gamma"), coef("lam")
    edge = draw(st.sampled_from(["none", "bootstrap", "carry"]))
    boot = torch.randn(n_rows, generator=g) if edge == "bootstrap" else None
    carry = (
        (torch.randn(n_rows, generator=g), torch.randn(n_rows, generator=g))
        if edge == "carry"
        else None
    )
    return r, v, mask, dones, gamma, lam, boot, carry, cu, draw(st.sampled_from(LOW_PRECISION))


@pytest.mark.parametrize("backend", cpu_backends("gae"))
def test_gae_matches_float64_oracle(backend):
    def body(case):
        r, v, mask, dones, gamma, lam, boot, carry, cu, dtype = case
        rr, vv = r.to(dtype), v.to(dtype)
        with poisoned(), backend_ctx("gae", backend):
            adv, ret, (cv, ca) = pk.gae(
                rr,
                vv,
                mask,
                gamma=gamma,
                lam=lam,
                dones=dones,
                bootstrap_value=boot,
                carry=carry,
                cu_seqlens=cu,
                return_carry=True,
            )
        wa, wr, (wcv, wca) = naive.gae_sequential(
            rr.double(),
            vv.double(),
            mask,
            gamma=gamma,
            lam=lam,
            dones=dones,
            bootstrap_value=boot,
            cu_seqlens=cu,
            carry=carry,
        )
        # float32 accumulation along the row: relative to the largest term
        mag = 1.0 + max(rr.abs().max().item() if rr.numel() else 0.0, 1.0) * (rr.shape[-1] + 1)
        tol = {"atol": 2e-6 * mag, "rtol": 1e-4}
        torch.testing.assert_close(adv.double(), torch.as_tensor(wa).reshape(adv.shape), **tol)
        torch.testing.assert_close(ret.double(), torch.as_tensor(wr).reshape(ret.shape), **tol)
        torch.testing.assert_close(cv.double(), torch.as_tensor(wcv, dtype=torch.float64), **tol)
        torch.testing.assert_close(ca.double(), torch.as_tensor(wca, dtype=torch.float64), **tol)

    run(backend, cases(backend), body)
