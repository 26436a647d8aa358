"""linear_distill_loss (the fused distillation loss from hidden states) against autograd of its
float64 reference (ppo_kernels/losses/distill_naive.py) on every CPU backend, with NaN-poisoned
outputs: every divergence, temperature, both weights, a mask, ignored labels, bias, several row
blocks, a teacher head or a cached top-k teacher (both tails); bf16 / fp16; gradcheck in float64;
opcheck; torch.compile (fullgraph); bad inputs naming the argument; batch-invariant mode; the
backward's scaling; the fallback without the extension; peak memory."""

from __future__ import annotations

import math

import pytest
import torch
from support.utils import cpu_backends, peak_extra_bytes, poisoned

import ppo_kernels as pk
from ppo_kernels import _library, batch_invariant, use_backend
from ppo_kernels.distill import op
from ppo_kernels.losses import distill_naive as DN

BACKENDS = cpu_backends("linear_distill_loss")
N, H, HT, V, K = 13, 12, 10, 37, 5
SMALL = 1500  # a budget of a few rows per block: several blocks
DIVS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2), ("tv", 0.5),
        ("jsd", 0.0), ("jsd", 1.0)]  # fmt: skip


def _inputs(dtype=torch.float32, seed=0, bias=True, shape=(N,), close=True, T=1.0):
    """Student and teacher heads (the teacher near the student when close: small divergences),
    labels with an ignored one, a mask with a zero, and the teacher's top-k at temperature T (the
    label among the ids in the first row, an unused slot in the third)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, H, generator=g) * 0.7).to(dtype)
    W = (torch.randn(V, H, generator=g) * 0.7).to(dtype)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype) if bias else None
    th = (torch.randn(*shape, HT, generator=g) * 0.7).to(dtype)
    tW = (torch.randn(V, HT, generator=g) * 0.7).to(dtype)
    tb = (torch.randn(V, generator=g) * 0.3).to(dtype) if bias else None
    labels = torch.randint(0, V, shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    n = labels.numel()
    if n > 3:
        labels.view(-1)[3] = -100
        mask.view(-1)[0] = True
    with torch.no_grad():
        zt = th.double() @ tW.double().T + (0 if tb is None else tb.double())
        tlp, ids = torch.log_softmax(zt / T, -1).topk(K, -1)
    if n > 2:
        ids.view(-1, K)[0, 1] = labels.view(-1)[0]
        tlp.view(-1, K)[2, 4] = -math.inf
    return dict(h=h, W=W, b=b, th=th, tW=tW, tb=tb, labels=labels, mask=mask, ids=ids,
                tlp=tlp.float())  # fmt: skip


def _teacher(x, topk):
    if topk:
        return dict(topk_ids=x["ids"], topk_logprobs=x["tlp"])
    return dict(teacher_hidden=x["th"], teacher_weight=x["tW"], teacher_bias=x["tb"])


def _run(x, topk=False, mask=True, **kw):
    """(loss, stats, grads of h / W / b) of the public op."""
    h, W, b = [None if t is None else t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    loss, stats = pk.linear_distill_loss(
        h, W, x["labels"], bias=b, mask=x["mask"] if mask else None, **_teacher(x, topk), **kw
    )
    grads = torch.autograd.grad(loss, [t for t in (h, W, b) if t is not None])
    return loss, stats, grads


def _reference(x, topk=False, mask=True, **kw):
    kw = dict(kw)
    kw.pop("max_chunk_bytes", None)
    kw.pop("logits_dtype", None)
    h, W, b = [
        None if t is None else t.detach().double().requires_grad_()
        for t in (x["h"], x["W"], x["b"])
    ]
    flat = h.reshape(-1, H)
    t = _teacher(x, topk)
    if not topk:
        t["teacher_hidden"] = t["teacher_hidden"].reshape(-1, HT)
    else:
        t = {k: v.reshape(-1, K) for k, v in t.items()}
    loss, soft, hard, d, lp, k = DN.linear_distill_loss(
        flat, W, x["labels"].reshape(-1), bias=b, mask=x["mask"].reshape(-1) if mask else None,
        **t, **kw,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, [t for t in (h, W, b) if t is not None])
    shape = x["labels"].shape
    stats = dict(soft_loss=soft, hard_loss=hard, divergence=d.view(shape),
                 hard_logprobs=lp.view(shape), sampled_reverse_kl=k.view(shape))  # fmt: skip
    return loss.detach(), stats, grads


def _close_scaled(a, b, rel, name):
    """|a - b| <= rel * max|b| (+ a floor): gradients are sums whose terms cancel."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    assert err <= rel * scale + 1e-7, f"{name}: max error {err} (scale {scale})"


def _check(x, backend, topk=False, rel=2e-5, atol=2e-5, **kw):
    with use_backend(linear_distill_loss=backend), poisoned():
        loss, stats, grads = _run(x, topk, **kw)
    rloss, rstats, rgrads = _reference(x, topk, **kw)
    tol = dict(atol=atol, rtol=rel)
    torch.testing.assert_close(loss.double(), rloss, **tol)
    for name, ref in rstats.items():
        torch.testing.assert_close(stats[name].double(), ref, equal_nan=True, **tol, msg=name)
    for g, r, name in zip(grads, rgrads, ("hidden", "weight", "bias")):
        assert g.dtype == x["h"].dtype
        _close_scaled(g, r, rel * 5, name)
    return loss, stats


# --------------------------------------------------------------------------- against float64
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("div, beta", DIVS)
@pytest.mark.parametrize("budget", [None, SMALL])
def test_teacher_head_matches_the_reference(backend, div, beta, budget):
    x = _inputs(shape=(3, 5) if budget else (N,))
    for T, w in ((1.0, (0.5, 0.5)), (0.7, (0.3, 1.2))):
        _check(x, backend, divergence=div, beta=beta, temperature=T, weight_hard_loss=w[0],
               weight_soft_loss=w[1], max_chunk_bytes=budget)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("div, beta", DIVS[:5])
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_topk_teacher_matches_the_reference(backend, div, beta, tail):
    for T, budget in ((1.0, None), (0.8, SMALL)):
        x = _inputs(T=T)
        # the bucket's tail mass 1 - sum_k p_k cancels in float32: a looser bound there
        rel = 2e-4 if tail == "bucket" else 2e-5
        _check(x, backend, topk=True, rel=rel, atol=1e-4, divergence=div, beta=beta,
               temperature=T, weight_hard_loss=0.4, weight_soft_loss=0.9, topk_tail=tail,
               max_chunk_bytes=budget)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [False, True])
def test_one_term_alone_and_without_mask_or_bias(backend, topk):
    x = _inputs(bias=False)
    _check(x, backend, topk, mask=False, weight_hard_loss=0.0, weight_soft_loss=1.0)
    _check(x, backend, topk, weight_hard_loss=1.0, weight_soft_loss=0.0, temperature=2.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
@pytest.mark.parametrize("topk", [False, True])
def test_low_precision(backend, dtype, logits_dtype, topk):
    """bf16 / fp16 heads: the reference sees the same rounded inputs; input tiles round the
    logits and the gradient tile to the dtype (a few of its units relative)."""
    x = _inputs(dtype)
    rel = 2e-5 if logits_dtype == "float32" else (3e-2 if dtype == torch.bfloat16 else 4e-3)
    with use_backend(linear_distill_loss=backend), poisoned():
        loss, stats, grads = _run(x, topk, logits_dtype=logits_dtype, temperature=0.9)
    rloss, rstats, rgrads = _reference(x, topk, temperature=0.9)
    tol = dict(atol=rel, rtol=rel)
    torch.testing.assert_close(loss.double(), rloss, **tol)
    torch.testing.assert_close(stats["divergence"].double(), rstats["divergence"], **tol)
    for g, r, name in zip(grads, rgrads, ("hidden", "weight", "bias")):
        assert g.dtype == dtype
        _close_scaled(g, r, max(rel, 1.6e-2 if dtype == torch.bfloat16 else 2e-3) * 2, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_runs_the_float64_loop(backend):
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
         for k, v in _inputs().items()}  # fmt: skip
    for topk in (False, True):
        loss, stats = _check(x, backend, topk, rel=1e-10, atol=1e-10, temperature=0.7)
        assert loss.dtype == torch.float64 and stats["divergence"].dtype == torch.float64


def test_sampled_reverse_kl_is_the_log_ratio_of_the_label():
    """The per-token output is log p(y) - log q(y) at temperature T (its negative: on-policy
    distillation's advantage); with a cached teacher NaN where y is not among the ids."""
    x = _inputs()
    T = 0.6
    _, st, _ = _run(x, temperature=T)
    zs = x["h"].double() @ x["W"].double().T + x["b"].double()
    zt = x["th"].double() @ x["tW"].double().T + x["tb"].double()
    keep = (x["labels"] != -100) & x["mask"]
    y = torch.where(keep, x["labels"], 0)
    want = DN.sampled_reverse_kl(zs, zt, y, T)
    got = st["sampled_reverse_kl"].double()
    torch.testing.assert_close(got, torch.where(keep, want, 0.0), atol=2e-5, rtol=2e-5)
    _, st, _ = _run(_inputs(T=T), topk=True, temperature=T)
    k = st["sampled_reverse_kl"]
    assert torch.isfinite(k[0]) and torch.isnan(k[keep & (torch.arange(N) > 0)]).any()
    assert torch.equal(k[~keep], torch.zeros_like(k[~keep]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [False, True])
def test_no_kept_token_and_no_rows(backend, topk):
    """Every token masked: loss 0, zero gradients; no rows at all: the same, empty stats."""
    x = _inputs()
    x["mask"] = torch.zeros_like(x["mask"])
    with use_backend(linear_distill_loss=backend), poisoned():
        loss, stats, grads = _run(x, topk)
        assert loss.item() == 0 and all(bool((g == 0).all()) for g in grads)
        assert bool((stats["divergence"] == 0).all())
        e = _inputs(shape=(0,))
        loss, stats, grads = _run(e, topk)
    assert loss.item() == 0 and stats["divergence"].shape == (0,)
    assert grads[0].shape == (0, H) and bool((grads[1] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_head_and_no_grad(backend):
    """Only the gradients asked for are formed (the same as when all are); under no_grad none."""
    x = dict(_inputs(), b=None, tb=None)
    with use_backend(linear_distill_loss=backend):
        h = x["h"].clone().requires_grad_()
        loss, _ = pk.linear_distill_loss(h, x["W"], x["labels"], x["th"], x["tW"], mask=x["mask"])
        (gh,) = torch.autograd.grad(loss, (h,))
        torch.testing.assert_close(gh, _run(x)[2][0], rtol=0, atol=0)
        with torch.no_grad():
            loss2, _ = pk.linear_distill_loss(h, x["W"], x["labels"], x["th"], x["tW"])
    assert not loss2.requires_grad


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    n, h_, v = 5, 4, 9
    h = torch.randn(n, h_, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(v, h_, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    th, tW = torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(v, 3, generator=g)
    tW = tW.double()
    labels = torch.tensor([1, -100, 4, 8, 0])
    tlp, ids = torch.log_softmax(th @ tW.T, -1).topk(3, -1)
    for div, beta in (("jsd", 0.3), ("reverse_kl", 0.5), ("forward_kl", 0.5)):
        for teacher in (dict(teacher_hidden=th, teacher_weight=tW),
                        dict(topk_ids=ids, topk_logprobs=tlp)):  # fmt: skip

            def f(h, W, b, teacher=teacher):
                return pk.linear_distill_loss(
                    h, W, labels, bias=b, divergence=div, beta=beta, temperature=0.8,
                    weight_hard_loss=0.3, max_chunk_bytes=200, **teacher,
                )[0]  # fmt: skip

            assert torch.autograd.gradcheck(f, (h, W, b))


def _op_args(x, topk=False, **kw):
    """The registered op's arguments for a flat call, as the API builds them."""
    cfg = pk.DistillLossConfig(**kw)
    t = _teacher(x, topk)
    return (
        x["h"], x["W"], x["labels"], x["mask"], x["b"], t.get("teacher_hidden"),
        t.get("teacher_weight"), t.get("teacher_bias"), t.get("topk_ids"),
        t.get("topk_logprobs"), *(getattr(cfg, f) for f in op.fields(pk.DistillLossConfig)),
        -100, 0, "float32",
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    x = _inputs()
    for t in ("h", "W", "b"):
        x[t] = x[t].requires_grad_()
    x["ids"][:, 0] = x["labels"].clamp(min=0)  # (no NaN: the label among the ids, every row)
    with use_backend(linear_distill_loss=backend):
        for topk, kw in ((False, dict(temperature=0.8)), (True, dict(divergence="reverse_kl"))):
            args = _op_args(x, topk, **kw)
            torch.library.opcheck(torch.ops.ppo_kernels.linear_distill_loss.default, args, **only)
            plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_distill_loss_grads.default,
                plain + (True, True, True),
                **only,
            )


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    x = _inputs()
    outs = []
    for compiled in (True, False):
        h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()

        def f(h, W):
            loss, st = pk.linear_distill_loss(
                h * 1.0, W, x["labels"], x["th"], x["tW"], mask=x["mask"], divergence="tv",
                temperature=0.9,
            )  # fmt: skip
            return loss * 2, st["soft_loss"], st["sampled_reverse_kl"]

        fn = (
            torch.compile(f, fullgraph=True, dynamic=dynamic, backend="aot_eager")
            if compiled
            else f
        )
        loss, soft, k = fn(h, W)
        loss.backward()
        outs.append((loss.detach(), soft, k, h.grad, W.grad))
    for a, c in zip(*outs):
        torch.testing.assert_close(a, c)


def test_backward_scales_the_saved_gradients():
    x = _inputs()
    h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()
    loss, _ = pk.linear_distill_loss(h, W, x["labels"], x["th"], x["tW"])
    g = [t.clone() for t in torch.autograd.grad(loss, (h, W), retain_graph=True)]
    (3.0 * loss).backward(retain_graph=True)
    torch.testing.assert_close(h.grad, 3 * g[0])
    torch.testing.assert_close(W.grad, 3 * g[1])
    gh, gW = torch.autograd.grad(-2.0 * loss, (h, W))
    torch.testing.assert_close(gh, -2 * g[0])
    torch.testing.assert_close(gW, -2 * g[1])


def test_without_the_extension_the_fallback_matches(monkeypatch):
    """The fallback (no compiled extension): the eager loop with the gradients attached."""
    x = _inputs()
    fallback = _library._FALLBACKS["linear_distill_loss"]
    args = _op_args(x, temperature=0.7)
    h, W, b = [t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    args = (h, W) + args[2:4] + (b,) + args[5:]
    loss, st, tok = fallback(*args)
    grads = torch.autograd.grad(3 * loss, (h, W, b))
    want, wst, wgrads = _run(x, temperature=0.7)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(st, torch.stack((wst["soft_loss"], wst["hard_loss"])))
    for a, c in zip(grads, wgrads):
        torch.testing.assert_close(a, 3 * c)


# --------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(hidden=torch.randn(N, H).int()), TypeError, "hidden"),
        (dict(weight=torch.randn(V, H).double()), TypeError, "weight"),
        (dict(weight=torch.randn(V, H + 1)), ValueError, "weight"),
        (dict(bias=torch.randn(V + 1)), ValueError, "bias"),
        (dict(labels=torch.zeros(N + 1, dtype=torch.long)), ValueError, "hidden"),
        (dict(labels=torch.zeros(N)), TypeError, "labels"),
        (dict(labels=torch.full((N,), V)), IndexError, "labels"),
        (dict(mask=torch.ones(N + 1)), ValueError, "mask"),
        (dict(mask=torch.ones(N, dtype=torch.complex64)), TypeError, "mask"),
        (dict(teacher_hidden=torch.randn(N + 1, HT)), ValueError, "teacher_hidden"),
        (dict(teacher_hidden=torch.randn(N, HT).double()), TypeError, "teacher_hidden"),
        (dict(teacher_weight=torch.randn(V + 1, HT)), ValueError, "teacher_weight"),
        (dict(teacher_weight=None), ValueError, "teacher_weight"),
        (dict(teacher_bias=torch.randn(V - 1)), ValueError, "teacher_bias"),
        (
            dict(topk_ids=torch.zeros(N, 2, dtype=torch.long), topk_logprobs=torch.zeros(N, 2)),
            ValueError,
            "topk_ids",
        ),  # fmt: skip
        (dict(teacher_hidden=None, teacher_weight=None), ValueError, "teacher"),
        (
            dict(teacher_hidden=None, teacher_weight=None, topk_ids=torch.zeros(N, 2).long()),
            ValueError,
            "topk_logprobs",
        ),  # fmt: skip
        (
            dict(
                teacher_hidden=None,
                teacher_weight=None,
                topk_ids=torch.zeros(N, 2),
                topk_logprobs=torch.zeros(N, 2),
            ),
            TypeError,
            "topk_ids",
        ),  # fmt: skip
        (
            dict(
                teacher_hidden=None,
                teacher_weight=None,
                topk_ids=torch.full((N, 2), V),
                topk_logprobs=torch.zeros(N, 2),
            ),
            IndexError,
            "topk_ids",
        ),  # fmt: skip
        (
            dict(
                teacher_hidden=None,
                teacher_weight=None,
                topk_ids=torch.zeros(N, 2).long(),
                topk_logprobs=torch.zeros(N, 3),
            ),
            ValueError,
            "topk_logprobs",
        ),  # fmt: skip
        (dict(divergence="kl"), ValueError, "divergence"),
        (dict(beta=1.5), ValueError, "beta"),
        (dict(beta="0.5"), TypeError, "beta"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(weight_soft_loss=math.nan), ValueError, "weight_soft_loss"),
        (dict(weight_hard_loss=math.inf), ValueError, "weight_hard_loss"),
        (dict(topk_tail="drop"), ValueError, "topk_tail"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(max_chunk_bytes=0), ValueError, "max_chunk_bytes"),
        (dict(logits_dtype="bf16"), ValueError, "logits_dtype"),
        (dict(distill_config=1), TypeError, "distill_config"),
        (dict(distill_config=pk.DistillLossConfig(), beta=0.1), TypeError, "distill_config"),
    ],
)
def test_bad_inputs_name_the_argument(kw, exc, match):
    x = _inputs(bias=False)
    args = dict(hidden=x["h"], weight=x["W"], labels=x["labels"], teacher_hidden=x["th"],
                teacher_weight=x["tW"])  # fmt: skip
    for k in [k for k in kw if k in args]:
        args[k] = kw.pop(k)
    with pytest.raises(exc, match=match):
        pk.linear_distill_loss(**args, **kw)


@pytest.mark.parametrize(
    "name, value, exc",
    [
        ("hidden", torch.randn(N, H, 1), ValueError),
        ("weight", torch.randn(V, H).double(), TypeError),
        ("labels", torch.zeros(N, 1, dtype=torch.long), ValueError),
        ("mask", torch.ones(N + 1), ValueError),
        ("teacher_bias", torch.randn(V), ValueError),
        ("divergence", "kl", ValueError),
        ("beta", -0.5, ValueError),
        ("temperature", -1.0, ValueError),
        ("weight_soft_loss", math.inf, ValueError),
        ("topk_tail", "none", ValueError),
        ("max_chunk_bytes", -1, ValueError),
        ("logits_dtype", "half", ValueError),
    ],
)
def test_the_registered_op_checks_its_arguments(name, value, exc):
    """The op checks what it is given itself (teacher_bias without a teacher head: the top-k
    call)."""
    x = _inputs()
    args = list(_op_args(x, topk=name == "teacher_bias"))
    args[op.ARG_NAMES.index(name)] = value
    with pytest.raises(exc, match=name):
        torch.ops.ppo_kernels.linear_distill_loss(*args)


# --------------------------------------------------------------------------- batch invariance
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [False, True])
def test_batch_invariant_rows(backend, topk):
    """Under batch_invariant() each token's per-token outputs (divergence, hard log-prob,
    sampled reverse KL) are bitwise the same alone and among others, in any position and block
    count; its hidden gradient is the same up to the rounding of the token mean's 1 / n."""
    g = torch.Generator().manual_seed(7)
    n = 70 if backend != "triton" else 9
    x = _inputs(shape=(n,), seed=3)
    x["mask"] = torch.ones(n, dtype=torch.bool)
    x["labels"] = torch.randint(0, V, (n,), generator=g)

    def call(idx, grad=False):
        sub = {k: (v[idx] if isinstance(v, torch.Tensor) and v.shape[:1] == (n,) else v)
               for k, v in x.items()}  # fmt: skip
        h = sub["h"].clone().requires_grad_(grad)
        loss, st = pk.linear_distill_loss(h, sub["W"], sub["labels"], bias=sub["b"],
                                          temperature=0.9, **_teacher(sub, topk))  # fmt: skip
        out = torch.stack([st[k] for k in op.TOKEN_STATS], -1)
        if grad:
            (gh,) = torch.autograd.grad(loss * len(idx), (h,))
            return out, gh
        return out

    with use_backend(linear_distill_loss=backend), batch_invariant():
        whole, gwhole = call(list(range(n)), True)
        for idx in ([n - 1], [0, n - 1, 5], list(range(n - 4, n)), [7, 2]):
            got, gh = call(idx, True)
            same = (got == whole[idx]) | (got.isnan() & whole[idx].isnan())
            assert bool(same.all()), (backend, idx)
            torch.testing.assert_close(gh, gwhole[idx], rtol=1e-5, atol=1e-7)


def test_peak_memory_is_a_few_tiles():
    """Forward + backward hold the weight gradient once and the chunk budget's tiles: far below
    the materialised logits of the student and the teacher."""
    g = torch.Generator().manual_seed(0)
    n, h_, v = 256, 64, 8192
    h = torch.randn(n, h_, generator=g)
    W = torch.randn(v, h_, generator=g) * 0.1
    th, tW = torch.randn(n, h_, generator=g), torch.randn(v, h_, generator=g) * 0.1
    labels = torch.randint(0, v, (n,), generator=g)
    budget = 512 * 1024

    def fused():
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
        loss, _ = pk.linear_distill_loss(hh, WW, labels, th, tW, max_chunk_bytes=budget)
        loss.backward()

    peak = peak_extra_bytes(fused)
    leaves = 2 * (n * h_ * 4 + v * h_ * 4)  # the copies of h, W and their gradients
    assert peak < leaves + v * h_ * 4 // 2 + 2 * budget, (peak, leaves)
    assert peak < n * v * 4, (peak, n * v * 4)  # less than one materialised logits tensor
