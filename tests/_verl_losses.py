"""verl's loss modules and configs for the tests that call its policy-loss registry and rollout
correction (tests/test_policy_losses.py, tests/test_integrations_verl_losses.py)."""

from __future__ import annotations

import contextlib
import types

from _peer_stubs import import_peer


class DataProtoStandIn:  # verl's DataProto needs tensordict; the helper only wraps the weights
    def __init__(self, batch):
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors):
        return cls(dict(tensors))


@contextlib.contextmanager
def verl_loss_modules():
    """core_algos, rollout_corr_helper (its DataProto stood in for), the actor and algorithm
    config modules, as a namespace (core, rch, actor, algo); skips where verl is not installed."""
    core = import_peer("verl.trainer.ppo.core_algos")
    rch = import_peer("verl.trainer.ppo.rollout_corr_helper")
    actor = import_peer("verl.workers.config.actor")
    algo = import_peer("verl.trainer.config.algorithm")
    saved = rch.DataProto
    rch.DataProto = DataProtoStandIn
    try:
        yield types.SimpleNamespace(core=core, rch=rch, actor=actor, algo=algo)
    finally:
        rch.DataProto = saved


def actor_config(verl, mode, info=None, rollout_correction=None, clip_ratio_c=3.0, **policy):
    """verl's ActorConfig for loss `mode`: clip range 0.15 / 0.28, SAPO's tau 1.0 / 1.3,
    PolicyLossConfig(**policy) (verl's defaults otherwise), `rollout_correction` a
    RolloutCorrectionConfig or its keywords, `info` the global batch info."""
    if isinstance(rollout_correction, dict):
        rollout_correction = verl.algo.RolloutCorrectionConfig(**rollout_correction)
    if rollout_correction is not None:
        policy["rollout_correction"] = rollout_correction
    return verl.actor.ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        clip_ratio_c=clip_ratio_c,
        tau_pos=1.0,
        tau_neg=1.3,
        policy_loss=verl.actor.PolicyLossConfig(loss_mode=mode, **policy),
        global_batch_info=dict(info or {}),
    )
