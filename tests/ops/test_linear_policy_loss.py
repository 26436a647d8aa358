"""linear_policy_loss (the fused hidden-states policy loss) against autograd of its float64
reference (ppo_kernels/linear_policy_loss/naive.py) on every CPU backend, against the
composition of the public ops, gradcheck, opcheck, torch.compile, bad inputs, the GEMM count."""

import math

import pytest
import torch
from support.skips import need
from support.utils import cpu_backends, peak_extra_bytes, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.fused_linear import engine
from ppo_kernels.linear_policy_loss import api, head, naive, op
from ppo_kernels.losses import policy_math as pm

BACKENDS = cpu_backends("linear_policy_loss")
B, T, H, V = 3, 7, 12, 37
# a budget of a few rows per chunk: several chunks, sequences longer than a chunk
SMALL = 1200
# one whole sequence (T rows) per chunk or more
ROWS = 6000

# (loss_type, options) of every type, with an option that exercises it
TYPES = [
    ("ppo", dict(dual_clip=3.0)),
    ("ppo", dict(importance_sampling_level="sequence")),
    ("grpo", {}),
    ("grpo", dict(importance_sampling_level="sequence", delta=1.5)),
    ("bnpo", {}),
    ("dr_grpo", {}),
    ("dapo", dict(global_num_tokens=11)),
    ("luspo", {}),
    ("gspo", {}),
    ("sapo", {}),
    ("sapo", dict(importance_sampling_level="sequence")),
    ("cispo", dict(clip_low=1.0, clip_high=4.0)),
    ("cispo", dict(importance_sampling_level="sequence")),
    ("gpg", {}),
    ("dro", dict(dro_beta=0.3)),
    ("dppo_tv", {}),
    ("dppo_kl", dict(dual_clip=3.0)),
    ("geo_mean", {}),
    # ratio 1: every candidate is drawn (the float64 reference draws other random numbers)
    ("clip_cov", dict(clip_cov_ratio=1.0, clip_cov_lb=-50.0, clip_cov_ub=50.0)),
    ("kl_cov", dict(kl_cov_ratio=0.2)),
]


def _ids(p):
    t, kw = p
    return t + ("-" + "-".join(kw) if kw else "")


def _inputs(dtype=torch.float32, seed=0, per_row_adv=False, bias=True, shape=(B, T)):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, H, generator=g) * 0.5).to(dtype)
    W = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype) if bias else None
    labels = torch.randint(0, V, shape, generator=g)
    if labels.numel():
        labels.view(-1)[3] = -100
    adv = torch.randn(shape[:-1] if per_row_adv else shape, generator=g)
    # old / ref / rollout log-probs near the current ones (ratios near 1, some clipped)
    with torch.no_grad():
        lp = pk.linear_token_logprobs(
            h.double(), W.double(), labels, bias=None if b is None else b.double()
        )
    old = (lp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).float()
    ref = (lp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).float()
    roll = (old + torch.randn(shape, generator=g) * 0.2).float()
    mask = torch.rand(shape, generator=g) > 0.25
    if mask.numel():
        mask.view(-1)[0] = True
    if len(shape) > 1 and shape[0]:
        mask[-1, 2:] = False  # a short row
    return dict(h=h, W=W, b=b, labels=labels, adv=adv, old=old, ref=ref, roll=roll, mask=mask)


def _run(x, leaves=None, **kw):
    """(loss, stats, grads of h / W / b) of the public op."""
    h, W, b = leaves or [
        None if t is None else t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])
    ]
    loss, stats = pk.linear_policy_loss(
        h, W, x["labels"], x["adv"], x["old"], x["mask"], bias=b, **kw
    )
    grads = torch.autograd.grad(loss, [t for t in (h, W, b) if t is not None])
    return loss, stats, grads


def _reference(x, **kw):
    """(loss, stats, grads) of the float64 reference on the same call."""
    h, W, b = [
        None if t is None else t.detach().double().requires_grad_()
        for t in (x["h"], x["W"], x["b"])
    ]
    gen = kw.get("generator")
    if gen is not None:
        kw["generator"] = torch.Generator().manual_seed(gen.initial_seed())
    call, pre, shape = api.arguments(h, W, x["labels"], x["adv"], x["old"], x["mask"], bias=b, **kw)
    call = call._replace(hidden=h.reshape(-1, h.shape[-1]))
    loss, stats = naive.linear_policy_loss(call, call.generator)
    stats.update(pre)
    grads = torch.autograd.grad(loss, [t for t in (h, W, b) if t is not None])
    return loss, stats, grads


def _close_scaled(a, b, rel, name):
    """|a - b| <= rel * max|b| (+ a floor): gradients are sums whose terms cancel."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    assert err <= rel * scale + 1e-6, f"{name}: max error {err} (scale {scale})"


def _check(x, backend, rel=2e-5, stat_atol=2e-5, **kw):
    gen = kw.get("generator")
    with use_backend(linear_policy_loss=backend), poisoned():
        loss, stats, grads = _run(x, **kw)
    if gen is not None:
        kw["generator"] = gen
    rloss, rstats, rgrads = _reference(x, **kw)
    assert loss.dtype == (torch.float64 if x["h"].dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(loss.double(), rloss, atol=stat_atol, rtol=2e-5)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == x["h"].dtype and not g.isnan().any(), name
        _close_scaled(g, r, rel, name)
    missing = sorted(set(stats) - set(rstats))
    assert not missing, missing
    for k, v in stats.items():
        assert not v.requires_grad, k
        torch.testing.assert_close(
            v.double(),
            rstats[k].double().reshape(v.shape),
            atol=stat_atol,
            rtol=2e-5,
            equal_nan=True,
            msg=lambda m: f"{k}: {m}",
        )
    return loss, stats, grads


def _budgets(*budgets):
    """(backend, budget) pairs: the Triton interpreter runs the first (several chunks) only --
    the budget shapes the engine's Python loop, which the eager backend runs with every budget;
    the Triton kernels see tiles of other row counts, nothing else."""
    return [(b, m) for b in BACKENDS for m in budgets if b != "triton" or m == budgets[0]]


@pytest.mark.parametrize("backend,budget", _budgets(SMALL, ROWS))
@pytest.mark.parametrize("case", TYPES, ids=_ids)
def test_every_loss_type_matches_the_reference(backend, case, budget):
    loss_type, kw = case
    x = _inputs(per_row_adv=loss_type in ("grpo", "sapo"))
    if loss_type == "clip_cov":
        kw = dict(kw, generator=torch.Generator().manual_seed(5))
    _check(
        x,
        backend,
        loss_type=loss_type,
        ref_logprobs=x["ref"],
        kl_coef=0.1,
        entropy_coef=0.01,
        temperature=0.8,
        max_chunk_bytes=budget,
        **kw,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "agg",
    [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "token-sum",
    ],
)
def test_aggregations_and_global_normalisers(backend, agg):
    x = _inputs()
    _check(x, backend, agg=agg, entropy_coef=0.02, ref_logprobs=x["ref"], kl_coef=0.05)
    _check(
        x,
        backend,
        agg=agg,
        dp_size=2,
        global_num_tokens=torch.tensor(30.0),
        global_batch_size=5,
        loss_scale_factor=9.0,
        entropy_coef=0.02,
    )


# (the clamps are the head term's Python, the same on every backend: the Triton interpreter
# runs each estimator with one of them)
@pytest.mark.parametrize(
    "backend,clamp",
    [
        (b, c)
        for b in BACKENDS
        for c in ("none", "verl", "openrlhf")
        if b != "triton" or c == "verl"
    ],
)
@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "k3+", "low_var_kl", "k2+"])
def test_kl_estimators(backend, estimator, clamp):
    x = _inputs()
    x["ref"] = x["ref"] - 3 * (torch.arange(B * T).view(B, T) % 5 == 0)  # some large log-ratios
    _, stats, _ = _check(
        x, backend, ref_logprobs=x["ref"], kl_coef=0.5, kl_estimator=estimator, kl_clamp=clamp
    )
    assert (stats["kl"][~x["mask"]] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "opts", [dict(temperature=0.6), dict(softcap=2.0), dict(softcap=1.5, temperature=1.7)]
)
def test_temperature_and_softcap(backend, opts):
    x = _inputs()
    _check(x, backend, entropy_coef=0.1, **opts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_labels_and_no_bias(backend):
    x = _inputs(bias=False)
    x["labels"][x["labels"] == -100] = 5
    x["labels"][0, :3] = 7  # in-vocabulary ignore_index
    x["labels"][1, 4] = 7
    _, stats, grads = _check(x, backend, ignore_index=7, entropy_coef=0.1)
    ign = x["labels"] == 7
    assert (stats["logprobs"][ign] == 0).all() and (stats["entropy"][ign] == 0).all()
    assert (grads[0][ign] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
def test_low_precision(backend, dtype, logits_dtype):
    x = _inputs(dtype)
    # the reference sees the same rounded inputs (and, for "input" tiles, rounds its logits);
    # the gradients are rounded to the input dtype on output
    rel = 1e-2 if logits_dtype == "float32" else 3e-2
    atol = 2e-5 if logits_dtype == "float32" else 3e-2
    _check(
        x,
        backend,
        rel=rel,
        stat_atol=atol,
        logits_dtype=logits_dtype,
        ref_logprobs=x["ref"],
        kl_coef=0.1,
        entropy_coef=0.01,
        loss_type="grpo",
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_runs_the_float64_loop(backend):
    x = _inputs(torch.float64)
    _check(
        x, backend, rel=1e-10, stat_atol=1e-10, ref_logprobs=x["ref"], kl_coef=0.2, entropy_coef=0.1
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["ppo", "grpo", "geo_mean", "kl_cov"])
def test_empty_mask(backend, loss_type):
    x = _inputs()
    x["mask"] = torch.zeros_like(x["mask"])
    with use_backend(linear_policy_loss=backend), poisoned():
        loss, stats, grads = _run(
            x, loss_type=loss_type, entropy_coef=0.1, ref_logprobs=x["ref"], kl_coef=0.1
        )
    assert loss.item() == 0 and all((g == 0).all() for g in grads)
    for k, v in stats.items():
        if v.dim() == 0 and k not in ("clip_low_frac_min", "clip_high_frac_max"):
            assert v.item() == 0, k


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x = _inputs(shape=(0, T))
    with use_backend(linear_policy_loss=backend), poisoned():
        loss, stats, grads = _run(x, entropy_coef=0.1)
    assert loss.item() == 0 and grads[0].shape == (0, T, H) and (grads[1] == 0).all()


@pytest.mark.parametrize("case", TYPES, ids=_ids)
@pytest.mark.parametrize("per_row_adv", [False, True])
def test_empty_batch_every_loss_type(case, per_row_adv):
    """No rows: no chunk runs, so no per-token metric is ever stored (the TRL types' clip
    summaries read them): loss 0, the statistics 0, the min / max over no rows NaN."""
    loss_type, kw = case
    x = _inputs(shape=(0, T), per_row_adv=per_row_adv)
    with poisoned():
        loss, stats, grads = _run(x, loss_type=loss_type, entropy_coef=0.1, **kw)
    assert loss.item() == 0 and grads[0].shape == (0, T, H) and (grads[1] == 0).all()
    for k, v in stats.items():
        if v.dim() == 0 and k in ("clip_low_frac_min", "clip_high_frac_max"):
            assert torch.isnan(v), k


def test_passes():
    """Per-token types: one pass; sequence statistics: one pass while a chunk holds whole
    sequences, two otherwise; batch statistics and bypass mode: two."""
    tok = pm.PolicyLossConfig("grpo")
    seq = pm.PolicyLossConfig("grpo", importance_sampling_level="sequence")
    assert head.passes(tok, False, 1000, 10) == 1
    assert head.passes(seq, False, 10, 10) == 1 and head.passes(seq, False, 11, 10) == 2
    assert head.passes(pm.PolicyLossConfig("geo_mean"), False, 11, 10) == 2
    assert head.passes(pm.PolicyLossConfig("kl_cov"), False, 1, 100) == 2
    assert head.passes(tok, True, 1, 100) == 2
    # bypass mode: token IS weights without rejection stay in the one pass
    assert head.token_local_bypass(("token", (2.0, None), []), False)
    assert not head.token_local_bypass(("token", (2.0, None), [("token_k1", 0.5, 2.0)]), False)
    assert not head.token_local_bypass(("sequence", (2.0, None), []), False)
    assert not head.token_local_bypass(("token", (2.0, None), []), True)
    p = engine.plan_rows(torch.empty(B * T, H), V, "float32", SMALL)
    assert p.vocab == V and p.rows < T  # SMALL: a sequence is longer than a chunk
    assert engine.plan_rows(torch.empty(B * T, H), V, "float32", ROWS).rows >= T


def _mm_calls(fn):
    """The GEMMs (aten mm / addmm) that fn runs, counted by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return sum(n in ("aten::mm", "aten::addmm", "aten::addmm_") for n in names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_gemms_for_token_level_types(backend):
    """One chunk (the whole batch fits the budget): the logits GEMM, then G W and G^T h in the
    forward; the backward adds none. The composition runs four; a frozen head two; a batch
    statistic one more for its first pass."""
    x = _inputs()
    h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()

    def fused(loss_type="grpo", w=W, **kw):
        kw = kw or dict(ref_logprobs=x["ref"], kl_coef=0.1)
        with use_backend(linear_policy_loss=backend):
            loss, _ = pk.linear_policy_loss(
                h,
                w,
                x["labels"],
                x["adv"],
                x["old"],
                x["mask"],
                loss_type=loss_type,
                entropy_coef=0.01,
                max_chunk_bytes=1 << 24,
                **kw,
            )
            loss.backward()

    def composition():
        lp, ent = pk.linear_token_logprobs(
            h, W, x["labels"], return_entropy=True, max_chunk_bytes=1 << 24
        )
        loss, _ = pk.ppo_policy_loss(lp, x["old"], x["adv"], x["mask"], loss_type="grpo")
        kl = pk.kl_penalty(lp, x["ref"], "k3")
        agg = dict(agg="seq-mean-token-mean", global_batch_size=B)
        loss = loss + 0.1 * pk.masked_aggregate(kl, x["mask"], **agg)
        loss = loss - 0.01 * pk.masked_aggregate(ent, x["mask"], **agg)
        loss.backward()

    assert _mm_calls(fused) == 3
    assert _mm_calls(composition) == 4
    assert _mm_calls(lambda: fused(w=x["W"])) == 2  # frozen LM head: no weight-gradient GEMM
    assert _mm_calls(lambda: fused("kl_cov")) == 4  # a batch statistic: a log-prob pass first
    # bypass mode with token IS weights and no rejection: one pass
    assert _mm_calls(lambda: fused("gpg", bypass_mode=True, rollout_is="token")) == 3
    assert (
        _mm_calls(
            lambda: fused("gpg", bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold=2.0)
        )
        == 4
    )
    # the exact KL: the reference logits tile is one more GEMM (no gradient GEMM for it)
    ref_head = dict(ref_hidden=x["h"] * 0.9, ref_weight=x["W"], kl_coef=0.1)
    assert _mm_calls(lambda: fused(**ref_head)) == 4
    with torch.no_grad():
        assert (
            _mm_calls(
                lambda: pk.linear_policy_loss(h, W, x["labels"], x["adv"], x["old"], x["mask"])
            )
            == 1
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["ppo", "grpo", "cispo", "sapo"])
def test_matches_the_composition_of_the_public_ops(backend, loss_type):
    """float32: the same loss, statistics and gradients as linear_token_logprobs + ppo_policy_loss
    + kl_penalty + masked_aggregate (the unfused path the op replaces)."""
    x = _inputs()
    kw = dict(
        loss_type=loss_type, ref_logprobs=x["ref"], kl_coef=0.1, entropy_coef=0.01, temperature=0.9
    )
    with use_backend(linear_policy_loss=backend):
        loss, stats, grads = _run(x, **kw)
    h, W, b = [t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    lp, ent = pk.linear_token_logprobs(
        h, W, x["labels"], bias=b, temperature=0.9, return_entropy=True
    )
    pg, st = pk.ppo_policy_loss(lp, x["old"], x["adv"], x["mask"], loss_type=loss_type)
    agg, rows = pm.default_aggregation(loss_type)
    agg_kw = dict(agg=agg, global_batch_size=B if rows else None)
    kl = pk.kl_penalty(lp, x["ref"], "k3")
    ref_loss = (
        pg
        + 0.1 * pk.masked_aggregate(kl, x["mask"], **agg_kw)
        - 0.01 * pk.masked_aggregate(ent, x["mask"], **agg_kw)
    )
    ref_grads = torch.autograd.grad(ref_loss, (h, W, b))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for g, r, n in zip(grads, ref_grads, ("hidden", "weight", "bias")):
        _close_scaled(g, r, 1e-5, n)
    for k, v in st.items():
        torch.testing.assert_close(
            stats[k], v, atol=1e-6, rtol=1e-5, equal_nan=True, msg=lambda m: f"{k}: {m}"
        )
    torch.testing.assert_close(stats["logprobs"], lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["entropy"], ent.detach(), atol=1e-5, rtol=1e-5)


# (gspo, cispo, dppo_*: their gradients hold a statistic or a ratio stop-gradient by definition,
# so they are not the derivative of the loss value: the reference tests cover them)
@pytest.mark.parametrize(
    "loss_type, level",
    [
        ("ppo", "token"),
        ("grpo", "sequence"),
        ("geo_mean", "token"),
        ("sapo", "token"),
        ("dro", "token"),
    ],
)
def test_gradcheck_float64(loss_type, level):
    x = _inputs(torch.float64, shape=(2, 3))
    h, W, b = [t.clone().requires_grad_() for t in (x["h"][:, :, :4], x["W"][:9, :4], x["b"][:9])]
    labels = x["labels"] % 9
    labels[0, 1] = -100
    kw = dict(dro_beta=0.2) if loss_type == "dro" else {}

    def f(h, W, b):
        loss, _ = pk.linear_policy_loss(
            h,
            W,
            labels,
            x["adv"],
            x["old"],
            x["mask"],
            bias=b,
            loss_type=loss_type,
            ref_logprobs=x["ref"],
            kl_coef=0.3,
            entropy_coef=0.2,
            temperature=0.8,
            softcap=3.0,
            max_chunk_bytes=150,
            importance_sampling_level=level,
            **kw,
        )
        return loss

    assert torch.autograd.gradcheck(f, (h, W, b))


def _op_args(x, **kw):
    call, _, _ = api.arguments(
        x["h"], x["W"], x["labels"], x["adv"], x["old"], x["mask"], bias=x["b"], **kw
    )
    return tuple(call[: len(op.ARG_NAMES)]), call


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    x = _inputs()
    for t in ("h", "W", "b"):
        x[t] = x[t].requires_grad_()
    with use_backend(linear_policy_loss=backend):
        for kw in (
            dict(ref_logprobs=x["ref"], kl_coef=0.1, entropy_coef=0.1, max_chunk_bytes=SMALL),
            dict(loss_type="grpo", importance_sampling_level="sequence"),
            dict(
                loss_type="gpg",
                bypass_mode=True,
                rollout_rs="token_k1",
                rollout_rs_threshold=3.0,
            ),
            dict(loss_type="kl_cov", kl_cov_ratio=0.3, ref_hidden=x["h"] * 0.5, ref_weight=x["W"]),
        ):
            args, call = _op_args(x, **kw)
            torch.library.opcheck(torch.ops.ppo_kernels.linear_policy_loss.default, args, **only)
            # the gradients' op is not differentiable itself (its gradients are outputs)
            plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)
            grads_args = plain + (True, True, True)
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_policy_loss_grads.default,
                grads_args,
                **only,
            )


def test_names_of_the_statistics_follow_the_configuration():
    x = _inputs()
    for loss_type, kw in TYPES:
        _, call = _op_args(x, loss_type=loss_type, **kw)
        cfg = head.config(call)
        xi = head._dummy_inputs()
        terms = pm.token_terms(cfg, xi, pm.statistics(cfg, xi))
        names = op.stat_names(call)
        assert set(terms.metrics) <= set(names) and len(set(names)) == len(names)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    x = _inputs()
    grads = []
    for compiled in (True, False):
        h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()

        def f(h, W):
            loss, stats = pk.linear_policy_loss(
                h * 1.0,
                W,
                x["labels"],
                x["adv"],
                x["old"],
                x["mask"],
                loss_type="grpo",
                ref_logprobs=x["ref"],
                kl_coef=0.1,
                entropy_coef=0.01,
            )
            return loss * 2, stats["clip_frac"], stats["logprobs"]

        fn = (
            torch.compile(f, fullgraph=True, dynamic=dynamic, backend="aot_eager")
            if compiled
            else f
        )
        loss, cf, lp = fn(h, W)
        loss.backward()
        grads.append((loss.detach(), cf, lp, h.grad, W.grad))
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c)


# --------------------------------------------------------------------------- bad inputs
def _call(x, **kw):
    args = dict(
        hidden=x["h"],
        weight=x["W"],
        labels=x["labels"],
        advantages=x["adv"],
        old_logprobs=x["old"],
        mask=x["mask"],
    )
    args.update({k: v for k, v in kw.items() if k in args})
    return pk.linear_policy_loss(**args, **{k: v for k, v in kw.items() if k not in args})


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (
            dict(hidden=torch.randn(B, T, H, dtype=torch.float64).to(torch.int32)),
            TypeError,
            "hidden",
        ),
        (dict(weight=torch.randn(V, H, dtype=torch.float64)), TypeError, "weight"),
        (dict(weight=torch.randn(V, H + 1)), ValueError, "weight"),
        (dict(bias=torch.randn(V + 1)), ValueError, "bias"),
        (dict(labels=torch.zeros(B, T + 1, dtype=torch.long)), ValueError, "hidden"),
        (dict(labels=torch.zeros(B, T)), TypeError, "labels"),
        (dict(labels=torch.full((B, T), V)), IndexError, "labels"),
        (dict(advantages=torch.randn(B, T + 1)), ValueError, "advantages"),
        (dict(old_logprobs=torch.randn(B)), ValueError, "old_logprobs"),
        (dict(old_logprobs=torch.zeros(B, T, dtype=torch.long)), TypeError, "old_logprobs"),
        (dict(mask=torch.ones(B, 1)), ValueError, "mask"),
        (dict(mask=torch.ones(B, T, dtype=torch.complex64)), TypeError, "mask"),
        (dict(ref_logprobs=torch.randn(B, T - 1)), ValueError, "ref_logprobs"),
        (dict(weights=torch.randn(T)), ValueError, "weights"),
        (dict(loss_type="ppo2"), ValueError, "loss_type"),
        (dict(agg="mean"), ValueError, "agg"),
        (dict(clip_low=1.5), ValueError, "clip_low"),
        (dict(dual_clip=0.5), ValueError, "dual_clip"),
        (dict(kl_coef=0.1), ValueError, "kl_coef"),
        (dict(kl_coef="0.1"), TypeError, "kl_coef"),
        (dict(entropy_coef=math.nan), ValueError, "entropy_coef"),
        (dict(kl_estimator="k4"), ValueError, "estimator"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(max_chunk_bytes=0), ValueError, "max_chunk_bytes"),
        (dict(logits_dtype="bf16"), ValueError, "logits_dtype"),
        (dict(importance_sampling_level="seq"), ValueError, "importance_sampling_level"),
        (dict(rollout_is="token"), ValueError, "rollout_is"),
        (dict(bypass_mode=True, loss_type="sapo"), ValueError, "bypass_mode"),
        (dict(generator=1), TypeError, "generator"),
        (dict(loss_type="geo_mean", agg="token-mean"), ValueError, "agg"),
    ],
)
def test_bad_inputs_name_the_argument(kw, exc, match):
    x = _inputs()
    with pytest.raises(exc, match=match):
        _call(x, **kw)


@pytest.mark.parametrize(
    "name, value, exc",
    [
        ("hidden", torch.randn(B * T, H, 1), ValueError),
        ("weight", torch.randn(V, H).double(), TypeError),
        ("labels", torch.zeros(B * T, dtype=torch.long), ValueError),
        ("advantages", torch.randn(B + 1), ValueError),
        ("mask", torch.ones(B, T + 1), ValueError),
        ("global_denom", torch.ones(2), ValueError),
        ("agg", "token-avg", ValueError),
        ("kl_estimator", "kl", ValueError),
        ("temperature", -1.0, ValueError),
        ("logits_dtype", "half", ValueError),
        ("loss_type", "nope", ValueError),
    ],
)
def test_the_registered_op_checks_its_arguments(name, value, exc):
    x = _inputs()
    args, call = _op_args(x)
    call = call._replace(**{name: value, "hidden": call.hidden if name != "hidden" else value})
    with pytest.raises(exc, match=name):
        torch.ops.ppo_kernels.linear_policy_loss(*call[: len(op.ARG_NAMES)])


# --------------------------------------------------------------------------- rollout correction
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "opts",
    [
        dict(rollout_is="token", rollout_is_threshold=1.5),
        dict(
            rollout_is="sequence",
            rollout_is_threshold=(0.5, 3.0),
            rollout_rs="token_k1",
            rollout_rs_threshold=1.3,
        ),
        dict(
            rollout_rs="seq_mean_k3,token_k2",
            rollout_rs_threshold="0.02,0.03",
            rollout_is="token",
            rollout_is_batch_normalize=True,
        ),
    ],
)
@pytest.mark.parametrize("loss_type", ["ppo", "grpo", "gpg"])
def test_rollout_correction_from_given_logprobs(backend, opts, loss_type):
    """Weights and rejection from old vs rollout log-probs, known before the loop: the same as
    ppo_policy_loss with the same options, the KL and entropy terms over the corrected mask."""
    x = _inputs()
    kw = dict(loss_type=loss_type, rollout_logprobs=x["roll"], **opts)
    with use_backend(linear_policy_loss=backend), poisoned():
        loss, stats, grads = _run(x, ref_logprobs=x["ref"], kl_coef=0.2, entropy_coef=0.05, **kw)
    h, W, b = [t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    lp, ent = pk.linear_token_logprobs(h, W, x["labels"], bias=b, return_entropy=True)
    pg, st = pk.ppo_policy_loss(lp, x["old"], x["adv"], x["mask"], **kw)
    rc = pk.rollout_correction(
        x["old"],
        x["roll"],
        x["mask"],
        **{k: v for k, v in opts.items() if k.startswith("rollout_")},
    )
    agg, rows = pm.default_aggregation(loss_type)
    agg_kw = dict(agg=agg, global_batch_size=B if rows else None)
    kl = pk.kl_penalty(lp, x["ref"], "k3")
    ref_loss = (
        pg
        + 0.2 * pk.masked_aggregate(kl, rc.mask, **agg_kw)
        - 0.05 * pk.masked_aggregate(ent, rc.mask, **agg_kw)
    )
    ref_grads = torch.autograd.grad(ref_loss, (h, W, b))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for g, r, n in zip(grads, ref_grads, ("hidden", "weight", "bias")):
        _close_scaled(g, r, 1e-5, n)
    for k, v in st.items():
        torch.testing.assert_close(
            stats[k], v, atol=1e-6, rtol=1e-5, equal_nan=True, msg=lambda m: f"{k}: {m}"
        )


@pytest.mark.parametrize("backend,budget", _budgets(SMALL, None))
@pytest.mark.parametrize(
    "opts",
    [
        dict(rollout_is="token", rollout_is_threshold=1.5),
        dict(
            rollout_is="sequence",
            rollout_is_threshold="0.5_3.0",
            rollout_rs="token_k1",
            rollout_rs_threshold=1.3,
        ),
        dict(rollout_rs="seq_max_k2", rollout_rs_threshold=0.05),
        dict(rollout_is="token", rollout_is_threshold=(0.8, 1.4)),  # IcePop, one pass
    ],
)
@pytest.mark.parametrize("loss_type", ["ppo", "gpg"])
def test_bypass_mode(backend, opts, loss_type, budget):
    """Bypass mode (old_logprobs are the rollout's): weights and rejection from the current
    log-probs -- a first pass, then the loss; against the float64 reference and ppo_policy_loss."""
    x = _inputs()
    kw = dict(loss_type=loss_type, bypass_mode=True, **opts)
    _check(
        x,
        backend,
        ref_logprobs=x["ref"],
        kl_coef=0.2,
        entropy_coef=0.05,
        max_chunk_bytes=SMALL,
        **kw,
    )
    with use_backend(linear_policy_loss=backend):
        _, stats, _ = _run(x, **kw)
    lp = pk.linear_token_logprobs(x["h"], x["W"], x["labels"], bias=x["b"])
    _, st = pk.ppo_policy_loss(lp, x["old"], x["adv"], x["mask"], **kw)
    for k, v in st.items():
        torch.testing.assert_close(
            stats[k], v, atol=1e-5, rtol=1e-5, equal_nan=True, msg=lambda m: f"{k}: {m}"
        )


# --------------------------------------------------------------------------- Liger
LIGER_CASES = [
    ("grpo", "token", {}),
    ("grpo", "sequence", dict(delta=1.5)),
    ("bnpo", "token", dict(delta=1.3)),
    ("bnpo", "sequence", {}),
    ("dr_grpo", "token", dict(mcl=11)),
    ("dapo", "token", {}),
    ("dapo", "sequence", {}),
    # Liger's luspo sums its per-token loss over masked positions too (TRL 1.16 masks the policy
    # term; the KL term it adds per token is summed unmasked by both): compared on a full mask
    ("luspo", "sequence", {}),
    ("cispo", "token", dict(eps=(0.2, 1.25))),
    ("sapo", "token", {}),
]


def _as_liger(t, B, mask, level="token", eps=(0.2, 0.28), delta=None, mcl=None):
    """Our arguments for Liger's loss_type (TRL's semantics; docs/ppo-math.md)."""
    kw = dict(clip_low=eps[0], clip_high=eps[1], importance_sampling_level=level)
    if t in pm.CLIP_TYPES:
        kw.update(loss_type=t, delta=delta)
        if t == "dr_grpo":
            kw["loss_scale_factor"] = mcl
        if t == "dapo":
            kw["global_num_tokens"] = mask.sum()
    elif t == "cispo":  # clamp(ratio, max=epsilon_high), dapo's normaliser
        kw.update(loss_type="cispo", clip_low=1.0, clip_high=eps[1] - 1, log_ratio_clamp=math.inf)
        kw["global_num_tokens"] = mask.sum()
    elif t == "sapo":  # no clamp, grpo's normaliser (every row counts)
        kw.update(loss_type="sapo", log_ratio_clamp=math.inf, global_batch_size=B)
    return kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,level,kw", LIGER_CASES, ids=lambda c: str(c))
def test_against_liger_fused_linear_grpo_loss(backend, t, level, kw):
    """float32, the same inputs: the loss, its metrics (k3 KL mean, clip fraction) and the
    gradients of hidden and weight within 1e-5."""
    need("liger_kernel")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    x = _inputs(per_row_adv=True, bias=False)
    x["labels"][x["labels"] < 0] = 1  # Liger has no ignore_index
    mask = torch.ones_like(x["mask"], dtype=torch.long) if t == "luspo" else x["mask"].long()
    eps = kw.get("eps", (0.2, 0.28))
    liger = LigerFusedLinearGRPOLoss(
        beta=0.05,
        compiled=False,
        use_ref_model=True,
        chunk_size=2,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        loss_type=t,
        max_completion_length=kw.get("mcl"),
        importance_sampling_level=level,
        delta=kw.get("delta"),
    )
    h1, w1 = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()
    ref, (kl_mean, clip) = liger(
        h1,
        w1,
        x["labels"],
        mask,
        x["adv"],
        ref_per_token_logps=x["ref"],
        old_per_token_logps=x["old"],
    )
    ref.backward()
    ours = _as_liger(t, B, mask, level, **kw)
    with use_backend(linear_policy_loss=backend):
        loss, stats, (gh, gW) = _run_liger(x, mask, ours)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    _close_scaled(gh, h1.grad, 1e-5, "hidden")
    _close_scaled(gW, w1.grad, 1e-5, "weight")
    torch.testing.assert_close(stats["kl_mean"], kl_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        stats.get("clip_region_frac", torch.zeros(())), clip, rtol=1e-5, atol=1e-6
    )


def _run_liger(x, mask, ours):
    h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()
    loss, stats = pk.linear_policy_loss(
        h, W, x["labels"], x["adv"], x["old"], mask, ref_logprobs=x["ref"], kl_coef=0.05, **ours
    )
    return loss, stats, torch.autograd.grad(loss, (h, W))


# --------------------------------------------------------------------------- exact KL
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [SMALL * 3, ROWS * 3])
@pytest.mark.parametrize("opts", [{}, dict(softcap=2.5, temperature=0.8)])
def test_exact_kl_against_a_reference_head(backend, budget, opts):
    """ref_hidden / ref_weight: the exact KL(pi || pi_ref) over the vocabulary, the reference
    logits tile computed in the same pass (no gradient to it); ref width differs from H."""
    x = _inputs(bias=False)
    g = torch.Generator().manual_seed(3)
    rh = torch.randn(B, T, 5, generator=g)
    rW = torch.randn(V, 5, generator=g) * 0.7
    rb = torch.randn(V, generator=g) * 0.2
    kw = dict(
        ref_hidden=rh,
        ref_weight=rW,
        ref_bias=rb,
        kl_coef=0.3,
        entropy_coef=0.02,
        max_chunk_bytes=budget,
        **opts,
    )
    _, stats, _ = _check(x, backend, loss_type="grpo", **kw)
    # the same KL as full_kl on the materialised logits
    z = x["h"] @ x["W"].T
    zr = rh @ rW.T + rb
    if "softcap" in opts:
        z, zr = (torch.tanh(t / 2.5) * 2.5 for t in (z, zr))
    full = pk.full_kl(z, zr, temperature=opts.get("temperature", 1.0))
    torch.testing.assert_close(stats["kl"], torch.where(x["mask"], full, 0.0), atol=1e-5, rtol=1e-5)


def test_backward_scales_the_saved_gradients_by_the_upstream_gradient():
    """The backward scales the forward's gradients by the upstream gradient; a retained graph's
    second backward finds them unscaled (gradcheck relies on it)."""
    x = _inputs()
    h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()
    loss, _ = pk.linear_policy_loss(h, W, x["labels"], x["adv"], x["old"], x["mask"])
    (3.0 * loss).backward(retain_graph=True)
    h2, W2 = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()
    loss2, _ = pk.linear_policy_loss(h2, W2, x["labels"], x["adv"], x["old"], x["mask"])
    g = torch.autograd.grad(loss2, (h2, W2))
    torch.testing.assert_close(h.grad, 3 * g[0])
    torch.testing.assert_close(W.grad, 3 * g[1])
    gh, gW = torch.autograd.grad(-2.0 * loss, (h, W))
    torch.testing.assert_close(gh, -2 * g[0])
    torch.testing.assert_close(gW, -2 * g[1])


def test_unit_upstream_gradient_hands_over_the_saved_gradients():
    """loss.backward() (upstream 1) returns the forward's gradients without a scaled copy; a
    retained graph still gives the same gradients on every backward, and changing .grad in place
    after one backward does not change the next (AccumulateGrad copies what the graph still
    holds). A gradient graph (create_graph) still flows through the upstream gradient."""
    x = _inputs()
    h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()
    loss, _ = pk.linear_policy_loss(h, W, x["labels"], x["adv"], x["old"], x["mask"])
    g = [t.clone() for t in torch.autograd.grad(loss, (h, W), retain_graph=True)]
    loss.backward(retain_graph=True)
    torch.testing.assert_close(h.grad, g[0], rtol=0, atol=0)
    torch.testing.assert_close(W.grad, g[1], rtol=0, atol=0)
    h.grad.mul_(7.0)
    W.grad.zero_()
    loss.backward()
    torch.testing.assert_close(h.grad, 8 * g[0])
    torch.testing.assert_close(W.grad, g[1], rtol=0, atol=0)
    # upstream 1 that requires grad: d(dL/dW . v)/du through the upstream gradient u
    u = torch.ones((), requires_grad=True)
    loss, _ = pk.linear_policy_loss(h, W, x["labels"], x["adv"], x["old"], x["mask"])
    (gW,) = torch.autograd.grad(loss, (W,), grad_outputs=u, create_graph=True)
    (du,) = torch.autograd.grad((gW * g[1]).sum(), (u,))
    torch.testing.assert_close(du, (g[1] * g[1]).sum())


def test_peak_memory_holds_one_weight_gradient():
    """Forward + loss.backward() hold the weight gradient once (the forward's sum is handed over,
    not scaled into a copy) next to the chunk budget: no more than the composition's peak."""
    g = torch.Generator().manual_seed(0)
    N, H_, V_ = 64, 128, 4096
    h = torch.randn(N, H_, generator=g)
    W = torch.randn(V_, H_, generator=g) * 0.1
    labels = torch.randint(0, V_, (N,), generator=g)
    adv, old = torch.randn(N, generator=g), -torch.rand(N, generator=g) * 5
    mask = torch.ones(N, dtype=torch.bool)
    budget = 256 * 1024

    def fused():
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
        loss, _ = pk.linear_policy_loss(hh, WW, labels, adv, old, mask, max_chunk_bytes=budget)
        loss.backward()

    def composition():
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
        lp = pk.linear_token_logprobs(hh, WW, labels, max_chunk_bytes=budget)
        loss, _ = pk.ppo_policy_loss(lp, old, adv, mask)
        loss.backward()

    grad_w = V_ * H_ * 4
    peak, peak_comp = peak_extra_bytes(fused), peak_extra_bytes(composition)
    # the leaves' copies and their gradients (2 x (h + W)) are in both; one more W would show
    assert peak < 2 * (N * H_ * 4 + grad_w) + budget + grad_w // 2, (peak, grad_w)
    assert peak <= peak_comp + (64 << 10), (peak, peak_comp)


# The C++ loop (csrc/cpu/linear_policy_loss.cpp): the registered op runs the cpp backend's
# float32 (and bf16 / fp16 input-tile) CPU calls of the clipped types there
# (csrc/ops/linear_policy_loss.cpp). Each case against the Python loop
# (`ppo_kernels_cpp::linear_policy_loss_grads`, op.run) on the same arguments: the same
# statistics, so the same numbers up to the order of float sums; the gradient tiles' softmax
# comes from kept exps there (cpu_rows.h), from a second exp here: float32 rounding, which a bf16
# / fp16 tile element can round across (one unit in its last place).
CPP_LOOP_CASES = [
    dict(loss_type="ppo", dual_clip=3.0, entropy_coef=0.01, temperature=0.8),
    dict(loss_type="ppo", agg="seq-mean-token-sum", kl_coef=0.3, kl_estimator="k2"),
    dict(loss_type="grpo", kl_coef=0.04, kl_estimator="k3", per_row_adv=True),
    dict(loss_type="bnpo", kl_coef=0.1, kl_estimator="k3+", kl_clamp="verl"),
    dict(loss_type="dr_grpo", kl_coef=0.1, kl_estimator="abs", entropy_coef=-0.02),
    dict(loss_type="dapo", global_num_tokens=11, kl_coef=0.2, kl_estimator="k1"),
    dict(loss_type="luspo", clip_high=0.28, kl_coef=0.1, kl_estimator="low_var_kl"),
    dict(loss_type="ppo", agg="seq-mean-token-mean", bias=False, need=(True, False, False)),
    dict(loss_type="ppo", agg="seq-mean-token-sum-norm", float_mask=True, kl_coef=0.1),
    dict(loss_type="grpo", need=(False, True, True), entropy_coef=0.05, kl_coef=0.1),
    dict(loss_type="ppo", global_num_tokens=torch.tensor(13.0), need=(False, False, False)),
]


CPP_LOOP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CPP_LOOP_GRAD_REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _python_runs(monkeypatch) -> list:
    """A list that gets an entry each time the Python loop (op.run) runs."""
    runs = []
    run = op.run
    monkeypatch.setattr(op, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
    return runs


def _python_and_cpp_loops(monkeypatch, args):
    """(C++ loop's outputs, Python loop's outputs) of linear_policy_loss_grads' arguments."""
    python_runs = _python_runs(monkeypatch)
    with use_backend(linear_policy_loss="cpp"), poisoned():
        got = torch.ops.ppo_kernels.linear_policy_loss_grads(*args)
        assert not python_runs, "the registered op did not take the C++ loop"
        want = torch.ops.ppo_kernels_cpp.linear_policy_loss_grads(*args)
        assert python_runs
    return got, want


def _compare_loops(got, want, names, grad_rel):
    assert got[1].shape == want[1].shape == (len(names),)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for k, g, w in zip(names, got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, equal_nan=True, msg=f"{k}")
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("hidden", "weight", "bias"), got[3:], want[3:]):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        _close_scaled(g, w, grad_rel, name)


@pytest.mark.parametrize("dtype", CPP_LOOP_DTYPES, ids=str)
@pytest.mark.parametrize("budget", [SMALL, ROWS])
@pytest.mark.parametrize("case", CPP_LOOP_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_cpp_loop_matches_the_python_loop(monkeypatch, case, budget, dtype):
    kw = dict(case)
    if dtype != torch.float32:
        kw["logits_dtype"] = "input"  # (float32 tiles of bf16 / fp16 take the Python loop)
    x = _inputs(dtype, per_row_adv=kw.pop("per_row_adv", False), bias=kw.pop("bias", True))
    need = kw.pop("need", (True, True, True))
    if kw.pop("float_mask", False):
        x["mask"] = x["mask"] * torch.rand(B, T, generator=torch.Generator().manual_seed(3))
    if "kl_coef" in kw:
        kw["ref_logprobs"] = x["ref"] - 2 * (torch.arange(B * T).view(B, T) % 4 == 0)
    call, _, _ = api.arguments(
        x["h"], x["W"], x["labels"], x["adv"], x["old"], x["mask"], bias=x["b"],
        max_chunk_bytes=budget, **kw,
    )  # fmt: skip
    args = tuple(call._replace(need_hidden=need[0], need_weight=need[1], need_bias=need[2]))
    got, want = _python_and_cpp_loops(monkeypatch, args)
    _compare_loops(got, want, op.stat_names(call), CPP_LOOP_GRAD_REL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # (fp16: max 65504)
def test_cpp_loop_edge_rows_match_the_python_loop(monkeypatch, dtype):
    """Rows whose scaled logits overflow float32 (logits near 3e38 at temperature 0.5: the
    float64 recomputation of their statistics and gradient, cpu_rows.h RowStats64), rows with
    huge but finite scaled logits (the fast path), an ignored label inside the mask, tokens off
    the mask: the same numbers as the Python loop, all finite."""
    x = _inputs()  # (float32: the huge logits are set, then rounded to dtype)
    h, W = x["h"].clone(), x["W"].clone()
    W[0] = 0.0
    W[0, 0] = 1e38  # logit 0 of token n: h[n, 0] * 1e38, the label's in these rows
    h[..., 0] = 0.0
    h[0, :3, 0] = 3.0  # 3e38: scaled by 2 it overflows float32
    h[1, 1, 0] = 1.5  # 1.5e38: 3e38 scaled, finite
    lab = x["labels"].clone()
    lab[0, :3] = lab[1, 1] = 0
    mask = x["mask"].clone()
    mask[0, 3] = True  # (labels.view(-1)[3] is ignore_index)
    kw = dict(ref_logprobs=x["ref"], kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    if dtype != torch.float32:
        kw["logits_dtype"] = "input"
    call, _, _ = api.arguments(
        h.to(dtype), W.to(dtype), lab, x["adv"], x["old"], mask, bias=None, temperature=0.5,
        max_chunk_bytes=SMALL, **kw,
    )  # fmt: skip
    args = tuple(call._replace(need_hidden=True, need_weight=True, need_bias=False))
    got, want = _python_and_cpp_loops(monkeypatch, args)
    lp = got[2][0]
    assert torch.isfinite(lp).all() and torch.isfinite(got[2][1]).all()
    assert lp[0, 3] == 0  # ignored
    assert (lp[0, :3] == 0).all() and lp[1, 1] == 0  # the huge label logit takes all
    for t in (got[0], got[1], *got[3:5]):
        assert torch.isfinite(t).all()
    _compare_loops(got, want, op.stat_names(call), CPP_LOOP_GRAD_REL[dtype])


def test_cpp_loop_takes_bf16_input_tiles_only(monkeypatch):
    """bf16 with float32 tiles (logits_dtype="float32") stays on the Python loop: its tiles are
    float32 copies of upcast blocks, which the C++ loop does not make."""
    x = _inputs(torch.bfloat16)
    call, _, _ = api.arguments(
        x["h"], x["W"], x["labels"], x["adv"], x["old"], x["mask"], logits_dtype="float32"
    )
    python_runs = _python_runs(monkeypatch)
    with use_backend(linear_policy_loss="cpp"):
        torch.ops.ppo_kernels.linear_policy_loss_grads(*call._replace(need_hidden=True))
    assert python_runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width,vocab", [(H, V), (8, 200)])
def test_cpp_loop_chunks_like_the_planner(width, vocab, dtype):
    """The C++ loop's row chunks are linear_logprobs' planner's (plan_chunks on the CPU, float32
    tiles, or bf16 input tiles with their [sub, H] product blocks in the budget): the forward's
    logits GEMMs counted for budgets from under one row to the whole batch (V > 64: the
    planner's under-16-rows rule differs from the plain fit)."""
    g = torch.Generator().manual_seed(0)
    N = B * T
    h = torch.randn(B, T, width, generator=g).to(dtype)
    W = torch.randn(vocab, width, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    adv, old = torch.randn(B, T, generator=g), -torch.rand(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    ld = "float32" if dtype == torch.float32 else "input"
    row = 4 * (vocab + width)
    for budget in (1, 100, row * 2, row * 5 + 3, row * 12, row * 17, SMALL, ROWS, 0):
        rows = engine.plan_rows(h.reshape(N, width), vocab, ld, budget).rows

        def forward(budget=budget):
            with use_backend(linear_policy_loss="cpp"), torch.no_grad():
                pk.linear_policy_loss(
                    h, W, labels, adv, old, mask, max_chunk_bytes=budget or None, logits_dtype=ld
                )

        assert _mm_calls(forward) == -(-N // rows), (budget, rows)


def test_cpp_loop_names_a_bad_label_by_its_position_in_the_batch():
    """Every label is checked before any work: the position is the batch's, not a chunk's."""
    x = _inputs()
    labels = x["labels"].clone()
    labels[2, 5] = V
    with (
        use_backend(linear_policy_loss="cpp"),
        pytest.raises(
            IndexError, match=rf"labels: value {V} at flat position {2 * T + 5} is outside"
        ),
    ):
        pk.linear_policy_loss(
            x["h"], x["W"], labels, x["adv"], x["old"], x["mask"], max_chunk_bytes=SMALL
        )


def test_cpp_loop_kernel_checks_its_arguments():
    """The raw kernel names a bad argument (it is callable on its own)."""
    x = _inputs()
    h = x["h"].reshape(B * T, H)
    args = [h, x["W"], None, x["labels"], x["adv"], x["old"], x["mask"], None, None, None, 0.2,
            0.2, None, 20.0, "token-mean", 1.0, 0.0, "k3", False, -math.inf, math.inf, -math.inf,
            math.inf, 0.0, 1.0, -100, 0, [0, 6], True, True, False]  # fmt: skip
    kernel = torch.ops.ppo_kernels_C.linear_policy_loss_ppo
    assert kernel(*args)[1].shape == (2,)
    for i, bad, match in [
        (0, h.double(), "hidden: expected dtype float32, bfloat16 or float16"),
        (1, x["W"][:, :-1], "weight: expected shape"),
        (1, x["W"].bfloat16(), "weight: expected dtype float32"),
        (4, x["adv"][:, :-1], "advantages: expected shape"),
        (5, x["old"].T, "old_logprobs: expected shape"),
        (3, x["labels"].float(), "labels: expected dtype int64 or int32"),
        (17, "k9", "kl_estimator: unknown mode 'k9'"),
        (26, -1, "max_chunk_bytes: expected a non-negative integer"),
        (27, [0, 15], r"stat_order: expected entries in \[0, 15\)"),
    ]:
        a = list(args)
        a[i] = bad
        if i == 17:
            a[7] = x["ref"]
        with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
            kernel(*a)


# --------------------------------------------------------------------------- the z-loss
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # ppo: the cpp backend's kernels for the policy term (the C++ loop steps aside)
        dict(temperature=0.7, softcap=3.0, ref_logprobs="ref", kl_coef=0.1),
        dict(loss_type="gspo", max_chunk_bytes=SMALL),  # sequences longer than a chunk
        dict(
            loss_type="gpg",
            rollout_is="token",
            rollout_rs="token_k1",
            rollout_rs_threshold=3.0,
            bypass_mode=True,
        ),
        dict(agg="seq-mean-token-mean", dp_size=2, global_batch_size=5),
    ],
    ids=["ppo", "softcap-kl", "gspo-two-pass", "bypass", "global-denominator"],
)
def test_z_loss_matches_the_reference(backend, kw):
    """z_loss * (the mask's mean of lse^2), lse of the tempered logits: its value, its gradient
    (2 c m lse softmax / (T sum m), at the label through dL/dz_label) and the `z_loss` stat."""
    x = _inputs()
    x["b"] = x["b"] + 2.0  # lse far from 0
    kw = {k: x["ref"] if v == "ref" else v for k, v in kw.items()}
    _, stats, _ = _check(x, backend, z_loss=0.01, entropy_coef=0.01, **kw)
    assert float(stats["z_loss"]) > 1.0


def test_z_loss_gradcheck_float64():
    x = _inputs(torch.float64, shape=(2, 3))
    h, W, b = [t.clone().requires_grad_() for t in (x["h"][:, :, :4], x["W"][:9, :4], x["b"][:9])]
    labels = x["labels"] % 9
    labels[0, 1] = -100

    def f(h, W, b):
        loss, _ = pk.linear_policy_loss(
            h, W, labels, x["adv"], x["old"], x["mask"], bias=b, z_loss=0.3, temperature=0.8,
            softcap=3.0, max_chunk_bytes=150, entropy_coef=0.1,
        )  # fmt: skip
        return loss

    assert torch.autograd.gradcheck(f, (h, W, b))


def test_z_loss_off_and_bad_values():
    x = _inputs()
    _, stats, _ = _run(x)
    assert "z_loss" not in stats
    for bad, exc in ((-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError)):
        with pytest.raises(exc, match="z_loss"):
            _run(x, z_loss=bad)
