"""ppo_kernels.integrations for verl 0.9.x: the real verl functions, patched vs unpatched."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from support import BENCH
from support.integration import batch, compare
from support.peer_stubs import import_peer
from support.peers import Config

import ppo_kernels.integrations as pki

AGGS = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


@pytest.fixture(scope="module")
def verl():
    core = import_peer("verl.trainer.ppo.core_algos")
    tf = import_peer("verl.utils.torch_functional")
    yield core, tf
    pki.revert("verl")


def _batch(B=6, T=9, seed=0, empty_row=True):
    return batch(B, T, seed, empty_row)


Cfg = Config  # verl's ActorConfig: attribute access plus .get()


def test_apply_reaches_every_copy_and_reverts(verl):
    core, tf = verl
    orig_gae = core.compute_gae_advantage_return
    orig_lp = tf.logprobs_from_logits
    copies = [
        m
        for m in list(sys.modules.values())
        if getattr(m, "__dict__", None) and m.__dict__.get("logprobs_from_logits") is orig_lp
    ]
    rep = pki.apply("verl")
    late = types.ModuleType("late_importer")  # imports the patched function after apply
    late.logprobs_from_logits = kept = tf.logprobs_from_logits
    sys.modules["late_importer"] = late
    try:
        assert core.compute_gae_advantage_return is not orig_gae
        assert core.ADV_ESTIMATOR_REGISTRY["gae"] is core.compute_gae_advantage_return
        assert core.get_policy_loss_fn("vanilla") is core.compute_policy_loss_vanilla
        for m in copies:
            assert m.logprobs_from_logits is tf.logprobs_from_logits is not orig_lp
        # 18 core_algos / torch_functional / fused-kernel / engine targets, 14 policy losses
        # (the registry's 12, compute_policy_loss_reinforce, the pre-registry compute_policy_loss),
        # 5 rollout helpers
        assert len(rep["functions"]) == 37 and rep["active"]
        for name, fn in core.POLICY_LOSS_REGISTRY.items():  # every registry entry replaced
            assert hasattr(fn, "__ppo_kernels_original__"), name
        places = rep["functions"]["verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage"][
            "patched_in"
        ]
        assert any("ADV_ESTIMATOR_REGISTRY['grpo']" in p for p in places)
    finally:
        pki.revert("verl")
    assert core.compute_gae_advantage_return is orig_gae
    assert core.ADV_ESTIMATOR_REGISTRY["gae"] is orig_gae
    assert all(m.logprobs_from_logits is orig_lp for m in copies)
    assert late.logprobs_from_logits is orig_lp
    del sys.modules["late_importer"]
    assert not pki.report("verl")["active"]
    x, y = torch.randn(2, 5), torch.tensor([1, 2])
    torch.testing.assert_close(kept(x, y), orig_lp(x, y))  # a surviving reference runs verl's


def test_strict_and_fallback(verl):
    core, _ = verl
    mask, lp, old, adv, _ = _batch()
    cfg = Cfg(
        clip_ratio=0.2,
        clip_ratio_low=1.2,
        clip_ratio_high=None,
        clip_ratio_c=3.0,
        global_batch_info={},
    )  # a lower clip >= 1: ppo_policy_loss refuses it
    with pki.patched("verl"):
        with pytest.raises(pki.Unsupported, match="clip_ratio_low"):
            core.compute_policy_loss_vanilla(old, lp, adv, mask, config=cfg)
        with pytest.raises(ValueError, match="kl_penalty='full'.*full_kl"):  # per-token inputs
            core.kl_penalty(lp, old, "full")
    ref = core.compute_policy_loss_vanilla(old, lp, adv, mask, config=cfg)
    with pki.patched("verl", strict=False):
        got = core.compute_policy_loss_vanilla(old, lp, adv, mask, config=cfg)
        s = pki.report("verl")["functions"][
            "verl.trainer.ppo.core_algos.compute_policy_loss_vanilla"
        ]
        assert s["calls"] == 1 and s["fallbacks"] == 1 and s["replaced"] == 0
        assert "clip_ratio_low" in next(iter(s["fallback_reasons"]))
    torch.testing.assert_close(got[0], ref[0])


def test_version_table(verl, monkeypatch):
    import importlib.metadata as md

    real = md.version
    monkeypatch.setattr(md, "version", lambda d: "0.3.0" if d == "verl" else real(d))
    with pytest.raises(
        pki.UnsupportedVersion, match=r"verl 0\.3\.0 is not a supported version.*0\.9\.x"
    ):
        pki.apply("verl")
    with pytest.warns(UserWarning, match="patching anyway"):
        pki.apply("verl", strict=False)
    pki.revert("verl")


@pytest.mark.parametrize("seed", [0, 1])
def test_gae(verl, seed):
    core, _ = verl
    mask, lp, old, adv, g = _batch(seed=seed)
    r = torch.randn(6, 9, generator=g) * mask
    v = torch.randn(6, 9, generator=g)
    compare("verl", lambda: core.get_adv_estimator_fn("gae"), r, v, mask, 0.99, 0.95)
    compare("verl", lambda: core.compute_gae_advantage_return, r, v, mask.float(), 1.0, 1.0)


def test_gae_too_few_tokens_raises_like_verl(verl):
    core, _ = verl
    r, v, m = torch.randn(2, 4), torch.randn(2, 4), torch.zeros(2, 4)
    m[0, 1] = 1
    with pytest.raises(ValueError):
        core.compute_gae_advantage_return(r, v, m, 1.0, 1.0)
    with pki.patched("verl"), pytest.raises(ValueError):
        core.compute_gae_advantage_return(r, v, m, 1.0, 1.0)


@pytest.mark.parametrize(
    "name,norm",  # the std normalisation is a GRPO option
    [("grpo", True), ("grpo", False), ("grpo_vectorized", True), ("grpo_vectorized", False)]
    + [("rloo", True), ("rloo_vectorized", True)],
)
def test_outcome_estimators(verl, name, norm):
    core, _ = verl
    g = torch.Generator().manual_seed(3)
    B, T = 12, 5
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.randint(0, 3, (B,), generator=g).float()  # ties -> equal-score groups
    uids = np.array(
        ["p1", "p0", "p1", "p2", "p0", "p1", "p3", "p2", "p0", "p2", "p4", "p4"], dtype=object
    )
    rewards[10, -1] = rewards[11, -1] = 1.0  # p4: equal scores; p3: a singleton
    kw = {"norm_adv_by_std_in_grpo": norm} if name.startswith("grpo") else {}
    compare("verl", lambda: core.get_adv_estimator_fn(name), rewards, mask, uids, **kw)


@pytest.mark.parametrize(
    "est", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "k2+"]
)
def test_kl_penalty(verl, est):
    core, _ = verl
    mask, lp, old, adv, _ = _batch()
    lp.requires_grad_(True)
    old.requires_grad_(True)
    compare("verl", lambda: core.kl_penalty, lp, old, est)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("glob", [False, True])
def test_policy_loss(verl, agg, glob):
    core, _ = verl
    mask, lp, old, adv, _ = _batch()
    lp.requires_grad_(True)
    info = {}
    if glob:
        info = dict(
            dp_size=2,
            batch_num_tokens=int(mask.sum()) * 2,
            global_batch_size=10,
            loss_scale_factor=16 if agg.endswith("norm") else None,
        )
    cfg = Cfg(
        clip_ratio=0.2,
        clip_ratio_low=0.1,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        global_batch_info=info,
    )
    compare("verl", lambda: core.get_policy_loss_fn("vanilla"), old, lp, adv, mask, agg, cfg)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(7)) * 2  # rollout IS weights
    compare("verl", lambda: core.get_policy_loss_fn("vanilla"), old, lp, adv, mask, agg, cfg, w)
    # the pre-registry entry point (no global batch info)
    compare(
        "verl",
        lambda: core.compute_policy_loss,
        old,
        lp,
        adv,
        mask,
        cliprange=0.2,
        clip_ratio_c=2.5,
        loss_agg_mode=agg,
    )


def test_policy_loss_empty_mask_is_nan_like_verl(verl):
    core, _ = verl
    mask, lp, old, adv, _ = _batch()
    cfg = Cfg(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, global_batch_info={})
    ref, got, _ = compare(
        "verl",
        lambda: core.compute_policy_loss_vanilla,
        old,
        lp,
        adv,
        torch.zeros_like(mask),
        "token-mean",
        cfg,
    )
    assert ref[0].isnan() and got[0].isnan()


@pytest.mark.parametrize("agg", AGGS)
def test_value_loss(verl, agg):
    core, _ = verl
    mask, lp, old, adv, g = _batch()
    vp = torch.randn(6, 9, generator=g, requires_grad=True)
    compare("verl", lambda: core.compute_value_loss, vp, adv, old, mask, 0.3, agg)
    compare(
        "verl",
        lambda: core.compute_value_loss,
        vp,
        adv,
        old,
        mask.float(),
        0.5,
        agg,
        dp_size=4,
        batch_num_tokens=100,
        global_batch_size=17,
        loss_scale_factor=8,
    )


@pytest.mark.parametrize("agg", AGGS)
def test_agg_loss(verl, agg):
    core, _ = verl
    mask, lp, old, adv, g = _batch()
    x = torch.randn(6, 9, generator=g, requires_grad=True)
    compare("verl", lambda: core.agg_loss, x, mask, agg)
    compare(
        "verl",
        lambda: core.agg_loss,
        x,
        mask.bool(),
        agg,
        dp_size=2,
        batch_num_tokens=50,
        global_batch_size=8,
        loss_scale_factor=4,
    )
    ref, got, _ = compare("verl", lambda: core.agg_loss, x, torch.zeros_like(mask), agg)
    assert ref.isnan() == got.isnan()


@pytest.mark.parametrize("shape", [(2, 5, 64), (7, 33)])
def test_logprobs_entropy(verl, shape):
    _, tf = verl
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(*shape, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    compare("verl", lambda: tf.logprobs_from_logits, logits, labels)
    compare("verl", lambda: tf.entropy_from_logits, logits)
    if len(shape) == 2:
        compare("verl", lambda: tf.entropy_from_logits_with_chunking, logits, chunk_size=4)


def test_masked_stats(verl):
    _, tf = verl
    mask, lp, old, adv, g = _batch()
    x = torch.randn(6, 9, generator=g, requires_grad=True)
    weights = torch.rand(6, 9, generator=g) * mask  # a weighted (float) mask
    for m in (mask, mask.bool(), weights):
        compare("verl", lambda: tf.masked_mean, x, m)
        compare("verl", lambda: tf.masked_mean, x, m, axis=-1)
        compare("verl", lambda: tf.masked_whiten, x, m)
        compare("verl", lambda: tf.masked_whiten, x, m, shift_mean=False)


@pytest.mark.parametrize("adv_est", ["gae", "grpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_core_algos_pipeline(verl, adv_est, agg):
    """verl's core_algos from scores to the aggregated loss, every step through verl's own lookup."""
    core, tf = verl
    mask, lp, old, adv, g = _batch(B=8, T=7, empty_row=False)
    ref = old - 0.2 * torch.rand(8, 7, generator=g)
    scores = torch.zeros(8, 7)
    scores[:, -1] = torch.randn(8, generator=g)
    values = torch.randn(8, 7, generator=g)
    uids = np.array([f"u{i // 4}" for i in range(8)], dtype=object)
    logits = torch.randn(8, 7, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 32, (8, 7), generator=g)
    vpred = torch.randn(8, 7, generator=g, requires_grad=True)
    cfg = Cfg(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=3.0,
        global_batch_info={},
    )

    def pipeline(logits, vpred):
        kld = core.kl_penalty(old, ref, kl_penalty="low_var_kl") * mask
        rewards = scores - 0.05 * kld
        fn = core.get_adv_estimator_fn(adv_est)
        if adv_est == "gae":
            a, ret = fn(rewards, values, mask, gamma=1.0, lam=0.95)
        else:
            a, ret = fn(rewards, mask, uids)
        logp = tf.logprobs_from_logits(logits, labels)
        ent = tf.entropy_from_logits(logits)
        pg, metrics = core.get_policy_loss_fn("vanilla")(old, logp, a, mask, agg, cfg)
        ent_loss = core.agg_loss(ent, mask, agg)
        vf, vclip = core.compute_value_loss(vpred, ret, values, mask, 0.5, agg)
        total = pg - 0.01 * ent_loss + 0.5 * vf
        return total, metrics, tf.masked_mean(kld, mask, axis=-1)

    compare("verl", lambda: pipeline, logits, vpred)


@pytest.mark.parametrize(
    "algo,loss,fused",
    [
        ("ppo", "vanilla", False),
        ("ppo", "gspo", True),
        ("grpo", "clip_cov", True),
        ("grpo", "cispo", True),
    ],
)
def test_end_to_end_training(verl, algo, loss, fused):
    """bench/e2e_verl.py for a few iterations (use_fused_kernels: log-probs from the hidden
    states; registry losses): the same sampled data, the same losses step by step (1e-5), the same
    final parameters (1e-6 of their norm), every call of verl's functions replaced."""
    sys.path.insert(0, BENCH)
    import e2e_verl

    kw = dict(algo=algo, loss=loss, fused=fused, iters=3)
    u = e2e_verl.run(**kw)
    p = e2e_verl.run(patched=True, **kw)
    assert p.replaced > 0 and p.fallbacks == 0
    c = e2e_verl.compare(u, p)
    assert c["same_samples"]
    assert c["loss_abs"] <= 1e-5, (u.losses, p.losses)
    assert c["param_rel"] <= 1e-6, c
