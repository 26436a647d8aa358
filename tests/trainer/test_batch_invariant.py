"""The trainer's --batch-invariant: the rollout is scored in --logprob-micro-batch
passes and updated in other passes, yet the first update's ratio is exactly 1 on every token
(first_logratio_max == 0; with one on-policy update per step, clip fraction and approx KL exactly
0), and runs with different micro-batch sizes give bitwise-equal metrics (written with every bit)
and bitwise-equal final weights. Without the mode the micro-batch sizes change the weights
(gradient accumulation in another order): the comparison can fail. Under the mode the update
runs passes of algos.ppo.INVARIANT_PASS_ROWS sequences whatever --micro-batch is."""

import json

import pytest
import torch

from ppo_kernels.trainer import ConfigError, TrainConfig
from ppo_kernels.trainer.algos import ppo
from ppo_kernels.trainer.config import config_from_args
from ppo_kernels.trainer.job import _check_data_parallel, run


def _run(tmp_path, name, algo, **kw):
    cfg = dict(
        algo=algo,
        vocab=64,
        hidden=32,
        layers=1,
        heads=2,
        sft_steps=5,
        sft_batch=8,
        prompts_per_step=4,
        group_size=2,
        minibatch_size=8,  # the whole rollout batch: one on-policy update per step
        ppo_epochs=1,
        ent_coef=0.01,  # a gradient from the first step (the untrained policy scores 0)
        max_new_tokens=12,
        eval_prompts=2,
        steps=2,  # the second step's rollout and update already run on a moved policy
        progress=False,
        plot=False,
        out=str(tmp_path / name),
        sft_cache=str(tmp_path / "sft"),
    )
    cfg.update(kw)
    run(TrainConfig(**cfg).validate(), log=lambda *a: None)
    with open(tmp_path / name / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        r.pop("seconds")
    actor = torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["trainer"]["actor"]
    return rows, actor


def _same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("pass_rows", [3, 32])
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_micro_batch_sizes_do_not_change_the_run(tmp_path, monkeypatch, algo, pass_rows):
    """pass_rows: the mode's sequences per update pass (the minibatch of 8 in passes of 3, 3 and
    2, or in one pass: the default), neither a micro-batch size of the runs compared."""
    monkeypatch.setattr(ppo, "INVARIANT_PASS_ROWS", pass_rows)
    a, wa = _run(tmp_path, "a", algo, batch_invariant=True, logprob_micro_batch=3, micro_batch=2)
    b, wb = _run(tmp_path, "b", algo, batch_invariant=True)  # no micro-batches
    c, wc = _run(tmp_path, "c", algo, batch_invariant=True, logprob_micro_batch=1, micro_batch=5)
    assert a == b == c
    assert _same_weights(wa, wb) and _same_weights(wa, wc)
    for r in a:
        assert r["first_logratio_max"] == 0.0
        assert r["clipfrac"] == 0.0 and r["approx_kl"] == 0.0
    assert all(r["actor_grad_norm"] > 0 for r in a)  # the updates do move the policy
    assert a[-1]["kl"] != 0  # the policy left the Reference


def test_without_the_mode_the_micro_batches_change_the_weights(tmp_path):
    _, wa = _run(tmp_path, "a", "grpo", logprob_micro_batch=3, micro_batch=2)
    _, wb = _run(tmp_path, "b", "grpo")
    assert not _same_weights(wa, wb)


def test_flags():
    cfg, _ = config_from_args(
        ["--batch-invariant", "--logprob-micro-batch", "3", "--micro-batch", "2"]
    )
    assert cfg.batch_invariant and cfg.logprob_micro_batch == 3 and cfg.micro_batch == 2
    with pytest.raises(ConfigError, match="--micro-batch"):
        TrainConfig(micro_batch=-1).validate()
    with pytest.raises(ConfigError, match="--logprob-micro-batch"):
        TrainConfig(logprob_micro_batch=-2).validate()
    # data parallel: not yet
    with pytest.raises(ConfigError, match="one process"):
        _check_data_parallel(TrainConfig(batch_invariant=True).validate(), 2)
