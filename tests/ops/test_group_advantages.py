"""grpo_advantages / rloo_advantages on every backend available for CPU tensors here (cpp, Triton
through the interpreter, eager) against a literal per-group loop written from verl's documented
semantics, against verl's real functions where its source is available (tests/support/peers.py), TRL's
group normalisation, and through opcheck and torch.compile."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from support.peers import load_verl
from support.skips import need_backend
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend

BACKENDS = cpu_backends("group_advantages")
TOL = dict(atol=1e-6, rtol=1e-5)


def lit_grpo(scores, index, eps=1e-6, norm=True):
    """verl's compute_grpo_outcome_advantage, literally: a loop over groups, torch.std (unbiased),
    singleton groups with mean 0 and std 1. float64."""
    scores = scores.double()
    groups = defaultdict(list)
    for i, g in enumerate(index.tolist()):
        groups[g].append(scores[i])
    stats = {}
    for g, v in groups.items():
        t = torch.stack(v)
        stats[g] = (
            (torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
            if len(v) == 1
            else (t.mean(), t.std())
        )
    out = torch.empty_like(scores)
    for i, g in enumerate(index.tolist()):
        m, s = stats[g]
        out[i] = (scores[i] - m) / (s + eps) if norm else scores[i] - m
    return out


def lit_rloo(scores, index):
    """R_i - mean of the other members; a singleton keeps its score (verl's `rloo`). float64."""
    scores = scores.double()
    out = scores.clone()
    idx = index.tolist()
    for i, g in enumerate(idx):
        others = [scores[j] for j, h in enumerate(idx) if h == g and j != i]
        if others:
            out[i] = scores[i] - torch.stack(others).mean()
    return out


def _index(B, n_groups):
    """Random group ids in [0, B), including singletons and an unused id range."""
    ids = torch.randint(0, n_groups, (B,))
    perm = torch.randperm(B)[:n_groups]  # map to scattered ids in [0, B)
    return perm[ids]


def _run(backend, fn, *args, **kw):
    with use_backend(group_advantages=backend), poisoned():
        return fn(*args, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_by_index(backend, dtype, norm):
    B = 37
    scores = (torch.randn(B) * 2).to(dtype)
    index = _index(B, 9)
    index[-1] = B - 1  # a singleton group with the largest id
    index[:-1][index[:-1] == B - 1] = 0
    got = _run(backend, pk.grpo_advantages, scores, index, norm_by_std=norm)
    assert got.dtype == torch.float32 and got.shape == (B,)
    torch.testing.assert_close(got.double(), lit_grpo(scores, index, norm=norm), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("G", [1, 4, 5])
def test_grpo_rloo_by_group_size_with_mask(backend, G):
    B, T = 20, 13
    scores = torch.randint(0, 2, (B,)).float()  # 0/1 verifier rewards: many equal-score groups
    scores[B - G :] = torch.randn(G)
    mask = torch.rand(B, T) > 0.4
    index = torch.arange(B) // G
    got = _run(backend, pk.grpo_advantages, scores, group_size=G, mask=mask, eps=1e-4)
    want = lit_grpo(scores, index, eps=1e-4)[:, None] * mask.double()
    assert got.shape == (B, T)
    torch.testing.assert_close(got.double(), want, **TOL)
    got = _run(backend, pk.rloo_advantages, scores, group_size=G, mask=mask.float())
    torch.testing.assert_close(
        got.double(), lit_rloo(scores, index)[:, None] * mask.double(), **TOL
    )
    got = _run(backend, pk.rloo_advantages, scores, index, mask=mask.to(torch.int64))
    torch.testing.assert_close(
        got.double(), lit_rloo(scores, index)[:, None] * mask.double(), **TOL
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_rloo_by_index(backend):
    B = 29
    scores = torch.randn(B)
    index = _index(B, 7)
    got = _run(backend, pk.rloo_advantages, scores, index)
    torch.testing.assert_close(got.double(), lit_rloo(scores, index), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_singleton_and_equal_score_groups(backend):
    """Documented: a singleton gives R / (1 + eps) (GRPO; R without std) and R (RLOO); a group of
    equal scores gives exactly 0, even for scores like 0.1 whose float32 mean is inexact."""
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 2.5, 0.3, 0.3, -4.0])
    index = torch.tensor([0, 0, 0, 3, 4, 5, 5, 7])
    g = _run(backend, pk.grpo_advantages, scores, index)
    assert torch.isfinite(g).all()
    assert torch.equal(g[[0, 1, 2, 5, 6]], torch.zeros(5))
    torch.testing.assert_close(g[[3, 4, 7]], scores[[3, 4, 7]] / (1 + 1e-6))
    g = _run(backend, pk.grpo_advantages, scores, index, norm_by_std=False)
    assert torch.equal(g[[0, 1, 2, 5, 6]], torch.zeros(5)) and torch.equal(
        g[[3, 4, 7]], scores[[3, 4, 7]]
    )
    r = _run(backend, pk.rloo_advantages, scores, index)
    assert torch.equal(r[[0, 1, 2, 5, 6]], torch.zeros(5)) and torch.equal(
        r[[3, 4, 7]], scores[[3, 4, 7]]
    )
    # all-zero mask rows, empty batch
    out = _run(backend, pk.grpo_advantages, scores, index, mask=torch.zeros(8, 5, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(8, 5))
    assert _run(backend, pk.grpo_advantages, scores[:0], group_size=4).shape == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_and_float16_inputs(backend):
    scores = torch.randn(12, dtype=torch.float64)
    got = _run(backend, pk.grpo_advantages, scores, group_size=3)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, lit_grpo(scores, torch.arange(12) // 3), atol=1e-12, rtol=1e-12)
    got = _run(backend, pk.grpo_advantages, scores.half(), group_size=3)
    torch.testing.assert_close(got.double(), lit_grpo(scores.half(), torch.arange(12) // 3), **TOL)


def test_argument_errors():
    s = torch.randn(8)
    with pytest.raises(ValueError, match="exactly one"):
        pk.grpo_advantages(s)
    with pytest.raises(ValueError, match="exactly one"):
        pk.grpo_advantages(s, torch.zeros(8, dtype=torch.long), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        pk.grpo_advantages(s, group_size=3)
    with pytest.raises(IndexError, match="group_index"):
        pk.grpo_advantages(s, torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]))
    with pytest.raises(IndexError, match="group_index"):
        pk.rloo_advantages(s, torch.tensor([0, 1, 2, 3, 4, 5, 6, -1]))
    with pytest.raises(TypeError, match="group_index"):
        pk.grpo_advantages(s, torch.zeros(8))
    with pytest.raises(ValueError, match="mask"):
        pk.grpo_advantages(s, group_size=2, mask=torch.ones(7, 3))
    with pytest.raises(ValueError, match="scores"):
        pk.grpo_advantages(s.view(2, 4), group_size=2)


def test_triton_out_of_range_index_gives_nan():
    """The GPU path never reads out of bounds and cannot raise without a host sync: NaN rows."""
    need_backend("group_advantages", "triton")
    from ppo_kernels.group_advantages import triton_kernels

    s = torch.randn(6)
    idx = torch.tensor([0, 0, 1, 1, 9, -3])
    out = triton_kernels.group_advantages(s, idx, 0, 1e-6, True, 0, None)
    assert torch.isnan(out[4:]).all() and torch.isfinite(out[:4]).all()
    torch.testing.assert_close(out[:4].double(), lit_grpo(s[:4], idx[:4]), **TOL)


def test_gradient_is_not_tracked():
    s = torch.randn(8, requires_grad=True)
    out = pk.grpo_advantages(s, group_size=4)
    assert not out.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    s = torch.randn(12)
    idx = torch.tensor([0, 0, 1, 1, 1, 5, 6, 6, 6, 6, 2, 2])
    mask = torch.rand(12, 5) > 0.5
    with use_backend(backend):
        for args in (
            (s, idx, 0, 1e-6, True, "grpo", None),
            (s, None, 3, 1e-6, False, "grpo", mask),
            (s, idx, 0, 0.0, False, "rloo", mask.float()),
        ):
            torch.library.opcheck(torch.ops.ppo_kernels.group_advantages.default, args)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    s = torch.randn(16)
    mask = torch.rand(16, 7) > 0.5

    def f(s, mask):
        return pk.grpo_advantages(s, group_size=4, mask=mask) + pk.rloo_advantages(
            s, group_size=4, mask=mask
        )

    torch.testing.assert_close(
        torch.compile(f, fullgraph=True, backend="aot_eager")(s, mask), f(s, mask)
    )


# ----------------------------------------------------------------------------- peers
def test_parity_with_verl_functions():
    verl = load_verl()
    B, T = 24, 10
    scores = torch.randn(B)
    scores[:4] = 1.0  # an equal-score group
    index = torch.tensor([0] * 4 + [1] * 6 + [2] + [3] * 5 + [4] * 8)
    mask = (torch.rand(B, T) > 0.3).float()
    rewards = torch.zeros(B, T)
    rewards[:, -1] = scores  # verl sums token-level rewards into the score
    for norm in (True, False):
        want, _ = verl.compute_grpo_outcome_advantage(
            rewards, mask, np.array(index.tolist()), 1e-6, norm
        )
        for backend in BACKENDS:
            got = _run(backend, pk.grpo_advantages, scores, index, norm_by_std=norm, mask=mask)
            torch.testing.assert_close(got, want, **TOL)
    want, _ = verl.compute_rloo_outcome_advantage(rewards, mask, np.array(index.tolist()))
    for backend in BACKENDS:
        torch.testing.assert_close(
            _run(backend, pk.rloo_advantages, scores, index, mask=mask), want, **TOL
        )
    # verl's vectorised helper: same statistics for the non-singleton groups
    mean_g, std_g, _ = verl.group_mean_std(scores, index, eps=0.0)
    multi = torch.bincount(index)[index] > 1
    want = ((scores - mean_g[index]) / (std_g[index] + 1e-6))[multi]
    torch.testing.assert_close(pk.grpo_advantages(scores, index)[multi], want, **TOL)


def test_trl_group_normalisation():
    """TRL's GRPOTrainer (scale_rewards="group"): rewards.view(-1, G), torch.std (unbiased),
    (r - mean) / (std + 1e-4): grpo_advantages(group_size=G, eps=1e-4)."""
    G = 8
    r = torch.randn(6 * G)
    r[:G] = 0.5
    mean = r.view(-1, G).mean(1).repeat_interleave(G)
    std = r.view(-1, G).std(1).repeat_interleave(G)
    want = torch.nan_to_num((r - mean) / (std + 1e-4), nan=0.0)
    for backend in BACKENDS:
        torch.testing.assert_close(
            _run(backend, pk.grpo_advantages, r, group_size=G, eps=1e-4), want, **TOL
        )


def test_group_ids_from_labels_and_rloo_singletons():
    """verl passes prompt uid strings: equal labels form a group; rloo's singleton convention."""
    import numpy as np

    uids = np.array(["b", "a", "b", "c", "a"], dtype=object)
    ids = pk.group_advantages.api.group_ids(uids)
    assert ids.tolist() == [1, 0, 1, 2, 0]
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0])
    torch.testing.assert_close(pk.grpo_advantages(scores, uids), pk.grpo_advantages(scores, ids))
    torch.testing.assert_close(
        pk.rloo_advantages(scores, list(uids)), torch.tensor([-2.0, -4.0, 2.0, 4.0, 4.0])
    )
    torch.testing.assert_close(
        pk.rloo_advantages(scores, uids, singleton="zero"),
        torch.tensor([-2.0, -4.0, 2.0, 0.0, 4.0]),
    )
    with pytest.raises(ValueError, match="singleton"):
        pk.rloo_advantages(scores, uids, singleton="drop")
    with pytest.raises(ValueError, match="group_index"):
        pk.grpo_advantages(scores, np.zeros((5, 1)))
