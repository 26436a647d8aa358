"""Property-based: grpo_advantages / rloo_advantages on every CPU backend against the float64
reference: random group layouts (indices or contiguous sizes, singletons), equal scores, eps
including 0, masks (budget: tests/support/prop.py)."""

import pytest
import torch
from hypothesis import strategies as st
from support.prop import LOW_PRECISION, backend_ctx, masks, run, small
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels.group_advantages import naive


@st.composite
def cases(draw, backend):
    B = draw(st.integers(0, small(backend, 16, 6)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    style = draw(st.sampled_from(["normal", "equal", "binary"]))
    scores = {
        "normal": torch.randn(B, generator=g, dtype=torch.float64) * 3,
        "equal": torch.full((B,), 0.1, dtype=torch.float64),
        "binary": (torch.rand(B, generator=g) > 0.5).double(),
    }[style]
    by_index = draw(st.booleans()) or B == 0
    if by_index:
        gi = torch.randint(0, max(1, B // 2), (B,), generator=g)
        layout = {"group_index": gi}
    else:
        size = draw(st.sampled_from([d for d in range(1, B + 1) if B % d == 0]))
        layout = {"group_size": size}
    mask = draw(masks([B, draw(st.integers(0, 5))])) if draw(st.booleans()) else None
    return (
        scores,
        layout,
        mask,
        draw(st.sampled_from(LOW_PRECISION)),
        draw(st.sampled_from([1e-6, 0.0, 0.1])),
        draw(st.booleans()),
    )


@pytest.mark.parametrize("backend", cpu_backends("group_advantages"))
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_group_advantages_match_float64(backend, kind):
    def body(case):
        scores, layout, mask, dtype, eps, norm = case
        s = scores.to(dtype)
        with poisoned(), backend_ctx("group_advantages", backend):
            if kind == "grpo":
                got = pk.grpo_advantages(s, eps=eps, norm_by_std=norm, mask=mask, **layout)
            else:
                got = pk.rloo_advantages(s, mask=mask, **layout)
        gi = layout.get("group_index")
        gs = layout.get("group_size")
        want = naive.group_advantages(
            s.double(),
            gi,
            gs,
            eps if kind == "grpo" else 0.0,
            norm if kind == "grpo" else False,
            mask,
            kind,
        )
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    run(backend, cases(backend), body)
