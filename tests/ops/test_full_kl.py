"""full_kl against the float64 definition sum_j p_j (log p_j - log q_j) on every CPU backend."""

import math

import pytest
import torch
from support.skips import requires_extension
from support.utils import cpu_backends, poisoned

from ppo_kernels import full_kl, use_backend
from ppo_kernels.full_kl import naive as R
from ppo_kernels.token_logprobs import naive as TR

BACKENDS = cpu_backends("full_kl")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ref64(logits, ref_logits, temperature=1.0, mask=None):
    """The definition in float64 on the (dtype-rounded) inputs, with autograd for the gradient."""
    z = logits.detach().double().requires_grad_()
    w = ref_logits.detach().double().requires_grad_()
    logp = torch.log_softmax(z / temperature, -1)
    logq = torch.log_softmax(w / temperature, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    if mask is not None:
        kl = kl * mask
    return kl, z, w


def _pair(shape, dtype, scale=3.0, close=False):
    z = torch.randn(shape) * scale
    w = z + 0.3 * torch.randn(shape) if close else torch.randn(shape) * scale
    return z.to(dtype), w.to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 7, 33, 2500, 4099])
def test_forward_backward_matches_float64(backend, dtype, V):
    N = 5 if V > 1000 else 9
    z, w = _pair((N, V), dtype, close=V % 2 == 1)
    z.requires_grad_()
    w.requires_grad_()
    with use_backend(full_kl=backend), poisoned():
        kl = full_kl(z, w, temperature=0.7)
        g = torch.randn(N)
        gz, gw = torch.autograd.grad(kl, (z, w), g)
    want, z64, w64 = _ref64(z, w, 0.7)
    rz, rw = torch.autograd.grad(want, (z64, w64), g.double())
    assert kl.dtype == torch.float32 and kl.shape == (N,)
    assert gz.dtype == dtype and gw.dtype == dtype
    # float32 accumulation over V: |error| ~ eps * (log V + max |z - w| / T)
    torch.testing.assert_close(kl.double(), want.detach(), atol=2e-5, rtol=1e-5)
    gtol = dict(atol=2e-6, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(gz.double(), rz, **gtol)
    torch.testing.assert_close(gw.double(), rw, **gtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_and_shifted_distributions_are_exactly_zero(backend):
    z = torch.randn(4, 3000) * 4
    with use_backend(full_kl=backend):
        same = full_kl(z, z.clone())
        shifted = full_kl(
            z, z - 1000.0
        )  # same softmax; a naive lse_z - lse_w would cancel to ~1e-4
    assert same.abs().max() == 0
    assert shifted.abs().max() < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_kl_relative_accuracy(backend):
    z = torch.randn(6, 5000) * 2
    w = z + 1e-3 * torch.randn(6, 5000)
    with use_backend(full_kl=backend):
        kl = full_kl(z, w)
    want = _ref64(z, w)[0].detach()
    assert want.min() > 0
    torch.testing.assert_close(kl.double(), want, atol=1e-8, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_and_strided_rows(backend):
    B, T, V = 3, 5, 300
    big = torch.randn(B, T + 1, V)
    ref_big = torch.randn(B, T + 1, V + 8)
    z = big[:, :-1]  # strided rows, no copy
    w = ref_big[:, 1:, 4 : V + 4]  # different strides and offset
    mask = torch.rand(B, T) > 0.4
    mask[0] = False
    zz = z.clone().requires_grad_()
    with use_backend(full_kl=backend), poisoned():
        kl = full_kl(z, w, mask=mask)
        klm = full_kl(zz, w, mask=mask.int())
        (gz,) = torch.autograd.grad(klm.sum(), zz)
    want, z64, _ = _ref64(z, w, mask=mask.double())
    (rz,) = torch.autograd.grad(want.sum(), z64)
    torch.testing.assert_close(kl.double(), want.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(klm, kl)
    assert kl[0].eq(0).all() and gz[0].eq(0).all()
    torch.testing.assert_close(gz.double(), rz, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_cases(backend):
    V = 40
    z = torch.randn(6, V)
    w = torch.randn(6, V)
    z[0, :5] = -math.inf  # p_j = 0: contributes 0
    w[0, 5:10] = -math.inf
    z[0, 5:10] = -math.inf  # p = q = 0 there: 0
    w[1, 3] = -math.inf  # q_j = 0 with p_j > 0: +inf
    z[2] = -math.inf  # undefined p: NaN
    w[3] = -math.inf  # undefined q: NaN
    z[4, 7] = math.nan  # NaN
    z[5, 2] = math.inf  # +inf
    with use_backend(full_kl=backend), poisoned():
        kl = full_kl(z, w)
    want = R.forward(z.double(), w.double())[0]
    torch.testing.assert_close(kl[0].double(), want[0])
    assert kl[1] == math.inf
    assert kl[2:].isnan().all()
    # large logits (|z| ~ 1e4) stay finite
    with use_backend(full_kl=backend):
        big = full_kl(z[:1].nan_to_num(0, 0, 0) * 1e4, torch.zeros(1, V))
    assert torch.isfinite(big).all()


def test_float64_gradcheck():
    z = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: full_kl(a, b, temperature=1.3), (z, w))
    mask = torch.tensor([True, False, True])
    torch.autograd.gradcheck(lambda a, b: full_kl(a, b, mask=mask), (z, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    z, w = torch.randn(2, 3, 17, requires_grad=True), torch.randn(2, 3, 17, requires_grad=True)
    with use_backend(full_kl=backend):
        torch.library.opcheck(torch.ops.ppo_kernels.full_kl.default, (z, w, 0.9, None))
        torch.library.opcheck(
            torch.ops.ppo_kernels.full_kl.default,
            (z, w, 1.0, torch.tensor([[True, False, True], [False, True, True]])),
        )
        kl, lz, lw = torch.ops.ppo_kernels.full_kl(z.detach(), w.detach(), 0.9, None)
        for need_ref in (True, False):
            torch.library.opcheck(
                torch.ops.ppo_kernels.full_kl_backward.default,
                (torch.randn_like(kl), z.detach(), w.detach(), None, kl, lz, lw, 0.9, need_ref),
            )


def test_only_logits_gradient_when_ref_is_frozen():
    z = torch.randn(3, 50, requires_grad=True)
    w = torch.randn(3, 50)
    kl = full_kl(z, w)
    (gz,) = torch.autograd.grad(kl.sum(), z)
    assert w.grad is None and gz.shape == z.shape


def test_compile_fullgraph():
    torch._dynamo.reset()
    z = torch.randn(4, 6, 64, requires_grad=True)
    w = torch.randn(4, 6, 64)
    f = torch.compile(
        lambda a, b, t: full_kl(a[:, :-1], b[:, :-1], temperature=t).mean(), fullgraph=True
    )
    out = f(z, w, 0.8)
    (g,) = torch.autograd.grad(out, z)
    want, z64, _ = _ref64(z[:, :-1], w[:, :-1], 0.8)
    torch.testing.assert_close(out.double(), want.mean().detach(), atol=1e-5, rtol=1e-5)
    (rz,) = torch.autograd.grad(want.mean(), z64)
    torch.testing.assert_close(g[:, :-1].double(), rz, atol=1e-6, rtol=1e-4)


def test_argument_errors():
    z = torch.randn(2, 5)
    with pytest.raises(ValueError, match="ref_logits"):
        full_kl(z, torch.randn(2, 6))
    with pytest.raises(TypeError, match="ref_logits"):
        full_kl(z, z.half())
    with pytest.raises(ValueError, match="temperature"):
        full_kl(z, z, temperature=0.0)
    with pytest.raises(ValueError, match="mask"):
        full_kl(z, z, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="contiguous"):
        full_kl(torch.randn(5, 2).t(), z)
    with pytest.raises(ValueError, match="empty"):
        full_kl(torch.randn(2, 0), torch.randn(2, 0))


# ---- under the sampler's distribution (top_k / top_p / min_p): ppo_kernels::full_kl_sampler ----


def _sampler_ref64(x, y, temps, top_k=0, top_p=1.0, min_p=0.0, sampler="vllm", mask=None):
    """The documented semantics in float64 on the (dtype-rounded) inputs, with autograd: K the
    kept set of the policy's tempered logits (token_logprobs' sampler reference), q = softmax(z)
    renormalised on K, r = softmax(w) over the whole vocabulary, KL = sum_{j in K} q_j (log q_j -
    log r_j). Per-row parameters broadcast over logits.shape[:-1]."""
    V = x.shape[-1]
    rows = x.shape[:-1]

    def per_row(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return t.reshape(tuple(t.shape) + (1,) * (len(rows) - t.dim())).expand(rows).reshape(-1)

    x64 = x.detach().double().reshape(-1, V)
    inv_t = 1.0 / per_row(temps, torch.float64)
    kept = TR.sampler_kept(
        x64, inv_t, per_row(top_k, torch.int64), per_row(top_p, torch.float64),
        per_row(min_p, torch.float64), sampler,
    )[0]  # fmt: skip
    z = x.detach().double().requires_grad_()
    w = y.detach().double().requires_grad_()
    zt = z.reshape(-1, V) * inv_t.unsqueeze(-1)
    logq = torch.log_softmax(torch.where(kept, zt, -math.inf), -1)
    logq = torch.where(kept, logq, 0.0)  # (no 0 * inf in the gradient of the dropped terms)
    logr = torch.log_softmax(w.reshape(-1, V) * inv_t.unsqueeze(-1), -1)
    kl = torch.where(kept, logq.exp() * (logq - logr), 0.0).sum(-1).reshape(rows)
    if mask is not None:
        kl = kl * mask
    return kl, z, w, kept


def _check_sampler_kl(backend, x, y, g, kw, mask=None, tol=None):
    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    with use_backend(full_kl=backend), poisoned():
        kl = full_kl(xg, yg, mask=mask, **kw)
        gz, gw = torch.autograd.grad(kl, (xg, yg), g)
    ref_kw = {k: v for k, v in kw.items() if k != "temperature"}
    want, z64, w64, kept = _sampler_ref64(x, y, kw.get("temperature", 1.0), mask=mask, **ref_kw)
    rz, rw = torch.autograd.grad(want, (z64, w64), g.double())
    assert kl.dtype == torch.float32 and gz.dtype == x.dtype
    torch.testing.assert_close(kl.double(), want.detach(), atol=5e-5, rtol=2e-5)
    gtol = tol or (
        dict(atol=2e-6, rtol=1e-4) if x.dtype == torch.float32 else dict(atol=1e-5, rtol=2**-7)
    )
    torch.testing.assert_close(gz.double(), rz, **gtol)
    torch.testing.assert_close(gw.double(), rw, **gtol)
    return kl, gz, kept


SAMPLER_KL_CASES = {
    # per-sequence temperatures, top-k (vLLM)
    "seq-topk": lambda B, T: dict(temperature=torch.rand(B) + 0.5, top_k=7),
    # per-token temperatures, per-row top-p, min-p (SGLang)
    "tok-topp-minp-sglang": lambda B, T: dict(
        temperature=torch.rand(B, T) + 0.5,
        top_p=torch.tensor([0.7, 0.95]),
        min_p=0.01,
        sampler="sglang",
    ),
    # every option, per-row top-k (vLLM)
    "all-vllm": lambda B, T: dict(
        temperature=0.8, top_k=torch.tensor([[5, 0, 40], [3, 300, 9]]), top_p=0.9, min_p=0.02
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(SAMPLER_KL_CASES))
def test_sampler_kl_matches_float64(backend, case):
    B, T, V = 2, 3, 300
    x, y = _pair((B, T, V), torch.float32)
    kw = SAMPLER_KL_CASES[case](B, T)
    # (the Triton interpreter fails on full_kl's masked backward: tests without a mask there)
    mask = torch.tensor([[True, False, True], [True, True, True]]) if backend != "triton" else None
    kl, gz, kept = _check_sampler_kl(backend, x, y, torch.randn(B, T), kw, mask)
    kept = kept.reshape(B, T, V)
    assert not kept.all(), "the truncation must bite"
    assert (gz[~kept] == 0).all()  # no gradient outside the kept set
    if mask is not None:
        assert (kl[~mask] == 0).all() and (gz[~mask] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_kl_bf16(backend):
    x, y = _pair((4, 200), torch.bfloat16)
    _check_sampler_kl(backend, x, y, torch.randn(4), dict(temperature=0.9, top_k=20, top_p=0.9))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_kl_limits(backend):
    """k = 1 and min_p = 1: q is the argmax alone, KL = -log r_argmax; k = V, p = 1: full_kl."""
    N, V = 4, 50
    x, y = _pair((N, V), torch.float32)
    t = torch.rand(N) + 0.5
    top = x.argmax(-1)
    want = -torch.log_softmax(y.double() / t.double().unsqueeze(-1), -1).gather(-1, top[:, None])
    with use_backend(full_kl=backend):
        plain = full_kl(x, y, temperature=t)
        for kw in (dict(top_k=1), dict(min_p=1.0), dict(top_k=1, sampler="sglang")):
            kl = full_kl(x, y, temperature=t, **kw)
            torch.testing.assert_close(kl.double(), want.squeeze(-1), atol=2e-6, rtol=1e-6)
        for kw in (dict(top_k=V), dict(top_p=1.0), dict(min_p=0.0), dict(top_k=0, top_p=1.0)):
            kl = full_kl(x, y, temperature=t, **kw)  # every option off: the same kernels, bits
            torch.testing.assert_close(kl, plain, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_sampler_kl_ties(backend, sampler):
    """Integer logits: tie groups across the top-k and top-p boundaries (vLLM keeps a group
    whole, SGLang by token id), the same kept set as the reference, exact."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 5, (6, 40), generator=g).float()
    y = torch.randn(6, 40, generator=g)
    kw = dict(top_k=torch.tensor([3, 3, 8, 8, 1, 2]), top_p=torch.tensor([1, 0.5, 1, 0.6, 1, 1.0]))
    _, gz, kept = _check_sampler_kl(backend, x, y, torch.randn(6), dict(kw, sampler=sampler))
    sizes = kept.sum(-1)
    if sampler == "sglang":
        assert (sizes[[0, 2, 4, 5]] == torch.tensor([3, 8, 1, 2])).all()
    else:  # every tie of the k-th value kept
        assert (sizes[[0, 2]] > torch.tensor([3, 8])).any()


def test_sampler_kl_gradcheck_float64():
    x = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.7, 1.2], dtype=torch.float64)
    torch.autograd.gradcheck(
        lambda a, b: full_kl(a, b, temperature=t, top_k=4, top_p=0.9, min_p=0.05), (x, y)
    )


@requires_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_kl_opcheck(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    ops = torch.ops.ppo_kernels
    x, y = torch.randn(2, 3, 17, requires_grad=True), torch.randn(2, 3, 17, requires_grad=True)
    t, ks = torch.rand(2) + 0.5, torch.tensor([3, 0])
    args = (x, y, 1.0, t, 0, ks, 0.9, None, 0.0, None, "vllm")
    with use_backend(full_kl=backend):
        torch.library.opcheck(torch.ops.ppo_kernels.full_kl_sampler.default, (*args, None), **only)
        if backend != "triton":  # (its interpreter: no masked backward, above)
            mask = torch.tensor([[True, False, True], [False, True, True]])
            torch.library.opcheck(torch.ops.ppo_kernels.full_kl_sampler.default, (*args, mask))
        kl, lz, lw, cut, ci = ops.full_kl_sampler(x.detach(), y.detach(), *args[2:], None)
        assert (cut > -math.inf).all()
        for need_ref in (True, False):
            torch.library.opcheck(
                torch.ops.ppo_kernels.full_kl_sampler_backward.default,
                (torch.randn_like(kl), x.detach(), y.detach(), None, kl, lz, lw, cut, ci, 1.0, t,
                 need_ref),
                **only,
            )  # fmt: skip


@pytest.mark.parametrize(
    "kw,exc,arg",
    [
        (dict(top_k=torch.ones(3, dtype=torch.long)), ValueError, "top_k"),
        (dict(top_k=torch.ones(2)), TypeError, "top_k"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=torch.tensor([0.5, 0.0])), ValueError, "top_p"),
        (dict(min_p=torch.tensor([0.5, -0.1])), ValueError, "min_p"),
        (dict(top_k=2, sampler="hf"), ValueError, "sampler"),
        (dict(sampler="hf"), ValueError, "sampler"),
        (dict(top_k=2, temperature=torch.tensor([1.0, 0.0])), ValueError, "temperature"),
        # (the vocab-parallel form takes the options: it needs torch.distributed first)
        (dict(top_k=2, process_group=object()), RuntimeError, "process_group"),
    ],
)
def test_sampler_kl_bad_arguments(kw, exc, arg):
    x, y = torch.randn(2, 10), torch.randn(2, 10)
    with pytest.raises(exc, match=arg):
        full_kl(x, y, **kw)
