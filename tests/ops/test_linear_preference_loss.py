"""linear_preference_loss (the fused hidden-states preference loss) against autograd of its float64
reference on materialised logits (ppo_kernels/linear_preference_loss/naive.py) on every CPU
backend, NaN-poisoned; the layouts (halves, explicit pairs), the reference (given, a head, none),
the passes and the GEMM count, gradcheck, opcheck, torch.compile, bad inputs, low precision,
batch-invariant mode."""

import math

import pytest
import torch
from support import sampler_losses as SL
from support.skips import NO_EXTENSION
from support.utils import cpu_backends, peak_extra_bytes, poisoned

import ppo_kernels as pk
from ppo_kernels import _backend, batch_invariant, use_backend
from ppo_kernels.fused_linear import engine
from ppo_kernels.linear_preference_loss import api, head, op
from ppo_kernels.losses import preference_math as prm

BACKENDS = cpu_backends("linear_preference_loss")
P, T, H, V = 3, 5, 8, 11
R = 2 * P
# a budget of 7 rows per block: a pair (2T = 10 tokens) is longer than a block
SMALL = 600
# several pairs per block
BIG = 1 << 16


def _inputs(dtype=torch.float32, seed=0, rows=R, bias=True, T=T, H=H):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, T, H, generator=g).to(dtype)
    W = (0.7 * torch.randn(V, H, generator=g)).to(dtype)
    b = (0.2 * torch.randn(V, generator=g)).to(dtype) if bias else None
    labels = torch.randint(0, V, (rows, T), generator=g)
    labels[:, :1] = -100  # the prompt
    if rows > 1:
        labels[1, 3:] = -100  # completions of different lengths
    mask = torch.ones(rows, T, dtype=torch.bool)
    if rows > 2:
        mask[2, -1] = False
    # a reference head near the policy (the f-divergence scores exponentiate the log-ratios)
    rh = (h.float() + 0.3 * torch.randn(rows, T, H, generator=g)).to(dtype)
    rW = (W.float() + 0.1 * torch.randn(V, H, generator=g)).to(dtype)
    with torch.no_grad():
        lp = pk.linear_token_logprobs(h.double(), W.double(), labels, bias=None)
    ref = ((lp * mask).sum(-1) + 0.5 * torch.randn(rows, generator=g, dtype=torch.float64)).float()
    y = torch.rand(rows, generator=g) > 0.4
    return dict(h=h, W=W, b=b, labels=labels, mask=mask, rh=rh, rW=rW, ref=ref, y=y)


def _kw(x, ref):
    """The reference as the call gives it: given sequence log-probs, a head, or none."""
    if ref == "given":
        return dict(ref_logps=x["ref"])
    if ref == "head":
        return dict(ref_hidden=x["rh"], ref_weight=x["rW"])
    return {}


def _run(x, **kw):
    """(loss, stats, grads of h / W / b) of the public op."""
    h, W, b = [None if t is None else t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    loss, stats = pk.linear_preference_loss(h, W, x["labels"], x["mask"], bias=b, **kw)
    grads = torch.autograd.grad(loss, [t for t in (h, W, b) if t is not None])
    return loss, stats, grads


# (loss, stats, rows, token lp, grads) of the float64 reference on the same call
_reference = SL.preference_reference


def _close_scaled(a, b, rel, name):
    """|a - b| <= rel * max|b| (+ a floor): gradients are sums whose terms cancel."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    assert err <= rel * scale + 1e-6, f"{name}: max error {err} (scale {scale})"


def _check(x, backend, rel=2e-5, atol=2e-5, **kw):
    with use_backend(linear_preference_loss=backend), poisoned():
        loss, stats, grads = _run(x, **kw)
    rloss, rstats, rrows, rlp, rgrads = _reference(x, **kw)
    dt = torch.float64 if x["h"].dtype == torch.float64 else torch.float32
    assert loss.dtype == dt and loss.dim() == 0
    torch.testing.assert_close(loss.double(), rloss.detach().double(), atol=atol, rtol=2e-5)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == x["h"].dtype and not g.isnan().any(), name
        _close_scaled(g, r, rel, name)
    assert set(rstats) == set(op.stat_names(api.arguments(x["h"], x["W"], x["labels"], **kw)[0]))
    for k, v in rstats.items():
        assert not stats[k].requires_grad, k
        torch.testing.assert_close(stats[k].double(), v.double(), atol=atol, rtol=2e-5, msg=k)
    for k in ("logps", "rewards") + (("ref_logps",) if "ref_logps" in stats else ()):
        torch.testing.assert_close(
            stats[k].double(), rrows[k].double(), atol=atol, rtol=2e-5, msg=k
        )
    torch.testing.assert_close(stats["token_logprobs"].double(), rlp.double(), atol=atol, rtol=2e-5)
    return loss, stats, grads


# (loss types, options) of every type, with the options the peers run
PAIRED = [((t,), {}) for t in prm.TRL_TYPES if t not in ("exo_pair", "robust")]
PAIRED += [
    (("exo_pair",), dict(label_smoothing=1e-3)),
    (("robust",), dict(label_smoothing=0.1)),
    (("aot",), dict(label_smoothing=0.2)),
    (("sigmoid", "bco_pair", "sft"), dict(loss_weights=(0.8, 0.2, 1.0))),  # MPO
    (("sigmoid", "sft"), dict(loss_weights=(1.0, 0.5), ld_alpha=0.3)),  # LD-DPO + RPO's NLL
    (("sigmoid",), dict(average_log_prob=True)),
    (("hinge", "ipo"), dict(f_divergence_type="js_divergence", beta=0.5)),
    (("sigmoid_norm",), dict(f_divergence_type="forward_kl")),
    (("discopop",), dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.7)),
]
FREE = [
    (("orpo", "sft"), dict(beta=0.2)),
    (("simpo", "sft"), dict(simpo_gamma=0.3, label_smoothing=0.1)),
    (("cpo",), dict(label_smoothing=0.05)),
]


def _ids(c):
    types, kw = c
    return "+".join(types) + "".join(f"-{k}" for k in kw)


# the interpreter (triton) takes one type of each path through first passes
PAIRED_RUNS = [
    pytest.param(backend, case, budget, id=f"{backend}-{_ids(case)}-{budget}")
    for backend in BACKENDS
    for case in PAIRED
    for budget in (SMALL, BIG)
    if backend != "triton" or budget != SMALL or case[0][0] in ("sigmoid", "aot")
]


@pytest.mark.parametrize("backend, case, budget", PAIRED_RUNS)
def test_every_paired_type_matches_the_reference(backend, case, budget):
    types, kw = case
    _check(_inputs(), backend, loss_type=types, ref_logps=_inputs()["ref"],
           max_chunk_bytes=budget, **kw)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FREE, ids=_ids)
@pytest.mark.parametrize("budget", [SMALL, BIG])
def test_reference_free_types_match_the_reference(backend, case, budget):
    types, kw = case
    x = _inputs(seed=1)
    _check(x, backend, loss_type=types, max_chunk_bytes=budget, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ref", ["given", "head", "none"])
@pytest.mark.parametrize("budget", [SMALL, BIG])
@pytest.mark.parametrize("types", [("sigmoid",), ("apo_down", "sft"), ("aot_unpaired",)], ids=str)
def test_the_reference_given_as_a_head_or_none(backend, ref, budget, types):
    x = _inputs(seed=2)
    _, st, _ = _check(x, backend, loss_type=types, max_chunk_bytes=budget, **_kw(x, ref))
    if ref == "head":  # the reference head's token log-probs, reduced as the policy's
        lp = pk.linear_token_logprobs(x["rh"], x["rW"], x["labels"].masked_fill(~x["mask"], -100))
        torch.testing.assert_close(st["ref_token_logprobs"], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st["ref_logps"], lp.sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", prm.UNPAIRED_TYPES)
@pytest.mark.parametrize("ref", ["given", "head", "none"])
@pytest.mark.parametrize("budget", [SMALL, BIG])
def test_unpaired_types_match_the_reference(backend, t, ref, budget):
    x = _inputs(seed=3)
    kw = dict(desirable_weight=1.3, undesirable_weight=0.7, beta=0.3)
    _check(x, backend, loss_type=t, desirable=x["y"], reference_point=0.4,
           max_chunk_bytes=budget, **kw, **_kw(x, ref))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [SMALL, BIG])
def test_explicit_pairs_match_the_halves(backend, budget):
    """Rows in any order with `pairs` naming each pair's rows: the loss, metrics and gradients of
    the same pairs laid out as halves; per-row outputs follow the rows."""
    x = _inputs(seed=4)
    perm = torch.tensor([4, 0, 3, 5, 1, 2])  # row i of the shuffled call is row perm[i]
    inv = torch.argsort(perm)
    pairs = torch.stack((inv[:P], inv[P:]), 1)  # (chosen, rejected) of pair p, where they went
    kw = dict(loss_type=("sigmoid", "sft"), max_chunk_bytes=budget)
    y = {k: (v[perm] if k in ("h", "labels", "mask", "ref", "rh") else v) for k, v in x.items()}
    with use_backend(linear_preference_loss=backend):
        a = _run(x, **kw, ref_logps=x["ref"])
        b = _run(y, **kw, ref_logps=y["ref"], pairs=pairs)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[2][0], b[2][0][inv])
    torch.testing.assert_close(a[2][1], b[2][1], atol=1e-6, rtol=1e-5)
    for k in ("logps", "rewards"):
        torch.testing.assert_close(a[1][k], b[1][k][inv])
    for k in ("chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards"):
        torch.testing.assert_close(a[1][k], b[1][k])
    torch.testing.assert_close(a[1]["token_logprobs"], b[1]["token_logprobs"][inv])
    _check(y, backend, ref_logps=y["ref"], pairs=pairs, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_softcap_no_bias_and_entropy(backend):
    x = _inputs(seed=5, bias=False)
    kw = dict(temperature=0.8, softcap=2.5, return_entropy=True)
    _, st, _ = _check(x, backend, loss_type="ipo", **kw, **_kw(x, "head"))
    lab = x["labels"].masked_fill(~x["mask"], -100)
    lp, ent = pk.linear_token_logprobs(x["h"], x["W"], lab, temperature=0.8, softcap=2.5,
                                       return_entropy=True)  # fmt: skip
    torch.testing.assert_close(st["entropy"], ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st["token_logprobs"], lp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
def test_low_precision(backend, dtype, logits_dtype):
    x = _inputs(dtype, seed=6)
    # the reference sees the same rounded inputs (and, for "input" tiles, rounds its logits);
    # the gradients are rounded to the input dtype on output
    loss, st, grads = _check(x, backend, rel=2e-2, atol=5e-5, logits_dtype=logits_dtype,
                             **_kw(x, "head"))  # fmt: skip
    assert all(g.dtype == dtype for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_runs_the_float64_loop(backend):
    x = _inputs(torch.float64, seed=7)
    loss, _, _ = _check(x, backend, rel=1e-10, atol=1e-10, loss_type=("nca_pair", "sft"),
                        **_kw(x, "head"))  # fmt: skip
    assert loss.dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_tokens_and_empty_batch(backend):
    """A completion without tokens has sequence log-prob 0 (its mean too) and no gradient; no
    chosen tokens leave the SFT term 0; no rows give loss 0 and empty outputs."""
    x = _inputs(seed=8)
    x["mask"][0] = False
    x["mask"][P + 1] = False
    with use_backend(linear_preference_loss=backend), poisoned():
        loss, st, grads = _run(x, loss_type=("sigmoid", "sft"), average_log_prob=True)
    assert st["logps"][0] == 0 and st["logps"][P + 1] == 0 and torch.isfinite(loss)
    assert (grads[0][0] == 0).all() and (grads[0][P + 1] == 0).all()
    _check(x, backend, loss_type=("sigmoid", "sft"), average_log_prob=True)
    x["mask"][:P] = False
    with use_backend(linear_preference_loss=backend), poisoned():
        loss, st, _ = _run(x, loss_type=("sft",))
    assert loss.item() == 0 and st["nll_loss"].item() == 0
    e = {k: (v[:0] if isinstance(v, torch.Tensor) and k != "W" and k != "b" else v)
         for k, v in x.items()}  # fmt: skip
    with use_backend(linear_preference_loss=backend), poisoned():
        loss, st, grads = _run(e)
    assert loss.item() == 0 and st["logps"].shape == (0,) and grads[0].shape == (0, T, H)
    assert grads[1].abs().sum() == 0
    with use_backend(linear_preference_loss=backend), poisoned():
        loss, st, _ = _run(e, loss_type="kto", desirable=x["y"][:0])
    assert loss.item() == 0


def _mm_calls(fn):
    """The GEMMs (aten mm / addmm) that fn runs, counted by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return sum(n in ("aten::mm", "aten::addmm", "aten::addmm_") for n in names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_count(backend):
    """Whole pairs per block: the logits GEMM, then G W and G^T h in the forward (3); a frozen
    head 2; a reference head one more (its tile, no gradient); a pair longer than a block or a
    sorted type: a first pass of log-probs (4; with a reference head 5: its own pass first)."""
    x = _inputs()
    h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()

    def fused(w=W, **kw):
        with use_backend(linear_preference_loss=backend):
            loss, _ = pk.linear_preference_loss(h, w, x["labels"], x["mask"], **kw)
            loss.backward()

    rh = dict(ref_hidden=x["rh"], ref_weight=x["rW"])
    assert _mm_calls(fused) == 3
    assert _mm_calls(lambda: fused(w=x["W"])) == 2
    assert _mm_calls(lambda: fused(**rh)) == 4
    assert _mm_calls(lambda: fused(loss_type="aot")) == 4
    # per block of a small budget (several blocks)
    n1 = -(-R * T // engine.plan_rows(x["h"].view(-1, H), V, "float32", SMALL).rows)
    assert _mm_calls(lambda: fused(max_chunk_bytes=SMALL)) == 4 * n1
    assert _mm_calls(lambda: fused(max_chunk_bytes=SMALL, **rh)) == 5 * n1
    # the two tiles side by side would cut a pair: the reference head's pass first, then one
    n3 = -(-R * T // engine.plan_rows(x["h"].view(-1, H), V, "float32", 1000).rows)
    assert _mm_calls(lambda: fused(max_chunk_bytes=1000, **rh)) == 4 * n3
    kto = dict(loss_type="kto", desirable=x["y"], max_chunk_bytes=SMALL)
    assert _mm_calls(lambda: fused(**kto)) == 3 * -(-R // (7 // T))  # whole rows per block
    with torch.no_grad():
        assert _mm_calls(lambda: pk.linear_preference_loss(h, W, x["labels"])) == 1


def test_passes():
    """Pair-scope types: one pass while a block holds a pair (2T rows); the sorted types (and
    sft under pair weights) two; unpaired types need whole rows only."""
    x = _inputs()

    def head_of(**kw):
        call, _ = api.arguments(x["h"], x["W"], x["labels"], **kw)
        cfg = head.config(call)
        layout = head.Layout(cfg, call.pairs, R, T, "cpu")
        return head.PreferenceHead(call, cfg, layout, call.labels, torch.float32)

    assert head_of().passes(2 * T, T) == 1 and head_of().passes(2 * T - 1, T) == 2
    assert head_of().step(5 * T, T) == 4 * T
    assert head_of(loss_type="aot").passes(1000, T) == 2
    kto = head_of(loss_type="kto", desirable=x["y"])
    assert kto.passes(T, T) == 1 and kto.step(3 * T + 1, T) == 3 * T
    assert engine.plan_rows(torch.empty(R * T, H), V, "float32", SMALL).rows < 2 * T
    assert engine.plan_rows(torch.empty(R * T, H), V, "float32", BIG).rows >= 2 * T


def test_the_default_budget_grows_a_block_to_one_pair():
    """A pair whose tile exceeds the default budget: the block grows to hold it (one pass), a
    given budget is kept (a first pass); a reference head then runs its own pass first."""
    Tl, Vl = 600, 30000
    h = torch.empty(2, Tl, 1024)  # H > T: a pair's tile is smaller than its accumulators
    W = torch.empty(Vl, 1024)
    labels = torch.zeros(2, Tl, dtype=torch.long)

    def plan(**kw):
        call, _ = api.arguments(h, W, labels, **kw)
        call = call._replace(need_hidden=True, need_weight=True, need_bias=False)
        cfg = head.config(call)
        hd = head.PreferenceHead(
            call, cfg, head.Layout(cfg, None, 2, Tl, "cpu"), labels, torch.float32
        )
        return op.plan_blocks(hd, call, Vl, op.whole_vocab("eager", 1.0, -100)), hd

    (p, beside, units), hd = plan()
    assert p.rows == 2 * Tl and not hd.needs_first_pass(p.rows) and not beside and not units
    (p, _, units), hd = plan(max_chunk_bytes=64 << 20)
    assert hd.needs_first_pass(p.rows) and not units
    (p, beside, _), hd = plan(ref_hidden=h, ref_weight=W)
    assert p.rows == 2 * Tl and not beside
    (p, _, units), hd = plan(loss_type="aot")  # a batch statistic: a first pass anyway
    assert hd.needs_first_pass(p.rows) and p.rows < 2 * Tl and not units


def test_pairs_longer_than_a_block_run_by_pairs_where_that_takes_less_memory():
    """The default budget with H < T: a pair's two [V, H] gradient accumulators are smaller than
    its tile, so the blocks keep the budget's rows and the loop runs by pairs (engine.run_units);
    with H > T, LD-DPO's token weights or a given budget the block grows or a first pass runs."""
    Tl, Vl = 600, 30000

    def plan(Hd, **kw):
        h, W = torch.empty(2, Tl, Hd), torch.empty(Vl, Hd)
        labels = torch.zeros(2, Tl, dtype=torch.long)
        call, _ = api.arguments(h, W, labels, **kw)
        call = call._replace(need_hidden=True, need_weight=True, need_bias=False)
        cfg = head.config(call)
        hd = head.PreferenceHead(
            call, cfg, head.Layout(cfg, None, 2, Tl, "cpu"), labels, torch.float32
        )
        return op.plan_blocks(hd, call, Vl, op.whole_vocab("eager", 1.0, -100))

    p, _, units = plan(256)
    assert units and p.rows < 2 * Tl
    assert not plan(1024)[2] and plan(1024)[0].rows == 2 * Tl  # H > T: the tile is smaller
    assert not plan(256, ld_alpha=0.5)[2]
    assert not plan(256, max_chunk_bytes=64 << 20)[2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "types, kw",
    [(("sigmoid",), dict(ref="head")), (("sigmoid", "sft"), dict(ref="given")),
     (("ipo",), dict(ref="head", average_log_prob=True)), (("kto",), dict(ref="given")),
     (("simpo", "sft"), dict(ref=None, frozen=True))],
    ids=str,
)  # fmt: skip
def test_by_pairs_equals_the_float64_reference(backend, types, kw, monkeypatch):
    """engine.run_units (a budget of 5 rows, pairs of 2 x 12 tokens, H = 4 < T) against float64:
    the gradient GEMMs on the mask alone into per-row accumulators, scaled once the pair is
    reduced; with the reference head's own pass first, the SFT term, means, unpaired rows and a
    frozen head (no weight accumulators)."""
    from ppo_kernels.fused_linear import planner

    kw = dict(kw)
    ref, frozen = kw.pop("ref"), kw.pop("frozen", False)
    x = _inputs(T=12, H=4, seed=3)
    if frozen:
        x["W"] = x["W"].detach()
    calls = []
    real = engine.run_units
    monkeypatch.setattr(engine, "run_units", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setitem(planner.DEFAULT_MAX_CHUNK_BYTES, "cpu", 300)
    extra = dict(desirable=x["y"], reference_point=0.2) if types == ("kto",) else {}
    _check(x, backend, loss_type=types, **_kw(x, ref), **extra, **kw)
    assert calls, "the loop did not run by pairs"


@pytest.mark.skipif(
    not _backend.HAS_EXTENSION, reason=NO_EXTENSION
)  # the eager kernels copy the tile
def test_the_reference_heads_own_pass_keeps_no_tile():
    """A pair too large for the default budget: the reference head runs its own pass first, and
    its last tile must not outlive that pass (the peak stays one tile, as with given ref_logps)."""
    Tl, Vl, H = 600, 30000, 4
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, Tl, H, generator=g, requires_grad=True)
    W = torch.randn(Vl, H, generator=g, requires_grad=True)
    rh, rW = torch.randn(2, Tl, H, generator=g), torch.randn(Vl, H, generator=g)
    labels = torch.randint(0, Vl, (2, Tl), generator=g)

    def step(**kw):
        loss, _ = pk.linear_preference_loss(h, W, labels, beta=0.1, **kw)
        loss.backward()

    tile = 2 * Tl * Vl * 4
    with use_backend("cpp"):  # LD-DPO's weights: the block grows to the pair
        given = peak_extra_bytes(lambda: step(ref_logps=torch.zeros(2), ld_alpha=0.5))
        head_ = peak_extra_bytes(lambda: step(ref_hidden=rh, ref_weight=rW, ld_alpha=0.5))
        # H < T: by pairs in blocks of the budget, no pair's tile at all
        units = peak_extra_bytes(lambda: step(ref_hidden=rh, ref_weight=rW))
    assert given > tile  # (the policy's tile is in both)
    assert head_ - given < tile / 2, (head_, given, tile)
    assert units < tile / 2, (units, tile)


@pytest.mark.parametrize(
    "types, kw",
    [(("sigmoid", "sft"), {}), (("ipo",), dict(ld_alpha=0.5)), (("orpo",), {}),
     (("aot",), dict(label_smoothing=0.1)), (("kto",), {})],
    ids=str,
)  # fmt: skip
def test_gradcheck_float64(types, kw):
    x = _inputs(torch.float64, seed=9)
    labels = x["labels"]
    extra = dict(desirable=x["y"], reference_point=0.2) if types == ("kto",) else {}
    if types[0] not in prm.REFERENCE_FREE_TYPES:
        extra.update(ref_hidden=x["rh"], ref_weight=x["rW"])
    if types == ("orpo",):  # ORPO's log(1 - p): mean log-probs, below 0
        kw = dict(kw, beta=0.3)

    def f(h, W, b):
        loss, _ = pk.linear_preference_loss(
            h, W, labels, x["mask"], bias=b, loss_type=types, temperature=0.8, softcap=3.0,
            max_chunk_bytes=500, **kw, **extra,
        )  # fmt: skip
        return loss

    leaves = [t.clone().requires_grad_() for t in (x["h"][:, :, :4], x["W"][:, :4], x["b"])]
    assert torch.autograd.gradcheck(f, leaves)


def _op_args(x, **kw):
    call, _ = api.arguments(x["h"], x["W"], x["labels"], x["mask"], bias=x["b"], **kw)
    return tuple(call[: len(op.ARG_NAMES)]), call


@pytest.mark.skipif(not _backend.HAS_EXTENSION, reason=NO_EXTENSION)
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    x = _inputs()
    for t in ("h", "W", "b"):
        x[t] = x[t].requires_grad_()
    with use_backend(linear_preference_loss=backend):
        for kw in (
            dict(ref_logps=x["ref"], loss_type=("sigmoid", "sft"), max_chunk_bytes=SMALL),
            dict(loss_type="aot", ref_hidden=x["rh"], ref_weight=x["rW"]),
            dict(loss_type="kto", desirable=x["y"], reference_point=0.1, return_entropy=True),
            dict(loss_type="simpo", pairs=torch.tensor([[5, 0], [1, 4], [2, 3]])),
        ):
            args, _ = _op_args(x, **kw)
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_preference_loss.default, args, **only
            )
            plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_preference_loss_grads.default,
                plain + (True, True, True),
                **only,
            )


def test_names_of_the_statistics_follow_the_configuration():
    x = _inputs()
    for types, kw in PAIRED + FREE:
        _, call = _op_args(x, loss_type=types, **kw)
        names = op.stat_names(call)
        assert len(set(names)) == len(names)
        assert ("nll_loss" in names) == ("sft" in types)
        assert ("log_odds_ratio" in names) == ("orpo" in types)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    x = _inputs()
    outs = []
    for compiled in (True, False):
        h, W = x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()

        def f(h, W):
            loss, st = pk.linear_preference_loss(
                h * 1.0, W, x["labels"], x["mask"], ref_logps=x["ref"],
                loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5), beta=0.2,
            )  # fmt: skip
            return loss * 2, st["rewards/margins"], st["chosen_logps"], st["token_logprobs"]

        fn = (
            torch.compile(f, fullgraph=True, dynamic=dynamic, backend="aot_eager")
            if compiled
            else f
        )
        loss, *rest = fn(h, W)
        loss.backward()
        outs.append((loss.detach(), *rest, h.grad, W.grad))
    for a, c in zip(*outs):
        torch.testing.assert_close(a, c)


def test_backward_scales_the_saved_gradients():
    x = _inputs()
    h = x["h"].clone().requires_grad_()
    loss, _ = pk.linear_preference_loss(h, x["W"], x["labels"], x["mask"], ref_logps=x["ref"])
    (g1,) = torch.autograd.grad(loss, h, retain_graph=True)
    (g3,) = torch.autograd.grad(3 * loss, h)
    torch.testing.assert_close(g3, 3 * g1)


# --------------------------------------------------------------------------- bad inputs
def _call(x, **kw):
    args = dict(hidden=x["h"], weight=x["W"], labels=x["labels"], mask=x["mask"])
    args.update({k: v for k, v in kw.items() if k in args})
    return pk.linear_preference_loss(**args, **{k: v for k, v in kw.items() if k not in args})


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(hidden=torch.randn(R, T, H).to(torch.int32)), TypeError, "hidden"),
        (dict(hidden=torch.randn(T, H)[0]), ValueError, "hidden"),
        (dict(weight=torch.randn(V, H, dtype=torch.float64)), TypeError, "weight"),
        (dict(weight=torch.randn(V, H + 1)), ValueError, "weight"),
        (dict(bias=torch.randn(V + 1)), ValueError, "bias"),
        (dict(labels=torch.zeros(R, T + 1, dtype=torch.long)), ValueError, "hidden"),
        (dict(labels=torch.zeros(R, T)), TypeError, "labels"),
        (dict(labels=torch.full((R, T), V)), IndexError, "labels"),
        (dict(mask=torch.ones(R, 1)), ValueError, "mask"),
        (dict(mask=torch.ones(R, T, dtype=torch.complex64)), TypeError, "mask"),
        (dict(ref_logps=torch.randn(R, 1)), ValueError, "ref_logps"),
        (dict(ref_logps=torch.zeros(R, dtype=torch.long)), TypeError, "ref_logps"),
        (dict(ref_hidden=torch.randn(R, T, H)), ValueError, "ref_weight"),
        (dict(ref_hidden=torch.randn(R, T + 1, H), ref_weight=torch.randn(V, H)), ValueError,
         "ref_hidden"),
        (dict(ref_hidden=torch.randn(R, T, H), ref_weight=torch.randn(V + 1, H)), ValueError,
         "ref_weight"),
        (dict(ref_bias=torch.randn(V)), ValueError, "ref_bias"),
        (dict(ref_logps=torch.randn(R), loss_type="orpo"), ValueError, "ref_logps"),
        (dict(loss_type="dpo"), ValueError, "loss_type"),
        (dict(loss_type=("kto", "sigmoid")), ValueError, "loss_type"),
        (dict(loss_type="kto"), ValueError, "desirable"),
        (dict(loss_type="kto", desirable=torch.ones(R + 1, dtype=torch.bool)), ValueError,
         "desirable"),
        (dict(desirable=torch.ones(R, dtype=torch.bool)), ValueError, "desirable"),
        (dict(pairs=torch.tensor([[0, 1], [2, 3], [4, 4]])), ValueError, "pairs"),
        (dict(pairs=torch.tensor([[0, 1], [2, 3]])), ValueError, "pairs"),
        (dict(pairs=torch.tensor([[0.0, 1], [2, 3], [4, 5]])), TypeError, "pairs"),
        (dict(pairs=torch.tensor([[0, 1], [2, 3], [4, 6]])), ValueError, "pairs"),
        (dict(labels=torch.zeros(R - 1, T, dtype=torch.long), hidden=torch.randn(R - 1, T, H),
              mask=None), ValueError, "labels"),
        (dict(loss_weights=(1.0, 2.0)), ValueError, "loss_weights"),
        (dict(beta=0.0), ValueError, "beta"),
        (dict(beta="0.1"), TypeError, "beta"),
        (dict(label_smoothing=math.nan), ValueError, "label_smoothing"),
        (dict(loss_type="exo_pair"), ValueError, "label_smoothing"),
        (dict(f_divergence_type="kl"), ValueError, "f_divergence_type"),
        (dict(ld_alpha=0.5, average_log_prob=True), ValueError, "ld_alpha"),
        (dict(reference_point="0.1"), TypeError, "reference_point"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(max_chunk_bytes=0), ValueError, "max_chunk_bytes"),
        (dict(logits_dtype="bf16"), ValueError, "logits_dtype"),
        (dict(return_entropy=1), TypeError, "return_entropy"),
        (dict(vocab_start=0), ValueError, "vocab_start"),
        (dict(loss_config=prm.PreferenceConfig()), TypeError, "loss_config"),
    ],
)  # fmt: skip
def test_bad_inputs_name_the_argument(kw, exc, match):
    x = _inputs()
    with pytest.raises(exc, match=match):
        _call(x, **kw)


@pytest.mark.skipif(not _backend.HAS_EXTENSION, reason=NO_EXTENSION)
@pytest.mark.parametrize(
    "name, value, exc",
    [
        ("hidden", torch.randn(R * T, H, 1), ValueError),
        ("weight", torch.randn(V, H).double(), TypeError),
        ("labels", torch.zeros(R * T, dtype=torch.long), ValueError),
        ("mask", torch.ones(R, T + 1), ValueError),
        ("pairs", torch.zeros(P, 3, dtype=torch.long), ValueError),
        ("desirable", torch.ones(R, dtype=torch.bool), ValueError),
        ("ref_logps", torch.randn(R + 1), ValueError),
        ("reference_point", torch.ones(2), ValueError),
        ("loss_type", [], ValueError),
        ("loss_type", ["nope"], ValueError),
        ("loss_weights", [1.0, 2.0], ValueError),
        ("beta", -1.0, ValueError),
        ("ld_alpha", math.inf, ValueError),
        ("temperature", -1.0, ValueError),
        ("logits_dtype", "half", ValueError),
    ],
)
def test_the_registered_op_checks_its_arguments(name, value, exc):
    x = _inputs()
    _, call = _op_args(x)
    call = call._replace(**{name: value})
    with pytest.raises(exc, match=name):
        torch.ops.ppo_kernels.linear_preference_loss(*call[: len(op.ARG_NAMES)])


# --------------------------------------------------------------------------- batch invariance
def _check_invariant(backend, ref, types, seed=10):
    """A pair's per-row and per-token outputs (sequence log-probs, rewards, token log-probs)
    alone and among other pairs, under budgets that cut the call into other blocks: bitwise
    equal, or an AssertionError naming where they differ."""
    g = torch.Generator().manual_seed(seed)
    n = 9
    unpaired = types == ("kto",)
    x = _inputs(seed=11, rows=2 * n)
    targets = (0, 4, 8)

    def rows_of(idx, budget):
        """The outputs of the pairs idx (rows idx and n + idx) in a call of only those pairs."""
        sel = idx if unpaired else torch.cat((idx, n + idx))
        sub = {k: (v[sel] if isinstance(v, torch.Tensor) and v.shape[:1] == (2 * n,) else v)
               for k, v in x.items()}  # fmt: skip
        kw = dict(loss_type=types, **_kw(sub, ref))
        if unpaired:
            kw["desirable"] = sub["y"]
        with use_backend(linear_preference_loss=backend), batch_invariant():
            _, st = pk.linear_preference_loss(sub["h"], sub["W"], sub["labels"], sub["mask"],
                                              bias=sub["b"], max_chunk_bytes=budget, **kw)  # fmt: skip
        k = idx.numel()
        out = [st[key] for key in ("logps", "rewards", "token_logprobs")]
        return out if unpaired else [torch.stack((t[:k], t[k:]), 1) for t in out]

    alone = {i: rows_of(torch.tensor([i]), None) for i in targets}
    for budget in (None, 3000):
        for size in (3, n):
            idx = torch.randperm(n, generator=g)[:size]
            got = rows_of(idx, budget)
            for pos, i in enumerate(idx.tolist()):
                if i in alone:
                    for a, b in zip(alone[i], got):
                        assert torch.equal(a[0], b[pos]), f"pair {i} differs (n={size})"


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
@pytest.mark.parametrize("ref", ["given", "head"])
@pytest.mark.parametrize("types", [("sigmoid", "sft"), ("aot",), ("kto",)], ids=str)
def test_batch_invariant_rows(backend, ref, types):
    """Under batch_invariant() a pair's outputs do not depend on the rest of the call."""
    _check_invariant(backend, ref, types)


def test_batch_invariance_check_can_fail(monkeypatch):
    """A kernel that moves its log-probs by one ulp when its tile holds more than one pair's
    tokens is caught."""
    from ppo_kernels.token_logprobs import op as tl_op

    eager = tl_op.forward.impls["eager"]

    def drifting(logits, labels, inv_t, ignore_index, with_entropy):
        lp, ent, lse = eager(logits, labels, inv_t, ignore_index, with_entropy)
        if int((labels != ignore_index).sum()) > 2 * T:
            lp = torch.nextafter(lp, torch.full_like(lp, -math.inf))
        return lp, ent, lse

    monkeypatch.setitem(tl_op.forward.impls, "eager", drifting)
    with pytest.raises(AssertionError, match="differs"):
        _check_invariant("eager", "given", ("sigmoid", "sft"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [SMALL, BIG])
def test_logit_stats(backend, budget):
    """return_logit_stats: each token's mean logit (temperature, soft-cap) and whether its label
    is the first largest logit (TRL's is_top1), 0 / False off the completion; in every layout
    and pass (a reference head's pass does not touch them)."""
    x = _inputs(seed=12)
    x["labels"][3, 2] = int((x["h"][3, 2] @ x["W"].T + x["b"]).argmax())  # a top-1 label
    pairs = torch.tensor([[5, 0], [1, 4], [2, 3]])
    kw = dict(temperature=0.7, softcap=4.0, return_logit_stats=True, max_chunk_bytes=budget,
              pairs=pairs, **_kw(x, "head"))  # fmt: skip
    with use_backend(linear_preference_loss=backend), poisoned():
        _, st, _ = _run(x, **kw)
    z = x["h"] @ x["W"].T + x["b"]
    z = 4.0 * torch.tanh(z / 4.0)
    keep = (x["labels"] != -100) & x["mask"]
    torch.testing.assert_close(st["mean_logits"], (z.mean(-1) / 0.7) * keep, atol=1e-5, rtol=1e-5)
    top1 = (z.argmax(-1) == x["labels"]) & keep
    assert st["is_top1"].dtype == torch.bool and torch.equal(st["is_top1"], top1)
    assert top1.any() and not top1.all()
    _, plain, _ = _run(x, **{**kw, "return_logit_stats": False})
    assert "mean_logits" not in plain and "is_top1" not in plain


def test_logit_stats_not_in_the_vocab_parallel_form():
    x = _inputs()
    with pytest.raises(ValueError, match="return_logit_stats"):
        pk.linear_preference_loss(
            x["h"], x["W"], x["labels"], x["mask"], return_logit_stats=True, process_group=object()
        )
