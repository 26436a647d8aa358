"""The typed configurations of the policy losses (ppo_kernels/losses/config.py): each checked once
when made, frozen, accepted by ppo_policy_loss and linear_policy_loss (and its vocab-parallel
form) as an object or as flat keyword arguments, with one list of names and defaults."""

import dataclasses
import inspect

import pytest
import torch
from support.skips import NO_GLOO

import ppo_kernels as pk
from ppo_kernels.losses import config as C

POLICY_FNS = {
    "ppo_policy_loss": (
        pk.ppo_policy_loss,
        ("loss_config", "aggregation_config", "rollout_config"),
    ),
    "linear_policy_loss": (
        pk.linear_policy_loss,
        ("loss_config", "aggregation_config", "rollout_config", "kl_config", "entropy_config"),
    ),
}


def _lp_inputs(seed=0, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = lp.detach() + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    return lp, old, adv, mask


def _head_inputs(seed=0, B=2, T=5, H=8, V=17):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    lab = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 3 - 1
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    return h, w, lab, adv, old, mask, ref


@pytest.mark.parametrize("name", sorted(POLICY_FNS))
def test_the_flat_arguments_are_the_config_fields_with_their_defaults(name):
    """One list of names and defaults: the signature's flat arguments are the fields of the
    configurations, with the classes' defaults (a changed default is one line of config.py)."""
    fn, params = POLICY_FNS[name]
    sig = inspect.signature(fn).parameters
    assert tuple(fn.config_params) == params
    assert all(cls in C.CONFIGS for cls in fn.config_params.values())
    for p in params:
        assert sig[p].default is None and sig[p].kind == inspect.Parameter.KEYWORD_ONLY
        for f in dataclasses.fields(fn.config_params[p]):
            assert sig[f.name].default == f.default, (p, f.name)
            assert sig[f.name].kind == inspect.Parameter.KEYWORD_ONLY


def test_flat_and_config_calls_are_bitwise_equal():
    lp, old, adv, mask = _lp_inputs()
    flat = {"loss_type": "dapo", "clip_low": 0.1, "clip_high": 0.28, "agg": "token-mean"}
    a_loss, a_st = pk.ppo_policy_loss(lp, old, adv, mask, **flat)
    (ga,) = torch.autograd.grad(a_loss, lp)
    b_loss, b_st = pk.ppo_policy_loss(
        lp, old, adv, mask,
        loss_config=pk.PolicyLossConfig("dapo", clip_low=0.1, clip_high=0.28),
        aggregation_config=pk.AggregationConfig(agg="token-mean"),
    )  # fmt: skip
    (gb,) = torch.autograd.grad(b_loss, lp)
    assert torch.equal(a_loss, b_loss) and torch.equal(ga, gb)
    assert a_st.keys() == b_st.keys() and all(torch.equal(a_st[k], b_st[k]) for k in a_st)


def test_linear_policy_loss_takes_every_config():
    h, w, lab, adv, old, mask, ref = _head_inputs()
    kw = dict(ref_logprobs=ref)
    flat = pk.linear_policy_loss(
        h, w, lab, adv, old, mask, loss_type="gspo", kl_coef=0.1, kl_estimator="k1",
        entropy_coef=0.01, agg="seq-mean-token-mean", **kw,
    )  # fmt: skip
    typed = pk.linear_policy_loss(
        h, w, lab, adv, old, mask,
        loss_config=pk.PolicyLossConfig("gspo"),
        kl_config=pk.KLTermConfig(kl_coef=0.1, kl_estimator="k1"),
        entropy_config=pk.EntropyTermConfig(0.01),
        aggregation_config=pk.AggregationConfig(agg="seq-mean-token-mean"),
        **kw,
    )  # fmt: skip
    assert torch.equal(flat[0], typed[0])
    for k in flat[1]:
        assert torch.equal(flat[1][k], typed[1][k]), k


@pytest.mark.parametrize("name", sorted(POLICY_FNS))
def test_a_config_and_its_fields_together_is_an_error(name):
    fn, _ = POLICY_FNS[name]
    args = _lp_inputs() if name == "ppo_policy_loss" else _head_inputs()[:6]
    with pytest.raises(TypeError, match="loss_config: give either loss_config= or its fields"):
        fn(*args, loss_config=pk.PolicyLossConfig(), clip_low=0.1)
    with pytest.raises(TypeError, match="loss_config: expected a PolicyLossConfig, got dict"):
        fn(*args, loss_config={"loss_type": "ppo"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'clip_lo'"):
        fn(*args, clip_lo=0.1)


@pytest.mark.parametrize(
    "cls, kw, match",
    [
        (C.PolicyLossConfig, {"loss_type": "nope"}, "loss_type"),
        (C.PolicyLossConfig, {"clip_low": -0.1}, "clip_low"),
        (C.PolicyLossConfig, {"clip_low": 1.5}, "clip_low"),
        (C.PolicyLossConfig, {"dual_clip": 0.5}, "dual_clip"),
        (C.PolicyLossConfig, {"loss_type": "gspo", "dual_clip": 3.0}, "dual_clip"),
        (C.PolicyLossConfig, {"loss_type": "gpg", "delta": 2.0}, "delta"),
        (C.PolicyLossConfig, {"loss_type": "dro"}, "dro_beta"),
        (C.PolicyLossConfig, {"loss_type": "gspo", "importance_sampling_level": "sequence"},
         "importance_sampling_level"),
        (C.PolicyLossConfig, {"kl_cov_ratio": 2.0}, "kl_cov_ratio"),
        (C.AggregationConfig, {"agg": "token-max"}, "agg"),
        (C.AggregationConfig, {"dp_size": 0}, "dp_size"),
        (C.AggregationConfig, {"global_num_tokens": -1.0}, "global_num_tokens"),
        (C.AggregationConfig, {"global_batch_size": torch.ones(2)}, "global_batch_size"),
        (C.AggregationConfig, {"loss_scale_factor": 0.0}, "loss_scale_factor"),
        (C.RolloutCorrectionConfig, {"rollout_is": "row"}, "rollout_is"),
        (C.RolloutCorrectionConfig, {"rollout_rs": "nope"}, "rollout_rs"),
        (C.RolloutCorrectionConfig, {"bypass_mode": "yes"}, "bypass_mode"),
        (C.KLTermConfig, {"kl_estimator": "k9"}, "estimator"),
        (C.KLTermConfig, {"kl_clamp": "tight"}, "clamp"),
        (C.KLTermConfig, {"kl_coef": float("nan")}, "kl_coef"),
        (C.EntropyTermConfig, {"entropy_coef": "0.1"}, "entropy_coef"),
    ],
)  # fmt: skip
def test_a_bad_value_is_an_error_naming_the_field_when_made(cls, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cls(**kw)


def test_configs_are_frozen_and_resolved_once():
    cfg = pk.PolicyLossConfig("gspo", clip_low=0.1)
    assert cfg.clip_high == 0.1 and cfg.log_ratio_clamp == 10.0  # resolved when made
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_low = 0.3
    # made from flat arguments once per distinct values (and types)
    assert C.make(C.PolicyLossConfig, clip_low=0.3) is C.make(C.PolicyLossConfig, clip_low=0.3)
    assert C.make(C.PolicyLossConfig, clip_low=0.3) == pk.PolicyLossConfig(clip_low=0.3)
    assert C.make(C.PolicyLossConfig, clip_low=0) is not C.make(C.PolicyLossConfig, clip_low=0.0)


def test_an_aggregation_with_a_tensor_total_is_not_remembered():
    t = torch.tensor(7.0)
    a = C.make(C.AggregationConfig, global_num_tokens=t, dp_size=2)
    b = C.make(C.AggregationConfig, global_num_tokens=t, dp_size=2)
    assert a is not b and a.global_num_tokens is t


def test_the_vocab_parallel_form_takes_the_configs(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip(NO_GLOO)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )
    try:
        h, w, lab, adv, old, mask, ref = _head_inputs(3)
        cfg = pk.PolicyLossConfig("grpo", clip_low=0.15)
        one = pk.linear_policy_loss(h, w, lab, adv, old, mask, loss_config=cfg)
        vp = pk.linear_policy_loss(
            h, w, lab, adv, old, mask, loss_config=cfg, process_group=dist.group.WORLD
        )
        torch.testing.assert_close(vp[0], one[0])
    finally:
        if own:
            dist.destroy_process_group()
