"""ppo_kernels.integrations for verl 0.9.x: every POLICY_LOSS_REGISTRY entry and the rollout
correction helpers, patched vs unpatched, reached as verl's trainer reaches them
(`get_policy_loss_fn(name)`, the helper module's functions), gradients and metrics included."""

from __future__ import annotations

import math

import pytest
import torch
from support.integration import ATOL, RTOL, actor_config, batch, compare, verl_loss_modules

import ppo_kernels.integrations as pki

AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"]
AGGS += ["seq-mean-token-sum-norm"]
NAMES = [
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
]
# options that make each loss bite here (clip_cov: every candidate drawn, so verl's draw and ours
# drop the same tokens; test_clip_cov_random_draw covers the random case)
POLICY = {
    "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=0.02, clip_cov_ub=8.0),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5),
    "dro": dict(dro_beta=0.3),
}


@pytest.fixture(scope="module")
def verl():
    with verl_loss_modules() as v:
        yield v
    pki.revert("verl")


def _config(verl, mode, info=None, rc=None, **policy):
    return actor_config(verl, mode, info, rc, **policy)


def _inputs(case, seed=0):
    """(old, lp (a leaf), adv, mask): random with a row of no action and one log-ratio of -30
    ('random'); log-ratios of +-3..8 with large advantages, every ratio outside the clip range
    ('all_clipped'); log-ratios up to +-40, beyond verl's +-20 clamp ('extreme')."""
    mask, lp, old, adv, g = batch(6, 9, seed)
    if case == "all_clipped":
        sign = torch.where(torch.rand(lp.shape, generator=g) > 0.5, 1.0, -1.0)
        old = lp - sign * (3 + 5 * torch.rand(lp.shape, generator=g))
        adv = 3 * sign * adv.abs()
    elif case == "extreme":
        old = lp + 40 * (torch.rand(lp.shape, generator=g) - 0.5) * 2
    return old, lp.requires_grad_(True), adv, mask


def _loss_fn(verl, name):
    return lambda: verl.core.get_policy_loss_fn(name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("agg", AGGS)
def test_registry_losses(verl, name, agg):
    old, lp, adv, mask = _inputs("random")
    cfg = _config(verl, name, **POLICY.get(name, {}))
    compare("verl", _loss_fn(verl, name), old, lp, adv, mask, agg, cfg)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)) * 2  # rollout IS weights
    compare("verl", _loss_fn(verl, name), old, lp, adv, mask, agg, cfg, w)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", ["all_clipped", "extreme"])
@pytest.mark.parametrize("glob", [False, True])
def test_registry_losses_edges(verl, name, case, glob):
    old, lp, adv, mask = _inputs(case, seed=1)
    info = None
    if glob:  # data-parallel totals, as verl's trainer passes them
        info = dict(dp_size=2, batch_num_tokens=2 * int(mask.sum()) + 3, global_batch_size=13)
    cfg = _config(verl, name, info, **POLICY.get(name, {}))
    agg = "seq-mean-token-mean" if name in ("gspo", "sapo") else "token-mean"
    ref, _, _ = compare("verl", _loss_fn(verl, name), old, lp, adv, mask, agg, cfg)
    assert torch.isfinite(ref[0])


@pytest.mark.parametrize("name", NAMES)
def test_registry_losses_empty_mask(verl, name):
    """No valid token: the same loss (NaN for verl's means of nothing, 0 for geo_mean) and
    metrics; verl's gradient there is 0/0 = NaN where ours is 0 (README), so outputs only."""
    old, lp, adv, mask = _inputs("random")
    cfg = _config(verl, name, **POLICY.get(name, {}))
    ref, got, _ = compare(
        "verl",
        _loss_fn(verl, name),
        old,
        lp,
        adv,
        torch.zeros_like(mask),
        "token-mean",
        cfg,
        grads=False,
    )
    assert ref[0].isnan() == (name != "geo_mean")


def test_float_mask_and_float64(verl):
    old, lp, adv, mask = _inputs("random")
    fmask = mask * (0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)))
    for name in ("vanilla", "gspo", "kl_cov", "cispo"):
        cfg = _config(verl, name, **POLICY.get(name, {}))
        compare("verl", _loss_fn(verl, name), old, lp, adv, fmask, "token-mean", cfg)
        x = lp.detach().double().requires_grad_(True)
        compare(
            "verl", _loss_fn(verl, name), old.double(), x, adv.double(), mask, "token-mean", cfg
        )


def test_clip_cov_random_draw(verl):
    """More candidates than clip_num (1 here): verl draws by a permutation from torch's global
    generator, ours by uniform keys (README), so one seed gives different tokens; over seeds both
    drop each candidate, and only candidates: the same set of possible losses, the same metrics."""
    old, lp, adv, mask = _inputs("random", seed=4)
    old[0, 1] = lp[0, 1].detach() - 0.1  # no e^30 ratio: each candidate's term shows in the sum
    lb, ub = 0.3, 0.9
    cfg = _config(verl, "clip_cov", clip_cov_ratio=1e-6, clip_cov_lb=lb, clip_cov_ub=ub)
    # verl's candidates: covariance in (lb, ub), not clipped by the ratio, in the mask
    m, r = mask.float(), torch.exp(lp.detach() - old)
    cov = (adv - (adv * m).sum() / m.sum()) * (lp.detach() - (lp.detach() * m).sum() / m.sum())
    clipped = -adv * r.clamp(0.85, 1.28) > -adv * r
    n_cand = int(((cov > lb) & (cov < ub) & (m > 0) & ~clipped).sum())
    assert 2 <= n_cand <= 6, n_cand
    fn = verl.core.get_policy_loss_fn
    seen = {False: set(), True: set()}
    for patched in (False, True):
        with pki.patched("verl") if patched else _nothing():
            for s in range(40):
                torch.manual_seed(s)
                loss, met = fn("clip_cov")(old, lp, adv, mask, "token-sum", cfg)
                assert met["actor/pg_clipfrac"] == pytest.approx(1 / float(m.sum()), rel=1e-5)
                seen[patched].add(round(loss.item(), 4))
    assert len(seen[False]) == n_cand
    assert seen[True] == seen[False]


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize(
    "rc",
    [
        dict(rollout_is="token", rollout_is_threshold=2.0),
        dict(
            rollout_is="sequence", rollout_is_threshold="0.2_5.0", rollout_is_batch_normalize=True
        ),
        dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2.0,0.05"),
        dict(rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold=0.3),
    ],
)
@pytest.mark.parametrize("case", ["random", "all_clipped", "extreme"])
def test_bypass_mode(verl, loss_type, rc, case):
    old, lp, adv, mask = _inputs(case, seed=2)
    cfg = _config(
        verl,
        "bypass_mode",
        rc={"bypass_mode": True, "loss_type": loss_type, "rollout_is": None, **rc},
    )
    if case == "extreme" and rc.get("rollout_is_threshold") == "0.2_5.0":
        # every sequence weight outside the IcePop band: verl's effective sample size divides by
        # zero in Python; ours is inf (losses/rollout.py)
        fn = verl.core.get_policy_loss_fn("bypass_mode")
        with pytest.raises(ZeroDivisionError):
            fn(old, lp, adv, mask, "token-mean", cfg)
        with pki.patched("verl"):
            _, met = fn(old, lp, adv, mask, "token-mean", cfg)
        assert met["rollout_corr/rollout_is_eff_sample_size"] == math.inf
        return
    compare("verl", _loss_fn(verl, "bypass_mode"), old, lp, adv, mask, "token-mean", cfg)


@pytest.mark.parametrize("agg", AGGS)
def test_reinforce(verl, agg):
    """compute_policy_loss_reinforce (bypass mode's REINFORCE, called directly)."""
    old, lp, adv, mask = _inputs("random", seed=5)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)) * 2
    fn = lambda: verl.core.compute_policy_loss_reinforce  # noqa: E731
    compare("verl", fn, old, lp, adv, mask, agg, _config(verl, "vanilla"), w)
    compare("verl", fn, old, lp, adv, mask, agg, _config(verl, "vanilla"))


def test_bypass_mode_empty_mask_raises_like_verl(verl):
    old, lp, adv, mask = _inputs("random")
    cfg = _config(verl, "bypass_mode", rc={"bypass_mode": True, "rollout_is": "token"})
    fn = verl.core.get_policy_loss_fn("bypass_mode")
    with pytest.raises(ValueError, match="at least one valid token"):
        fn(old, lp, adv, torch.zeros_like(mask), "token-mean", cfg)
    with pki.patched("verl"), pytest.raises(ValueError, match="at least one valid token"):
        fn(old, lp, adv, torch.zeros_like(mask), "token-mean", cfg)


def test_strict_and_fallback(verl, monkeypatch):
    old, lp, adv, mask = _inputs("random")
    fn = verl.core.get_policy_loss_fn
    bad = _config(verl, "kl_cov", kl_cov_ratio=1.5)  # more tokens than there are: ours refuses
    with pki.patched("verl"):
        with pytest.raises(pki.Unsupported, match="kl_cov_ratio"):
            fn("kl_cov")(old, lp, adv, mask, "token-mean", bad)
        with pytest.raises(pki.Unsupported, match="dro_beta"):  # verl raises too
            fn("dro")(old, lp, adv, mask, "token-mean", _config(verl, "dro"))
        rc = {"bypass_mode": True, "rollout_is": "token", "rollout_is_batch_normalize": True}
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        with pytest.raises(pki.Unsupported, match="rollout_is_batch_normalize"):
            fn("bypass_mode")(old, lp, adv, mask, "token-mean", _config(verl, "bypass_mode", rc=rc))
        monkeypatch.undo()
    with pki.patched("verl", strict=False):
        with pytest.raises(ValueError, match="dro_beta must be a positive"):  # verl's own error
            fn("dro")(old, lp, adv, mask, "token-mean", _config(verl, "dro"))
        s = pki.report("verl")["functions"]["verl.trainer.ppo.core_algos.compute_policy_loss_dro"]
        assert s["fallbacks"] == 1 and "dro_beta" in next(iter(s["fallback_reasons"]))


# --------------------------------------------------------------------------- rollout_corr_helper
RC_CASES = [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_1.5"),
    dict(rollout_is="sequence", rollout_is_threshold="0.1_4.0", rollout_is_batch_normalize=True),
    dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k2,token_k3", rollout_rs_threshold="0.1,0.2"),
    dict(rollout_rs="seq_sum_k1,seq_mean_k2,seq_max_k3", rollout_rs_threshold="0.3_2.5,0.5,0.6"),
    dict(
        rollout_is="sequence",
        rollout_is_threshold=3.0,
        rollout_rs="token_k1",
        rollout_rs_threshold=1.5,
    ),
    {},
]


def _rc_data(seed=21, float_mask=False, extreme=False):
    old, lp, _, mask = _inputs("random", seed)
    roll = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed))
    roll[3, 2] -= 4.0  # an outlier token
    if extreme:  # log-ratios past verl's +-20 safety bound, for a token and a whole row
        roll[0, 0] += 30.0
        roll[2] -= 25.0
    if float_mask:
        mask = mask * (0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(9)))
    return old, roll, mask


def _same_metrics(ref, got):
    assert ref.keys() == got.keys(), sorted(set(ref) ^ set(got))
    for k, v in ref.items():
        assert isinstance(got[k], float), k
        assert math.isclose(got[k], v, rel_tol=RTOL, abs_tol=ATOL), (k, v, got[k])


def _replaced(name):
    s = pki.report("verl")["functions"][f"verl.trainer.ppo.rollout_corr_helper.{name}"]
    assert s["replaced"] >= 1 and s["fallbacks"] == 0, s


@pytest.mark.parametrize("case", RC_CASES, ids=lambda c: ",".join(map(str, c.values())) or "none")
@pytest.mark.parametrize("float_mask,extreme", [(False, False), (True, False), (False, True)])
def test_correction_and_rejection_mask(verl, case, float_mask, extreme):
    old, roll, mask = _rc_data(float_mask=float_mask, extreme=extreme)
    f = verl.rch.compute_rollout_correction_and_rejection_mask
    ref_w, ref_m, ref_met = f(old, roll, mask, **case)
    with pki.patched("verl"):
        w, m, met = verl.rch.compute_rollout_correction_and_rejection_mask(old, roll, mask, **case)
        _replaced("compute_rollout_correction_and_rejection_mask")
    assert (w is None) == (ref_w is None)
    if w is not None:
        a, b = ref_w.batch["rollout_is_weights"], w.batch["rollout_is_weights"]
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert m.dtype == ref_m.dtype and m is not mask
    torch.testing.assert_close(m, ref_m)
    _same_metrics(ref_met, met)


@pytest.mark.parametrize("case", RC_CASES[:4])
def test_correction_weights(verl, case):
    old, roll, mask = _rc_data()
    lr = old - roll
    kw = {k: v for k, v in case.items() if k.startswith("rollout_is")}
    ref_w, ref_met = verl.rch.compute_rollout_correction_weights(lr, mask, **kw)
    with pki.patched("verl"):
        w, met = verl.rch.compute_rollout_correction_weights(lr, mask, **kw)
        _replaced("compute_rollout_correction_weights")
    torch.testing.assert_close(w, ref_w, rtol=RTOL, atol=ATOL)
    _same_metrics(ref_met, met)


@pytest.mark.parametrize("case", [c for c in RC_CASES if "rollout_rs" in c])
def test_rejection_mask(verl, case):
    old, roll, mask = _rc_data(float_mask=True)
    kw = {k: v for k, v in case.items() if k.startswith("rollout_rs")}
    ref_m, ref_met = verl.rch.compute_rollout_rejection_mask(old - roll, mask, **kw)
    with pki.patched("verl"):
        m, met = verl.rch.compute_rollout_rejection_mask(old - roll, mask, **kw)
        _replaced("compute_rollout_rejection_mask")
    assert m.dtype == ref_m.dtype
    torch.testing.assert_close(m, ref_m)
    _same_metrics(ref_met, met)


def test_offpolicy_metrics(verl):
    old, roll, mask = _rc_data()
    for args in ((old, roll, mask), (old, None, mask)):
        ref = verl.rch.compute_offpolicy_metrics(*args)
        with pki.patched("verl"):
            got = verl.rch.compute_offpolicy_metrics(*args)
        _same_metrics(ref, got)
    ref = verl.rch.compute_rollout_corr_metrics_from_logprobs(old, roll, mask)
    with pki.patched("verl"):
        got = verl.rch.compute_rollout_corr_metrics_from_logprobs(old, roll, mask)
        _replaced("compute_rollout_corr_metrics_from_logprobs")
    _same_metrics(ref, got)


def test_rollout_helpers_empty_mask_raise_like_verl(verl):
    old, roll, mask = _rc_data()
    none = torch.zeros_like(mask)
    for patched in (False, True):
        with pki.patched("verl") if patched else _nothing():
            with pytest.raises(ValueError, match="at least one valid token"):
                verl.rch.compute_rollout_correction_and_rejection_mask(old, roll, none)
            with pytest.raises(AssertionError):
                verl.rch.compute_offpolicy_metrics(old, roll, none)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_one_host_sync_per_call(verl, monkeypatch):
    """verl syncs once per metric (.item()); the patched helpers once per call (.tolist())."""
    old, roll, mask = _rc_data()
    calls = {"item": 0, "tolist": 0}
    real = {k: getattr(torch.Tensor, k) for k in calls}

    def counting(k):
        def f(self, *a, **kw):
            calls[k] += 1
            return real[k](self, *a, **kw)

        return f

    case = dict(rollout_is="token", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="2,0.1")
    with pki.patched("verl"):
        for k in calls:
            monkeypatch.setattr(torch.Tensor, k, counting(k))
        verl.rch.compute_rollout_correction_and_rejection_mask(old, roll, mask, **case)
        cfg = _config(verl, "gspo")
        verl.core.get_policy_loss_fn("gspo")(
            old, old.clone().requires_grad_(True), roll, mask, "token-mean", cfg
        )
        monkeypatch.undo()
    assert calls == {"item": 0, "tolist": 2}, calls
