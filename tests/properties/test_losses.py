"""Property-based: ppo_policy_loss / ppo_value_loss (every aggregation mode, dual clip, masks,
data-parallel denominators; loss, statistics and gradient) on every CPU backend, and the pairwise
reward-model / DPO losses, against the float64 reference (budget: tests/support/prop.py)."""

import pytest
import torch
from hypothesis import strategies as st
from support.prop import LOW_PRECISION, backend_ctx, masks, run, small, values
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels.losses import naive
from ppo_kernels.losses.naive import AGG_MODES


@st.composite
def cases(draw, backend):
    shape = draw(st.lists(st.integers(0, small(backend, 6, 3)), min_size=1, max_size=3))
    a = draw(values(shape, scale=draw(st.sampled_from([1e-3, 0.3, 3.0])), extremes=False))
    b = a + draw(values(shape, scale=draw(st.sampled_from([1e-4, 0.1, 30.0])), extremes=False))
    c = draw(values(shape, scale=draw(st.sampled_from([1e-2, 1.0, 1e3]))))
    agg = draw(st.sampled_from(AGG_MODES))
    denom = draw(st.sampled_from([None, "float", "tensor"]))
    return (
        shape,
        a,
        b,
        c,
        draw(masks(shape)),
        agg,
        denom,
        draw(st.sampled_from(LOW_PRECISION)),
        draw(st.sampled_from([None, 3.0])),
        draw(st.sampled_from([None, 0.2])),
        draw(st.integers(0, 2**31 - 1)),
    )


def _kw(agg, denom, mask):
    if denom is None:
        return {}, None
    n = float((mask != 0).sum()) + 3.0 if agg == "token-mean" else float(mask.shape[0] + 1)
    name = "global_num_tokens" if agg == "token-mean" else "global_batch_size"
    val = n if denom == "float" else torch.tensor(n)
    return {name: val, "dp_size": 2}, n


@pytest.mark.parametrize("backend", cpu_backends("ppo_policy_loss"))
def test_ppo_policy_loss_matches_float64(backend):
    def body(case):
        shape, lp, old, adv, mask, agg, denom, dtype, dual, _, _ = case
        x = lp.to(dtype).requires_grad_()
        kw, n = _kw(agg, denom, mask)
        with poisoned(), backend_ctx("ppo_policy_loss", backend):
            loss, stats = pk.ppo_policy_loss(
                x, old.to(dtype), adv.to(dtype), mask, agg=agg, dual_clip=dual, **kw
            )
            loss.backward()
        x64 = x.detach().double().requires_grad_()
        T = shape[-1]
        scale = 2.0 if kw else 1.0
        if agg == "seq-mean-token-sum-norm":
            scale /= max(T, 1)
        want, wstats, _ = naive.policy_loss(
            x64,
            old.to(dtype).double(),
            adv.to(dtype).double(),
            mask,
            0.2,
            None,
            dual,
            agg,
            20.0,
            scale,
            None if n is None else torch.tensor(n, dtype=torch.float64),
        )
        want.backward()
        mag = 1.0 + adv.to(dtype).double().abs().max().item() * 2 if adv.numel() else 1.0
        torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5 * mag, rtol=1e-4)
        for k, w in zip(("clip_frac", "clip_frac_lower", "approx_kl", "ratio_mean"), wstats):
            torch.testing.assert_close(stats[k].double(), w.double(), atol=1e-5 * mag, rtol=1e-4)
        rtol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            x.grad.double(), x64.grad.to(dtype).double(), atol=1e-6 * mag, rtol=rtol
        )

    run(backend, cases(backend), body)


@pytest.mark.parametrize("backend", cpu_backends("ppo_value_loss"))
def test_ppo_value_loss_matches_float64(backend):
    def body(case):
        shape, v, old, ret, mask, agg, denom, dtype, _, clip, _ = case
        x = v.to(dtype).requires_grad_()
        kw, n = _kw(agg, denom, mask)
        with poisoned(), backend_ctx("ppo_value_loss", backend):
            loss, stats = pk.ppo_value_loss(
                x, old.to(dtype), ret.to(dtype), mask, agg=agg, clip=clip, **kw
            )
            loss.backward()
        x64 = x.detach().double().requires_grad_()
        scale = 2.0 if kw else 1.0
        if agg == "seq-mean-token-sum-norm":
            scale /= max(shape[-1], 1)
        want, wstats, _ = naive.value_loss(
            x64,
            old.to(dtype).double(),
            ret.to(dtype).double(),
            mask,
            clip,
            agg,
            scale,
            None if n is None else torch.tensor(n, dtype=torch.float64),
        )
        want.backward()
        mag = (
            1.0 + (ret.to(dtype).double().abs().max().item() + 3 * v.abs().max().item()) ** 2
            if v.numel()
            else 1.0
        )
        torch.testing.assert_close(loss.double(), want.detach(), atol=1e-6 * mag, rtol=1e-4)
        torch.testing.assert_close(
            stats["clip_frac"].double(), wstats[0].double(), atol=1e-5, rtol=1e-4
        )
        rtol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            x.grad.double(), x64.grad.to(dtype).double(), atol=1e-6 * mag**0.5, rtol=rtol
        )

    run(backend, cases(backend), body)


def test_pairwise_losses_match_float64():
    @st.composite
    def pairs(draw):
        n = draw(st.integers(0, 9))
        scale = draw(st.sampled_from([1e-3, 1.0, 50.0, 1e4]))
        xs = [draw(values([n], scale=scale)) for _ in range(4)]
        return (
            xs,
            draw(st.sampled_from(LOW_PRECISION)),
            draw(st.sampled_from(["mean", "sum", "none"])),
        )

    def body(case):
        xs, dtype, red = case
        ts = [x.to(dtype).requires_grad_() for x in xs]
        t64 = [t.detach().double().requires_grad_() for t in ts]
        got = pk.reward_model_loss(ts[0], ts[1], reduction=red)
        want = naive.reward_model_loss(t64[0], t64[1], red)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        got = pk.dpo_loss(*ts, beta=0.1, reduction=red)
        want = naive.dpo_loss(*t64, 0.1, red)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        got.sum().backward()
        want.sum().backward()
        for t, w in zip(ts, t64):
            torch.testing.assert_close(
                t.grad.double(),
                w.grad.to(dtype).double(),
                atol=1e-6,
                rtol=1e-4 if dtype == torch.float32 else 2e-2,
            )

    run("cpp", pairs(), body)
