"""Property-based: masked_whiten and masked_mean against float64 on random shapes, dtypes, masks
and magnitudes from 1e-30 to 3e38 (any finite input gives a finite, correct result)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.prop import LOW_PRECISION, masks

import ppo_kernels as pk


@st.composite
def cases(draw):
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from(LOW_PRECISION))
    top = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e19, 1e30, top]))
    offset = draw(st.sampled_from([0.0, 1.0, -0.5]))
    x = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1 + offset) * scale
    x = x.clamp(-top, top).to(dtype)
    return x, draw(masks(shape)), draw(st.booleans()), draw(st.booleans())


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(cases())
def test_masked_whiten_and_mean_match_float64(case):
    x, mask, unbiased, shift_mean = case
    xd = x.double()
    m = mask != 0
    w = mask.double() if mask.is_floating_point() else m.double()  # a float mask weights
    W = float(w[m].sum())
    out = pk.masked_whiten(x, mask, unbiased=unbiased, shift_mean=shift_mean)
    mean = (xd[m] * w[m]).sum() / W if W else torch.tensor(0.0, dtype=torch.float64)
    if W and not (unbiased and W == 1.0):
        var = (w[m] * (xd[m] - mean) ** 2).sum() / W * (W / (W - 1) if unbiased else 1.0)
        want = (xd - mean) * torch.rsqrt(var + 1e-8)
        if not shift_mean:
            want = want + mean
        # inputs outside the mask may lie far from it: compare where the result is representable
        ok = want.abs() < 1e37
        assert torch.isfinite(out[ok]).all()
        scale = 1.0 if shift_mean else 1.0 + mean.abs().item()
        torch.testing.assert_close(out.double()[ok], want[ok], atol=2e-5 * scale, rtol=2e-5)
    elif unbiased:
        assert torch.isnan(out).all()  # total weight 0 or 1: documented NaN
    mm = pk.masked_mean(x, mask)
    if W and xd[m].abs().max() < 1e37:
        torch.testing.assert_close(
            mm.double(), mean, atol=1e-6 * xd[m].abs().max().item(), rtol=1e-5
        )
