"""What the trainer's command line keeps, without training: when a checkpoint is written
(trainer/checkpoint.py)."""

import pytest

from ppo_kernels.trainer import TrainConfig, checkpoint


@pytest.mark.parametrize(
    "kw, due",
    [
        (dict(steps=5), [4]),
        (dict(steps=5, save_every=2), [1, 3, 4]),
        (dict(steps=5, save_every=2, checkpoint=False), []),
        (dict(steps=5, checkpoint=False), []),
    ],
)
def test_checkpoint_is_written_at_the_end_and_every_save_every(kw, due):
    cfg = TrainConfig(**kw).validate()
    assert [s for s in range(cfg.steps) if checkpoint.due(cfg, s)] == due
