"""Every policy-loss type of `ppo_policy_loss` (ppo_kernels/losses/policy_math.py): the analytic
two-stage gradients against autograd of the float64 reference and gradcheck, the peers' own
functions fed the same per-token log-probs (verl's registry, TRL's GRPOTrainer._compute_loss,
Liger's LigerFusedLinearGRPOLoss), rollout correction against verl's helper, bad arguments."""

from __future__ import annotations

import math
import types

import pytest
import torch
from support.skips import need

import ppo_kernels as pk
from ppo_kernels.losses import policy_loss as pl
from ppo_kernels.losses import policy_math as pm
from ppo_kernels.losses import policy_naive as pr
from ppo_kernels.losses.config import PolicyLossConfig

RTOL, ATOL = 1e-5, 1e-6

# per type: the options that make it bite (clip bounds, truncations, selections)
OPTS = {
    "ppo": dict(dual_clip=3.0),
    "grpo": dict(delta=1.6),
    "bnpo": {},
    "dr_grpo": {},
    "dapo": dict(delta=2.0),
    "luspo": {},
    "gspo": {},
    "sapo": {},
    "cispo": {},
    "gpg": {},
    "reinforce": {},
    "dro": dict(dro_beta=0.3),
    "dppo_tv": dict(dual_clip=2.5),
    "dppo_kl": {},
    "geo_mean": {},
    "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0),
    "kl_cov": dict(kl_cov_ratio=0.2, kl_cov_coef=0.5),
}
CASES = [(t, "token") for t in pm.LOSS_TYPES] + [(t, "sequence") for t in pm.SEQUENCE_LEVEL_TYPES]


def _data(B=6, T=7, seed=0, spread=0.5, dtype=torch.float32, per_row_adv=False, edge=True):
    """Log-probs < 0 (as real ones), old ones `spread` away (ratios far outside the clip range
    for spread >= 1), a mask with an empty row, a single-token row and ragged rows."""
    g = torch.Generator().manual_seed(seed)
    lp = -(torch.rand(B, T, generator=g) * 3 + 0.05)
    old = (lp + spread * torch.randn(B, T, generator=g)).clamp(max=-0.01)
    adv = torch.randn(B, generator=g) if per_row_adv else torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    if edge:
        mask[1] = 0  # all-masked row
        mask[2] = 0
        mask[2, 3] = 1  # single-token row
        mask[0] = 1
    return lp.to(dtype), old.to(dtype), adv.to(dtype), mask


def _ours(t, lp, old, adv, mask, level="token", seed=1, **kw):
    opts = dict(OPTS[t])
    opts.update(kw)
    g = torch.Generator().manual_seed(seed) if t == "clip_cov" else None
    return pk.ppo_policy_loss(
        lp, old, adv, mask, loss_type=t, importance_sampling_level=level, generator=g, **opts
    )


def _cfg(t, level, **kw):
    """The PolicyLossConfig ppo_policy_loss builds for these options (through its own checks)."""
    o = dict(OPTS[t])
    o.update(kw)
    return PolicyLossConfig(loss_type=t, importance_sampling_level=level, **o)


def _reference_grad(t, level, lp, old, adv, mask, agg=None, weights=None, seed=1, **kw):
    """(loss, d loss / d lp) of the autograd reference, float64, with ppo_policy_loss's defaults."""
    cfg = _cfg(t, level, **kw)
    B, T = lp.shape
    default, rows = pm.default_aggregation(t)
    gd = torch.tensor(float(B), dtype=torch.float64) if (agg is None and rows) else None
    agg = default if agg is None else agg
    scale = 1.0 / T if agg == "seq-mean-token-sum-norm" else 1.0
    x = pm.prepare(lp.double(), old.double(), adv.double(), mask)
    leaf = x.lp.clone().requires_grad_(True)
    g = torch.Generator().manual_seed(seed) if t == "clip_cov" else None
    w = None if weights is None else weights.double()
    loss = pr.policy_loss(cfg, x, leaf, agg, scale, gd, w, generator=g)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


# --------------------------------------------------------------------------- analytic = autograd
@pytest.mark.parametrize("t,level", CASES)
@pytest.mark.parametrize("spread", [0.3, 2.0])
@pytest.mark.parametrize("per_row_adv", [False, True])
def test_analytic_gradient_is_autograd_of_the_reference(t, level, spread, per_row_adv):
    lp, old, adv, mask = _data(spread=spread, dtype=torch.float64, per_row_adv=per_row_adv)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
    for weights in (None, w):
        x = lp.clone().requires_grad_(True)
        loss, _ = _ours(t, x, old, adv, mask, level, weights=weights)
        loss.backward()
        ref, ref_grad = _reference_grad(t, level, lp, old, adv, mask, weights=weights)
        torch.testing.assert_close(loss.detach(), ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, ref_grad, rtol=1e-10, atol=1e-12)
        assert ref_grad.abs().max() > 0  # a gradient that can differ


@pytest.mark.parametrize("t", ["grpo", "sapo", "dro", "clip_cov"])
@pytest.mark.parametrize(
    "agg", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_every_aggregation(t, agg):
    lp, old, adv, mask = _data(dtype=torch.float64)
    level = "sequence" if t == "grpo" else "token"
    x = lp.clone().requires_grad_(True)
    loss, _ = _ours(t, x, old, adv, mask, level, agg=agg)
    loss.backward()
    ref_agg = "token-mean" if agg == "token-sum" else agg
    cfg = _cfg(t, level)
    xs = pm.prepare(lp, old, adv, mask)
    leaf = xs.lp.clone().requires_grad_(True)
    scale = 1.0 / lp.shape[-1] if agg.endswith("norm") else 1.0
    gd = torch.tensor(1.0, dtype=torch.float64) if agg == "token-sum" else None
    g = torch.Generator().manual_seed(1) if t == "clip_cov" else None
    ref = pr.policy_loss(cfg, xs, leaf, ref_agg, scale, gd, generator=g)
    (rg,) = torch.autograd.grad(ref, leaf)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, rg, rtol=1e-10, atol=1e-12)


# A stop-gradient (cispo's and dppo's detached ratio, gspo's detached sequence ratio) makes the
# gradient differ from the derivative of the loss value by design: those types are checked against
# autograd of the reference above, gradcheck runs on the others.
STOP_GRADIENT_TYPES = ("gspo", "cispo", "dppo_tv", "dppo_kl")


@pytest.mark.parametrize("t,level", [c for c in CASES if c[0] not in STOP_GRADIENT_TYPES])
def test_gradcheck(t, level):
    lp, old, adv, mask = _data(B=4, T=5, seed=3, spread=0.6, dtype=torch.float64)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5

    def f(x):
        return _ours(t, x, old, adv, mask, level, weights=w, dp_size=1)[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(True),), eps=1e-7, atol=1e-7)


def test_stage_outputs_and_second_pass_needs():
    """Stage 1 returns exactly what each type needs; stage 2's row-statistic gradient terms are
    present exactly where the gradient flows through a row statistic."""
    lp, old, adv, mask = _data(dtype=torch.float64)
    x = pm.prepare(lp, old, adv, mask)
    for t, level in CASES:
        cfg = _cfg(t, level)
        st = pm.statistics(cfg, x, torch.Generator().manual_seed(0))
        terms = pm.token_terms(cfg, x, st)
        assert (st.seq_log_ratio is not None) == (t == "gspo" or level == "sequence"), t
        assert (st.select is not None) == (t in pm.BATCH_STAT_TYPES), t
        assert (terms.seq_grad is not None) == (
            (level == "sequence" and t != "cispo") or t == "geo_mean"
        ), (t, level)
        scope = pm.stat_scope(cfg)  # what a fused op needs before forming the gradient tile
        assert (scope == "batch") == (st.select is not None), t
        assert (scope == "sequence") == (
            st.seq_log_ratio is not None or st.geo_log_ratio is not None
        ), t
    cfg = _cfg("gpg", "token")
    opts = pl.RolloutOptions("token", (2.0, None), False, [], True)
    assert pl.stat_scope(cfg, opts, "token-mean", None) == "token"
    opts = pl.RolloutOptions("sequence", (2.0, None), False, [], True)
    assert pl.stat_scope(cfg, opts, "token-mean", None) == "sequence"
    opts = pl.RolloutOptions(None, None, False, [("token_k2", None, 1.0)], True)
    assert pl.stat_scope(cfg, opts, "token-mean", None) == "batch"
    assert pl.stat_scope(cfg, opts, "token-mean", torch.tensor(9.0)) == "token"
    opts = pl.RolloutOptions("sequence", (2.0, None), False, [], False)  # from old log-probs
    assert pl.stat_scope(cfg, opts, "token-mean", None) == "token"


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("t,level", CASES)
def test_empty_and_degenerate_masks(t, level):
    lp, old, adv, _ = _data(dtype=torch.float32)
    for mask in (torch.zeros_like(lp), torch.zeros(lp.shape, dtype=torch.bool)):
        x = lp.clone().requires_grad_(True)
        loss, stats = _ours(t, x, old, adv, mask, level)
        loss.backward()
        assert loss.item() == 0 and x.grad.abs().max() == 0
        for k, v in stats.items():
            if k in ("clip_low_frac_min", "clip_high_frac_max"):
                assert v.isnan(), k  # no row to take a min / max over (TRL's nanmin)
            else:
                assert torch.isfinite(v) and v == 0, (k, v)
        loss, stats = _ours(t, x, old, adv, mask, level, empty="nan", empty_stats="nan")
        # NaN over a zero denominator only: TRL's grpo / dr_grpo / luspo and geo_mean divide by B
        assert loss.isnan() != pm.default_aggregation(t)[1] and stats["approx_kl"].isnan()
    # no token at all, and NaN / inf at masked positions never reach the result
    for shape in ((0, 4), (3, 0)):
        z = torch.zeros(shape, requires_grad=True)
        loss, _ = _ours(t, z, z.detach(), z.detach(), z.detach(), level)
        loss.backward()
        assert loss.item() == 0
    lp2, old2, adv2, mask2 = _data(dtype=torch.float32)
    poisoned = [a.clone() for a in (lp2, old2, adv2)]
    for a in poisoned:
        a[mask2 == 0] = math.nan
    poisoned[0][1, 0] = math.inf
    x = poisoned[0].clone().requires_grad_(True)
    ref = _ours(t, lp2, old2, adv2, mask2, level)[0]
    loss, stats = _ours(t, x, poisoned[1], poisoned[2], mask2, level)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    assert torch.isfinite(x.grad).all() and (x.grad[mask2 == 0] == 0).all()
    assert all(torch.isfinite(v) for v in stats.values())


def test_ppo_default_path_unchanged_and_per_row_advantages():
    """loss_type="ppo" (default) still runs today's fused op; per-sequence advantages broadcast."""
    lp, old, adv, mask = _data(per_row_adv=True)
    full = adv.unsqueeze(-1).expand(lp.shape).contiguous()
    a, sa = pk.ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0)
    b, sb = pk.ppo_policy_loss(lp, old, full, mask, dual_clip=3.0)
    torch.testing.assert_close(a, b)
    assert sa.keys() == sb.keys() == {"clip_frac", "clip_frac_lower", "approx_kl", "ratio_mean"}
    # the shared math's "ppo" (sequence level at length 1 == token level) agrees with the kernel
    one = mask[:, :1]
    c, _ = pk.ppo_policy_loss(lp[:, :1], old[:, :1], full[:, :1], one, dual_clip=3.0)
    d, _ = pk.ppo_policy_loss(
        lp[:, :1], old[:, :1], full[:, :1], one, dual_clip=3.0, importance_sampling_level="sequence"
    )
    torch.testing.assert_close(c, d)


TOKEN_CLIP_TYPES = [t for t in pm.CLIP_TYPES if t != "ppo"]


@pytest.mark.parametrize(
    "case",
    [{}, dict(clip_high=0.28), dict(per_row_adv=True), dict(log_ratio_clamp=3.0)]
    + [dict(float_mask=True), dict(garbage=True), dict(dtype=torch.float64)],
    ids=lambda c: "-".join(c) or "default",
)
@pytest.mark.parametrize("t", TOKEN_CLIP_TYPES)
def test_token_level_clipped_types_run_the_fused_kernels(t, case, monkeypatch):
    """TRL's token-level clipped types are ppo's per-token loss with their own aggregation and
    log-ratio clamp: they run the fused "ppo" kernels (the shared math is not called), with TRL's
    clip statistics beside -- the shared math's numbers (weights of 1 take that route), its
    statistics in its order. Ratios on the clip bounds (ties), extreme log-ratios, rows with no
    token, and NaN / inf under the mask."""
    case = dict(case)
    dtype = case.pop("dtype", torch.float32)
    g = torch.Generator().manual_seed(1)
    B, T = 5, 33
    lp = (-torch.rand(B, T, generator=g) * 3).to(dtype)
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    old[:, ::7] = lp[:, ::7] - 30.0
    old[:, 3] = lp[:, 3] - math.log(0.8)  # on the lower clip bound
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    adv[:, 5] = 0.0
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False
    if case.pop("per_row_adv", False):
        adv = adv[:, 0].clone()
    if case.pop("float_mask", False):
        mask = mask * torch.rand(B, T, generator=g)
    if case.pop("garbage", False):  # what the mask hides reaches no sum and no gradient
        lp = torch.where(mask, lp, torch.full_like(lp, math.nan))
        adv = torch.where(mask, adv, torch.full_like(adv, math.inf))

    def run(**kw):
        x = lp.clone().requires_grad_()
        loss, stats = pk.ppo_policy_loss(x, old, adv, mask, loss_type=t, **case, **kw)
        (gx,) = torch.autograd.grad(loss, x)
        return loss, stats, gx

    shared = run(weights=torch.ones_like(lp))
    with monkeypatch.context() as mp:
        mp.setattr(pl, "shared_loss", lambda *a, **k: pytest.fail("the shared math ran"))
        fused = run()
    assert list(fused[1]) == list(shared[1])
    assert torch.isfinite(fused[2]).all() and (fused[2][mask == 0] == 0).all()
    # float32: the kernel's sums run in another order (ratios up to e^30 here)
    tol = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(fused[0], shared[0], **tol)
    torch.testing.assert_close(fused[2], shared[2], **tol, msg=lambda m: f"gradient: {m}")
    for k, v in fused[1].items():
        torch.testing.assert_close(
            v, shared[1][k], **tol, equal_nan=True, msg=lambda m: f"{k}: {m}"
        )


def test_clip_cov_draws_exactly_clip_num_candidates():
    lp, old, adv, mask = _data(B=8, T=40, seed=4, spread=0.2)
    adv = adv * 3
    cfg = _cfg("clip_cov", "token", clip_cov_ratio=0.02, clip_cov_lb=0.05)
    x = pm.prepare(lp, old, adv, mask)
    wide = _cfg("clip_cov", "token", clip_cov_ratio=1.0, clip_cov_lb=0.05)
    cand = pm.statistics(wide, x).select == 0  # every candidate dropped
    assert int(cand.sum()) > max(int(0.02 * mask.sum()), 1)
    draws = set()
    for seed in range(6):
        st = pm.statistics(cfg, x, torch.Generator().manual_seed(seed))
        dropped = st.select == 0
        assert int(dropped.sum()) == max(int(0.02 * mask.sum()), 1)
        draws.add(tuple(dropped.flatten().nonzero().flatten().tolist()))
        assert (dropped <= cand).all()  # only candidates are dropped
    assert len(draws) > 1  # drawn at random among them


# --------------------------------------------------------------------------- verl's registry
@pytest.fixture(scope="module")
def verl():
    from support.integration import verl_loss_modules

    with verl_loss_modules() as v:
        yield v


def _verl_config(verl, mode, info=None, rollout_correction=None, **policy):
    from support.integration import actor_config

    return actor_config(verl, mode, info, rollout_correction, **policy)


VERL_METRICS = {
    "actor/pg_clipfrac": "clip_frac",
    "actor/ppo_kl": "approx_kl",
    "actor/pg_clipfrac_lower": "clip_frac_lower",
}
# verl's registry name -> (our loss_type, our options besides clip_low=0.15, clip_high=0.28)
VERL_TYPES = {
    "vanilla": ("ppo", dict(dual_clip=3.0)),
    "dppo_tv": ("dppo_tv", dict(dual_clip=3.0)),
    "dppo_kl": ("dppo_kl", dict(dual_clip=3.0)),
    "gspo": ("gspo", {}),
    "sapo": ("sapo", dict(tau_neg=1.3)),
    "gpg": ("gpg", {}),
    "clip_cov": ("clip_cov", dict(clip_cov_ratio=1.0, clip_cov_lb=0.05)),
    "kl_cov": ("kl_cov", dict(kl_cov_ratio=0.2, kl_cov_coef=0.5)),
    "geo_mean": ("geo_mean", {}),
    "dro": ("dro", dict(dro_beta=0.3)),
    "cispo": ("cispo", {}),
}
VERL_POLICY = {  # what PolicyLossConfig / ActorConfig carry for those options
    "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=0.05),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5),
    "dro": dict(dro_beta=0.3),
}


def _agg_kwargs(agg, info):
    out = {}
    if info:
        out = dict(
            dp_size=info["dp_size"],
            global_num_tokens=info.get("batch_num_tokens"),
            global_batch_size=info.get("global_batch_size"),
            loss_scale_factor=info.get("loss_scale_factor"),
        )
    if agg is not None:
        out["agg"] = agg
    return out


def _close_metrics(ref: dict, ours: dict, names: dict):
    for k, v in ref.items():
        ok = names.get(k, k)
        assert ok in ours, (k, sorted(ours))
        got = float(ours[ok])
        assert math.isclose(got, float(v), rel_tol=RTOL, abs_tol=ATOL), (k, v, got)


@pytest.mark.parametrize("name", list(VERL_TYPES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("glob", [False, True])
@pytest.mark.parametrize("spread", [0.3, 2.0])
def test_verl_registry(verl, name, agg, glob, spread):
    lp, old, adv, mask = _data(spread=spread, seed=11)
    t, opts = VERL_TYPES[name]
    info = None
    if glob:
        info = dict(
            dp_size=2,
            batch_num_tokens=int(mask.sum()) * 2 + 3,
            global_batch_size=13,
            loss_scale_factor=16 if agg.endswith("norm") else None,
        )
    cfg = _verl_config(verl, name, info, **VERL_POLICY.get(name, {}))
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(7)) * 2
    for weights in (None, w):
        x = lp.clone().requires_grad_(True)
        ref, met = verl.core.get_policy_loss_fn(name)(old, x, adv, mask, agg, cfg, weights)
        ref.backward()
        y = lp.clone().requires_grad_(True)
        # verl's sapo aggregates seq-mean-token-mean and geo_mean its rows whatever agg says
        a = None if name in ("sapo", "geo_mean") else agg
        kw = _agg_kwargs(a, info)
        if name == "geo_mean":
            kw = {}  # verl's geo_mean ignores global_batch_info: a local mean over the rows
        elif name == "sapo" and info:
            kw.pop("loss_scale_factor")
        loss, stats = _ours(
            t, y, old, adv, mask, clip_low=0.15, clip_high=0.28, weights=weights, **opts, **kw
        )
        loss.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(y.grad, x.grad, rtol=RTOL, atol=ATOL)
        _close_metrics(met, stats, VERL_METRICS)


def _verl_rc(verl, **kw):
    return verl.algo.RolloutCorrectionConfig(**kw)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize(
    "rc",
    [
        dict(rollout_is="token", rollout_is_threshold=2.0),
        dict(rollout_is="sequence", rollout_is_threshold="0.2_5.0"),
        dict(
            rollout_is="token",
            rollout_rs="token_k1,seq_mean_k3",
            rollout_rs_threshold="0.5_2.0,0.05",
        ),
        dict(rollout_rs="seq_max_k2", rollout_rs_threshold=0.3),
    ],
)
def test_verl_bypass_mode(verl, loss_type, rc):
    lp, old, adv, mask = _data(spread=0.4, seed=12)
    rcc = _verl_rc(verl, bypass_mode=True, loss_type=loss_type, **{"rollout_is": None, **rc})
    cfg = _verl_config(verl, "bypass_mode", rollout_correction=rcc)
    x = lp.clone().requires_grad_(True)
    ref, met = verl.core.get_policy_loss_fn("bypass_mode")(old, x, adv, mask, "token-mean", cfg)
    ref.backward()
    y = lp.clone().requires_grad_(True)
    t, opts = ("ppo", dict(dual_clip=3.0)) if loss_type == "ppo_clip" else ("gpg", {})
    loss, stats = pk.ppo_policy_loss(
        y,
        old,
        adv,
        mask,
        loss_type=t,
        clip_low=0.15,
        clip_high=0.28,
        bypass_mode=True,
        agg="token-mean",
        **opts,
        **rc,
    )
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.grad, x.grad, rtol=RTOL, atol=ATOL)
    _close_metrics(met, stats, VERL_METRICS)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "geo_mean"])
def test_verl_trainer_rollout_correction_then_loss(verl, name):
    """verl's trainer: weights / rejection from old vs rollout log-probs, then the loss on the
    corrected mask with the weights; ours: the same from rollout_logprobs inside the loss."""
    lp, old, adv, mask = _data(spread=0.3, seed=13)
    roll = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    opts = dict(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k2,seq_sum_k1",
        rollout_rs_threshold="0.5,0.2_5",
    )
    proto, new_mask, rmet = verl.rch.compute_rollout_correction_and_rejection_mask(
        old, roll, mask, **opts
    )
    cfg = _verl_config(verl, name)
    x = lp.clone().requires_grad_(True)
    ref, met = verl.core.get_policy_loss_fn(name)(
        old, x, adv, new_mask, "token-mean", cfg, proto.batch["rollout_is_weights"]
    )
    ref.backward()
    y = lp.clone().requires_grad_(True)
    t, o = VERL_TYPES[name]
    loss, stats = _ours(
        t, y, old, adv, mask, clip_low=0.15, clip_high=0.28, rollout_logprobs=roll, **o, **opts
    )
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.grad, x.grad, rtol=RTOL, atol=ATOL)
    _close_metrics(met, stats, VERL_METRICS)
    _close_metrics(rmet, stats, {})


# --------------------------------------------------------------------------- rollout correction
RC_CASES = [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_1.5"),
    dict(rollout_is="sequence", rollout_is_threshold=3.0),
    dict(rollout_is="sequence", rollout_is_threshold="0.1_4.0", rollout_is_batch_normalize=True),
    dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k1", rollout_rs_threshold=1.5),
    dict(rollout_rs="token_k2,token_k3", rollout_rs_threshold="0.1,0.2"),
    dict(rollout_rs="seq_sum_k1,seq_sum_k2,seq_sum_k3", rollout_rs_threshold="0.3_2.5,0.5,0.6"),
    dict(rollout_rs="seq_mean_k1,seq_mean_k2,seq_mean_k3", rollout_rs_threshold="0.6_1.5,0.1,0.1"),
    dict(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_max_k2,seq_max_k3",
        rollout_rs_threshold=0.4,
    ),
]


@pytest.mark.parametrize("case", RC_CASES, ids=lambda c: ",".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("float_mask", [False, True])
def test_rollout_correction_matches_verl(verl, case, float_mask):
    lp, old, _, mask = _data(B=7, T=9, spread=0.3, seed=21)
    roll = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(4))
    roll[3, 2] -= 4.0  # an outlier token
    if float_mask:
        mask = mask * (0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(9)))
    proto, ref_mask, ref_met = verl.rch.compute_rollout_correction_and_rejection_mask(
        old, roll, mask, **case
    )
    got = pk.rollout_correction(old, roll, mask, **case)
    if proto is None:
        assert got.weights is None
    else:
        torch.testing.assert_close(
            got.weights, proto.batch["rollout_is_weights"], rtol=RTOL, atol=ATOL
        )
    assert got.mask.dtype == ref_mask.dtype
    torch.testing.assert_close(got.mask, ref_mask)
    assert set(ref_met) == {f"rollout_corr/{k}" for k in got.metrics}
    _close_metrics(ref_met, {f"rollout_corr/{k}": v for k, v in got.metrics.items()}, {})
    assert any(v != 0 for v in ref_met.values())


def test_rollout_correction_is_sync_free_and_traceable():
    lp, old, _, mask = _data(B=4, T=5)
    roll = old - 0.3

    def f(a, b, m):
        r = pk.rollout_correction(
            a,
            b,
            m,
            rollout_is="sequence",
            rollout_is_threshold="0.5_2",
            rollout_is_batch_normalize=True,
            rollout_rs="token_k1,seq_max_k3",
            rollout_rs_threshold="0.5_2,0.3",
        )
        return r.weights, r.mask, r.metrics

    eager = f(old, roll, mask)
    compiled = torch.compile(f, fullgraph=True, backend="eager")(old, roll, mask)
    for a, b in zip(eager[:2], compiled[:2]):
        torch.testing.assert_close(a, b)
    for k in eager[2]:
        torch.testing.assert_close(eager[2][k], compiled[2][k])


@pytest.mark.parametrize(
    "t,level",
    [("grpo", "sequence"), ("geo_mean", "token"), ("kl_cov", "token"), ("clip_cov", "token")],
)
def test_shared_math_traces_without_graph_breaks(t, level):
    """No .item(), no data-dependent Python branch: dynamo traces stage 1 + 2 in one graph."""
    lp, old, adv, mask = _data()
    cfg = _cfg(t, level)

    def f(lp, old, adv, mask):
        x = pm.prepare(lp, old, adv, mask)
        return pl.shared_loss(cfg, x, None, "token-mean", 1.0, None, None, False)[:2]

    a = f(lp, old, adv, mask)
    b = torch.compile(f, fullgraph=True, backend="eager")(lp, old, adv, mask)
    if t != "clip_cov":  # clip_cov draws from the global generator: another draw
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- TRL
class _Acc:
    num_processes = 1

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(
    loss_type,
    lp,
    old,
    adv,
    mask,
    *,
    level="token",
    eps=(0.2, 0.28),
    delta=None,
    mcl=None,
    num_items=None,
):
    from support.peer_stubs import import_peer

    grpo = import_peer("trl.trainer.grpo_trainer")
    B, T = lp.shape
    self = types.SimpleNamespace(
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        args=types.SimpleNamespace(
            delta=delta,
            sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05,
            use_bias_correction_kl=False,
            steps_per_generation=1,
        ),
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=mcl if mcl is not None else T,
        accelerator=_Acc(),
        _metrics={"train": __import__("collections").defaultdict(list)},
        _entropy_bonus_enabled=False,
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum() if num_items is None else torch.tensor(float(num_items)),
    }
    loss = grpo.GRPOTrainer._compute_loss(self, None, inputs)
    return loss, {k: v[-1] for k, v in self._metrics["train"].items()}


TRL_METRICS_TOKEN = {
    "clip_ratio/low_mean": "clip_low_frac",
    "clip_ratio/high_mean": "clip_high_frac",
    "clip_ratio/region_mean": "clip_region_frac",
    "clip_ratio/low_min": "clip_low_frac_min",
    "clip_ratio/high_max": "clip_high_frac_max",
    "cispo_clip_ratio": "clip_high_frac",
}
TRL_METRICS_SEQ = dict(
    TRL_METRICS_TOKEN,
    **{
        "clip_ratio/low_mean": "seq_clip_low_frac",
        "clip_ratio/high_mean": "seq_clip_high_frac",
        "clip_ratio/region_mean": "seq_clip_region_frac",
        "cispo_clip_ratio": "seq_clip_high_frac",
    },
)


def _ours_as_trl(
    loss_type,
    lp,
    old,
    adv,
    mask,
    *,
    level="token",
    eps=(0.2, 0.28),
    delta=None,
    mcl=None,
    num_items=None,
):
    B, T = lp.shape
    kw = dict(clip_low=eps[0], clip_high=eps[1], importance_sampling_level=level)
    if loss_type in pm.CLIP_TYPES:
        kw.update(loss_type=loss_type, delta=delta)
        if loss_type == "dr_grpo":
            kw["loss_scale_factor"] = mcl if mcl is not None else T
        if loss_type == "dapo":
            kw["global_num_tokens"] = mask.sum() if num_items is None else num_items
    elif loss_type == "cispo":  # TRL: clamp(ratio, max=epsilon_high), dapo's normaliser
        kw.update(loss_type="cispo", clip_low=1.0, clip_high=eps[1] - 1, log_ratio_clamp=math.inf)
        kw["global_num_tokens"] = mask.sum() if num_items is None else num_items
    elif loss_type == "sapo":  # TRL: no clamp, grpo's normaliser (every row counts)
        kw.update(loss_type="sapo", log_ratio_clamp=math.inf, global_batch_size=B)
    return pk.ppo_policy_loss(lp, old, adv, mask, **kw)


TRL_CASES = [
    ("grpo", "token", {}),
    ("grpo", "sequence", {}),
    ("grpo", "token", dict(delta=1.5)),
    ("bnpo", "token", {}),
    ("bnpo", "sequence", dict(delta=1.4)),
    ("dr_grpo", "token", dict(mcl=12)),
    ("dr_grpo", "sequence", {}),
    ("dapo", "token", dict(num_items=57)),
    ("dapo", "sequence", {}),
    ("luspo", "sequence", {}),
    ("luspo", "token", {}),
    ("cispo", "token", dict(eps=(0.2, 1.3))),
    ("cispo", "sequence", dict(eps=(0.2, 1.2))),
    ("sapo", "token", {}),
    ("sapo", "sequence", {}),
]


@pytest.mark.parametrize("t,level,kw", TRL_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("per_row_adv", [True, False])
@pytest.mark.parametrize("spread", [0.3, 2.0])
def test_trl_compute_loss(t, level, kw, per_row_adv, spread):
    lp, old, adv, mask = _data(spread=spread, seed=31, per_row_adv=per_row_adv)
    mask = mask.long()
    x = lp.clone().requires_grad_(True)
    ref, met = _trl_loss(t, x, old, adv, mask, level=level, **kw)
    ref.backward()
    y = lp.clone().requires_grad_(True)
    loss, stats = _ours_as_trl(t, y, old, adv, mask, level=level, **kw)
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.grad, x.grad, rtol=RTOL, atol=ATOL)
    names = TRL_METRICS_SEQ if (level == "sequence" and per_row_adv) else TRL_METRICS_TOKEN
    met.pop("entropy")
    for k, v in met.items():
        got = float(stats[names[k]])
        assert (math.isnan(v) and math.isnan(got)) or math.isclose(
            got, v, rel_tol=RTOL, abs_tol=ATOL
        ), (k, v, got)


# --------------------------------------------------------------------------- Liger
LIGER_CASES = [
    ("grpo", "token", {}),
    ("grpo", "sequence", dict(delta=1.5)),
    ("bnpo", "token", dict(delta=1.3)),
    ("bnpo", "sequence", {}),
    ("dr_grpo", "token", dict(mcl=11)),
    ("dapo", "token", {}),
    ("dapo", "sequence", {}),
    ("luspo", "sequence", {}),  # Liger's token-level luspo also sums masked positions (TRL not)
    ("cispo", "token", dict(eps=(0.2, 1.25))),
    ("sapo", "token", {}),
]


@pytest.mark.parametrize("t,level,kw", LIGER_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("spread", [0.3, 2.0])
def test_liger_fused_linear_grpo_loss(t, level, kw, spread):
    need("liger_kernel")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    B, T, H, V = 5, 6, 8, 16
    g = torch.Generator().manual_seed(41)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[1] = 0
    mask[2] = 0
    mask[2, 0] = 1
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        lp0 = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
    old = lp0 + spread * torch.randn(B, T, generator=g)
    eps = kw.get("eps", (0.2, 0.28))
    liger = LigerFusedLinearGRPOLoss(
        beta=0.0,
        compiled=False,
        use_ref_model=False,
        chunk_size=2,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        loss_type=t,
        max_completion_length=kw.get("mcl"),
        importance_sampling_level=level,
        delta=kw.get("delta"),
    )
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref, metrics = liger(h1, w1, ids, mask, adv, old_per_token_logps=old)
    ref.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = torch.log_softmax(h2 @ w2.T, -1).gather(-1, ids[..., None])[..., 0]
    loss, stats = _ours_as_trl(t, lp, old, adv, mask, level=level, **kw)
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=RTOL, atol=ATOL)
    (clip,) = metrics  # Liger's clip fraction: 0 for sapo (no clip), as ours has none
    torch.testing.assert_close(
        stats.get("clip_region_frac", torch.zeros(())), clip, rtol=RTOL, atol=ATOL
    )


# --------------------------------------------------------------------------- bad arguments
BAD = [
    (dict(loss_type="vanila"), ValueError, "loss_type"),
    (dict(loss_type=3), TypeError, "loss_type"),
    (dict(importance_sampling_level="seq"), ValueError, "importance_sampling_level"),
    (
        dict(loss_type="gpg", importance_sampling_level="sequence"),
        ValueError,
        "importance_sampling_level",
    ),
    (dict(loss_type="gspo", delta=2.0), ValueError, "delta"),
    (dict(loss_type="grpo", delta=-1.0), ValueError, "delta"),
    (dict(loss_type="sapo", dual_clip=3.0), ValueError, "dual_clip"),
    (dict(loss_type="grpo", dual_clip=0.5), ValueError, "dual_clip"),
    (dict(loss_type="dro"), ValueError, "dro_beta"),
    (dict(loss_type="dro", dro_beta=-1.0), ValueError, "dro_beta"),
    (dict(loss_type="kl_cov", kl_cov_ratio=1.5), ValueError, "kl_cov_ratio"),
    (dict(loss_type="clip_cov", clip_cov_ratio=0.0), ValueError, "clip_cov_ratio"),
    (dict(loss_type="clip_cov", generator=3), TypeError, "generator"),
    (dict(loss_type="sapo", tau_pos=0.0), ValueError, "tau_pos"),
    (dict(loss_type="grpo", clip_low=1.0), ValueError, "clip_low"),
    (dict(loss_type="cispo", clip_low=1.5), ValueError, "clip_low"),
    (dict(loss_type="cispo", clip_high=-1.0), ValueError, "clip_high"),
    (dict(loss_type="geo_mean", agg="token-mean"), ValueError, "agg"),
    (dict(loss_type="grpo", agg="seq-mean"), ValueError, "agg"),
    (dict(rollout_is="token"), ValueError, "rollout_is"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=2.0), ValueError, "rollout_rs"),
    (dict(bypass_mode=True, rollout_is="seq"), ValueError, "rollout_is"),
    (
        dict(bypass_mode=True, rollout_is="token", rollout_is_threshold="a_b"),
        ValueError,
        "rollout_is_threshold",
    ),
    (
        dict(bypass_mode=True, rollout_is="token", rollout_is_threshold="3_2"),
        ValueError,
        "rollout_is_threshold",
    ),
    (
        dict(bypass_mode=True, rollout_is="token", rollout_is_threshold=True),
        TypeError,
        "rollout_is_threshold",
    ),
    (
        dict(bypass_mode=True, rollout_rs="token_k4", rollout_rs_threshold=2.0),
        ValueError,
        "rollout_rs",
    ),
    (dict(bypass_mode=True, rollout_rs="token_k2"), ValueError, "rollout_rs_threshold"),
    (
        dict(bypass_mode=True, rollout_rs="token_k2", rollout_rs_threshold="0.1_2"),
        ValueError,
        "rollout_rs_threshold",
    ),
    (
        dict(bypass_mode=True, rollout_rs="token_k2,token_k3", rollout_rs_threshold="1,2,3"),
        ValueError,
        "rollout_rs_threshold",
    ),
    (
        dict(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold=-2.0),
        ValueError,
        "rollout_rs_threshold",
    ),
    (dict(bypass_mode=True, loss_type="dro", dro_beta=0.1), ValueError, "bypass_mode"),
    (dict(bypass_mode="yes"), TypeError, "bypass_mode"),
    (dict(rollout_is_batch_normalize=1), TypeError, "rollout_is_batch_normalize"),
]


@pytest.mark.parametrize("kw,err,name", BAD, ids=lambda v: str(v)[:60])
def test_bad_arguments_are_named(kw, err, name):
    lp, old, adv, mask = _data(B=3, T=4)
    with pytest.raises(err, match=rf"^{name}\b"):
        pk.ppo_policy_loss(lp, old, adv, mask, **kw)


def test_bad_tensors_are_named():
    lp, old, adv, mask = _data(B=3, T=4)
    with pytest.raises(ValueError, match="^rollout_logprobs"):
        pk.ppo_policy_loss(lp, old, adv, mask, rollout_logprobs=old[:, :2], rollout_is="token")
    with pytest.raises(ValueError, match="^rollout_logprobs"):
        pk.ppo_policy_loss(lp, old, adv, mask, rollout_logprobs=old, bypass_mode=True)
    with pytest.raises(ValueError, match="^advantages"):
        pk.ppo_policy_loss(lp, old, adv[:, :2], mask, loss_type="grpo")
    with pytest.raises(ValueError, match="^weights"):
        pk.ppo_policy_loss(lp, old, adv, mask, loss_type="grpo", weights=lp[:, :1])
    with pytest.raises(TypeError, match="^rollout_logprobs"):
        pk.rollout_correction(lp, old.long(), mask, rollout_is="token")
    with pytest.raises(ValueError, match="^mask"):
        pk.rollout_correction(lp, old, mask[:1], rollout_is="token")
