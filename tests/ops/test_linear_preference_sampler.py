"""linear_preference_loss under a rollout sampler's distribution (temperature tensor, top-k, top-p,
min-p, vLLM's / SGLang's rules) on every CPU backend, against the float64 reference: token_logprobs'
eager sampler on the materialised logits of each head feeding the preference loss's naive
composition, the labels outside either kept set masked out (linear_preference_loss/naive.py).
Small sizes: the Triton interpreter runs the sampler's search per element."""

import pytest
import torch
from support import sampler_losses as SL
from support.skips import requires_extension
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.linear_logprobs import naive as ll_ref
from ppo_kernels.linear_preference_loss import api, op

BACKENDS = cpu_backends("linear_preference_loss")
P, T, H, V = 2, 4, 8, 23
R = 2 * P
# two rows per block (the tile and its gradient of 2 rows): a pair (2T rows) is longer than a block
SMALL = 2 * 2 * (V * 4 + H * 4)
ops = torch.ops.ppo_kernels


def _inputs(dtype=torch.float32, seed=0):
    return SL.preference_inputs(P, T, H, V, dtype=dtype, seed=seed)


SETTINGS = SL.preference_settings(R, T)
_ref_kw = SL.preference_ref_kw


def _run(x, **kw):
    h, W, b = [t.clone().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    loss, stats = pk.linear_preference_loss(h, W, x["labels"], x["mask"], bias=b, **kw)
    return loss, stats, torch.autograd.grad(loss, (h, W, b))


def _reference(x, **kw):
    assert isinstance(api.arguments(x["h"], x["W"], x["labels"], **kw)[0], op.SamplerCall)
    return SL.preference_reference(x, **kw)


def _close(ours, ref, what, atol=2e-5, rtol=2e-5):
    """Equal infinities and NaNs, close elsewhere."""
    ours, ref = ours.double(), ref.double().reshape(ours.shape)
    odd = ~torch.isfinite(ref)
    assert torch.equal(~torch.isfinite(ours), odd), what
    torch.testing.assert_close(ours[~odd], ref[~odd], atol=atol, rtol=rtol, msg=what)
    torch.testing.assert_close(ours[odd], ref[odd], equal_nan=True, msg=what)


def _check(x, backend, grads=True, **kw):
    with use_backend(linear_preference_loss=backend), poisoned():
        loss, stats, g = _run(x, **kw)
    rloss, rstats, rrows, rlp, rg = _reference(x, **kw)
    _close(loss, rloss, "loss")
    for name, a, r in zip(("hidden", "weight", "bias"), g, rg):
        assert torch.isfinite(a).all(), name
        if grads:
            torch.testing.assert_close(a.double(), r, atol=2e-5, rtol=1e-4, msg=name)
    for k, v in rstats.items():
        assert not stats[k].requires_grad, k
        if v.dtype == torch.bool:
            assert torch.equal(stats[k], v.reshape(stats[k].shape)), k
        else:
            _close(stats[k], v, k)
    for k in ("logps", "rewards"):
        _close(stats[k], rrows[k], k)
    _close(stats["token_logprobs"], rlp, "token_logprobs")
    return loss, stats, g


# (backend, budget, setting, sampler): one block, and several (a pair longer than a block: a
# first pass); the eager loop one block; the Triton interpreter several blocks, two settings
CASES = [
    (backend, budget, setting, sampler)
    for backend in BACKENDS
    for budget in (None, SMALL)
    for setting in sorted(SETTINGS)
    for sampler in ("vllm", "sglang")
    if (backend == "cpp" or (backend == "eager" and budget is None))
    or (budget is not None and (setting, sampler) in (("per_row", "vllm"), ("all", "sglang")))
]


@pytest.mark.parametrize("backend,budget,setting,sampler", CASES)
def test_matches_the_float64_reference(backend, budget, setting, sampler):
    x = _inputs()
    _, stats, _ = _check(
        x, backend, max_chunk_bytes=budget, sampler=sampler, ref_logps=x["ref"],
        **SETTINGS[setting],
    )  # fmt: skip
    n = int(stats["num_outside"])
    assert n == int(stats["outside"].sum()) and not (stats["outside"] & ~x["mask"]).any()
    if setting not in ("temperature_tensor_only", "topp"):
        assert n > 0  # the argmin labels fall outside
    assert torch.isneginf(stats["token_logprobs"][stats["outside"]]).all()


TYPES = [
    ("sigmoid-head", dict(loss_type="sigmoid"), "head"),
    ("ipo", dict(loss_type="ipo"), "given"),
    ("simpo", dict(loss_type="simpo", simpo_gamma=0.5), None),
    ("rpo-ld", dict(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5), ld_alpha=0.5), "head"),
    ("aot", dict(loss_type="aot"), "given"),
    ("pairs", dict(loss_type="sigmoid", pairs=torch.tensor([[3, 0], [1, 2]])), "head"),
    ("kto", dict(loss_type="kto", reference_point=0.1), "head"),
]
# the Triton interpreter's sampler kernels: test_matches_the_float64_reference (the same loop)
TYPE_CASES = [
    (backend, name, budget)
    for backend in BACKENDS
    for name, _, _ in TYPES
    for budget in (None, SMALL)
    if backend != "triton"
]


@pytest.mark.parametrize("backend,name,budget", TYPE_CASES)
def test_loss_types(backend, name, budget):
    """A reference head (its own kept set), a length-normalised type, the SFT term's batch count
    (a first pass), a sorted type, explicit pairs, kto; one block and several."""
    x = _inputs()
    _, kw, ref = next(t for t in TYPES if t[0] == name)
    kw = dict(kw, **_ref_kw(x, ref))
    if name == "kto":
        kw["desirable"] = x["y"]
    # explicit pairs: the per-row parameters follow their rows through the walk order
    opts = SETTINGS["per_row" if name == "pairs" else "all"]
    _, stats, _ = _check(x, backend, max_chunk_bytes=budget, return_entropy=True, **opts, **kw)
    assert int(stats["num_outside"]) > 0


def test_edge_settings():
    """k = 1 (greedy: every tied maximum under vllm, the lowest id under sglang), k = V, p = 1
    and min_p = 0 (off: the plain loss), min_p = 1, tied logits at the cut, p -> 0."""
    x = _inputs()
    W, bias = x["W"].clone(), x["b"].clone()
    W[5], bias[5] = W[7], bias[7]  # tokens 5 and 7: the same logit everywhere
    x = dict(x, W=W, b=bias)
    z = ll_ref.logits(x["h"], W, bias)
    x["labels"][0, 1] = z[0, 1].argmax()
    for sampler in ("vllm", "sglang"):
        for opts in (
            dict(top_k=1),
            dict(min_p=1.0),
            dict(top_p=1e-6),
            dict(top_k=2, top_p=0.6, ref_hidden=x["rh"], ref_weight=x["rW"]),
        ):
            _, stats, _ = _check(x, "eager", sampler=sampler, **opts)
            if "ref_hidden" not in opts:
                assert not stats["outside"][0, 1]  # the argmax label is kept
    # k = V, p = 1, min_p = 0: the plain loss at the same temperature (one pass, nothing outside)
    plain = _run(x, temperature=0.9, ref_hidden=x["rh"], ref_weight=x["rW"])
    for opts in (dict(top_k=V, temperature=0.9), dict(top_p=1.0, min_p=0.0,
                 temperature=torch.full((R,), 0.9))):  # fmt: skip
        loss, stats, grads = _run(x, ref_hidden=x["rh"], ref_weight=x["rW"], **opts)
        assert int(stats["num_outside"]) == 0
        torch.testing.assert_close(loss, plain[0], atol=2e-6, rtol=2e-6)
        for g, r in zip(grads, plain[2]):
            torch.testing.assert_close(g, r, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_outside_tokens_are_masked(backend):
    """mask_outside: the loss, statistics and gradients of the call whose mask leaves those
    tokens out (the kept sets do not depend on the mask)."""
    x = _inputs()
    kw = dict(SETTINGS["all"], loss_type="ipo", ref_hidden=x["rh"], ref_weight=x["rW"])
    with use_backend(linear_preference_loss=backend):
        loss, stats, grads = _run(x, **kw)
        outside = stats["outside"]
        loss2, stats2, grads2 = _run(dict(x, mask=x["mask"] & ~outside), **kw)
    assert int(stats2["num_outside"]) == 0 < int(stats["num_outside"])
    torch.testing.assert_close(loss, loss2, atol=1e-6, rtol=1e-6)
    for g, r in zip(grads, grads2):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    for k in ("rewards/margins", "logps", "ref_logps"):
        torch.testing.assert_close(stats[k], stats2[k], msg=k)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_mask_outside_off(backend, loss_type):
    """mask_outside=False: the -inf enters the sequence log-probs; the loss is what the formula
    gives (inf: a chosen completion's log-prob is -inf), the gradients stay finite (sigmoid's
    derivative is; a non-finite one, ipo's, gives none)."""
    x = _inputs()
    kw = dict(SETTINGS["topk"], mask_outside=False, loss_type=loss_type, ref_logps=x["ref"])
    loss, stats, _ = _check(x, backend, grads=loss_type == "sigmoid", **kw)
    assert int(stats["num_outside"]) > 0 and torch.isneginf(stats["logps"]).any()
    assert torch.isposinf(loss)


def test_entropy_and_logit_stats():
    """The entropy of the truncated distribution, the mean logit at each row's temperature and
    the argmax flag, as token_logprobs / the materialised logits give them."""
    x = _inputs()
    temps = torch.rand(R, T, generator=torch.Generator().manual_seed(2)) + 0.5
    for budget in (None, SMALL):
        _, stats, _ = _run(x, temperature=temps, top_k=6, return_entropy=True,
                           return_logit_stats=True, max_chunk_bytes=budget)  # fmt: skip
        z = ll_ref.logits(*(x[k].double() for k in ("h", "W", "b")))
        lab = torch.where(x["mask"], x["labels"], -100)
        t = temps.double()
        _, ent = pk.token_logprobs(z, lab, temperature=t, top_k=6, return_entropy=True)
        keep = lab != -100
        torch.testing.assert_close(stats["entropy"].double(), ent * keep, atol=2e-5, rtol=2e-5)
        mean = (z / t.unsqueeze(-1)).mean(-1) * keep
        torch.testing.assert_close(stats["mean_logits"].double(), mean, atol=2e-5, rtol=2e-5)
        assert torch.equal(stats["is_top1"], (z.argmax(-1) == lab) & keep)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    t_, hd, v = 3, 3, 9
    h = torch.randn(2, t_, hd, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(v, hd, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[0, 3, -100], [8, 1, 4]])
    with torch.no_grad():
        z = h @ W.T + bias
        labels[1, 0] = z[1, 0].argmin()  # outside the kept set
    temps = torch.tensor([0.7, 1.3], dtype=torch.float64)

    def f(h, W, bias):
        loss, st = pk.linear_preference_loss(
            h, W, labels, bias=bias, temperature=temps, top_k=5, top_p=0.95, loss_type="ipo",
            ref_logps=torch.tensor([-3.0, -4.0], dtype=torch.float64),
        )  # fmt: skip
        assert int(st["num_outside"]) >= 1
        return loss

    assert torch.autograd.gradcheck(f, (h, W, bias))


def _op_args(x, **kw):
    call, _ = api.arguments(x["h"], x["W"], x["labels"], x["mask"], bias=x["b"], **kw)
    return list(call[: len(op.ARG_NAMES) + len(op.SAMPLER_NAMES)])


@requires_extension
@pytest.mark.parametrize("backend", ["cpp"])
def test_opcheck(backend):
    x = _inputs()
    args = _op_args(x, ref_hidden=x["rh"], ref_weight=x["rW"], **SETTINGS["per_row"])
    i = op.ARG_NAMES.index
    for k in ("hidden", "weight", "bias"):
        args[i(k)] = args[i(k)].clone().requires_grad_()
    with use_backend(linear_preference_loss=backend):
        torch.library.opcheck(torch.ops.ppo_kernels.linear_preference_loss_sampler.default, args)
        d = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(
            torch.ops.ppo_kernels.linear_preference_loss_sampler_grads.default,
            (*d, True, True, True),
        )


@requires_extension
def test_without_options_the_plain_path_runs():
    """No sampler option: the plain op, bit for bit (the sampler's op is not called)."""
    x = _inputs()
    calls = []
    real = api._sampler_op
    api._sampler_op = lambda *a: calls.append(a) or real(*a)
    try:
        loss, stats, grads = _run(x, temperature=0.9, ref_logps=x["ref"])
        args = _op_args(x, temperature=0.9, ref_logps=x["ref"])[: len(op.ARG_NAMES)]
        leaves = [x[k].clone().requires_grad_() for k in ("h", "W", "b")]
        for k, t in zip(("hidden", "weight", "bias"), leaves):
            args[op.ARG_NAMES.index(k)] = t.reshape(-1, H) if k == "hidden" else t
        rloss, _, _, rtok = ops.linear_preference_loss(*args)
        assert torch.equal(loss, rloss) and "num_outside" not in stats
        assert torch.equal(stats["token_logprobs"], rtok[0].view(R, T))
        for g, r in zip(grads, torch.autograd.grad(rloss, leaves)):
            assert torch.equal(g, r)
    finally:
        api._sampler_op = real
    assert not calls


@requires_extension
def test_compile():
    x = _inputs()
    temps = torch.rand(R) + 0.5

    def f(h, W, y, m, r, t):
        return pk.linear_preference_loss(h, W, y, m, ref_logps=r, temperature=t, top_k=4)[0]

    args = (x["h"], x["W"], x["labels"], x["mask"], x["ref"], temps)
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")(*args)
    torch.testing.assert_close(compiled, eager)


BAD = [
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=torch.tensor([1, -2, 3, 1])), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=torch.tensor([0.5, 1.2, 0.9, 1.0])), ValueError, "top_p"),
    (dict(min_p=1.5), ValueError, "min_p"),
    (dict(temperature=torch.ones(5)), ValueError, "temperature"),
    (dict(temperature=torch.ones(R, T + 1)), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=-torch.ones(R, T)), ValueError, "temperature"),
    (dict(top_k=3, sampler="hf"), ValueError, "sampler"),
    (dict(sampler="hf"), ValueError, "sampler"),
    (dict(top_k=3, mask_outside="yes"), TypeError, "mask_outside"),
    (dict(top_k=3, max_chunk_bytes=64), ValueError, "max_chunk_bytes"),
    # (the vocab-parallel form takes the options: it needs torch.distributed first)
    (dict(top_k=3, process_group=object()), RuntimeError, "process_group"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_name_the_argument(case):
    kw, exc, name = BAD[case]
    with use_backend(linear_preference_loss="cpp"), pytest.raises(exc, match=name):
        _run(_inputs(), **kw)


def test_no_rows():
    h = torch.randn(0, T, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    loss, stats = pk.linear_preference_loss(
        h, W, torch.zeros(0, T, dtype=torch.long), top_k=3, temperature=torch.ones(0)
    )
    loss.backward()
    assert float(loss.detach()) == 0 and int(stats["num_outside"]) == 0
    assert stats["outside"].shape == (0, T) and torch.equal(W.grad, torch.zeros(V, H))
