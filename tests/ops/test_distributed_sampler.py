"""The vocab-parallel forms with the rollout sampler's options on torch.distributed with gloo on
the CPU: each world size spawns its processes once (tests/support/dist_sampler_workers.py), which
compare against the single-process op on the gathered logits / the unsharded head, outputs
NaN-poisoned, uneven and empty slices: per-row and per-token temperature tensors in every
vocab-parallel form (token_logprobs, full_kl, linear_token_logprobs, linear_policy_loss,
linear_preference_loss); top_k / top_p / min_p under both samplers' rules in the same forms (ties across the slices' borders, the edges k = 1,
k >= V, p -> 0, p = 1, min_p = 1, per-row tensors, a NaN row, the statistics, gradients on the
kept set only, a fixed number of collectives, row blocks, mask_outside, torch.compile); bad
inputs raising on every rank."""

import pytest
from support.dist_workers import spawn
from support.skips import requires_gloo

pytestmark = requires_gloo

ALL = (
    "temperature_logits,temperature_linear,sampler_logits,sampler_full_kl,sampler_linear,"
    "sampler_policy,sampler_preference"
)


# one set of processes per world size (process start-up dominates on a small CPU)
@pytest.mark.parametrize("cases,world", [(ALL + ",sampler_compile", 2), (ALL, 3)])
def test_vocab_parallel_sampler(cases, world):
    spawn("dist_sampler_workers.py", cases, world)


def test_sampler_ops_opcheck():
    """The registered ops of the vocab-parallel sampler form and the per-row temperature
    arguments of the plain forms' ops pass opcheck (schema, fake kernels, registered autograd),
    on one rank's states (world 1)."""
    import torch

    import ppo_kernels.distributed  # noqa: F401  (registers the ops)
    from ppo_kernels.distributed import vocab_parallel_sampler as vs

    ops, opcheck = torch.ops.ppo_kernels, torch.library.opcheck
    g = torch.Generator().manual_seed(3)
    N, V, H = 4, 6, 3
    z, h, w = torch.randn(N, V, generator=g), torch.randn(N, H, generator=g), torch.randn(V, H)
    y = torch.randint(0, V, (N,), generator=g)
    ts = torch.rand(N, generator=g) + 0.5
    opcheck(torch.ops.ppo_kernels.vocab_parallel_states.default, (z, y, 0, 1.0, -100, ts))
    opcheck(
        torch.ops.ppo_kernels.vocab_parallel_linear_states.default,
        (h, w, y, None, 0, 1.0, -100, 0, "float32", ts),
    )
    m = z.amax(-1)
    inv_ts, lmp = 1.0 / ts, torch.full((N,), -2.0)
    floor = torch.full((N,), vs.NO_CUT, dtype=torch.long)
    prefix = torch.zeros(N, dtype=torch.long)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_max.default, (z, y))
    for first, mass in ((True, False), (False, True)):
        args = (z, m, inv_ts, lmp, floor, prefix, 24 if first else 16, first, mass)
        opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_hist.default, args)
    cut = vs.keys(z[:, 2])
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_ties.default, (z, cut))
    allow = torch.tensor([0.0, 1.0, float("inf"), 2.0], dtype=torch.float64)
    start = torch.tensor(0)
    sums = ops.vocab_parallel_sampler_states(z, y, start, m, inv_ts, lmp, cut, allow, -100)
    opcheck(
        torch.ops.ppo_kernels.vocab_parallel_sampler_states.default,
        (z, y, start, m, inv_ts, lmp, cut, allow, -100),
    )
    gathered = torch.cat([torch.tensor([0.0, V, N, 0.0]), m]).view(1, -1)
    fin = (z.clone().requires_grad_(), y, gathered, sums, m, inv_ts, lmp, cut, allow, 0, -100)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_finish.default, fin)
    with torch.no_grad():
        _, ent, log_s, outside, *_, layout = ops.vocab_parallel_sampler_finish(*fin)
    topk = (z, start, m, inv_ts, lmp, cut, allow, log_s, 3)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_topk.default, topk)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_topk.default, (*topk[:-1], V + 2))
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    bwd = (gl, ge, z, y, m, inv_ts, lmp, cut, allow, log_s, ent, outside, layout, -100)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_backward.default, bwd)
    # full_kl under the sampler: the reference's sums, the KL (differentiable in both), backward
    zr = torch.randn(N, V, generator=g)
    mr = zr.amax(-1)
    kl_args = (z, zr, m, mr, inv_ts, lmp, cut, allow)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_kl_sums.default, kl_args)
    kls = ops.vocab_parallel_sampler_kl_sums(*kl_args)
    mask = torch.tensor([True, False, True, True])
    zg, zrg = z.clone().requires_grad_(), zr.clone().requires_grad_()
    kl_in = (zg, zrg, sums, kls, m, mr, inv_ts, lmp, cut, allow, mask)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_kl.default, kl_in)
    with torch.no_grad():
        kl, ls, lsr = ops.vocab_parallel_sampler_kl(*kl_in)
    bwd = (gl, z, zr, m, mr, inv_ts, lmp, cut, allow, kl, ls, lsr, mask, True)
    opcheck(torch.ops.ppo_kernels.vocab_parallel_sampler_kl_backward.default, bwd)


def test_keys_keep_the_order():
    """The radix selection's keys order the floats as the floats order (ties: equal keys, -0.0
    and +0.0 alike), and key_values inverts them, in float32 and float64."""
    import torch

    from ppo_kernels.distributed.vocab_parallel_sampler import key_values, keys

    for dt in (torch.float32, torch.float64):
        x = torch.tensor(
            [-float("inf"), -3e38, -1.5, -0.0, 0.0, 1e-40, 2.0, 2.0, 3e38, float("inf")]
        )
        x = x.to(dt)
        k = keys(x)
        assert bool((k[1:] >= k[:-1]).all()) and int(k[3]) == int(k[4]) and int(k[6]) == int(k[7])
        assert bool((k[1:] != k[:-1])[[0, 1, 2, 4, 5, 7, 8]].all())
        torch.testing.assert_close(key_values(k, dt), x + 0.0)
