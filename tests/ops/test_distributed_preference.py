"""The vocab-parallel linear_preference_loss on torch.distributed with gloo on the CPU: each case
spawns 2 or 3 processes (tests/support/dist_preference_workers.py) that compare against the
single-process op on the unsharded head, outputs NaN-poisoned: loss types, the reference given or
as a sharded head (beside the policy tile or in its own pass), first passes (pairs longer than a
block, a sorted type), explicit pairs, KTO, softcap, bf16 tiles; loss, statistics, per-row and
per-token outputs and every gradient; collectives counted; bad inputs on every rank."""

import pytest
import torch.distributed as dist
from support.dist_workers import spawn
from support.skips import requires_gloo

pytestmark = requires_gloo

ALL = "vocab_parallel_preference,vocab_parallel_preference_partial,vocab_parallel_preference_errors"


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_preference(world):
    spawn("dist_preference_workers.py", ALL, world)


def test_process_group_arguments():
    """The vocab-parallel arguments, checked before any collective."""
    import torch

    import ppo_kernels as pk

    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    y = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_start: needs process_group"):
        pk.linear_preference_loss(h, w, y, vocab_start=0)
    with pytest.raises(TypeError, match="reduce_hidden_grad"):
        pk.linear_preference_loss(h, w, y, reduce_hidden_grad="yes")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="process_group: torch.distributed is not init"):
            pk.linear_preference_loss(h, w, y, process_group=object())
