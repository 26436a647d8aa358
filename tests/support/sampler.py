"""Shared by the sampler's tests (tests/ops/test_sampler.py, tests/properties/test_sampler.py,
tests/simt/test_sampler.py): token_logprobs under the distribution a rollout engine sampled from,
against float64 references written from docs/ppo-math.md ("The distribution the rollout sampled
from"), token by token (no sort)."""

import functools
import math

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend

from .simt import emulated, launches
from .utils import GRAD_TOL

ops = torch.ops.ppo_kernels
STATS = ("outside", "sum_p2", "lse", "topk", "is_argmax")


# ---- a float64 reference written from the documented rules, token by token (no sort) ----


@functools.lru_cache(maxsize=16)
def rank_order(x):
    """A row's ids in rank order (decreasing logit, ties by index); x a tuple of floats (cached:
    the tests check one row under many settings)."""
    return sorted(range(len(x)), key=lambda j: (-x[j], j))


@functools.lru_cache(maxsize=16)
def _probs(x, T):
    z = [v / T for v in x]
    zmax = max(z)
    w = [math.exp(v - zmax) if v > -math.inf else 0.0 for v in z]
    S = sum(w)
    return [v / S for v in w]


def brute_kept(x, T, k, p, mp, sampler):
    """The kept set of one row (a tuple of floats) straight from docs/ppo-math.md, in Python
    floats: prefix masses over the rank order (decreasing logit, ties by index)."""
    x = tuple(x)
    V = len(x)
    prob = _probs(x, T)
    pmax = max(prob)
    minp_keep = [prob[j] >= mp * pmax for j in range(V)]
    k_on = 0 < k < V
    p_on = p < 1
    order = rank_order(x)
    if sampler == "vllm":
        A = [j for j in order if minp_keep[j]]
        B = A
        if k_on and len(A) > k:
            vk = x[A[k - 1]]
            B = [j for j in A if x[j] >= vk]
        if not p_on:
            return set(B)
        SB = sum(prob[j] for j in B)
        kept, above, i = set(), 0.0, 0
        while i < len(B):  # whole tie groups: the mass strictly above their value decides
            g = [B[i]]
            while i + len(g) < len(B) and x[B[i + len(g)]] == x[B[i]]:
                g.append(B[i + len(g)])
            if above / SB < p:
                kept.update(g)
            above += sum(prob[j] for j in g)
            i += len(g)
        return kept
    kept, excl = set(), 0.0
    for r, j in enumerate(order):
        if (not k_on or r < k) and (not p_on or excl <= p) and minp_keep[j]:
            kept.add(j)
        excl += prob[j]
    return kept


def top_p_kept(x, ps, sampler):
    """Top-p alone at temperature 1 for one row (a float64 tensor) at each p of `ps`: [len(ps), V]
    kept masks by brute_kept's rules, vectorised (one sort of the row for every p: brute_kept is
    too slow for the thousands of settings a tie-group test needs; a test checks the two agree).
    vLLM keeps a tie group while the mass strictly above its value is below p; SGLang a token
    while the mass ranked before it is at most p."""
    V = x.numel()
    order = torch.sort(-x, stable=True).indices  # rank order: a stable sort keeps ties by index
    xs = x[order]
    pr = torch.softmax(x, 0)[order]
    excl = torch.cumsum(pr, 0) - pr
    if sampler == "vllm":
        first = torch.ones(V, dtype=torch.bool)
        first[1:] = xs[1:] != xs[:-1]
        group = torch.cumsum(first.long(), 0) - 1
        excl = excl[torch.nonzero(first).flatten()][group]
    p = torch.as_tensor(ps, dtype=torch.float64).unsqueeze(-1)
    keep_sorted = excl < p if sampler == "vllm" else excl <= p
    kept = torch.zeros(len(ps), V, dtype=torch.bool)
    kept[:, order] = keep_sorted
    return kept


def rows_of(t, n):
    return [float(v) for v in t.reshape(n)] if t.dim() else [float(t)] * n


def kept_from_cut(logits, cut, cut_index):
    V = logits.shape[-1]
    x = logits.double()
    j = torch.arange(V)
    c = cut.double().unsqueeze(-1)
    return (x > c) | ((x == c) & (j <= cut_index.unsqueeze(-1)))


def sampler_op(logits, labels, T=1.0, k=0, p=1.0, mp=0.0, sampler="vllm", temps=None, ks=None,
               ps=None, mps=None, ignore_index=-100, entropy=True, stats_top_k=0):  # fmt: skip
    return ops.token_logprobs_sampler(
        logits, labels, T, temps, k, ks, p, ps, mp, mps, sampler, ignore_index, entropy, True,
        True, stats_top_k, True,
    )  # fmt: skip


def inputs(N, V, dtype=torch.float32, scale=2.0, ignore_frac=0.0):
    logits = (torch.randn(N, V) * scale).to(dtype)
    labels = torch.randint(0, V, (N,))
    labels[torch.rand(N) < ignore_frac] = -100
    return logits, labels


def check_against_truth(logits, labels, T, k, p, mp, sampler, outs, rel=1e-4):
    """The kernel's kept set lies between the documented sets at p / min_p nudged by `rel` (the
    float32 rounding of the masses), exactly for top-k; log-probs, entropy and the statistics
    equal the float64 values on the kernel's own kept set."""
    N, V = logits.shape
    lp, ent, lse, cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax = outs
    kept = kept_from_cut(logits, cut, cut_index)
    Ts, ks_, ps_, mps_ = (rows_of(torch.as_tensor(v), N) for v in (T, k, p, mp))
    x64 = logits.double()
    for r in range(N):
        if int(labels[r]) == -100:
            assert lp[r] == 0 and (ent.numel() == 0 or ent[r] == 0) and not outside[r]
            continue
        row = tuple(float(v) for v in x64[r])
        kk, pp, mm = int(ks_[r]), ps_[r], mps_[r]
        inner = brute_kept(row, Ts[r], kk, pp * (1 - rel), min(1.0, mm * (1 + rel)), sampler)
        outer = brute_kept(row, Ts[r], kk, min(1.0, pp * (1 + rel)), mm * (1 - rel), sampler)
        got = set(torch.nonzero(kept[r]).flatten().tolist())
        assert inner <= got <= outer, (r, sorted(inner), sorted(got), sorted(outer))
        z = x64[r] / Ts[r]
        zk = torch.where(kept[r], z, torch.full_like(z, -math.inf))
        lsk = torch.logsumexp(zk, 0)
        q = torch.exp(zk - lsk)
        lab = int(labels[r])
        want_lp = (z[lab] - lsk).item() if kept[r, lab] else -math.inf
        assert bool(outside[r]) == (not bool(kept[r, lab]))
        if want_lp == -math.inf:
            assert lp[r] == -math.inf
        else:
            assert abs(lp[r].item() - want_lp) <= 5e-5 + 2e-5 * abs(want_lp), (r, lp[r], want_lp)
        h = -(q[q > 0] * torch.log(q[q > 0])).sum().item()
        if ent.numel():  # (asked for: with_entropy)
            assert abs(ent[r].item() - h) <= 5e-5 + 2e-5 * h, (r, ent[r], h)
        assert abs(lse[r].item() - lsk.item()) <= 5e-5 + 2e-5 * abs(lsk.item())
        assert abs(sum_p2[r].item() - (q * q).sum().item()) <= 2e-5
        fl = torch.logsumexp(z, 0).item()
        assert abs(full_lse[r].item() - fl) <= 5e-5 + 2e-5 * abs(fl)
        assert bool(is_argmax[r]) == bool(x64[r, lab] == x64[r].max())
        if top_ids.numel():
            K = top_ids.shape[-1]
            order = rank_order(row)[:K]
            assert top_ids[r].tolist() == order
            for i, j in enumerate(order):
                want = (z[j] - lsk).item() if kept[r, j] else -math.inf
                got_lp = top_lp[r, i].item()
                assert (got_lp == want) if want == -math.inf else abs(got_lp - want) < 1e-4


def kl64(x, y, T, mask=None):
    """KL(softmax(x / T) || softmax(y / T)) per row in float64, T per row ([..., 1])."""
    lp = torch.log_softmax(x.double() / T, -1)
    lq = torch.log_softmax(y.double() / T, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl if mask is None else torch.where(mask, kl, torch.zeros_like(kl))


# ---- the CUDA kernels under the SIMT emulator (tests/simt) ----


def simt_case(seed, dtype, N, V, settings, strided=False, max_row_blocks=1 << 20):
    """Forward (every output) and backward of the emulated CUDA kernels against the rules and the
    float64 values on their kept set, outputs NaN-poisoned."""
    if strided:
        logits = (torch.randn(N, 2, V) * 2).to(dtype)[:, 0]
    else:
        logits = (torch.randn(N, V) * 2).to(dtype)
    labels = torch.randint(0, V, (N,))
    labels[::3] = -100  # rows 0, 3, ...: the others are checked (N // 3 was 1 for N < 6: none)
    assert (labels != -100).any()
    for T, k, p, mp, sampler in settings:
        with emulated(seed, max_row_blocks=max_row_blocks, token_logprobs="cpp"):
            outs = sampler_op(logits, labels, T, k, p, mp, sampler, stats_top_k=min(V, 5))
            x = logits.clone().requires_grad_(True)
            lp, ent = pk.token_logprobs(
                x, labels, temperature=T, top_k=k, top_p=p, min_p=mp, sampler=sampler,
                return_entropy=True,
            )  # fmt: skip
            g = torch.randn(N)
            (torch.where(torch.isfinite(lp), lp, 0) * g + ent).sum().backward()
            names = [e.split()[0] + " " + e.split()[1] for e in launches()]
        assert names == [
            "token_logprobs_sampler fwd_kernel",
            "token_logprobs_sampler fwd_kernel",
            "token_logprobs_sampler bwd_kernel",
        ], names
        check_against_truth(logits.float(), labels, T, k, p, mp, sampler, outs)
        with use_backend("eager"):
            x64 = logits.double().requires_grad_(True)
            lp64, ent64 = pk.token_logprobs(
                x64, labels, temperature=T, top_k=k, top_p=p, min_p=mp, sampler=sampler,
                return_entropy=True,
            )  # fmt: skip
            (torch.where(torch.isfinite(lp64), lp64, 0) * g.double() + ent64).sum().backward()
        same = torch.isfinite(lp) == torch.isfinite(lp64)  # rows whose kept sets agree
        torch.testing.assert_close(
            x.grad[same].double(), x64.grad[same], **GRAD_TOL[dtype], equal_nan=True
        )


SIMT_SETTINGS = [
    (0.7, 5, 1.0, 0.0, "vllm"),
    (1.0, 0, 0.8, 0.02, "vllm"),
    (1.3, 20, 0.9, 0.0, "sglang"),
    (1.0, 0, 0.5, 0.1, "sglang"),
]
