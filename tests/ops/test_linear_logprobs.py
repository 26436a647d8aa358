"""linear_token_logprobs against token_logprobs' float64 reference on materialised logits."""

import itertools
import os

import pytest
import torch
from support.skips import need_backend
from support.utils import PassThroughMode, cpu_backends, peak_extra_bytes, poisoned

import ppo_kernels
import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.fused_linear.planner import plan_chunks
from ppo_kernels.linear_logprobs import naive

BACKENDS = cpu_backends("linear_token_logprobs")
B, T, H, V = 2, 9, 19, 103  # odd H and V: no divisibility anywhere
# A budget that forces vocabulary chunks (a few rows x ~40 vocab entries per tile).
TINY = 1000


def _inputs(dtype, bias=True, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) * 0.8).to(dtype)
    W = (torch.randn(V, H, generator=g) * 0.6).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 2] = ignore_index
    labels[1, 5] = ignore_index
    labels[1, 0] = V - 1  # the last vocabulary entry (last chunk, ragged tail)
    return h, W, b, labels


def _ref(h, W, b, labels, temperature, ignore_index):
    """float64 token_logprobs on the materialised float64 logits, differentiable."""
    from ppo_kernels.token_logprobs import naive as tl_ref

    z = naive.logits(h, W, b)
    lp, ent, _ = tl_ref.forward(z, labels, temperature, ignore_index, True)
    return lp, ent


def _ours(leaves, labels, temperature, budget, **kw):
    """(log-probs, entropy) of linear_token_logprobs on (hidden, weight, bias)."""
    h, W, b = leaves
    return ppo_kernels.linear_token_logprobs(
        h,
        W,
        labels,
        bias=b,
        temperature=temperature,
        return_entropy=True,
        max_chunk_bytes=budget,
        **kw,
    )


# Forward outputs are float32 from float32 accumulation over H and V; the reference sees the same
# (dtype-rounded) inputs, so the error is float32 rounding only.
FWD_TOL = dict(atol=2e-5, rtol=2e-5)


def test_plan_respects_budget_and_chunks_vocabulary():
    for N, V_, H_, dt, budget in [
        (4096, 152064, 4096, torch.bfloat16, 64 << 20),
        (18, 103, 19, torch.float32, TINY),
        (1000, 50000, 64, torch.float32, 1 << 20),
        (7, 11, 3, torch.float16, 1),
    ]:
        p = plan_chunks(N, V_, H_, dt, "cpu", budget)
        assert 1 <= p.rows <= N and 1 <= p.vocab <= V_ and 1 <= p.sub <= p.vocab
        used = (
            p.rows * p.vocab * 4
            + p.rows * H_ * 4 * (2 if p.upcast else 1)
            + ((V_ if p.whole_weight else p.sub) * H_ * 4 if p.upcast else 0)
        )
        assert used <= max(budget, 4 * (V_ + 2 * H_ + H_)), (p, used, budget)
    assert plan_chunks(18, V, H, torch.float32, "cpu", TINY).vocab < V
    assert plan_chunks(18, V, H, torch.float32, "cpu", 1 << 20).vocab == V


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("budget", [None, TINY])
def test_forward_matches_reference(backend, dtype, bias, budget):
    h, W, b, labels = _inputs(dtype, bias)
    ref_lp, ref_ent = _ref(h, W, b, labels, 0.7, -100)
    with use_backend(linear_token_logprobs=backend), poisoned():
        lp, ent = ppo_kernels.linear_token_logprobs(
            h, W, labels, bias=b, temperature=0.7, return_entropy=True, max_chunk_bytes=budget
        )
        lp_only = ppo_kernels.linear_token_logprobs(
            h, W, labels.int(), bias=b, temperature=0.7, max_chunk_bytes=budget
        )
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == labels.shape
    torch.testing.assert_close(lp.double(), ref_lp, **FWD_TOL)
    torch.testing.assert_close(ent.double(), ref_ent, **FWD_TOL)
    torch.testing.assert_close(lp_only, lp, atol=0, rtol=0)
    assert (lp[labels == -100] == 0).all() and (ent[labels == -100] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [None, TINY])
@pytest.mark.parametrize("which", ["both", "logprobs", "entropy"])
def test_gradients_match_reference(backend, dtype, budget, which):
    ignore_index = 5  # an in-vocabulary id used as ignore_index
    h, W, b, labels = _inputs(dtype, True, ignore_index)
    labels[labels == ignore_index] = 6
    labels[0, 2] = labels[1, 5] = ignore_index
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(B, T, generator=g) if which != "entropy" else None
    g_ent = torch.randn(B, T, generator=g) if which != "logprobs" else None

    def loss(lp, ent):
        out = 0
        if g_lp is not None:
            out = out + (lp * g_lp.to(lp.dtype)).sum()
        if g_ent is not None:
            out = out + (ent * g_ent.to(ent.dtype)).sum()
        return out

    leaves = [t.detach().double().requires_grad_() for t in (h, W, b)]
    loss(*_ref(*leaves, labels, 1.3, ignore_index)).backward()
    ref_grads = [t.grad for t in leaves]

    ours = [t.detach().clone().requires_grad_() for t in (h, W, b)]
    with use_backend(linear_token_logprobs=backend), poisoned():
        lp, ent = _ours(ours, labels, 1.3, budget, ignore_index=ignore_index)
        loss(lp, ent).backward()
    # Accumulation is float32 throughout (the CPU upcasts bf16 chunks); the only other error is
    # rounding the returned gradient to the input dtype.
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-4, rtol=1.6e-2)
    for name, t, ref in zip(("hidden", "weight", "bias"), ours, ref_grads):
        assert t.grad.dtype == dtype, name
        torch.testing.assert_close(t.grad.double(), ref, **tol, msg=lambda m: f"{name}: {m}")
    assert (ours[0].grad[labels == ignore_index] == 0).all()


@pytest.mark.parametrize("budget", [None, 100])
def test_gradcheck_float64(budget):
    torch.manual_seed(0)
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    W = torch.randn(13, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 12, -100, 7, 3])

    def f(h, W, b):
        lp, ent = ppo_kernels.linear_token_logprobs(
            h, W, labels, bias=b, temperature=0.9, return_entropy=True, max_chunk_bytes=budget
        )
        return lp, ent

    if budget:
        assert plan_chunks(5, 13, 4, torch.float64, "cpu", budget).vocab < 13
    assert torch.autograd.gradcheck(f, (h, W, b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    h, W, b, labels = _inputs(torch.float32)
    h, W, b = (t.reshape(-1, H) if t.dim() == 3 else t for t in (h, W, b))
    h.requires_grad_(), W.requires_grad_(), b.requires_grad_()
    with use_backend(linear_token_logprobs=backend):
        for budget in (0, TINY):
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_token_logprobs,
                (h, W, labels.reshape(-1), b, 0.8, -100, True, budget),
                **only,
            )
        torch.library.opcheck(
            torch.ops.ppo_kernels.linear_token_logprobs,
            (h, W, labels.reshape(-1), None, 1.0, -100, False, 0),
            **only,
        )
        y = labels.reshape(-1)
        lp, ent, lse = torch.ops.ppo_kernels.linear_token_logprobs(
            h.detach(), W.detach(), y, b.detach(), 0.8, -100, True, TINY
        )
        for budget in (0, TINY):
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_token_logprobs_backward.default,
                (
                    torch.randn_like(lp),
                    torch.randn_like(ent),
                    h.detach(),
                    W.detach(),
                    y,
                    b.detach(),
                    lse,
                    ent,
                    0.8,
                    -100,
                    budget,
                    True,
                    True,
                    True,
                ),
                **only,
            )


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    h, W, b, labels = _inputs(torch.float32)
    hc, Wc = h.clone().requires_grad_(), W.clone().requires_grad_()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(h, W, labels):
        lp, ent = ppo_kernels.linear_token_logprobs(
            h * 1.0, W, labels, temperature=0.9, return_entropy=True, max_chunk_bytes=TINY
        )
        return (lp * 2).sum() + ent.sum()

    f(hc, Wc, labels).backward()
    he, We = h.clone().requires_grad_(), W.clone().requires_grad_()
    lp, ent = ppo_kernels.linear_token_logprobs(
        he, We, labels, temperature=0.9, return_entropy=True, max_chunk_bytes=TINY
    )
    ((lp * 2).sum() + ent.sum()).backward()
    torch.testing.assert_close(hc.grad, he.grad)
    torch.testing.assert_close(Wc.grad, We.grad)


def test_weight_gradient_accumulates_in_float32():
    """The backward op's float32 weight gradient is more accurate than its bf16 rounding."""
    h, W, b, labels = _inputs(torch.bfloat16, False)
    h2, lab = h.reshape(-1, H), labels.reshape(-1)
    lp, ent, lse = torch.ops.ppo_kernels.linear_token_logprobs(h2, W, lab, None, 1.0, -100, True, 0)
    g = torch.randn_like(lp)
    gh, gW, gb = torch.ops.ppo_kernels.linear_token_logprobs_backward(
        g, None, h2, W, lab, None, lse, ent, 1.0, -100, 0, True, True, False
    )
    assert gW.dtype == torch.float32 and gb.numel() == 0 and gh.dtype == torch.bfloat16
    Wd = W.double().requires_grad_()
    (_ref(h2, Wd, None, lab, 1.0, -100)[0] * g.double()).sum().backward()
    torch.testing.assert_close(gW.double(), Wd.grad, atol=2e-5, rtol=1e-4)


def test_frozen_weight_and_empty_input():
    h, W, b, labels = _inputs(torch.float32)
    hh = h.clone().requires_grad_()
    ppo_kernels.linear_token_logprobs(hh, W, labels, bias=b).sum().backward()
    assert hh.grad is not None and W.grad is None
    empty = ppo_kernels.linear_token_logprobs(
        torch.zeros(0, H), W, torch.zeros(0, dtype=torch.long)
    )
    assert empty.shape == (0,)


def test_nan_hidden_row_gives_nan_only_there():
    h, W, b, labels = _inputs(torch.float32)
    h[1, 3, 4] = float("nan")
    for budget in (None, TINY):
        lp, ent = ppo_kernels.linear_token_logprobs(
            h, W, labels, bias=b, return_entropy=True, max_chunk_bytes=budget
        )
        assert lp[1, 3].isnan() and ent[1, 3].isnan()
        ok = torch.ones_like(labels, dtype=torch.bool)
        ok[1, 3] = False
        assert lp[ok].isfinite().all() and ent[ok].isfinite().all()


def test_bad_inputs():
    h, W, b, labels = _inputs(torch.float32)
    f = ppo_kernels.linear_token_logprobs
    bad = labels.clone()
    bad[0, 0] = V
    with pytest.raises(IndexError, match="labels"):
        f(h, W, bad)
    with pytest.raises(IndexError, match="labels"):
        f(h, W, bad, max_chunk_bytes=TINY)
    with pytest.raises(TypeError, match="weight"):
        f(h, W.double(), labels)
    with pytest.raises(ValueError, match="weight"):
        f(h, W[:, :-1], labels)
    with pytest.raises(ValueError, match="bias"):
        f(h, W, labels, bias=b[:-1])
    with pytest.raises(ValueError, match="labels"):
        f(h, W, labels[:, :-1])
    with pytest.raises(TypeError, match="labels"):
        f(h, W, labels.float())
    with pytest.raises(ValueError, match="temperature"):
        f(h, W, labels, temperature=0.0)
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        f(h, W, labels, max_chunk_bytes=-1)


def test_peak_memory_bounded_where_logits_would_not_fit():
    N, H_, V_ = 1024, 32, 8192
    budget = 2 << 20
    h = torch.randn(N, H_, requires_grad=True)
    W = torch.randn(V_, H_, requires_grad=True)
    labels = torch.randint(0, V_, (N,))
    logits_bytes = N * V_ * 4  # 32 MiB

    def ours():
        lp, ent = ppo_kernels.linear_token_logprobs(
            h, W, labels, return_entropy=True, max_chunk_bytes=budget
        )
        (lp.sum() + ent.sum()).backward()

    def materialised():
        lp, ent = ppo_kernels.token_logprobs(h @ W.T, labels, return_entropy=True)
        (lp.sum() + ent.sum()).backward()

    # outputs and gradients we cannot avoid: grad_hidden, grad_weight (float32), O(N) vectors
    unavoidable = (N * H_ + V_ * H_) * 4 + 16 * N * 4
    peak = peak_extra_bytes(ours)
    peak_mat = peak_extra_bytes(materialised)
    assert peak_mat >= logits_bytes  # the profiler sees the logits: the measurement works
    assert peak <= budget + unavoidable + (1 << 20), (peak, budget, unavoidable)
    assert peak < logits_bytes / 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_vocabulary_several_blocks_per_tile(backend):
    """V beyond one kernel block (C++: 2048, Triton: 4096 entries): the in-tile merge runs too."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(4, 8, generator=g)
    W = torch.randn(9001, 8, generator=g)
    labels = torch.tensor([0, 9000, 4500, -100])
    ref_lp, ref_ent = _ref(h, W, None, labels, 1.0, -100)
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    for budget in (None, 100_000):  # whole vocabulary; two vocabulary chunks
        hh.grad = WW.grad = None
        with use_backend(linear_token_logprobs=backend), poisoned():
            lp, ent = ppo_kernels.linear_token_logprobs(
                hh, WW, labels, return_entropy=True, max_chunk_bytes=budget
            )
            (lp.sum() + ent.sum()).backward()
        torch.testing.assert_close(lp.double(), ref_lp, **FWD_TOL)
        torch.testing.assert_close(ent.double(), ref_ent, **FWD_TOL)
        assert hh.grad.isfinite().all() and WW.grad.isfinite().all()
    assert plan_chunks(4, 9001, 8, torch.float32, "cpu", 100_000).vocab < 9001


def test_square_tiles_plan(monkeypatch):
    """The "square" tiling (PPO_KERNELS_LINEAR_TILES=square, for GPU measurements) is exact too."""
    p = plan_chunks(32768, 152064, 4096, torch.bfloat16, "cuda", 1 << 30, tiles="square")
    assert 8000 < p.rows < 16000 and 8000 < p.vocab < 16000
    monkeypatch.setenv("PPO_KERNELS_LINEAR_TILES", "square")
    h, W, b, labels = _inputs(torch.float32)
    assert plan_chunks(B * T, V, H, torch.float32, "cpu", 4000).vocab < V
    ref_lp, ref_ent = _ref(h, W, b, labels, 1.0, -100)
    hh = h.clone().requires_grad_()
    lp, ent = ppo_kernels.linear_token_logprobs(
        hh, W, labels, bias=b, return_entropy=True, max_chunk_bytes=4000
    )
    torch.testing.assert_close(lp.double(), ref_lp, **FWD_TOL)
    torch.testing.assert_close(ent.double(), ref_ent, **FWD_TOL)
    (lp.sum() + ent.sum()).backward()
    hd = h.double().requires_grad_()
    sum(_ref(hd, W, b, labels, 1.0, -100)).sum().backward()
    torch.testing.assert_close(hh.grad.double(), hd.grad, atol=2e-5, rtol=1e-4)
    monkeypatch.setenv("PPO_KERNELS_LINEAR_TILES", "bogus")
    with pytest.raises(ValueError, match="PPO_KERNELS_LINEAR_TILES"):  # (a budget: not one tile)
        ppo_kernels.linear_token_logprobs(h, W, labels, max_chunk_bytes=4000)


@pytest.mark.parametrize("kernels", ["eager", "triton"])
def test_tile_kernels_give_nan_for_out_of_range_labels(kernels):
    """The GPU contract (no host check there): a label outside [0, V) gives NaN for that row's
    log-prob, entropy and gradient, never an out-of-bounds read; other rows are unaffected."""
    if kernels == "triton":
        need_backend("linear_token_logprobs", "triton")
    if kernels == "eager":
        mod = naive
    else:
        from ppo_kernels.linear_logprobs import triton_kernels as mod
    V_ = 10
    tile = torch.randn(4, V_)
    labels = torch.tensor([3, V_ + 2, -100, -7])
    state = torch.zeros(3, 4)
    state[0] = float("-inf")
    zl = torch.full((4,), float("nan"))
    for v0 in (0, 6):  # two vocabulary chunks
        mod.tile_stats_(
            tile[:, v0 : min(V_, v0 + 6)].contiguous(), labels, v0, 1.0, -100, state, zl
        )
    lp, ent, lse = naive.finalize(state, zl, labels, V_, -100)
    ref = torch.log_softmax(tile.double(), -1)
    torch.testing.assert_close(lp[0].double(), ref[0, 3], atol=1e-6, rtol=1e-6)
    assert lp[1].isnan() and ent[1].isnan() and lp[3].isnan() and ent[3].isnan()
    assert lp[2] == 0 and ent[2] == 0
    g = tile[:, :6].contiguous()
    mod.tile_bwd_(g, labels, 0, lse, ent, torch.ones(4), None, 1.0, -100, V_)
    assert g[1].isnan().all() and g[3].isnan().all() and (g[2] == 0).all() and g[0].isfinite().all()


# ---- logits_dtype="input": matmuls in the input dtype, as materialised bf16/fp16 logits ----------

# forces vocabulary chunks of ~77 entries x 2 rows with input-dtype tiles
INPUT_TINY = 1500


def _materialised(h, W, b, labels, temperature, ignore_index):
    """What a trainer gets today: the logits materialised in the input dtype, then token_logprobs."""
    z = h @ W.T
    if b is not None:
        z = z + b
    return ppo_kernels.token_logprobs(
        z, labels, temperature=temperature, ignore_index=ignore_index, return_entropy=True
    )


def test_input_logits_dtype_plan_respects_budget():
    for N, V_, H_, budget in [
        (4096, 152064, 4096, 64 << 20),
        (18, 103, 19, INPUT_TINY),
        (1000, 50000, 64, 1 << 20),
        (7, 11, 3, 1),
    ]:
        for fused, dev in itertools.product((True, False), ("cpu", "cuda")):
            p = plan_chunks(
                N, V_, H_, torch.bfloat16, dev, budget, logits_dtype="input", fused=fused
            )
            assert p.input_tiles and not p.upcast
            assert 1 <= p.rows <= N and 1 <= p.vocab <= V_ and 1 <= p.sub <= p.vocab
            f32_copy = not fused or p.vocab < V_
            used = p.rows * p.vocab * (2 + 4 * f32_copy)
            # CUDA: the float32-output matmuls need no input-dtype product buffers
            used += p.rows * H_ * 4 if dev == "cuda" else p.rows * H_ * 10 + p.sub * H_ * 6
            assert used <= max(budget, 2 * (3 * V_ + 5 * H_ + 3 * H_)), (p, used, budget)
    big = dict(logits_dtype="input", fused=True)
    assert (
        plan_chunks(4096, 152064, 4096, torch.bfloat16, "cuda", 1 << 30, **big).rows
        > plan_chunks(4096, 152064, 4096, torch.bfloat16, "cpu", 1 << 30, **big).rows
    )
    # the float32 copy of vocabulary chunks only when the fused kernels cannot take the tile
    assert (
        plan_chunks(4096, 1000, 16, torch.bfloat16, "cpu", 1 << 20, logits_dtype="input").rows
        > plan_chunks(
            4096, 1000, 16, torch.bfloat16, "cpu", 1 << 20, logits_dtype="input", fused=False
        ).rows
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("budget", [None, INPUT_TINY])  # whole vocabulary; chunks
@pytest.mark.parametrize("f32_out", [False, True])  # True: the GPU's float32-output matmuls
def test_input_logits_dtype_matches_materialised_logits(
    request, backend, dtype, bias, budget, f32_out
):
    """f32_out: as on CUDA, the gradient products are accumulated into the float32 sums by
    matmuls with float32 output (emulated here) instead of rounded per chunk and added."""
    mms = request.getfixturevalue("lowp_on_cpu") if f32_out else None
    h, W, b, labels = _inputs(dtype, bias)
    assert (
        plan_chunks(B * T, V, H, dtype, "cpu", budget or (64 << 20), logits_dtype="input").vocab < V
    ) == (budget is not None)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    ref = [t.clone().requires_grad_() if t is not None else None for t in (h, W, b)]
    ref_lp, ref_ent = _materialised(*ref, labels, 0.7, -100)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()

    ours = [t.clone().requires_grad_() if t is not None else None for t in (h, W, b)]
    # (a whole-vocabulary budget keeps an f32_out call off the one-tile path, whose C++ matmuls
    # the emulation does not see)
    loop_budget = 1 << 30 if f32_out and budget is None else budget
    with use_backend(linear_token_logprobs=backend), poisoned():
        lp, ent = ppo_kernels.linear_token_logprobs(
            ours[0],
            ours[1],
            labels,
            bias=ours[2],
            temperature=0.7,
            return_entropy=True,
            max_chunk_bytes=loop_budget,
            logits_dtype="input",
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    # Same input-dtype logits, same float32 reduction: float32 rounding only.
    torch.testing.assert_close(lp, ref_lp, **FWD_TOL)
    torch.testing.assert_close(ent, ref_ent, **FWD_TOL)
    # The test can fail: float32 logits tiles give measurably different values.
    lp32 = ppo_kernels.linear_token_logprobs(h, W, labels, bias=b, temperature=0.7)
    assert (lp32 - ref_lp).abs().max() > 20 * FWD_TOL["atol"]
    # Gradients: the same input-dtype products; the only difference allowed is rounding partial
    # sums to the input dtype per chunk (grad_weight per row chunk, grad_hidden per vocabulary
    # chunk) before the float32 sum across chunks.
    eps = torch.finfo(dtype).eps
    for name, t, r in zip(("hidden", "weight", "bias"), ours, ref):
        if t is None:
            continue
        assert t.grad.dtype == dtype, name
        scale = r.grad.float().abs().max().item()
        torch.testing.assert_close(
            t.grad.float(),
            r.grad.float(),
            atol=2 * eps * scale,
            rtol=0,
            msg=lambda m: f"{name}: {m}",
        )
    assert (ours[0].grad[labels == -100] == 0).all()
    if f32_out:  # the gradient products went through the float32-output matmuls
        adds = [w for w in mms if w[0] == "addmm"]
        assert adds and all(w[1] == dtype for w in adds), mms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_input_logits_dtype_is_ignored_for_float32_and_float64(dtype):
    h, W, b, labels = _inputs(dtype)
    outs = []
    for mode in ("float32", "input"):
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
        lp, ent = ppo_kernels.linear_token_logprobs(
            hh, WW, labels, bias=b, return_entropy=True, max_chunk_bytes=TINY, logits_dtype=mode
        )
        (lp.sum() + ent.sum()).backward()
        outs.append((lp, ent, hh.grad, WW.grad))
    for a, c in zip(*outs):
        torch.testing.assert_close(a, c, atol=0, rtol=0)
    with pytest.raises(ValueError, match="logits_dtype"):
        ppo_kernels.linear_token_logprobs(h, W, labels, logits_dtype="bfloat16")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_input_logits_dtype(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    h, W, b, labels = _inputs(torch.bfloat16)
    h, y = h.reshape(-1, H), labels.reshape(-1)
    with use_backend(linear_token_logprobs=backend):
        for budget in (0, INPUT_TINY):
            args = (
                h.clone().requires_grad_(),
                W.clone().requires_grad_(),
                y,
                b.clone().requires_grad_(),
                0.8,
                -100,
                True,
                budget,
                "input",
            )
            torch.library.opcheck(torch.ops.ppo_kernels.linear_token_logprobs, args, **only)
            lp, ent, lse = torch.ops.ppo_kernels.linear_token_logprobs(
                h, W, y, b, 0.8, -100, True, budget, "input"
            )
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_token_logprobs_backward.default,
                (
                    torch.randn_like(lp),
                    torch.randn_like(ent),
                    h,
                    W,
                    y,
                    b,
                    lse,
                    ent,
                    0.8,
                    -100,
                    budget,
                    True,
                    True,
                    True,
                    "input",
                ),
                **only,
            )


def test_torch_compile_fullgraph_input_logits_dtype():
    torch._dynamo.reset()
    h, W, b, labels = _inputs(torch.bfloat16, False)
    grads = []
    for compiled in (True, False):
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()

        def f(h, W, labels):
            lp, ent = ppo_kernels.linear_token_logprobs(
                h * 1.0,
                W,
                labels,
                return_entropy=True,
                max_chunk_bytes=INPUT_TINY,
                logits_dtype="input",
            )
            return lp.sum() + ent.sum()

        fn = torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f
        fn(hh, WW, labels).backward()
        grads.append((hh.grad, WW.grad))
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, atol=0, rtol=0)


def test_peak_memory_bounded_with_input_logits_dtype():
    N, H_, V_ = 1024, 32, 16384
    budget = 2 << 20
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H_, generator=g).bfloat16().requires_grad_()
    W = torch.randn(V_, H_, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, V_, (N,), generator=g)
    logits_bytes = N * V_ * 2  # 32 MiB of bf16 logits

    def ours():
        lp, ent = ppo_kernels.linear_token_logprobs(
            h, W, labels, return_entropy=True, max_chunk_bytes=budget, logits_dtype="input"
        )
        (lp.sum() + ent.sum()).backward()

    def materialised():
        lp, ent = ppo_kernels.token_logprobs(h @ W.T, labels, return_entropy=True)
        (lp.sum() + ent.sum()).backward()

    # grad_hidden (bf16), the float32 grad_weight accumulator and its bf16 copy, O(N) vectors
    unavoidable = N * H_ * 2 + V_ * H_ * (4 + 2) + 16 * N * 4
    # and the BLAS's own scratch for one chunk's products (a CPU without native bf16 GEMMs
    # converts the operands: measured, not assumed)
    plan = plan_chunks(N, V_, H_, torch.bfloat16, "cpu", budget, "rows", "input", True)
    hc, Wd = h.detach()[: plan.rows], W.detach()
    gz = torch.zeros(plan.rows, V_, dtype=torch.bfloat16)
    out = [torch.empty(s, dtype=torch.bfloat16) for s in (gz.shape, hc.shape, (plan.sub, H_))]
    unavoidable += max(
        peak_extra_bytes(lambda: torch.mm(hc, Wd.T, out=out[0])),
        peak_extra_bytes(lambda: torch.mm(gz, Wd, out=out[1])),
        peak_extra_bytes(lambda: torch.mm(gz[:, : plan.sub].T, hc, out=out[2])),
    )
    h.grad = W.grad = None
    peak = peak_extra_bytes(ours)
    h.grad = W.grad = None
    peak_mat = peak_extra_bytes(materialised)
    assert peak_mat >= logits_bytes
    assert peak <= budget + unavoidable + (1 << 20), (peak, budget, unavoidable)
    assert peak < logits_bytes / 4


@pytest.mark.parametrize("budget", [None, 1 << 14])
@pytest.mark.parametrize("entropy", [False, True])
def test_softcap(budget, entropy):
    """Gemma-2 soft-capping: softcap * tanh(logits / softcap) before the temperature, against the
    float64 materialised composition, gradients to hidden, weight and bias included."""
    g = torch.Generator().manual_seed(3)
    N, H, V, cap, T = 9, 8, 50, 3.0, 0.8
    h = torch.randn(N, H, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=g)
    y[2] = -100

    def ref(h, w, b):
        z = cap * torch.tanh((h @ w.T + b) / cap) / T
        lsm = torch.log_softmax(z, -1)
        lp = torch.where(y == -100, 0.0, lsm.gather(-1, y.clamp(min=0)[:, None])[:, 0])
        ent = torch.where(y == -100, 0.0, -(lsm.exp() * lsm).sum(-1))
        return lp + 0.3 * ent if entropy else lp

    def ours(h, w, b):
        out = pk.linear_token_logprobs(
            h,
            w,
            y,
            bias=b,
            temperature=T,
            softcap=cap,
            return_entropy=entropy,
            max_chunk_bytes=budget,
        )
        return out[0] + 0.3 * out[1] if entropy else out

    for backend in cpu_backends("linear_token_logprobs"):
        with pk.use_backend(linear_token_logprobs=backend):
            args32 = [t.float().requires_grad_(True) for t in (h, w, b)]
            got = ours(*args32)
            args64 = [t.clone().requires_grad_(True) for t in (h, w, b)]
            exp = ref(*args64)
            torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5)
            got.sum().backward()
            exp.sum().backward()
            for a, e in zip(args32, args64):
                torch.testing.assert_close(a.grad.double(), e.grad, rtol=1e-4, atol=1e-5)
    args = [t.clone().requires_grad_(True) for t in (h[:4], w[:12], b[:12])]
    y4 = y[:4].clamp(0, 11)
    assert torch.autograd.gradcheck(
        lambda *a: pk.linear_token_logprobs(a[0], a[1], y4, bias=a[2], softcap=cap), args
    )
    with pytest.raises(ValueError, match="softcap"):
        pk.linear_token_logprobs(h.float(), w.float(), y, softcap=0.0)


@pytest.fixture
def lowp_on_cpu(monkeypatch):
    """Run the CUDA bf16/fp16 path ("lowp": no upcast, matmuls with float32 output, the gradient
    tile rounded to the input dtype for the backward matmuls) on the CPU. The planner treats the
    CPU as a device with such matmuls and they are emulated by float32 matmuls of the upcast
    inputs, whose products are exact in float32 -- what cuBLAS computes up to summation order."""
    from ppo_kernels.fused_linear import planner, tiler

    monkeypatch.setattr(planner, "F32_OUT_MATMUL_DEVICES", ("cuda", "cpu"))

    written = []  # ("mm" / "addmm", input dtype) of each matmul; (backend, tile, gradient dtypes)

    def mm_f32(a, b, out):
        assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
        written.append(("mm", a.dtype))
        torch.mm(a.float(), b.float(), out=out)

    def addmm_f32(c, a, b):
        assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
        written.append(("addmm", a.dtype))
        c.addmm_(a.float(), b.float())

    monkeypatch.setattr(tiler.Tiler, "mm_f32", staticmethod(mm_f32))
    monkeypatch.setattr(tiler.Tiler, "addmm_f32", staticmethod(addmm_f32))
    # the dtypes of the whole-vocabulary gradient tiles the token_logprobs kernels write
    from ppo_kernels.token_logprobs import op as tl_op

    for name, impl in list(tl_op.backward.impls.items()):

        def spy(*args, _impl=impl, _name=name):
            written.append((_name, args[0].dtype, args[-1].dtype))
            return _impl(*args)

        monkeypatch.setitem(tl_op.backward.impls, name, spy)
    return written


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("budget", [None, TINY])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_lowp_path_emulated_on_cpu(lowp_on_cpu, backend, dtype, budget, softcap):
    """The GPU's bf16/fp16 path (float32 tiles from bf16 matmuls; with Triton, the gradient tile
    rounded to bf16 as the kernel stores it, never written in float32) against the float64
    reference: forward, and the gradients of hidden, weight and bias."""
    h, W, b, labels = _inputs(dtype, True)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    leaves = [t.detach().double().requires_grad_() for t in (h, W, b)]
    z = naive.logits(*leaves)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    from ppo_kernels.token_logprobs import naive as tl_ref

    ref_lp, ref_ent, _ = tl_ref.forward(z, labels, 0.7, -100, True)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    ours = [t.detach().clone().requires_grad_() for t in (h, W, b)]
    with use_backend(linear_token_logprobs=backend), poisoned():
        # (None: a whole-vocabulary budget, which keeps the call off the one-tile path: its C++
        # matmuls are not the emulated ones)
        lp, ent = _ours(ours, labels, 0.7, budget or (1 << 30), softcap=softcap)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    # softcap's tanh is computed on the float32 tile: float32 rounding only
    torch.testing.assert_close(lp.double(), ref_lp, **FWD_TOL)
    torch.testing.assert_close(ent.double(), ref_ent, **FWD_TOL)
    # the gradient tile is rounded to the input dtype before the matmuls (as a bf16 model's
    # materialised grad_logits is), then the result to the input dtype: two roundings
    eps = torch.finfo(dtype).eps
    for name, t, ref in zip(("hidden", "weight", "bias"), ours, leaves):
        assert t.grad.dtype == dtype, name
        torch.testing.assert_close(
            t.grad.double(),
            ref.grad,
            atol=4 * eps * ref.grad.abs().max(),
            rtol=2 * eps,
            msg=lambda m: f"{name}: {m}",
        )
    mms = [w for w in lowp_on_cpu if w[0] in ("mm", "addmm")]
    assert {w[0] for w in mms} == {"mm", "addmm"} and all(w[1] == dtype for w in mms)
    whole = [w for w in lowp_on_cpu if w[0] not in ("mm", "addmm")]
    if budget is None and backend != "eager":
        # whole-vocabulary tiles (float32) went through the token_logprobs kernels; Triton writes
        # the input-dtype gradient straight from them unless softcap's derivative must multiply it
        direct = backend == "triton" and not softcap
        assert whole and all(w[0] == backend and w[1] == torch.float32 for w in whole), whole
        assert all(w[2] == (dtype if direct else torch.float32) for w in whole), whole
    else:
        assert not whole, whole  # vocabulary chunks: the per-chunk tile kernels


def test_fallback_without_the_extension():
    """Without the compiled extension there is no registered op: the API runs the same chunk loop
    (eager tile kernels on the CPU) in an autograd.Function, its arguments checked in Python.
    Forward against the float64 reference (chunked vocabulary too), gradcheck, and the errors."""
    import os
    import subprocess
    import sys

    code = """
import torch, ppo_kernels as pk
from ppo_kernels import _backend
from ppo_kernels.linear_logprobs import naive as R
assert not _backend.HAS_EXTENSION
g = torch.Generator().manual_seed(0)
h = torch.randn(6, 5, dtype=torch.float64, generator=g).requires_grad_()
W = torch.randn(11, 5, dtype=torch.float64, generator=g).requires_grad_()
b = torch.randn(11, dtype=torch.float64, generator=g).requires_grad_()
y = torch.randint(0, 11, (6,), generator=g)
y[2] = -100
for budget in (None, 300):  # 300 bytes: vocabulary chunks
    def f(h, W, b):
        return pk.linear_token_logprobs(h, W, y, bias=b, temperature=0.8, return_entropy=True,
                                        max_chunk_bytes=budget)
    lp, ent = f(h, W, b)
    lp_r, ent_r, _ = R.forward(h, W, y, b, 0.8)
    torch.testing.assert_close((lp, ent), (lp_r, ent_r))
    assert torch.autograd.gradcheck(f, (h, W, b))
lp = pk.linear_token_logprobs(h.float(), W.float(), y, bias=b.float())
assert lp.dtype == torch.float32 and lp.shape == (6,)
for exc, arg, call in (
    (IndexError, "labels", lambda: pk.linear_token_logprobs(h, W, torch.full((6,), 11))),
    (ValueError, "weight", lambda: pk.linear_token_logprobs(h, W[:, :2], y)),
    (TypeError, "weight", lambda: pk.linear_token_logprobs(h, W.float(), y)),
    (ValueError, "bias", lambda: pk.linear_token_logprobs(h, W, y, bias=b[:3])),
):
    try:
        call()
    except exc as e:
        assert str(e).startswith(arg + ":"), e
    else:
        raise AssertionError(f"no {exc.__name__} for {arg}")
print("OK")
"""
    from support import ROOT as root

    env = dict(os.environ, PPO_KERNELS_NO_EXTENSION="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------- logits_dtype="auto"
@pytest.fixture
def auto_logits_dtype(monkeypatch):
    """logits_dtype="auto" unpinned (conftest pins it to float32 for the suite), with the CPU's
    bf16 / fp16 support set by the test: set(bf16=..., fp16=...)."""
    from ppo_kernels.fused_linear import planner

    monkeypatch.setattr(planner, "_ENV_DEFAULT", "auto")

    def set_support(bf16, fp16=False):
        monkeypatch.setattr(planner, "_CPU_NATIVE", {torch.bfloat16: bf16, torch.float16: fp16})

    return set_support


@pytest.mark.parametrize("native", [False, True])
def test_auto_logits_dtype_follows_the_cpus_bf16_support(auto_logits_dtype, native):
    auto_logits_dtype(bf16=native, fp16=False)
    want = "input" if native else "float32"
    assert pk.default_logits_dtype(torch.bfloat16, torch.device("cpu")) == want
    assert pk.default_logits_dtype(torch.bfloat16, "cpu") == want
    # fp16 follows its own support; CUDA is float32 tiles (faster there:
    # bench/results/gpu_H200.md); float32 inputs have float32 tiles whatever the mode
    assert pk.default_logits_dtype(torch.float16, "cpu") == "float32"
    assert pk.default_logits_dtype(torch.bfloat16, torch.device("cuda", 0)) == "float32"
    assert pk.default_logits_dtype(torch.float32, "cpu") == "float32"
    # the default call is the call with the resolved mode, bit for bit, and differs from the
    # other mode (the test can fail)
    h, W, b, labels = _inputs(torch.bfloat16)
    other = "float32" if native else "input"
    outs = {}
    for mode in ("auto", want, other):
        leaves = [t.clone().requires_grad_() for t in (h, W, b)]
        lp, ent = _ours(
            leaves, labels, 0.7, None, **({} if mode == "auto" else {"logits_dtype": mode})
        )
        (lp.sum() + ent.sum()).backward()
        outs[mode] = [lp, ent] + [t.grad for t in leaves]
    for a, r in zip(outs["auto"], outs[want]):
        assert torch.equal(a, r)
    assert not torch.equal(outs["auto"][0], outs[other][0])


def test_auto_logits_dtype_fp16_and_policy_loss(auto_logits_dtype):
    auto_logits_dtype(bf16=False, fp16=True)
    assert pk.default_logits_dtype(torch.float16, "cpu") == "input"
    assert pk.default_logits_dtype(torch.bfloat16, "cpu") == "float32"
    h, W, b, labels = _inputs(torch.float16)
    adv, old = torch.randn(B, T), torch.randn(B, T) - 4
    mask = torch.ones(B, T, dtype=torch.bool)
    runs = {
        mode: pk.linear_policy_loss(
            h, W, labels, adv, old, mask, bias=b, **({} if mode is None else {"logits_dtype": mode})
        )
        for mode in (None, "auto", "input", "float32")
    }
    for mode in (None, "auto"):
        assert torch.equal(runs[mode][0], runs["input"][0])
        assert torch.equal(runs[mode][1]["logprobs"], runs["input"][1]["logprobs"])
    assert not torch.equal(runs["auto"][1]["logprobs"], runs["float32"][1]["logprobs"])


def test_logits_dtype_environment_variable(tmp_path):
    """PPO_KERNELS_LOGITS_DTYPE fixes the default on every machine; a bad value is an error
    naming it, at import."""
    import subprocess
    import sys

    code = (
        "import torch, ppo_kernels as pk;"
        "print(pk.default_logits_dtype(torch.bfloat16, 'cpu'),"
        " pk.default_logits_dtype(torch.bfloat16, 'cuda'))"
    )
    for value, want in (("input", "input input"), ("float32", "float32 float32")):
        env = dict(os.environ, PPO_KERNELS_LOGITS_DTYPE=value)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == want.split()
    env = dict(os.environ, PPO_KERNELS_LOGITS_DTYPE="bf16")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "PPO_KERNELS_LOGITS_DTYPE" in out.stderr, out.stderr


def test_bad_logits_dtype_names_the_argument():
    h, W, b, labels = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="logits_dtype.*'auto'.*got 'bf16'"):
        pk.linear_token_logprobs(h, W, labels, logits_dtype="bf16")
    with pytest.raises(TypeError, match="logits_dtype"):
        pk.linear_token_logprobs(h, W, labels, logits_dtype=torch.bfloat16)


# ------------------------------------------------------------------------- one tile (small calls)
def _one_tile_calls():
    """Forward + backward calls the registered op ran as one tile in C++ (no chunk loop)."""
    return torch.ops.ppo_kernels_C.linear_token_logprobs_one_tile_calls()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["float32", "input"])
@pytest.mark.parametrize("bias", [True, False])
def test_small_calls_run_as_one_tile(dtype, mode, bias):
    """A call whose logits fit 64k elements runs as one tile (no chunk loop), forward and
    backward: same values and gradients as the chunk loop within the forward tolerance, and the
    float64 reference for float32 tiles."""
    h, W, b, labels = _inputs(dtype, bias)
    leaves = [None if t is None else t.clone().requires_grad_() for t in (h, W, b)]
    n0 = _one_tile_calls()
    with poisoned():
        lp, ent = _ours(leaves, labels, 0.7, None, logits_dtype=mode)
    assert lp.dtype == ent.dtype == torch.float32
    g = torch.Generator().manual_seed(4)
    gl, ge = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    with poisoned():
        ((lp * gl).sum() + (ent * ge).sum()).backward()
    assert _one_tile_calls() == n0 + 2
    loop = [None if t is None else t.clone().requires_grad_() for t in (h, W, b)]
    lp2, ent2 = _ours(loop, labels, 0.7, 1 << 30, logits_dtype=mode)  # a budget: the chunk loop
    ((lp2 * gl).sum() + (ent2 * ge).sum()).backward()
    assert _one_tile_calls() == n0 + 2
    torch.testing.assert_close(lp, lp2, **FWD_TOL)
    torch.testing.assert_close(ent, ent2, **FWD_TOL)
    assert lp[0, 2] == 0 and ent[1, 5] == 0  # ignored labels
    for t, r in zip(leaves, loop):
        if t is None:
            continue
        assert t.grad.dtype == t.dtype
        scale = r.grad.float().abs().max().item()
        eps = 2e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
        torch.testing.assert_close(t.grad.float(), r.grad.float(), atol=2 * eps * scale, rtol=0)
    if mode == "float32":  # float32 tiles: the float64 reference within float32 rounding
        ref_lp, ref_ent = _ref(h, W, b, labels, 0.7, -100)
        torch.testing.assert_close(lp.double(), ref_lp, **FWD_TOL)
        torch.testing.assert_close(ent.double(), ref_ent, **FWD_TOL)


@pytest.mark.parametrize("entropy", [True, False])
def test_one_tile_node_equals_the_registered_ops(entropy):
    """The one-tile graph node (plain tensors) and the registered ops' autograd (taken under a
    dispatch mode, as while tracing) give the same values and gradients bit for bit; a retained
    graph differentiates twice alike (the kept tile is not overwritten); an input modified in
    place after the forward is refused; asking for one gradient computes only that one."""
    h, W, b, labels = _inputs(torch.float32)
    g = torch.Generator().manual_seed(5)
    gl, ge = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    def run(mode):
        leaves = [t.clone().requires_grad_() for t in (h, W, b)]
        with mode:
            out = pk.linear_token_logprobs(
                leaves[0], leaves[1], labels, bias=leaves[2], return_entropy=entropy
            )
            lp, ent = out if entropy else (out, None)
            loss = (lp * gl).sum() + ((ent * ge).sum() if entropy else 0)
            grads = torch.autograd.grad(loss, leaves, retain_graph=True)
            again = torch.autograd.grad(loss, leaves)
        return lp, ent, grads, again, lp.grad_fn.next_functions[0][0].name()  # (under a view)

    import contextlib

    plain, traced = run(contextlib.nullcontext()), run(PassThroughMode())
    assert plain[4] == "LinearTokenLogprobsBackward" and plain[4] != traced[4]
    for x, y in zip(plain[:2], traced[:2]):
        if x is not None:
            assert torch.equal(x, y)
    for gx, gy, gz in zip(plain[2], traced[2], plain[3]):
        assert torch.equal(gx, gy) and torch.equal(gx, gz)
    hh = h.clone().requires_grad_()
    x = hh * 1.0
    lp = pk.linear_token_logprobs(x, W, labels)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()
    Wg = W.clone().requires_grad_()
    hg = h.clone().requires_grad_()
    (gh,) = torch.autograd.grad(pk.linear_token_logprobs(hg, Wg, labels).sum(), [hg])
    both = torch.autograd.grad(pk.linear_token_logprobs(hg, Wg, labels).sum(), [hg, Wg])
    assert Wg.grad is None and torch.equal(gh, both[0])  # one edge asked for: the same value


def test_one_tile_only_for_small_default_calls():
    """One tile when N * V <= 65536 (and V * H <= 2**20), and not with a budget, a softcap, the
    eager backend, batch-invariant mode or float64; what the op refuses still names the
    argument."""
    h, W, b, labels = _inputs(torch.float32)
    n0 = _one_tile_calls()
    pk.linear_token_logprobs(h, W.requires_grad_(), labels)
    assert _one_tile_calls() == n0 + 1
    pk.linear_token_logprobs(h, W, labels, max_chunk_bytes=1 << 20)  # a budget
    pk.linear_token_logprobs(h, W, labels, softcap=5.0)
    pk.linear_token_logprobs(h.double(), W.double(), labels)
    with use_backend(linear_token_logprobs="eager"):
        pk.linear_token_logprobs(h, W, labels)
    with pk.batch_invariant():
        pk.linear_token_logprobs(h, W, labels)
    assert _one_tile_calls() == n0 + 1
    g = torch.Generator().manual_seed(1)
    for n, one in ((65536 // V, 1), (65536 // V + 1, 0)):  # N * V at and over the limit
        before = _one_tile_calls()
        hn = torch.randn(n, H, generator=g)
        pk.linear_token_logprobs(hn, W, torch.randint(0, V, (n,), generator=g))
        assert _one_tile_calls() == before + one
    # what the op would refuse still reaches it, and its named errors
    with pytest.raises((ValueError, TypeError), match="weight"):
        pk.linear_token_logprobs(h, W[:, :5], labels)
    with pytest.raises((ValueError, TypeError), match="bias"):
        pk.linear_token_logprobs(h, W, labels, bias=b[:7])
    with pytest.raises((ValueError, IndexError), match="labels"):
        pk.linear_token_logprobs(h, W, labels.clamp(min=0) + V)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accumulate_kernel_is_torch_add_bit_for_bit(dtype):
    """The CPU kernel that adds input-dtype gradient products into the float32 sums gives
    torch's `acc += x` bits (float32(x) is exact; one rounding per addition), at sizes with and
    without a vector tail and across its parallel blocks; bad arguments are named."""
    g = torch.Generator().manual_seed(8)
    for n in (1, 7, 2048 * 16 + 5, 3 * 2048 * 16):
        acc = torch.randn(n, generator=g) * 100
        x = (torch.randn(n, generator=g) * 1e-3).to(dtype)
        want = acc.clone()
        want += x
        torch.ops.ppo_kernels_C.accumulate_(acc, x)
        assert torch.equal(acc, want)
    acc = torch.zeros(4, 5)
    with pytest.raises(TypeError, match="acc: expected dtype float32"):
        torch.ops.ppo_kernels_C.accumulate_(acc.double(), torch.ones(4, 5))
    with pytest.raises(
        ValueError, match=r"x: expected 20 elements \(like acc\), got shape \(4, 6\)"
    ):
        torch.ops.ppo_kernels_C.accumulate_(acc, torch.ones(4, 6))
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.ppo_kernels_C.accumulate_(acc, torch.ones(5, 4).T)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_hand_built_nodes_honour_saved_tensor_hooks_and_checkpoint():
    """The hand-built graph nodes (csrc/ops/plain_node.h) save through SavedVariable, so
    saved_tensors_hooks see what they save, save_on_cpu / checkpoint / anomaly mode work, and the
    gradients equal those without them."""
    g = torch.Generator().manual_seed(9)
    h0, W = torch.randn(4, 8, generator=g), torch.randn(16, 8, generator=g)
    labels = torch.randint(0, 16, (4,), generator=g)

    def grad_of(ctx):
        h = h0.clone().requires_grad_()
        with ctx:
            lp = pk.linear_token_logprobs(h, W, labels)
            s = pk.reward_model_loss(lp, lp.detach().flip(0))
            loss = s + pk.masked_aggregate(lp[None], torch.ones(1, 4, dtype=torch.bool))
        loss.backward()
        return h.grad, [lp.grad_fn.name(), s.grad_fn.name()]

    import contextlib

    want, names = grad_of(contextlib.nullcontext())
    assert names == ["LinearTokenLogprobsBackward", "PairwiseLogsigmoidLossBackward"]
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    for ctx in (hooks, torch.autograd.graph.save_on_cpu(), torch.autograd.detect_anomaly()):
        got, _ = grad_of(ctx)
        assert torch.equal(got, want)
    assert (4, 16) in packed and (4, 8) in packed  # the kept logits tile, hidden
    h = h0.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(
        lambda x: pk.linear_token_logprobs(x, W, labels).sum(), h, use_reentrant=False
    )
    out.backward()
    ref = h0.clone().requires_grad_()
    pk.linear_token_logprobs(ref, W, labels).sum().backward()
    assert torch.equal(h.grad, ref.grad)
