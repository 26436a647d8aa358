"""Batch-invariant mode (README "Batch-invariant mode").

Under `ppo_kernels.batch_invariant()` every per-token output of token_logprobs,
linear_token_logprobs / causal_lm_logprobs, full_kl and linear_policy_loss (its per-token stats;
a row there is one sequence) is bitwise the same whatever else is in the call. Each test computes a few target rows alone (one row per call), then embeds them at random
positions among random neighbours -- batches of 1, 3, 64 and 257 rows (257 = 4 x 64 + 1: MKL
computes the last row of such a matmul with other instructions), padded `[B, T]` with ignored
padding rows, strided (`x[:, :-1]`), packed, split into micro-batches, under several chunk budgets
(linear) and 1 or 2 CPU threads -- and compares the targets' outputs bitwise. Gradients: two runs
of the same call give bitwise-equal gradients (default mode and the mode), and in the mode the
gradient of each row's own input (logits, hidden) is batch-invariant too.

That the checks can fail: `test_default_mode_is_not_batch_invariant` finds configurations whose
rows differ without the mode (linear_token_logprobs: the budget's fused vs chunked tiles, the
matmul's row count), and `test_check_catches_a_batch_dependent_kernel` injects a one-ulp,
batch-size-dependent change into a kernel and sees the check fail;
`test_linear_policy_loss_checks_can_fail` does both for the fused policy loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
from support.simt import HAS_SIMT, emulated
from support.skips import NO_SIMT, need
from support.utils import cpu_backends

import ppo_kernels as pk
from ppo_kernels import _backend, batch_invariant, use_backend

IGNORE = -100
SIZES = (1, 3, 64, 257)


@contextlib.contextmanager
def threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ---- the ops as row functions: inputs of one row, a padding row, a call on a layout ----------


@dataclasses.dataclass
class Spec:
    """An op seen row by row: `row(g)` makes one random row (a tuple of per-row tensors),
    `pad(g)` a padding row (ignored / masked, random content), `call(*stacked)` runs the op on
    rows stacked along the leading dims and returns the per-row outputs `[..., k]`."""

    row: object
    pad: object
    call: object
    loss: object = None  # linear_policy_loss: the call's loss (for the gradients)


def token_logprobs_spec(V, dtype, temperature=0.7):
    def row(g):
        label = int(torch.randint(0, V, (), generator=g))
        return (torch.randn(V, generator=g).mul(3).to(dtype), torch.tensor(label))

    def pad(g):
        return (torch.randn(V, generator=g).to(dtype), torch.tensor(IGNORE))

    def call(x, labels):
        lp, ent = pk.token_logprobs(x, labels, temperature=temperature, return_entropy=True)
        return torch.stack([lp, ent], -1)

    return Spec(row, pad, call)


def full_kl_spec(V, dtype):
    def row(g):
        x = torch.randn(V, generator=g).mul(2)
        return (x.to(dtype), (x + torch.randn(V, generator=g)).to(dtype), torch.tensor(True))

    def pad(g):
        return (torch.randn(V, generator=g).to(dtype), torch.randn(V, generator=g).to(dtype),
                torch.tensor(False))  # fmt: skip

    def call(x, ref, mask):
        return pk.full_kl(x, ref, temperature=0.9, mask=mask)[..., None]

    return Spec(row, pad, call)


def linear_spec(W, b, dtype, budget=None, logits_dtype="float32"):
    V, H = W.shape

    def row(g):
        label = int(torch.randint(0, V, (), generator=g))
        return (torch.randn(H, generator=g).to(dtype), torch.tensor(label))

    def pad(g):
        return (torch.randn(H, generator=g).to(dtype), torch.tensor(IGNORE))

    def call(h, labels):
        lp, ent = pk.linear_token_logprobs(
            h,
            W,
            labels,
            bias=b,
            temperature=0.8,
            return_entropy=True,
            max_chunk_bytes=budget,
            logits_dtype=logits_dtype,
        )
        return torch.stack([lp, ent], -1)

    return Spec(row, pad, call)


def policy_loss_spec(W, b, dtype, T=5, full_kl=False, **opts):
    """linear_policy_loss with a row = one sequence of T tokens (hidden [T, H], labels, advantages,
    old log-probs, mask, reference log-probs or reference hidden states); the per-row outputs are
    its per-token stats [T, 3]: logprobs, entropy, kl. A padding row is a sequence off the mask
    with ignored labels. The aggregation's denominator is fixed (global_num_tokens): then each
    token's coefficients do not depend on the other rows either."""
    V, H = W.shape
    kw = dict(bias=b, kl_coef=0.1, entropy_coef=0.01, global_num_tokens=97, temperature=0.8)
    kw.update(opts)

    def row(g):
        h = torch.randn(T, H, generator=g)
        labels = torch.randint(0, V, (T,), generator=g)
        labels[int(torch.randint(0, T, (), generator=g))] = IGNORE
        old = -7 + torch.randn(T, generator=g)
        ref = (h + 0.3 * torch.randn(T, H, generator=g)) if full_kl else old + 0.1
        mask = torch.rand(T, generator=g) > 0.2
        return (h.to(dtype), labels, torch.randn(T, generator=g), old, mask, ref.to(h.dtype))

    def pad(g):
        h = torch.randn(T, H, generator=g)
        z = torch.zeros(T)
        ref = h if full_kl else z
        return (h.to(dtype), torch.full((T,), IGNORE), z, z, z.bool(), ref.to(h.dtype))

    def loss(h, labels, adv, old, mask, ref, W=W, b=b):
        refs = dict(ref_hidden=ref.to(dtype), ref_weight=W) if full_kl else dict(ref_logprobs=ref)
        return pk.linear_policy_loss(h, W, labels, adv, old, mask, **refs, **dict(kw, bias=b))

    def call(*args):
        st = loss(*args)[1]
        return torch.stack([st["logprobs"], st["entropy"], st["kl"]], -1)

    return Spec(row, pad, call, loss)


# ---- layouts ----------------------------------------------------------------------------------


def _stack(rows):
    return tuple(torch.stack(cols) for cols in zip(*rows))


def flat(spec, rows, targets):
    """rows stacked [N, ...] (packed); the outputs of the rows at `targets`."""
    return spec.call(*_stack(rows))[targets]


def padded(spec, rows, targets, g, T=7, strided=False):
    """rows laid out [B, T] in order, each sequence followed by 0-3 padding rows (ignored);
    strided: the inputs are the [:, :-1] view of a [B, T + 1] tensor."""
    grid, where, b, t = [], {}, [], 0
    for i, r in enumerate(rows):
        if t == T:
            grid.append(b)
            b, t = [], 0
        where[i] = (len(grid), t)
        b.append(r)
        t += 1
        if t < T and int(torch.randint(0, 4, (), generator=g)) == 0:
            k = min(T - t, 1 + int(torch.randint(0, 3, (), generator=g)))
            b += [spec.pad(g) for _ in range(k)]
            t += k
    b += [spec.pad(g) for _ in range(T - t)]
    grid.append(b)
    cols = [_stack(seq + ([spec.pad(g)] if strided else [])) for seq in grid]
    args = tuple(torch.stack(c) for c in zip(*cols))
    if strided:
        args = tuple(a[:, :-1] for a in args)
    out = spec.call(*args)
    return torch.stack([out[where[i]] for i in targets])


def split(spec, rows, targets, cuts):
    """rows in micro-batches cut at `cuts`, one call each."""
    outs = [spec.call(*_stack(rows[a:b])) for a, b in zip((0,) + cuts, cuts + (len(rows),))]
    return torch.cat(outs)[targets]


def embed(spec, targets, n, g):
    """n rows (n >= len(targets)): the targets at random distinct positions (the last position
    taken when n > len(targets)), random neighbours and some ignored rows elsewhere."""
    pos = torch.randperm(n, generator=g)[: len(targets)].tolist()
    if n > len(targets) and n - 1 not in pos:
        pos[-1] = n - 1
    rows = [
        spec.row(g) if int(torch.randint(0, 5, (), generator=g)) else spec.pad(g) for _ in range(n)
    ]
    for p, t in zip(pos, targets):
        rows[p] = t
    return rows, pos


def configurations(spec, targets, g, sizes=SIZES, thread_counts=(1, 2)):
    """(name, outputs of the targets) for every configuration."""
    for n in sizes:
        if n < len(targets):  # one target per call
            outs = [flat(spec, *embed(spec, [t], n, g)) for t in targets]
            yield f"n={n}", torch.cat(outs)
            continue
        rows, pos = embed(spec, targets, n, g)
        for nt in thread_counts:
            with threads(nt):
                yield f"n={n} packed, {nt} threads", flat(spec, rows, pos)
        yield f"n={n} padded [B, T]", padded(spec, rows, pos, g)
        yield f"n={n} padded, strided view", padded(spec, rows, pos, g, strided=True)
        if n > 4:
            cuts = tuple(sorted({n // 3, n // 3 + 1, 2 * n // 3}))
            yield f"n={n} split at {cuts}", split(spec, rows, pos, cuts)


def check_invariant(spec, targets, g, **kw):
    """Every configuration's target outputs equal the targets computed alone, bitwise."""
    alone = torch.cat([flat(spec, [t], [0]) for t in targets])
    for name, out in configurations(spec, targets, g, **kw):
        same = (out == alone) | (out.isnan() & alone.isnan())
        assert bool(same.all()), (
            f"{name}: rows differ from the rows computed alone "
            f"(max |diff| {(out - alone).abs().max().item():.3g})"
        )


def _targets(spec, g, k=3):
    return [spec.row(g) for _ in range(k)]


# ---- the mode, op by op --------------------------------------------------------------------


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs(backend, dtype):
    g = torch.Generator().manual_seed(1)
    spec = token_logprobs_spec(1003, dtype)
    sizes = SIZES if backend != "triton" else (1, 3, 64)
    with use_backend(token_logprobs=backend), batch_invariant():
        check_invariant(spec, _targets(spec, g), g, sizes=sizes)


@pytest.mark.parametrize("backend", cpu_backends("full_kl"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_kl(backend, dtype):
    g = torch.Generator().manual_seed(2)
    spec = full_kl_spec(777, dtype)
    sizes = SIZES if backend != "triton" else (1, 3, 64)
    with use_backend(full_kl=backend), batch_invariant():
        check_invariant(spec, _targets(spec, g), g, sizes=sizes)


def _head(V, H, dtype, g, bias=True):
    W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    return W, b


LINEAR_CASES = [
    # dtype, logits_dtype, budgets (None: the default; small ones chunk the vocabulary)
    (torch.float32, "float32", (None, 64 << 10, 8 << 10)),
    (torch.bfloat16, "float32", (None, 48 << 10)),
    (torch.bfloat16, "input", (None, 48 << 10)),
]


@pytest.mark.parametrize("backend", cpu_backends("linear_token_logprobs"))
@pytest.mark.parametrize("dtype,logits_dtype,budgets", LINEAR_CASES)
def test_linear_token_logprobs(backend, dtype, logits_dtype, budgets):
    g = torch.Generator().manual_seed(3)
    # Triton's interpreter runs Python per row program: a smaller case (the tiles are the same
    # matmuls as the cpp backend's; what differs is the reduction kernels)
    V, sizes, more = (1001, SIZES, (3, 257)) if backend != "triton" else (257, (1, 3, 40), (40,))
    W, b = _head(V, 48, dtype, g)
    targets = _targets(linear_spec(W, b, dtype), g)
    with use_backend(linear_token_logprobs=backend), batch_invariant():
        want = None
        for budget in budgets if backend != "triton" else budgets[:2]:
            spec = linear_spec(W, b, dtype, budget, logits_dtype)
            alone = torch.cat([flat(spec, [t], [0]) for t in targets])
            # the chunk budget changes nothing either
            assert want is None or torch.equal(alone, want), f"budget {budget}"
            want = alone
            check_invariant(spec, targets, g, sizes=sizes if budget is None else more)


def test_linear_vocab_chunks_in_the_mode():
    """A vocabulary too large for whole-vocabulary tiles of 16 rows in the default budget: the
    mode's plan walks vocabulary chunks (the same ones for every call) and rows stay invariant."""
    from ppo_kernels.fused_linear import planner

    g = torch.Generator().manual_seed(4)
    V, H = 1_100_003, 4
    W, b = _head(V, H, torch.float32, g)
    plan = planner.plan_invariant(V, H, torch.float32, "cpu")
    assert plan.pad == plan.rows == planner.INVARIANT_ROW_MULTIPLE and plan.vocab < V
    spec = linear_spec(W, b, torch.float32)
    with use_backend(linear_token_logprobs="cpp"), batch_invariant():
        check_invariant(spec, _targets(spec, g, 2), g, sizes=(1, 3, 40), thread_counts=(2,))


def test_plan_invariant_depends_on_neither_rows_nor_budget():
    from ppo_kernels.fused_linear import planner

    for V, H, dtype, ld in [
        (32000, 64, torch.float32, "float32"),
        (152064, 4096, torch.bfloat16, "float32"),
        (152064, 4096, torch.bfloat16, "input"),
        (1 << 20, 4096, torch.float32, "float32"),
    ]:
        p = planner.plan_invariant(V, H, dtype, "cpu", logits_dtype=ld)
        assert p.rows % planner.INVARIANT_ROW_MULTIPLE == 0
        assert p.pad == p.rows <= planner.INVARIANT_MAX_ROWS["cpu"]  # one tile shape
        q = planner.plan_invariant(V, H, dtype, "cuda", logits_dtype=ld)  # (arithmetic only)
        assert q.pad == q.rows <= planner.INVARIANT_MAX_ROWS["cuda"]
        with batch_invariant():
            for N in (1, 5, 100000):
                for budget in (1, 1 << 20, 1 << 30):
                    q = planner.plan_call(N, V, H, dtype, torch.device("cpu"), budget, ld, True)
                    assert q == p
        assert not planner.plan_call(5, V, H, dtype, torch.device("cpu"), 0, ld, True).pad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_rows_do_not_depend_on_their_position(dtype):
    """What the plan rests on (planner.plan_invariant): the BLAS computes a row of a tile's
    matmuls of one shape (the plan's rows; one thread, as the Tiler runs them in the mode) bitwise
    the same wherever the row sits in the tile -- the logits h @ W^T (K = H) and the hidden
    gradient g @ W (K = V), at the tests' head size and larger ones. And the comparison can
    fail: a row's result does depend on the row count (MKL computes 1-3 rows with other code; on
    a BLAS without that effect only the first part is asserted)."""
    from ppo_kernels.fused_linear import planner

    g = torch.Generator().manual_seed(17)
    odd = []
    sizes = [(48, 1001), (512, 4000), (1024, 8192)][: 3 if dtype == torch.float32 else 1]
    for H, V in sizes:  # (bf16 matmuls are slow here: the tests' head size only)
        R = planner.plan_invariant(V, H, dtype, "cpu").rows
        h = torch.randn(R, H, generator=g).to(dtype)
        W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
        gz = torch.randn(R, V, generator=g).to(dtype)
        for name, a, b in [("h @ W^T", h, W.T), ("g @ W", gz, W)]:
            with threads(1):
                want = torch.mm(a, b)
                for shift in (1, 7, R // 2):  # the same rows at other positions of the tile
                    got = torch.roll(torch.mm(torch.roll(a, shift, 0), b), -shift, 0)
                    assert torch.equal(got, want), (name, H, R, shift)
                odd += [n for n in (1, 2, 3) if not torch.equal(torch.mm(a[:n], b), want[:n])]
    if dtype == torch.float32 and torch.backends.mkl.is_available():
        assert odd, "MKL computed 1-3 rows like the others: the comparison found nothing"


def test_small_fixed_tiles(monkeypatch):
    """64-row tiles (a small cap on the rows): several tiles per call, the last padded, and every
    output still batch-invariant."""
    from ppo_kernels.fused_linear import planner

    monkeypatch.setitem(planner.INVARIANT_MAX_ROWS, "cpu", 64)
    g = torch.Generator().manual_seed(18)
    W, b = _head(1001, 48, torch.float32, g)
    assert planner.plan_invariant(1001, 48, torch.float32, "cpu").pad == 64
    spec = linear_spec(W, b, torch.float32)
    policy = policy_loss_spec(W, b, torch.float32, 5, loss_type="gspo", agg="token-mean")
    with use_backend("cpp"), batch_invariant():
        check_invariant(spec, _targets(spec, g), g, sizes=(1, 3, 257), thread_counts=(2,))
        check_invariant(policy, _targets(policy, g), g, sizes=(1, 3, 64), thread_counts=(2,))


def test_causal_lm_logprobs():
    """Our part of causal_lm_logprobs is linear_token_logprobs on the backbone's hidden states;
    end to end the backbone must be batch-invariant too (this tiny Llama on the CPU is: its
    matmuls have M = tokens >= 4 and H a multiple of 16). Sequences alone, in batches with other
    sequences and right padding, compared bitwise."""
    transformers = need("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    L = 12
    ids = torch.randint(3, 1000, (9, L), generator=g)
    lens = torch.randint(4, L + 1, (9,), generator=g)
    attn = (torch.arange(L)[None] < lens[:, None]).long()
    with batch_invariant(), torch.no_grad():
        alone = [
            pk.causal_lm_logprobs(model, ids[i : i + 1], attn[i : i + 1], return_entropy=True)
            for i in range(9)
        ]
        for idx in ([0, 1, 2], [3, 0, 8, 5], list(range(9))):
            lp, ent = pk.causal_lm_logprobs(model, ids[idx], attn[idx], return_entropy=True)
            for j, i in enumerate(idx):
                keep = attn[i, 1:].bool()
                assert torch.equal(lp[j][keep], alone[i][0][0][keep]), (idx, i)
                assert torch.equal(ent[j][keep], alone[i][1][0][keep]), (idx, i)


# ---- the checks can fail ---------------------------------------------------------------------


def test_default_mode_is_not_batch_invariant():
    """Without the mode, rows of linear_token_logprobs differ with the chunk budget (whole-
    vocabulary tiles reduced by the fused kernel vs vocabulary chunks merged across tiles) and with
    the matmul's row count (MKL: 1 row, 2-3 rows and the last row of 4k + 1 rows take other
    code paths) -- the causes the mode removes. On a BLAS without the row-count effect only the
    budget one is asserted."""
    g = torch.Generator().manual_seed(6)
    W, b = _head(1001, 48, torch.float32, g)
    spec = linear_spec(W, b, torch.float32)
    targets = _targets(spec, g, 4)
    with use_backend(linear_token_logprobs="cpp"):
        alone = torch.cat([flat(spec, [t], [0]) for t in targets])
        chunked = linear_spec(W, b, torch.float32, budget=2 << 10)  # vocabulary chunks
        assert not torch.equal(torch.cat([flat(chunked, [t], [0]) for t in targets]), alone)
        with pytest.raises(AssertionError, match="differ"):
            check_invariant(spec, targets, g, sizes=(257,), thread_counts=(2,))
        with batch_invariant():
            check_invariant(spec, targets, g, sizes=(257,), thread_counts=(2,))


def test_check_catches_a_batch_dependent_kernel(monkeypatch):
    """A kernel whose rows move by one ulp when the call has more than one row: the check fails."""
    from ppo_kernels.token_logprobs import op as tl_op

    eager = tl_op.forward.impls["eager"]

    def drifting(logits, labels, inv_t, ignore_index, with_entropy):
        lp, ent, lse = eager(logits, labels, inv_t, ignore_index, with_entropy)
        if labels.numel() > 1:
            lp = torch.nextafter(lp, torch.full_like(lp, -float("inf")))
        return lp, ent, lse

    monkeypatch.setitem(tl_op.forward.impls, "eager", drifting)
    g = torch.Generator().manual_seed(7)
    spec = token_logprobs_spec(64, torch.float32)
    with use_backend(token_logprobs="eager"), batch_invariant():
        with pytest.raises(AssertionError, match="n=3"):
            check_invariant(spec, _targets(spec, g), g, sizes=(3,))


# ---- the fused policy loss -------------------------------------------------------------------

POLICY_CASES = [
    # loss_type, options, exact KL (ref_hidden), sequence length
    ("ppo", {}, False, 5),  # per-token coefficients: one pass, chunks of tokens
    ("gspo", dict(agg="token-mean"), True, 5),  # a sequence statistic: whole sequences per chunk
    ("clip_cov", dict(clip_cov_ratio=0.1), False, 5),  # a batch statistic: two passes
]


def _policy_runs(cases):
    """(backend, *case): the Triton interpreter runs the first case only. The backends share the
    engine's Python loop and the head term (the passes, whole sequences per chunk, the batch
    statistics: the eager backend runs every case through them); the Triton kernels are the
    tiles' statistics, the same kernels in every loss type."""
    return [
        (b, *c) for b in cpu_backends("linear_policy_loss") for c in cases
        if b != "triton" or c == cases[0]
    ]  # fmt: skip


@pytest.mark.parametrize(
    "backend,loss_type,opts,full,T", _policy_runs(POLICY_CASES), ids=lambda c: str(c)
)
def test_linear_policy_loss(backend, loss_type, opts, full, T):
    """The per-token outputs (log-prob, entropy, KL) of each sequence, alone and among others."""
    g = torch.Generator().manual_seed(12)
    V, sizes = (1001, SIZES) if backend != "triton" else (257, (1, 3, 9))  # (the interpreter)
    full = full and backend != "triton"  # (the interpreter: minutes; test_full_kl covers it)
    W, b = _head(V, 48, torch.float32, g)
    spec = policy_loss_spec(W, b, torch.float32, T, full, loss_type=loss_type, **opts)
    with use_backend(linear_policy_loss=backend), batch_invariant():
        check_invariant(spec, _targets(spec, g), g, sizes=sizes)


@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
def test_linear_policy_loss_bf16(logits_dtype):
    g = torch.Generator().manual_seed(13)
    W, b = _head(1001, 48, torch.bfloat16, g)
    spec = policy_loss_spec(W, b, torch.bfloat16, logits_dtype=logits_dtype)
    with use_backend(linear_policy_loss="cpp"), batch_invariant():
        check_invariant(spec, _targets(spec, g), g, sizes=(1, 3, 64), thread_counts=(2,))


def test_linear_policy_loss_sequences_longer_than_a_tile():
    """A vocabulary whose invariant tiles hold 32 rows and sequences of 40 tokens: a first pass of
    log-probs, then the sequence statistics on every row at once."""
    from ppo_kernels.fused_linear import planner

    g = torch.Generator().manual_seed(14)
    V, H = 300_007, 4
    assert planner.plan_invariant(V, H, torch.float32, "cpu").rows == 32
    W, b = _head(V, H, torch.float32, g)
    spec = policy_loss_spec(W, b, torch.float32, 40, loss_type="gspo", agg="token-mean")
    with use_backend(linear_policy_loss="cpp"), batch_invariant():
        check_invariant(spec, _targets(spec, g, 2), g, sizes=(3,), thread_counts=(2,))


@pytest.mark.parametrize("backend,loss_type,full", _policy_runs([("ppo", False), ("gspo", True)]))
def test_linear_policy_loss_gradients(backend, loss_type, full):
    """Two runs give bitwise-equal gradients (hidden, weight, bias; default mode and the mode);
    in the mode each sequence's hidden gradient is the same alone and in the batch (its
    coefficients are: the aggregation's denominator is fixed)."""
    g = torch.Generator().manual_seed(15)
    V, n = (1001, 257) if backend != "triton" else (257, 9)  # (the interpreter)
    full = full and backend != "triton"  # (as in test_linear_policy_loss)
    W, b = _head(V, 48, torch.float32, g)
    spec = policy_loss_spec(W, b, torch.float32, 5, full, loss_type=loss_type, agg="token-mean")
    rows = [spec.row(g) if i % 5 else spec.pad(g) for i in range(n)]

    def grad_h(idx):
        h, *rest = _stack([rows[i] for i in idx])
        h.requires_grad_(True)
        spec.loss(h, *rest)[0].backward()
        return h.grad

    h, *rest = _stack(rows)
    with use_backend(linear_policy_loss=backend):
        for mode in (False, True):
            with batch_invariant(mode):
                _deterministic(lambda h, W, b: spec.loss(h, *rest, W=W, b=b)[0], h, W, b, runs=2)
        with batch_invariant():
            whole = grad_h(range(n))
            for idx in ([n - 1], [0, n - 1, 5], list(range(n - 4, n))):
                assert torch.equal(grad_h(idx), whole[idx]), (backend, idx)


def _blas_rows_depend_on_count(W, nt, rows=257 * 5, seed=19):
    """Whether torch.mm(h, W^T) on nt threads gives a row other bits in a call of `rows` rows
    than alone or in a call of 5 rows (the shapes of the check below)."""
    h = torch.randn(rows, W.shape[1], generator=torch.Generator().manual_seed(seed))
    with threads(nt):
        whole = torch.mm(h, W.T)
        return any(
            not torch.equal(torch.mm(h[i : i + 5], W.T), whole[i : i + 5])
            for i in range(0, rows, 5 * 37)
        )


def test_linear_policy_loss_checks_can_fail(monkeypatch):
    """Without the mode the sequences' outputs depend on the batch (the matmul's row count); and
    a kernel that moves its rows by one ulp when the call holds more than one sequence's tokens
    is caught in the mode."""
    from ppo_kernels.token_logprobs import op as tl_op

    g = torch.Generator().manual_seed(16)
    W, b = _head(1001, 48, torch.float32, g)
    spec = policy_loss_spec(W, b, torch.float32)
    targets = _targets(spec, g, 4)
    # without the mode, a BLAS whose two threads split the 257 sequences' rows differently from
    # the targets' gives other bits (whether it does depends on the CPU and its MKL kernels: the
    # probe below says; the drifting kernel after it shows the check failing on every machine)
    if os.environ.get("OMP_NUM_THREADS", "") != "1" and _blas_rows_depend_on_count(W, 2):
        with use_backend(linear_policy_loss="cpp"):
            with pytest.raises(AssertionError, match="differ"):
                check_invariant(spec, targets, g, sizes=(257,), thread_counts=(2,))
    eager = tl_op.forward.impls["eager"]

    def drifting(logits, labels, inv_t, ignore_index, with_entropy):
        lp, ent, lse = eager(logits, labels, inv_t, ignore_index, with_entropy)
        if int((labels != ignore_index).sum()) > 5:
            lp = torch.nextafter(lp, torch.full_like(lp, -float("inf")))
        return lp, ent, lse

    monkeypatch.setitem(tl_op.forward.impls, "eager", drifting)
    with use_backend(linear_policy_loss="eager"), batch_invariant():
        with pytest.raises(AssertionError, match="n=3"):
            check_invariant(spec, targets, g, sizes=(3,))


# ---- gradients -------------------------------------------------------------------------------


def _grads(fn, *inputs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*xs)
    torch.manual_seed(0)
    (out * torch.randn(out.shape)).sum().backward()
    return [x.grad for x in xs if x.grad is not None]


def _deterministic(fn, *inputs, runs=3):
    first = _grads(fn, *inputs)
    for _ in range(runs - 1):
        for a, b in zip(first, _grads(fn, *inputs)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("backend", cpu_backends("linear_token_logprobs"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gradients_deterministic(mode, backend, dtype):
    g = torch.Generator().manual_seed(8)
    N, V = (300, 1001) if backend != "triton" else (40, 257)
    W, b = _head(V, 48, dtype, g)
    h = torch.randn(N, 48, generator=g).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = IGNORE

    def fn(h, W, b):
        lp, ent = pk.linear_token_logprobs(h, W, labels, bias=b, return_entropy=True,
                                           max_chunk_bytes=48 << 10)  # fmt: skip
        return torch.stack([lp, ent])

    with use_backend(linear_token_logprobs=backend), batch_invariant(mode == "invariant"):
        _deterministic(fn, h, W, b, runs=2)


@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("op", ["token_logprobs", "full_kl"])
def test_vocab_gradients_deterministic(mode, op):
    g = torch.Generator().manual_seed(9)
    for backend in cpu_backends(op):
        B, T, V = (4, 70, 1003) if backend != "triton" else (2, 9, 301)  # (the interpreter)
        x = torch.randn(B, T, V, generator=g)
        y = torch.randn(B, T, V, generator=g)
        labels = torch.randint(0, V, (B, T), generator=g)
        if op == "token_logprobs":

            def fn(x):
                return torch.stack(pk.token_logprobs(x, labels, return_entropy=True))

            args = (x,)
        else:

            def fn(x, y):
                return pk.full_kl(x, y)

            args = (x, y)
        with use_backend(**{op: backend}), batch_invariant(mode == "invariant"):
            _deterministic(fn, *args, runs=2)


def test_row_gradients_batch_invariant():
    """In the mode the gradient of a row's own input (its logits, its hidden state) does not
    depend on the other rows either (given its upstream gradient); the weight gradient, a sum over
    rows, is only deterministic."""
    g = torch.Generator().manual_seed(10)
    W, b = _head(1001, 48, torch.float32, g)
    h = torch.randn(257, 48, generator=g)
    labels = torch.randint(0, 1001, (257,), generator=g)
    up = torch.randn(2, 257, generator=g)
    x = torch.randn(257, 777, generator=g)
    lx = torch.randint(0, 777, (257,), generator=g)

    def grad_h(rows):
        hh = h[rows].clone().requires_grad_(True)
        lp, ent = pk.linear_token_logprobs(hh, W, labels[rows], bias=b, return_entropy=True)
        (lp * up[0, rows] + ent * up[1, rows]).sum().backward()
        return hh.grad

    def grad_x(rows):
        xx = x[rows].clone().requires_grad_(True)
        lp, ent = pk.token_logprobs(xx, lx[rows], return_entropy=True)
        (lp * up[0, rows] + ent * up[1, rows]).sum().backward()
        return xx.grad

    for backend in cpu_backends("linear_token_logprobs"):
        n = 257 if backend != "triton" else 41  # (the interpreter)
        with use_backend(backend), batch_invariant():
            for fn in (grad_h, grad_x):
                full = fn(torch.arange(n))
                for rows in ([n - 1], [0, n - 1, 5], list(range(n - 30, n))):
                    assert torch.equal(fn(torch.tensor(rows)), full[rows]), (backend, fn, rows)


# ---- the switch ------------------------------------------------------------------------------


def test_switch_stacks_and_env(monkeypatch):
    assert not _backend.invariant()
    with batch_invariant():
        assert _backend.invariant()
        with batch_invariant(False):
            assert not _backend.invariant()
        assert _backend.invariant()
    assert not _backend.invariant()


def test_env_var_and_info():
    import os
    import subprocess
    import sys

    from support import ROOT as root

    env = dict(os.environ, PPO_KERNELS_BATCH_INVARIANT="1", PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, "-m", "ppo_kernels", "info"], env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert "batch-invariant mode: on (PPO_KERNELS_BATCH_INVARIANT=1)" in out.stdout


# ---- the CUDA kernels, in the SIMT emulator --------------------------------------------------


@pytest.mark.parametrize("op", ["token_logprobs", "full_kl"])
@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.simt
@pytest.mark.skipif(not HAS_SIMT, reason=NO_SIMT)
def test_cuda_kernels_row_alignment(op, mode):
    """The CUDA token_logprobs / full_kl kernels read a row in 16-byte packs after a scalar head
    that makes the row aligned: with V * 2 bytes not a multiple of 16 (bf16, V odd) the head, hence
    which thread adds which logits, depends on the row's place in the batch. Batch-invariant mode
    starts the packs at every row's first element (misaligned rows load them element by element):
    rows computed alone and in batches are then bitwise equal; without it they differ."""
    g = torch.Generator().manual_seed(11)
    V = 301
    spec = token_logprobs_spec(V, torch.bfloat16) if op == "token_logprobs" else full_kl_spec(
        V, torch.bfloat16)  # fmt: skip
    targets = _targets(spec, g, 2)
    with emulated(0, **{op: "cpp"}), batch_invariant(mode == "invariant"):
        if mode == "invariant":
            check_invariant(spec, targets, g, sizes=(1, 3, 6), thread_counts=(1,))
        else:
            with pytest.raises(AssertionError, match="differ"):
                check_invariant(spec, targets, g, sizes=(3, 6), thread_counts=(1,))


_VOCAB_PARALLEL_SCRIPT = r"""
import os, socket, sys, torch, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
import ppo_kernels as pk
g = torch.Generator().manual_seed(0)
h = torch.randn(37, 16, generator=g); W = torch.randn(40, 16, generator=g)
y = torch.randint(0, 40, (37,), generator=g); y[5] = -100
def run(n):
    hh, WW = h[:n].clone().requires_grad_(), W.clone().requires_grad_()
    with pk.batch_invariant():
        lp, ent = pk.linear_token_logprobs(
            hh, WW, y[:n], process_group=dist.group.WORLD, return_entropy=True)
        (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), ent.detach(), hh.grad
many, few = run(37), run(7)
for a, b in zip(many, few):
    assert torch.equal(a[:7], b), (a[:7] - b).abs().max()
print("OK")
# os._exit, not a teardown: gloo's threads can abort a finished process at exit ("terminate
# called without an active exception"; tests/support/dist_workers.py), failing a run whose checks passed
sys.stdout.flush()
os._exit(0)
"""


def test_vocab_parallel_linear_token_logprobs_in_the_mode():
    """The vocab-parallel form under the mode (its chunks are padded like the single-device op's:
    it failed on the padded tile before): a row's outputs and hidden gradient alone among 7 or
    37 rows, bitwise (one gloo rank; the sharded result itself: tests/ops/test_distributed.py)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _VOCAB_PARALLEL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
