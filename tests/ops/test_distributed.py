"""Distributed forms on torch.distributed with gloo on the CPU: each case spawns 2-3 processes
(tests/support/dist_workers.py) that compare against the single-process op on the same data, outputs
NaN-poisoned: vocab-parallel token_logprobs (uneven and empty slices, ignore_index, temperature,
fp32 / bf16, both outputs' gradients), vocab-parallel linear_policy_loss (loss types, KL, entropy,
softcap, a sharded reference head, first passes, bypass mode; loss, stats and every gradient;
collectives counted; bad inputs), sequence-parallel GAE (a slice with no action, dones at a
slice border, per-token gamma, bootstrap on the last rank; packed rows spanning ranks, a rank
inside one row, row boundaries on rank borders), data-parallel masked_whiten / masked_mean (a rank
with no unmasked position), shapes that differ across ranks (a clear error on every rank), and
torch.compile of the distributed forms against eager."""

import pytest
import torch.distributed as dist
from support.dist_workers import spawn
from support.skips import requires_gloo

pytestmark = requires_gloo


ALL = (
    "vocab_parallel,vocab_parallel_linear,vocab_parallel_full_kl,sequence_parallel_gae,"
    "data_parallel_whiten,data_parallel_grpo,sequence_parallel_gae_packed,cross_rank_checks,"
    "vocab_parallel_layouts,vocab_parallel_device_checks,vocab_parallel_policy,"
    "vocab_parallel_policy_partial,vocab_parallel_policy_errors"
)


# one set of processes per world size (process start-up dominates on a small CPU)
@pytest.mark.parametrize(
    "cases,world",
    [
        (ALL + ",compile", 2),
        (ALL, 3),
        ("sequence_parallel_gae,sequence_parallel_gae_packed", 4),
    ],
)
def test_distributed(cases, world):
    spawn("dist_workers.py", cases, world)


def test_merge_states_matches_one_pass():
    """The merge of per-slice softmax states equals the statistics of the whole row."""
    import torch

    from ppo_kernels.distributed import merge_states
    from ppo_kernels.linear_logprobs import naive as R

    z = torch.randn(6, 40, dtype=torch.float64) * 5
    z[0, :13] = float("-inf")  # a slice of only -inf: the empty state
    z[1, 7] = float("nan")
    labels = torch.randint(0, 40, (6,))
    states = []
    for v0, v1 in ((0, 13), (13, 13), (13, 40)):
        st = torch.zeros(3, 6, dtype=torch.float64)
        st[0] = float("-inf")
        zl = torch.full((6,), float("nan"), dtype=torch.float64)
        R.tile_stats_(z[:, v0:v1].contiguous(), labels, v0, 1.0, -100, st, zl)
        states.append(st)
    whole = torch.zeros(3, 6, dtype=torch.float64)
    whole[0] = float("-inf")
    R.tile_stats_(
        z, labels, 0, 1.0, -100, whole, torch.full((6,), float("nan"), dtype=torch.float64)
    )
    merged = merge_states(torch.stack(states))
    lse_m = merged[0] + merged[1].log()
    lse_w = whole[0] + whole[1].log()
    torch.testing.assert_close(lse_m, lse_w, equal_nan=True)
    ent_m = merged[1].log() - merged[2] / merged[1]
    ent_w = whole[1].log() - whole[2] / whole[1]
    torch.testing.assert_close(ent_m, ent_w, equal_nan=True)


def test_vocab_parallel_ops_opcheck():
    """The registered ops of the vocab-parallel forms (what torch.compile traces) pass opcheck:
    schema, fake kernels, registered autograd; here on one rank's gathered states (world 1)."""
    import torch

    import ppo_kernels as pk
    import ppo_kernels.distributed  # noqa: F401  (registers the ops)

    ops = torch.ops.ppo_kernels
    g = torch.Generator().manual_seed(2)
    N, V, H = 4, 6, 3
    z, zr = torch.randn(N, V, generator=g), torch.randn(N, V, generator=g)
    h, w, b = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V)
    y = torch.randint(0, V, (N,), generator=g)  # every label owned: no NaN in the states

    def gathered(states):
        return torch.cat([torch.tensor([0.0, V, N, 0.0]), states.reshape(-1)]).view(1, -1)

    states = ops.vocab_parallel_states(z, y, 0, 0.7, -100)
    lin_states = ops.vocab_parallel_linear_states(h, w, y, b, 0, 0.7, -100, 0, "float32")
    kl_states = torch.stack(ops.full_kl(z, zr, 0.9, None)).reshape(1, -1)
    mask = torch.tensor([True, False, True, True])
    zg, zrg, hg, wg, bg = (t.clone().requires_grad_() for t in (z, zr, h, w, b))
    opcheck = torch.library.opcheck
    opcheck(torch.ops.ppo_kernels.vocab_parallel_states.default, (z, y, 0, 0.7, -100))
    opcheck(
        torch.ops.ppo_kernels.vocab_parallel_linear_states.default,
        (h, w, y, b, 0, 0.7, -100, 0, "float32"),
    )
    tl_args = (zg, y, gathered(states), 0, 0.7, -100, True)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_token_logprobs.default, tl_args)
    lin_args = (hg, wg, y, bg, gathered(lin_states), 0, 0.7, -100, True, 0, "float32", None)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_linear_token_logprobs.default, lin_args)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_full_kl.default, (zg, zrg, kl_states, mask, 0.9))
    # the backward ops on the forward's own outputs
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    with torch.no_grad():
        _, ent, lse, layout = ops.vocab_parallel_token_logprobs(*tl_args)
        _, lent, llse, llayout = ops.vocab_parallel_linear_token_logprobs(*lin_args)
    opcheck(
        torch.ops.ppo_kernels.vocab_parallel_token_logprobs_backward.default,
        (gl, ge, z, y, lse, ent, layout, 0.7, -100),
    )
    opcheck(
        torch.ops.ppo_kernels.vocab_parallel_linear_token_logprobs_backward.default,
        (gl, ge, h, w, y, b, llse, lent, llayout, 0.7, -100, 0, "float32", True, True, True),
    )
    # one rank holding the whole vocabulary is the single-device op
    lp, ent, _, layout = ops.vocab_parallel_token_logprobs(
        zg, y, gathered(states), 0, 0.7, -100, True
    )
    lp_w, ent_w = pk.token_logprobs(z, y, temperature=0.7, return_entropy=True)
    torch.testing.assert_close((lp, ent), (lp_w, ent_w))
    assert layout.tolist() == [0, V]


def test_linear_policy_loss_process_group_arguments():
    """The vocab-parallel arguments of linear_policy_loss, checked before any collective."""
    import torch

    import ppo_kernels as pk

    B, T, H, V = 2, 3, 4, 5
    args = (
        torch.randn(B, T, H),
        torch.randn(V, H),
        torch.zeros(B, T, dtype=torch.long),
        torch.randn(B, T),
        torch.randn(B, T),
        torch.ones(B, T, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="vocab_start: needs process_group"):
        pk.linear_policy_loss(*args, vocab_start=0)
    with pytest.raises(TypeError, match="reduce_hidden_grad"):
        pk.linear_policy_loss(*args, reduce_hidden_grad="yes")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="process_group: torch.distributed is not init"):
            pk.linear_policy_loss(*args, process_group=object())
