"""token_logprobs on every backend available for CPU tensors here (cpp, Triton through the
interpreter, eager) against the float64 reference, through the registered op and its autograd."""

import pytest
import torch
from support.skips import need, requires_backend, requires_extension
from support.utils import GRAD_TOL, TOL, cpu_backends, peak_extra_bytes, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.token_logprobs import naive as ref

BACKENDS = cpu_backends("token_logprobs")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(
    shape, V, dtype, scale=3.0, ignore_frac=0.2, ignore_index=-100, label_dtype=torch.int64
):
    logits = (torch.randn(*shape, V) * scale).to(dtype)
    labels = torch.randint(0, V, shape, dtype=label_dtype)
    drop = torch.rand(shape) < ignore_frac
    labels[drop] = ignore_index
    return logits, labels


def _ref(logits, labels, T, ignore_index=-100):
    lp, ent, _ = ref.forward(logits.double(), labels, T, ignore_index)
    return lp, ent


def _close(got, want, tol):
    torch.testing.assert_close(got.double(), want.double(), **tol, equal_nan=True)


# (shape of leading dims, V): V in {1, 7, 4099, 32000, 152064}, small N for the large ones.
CASES = [((3, 5), 1), ((4, 9), 7), ((2, 33), 4099), ((2, 3), 32000), ((1, 3), 152064)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,V", CASES)
def test_forward_backward_matches_float64(backend, dtype, shape, V):
    T = 0.7
    logits, labels = _inputs(shape, V, dtype)
    want_lp, want_ent = _ref(logits, labels, T)
    x = logits.clone().requires_grad_(True)
    with use_backend(backend), poisoned():
        lp, ent = pk.token_logprobs(x, labels, temperature=T, return_entropy=True)
        assert lp.dtype == torch.float32 and lp.shape == labels.shape
        _close(lp, want_lp, TOL[dtype])
        _close(ent, want_ent, TOL[dtype])
        g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
        (lp * g_lp + ent * g_ent).sum().backward()
    x64 = logits.double().requires_grad_(True)
    lp64, ent64, _ = ref.forward(x64, labels, T)
    (lp64 * g_lp.double() + ent64 * g_ent.double()).sum().backward()
    assert x.grad.dtype == dtype
    _close(x.grad, x64.grad, GRAD_TOL[dtype])
    ignored = labels == -100
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert (x.grad[ignored] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [0.3, 1.0, 2.5])
def test_temperature_and_logprob_only_gradient(backend, T):
    logits, labels = _inputs((6,), 301, torch.float32)
    x = logits.clone().requires_grad_(True)
    with use_backend(backend), poisoned():
        lp = pk.token_logprobs(x, labels, temperature=T)
        lp.sum().backward()
    x64 = logits.double().requires_grad_(True)
    lp64 = ref.forward(x64, labels, T, with_entropy=False)[0]
    lp64.sum().backward()
    _close(lp, lp64, TOL[torch.float32])
    _close(x.grad, x64.grad, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_only_gradient_and_custom_ignore_index(backend):
    logits, labels = _inputs((3, 4), 97, torch.float32, ignore_index=5)
    x = logits.clone().requires_grad_(True)
    with use_backend(backend):
        _, ent = pk.token_logprobs(x, labels, ignore_index=5, return_entropy=True)
        ent.sum().backward()
    x64 = logits.double().requires_grad_(True)
    ref.forward(x64, labels, 1.0, ignore_index=5)[1].sum().backward()
    _close(x.grad, x64.grad, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_logits_are_read_without_copy(backend, dtype):
    # logits[:, :-1] of a contiguous [B, T+1, V] tensor: leading dims do not flatten to one stride.
    full = (torch.randn(3, 8, 211) * 2).to(dtype)
    labels = torch.randint(0, 211, (3, 7), dtype=torch.int32)
    logits = full[:, :-1]
    assert not logits.is_contiguous()
    x = logits.detach().requires_grad_(True)
    with use_backend(backend), poisoned():
        lp, ent = pk.token_logprobs(x, labels, return_entropy=True)
        lp.sum().backward()
    want_lp, want_ent = _ref(logits, labels, 1.0)
    _close(lp, want_lp, TOL[dtype])
    _close(ent, want_ent, TOL[dtype])
    x64 = logits.double().requires_grad_(True)
    ref.forward(x64, labels, 1.0, with_entropy=False)[0].sum().backward()
    _close(x.grad, x64.grad, GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_writes_gradient_into_logits(backend):
    logits, labels = _inputs((4, 5), 129, torch.bfloat16)
    leaf = logits.clone().requires_grad_(True)
    x = leaf * 1  # a non-leaf buffer the op may overwrite
    with use_backend(backend):
        lp, ent = pk.token_logprobs(x, labels, return_entropy=True, inplace_backward=True)
        g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
        (lp * g_lp + ent * g_ent).sum().backward()
    x64 = logits.double().requires_grad_(True)
    lp64, ent64, _ = ref.forward(x64, labels, 1.0)
    (lp64 * g_lp.double() + ent64 * g_ent.double()).sum().backward()
    _close(leaf.grad, x64.grad, GRAD_TOL[torch.bfloat16])
    _close(x.detach(), x64.grad, GRAD_TOL[torch.bfloat16])  # the buffer now holds the gradient


def test_gradcheck_float64():
    logits = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 4))
    labels[0, 1] = -100

    def f(x):
        lp, ent = pk.token_logprobs(x, labels, temperature=0.8, return_entropy=True)
        return lp, ent

    assert torch.autograd.gradcheck(f, (logits,))
    assert torch.autograd.gradgradcheck is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    logits, labels = _inputs((2, 3), 37, torch.float32)
    with use_backend(backend):
        for ent, inplace in [(True, False), (False, False)]:
            torch.library.opcheck(
                torch.ops.ppo_kernels.token_logprobs.default,
                (logits.clone().requires_grad_(True), labels, 0.9, -100, ent, inplace),
            )
        lp, e, lse = torch.ops.ppo_kernels.token_logprobs(logits, labels, 0.9, -100, True, False)
        g = torch.randn_like(lp)
        torch.library.opcheck(
            torch.ops.ppo_kernels.token_logprobs_backward.default,
            (g, g, logits, labels, lse, e, 0.9, -100),
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.token_logprobs_backward_.default,
            (g, g, logits.clone(), labels, lse, e, 0.9, -100),
        )


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    logits, labels = _inputs((2, 6), 50, torch.float32)

    def f(x, y):
        lp, ent = pk.token_logprobs(x[:, :-1], y[:, 1:], temperature=0.9, return_entropy=True)
        return (lp * 2 + ent).sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    out1, out2 = f(x1, labels), cf(x2, labels)
    out1.backward()
    out2.backward()
    torch.testing.assert_close(out1, out2)
    torch.testing.assert_close(x1.grad, x2.grad)


def test_torch_compile_inductor_fullgraph():
    torch._dynamo.reset()
    logits, labels = _inputs((3,), 40, torch.float32)
    cf = torch.compile(lambda x, y: pk.token_logprobs(x, y).exp().sum(), fullgraph=True)
    torch.testing.assert_close(cf(logits, labels), pk.token_logprobs(logits, labels).exp().sum())


# --- edge cases and bad input -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_documented_edge_rows(backend):
    V = 64
    logits = torch.randn(5, V)
    labels = torch.tensor([3, 3, 3, 10, 7])
    logits[0] = -float("inf")  # all -inf: undefined distribution -> NaN
    logits[1, 5] = float("nan")  # contains NaN -> NaN
    logits[2, :32] = -float("inf")  # some -inf; label 3 sits on one -> logprob -inf
    logits[3, :32] = -float("inf")  # label 10 on a -inf, entropy finite
    logits[3, 10] = 0.5  # ...except the label's own entry
    logits[4, 1] = float("inf")  # +inf -> NaN
    x = logits.clone().requires_grad_(True)
    with use_backend(backend), poisoned():
        lp, ent = pk.token_logprobs(x, labels, return_entropy=True)
        lp.sum().backward()
    want_lp, want_ent = _ref(logits, labels, 1.0)
    assert torch.isnan(lp[0]) and torch.isnan(ent[0])
    assert torch.isnan(lp[1]) and torch.isnan(ent[1])
    assert lp[2] == -float("inf") and torch.isfinite(ent[2])
    assert torch.isnan(lp[4]) and torch.isnan(ent[4])
    _close(lp[2:4], want_lp[2:4], TOL[torch.float32])
    _close(ent[2:4], want_ent[2:4], TOL[torch.float32])
    assert torch.isfinite(x.grad[3]).all()
    assert (x.grad[3, :32].masked_fill(torch.arange(32) == 10, 0) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_label_out_of_range_raises_on_cpu(backend):
    logits = torch.randn(4, 10)
    for bad in (10, -1, 1000):
        labels = torch.tensor([1, 2, bad, 3])
        with (
            use_backend(backend),
            pytest.raises(IndexError, match="labels.*outside the vocabulary"),
        ):
            pk.token_logprobs(logits, labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    with use_backend(backend):
        for shape in [(0, 5), (2, 0, 5)]:
            x = torch.randn(*shape, requires_grad=True)
            lp, ent = pk.token_logprobs(
                x, torch.zeros(shape[:-1], dtype=torch.long), return_entropy=True
            )
            assert lp.shape == shape[:-1] and ent.shape == shape[:-1]
            lp.sum().backward()
            assert x.grad.shape == x.shape


def test_bad_arguments_name_the_argument():
    x = torch.randn(4, 10)
    y = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="labels: expected shape"):
        pk.token_logprobs(x, y[:3])
    with pytest.raises(TypeError, match="labels: dtype float32"):
        pk.token_logprobs(x, y.float())
    with pytest.raises(TypeError, match="logits: dtype int64"):
        pk.token_logprobs(y.view(2, 2), y[:2])
    with pytest.raises(ValueError, match="temperature"):
        pk.token_logprobs(x, y, temperature=0.0)
    with pytest.raises(ValueError, match="logits: the last .* contiguous"):
        pk.token_logprobs(x.t(), torch.randint(0, 4, (10,)))
    with pytest.raises(
        ValueError, match=r"labels: expected a tensor on cpu \(like logits\), got meta"
    ):
        pk.token_logprobs(x, y.to("meta"))
    with pytest.raises(ValueError, match="vocabulary dimension"):
        pk.token_logprobs(torch.randn(3, 0), torch.zeros(3, dtype=torch.long))


@requires_extension
def test_strict_checks_reach_the_cpp_ops():
    """The registered ops check GPU label ranges under strict_checks(): they read the setting in
    C++ (csrc/ops/route.h), which must follow the Python context, nested ones included."""
    C = torch.ops.ppo_kernels_C

    def cpp_strict():
        old = C.set_strict(True)
        C.set_strict(old)
        return old

    assert cpp_strict() is False
    with pk.strict_checks():
        assert cpp_strict() is True
        with pk.strict_checks(False):
            assert cpp_strict() is False
        assert cpp_strict() is True
    assert cpp_strict() is False


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend"):
        with use_backend("fast"):
            pass
    with pytest.raises(ValueError, match="unknown op"):
        with use_backend(not_an_op="eager"):
            pass


def test_env_backend_override(monkeypatch):
    from ppo_kernels import _backend

    monkeypatch.setenv("PPO_KERNELS_BACKEND", "cpp,token_logprobs=eager")
    assert _backend.resolve("token_logprobs", "cpu") == "eager"
    with use_backend(token_logprobs="cpp" if "cpp" in BACKENDS else "eager"):
        assert _backend.resolve("token_logprobs", "cpu") == (
            "cpp" if "cpp" in BACKENDS else "eager"
        )


@pytest.mark.slow
@requires_backend("token_logprobs", "cpp")
def test_more_than_2_pow_31_elements():
    # bf16 [16400, 131072] = 2.15e9 elements: rows past element 2^31 need 64-bit offsets.
    N, V = 16400, 131072
    logits = torch.zeros(N, V, dtype=torch.bfloat16)
    tail = torch.randn(3, V).to(torch.bfloat16)
    logits[-3:] = tail
    labels = torch.zeros(N, dtype=torch.long)
    labels[-3:] = torch.tensor([5, V - 1, 77])
    with use_backend("cpp"):
        lp, ent = pk.token_logprobs(logits, labels, return_entropy=True)
    want_lp, want_ent = _ref(tail, labels[-3:], 1.0)
    _close(lp[-3:], want_lp, TOL[torch.bfloat16])
    _close(ent[-3:], want_ent, TOL[torch.bfloat16])
    import math

    assert torch.allclose(lp[:-3], torch.full((N - 3,), -math.log(V)))


def test_temperature_is_a_runtime_argument_of_the_triton_kernels():
    need("triton")
    import inspect

    from ppo_kernels.token_logprobs import triton_kernels as tk

    for kernel in (tk._fwd_kernel, tk._bwd_kernel):
        params = inspect.signature(getattr(kernel, "fn", kernel)).parameters

        def is_constexpr(name):
            return "constexpr" in str(params[name].annotation)

        assert not is_constexpr("inv_t") and not is_constexpr("ignore_index")
        assert is_constexpr("BLOCK")  # the check can tell them apart


@requires_backend("token_logprobs", "cpp")
def test_no_n_by_v_temporary():
    N, V = 2048, 32000
    logits = torch.randn(N, V)
    labels = torch.randint(0, V, (N,))
    nv_bytes = N * V * 4
    with use_backend("cpp"):
        with torch.no_grad():
            pk.token_logprobs(logits[:4], labels[:4])  # first-call initialisation is not the op's
            fwd = peak_extra_bytes(lambda: pk.token_logprobs(logits, labels, return_entropy=True))
        x = logits.clone().requires_grad_(True)
        y = x * 1

        def fwd_bwd_inplace():
            lp, ent = pk.token_logprobs(y, labels, return_entropy=True, inplace_backward=True)
            torch.autograd.grad((lp + ent).sum(), y)

        bwd = peak_extra_bytes(fwd_bwd_inplace)

        def fwd_bwd():
            lp = pk.token_logprobs(x, labels)
            torch.autograd.grad(lp.sum(), x)

        bwd_alloc = peak_extra_bytes(fwd_bwd)
    o_n = 64 * N + (1 << 20)  # a few float32 per row (outputs, lse, upstream grads) + slack
    assert fwd < o_n, fwd
    assert bwd < o_n, bwd  # the gradient went into the logits buffer
    assert nv_bytes <= bwd_alloc < nv_bytes + o_n, bwd_alloc  # exactly one gradient buffer
