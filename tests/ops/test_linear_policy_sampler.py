"""linear_policy_loss under a rollout sampler's distribution (temperature tensor, top-k, top-p,
min-p, vLLM's / SGLang's rules) on every CPU backend, against the float64 reference: token_logprobs'
eager sampler on the materialised logits feeding the policy loss's naive composition, with the
labels outside the kept set masked out (linear_policy_loss/naive.py; inputs, settings and
reference: support/sampler_losses.py, shared with the GPU tests). Small sizes: the Triton
interpreter runs the sampler's search per element."""

import pytest
import torch
from support import sampler_losses as SL
from support.skips import requires_extension
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.linear_logprobs import naive as ll_ref
from ppo_kernels.linear_policy_loss import api, op

BACKENDS = cpu_backends("linear_policy_loss")
B, T, H, V = 3, 4, 8, 23
# two rows per block (the tile and its gradient of 2 rows, plus the per-row buffers): several
# blocks, a sequence longer than a block
SMALL = 2 * 2 * (V * 4 + H * 4)
ops = torch.ops.ppo_kernels


def _inputs(dtype=torch.float32, seed=0, per_row_adv=False):
    return SL.policy_inputs(B, T, H, V, dtype, seed, per_row_adv)


SETTINGS = SL.sampler_settings(B, T)


def _run(x, leaves=None, **kw):
    h, W, b = leaves or [t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    loss, stats = pk.linear_policy_loss(
        h, W, x["labels"], x["adv"], x["old"], x["mask"], bias=b, **kw
    )
    grads = torch.autograd.grad(loss, (h, W, b))
    return loss, stats, grads


_reference = SL.policy_reference


def _close(ours, ref, what, atol=2e-5, rtol=2e-5):
    ref = ref.to(ours.dtype).reshape(ours.shape)
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(ours), inf), what
    torch.testing.assert_close(ours[~inf], ref[~inf], atol=atol, rtol=rtol, msg=what)
    assert torch.equal(ours[inf], ref[inf]), what


def _check(x, backend, atol=2e-5, **kw):
    with use_backend(linear_policy_loss=backend), poisoned():
        loss, stats, grads = _run(x, **kw)
    rloss, rstats, rgrads = _reference(x, **kw)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), rloss, atol=atol, rtol=2e-5)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.double(), r, atol=atol, rtol=1e-4, msg=name)
    assert sorted(set(stats) - set(rstats)) == []
    for k, v in stats.items():
        assert not v.requires_grad, k
        if v.dtype == torch.bool:
            assert torch.equal(v, rstats[k].reshape(v.shape)), k
        else:
            _close(v, rstats[k].double(), k, atol=atol)
    return loss, stats, grads


# (backend, budget): one block, and several; the Triton interpreter runs the several-block one
BUDGETS = [(b, m) for b in BACKENDS for m in (None, SMALL) if b != "triton" or m is not None]


# the Triton interpreter: a few of them
CASES = [
    (backend, budget, setting)
    for backend, budget in BUDGETS
    for setting in sorted(SETTINGS)
    if backend != "triton" or setting in ("all", "per_row", "per_token_temperature")
]


@pytest.mark.parametrize("backend,budget,setting", CASES)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_matches_the_float64_reference(backend, budget, sampler, setting):
    x = _inputs()
    opts = SETTINGS[setting]
    _, stats, _ = _check(
        x, backend, max_chunk_bytes=budget, sampler=sampler, entropy_coef=0.01, **opts
    )
    n = int(stats["num_outside"])
    assert n == int((stats["outside"] & x["mask"]).sum())
    if setting not in ("temperature_tensor_only", "topp"):
        assert n > 0  # the argmin labels fall outside
    assert torch.isneginf(stats["logprobs"][stats["outside"]]).all()


TYPES = [
    ("ppo", dict(dual_clip=3.0)),
    ("grpo", dict(importance_sampling_level="sequence")),
    ("gspo", {}),
    ("geo_mean", {}),
    ("dr_grpo", {}),
    ("gpg", dict(rollout_is="token", bypass_mode=True)),
    ("cispo", {}),
    ("ppo", dict(agg="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k3")),
    ("kl_cov", dict(kl_cov_ratio=0.2)),
]
# the Triton interpreter: a sequence statistic and a KL term
TYPE_CASES = [
    (backend, t, kw)
    for backend in BACKENDS
    for t, kw in TYPES
    if backend != "triton" or t == "gspo" or "kl_coef" in kw
]


@pytest.mark.parametrize(
    "backend,loss_type,kw",
    TYPE_CASES,
    ids=lambda v: v if isinstance(v, str) else "-".join(v) or "-",
)
def test_loss_types(backend, loss_type, kw):
    """Sequence and batch statistics, bypass mode, a KL term: all on the masked tokens."""
    x = _inputs(per_row_adv=loss_type == "geo_mean")
    kw = dict(kw)
    if kw.get("kl_coef"):
        kw["ref_logprobs"] = x["ref"]
    _check(
        x, backend, max_chunk_bytes=SMALL if backend == "triton" else None, loss_type=loss_type,
        entropy_coef=0.02, **SETTINGS["all"], **kw,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_and_batch_invariant_mode(backend):
    x = _inputs()
    for invariant in (False, True):
        with pk.batch_invariant(invariant):
            _check(
                x, backend, softcap=2.5, max_chunk_bytes=SMALL, entropy_coef=0.05,
                loss_type="gspo", **SETTINGS["per_row"],
            )  # fmt: skip


def test_edge_settings():
    """k = 1 (greedy: every tied maximum under vllm, the lowest id under sglang), k = V and
    p = 1 (off: the plain loss), min-p alone, tied logits at the cut."""
    x = _inputs()
    W = x["W"].clone()
    W[5] = W[7]  # tokens 5 and 7: the same logit everywhere (bias too)
    x["b"] = x["b"].clone()
    x["b"][5] = x["b"][7]
    x["W"] = W
    z = ll_ref.logits(x["h"], W, x["b"])
    top = z.argmax(-1)
    x["labels"][0, 0] = top[0, 0]
    for sampler in ("vllm", "sglang"):
        for opts in (
            dict(top_k=1),
            dict(top_k=V),
            dict(top_p=1.0, temperature=torch.full((B,), 0.9)),
            dict(min_p=0.3),
            dict(top_k=2, top_p=0.6),
        ):
            _, stats, _ = _check(x, "eager", sampler=sampler, **opts)
            if opts.get("top_k") == 1:
                assert not stats["outside"][0, 0]  # the argmax label is kept
    # k = V and p = 1: the plain loss (no truncation, one pass)
    plain = _run(x, temperature=0.9)
    for opts in (
        dict(top_k=V, temperature=0.9),
        dict(top_p=1.0, temperature=torch.full((B,), 0.9)),
    ):
        loss, stats, grads = _run(x, **opts)
        assert int(stats["num_outside"]) == 0
        torch.testing.assert_close(loss, plain[0], atol=2e-6, rtol=2e-6)
        for g, r in zip(grads, plain[2]):
            torch.testing.assert_close(g, r, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outside_tokens_are_masked(backend):
    """mask_outside: the same loss, statistics and gradients as the call whose mask leaves those
    tokens out; num_outside counts the mask's tokens only."""
    x = _inputs()
    opts = dict(SETTINGS["all"], max_chunk_bytes=SMALL, entropy_coef=0.05)
    with use_backend(linear_policy_loss=backend):
        loss, stats, grads = _run(x, **opts)
        outside = stats["outside"]
        assert int(stats["num_outside"]) == int((outside & x["mask"]).sum()) > 0
        assert (outside & ~x["mask"]).any() or True
        y = dict(x, mask=x["mask"] & ~outside)
        loss2, stats2, grads2 = _run(y, **opts)
    assert int(stats2["num_outside"]) == 0
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, loss2, atol=1e-6, rtol=1e-6)
    for g, r in zip(grads, grads2):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    for k in stats2:
        if k not in ("num_outside",):
            torch.testing.assert_close(stats[k], stats2[k], equal_nan=True, msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_outside_off(backend):
    """mask_outside=False: the outside tokens stay in the mask with log-prob -inf, as the
    composition (ppo_policy_loss on token_logprobs' sampled log-probs) has them: for ppo the
    log-ratio clamp keeps the loss finite and no NaN reaches the gradients."""
    x = _inputs()
    kw = dict(SETTINGS["topk"], mask_outside=False, entropy_coef=0.05)
    if backend == "triton":
        kw["max_chunk_bytes"] = SMALL
    loss, stats, grads = _check(x, backend, **kw)
    assert int(stats["num_outside"]) > 0
    # the composition of the public ops on the materialised logits
    h, W, b = (t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"]))
    lp, ent = pk.token_logprobs(h @ W.T + b, x["labels"], temperature=0.8, top_k=5,
                                return_entropy=True)  # fmt: skip
    pg, _ = pk.ppo_policy_loss(lp, x["old"], x["adv"], x["mask"])
    m = x["mask"].float()
    comp = pg - 0.05 * (ent * m).sum() / m.sum()
    torch.testing.assert_close(loss, comp, atol=2e-5, rtol=2e-5)
    for g, r in zip(grads, torch.autograd.grad(comp, (h, W, b))):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-4)


# the z-loss under the sampler: lse of the whole vocabulary at each token's temperature (the
# kernels' with_lse), its gradient the untruncated softmax term beside the sampler's on K
Z_CASES = [
    (backend, budget, setting, mask_outside)
    for backend, budget in BUDGETS
    for setting in ("all", "per_row", "per_token_temperature")
    for mask_outside in (True, False)
    if backend != "triton" or (setting == "per_row" and mask_outside)
]


@pytest.mark.parametrize("backend,budget,setting,mask_outside", Z_CASES)
def test_z_loss_under_the_sampler(backend, budget, setting, mask_outside):
    x = _inputs()
    x["b"] = x["b"] + 2.0  # lse far from 0: the term weighs in the loss and the gradients
    assert x["labels"][0, 1] == -100
    x["h"][0, 1] *= 60.0  # an ignored token's logits past exp's range: no term, no inf * 0
    opts = SETTINGS[setting]
    kw = dict(max_chunk_bytes=budget, entropy_coef=0.01, z_loss=0.05, mask_outside=mask_outside)
    _, stats, grads = _check(x, backend, **kw, **opts)
    assert float(stats["z_loss"]) > 1.0
    # the term is in the gradient: without it the weight's gradient moves
    _, _, g0 = _run(x, **{**kw, "z_loss": 0.0}, **opts)
    assert (grads[1] - g0[1]).abs().max() > 1e-3


def _gradcheck(seed, temps, **kw):
    """gradcheck in float64 of the loss on a tiny head (2 x 3 tokens, V = 9, blocks of 2 rows):
    an ignored label, and the least likely one (outside the kept set)."""
    g = torch.Generator().manual_seed(seed)
    b_, t_, hd, v = 2, 3, 3, 9
    h = torch.randn(b_, t_, hd, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(v, hd, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[0, 3, -100], [8, 1, 4]])
    with torch.no_grad():
        z = h @ W.T + bias
        labels[1, 0] = z[1, 0].argmin()  # outside the kept set
    adv = torch.randn(b_, t_, generator=g, dtype=torch.float64)
    old = torch.randn(b_, t_, generator=g, dtype=torch.float64) * 0.1 - 2.0
    mask = torch.ones(b_, t_, dtype=torch.bool)

    def f(h, W, bias):
        loss, st = pk.linear_policy_loss(
            h, W, labels, adv, old, mask, bias=bias, temperature=temps, entropy_coef=0.1,
            max_chunk_bytes=2 * 2 * (v * 8 + hd * 8), **kw,
        )  # fmt: skip
        assert int(st["num_outside"]) >= 1
        return loss

    assert torch.autograd.gradcheck(f, (h, W, bias))


def test_z_loss_gradcheck_under_the_sampler():
    temps = torch.tensor([[0.7, 1.1, 0.9], [1.3, 0.6, 1.0]], dtype=torch.float64)
    _gradcheck(4, temps, top_k=5, min_p=0.05, softcap=4.0, z_loss=0.2)


def test_gradcheck_float64():
    _gradcheck(3, torch.tensor([0.7, 1.3], dtype=torch.float64), top_k=5, top_p=0.95)


def _op_args(x, **kw):
    call, _, _ = api.arguments(
        x["h"], x["W"], x["labels"], x["adv"], x["old"], x["mask"], bias=x["b"], **kw
    )
    return list(call[: len(op.ARG_NAMES) + len(op.SAMPLER_NAMES)])


@requires_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    x = _inputs()
    args = _op_args(x, max_chunk_bytes=SMALL, entropy_coef=0.1, **SETTINGS["per_row"])
    i = op.ARG_NAMES.index
    for k in ("hidden", "weight", "bias"):
        args[i(k)] = args[i(k)].clone().requires_grad_()
    with use_backend(linear_policy_loss=backend):
        torch.library.opcheck(
            torch.ops.ppo_kernels.linear_policy_loss_sampler.default, args, **only
        )
        if backend != "triton":  # (the interpreter: one opcheck is enough)
            d = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            torch.library.opcheck(
                torch.ops.ppo_kernels.linear_policy_loss_sampler_grads.default,
                (*d, True, True, True),
            )


@requires_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_without_options_the_plain_path_runs(backend):
    """No sampler option: the plain op, bit for bit (the sampler's op is not called)."""
    x = _inputs()
    calls = []
    real = api._sampler_op
    api._sampler_op = lambda *a: calls.append(a) or real(*a)
    try:
        with use_backend(linear_policy_loss=backend):
            for kw in (dict(temperature=0.9), dict(max_chunk_bytes=SMALL, loss_type="gspo")):
                loss, stats, grads = _run(x, **kw)
                args = _op_args(x, **kw)[: len(op.ARG_NAMES)]
                leaves = [x[k].clone().requires_grad_() for k in ("h", "W", "b")]
                for k, t in zip(("hidden", "weight", "bias"), leaves):
                    args[op.ARG_NAMES.index(k)] = t.reshape(-1, H) if k == "hidden" else t
                rloss, rst, rtok = ops.linear_policy_loss(*args)
                rgrads = torch.autograd.grad(rloss, leaves)
                assert torch.equal(loss, rloss) and "num_outside" not in stats
                assert torch.equal(stats["logprobs"], rtok[0].view(B, T))
                for g, r in zip(grads, rgrads):
                    assert torch.equal(g, r)
    finally:
        api._sampler_op = real
    assert not calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("z_loss", [0.0, 0.05])
def test_other_dtypes(dtype, z_loss):
    x = _inputs(dtype)
    kw = dict(SETTINGS["all"], z_loss=z_loss)
    with use_backend(linear_policy_loss="cpp"):
        loss, stats, grads = _run(x, **kw, max_chunk_bytes=8 * SMALL)
    rloss, rstats, rgrads = _reference(x, **kw)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.bfloat16 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(loss.double(), rloss, **tol)
    assert torch.equal(stats["outside"], rstats["outside"])
    assert all(torch.isfinite(g).all() for g in grads)
    gtol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else tol
    for g, r in zip(grads, rgrads):
        torch.testing.assert_close(g.double(), r, **gtol)


def test_compile():
    x = _inputs()
    temps = torch.rand(B) + 0.5

    def f(h, W, y, adv, old, m, t):
        return pk.linear_policy_loss(h, W, y, adv, old, m, temperature=t, top_k=4, top_p=0.9)[0]

    args = (x["h"], x["W"], x["labels"], x["adv"], x["old"], x["mask"], temps)
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")(*args)
    torch.testing.assert_close(compiled, eager)


BAD = [
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=torch.tensor([1, -2, 3])), ValueError, "top_k"),
    (dict(top_k=torch.tensor([1.0, 2.0, 3.0])), TypeError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=torch.tensor([0.5, 1.2, 0.9])), ValueError, "top_p"),
    (dict(min_p=1.5), ValueError, "min_p"),
    (dict(temperature=torch.ones(5)), ValueError, "temperature"),
    (dict(temperature=torch.ones(B, T + 1)), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, 0.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, -1.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=torch.ones(B, dtype=torch.long)), TypeError, "temperature"),
    (dict(top_k=3, sampler="hf"), ValueError, "sampler"),
    (dict(sampler="hf"), ValueError, "sampler"),
    (dict(top_k=3, mask_outside="yes"), TypeError, "mask_outside"),
    (dict(top_k=3, max_chunk_bytes=64), ValueError, "max_chunk_bytes"),
    # (the vocab-parallel form takes the options: it needs torch.distributed first)
    (dict(top_k=3, process_group=object()), RuntimeError, "process_group"),
    (dict(top_k=3, ref_hidden=torch.ones(B, T, 2), ref_weight=torch.ones(V, 2)), ValueError,
     "ref_hidden"),
]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_name_the_argument(backend, case):
    kw, exc, name = BAD[case]
    x = _inputs()
    with use_backend(linear_policy_loss=backend), pytest.raises(exc, match=name):
        _run(x, **kw)


@requires_extension
def test_the_op_refuses_a_reference_head():
    x = _inputs()
    args = _op_args(x, top_k=3)
    i = op.ARG_NAMES.index
    args[i("ref_hidden")], args[i("ref_weight")] = torch.ones(B * T, 2), torch.ones(V, 2)
    with pytest.raises(ValueError, match="ref_hidden"):
        ops.linear_policy_loss_sampler(*args)


def test_no_tokens():
    h = torch.randn(0, T, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    z = torch.zeros(0, T)
    loss, stats = pk.linear_policy_loss(
        h, W, z.long(), z, z, z.bool(), top_k=3, temperature=torch.ones(0)
    )
    loss.backward()
    assert float(loss.detach()) == 0 and int(stats["num_outside"]) == 0
    assert stats["outside"].shape == (0, T) and torch.equal(W.grad, torch.zeros(V, H))


@pytest.mark.parametrize("estimator", [None, "k3"])
def test_mask_outside_off_gradients_stay_finite(estimator):
    """mask_outside=False, every loss type (and a KL term): whatever the loss's value, the
    gradients are finite (docs/ppo-math.md)."""
    from ppo_kernels.losses.config import LOSS_TYPES

    x = _inputs()
    for loss_type in LOSS_TYPES:
        kw = dict(loss_type=loss_type, top_k=5, mask_outside=False, entropy_coef=0.01)
        if loss_type == "dro":
            kw["dro_beta"] = 0.3
        if estimator is not None:
            kw.update(ref_logprobs=x["ref"], kl_coef=0.1, kl_estimator=estimator)
        y = dict(x, adv=x["adv"][:, 0]) if loss_type == "geo_mean" else x
        with use_backend(linear_policy_loss="eager"):
            _, stats, grads = _run(y, **kw)
        assert int(stats["num_outside"]) > 0
        for g in grads:
            assert torch.isfinite(g).all(), loss_type
