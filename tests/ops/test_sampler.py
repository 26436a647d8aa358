"""token_logprobs under the distribution a rollout engine sampled from (temperature, min-p, top-k,
top-p; vLLM's and SGLang's rules) and the head's statistics, on every backend available for CPU
tensors (cpp, Triton through the interpreter, eager) against float64 references written from
docs/ppo-math.md ("The distribution the rollout sampled from")."""

import itertools
import math

import pytest
import torch
from support.sampler import (
    STATS,
    brute_kept,
    check_against_truth,
    inputs,
    kept_from_cut,
    kl64,
    ops,
    sampler_op,
    top_p_kept,
)
from support.skips import NO_EXTENSION
from support.utils import GRAD_TOL, cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import _backend, use_backend
from ppo_kernels.token_logprobs import naive as ref

BACKENDS = cpu_backends("token_logprobs")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _sized(sizes, most):
    """(backend, V) pairs: the Triton interpreter runs a kernel's search passes element by
    element, so its cases run at V = `most` only (the cpp and eager backends run them all)."""
    return [(b, V) for b in BACKENDS for V in sizes if b != "triton" or V == most]


SETTINGS = [
    # (T, top_k, top_p, min_p)
    (1.0, 5, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 0, 1.0, 0.05),
    (0.8, 20, 0.95, 0.02),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 0.3, 0.0),
    (0.5, 3, 0.5, 0.5),
    (1.0, 0, 1.0, 1.0),
    (2.0, 100, 1.0, 0.0),
]


@pytest.mark.parametrize("backend,V", _sized([7, 50, 2500], 50))
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_kept_set_and_outputs_follow_the_rules(backend, V, sampler, setting):
    T, k, p, mp = setting
    # (the interpreter runs a program per row: 6 rows there); the last row ignored
    logits, labels = inputs(12 if backend != "triton" else 6, V, ignore_frac=0.2)
    labels[-1] = -100
    with use_backend(backend), poisoned():
        outs = sampler_op(logits, labels, T, k, p, mp, sampler, stats_top_k=min(V, 6))
    check_against_truth(logits, labels, T, k, p, mp, sampler, outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_per_row_parameters(backend, sampler):
    N, V = (16 if backend != "triton" else 8), 300  # (the interpreter: a program per row)
    logits, labels = inputs(N, V, ignore_frac=0.1)
    T = torch.rand(N) + 0.5
    k = torch.randint(0, 40, (N,))
    p = torch.rand(N) * 0.8 + 0.2
    p[::3] = 1.0
    mp = torch.rand(N) * 0.2
    mp[::2] = 0.0
    with use_backend(backend), poisoned():
        outs = sampler_op(logits, labels, 1.0, 0, 1.0, 0.0, sampler, T, k, p, mp, stats_top_k=4)
    check_against_truth(logits, labels, T, k, p, mp, sampler, outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_ties(backend, sampler):
    """Tied logits at every boundary: the k-th value, the top-p crossing, the min-p bound."""
    N, V = (4 if backend == "triton" else 24), 40  # (the interpreter: element by element)
    logits = torch.randint(-3, 4, (N, V)).float()  # many ties
    labels = torch.randint(0, V, (N,))
    for k, p, mp in [(3, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.3), (5, 0.7, 0.1), (1, 1.0, 0.0)]:
        with use_backend(backend), poisoned():
            outs = sampler_op(logits, labels, 1.0, k, p, mp, sampler, stats_top_k=8)
        check_against_truth(logits, labels, 1.0, k, p, mp, sampler, outs)


@pytest.mark.parametrize("backend,V", _sized([33, 4099, 32000], 33))
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_sizes(backend, V, dtype):
    logits, labels = inputs(4, V, dtype, scale=3.0, ignore_frac=0.2)
    for sampler in ("vllm", "sglang"):
        with use_backend(backend), poisoned():
            outs = sampler_op(logits, labels, 0.9, 40, 0.9, 0.01, sampler, stats_top_k=5)
        check_against_truth(logits.float(), labels, 0.9, 40, 0.9, 0.01, sampler, outs)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "cpp"])
def test_flat_and_peaked_rows(backend):
    """Rows where top-p keeps most of a large vocabulary, and rows where it keeps one token: the
    band estimates of the CPU kernel miss on purpose in some of them (its exact fallback). Too
    large for the Triton interpreter; the eager backend (a sort and a cumulative sum, the same
    code at any V) meets these rules in the cases above and at V = 32000 in
    test_dtypes_and_sizes."""
    V = 20000
    flat = torch.randn(3, V) * 0.3
    peaked = torch.randn(3, V)
    peaked[:, 7] = 40.0
    big_k = torch.randn(2, V) * 2
    logits = torch.cat([flat, peaked, big_k])
    labels = torch.randint(0, V, (8,))
    settings = [(0, 0.9, 0.0), (0, 0.999, 0.0), (5000, 0.95, 0.0), (0, 0.5, 0.001), (0, 1e-6, 0.0)]
    for sampler, entropy in itertools.product(("vllm", "sglang"), (True, False)):
        for k, p, mp in settings:
            with use_backend(backend), poisoned():
                outs = sampler_op(logits, labels, 1.0, k, p, mp, sampler, entropy=entropy)
            check_against_truth(logits, labels, 1.0, k, p, mp, sampler, outs)


@pytest.mark.parametrize("k", [1, 50, 256, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_from_the_statistics_pass(k, dtype):
    """The CPU kernel finds a top-k of at most 256 among the tokens its statistics pass collects
    (those at or above a bound on the k-th largest, raised as the pass reads the row); 257 takes
    the band pass. Rows whose every token raises the bound (ascending), whose first tokens are the
    top k (descending), with ties at the k-th value spread over every block (kept whole by vLLM,
    by id by SGLang), and random; with top-p and min-p cutting inside the top k, and the top
    ids."""
    V = 5000
    g = torch.Generator().manual_seed(k)
    asc = torch.linspace(-3.0, 3.0, V)
    ties = torch.randint(-3, 3, (V,), generator=g).float()
    rows = torch.stack([asc, asc.flip(0), ties, torch.randn(V, generator=g) * 2])
    logits = rows.to(dtype)
    labels = torch.cat([logits.float().argmax(-1)[:2], torch.randint(0, V, (2,), generator=g)])
    for sampler in ("vllm", "sglang"):
        for p, mp in [(1.0, 0.0), (0.9, 0.0), (1.0, 0.2), (0.95, 0.02)]:
            with use_backend("cpp"), poisoned():
                outs = sampler_op(logits, labels, 1.0, k, p, mp, sampler, stats_top_k=min(k, 20))
            check_against_truth(logits.float(), labels, 1.0, k, p, mp, sampler, outs)


@pytest.mark.parametrize("entropy", [True, False])
def test_top_p_where_the_sample_misleads(entropy):
    """Top-p alone on rows built against the CPU kernel's sample (1024 evenly spaced tokens, whose
    masses give it bounds on the cut): the sampled tokens raised, lowered, or the mass hidden
    between them. Its bounds then miss -- the tokens it sums as surely kept reach top-p's mass, or
    the cut lies below its candidates -- and it must retry with its sure bounds, still exact.
    Without the entropy the kernel works from the statistics pass's masses (a band around the
    sample's estimate of the cut, the masses above it summed), with the entropy from a histogram
    of the candidates: both paths."""
    V, n = 20000, 1024
    pos = torch.tensor([(i * V) // n for i in range(n)])
    g = torch.Generator().manual_seed(3)
    rows = []
    for shift in (1.0, -3.0):
        x = torch.randn(V, generator=g) * 0.3
        x[pos] += shift
        rows.append(x)
    x = torch.randn(V, generator=g) * 0.3
    between = torch.ones(V, dtype=torch.bool)
    between[pos] = False
    x[between] += 0.8
    rows.append(x)
    logits = torch.stack(rows)
    labels = torch.randint(0, V, (3,), generator=g)
    for sampler in ("vllm", "sglang"):
        for p in (0.9, 0.5):
            with use_backend("cpp"), poisoned():
                outs = sampler_op(logits, labels, 1.0, 0, p, 0.0, sampler, entropy=entropy)
            check_against_truth(logits, labels, 1.0, 0, p, 0.0, sampler, outs)


@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_top_p_ties_from_the_masses(sampler):
    """Top-p alone without the entropy (the CPU kernel's path from the statistics pass's masses)
    where the cut falls in a tie group of thousands of tokens (seven distinct logits; bf16 rows):
    vLLM keeps the group whole, SGLang up to the token that crosses, by id."""
    V = 20000
    g = torch.Generator().manual_seed(11)
    ints = torch.randint(-3, 4, (2, V), generator=g).float()
    bf = (torch.randn(2, V, generator=g) * 2).to(torch.bfloat16).float()
    logits = torch.cat([ints, bf])
    labels = torch.randint(0, V, (4,), generator=g)
    for p in (0.9, 0.5, 0.3):
        with use_backend("cpp"), poisoned():
            outs = sampler_op(logits, labels, 1.0, 0, p, 0.0, sampler, entropy=False)
        check_against_truth(logits, labels, 1.0, 0, p, 0.0, sampler, outs)


@pytest.mark.parametrize("entropy", [False, True])
def test_top_p_at_tie_groups_across_blocks(entropy):
    """Top-p alone where the cut falls in a tie group of thousands of tokens spread over blocks with
    different maxima, p just above and just below each group's share of the mass above it: equal
    logits then get masses a few ulp apart (each block's factor rounds its own way), which the
    CPU kernel's mass buckets must keep together (a group can straddle two buckets: the crossing
    bucket's neighbours are walked too), and a group's thousands of equal masses summed in
    float32 drift by ~1e-4 of p (the kernels sum the buckets and the walk in float64)."""
    V, R = 20000, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (R, V), generator=g).float()
    for b in range((V + 2047) // 2048):  # a distinct maximum in each 2048-token block
        x[:, b * 2048 + 7] = 4 + 0.37 * b + torch.rand(R, generator=g)
    rows, ps = [], []
    for r in range(R):
        prob = torch.softmax(x[r].double(), 0)
        for v in range(3, -3, -1):
            above, share = prob[x[r] > v].sum().item(), prob[x[r] == v].sum().item()
            rows += [r, r]
            ps += [above + 1e-3 * share, above - 1e-3 * share]
    xs, p = x[rows], torch.tensor(ps).clamp(1e-3, 1.0)
    labels = torch.randint(0, V, (len(rows),), generator=g)
    # the vectorised reference agrees with the token-by-token one (on a small row with ties)
    small = torch.randint(-2, 3, (300,), generator=g).double()
    for sampler in ("vllm", "sglang"):
        want = top_p_kept(small, [0.3, 0.6], sampler)
        for i, q in enumerate([0.3, 0.6]):
            assert set(torch.nonzero(want[i]).flatten().tolist()) == brute_kept(
                tuple(small.tolist()), 1.0, 0, q, 0.0, sampler
            )
    rel = 1e-4
    for sampler in ("vllm", "sglang"):
        with use_backend("cpp"), poisoned():
            outs = ops.token_logprobs_sampler(
                xs, labels, 1.0, None, 0, None, 1.0, p, 0.0, None, sampler, -100, entropy, True,
                True, 0, True,
            )  # fmt: skip
        got = kept_from_cut(xs, outs[3], outs[4])
        for r in range(R):
            i = [k for k in range(len(rows)) if rows[k] == r]
            q = p[i].double()
            inner = top_p_kept(x[r].double(), q * (1 - rel), sampler)
            outer = top_p_kept(x[r].double(), (q * (1 + rel)).clamp(max=1.0), sampler)
            assert not (inner & ~got[i]).any() and not (got[i] & ~outer).any(), (sampler, r)
        # the values on the kernel's kept set, for a few of the rows
        few = tuple(o[:8] for o in outs)
        check_against_truth(xs[:8], labels[:8], 1.0, 0, p[:8], 0.0, sampler, few)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,entropy", [(1.0, True), (0.7, True), (1.0, False), (0.7, False)])
def test_top_p_sparse_candidates_across_blocks(dtype, T, entropy):
    """Top-p alone (the CPU kernel's mass histogram over its candidates) where they are few and
    sit in some blocks of the row: spikes at a block's first and last token (2048-token blocks),
    at the vector tail and the scalar tail, and peaked rows; scaled logits and bf16."""
    V = 3 * 2048 + 13
    g = torch.Generator().manual_seed(5)
    spiky = torch.randn(4, V, generator=g) * 0.5
    for r, cols in enumerate([[2047], [2048, 4095], [V - 1], [V - 13, 4096]]):
        spiky[r, cols] = torch.tensor([12.0, 11.5][: len(cols)] if len(cols) == 2 else [12.0])
    peaked = torch.randn(4, V, generator=g) * 4
    logits = torch.cat([spiky, peaked]).to(dtype)
    labels = torch.cat([torch.tensor([2047, 4095, V - 1, 4096]), torch.randint(0, V, (4,))])
    for sampler in ("vllm", "sglang"):
        for p in (0.9, 0.5, 0.999):
            with use_backend("cpp"), poisoned():
                outs = sampler_op(logits, labels, T, 0, p, 0.0, sampler, entropy=entropy)
            check_against_truth(logits.float(), labels, T, 0, p, 0.0, sampler, outs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_off_equal_the_plain_op(backend):
    """No option (or every option off, or a temperature tensor of equal values): the plain
    softmax; the cpp kernels run the plain op's rows for it, bit for bit."""
    logits, labels = inputs(9, 300, ignore_frac=0.2)
    with use_backend(backend):
        lp0, ent0 = pk.token_logprobs(logits, labels, temperature=0.7, return_entropy=True)
        T = torch.full((9,), 0.7)
        lp1, ent1 = pk.token_logprobs(logits, labels, temperature=T, return_entropy=True)
        lp2, ent2 = pk.token_logprobs(
            logits, labels, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, return_entropy=True
        )
    tol = dict(rtol=0, atol=0) if backend == "cpp" else dict(rtol=1e-6, atol=1e-6)
    for a, b in ((lp0, lp1), (ent0, ent1), (lp0, lp2), (ent0, ent2)):
        torch.testing.assert_close(a, b, **tol, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_on_the_kept_set(backend, sampler, dtype):
    N, V = 10, 200
    logits, labels = inputs(N, V, dtype, ignore_frac=0.2)
    T = torch.rand(N) + 0.5
    x = logits.clone().requires_grad_(True)
    with use_backend(backend), poisoned():
        lp, ent = pk.token_logprobs(
            x, labels, temperature=T, top_k=30, top_p=0.8, min_p=0.01, sampler=sampler,
            return_entropy=True,
        )  # fmt: skip
        g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
        finite = torch.isfinite(lp)
        (torch.where(finite, lp, 0) * g_lp + ent * g_ent).sum().backward()
        outs = sampler_op(logits, labels, 1.0, 30, 0.8, 0.01, sampler, temps=T)
    kept = kept_from_cut(logits, outs[3], outs[4])
    x64 = logits.double().requires_grad_(True)
    z = x64 / T.double().unsqueeze(-1)
    lse = torch.logsumexp(torch.where(kept, z, torch.full_like(z, -math.inf)), -1, keepdim=True)
    logq = torch.where(kept, z - lse, torch.zeros_like(z))  # (no -inf: no NaN gradient)
    q = torch.where(kept, logq.exp(), torch.zeros_like(z))
    valid = labels != -100
    lab = labels.clamp(min=0)
    use = valid & kept.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
    lp64 = logq.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
    ent64 = -(q * logq).sum(-1)
    total = (
        torch.where(use, lp64, 0) * g_lp.double() + torch.where(valid, ent64, 0) * g_ent.double()
    )
    total.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL[dtype])
    assert torch.equal(torch.isfinite(lp), use | ~valid)


def test_gradcheck_float64():
    """float64 logits run the float64 reference: gradcheck of log-probs and entropy, the kept set
    held fixed (away from its boundaries by construction)."""
    N, V = 3, 12
    logits = torch.randn(N, V, dtype=torch.float64) * 2
    labels = torch.tensor([0, 5, 11])
    T = torch.tensor([0.7, 1.0, 1.5], dtype=torch.float64)

    def f(x):
        lp, ent = pk.token_logprobs(
            x, labels, temperature=T, top_k=6, top_p=0.9, return_entropy=True
        )
        return torch.where(torch.isfinite(lp), lp, 0), ent

    torch.autograd.gradcheck(f, (logits.requires_grad_(True),))


@pytest.mark.parametrize("backend", BACKENDS)
def test_label_outside_the_kept_set(backend):
    """-inf (never NaN), counted, and no log-prob gradient; the entropy's still flows."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    labels = torch.tensor([0, 4, -100])
    x = logits.clone().requires_grad_(True)
    with use_backend(backend):
        lp, ent, st = pk.token_logprobs(x, labels, top_k=2, return_entropy=True, stats=("outside",))
        assert lp[0] > -math.inf and lp[1] == -math.inf and lp[2] == 0
        assert st.outside.tolist() == [False, True, False] and int(st.num_outside) == 1
        lp[1].sum().backward(retain_graph=True)
        assert torch.equal(x.grad, torch.zeros_like(x))
        ent[1].backward()
        assert x.grad[1, :2].abs().sum() > 0 and torch.equal(x.grad[1, 2:], torch.zeros(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_undefined_rows_stay_nan(backend):
    V = 10
    logits = torch.randn(4, V)
    logits[0, 3] = float("nan")
    logits[1] = -float("inf")
    logits[2, 1] = float("inf")
    labels = torch.tensor([1, 2, 3, 4])
    with use_backend(backend):
        lp, ent = pk.token_logprobs(logits, labels, top_p=0.9, top_k=3, return_entropy=True)
    assert torch.isnan(lp[:3]).all() and torch.isnan(ent[:3]).all()
    assert torch.isfinite(ent[3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflowing_scaled_logits(backend):
    """Finite logits whose scaled value overflows float32: exact results (float64 slow path)."""
    logits = torch.tensor([[3e38, 2.9e38, 1e38, 0.0, -3e38]] * 2)
    labels = torch.tensor([0, 1])
    with use_backend(backend):
        lp, ent = pk.token_logprobs(logits, labels, temperature=0.5, top_k=2, return_entropy=True)
    # z gap 2e37 between the two kept tokens: p = (1, 0) in any precision
    assert lp[0] == 0 and lp[1] == -math.inf or lp[1] < -1e30
    assert torch.isfinite(ent).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_boundaries(backend):
    """k = 1 (greedy), k = V (off), p -> 0 (the top token), p = 1, min_p = 1 (the maxima)."""
    logits, labels = inputs(6, 30)
    top = logits.argmax(-1)
    labels[:3] = top[:3]
    with use_backend(backend):
        for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
            lp = pk.token_logprobs(logits, labels, **kw)
            assert torch.equal(lp[:3], torch.zeros(3))
            assert (lp[3:][labels[3:] != top[3:]] == -math.inf).all()
        plain = pk.token_logprobs(logits, labels)
        for kw in ({"top_k": 30}, {"top_k": 1000}, {"top_p": 1.0}, {"min_p": 0.0}):
            torch.testing.assert_close(pk.token_logprobs(logits, labels, **kw), plain)


@pytest.mark.parametrize(
    "backend,V,k,order",
    [(b, 500, 7, "random") for b in BACKENDS]
    + [("cpp", 9000, k, o) for k in (1, 64) for o in ("random", "ascending", "ties")],
)
def test_statistics_without_truncation(backend, V, k, order):
    """The top ids without a truncation: the CPU kernel collects them in its statistics pass
    behind a bound it raises block by block. Rows in random order, in ascending order (each block
    raises the bound) and with wide ties (the k-th value shared by many tokens)."""
    logits, labels = inputs(8, V, ignore_frac=0.25)
    if order == "ascending":
        logits = logits.sort(-1).values
    elif order == "ties":
        logits = torch.randint(-40, 5, (8, V)).float() / 4
    with use_backend(backend), poisoned():
        outs = ops.token_logprobs_sampler(
            logits, labels, 0.8, None, 0, None, 1.0, None, 0.0, None, "vllm", -100, True, True,
            True, k, True,
        )  # fmt: skip
    check_against_truth(logits, labels, 0.8, 0, 1.0, 0.0, "vllm", outs)
    ignored = labels == -100
    assert (outs[8][ignored] == -1).all() and (outs[9][ignored] == 0).all()


def test_statistics_api():
    logits, labels = inputs(5, 64)
    lp, st = pk.token_logprobs(logits, labels, stats=STATS, stats_top_k=4)
    assert st.top_ids.shape == (5, 4) and st.top_logprobs.shape == (5, 4)
    assert st.num_outside == 0 and not st.outside.any()
    lp2, st2 = pk.token_logprobs(logits, labels, stats="sum_p2")
    assert st2.lse is None and st2.sum_p2 is not None
    torch.testing.assert_close(lp2, lp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sequence_and_per_token_shapes(backend):
    B, Tn, V = 3, 4, 40
    logits = torch.randn(B, Tn, V)
    labels = torch.randint(0, V, (B, Tn))
    temps = torch.tensor([0.5, 1.0, 2.0])
    ks = torch.tensor([[1, 2, 3, 4]] * B)
    with use_backend(backend):
        a = pk.token_logprobs(logits, labels, temperature=temps, top_k=ks)
        b = torch.stack(
            [
                torch.stack(
                    [
                        pk.token_logprobs(
                            logits[i, t : t + 1], labels[i, t : t + 1],
                            temperature=float(temps[i]), top_k=int(ks[i, t]),
                        )[0]
                        for t in range(Tn)
                    ]
                )
                for i in range(B)
            ]
        )  # fmt: skip
    torch.testing.assert_close(a, b)


BAD = [
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(min_p=2.0), ValueError, "min_p"),
    (dict(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, -1.0, 1.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=torch.ones(5)), ValueError, "temperature"),
    (dict(temperature=torch.ones(4, dtype=torch.int64)), TypeError, "temperature"),
    (dict(top_k=torch.tensor([1, -2, 3, 4])), ValueError, "top_k"),
    (dict(top_k=torch.ones(4)), TypeError, "top_k"),
    (dict(top_p=torch.tensor([0.5, 0.0, 1.0, 1.0])), ValueError, "top_p"),
    (dict(min_p=torch.tensor([0.5, 1.5, 0.0, 0.0])), ValueError, "min_p"),
    (dict(top_p=0.5, sampler="hf"), ValueError, "sampler"),
    (dict(stats=("nope",)), ValueError, "stats"),
    (dict(stats=("topk",)), ValueError, "stats_top_k"),
    (dict(stats=("topk",), stats_top_k=65), ValueError, "stats_top_k"),
    (dict(top_k=1.5), TypeError, "top_k"),
    (dict(top_p="0.5"), TypeError, "top_p"),
    (dict(top_p=0.5, inplace_backward=True), ValueError, "inplace_backward"),
]


@pytest.mark.parametrize("kw,exc,name", BAD)
def test_bad_inputs_name_the_argument(kw, exc, name):
    logits, labels = inputs(4, 10)
    with pytest.raises(exc, match=name):
        pk.token_logprobs(logits, labels, **kw)


@pytest.mark.skipif(not _backend.HAS_EXTENSION, reason=NO_EXTENSION)
def test_registered_op_checks_its_tensors():
    logits, labels = inputs(4, 10)
    with pytest.raises(ValueError, match="top_p"):
        sampler_op(logits, labels, p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sampler_op(logits, labels, temps=torch.tensor([1.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="top_k"):
        sampler_op(logits, labels, ks=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="stats_top_k"):
        sampler_op(logits, labels, stats_top_k=11)
    with pytest.raises(IndexError, match="labels"):
        sampler_op(logits, torch.tensor([0, 1, 2, 10]))
    lp, ent, lse, cut, ci, *_ = sampler_op(logits, labels, p=0.5)
    g = torch.ones(4)
    with pytest.raises(ValueError, match="cut_index"):
        ops.token_logprobs_sampler_backward(g, None, logits, labels, lse, ent, cut, ci[:3], 1.0,
                                            None, -100)  # fmt: skip
    with pytest.raises(TypeError, match="cut"):
        ops.token_logprobs_sampler_backward(g, None, logits, labels, lse, ent, cut.double(), ci,
                                            1.0, None, -100)  # fmt: skip


@pytest.mark.skipif(not _backend.HAS_EXTENSION, reason=NO_EXTENSION)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_opcheck(sampler):
    logits, labels = inputs(5, 30, ignore_frac=0.2)
    x = logits.requires_grad_(True)
    T = torch.rand(5) + 0.5
    args = (x, labels, 1.0, T, 4, None, 0.8, None, 0.01, None, sampler, -100, True, True, True,
            3, True)  # fmt: skip
    torch.library.opcheck(torch.ops.ppo_kernels.token_logprobs_sampler.default, args)
    outs = [o.detach() for o in ops.token_logprobs_sampler(*args)]  # the backward's inputs
    bargs = (torch.randn(5), torch.randn(5), logits.detach(), labels, outs[2], outs[1], outs[3],
             outs[4], 1.0, T, -100)  # fmt: skip
    torch.library.opcheck(torch.ops.ppo_kernels.token_logprobs_sampler_backward.default, bargs)


@pytest.mark.skipif(not _backend.HAS_EXTENSION, reason=NO_EXTENSION)
def test_compile():
    logits, labels = inputs(6, 40)
    T = torch.rand(6) + 0.5

    def f(x, y, t):
        lp, ent, st = pk.token_logprobs(
            x, y, temperature=t, top_k=5, top_p=0.9, min_p=0.01, return_entropy=True,
            stats=STATS, stats_top_k=3,
        )  # fmt: skip
        return lp, ent, st.num_outside, st.top_ids

    want = f(logits, labels, T)
    got = torch.compile(f, fullgraph=True, dynamic=True)(logits, labels, T)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant(backend):
    """A row's outputs do not depend on the rows around it, in batch-invariant mode."""
    logits, labels = inputs(20, 333)
    with use_backend(backend), pk.batch_invariant():
        full = sampler_op(logits, labels, 0.9, 7, 0.9, 0.01, "vllm", stats_top_k=3)
        part = sampler_op(logits[5:9], labels[5:9], 0.9, 7, 0.9, 0.01, "vllm", stats_top_k=3)
    for a, b in zip(full, part):
        if a.numel():
            assert torch.equal(a[5:9], b) or torch.allclose(
                a[5:9], b, equal_nan=True, atol=0, rtol=0
            )


def test_eager_baseline_agrees():
    """bench's eager sort-and-cumsum baseline (vLLM's code) against the op."""
    logits, labels = inputs(6, 500)
    labels = logits.argsort(-1, descending=True)[:, 3]  # inside every kept set below
    for kw in ({"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.01}, {"top_k": 20, "top_p": 0.95}):
        want = ref.eager_sampled_logprobs(logits, labels, temperature=0.8, **kw)
        got = pk.token_logprobs(logits, labels, temperature=0.8, **kw)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- full_kl with per-row temperatures (ppo_kernels::full_kl_row_temperature) ------------------

FK_BACKENDS = cpu_backends("full_kl")


@pytest.mark.parametrize("backend", FK_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per", ["sequence", "token"])
def test_full_kl_per_row_temperature(backend, dtype, per):
    B, Tn, V = 3, 5, 300
    x = (torch.randn(B, Tn, V) * 2).to(dtype)
    y = (torch.randn(B, Tn, V) * 2).to(dtype)
    # (the Triton interpreter of this triton version fails on full_kl's masked backward, with or
    # without per-row temperatures: tests/test_full_kl.py::test_mask_and_strided_rows[triton])
    mask = torch.rand(B, Tn) > 0.2 if backend != "triton" else None
    temps = torch.rand(B) + 0.5 if per == "sequence" else torch.rand(B, Tn) + 0.5
    t3 = temps.double().reshape(temps.shape + (1,) * (3 - temps.dim()))
    xg, yg = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    with use_backend(backend), poisoned():
        kl = pk.full_kl(xg, yg, temperature=temps, mask=mask)
        g = torch.randn(B, Tn)
        (kl * g).sum().backward()
    x64, y64 = x.double().requires_grad_(True), y.double().requires_grad_(True)
    want = kl64(x64, y64, t3, mask)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(kl.double(), want.detach(), atol=5e-5, rtol=2e-5)
    torch.testing.assert_close(xg.grad.double(), x64.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(yg.grad.double(), y64.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", FK_BACKENDS)
def test_full_kl_equal_temperatures_equal_the_scalar_op(backend):
    x, y = torch.randn(6, 70), torch.randn(6, 70)
    with use_backend(backend):
        a = pk.full_kl(x, y, temperature=0.8)
        b = pk.full_kl(x, y, temperature=torch.full((6,), 0.8))
    tol = dict(rtol=0, atol=0) if backend == "cpp" else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize(
    "t,exc",
    [
        (torch.tensor([1.0, 0.0, 1.0]), ValueError),
        (torch.ones(4), ValueError),
        (torch.ones(3, dtype=torch.int64), TypeError),
    ],
)
def test_full_kl_bad_temperatures(t, exc):
    x, y = torch.randn(3, 10), torch.randn(3, 10)
    with pytest.raises(exc, match="temperature"):
        pk.full_kl(x, y, temperature=t)


@pytest.mark.skipif(not _backend.HAS_EXTENSION, reason=NO_EXTENSION)
def test_full_kl_row_temperature_opcheck_and_compile():
    x = torch.randn(4, 30, requires_grad=True)
    y = torch.randn(4, 30)
    t = torch.rand(4) + 0.5
    torch.library.opcheck(torch.ops.ppo_kernels.full_kl_row_temperature.default, (x, y, t, None))
    kl, lz, lw = ops.full_kl_row_temperature(x, y, t, None)
    torch.library.opcheck(
        torch.ops.ppo_kernels.full_kl_row_temperature_backward.default,
        (torch.randn(4), x.detach(), y, None, kl.detach(), lz, lw, t, True),
    )

    def f(a, b, tt):
        return pk.full_kl(a, b, temperature=tt)

    got = torch.compile(f, fullgraph=True, dynamic=True)(x.detach(), y, t)
    torch.testing.assert_close(got, f(x.detach(), y, t))
