"""linear_distill_loss under the rollout sampler's distribution (temperature tensor, top-k, top-p,
min-p, vLLM's / SGLang's rules) on every CPU backend, against a float64 reference written from the
semantics: both heads' logits materialised, the student's kept set from token_logprobs' float64
sampler reference, p_K renormalised on it, the teacher's q whole, the divergence of the two, the
hard-label term at temperature 1. Small sizes: the Triton interpreter runs the sampler's search
per element."""

import pytest
import torch
from support import sampler_losses as SL
from support.skips import requires_extension
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.distill import api, op

BACKENDS = cpu_backends("linear_distill_loss")
B, T, H, HT, V = 3, 4, 8, 6, 29
# two rows per block (four tiles of two rows, plus the per-row buffers): several blocks
SMALL = 4 * 2 * (V * 4 + H * 4)
ops = torch.ops.ppo_kernels


def _inputs(seed=0, dtype=torch.float32):
    return SL.distill_inputs(B, T, H, HT, V, dtype=dtype, seed=seed)


SETTINGS = SL.distill_settings(B, T)


def _run(x, **kw):
    h, W, b = [x[k].clone().requires_grad_() for k in ("h", "W", "b")]
    loss, stats = pk.linear_distill_loss(
        h, W, x["labels"], x["th"], x["tW"], bias=b, mask=x["mask"], **kw
    )
    return loss, stats, torch.autograd.grad(loss, (h, W, b))


_reference = SL.distill_reference


def _close(ours, ref, what, atol=2e-5, rtol=2e-5):
    ref = ref.to(ours.dtype).reshape(ours.shape)
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(ours), inf), what
    torch.testing.assert_close(ours[~inf], ref[~inf], atol=atol, rtol=rtol, msg=what)
    assert torch.equal(ours[inf], ref[inf]), what


def _check(x, backend, atol=2e-5, **kw):
    with use_backend(linear_distill_loss=backend), poisoned():
        loss, stats, grads = _run(x, **kw)
    rloss, rstats, rgrads = _reference(x, **kw)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), rloss, atol=atol, rtol=2e-5)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.double(), r, atol=atol, rtol=1e-4, msg=name)
    assert sorted(stats) == sorted(rstats)
    for k, v in stats.items():
        assert not v.requires_grad, k
        if v.dtype == torch.bool:
            assert torch.equal(v, rstats[k].reshape(v.shape)), k
        else:
            _close(v, rstats[k], k, atol=atol)
    return loss, stats, grads


# (backend, budget, setting): one block and several; the Triton interpreter runs two
CASES = [
    (backend, SMALL if i % 2 else None, s)
    for backend in BACKENDS
    for i, s in enumerate(sorted(SETTINGS))
    if backend == "cpp"
    or (backend == "eager" and s in ("all", "per_row", "temperature_tensor_only"))
    or (backend == "triton" and s in ("per_row", "per_token_temperature"))
]


@pytest.mark.parametrize("backend,budget,setting", CASES)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_matches_the_float64_reference(backend, budget, sampler, setting):
    x = _inputs()
    _, stats, _ = _check(x, backend, max_chunk_bytes=budget, sampler=sampler, **SETTINGS[setting])
    n = int(stats["num_outside"])
    if setting not in ("temperature_tensor_only", "topp"):
        assert n > 0  # the argmin labels fall outside
    assert torch.isneginf(stats["sampled_reverse_kl"][stats["outside"]]).all()
    assert torch.isfinite(stats["divergence"]).all()


def test_edge_settings():
    """k = 1 (every tied maximum under vllm, the lowest id under sglang), k = V and p = 1 (off:
    the plain loss), min_p = 1 (the maxima), p -> 0, tied logits at the cut, one block and
    several, a config's weights."""
    x = _inputs()
    W, b = x["W"].clone(), x["b"].clone()
    W[5], b[5] = W[7], b[7]  # tokens 5 and 7: the same logit everywhere
    x["W"], x["b"] = W, b
    z = x["h"] @ W.T + b
    x["labels"][0, 0] = z[0, 0].argmax(-1)
    for sampler in ("vllm", "sglang"):
        for i, opts in enumerate((
            dict(top_k=1),
            dict(top_k=V, divergence="forward_kl"),
            dict(top_p=1.0, temperature=torch.full((B,), 0.9)),
            dict(min_p=1.0, weight_hard_loss=0.0),
            dict(top_p=1e-6, weight_soft_loss=1.0),
            dict(top_k=2, top_p=0.6, divergence="tv"),
        )):  # fmt: skip
            _, stats, _ = _check(
                x, "cpp", sampler=sampler, max_chunk_bytes=SMALL if i % 2 else None, **opts
            )
            if opts.get("top_k") == 1:
                assert not stats["outside"][0, 0]  # the argmax label is kept
    # k = V and p = 1: the plain loss (no truncation)
    plain = _run(x, temperature=0.9, divergence="forward_kl")
    for opts in (
        dict(top_k=V, temperature=0.9),
        dict(top_p=1.0, temperature=torch.full((B,), 0.9)),
    ):
        loss, stats, grads = _run(x, divergence="forward_kl", **opts)
        assert int(stats["num_outside"]) == 0
        torch.testing.assert_close(loss, plain[0], atol=2e-6, rtol=2e-6)
        for g, r in zip(grads, plain[2]):
            torch.testing.assert_close(g, r, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_random_parameters(sampler):
    """Per-row k, p, min-p and temperatures drawn at random, their boundaries among them (k = 1,
    k = V, p -> 0, p = 1, min_p = 0 and 1), against the reference."""
    g = torch.Generator().manual_seed(7)
    x = _inputs(seed=2)

    def pick(choices, rand):
        i = torch.randint(0, len(choices) + 1, (B,), generator=g)
        v = torch.tensor([float(c) for c in choices] + [0.0])[i]
        return torch.where(i == len(choices), rand, v)

    for div in ("reverse_kl", "jsd", "tv") * 3:
        opts = dict(
            temperature=torch.rand(B, generator=g) * 1.7 + 0.3,
            top_k=pick((1, V, 0), torch.randint(1, V, (B,), generator=g).float()).long(),
            top_p=pick((1.0, 1e-6), torch.rand(B, generator=g) * 0.98 + 0.01),
            min_p=pick((0.0, 1.0), torch.rand(B, generator=g) * 0.3),
            divergence=div,
        )
        _check(x, "cpp", sampler=sampler, max_chunk_bytes=SMALL, **opts)


@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
def test_bfloat16(logits_dtype):
    x = _inputs(dtype=torch.bfloat16)
    with use_backend(linear_distill_loss="cpp"), poisoned():
        loss, stats, grads = _run(x, logits_dtype=logits_dtype, **SETTINGS["all"])
    rloss, rstats, _ = _reference(x, **SETTINGS["all"])
    torch.testing.assert_close(loss.double(), rloss, atol=2e-2, rtol=2e-2)
    assert torch.equal(stats["outside"], rstats["outside"].view(B, T))
    assert all(torch.isfinite(g).all() for g in grads)


def test_no_kept_token():
    x = _inputs()
    x["labels"] = torch.full((B, T), -100)
    loss, stats, grads = _run(x, top_k=3, divergence="tv")
    assert float(loss.detach()) == 0 and int(stats["num_outside"]) == 0
    assert all(bool((g == 0).all()) for g in grads)


def test_temperature_tensor_in_the_config():
    """A temperature tensor as the config's field: the same call as the flat one."""
    x = _inputs()
    t = SETTINGS["per_row"]["temperature"]
    a = _run(x, temperature=t, divergence="tv")
    cfg = pk.DistillLossConfig(temperature=t, divergence="tv")
    b = _run(x, distill_config=cfg)
    assert torch.equal(a[0], b[0])
    for g, r in zip(a[2], b[2]):
        assert torch.equal(g, r)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    n, hd, v = 5, 4, 9
    h = torch.randn(n, hd, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(v, hd, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    th, tW = torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(v, 3).double()
    labels = torch.tensor([1, -100, 4, 8, 0])
    temps = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    for div, beta in (("jsd", 0.3), ("reverse_kl", 0.5)):

        def f(h, W, bias, div=div, beta=beta):
            return pk.linear_distill_loss(
                h, W, labels, th, tW, bias=bias, divergence=div, beta=beta, temperature=temps,
                top_k=4, top_p=0.9, weight_hard_loss=0.3, max_chunk_bytes=600,
            )[0]  # fmt: skip

        assert torch.autograd.gradcheck(f, (h, W, bias))


def _op_args(x, **kw):
    """The sampler op's arguments, as the API builds them."""
    captured = []
    real = api._sampler_op
    api._sampler_op = lambda *a: captured.append(a) or real(*a)
    try:
        pk.linear_distill_loss(x["h"], x["W"], x["labels"], x["th"], x["tW"], bias=x["b"],
                               mask=x["mask"], **kw)  # fmt: skip
    finally:
        api._sampler_op = real
    return list(captured[0])


@requires_extension
def test_opcheck():
    x = _inputs()
    args = _op_args(x, **SETTINGS["per_row"])
    i = op.ARG_NAMES.index
    for k in ("hidden", "weight", "bias"):
        args[i(k)] = args[i(k)].clone().requires_grad_()
    with use_backend(linear_distill_loss="cpp"):
        torch.library.opcheck(torch.ops.ppo_kernels.linear_distill_loss_sampler.default, args)
        d = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(
            torch.ops.ppo_kernels.linear_distill_loss_sampler_grads.default, (*d, True, True, True)
        )


@requires_extension
def test_without_options_the_plain_path_runs():
    """No sampler option (a float temperature): the plain op; the sampler's op is not called."""
    x = _inputs()
    calls = []
    real = api._sampler_op
    api._sampler_op = lambda *a: calls.append(a) or real(*a)
    try:
        loss, stats, _ = _run(x, temperature=0.9, divergence="forward_kl")
    finally:
        api._sampler_op = real
    assert not calls and "num_outside" not in stats and "outside" not in stats
    assert torch.isfinite(loss)


@requires_extension  # (without it the API reads the tensors' values: a graph break)
def test_compile():
    x = _inputs()
    temps = torch.rand(B) + 0.5

    def f(h, W, y, th, tW, t):
        loss, st = pk.linear_distill_loss(h, W, y, th, tW, temperature=t, top_k=4, top_p=0.9,
                                          divergence="reverse_kl")  # fmt: skip
        return loss, st["num_outside"]

    args = (x["h"], x["W"], x["labels"], x["th"], x["tW"], temps)
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")(*args)
    torch.testing.assert_close(compiled, eager)


BAD = [
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=torch.tensor([1, -2, 3])), ValueError, "top_k"),
    (dict(top_k=torch.tensor([1.0, 2.0, 3.0])), TypeError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=torch.tensor([0.5, 1.2, 0.9])), ValueError, "top_p"),
    (dict(min_p=1.5), ValueError, "min_p"),
    (dict(temperature=torch.ones(5)), ValueError, "temperature"),
    (dict(temperature=torch.ones(B, T + 1)), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, 0.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, -1.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=torch.ones(B, dtype=torch.long)), TypeError, "temperature"),
    (dict(top_k=3, sampler="hf"), ValueError, "sampler"),
    (dict(sampler="hf"), ValueError, "sampler"),
    (dict(top_k=3, divergence="forward_kl"), ValueError, "divergence"),
    (dict(min_p=0.1, divergence="jsd", beta=0.0), ValueError, "divergence"),
    (dict(top_p=torch.full((B,), 0.5), divergence="forward_kl"), ValueError, "divergence"),
    (dict(top_k=3, temperature=torch.ones(B), distill_config=pk.DistillLossConfig()), TypeError,
     "distill_config"),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_name_the_argument(case):
    kw, exc, match = BAD[case]
    x = _inputs()
    with pytest.raises(exc, match=match):
        pk.linear_distill_loss(x["h"], x["W"], x["labels"], x["th"], x["tW"], **kw)


def test_a_cached_teacher_is_refused():
    x = _inputs()
    ids = torch.zeros(B, T, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="topk_ids"):
        pk.linear_distill_loss(x["h"], x["W"], x["labels"], topk_ids=ids,
                               topk_logprobs=torch.zeros(B, T, 2), top_k=3)  # fmt: skip


@requires_extension
def test_the_registered_op_checks_its_arguments():
    x = _inputs()
    args = _op_args(x, **SETTINGS["all"])
    i = op.ARG_NAMES.index
    s = len(op.ARG_NAMES) + op.SAMPLER_NAMES.index("top_k")
    for name, k, v in (("divergence", i("divergence"), "forward_kl"), ("top_k", s, -2),
                       ("temperature", s - 1, torch.zeros(B * T))):  # fmt: skip
        bad = list(args)
        bad[k] = v
        with pytest.raises(ValueError, match=name):
            ops.linear_distill_loss_sampler(*bad)
