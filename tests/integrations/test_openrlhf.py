"""ppo_kernels.integrations for OpenRLHF 0.11.x: the real OpenRLHF code, patched vs unpatched."""

from __future__ import annotations

import pytest
import torch
from support.integration import batch, compare
from support.peer_stubs import import_peer

import ppo_kernels.integrations as pki


@pytest.fixture(scope="module")
def orl():
    utils = import_peer("openrlhf.models.utils")
    loss = import_peer("openrlhf.models.loss")
    exp = import_peer("openrlhf.trainer.ppo_utils.experience_maker")
    yield utils, loss, exp
    pki.revert("openrlhf")


def _batch(B=5, T=8, seed=0, empty_row=True):
    return batch(B, T, seed, empty_row, mask_dtype=torch.float32)


def test_apply_reaches_copies_and_methods(orl):
    utils, loss, exp = orl
    actor = import_peer("openrlhf.models.actor")
    orig_fwd = loss.PolicyLoss.forward
    with pki.patched("openrlhf") as _:
        assert actor.log_probs_from_logits is utils.log_probs_from_logits
        assert exp.compute_approx_kl is utils.compute_approx_kl
        assert loss.PolicyLoss.forward is not orig_fwd
        rep = pki.report("openrlhf")
        assert len(rep["functions"]) == 10
    assert loss.PolicyLoss.forward is orig_fwd


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("with_old", [False, True])
def test_compute_approx_kl(orl, est, unbiased, with_old):
    utils, _, _ = orl
    mask, lp, old, adv, g = _batch()
    base = lp + torch.randn(lp.shape, generator=g)
    base[1, 2] = lp[1, 2] + 15.0  # k3's clamps
    lp.requires_grad_(True)
    kw = {"log_probs_old": old} if with_old else {}
    compare(
        "openrlhf",
        lambda: utils.compute_approx_kl,
        lp,
        base,
        kl_estimator=est,
        unbiased_gradient=unbiased,
        **kw,
    )


@pytest.mark.parametrize("clip", [None, (-1.0, 1.0)])
def test_compute_reward(orl, clip):
    utils, _, _ = orl
    mask, lp, old, adv, g = _batch()
    kl = torch.randn(mask.shape, generator=g)  # nonzero on masked positions too
    r = torch.randn(mask.shape[0], generator=g) * 2
    compare(
        "openrlhf",
        lambda: utils.compute_reward,
        r,
        0.05,
        kl,
        action_mask=mask,
        reward_clip_range=clip,
    )
    compare("openrlhf", lambda: utils.compute_reward, r, -1.0, kl, action_mask=mask.long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy(orl, dtype, temperature):
    utils, _, _ = orl
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 6, 50, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 50, (3, 6), generator=g)
    compare("openrlhf", lambda: utils.log_probs_from_logits, logits, labels, temperature)
    x = logits.clone().requires_grad_(True)
    compare("openrlhf", lambda: utils.log_probs_from_logits, x, labels)
    compare("openrlhf", lambda: utils.compute_entropy, x)


def test_masked_mean(orl):
    utils, _, _ = orl
    mask, lp, old, adv, g = _batch(empty_row=False)
    x = torch.randn(mask.shape, generator=g, requires_grad=True)
    w = torch.rand(mask.shape, generator=g) * mask
    for m in (mask, w, mask.bool()):
        for dim in (None, -1):
            compare("openrlhf", lambda: utils.masked_mean, x, m, dim=dim)
    # an empty row: NaN like OpenRLHF's 0 / 0; its gradient is 0 here, NaN there (documented)
    mask[-1] = 0
    ref, got, _ = compare("openrlhf", lambda: utils.masked_mean, x, mask, dim=-1, grads=False)
    assert got[-1].isnan() and ref[-1].isnan()


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("glob", [False, True])
def test_policy_loss(orl, token_level, dual_clip, glob):
    _, loss, _ = orl
    mask, lp, old, adv, _ = _batch()
    lp.requires_grad_(True)
    fn = loss.PolicyLoss(
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, token_level_loss=token_level
    )
    kw = dict(dp_size=2, batch_num_tokens=60.0, global_batch_size=9.0) if glob else {}
    compare("openrlhf", lambda: fn, lp, old, adv, mask, **kw)
    ref, got, _ = compare("openrlhf", lambda: fn, lp, old, adv, torch.zeros_like(mask), grads=False)
    assert ref[0].isnan() and got[0].isnan() and got[1].isnan()


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(orl, token_level, clip):
    _, loss, _ = orl
    mask, lp, old, adv, g = _batch()
    v = torch.randn(mask.shape, generator=g, requires_grad=True)
    fn = loss.ValueLoss(clip_eps=clip, token_level_loss=token_level)
    compare("openrlhf", lambda: fn, v, old, adv, mask)
    compare(
        "openrlhf",
        lambda: fn,
        v,
        old,
        adv,
        mask,
        dp_size=4,
        batch_num_tokens=50,
        global_batch_size=7,
    )


def test_gae_and_returns(orl):
    _, _, exp = orl
    mask, lp, old, adv, g = _batch()
    v = torch.randn(mask.shape, generator=g)
    r = torch.randn(mask.shape, generator=g)
    maker = object.__new__(exp.RemoteExperienceMaker)  # the methods use no state
    compare("openrlhf", lambda: maker.get_advantages_and_returns, v, r, mask, 0.99, 0.95)
    compare("openrlhf", lambda: maker.get_advantages_and_returns, v, r, None, 1.0, 1.0)
    compare("openrlhf", lambda: maker.get_cumulative_returns, r, mask, 0.97)
    compare("openrlhf", lambda: maker.get_cumulative_returns, r, None, 1.0)


def _rollout(old, seed=5, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    roll = old + spread * torch.randn(old.shape, generator=g)
    roll[1, 2] -= 3.0  # a token far off the band
    return roll


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("glob", [False, True])
@pytest.mark.parametrize("level", ["off", "token"])
def test_gspo(orl, dual_clip, glob, level):
    """policy_loss_type="gspo": the clipped loss on the row's mean log-ratio (gradient through the
    mean), against the rollout log-probs with is_correction_level set, per-sample aggregation."""
    _, loss, _ = orl
    mask, lp, old, adv, _ = _batch()
    old[0, 1] = lp[0, 1] - 2.0  # OpenRLHF's gspo has no log-ratio clamp: keep it finite
    lp.requires_grad_(True)
    fn = loss.PolicyLoss(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=dual_clip,
        policy_loss_type="gspo",
        is_correction_level=level,
    )
    kw = dict(dp_size=2, batch_num_tokens=60.0, global_batch_size=9.0) if glob else {}
    roll = _rollout(old, spread=0.2)
    compare("openrlhf", lambda: fn, lp, old, adv, mask, rollout_log_probs=roll, **kw)
    ref, got, _ = compare(
        "openrlhf", lambda: fn, lp, old, adv, torch.zeros_like(mask), roll, grads=False
    )
    assert ref[0].isnan() and got[0].isnan()


@pytest.mark.parametrize("level", ["token", "seq"])
@pytest.mark.parametrize("threshold", [(0.5, 5.0), (0.8, 1.25)])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("token_level", [True, False])
def test_is_correction(orl, level, threshold, dual_clip, token_level):
    """is_correction_level with the "mask" mode and "ratio" gating: OpenRLHF's per-token IS
    weights (0 outside the band, per token or per row) on rollout_correction, its vllm_kl and
    filter ratio."""
    _, loss, _ = orl
    mask, lp, old, adv, _ = _batch(seed=3)
    lp.requires_grad_(True)
    fn = loss.PolicyLoss(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=dual_clip,
        token_level_loss=token_level,
        is_correction_level=level,
        is_correction_threshold=threshold,
    )
    roll = _rollout(old)
    ref, got, _ = compare("openrlhf", lambda: fn, lp, old, adv, mask, rollout_log_probs=roll)
    assert 0 < ref[4].item() < 1  # some tokens / rows filtered, not all
    ref, got, _ = compare(
        "openrlhf", lambda: fn, lp, old, adv, torch.zeros_like(mask), roll, grads=False
    )
    assert ref[0].isnan() and got[0].isnan()


def test_unsupported_is_correction(orl):
    _, loss, _ = orl
    mask, lp, old, adv, _ = _batch()
    roll = _rollout(old)
    kinds = [
        ("is_correction_mode", dict(is_correction_mode="clip")),
        ("is_correction_gating", dict(is_correction_gating="tv", is_correction_threshold=(0, 0.2))),
        ("is_correction_threshold", dict(is_correction_threshold=(1e-12, 5.0))),
    ]
    for arg, kw in kinds:
        fn = loss.PolicyLoss(is_correction_level="token", **kw)
        with pki.patched("openrlhf"), pytest.raises(pki.Unsupported, match=arg):
            fn(lp, old, adv, mask, rollout_log_probs=roll)
        ref = fn(lp, old, adv, mask, rollout_log_probs=roll)
        with pki.patched("openrlhf", strict=False):
            got = fn(lp, old, adv, mask, rollout_log_probs=roll)
            s = pki.report("openrlhf")["functions"]["openrlhf.models.loss.PolicyLoss.forward"]
            assert s["fallbacks"] == 1 and arg in next(iter(s["fallback_reasons"]))
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b)


def test_experience_math_pipeline(orl):
    """OpenRLHF's experience-maker math: approx KL -> shaped rewards -> GAE -> losses."""
    utils, loss, exp = orl
    mask, lp, old, adv, g = _batch(B=6, T=7, empty_row=False)
    base = lp + 0.3 * torch.randn(lp.shape, generator=g)
    values = torch.randn(lp.shape, generator=g)
    scores = torch.randn(6, generator=g)
    vnew = torch.randn(lp.shape, generator=g, requires_grad=True)
    maker = object.__new__(exp.RemoteExperienceMaker)
    pl, vl = loss.PolicyLoss(), loss.ValueLoss(clip_eps=0.2)

    def pipeline(lp, vnew):
        kl = exp.compute_approx_kl(old, base, kl_estimator="k3")
        kl_mean = exp.masked_mean(kl, mask, dim=-1)
        reward = exp.compute_reward(scores, 0.02, kl, action_mask=mask)
        a, ret = maker.get_advantages_and_returns(values, reward, mask, 1.0, 0.95)
        p = pl(lp, old, a, mask)
        return p[0] + vl(vnew, values, ret, mask), p[1], p[2], kl_mean

    compare("openrlhf", lambda: pipeline, lp.requires_grad_(True), vnew)
