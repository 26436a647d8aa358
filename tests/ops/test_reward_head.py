"""reward_model_head_loss: TRL's RewardTrainer loss (margin, reward centring) from a scalar head's
hidden states, against the float64 formula with autograd, gradcheck, reductions, bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from ppo_kernels.losses.pairwise import reward_model_head_loss


def _inputs(B=6, H=10, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hc = torch.randn(B, H, generator=g, dtype=dtype, requires_grad=True)
    hr = torch.randn(B, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(1, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(1, generator=g, dtype=dtype, requires_grad=True)
    m = torch.rand(B, generator=g, dtype=dtype)
    return hc, hr, w, b, m


def _trl(hc, hr, w, b, m, center):
    """TRL RewardTrainer.compute_loss on the head's rewards."""
    rc, rr = ((h.double() @ w.double().T + b.double()).squeeze(-1) for h in (hc, hr))
    loss = -F.logsigmoid(rc - rr - m.double()).mean()
    if center is not None:
        loss = loss + center * torch.mean((rc + rr) ** 2)
    return loss, rc, rr


@pytest.mark.parametrize("center", [None, 0.01])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_trl_reward_trainer_loss(center, dtype):
    hc, hr, w, b, m = _inputs(dtype=dtype)
    loss, rc, rr = reward_model_head_loss(hc, hr, w, b, margin=m, center_rewards_coefficient=center)
    ref, rc64, rr64 = _trl(hc, hr, w, b, m, center)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.double(), ref, **tol)
    torch.testing.assert_close(rc.double(), rc64.detach(), **tol)
    assert not rc.requires_grad and not rr.requires_grad
    g = torch.autograd.grad(loss, (hc, hr, w, b))
    g_ref = torch.autograd.grad(ref, (hc, hr, w, b))
    for a, r in zip(g, g_ref):
        torch.testing.assert_close(a.double(), r.double(), **tol)


def test_gradcheck_and_reductions():
    hc, hr, w, b, m = _inputs(B=4, H=5)
    assert torch.autograd.gradcheck(
        lambda *x: reward_model_head_loss(*x, margin=0.3, center_rewards_coefficient=0.1)[0],
        (hc, hr, w, b),
    )
    per, _, _ = reward_model_head_loss(hc, hr, w.reshape(-1), reduction="none")
    total, _, _ = reward_model_head_loss(hc, hr, w, reduction="sum")
    mean, _, _ = reward_model_head_loss(hc, hr, w)
    assert per.shape == (4,)
    torch.testing.assert_close(per.sum(), total)
    torch.testing.assert_close(per.mean(), mean)
    empty = torch.zeros(0, 5, dtype=torch.float64)
    assert reward_model_head_loss(empty, empty, w)[0].item() == 0


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(rejected_hidden=torch.randn(3, 5)), ValueError, "rejected_hidden"),
        (dict(weight=torch.randn(2, 4)), ValueError, "weight: expected shape"),
        (dict(weight=torch.randint(0, 2, (1, 4))), TypeError, "weight"),
        (dict(bias=torch.randn(2)), ValueError, "bias: expected one value"),
        (dict(margin=torch.randn(3)), ValueError, "margin"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(center_rewards_coefficient="x"), TypeError, "center_rewards_coefficient"),
        (dict(chosen_hidden=torch.randn(4)), ValueError, "chosen_hidden"),
    ],
)
def test_bad_inputs_name_the_argument(kw, err, match):
    a = dict(chosen_hidden=torch.randn(4, 4), rejected_hidden=torch.randn(4, 4),
             weight=torch.randn(1, 4), bias=None)  # fmt: skip
    opts = {
        k: kw.pop(k) for k in list(kw) if k in ("margin", "reduction", "center_rewards_coefficient")
    }
    a.update(kw)
    with pytest.raises(err, match=match):
        reward_model_head_loss(*a.values(), **opts)
