"""masked_mean / masked_whiten on every CPU backend against the float64 reference (written here
from the documented formulas), forward and backward, with poisoned outputs; the float64 eager
backward by gradcheck; opcheck of the four registered ops. (test_gae.py and
properties/test_masked_stats.py cover the public semantics and magnitudes from 1e-30 to 3e38.)"""

import pytest
import torch
from support.skips import need_backend
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import _backend

ops = torch.ops.ppo_kernels
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _mask(kind, shape, g):
    sel = torch.rand(shape, generator=g) > 0.3
    if kind == "bool":
        return sel
    if kind == "int":
        return sel.long()
    return torch.rand(shape, generator=g) * sel  # weights


def _stats64(x, mask, dim=None):
    xd = x.double()
    m = mask != 0
    w = torch.where(m, mask.double() if mask.is_floating_point() else m.double(), 0.0)
    xm = torch.where(m, xd, 0.0)
    if dim is None:
        return (w * xm).sum(), w.sum()
    return (w * xm).sum(dim), w.sum(dim)


def _mean64(x, mask, dim=None, empty="zero"):
    s, n = _stats64(x, mask, dim)
    if empty == "nan":
        return s / n
    return torch.where(n != 0, s / torch.where(n != 0, n, 1.0), 0.0)


def _whiten64(x, mask, shift_mean=True, unbiased=True, eps=1e-8):
    xd = x.double()
    m = mask != 0
    w = torch.where(m, mask.double() if mask.is_floating_point() else m.double(), 0.0)
    n = w.sum()
    mean = (w * torch.where(m, xd, 0.0)).sum() / n
    d = torch.where(m, xd - mean, 0.0)
    var = (w * d * d).sum() / n * (n / (n - 1) if unbiased else 1.0)
    out = (xd - mean) / torch.sqrt(var + eps)
    return out if shift_mean else out + mean


@pytest.mark.parametrize("backend", cpu_backends("masked_whiten"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["bool", "int", "float"])
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_whiten_forward_and_backward(backend, dtype, mask_kind, shift_mean, unbiased):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 37, generator=g) * 3 + 2).to(dtype)
    mask = _mask(mask_kind, x.shape, g)
    x_nan = torch.where(mask != 0, x, torch.tensor(float("nan"), dtype=dtype))
    gout = torch.randn(5, 37, generator=g)
    xd = x.double().requires_grad_()
    want = _whiten64(xd, mask, shift_mean, unbiased)
    (want * gout.double()).sum().backward()
    xg = x.clone().requires_grad_()
    with _backend.use_backend(masked_whiten=backend), poisoned():
        got = pk.masked_whiten(xg, mask, shift_mean=shift_mean, unbiased=unbiased)
        got_nan = pk.masked_whiten(x_nan, mask, shift_mean=shift_mean, unbiased=unbiased)
        (got * gout).sum().backward()
    assert got.dtype == torch.float32
    tol = dict(atol=2e-5 * (1 if shift_mean else 3), rtol=2e-5)
    torch.testing.assert_close(got.double(), want.detach(), **tol)
    m = mask != 0  # masked-out NaNs never reach the statistics
    torch.testing.assert_close(got_nan[m].double(), want.detach()[m], **tol)
    gtol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert xg.grad.dtype == dtype
    torch.testing.assert_close(xg.grad.double(), xd.grad, **gtol)


@pytest.mark.parametrize("backend", cpu_backends("masked_mean"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["bool", "int", "float"])
@pytest.mark.parametrize("dim", [None, -1, 0, (0, 2), (1,), ()])
@pytest.mark.parametrize("empty", ["zero", "nan"])
def test_masked_mean_forward_and_backward(backend, dtype, mask_kind, dim, empty):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, 5, generator=g).to(dtype)
    mask = _mask(mask_kind, x.shape, g)
    mask[1, :, 2] = 0  # an empty row along the last dim, and a column along dim 1
    mask[:, 2, :] = 0
    x_nan = torch.where(mask != 0, x, torch.tensor(float("nan"), dtype=dtype))
    red = None if dim in (None, ()) else dim
    want = _mean64(x, mask, red, empty)
    gout = torch.randn(want.shape, generator=g)
    # d mean / d x = w / n on the selection; 0 in an empty set (documented: peers give NaN there)
    _, n = _stats64(x, mask, red)
    coef = torch.where(n != 0, gout.double() / torch.where(n != 0, n, 1.0), 0.0)
    dims = () if red is None else (red if isinstance(red, tuple) else (red,))
    for d in sorted(d % 3 for d in dims):
        coef = coef.unsqueeze(d)
    w = mask.double() if mask.is_floating_point() else (mask != 0).double()
    grad_want = torch.where(mask != 0, coef * w, 0.0)
    xg = x.clone().requires_grad_()
    with _backend.use_backend(masked_mean=backend), poisoned():
        got = pk.masked_mean(xg, mask, dim, empty=empty)
        got_nan = pk.masked_mean(x_nan, mask, dim, empty=empty)
        (torch.nan_to_num(got * gout, nan=0.0)).sum().backward()
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(got_nan.double(), want, atol=1e-6, rtol=1e-5, equal_nan=True)
    assert xg.grad.dtype == dtype
    torch.testing.assert_close(xg.grad.double(), grad_want, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("backend", cpu_backends("masked_mean"))
def test_masked_mean_non_contiguous_and_0_dim(backend):
    x = torch.randn(6, 8).t()[1:]  # [7, 6], strided
    mask = (torch.rand(6, 8) > 0.4).t()[1:]
    with _backend.use_backend(masked_mean=backend):
        got = pk.masked_mean(x, mask, 0)
        scalar = pk.masked_mean(torch.tensor(2.5), torch.tensor(True), 0)
    torch.testing.assert_close(got.double(), _mean64(x, mask, 0), atol=1e-6, rtol=1e-5)
    assert scalar.shape == () and scalar.item() == 2.5


def test_masked_whiten_cpp_is_thread_count_independent_and_large():
    """Whole-tensor sums in fixed chunks, added in order: any thread count, one answer."""
    need_backend("masked_whiten", "cpp")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 70001, generator=g) * 1e3 + 5e3
    mask = torch.rand(x.shape, generator=g) > 0.5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pk.masked_whiten(x, mask)
        torch.set_num_threads(2)
        two = pk.masked_whiten(x, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), _whiten64(x, mask), atol=1e-5, rtol=1e-5)


def test_float64_backward_gradcheck():
    """float64 runs the eager implementations: their backward ops against finite differences."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, 7, generator=g, dtype=torch.float64) * (torch.rand(3, 7, generator=g) > 0.3)
    for mask in (w, w != 0):
        for shift in (True, False):
            for unbiased in (True, False):
                torch.autograd.gradcheck(
                    lambda t: pk.masked_whiten(t, mask, shift_mean=shift, unbiased=unbiased), (x,)
                )
        for dim in (None, 1, (0, 1)):
            torch.autograd.gradcheck(lambda t: pk.masked_mean(t, mask, dim), (x,))


def test_huge_and_tiny_values_are_finite_on_every_backend():
    x = torch.tensor([[3e38, -3e38, 1e38, 0.0], [2e38, -1e30, 5.0, -3e38]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    for backend in cpu_backends("masked_whiten"):
        with _backend.use_backend(masked_whiten=backend):
            out = pk.masked_whiten(x, mask)
            tiny = pk.masked_whiten(x * 1e-70 * 1e-7, mask)  # ~1e-39: subnormal float32
        assert torch.isfinite(out).all(), backend
        torch.testing.assert_close(out.double(), _whiten64(x, mask), atol=1e-5, rtol=1e-5)
        assert torch.isfinite(tiny).all(), backend


def test_bad_arguments_name_the_argument():
    x, m = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask"):
        ops.masked_whiten(x, m[:, :2], True, True, 1e-8)
    with pytest.raises(TypeError, match="x"):
        ops.masked_mean(x.long(), m, None, "zero")
    with pytest.raises(ValueError, match="empty"):
        ops.masked_mean(x, m, None, "none")
    with pytest.raises(IndexError, match="dim"):
        ops.masked_mean(x, m, [2], "zero")
    with pytest.raises(ValueError, match="dim"):
        ops.masked_mean(x, m, [1, -1], "zero")
    with pytest.raises(ValueError, match="eps"):
        ops.masked_whiten(x, m, True, True, -1.0)
    with pytest.raises(TypeError, match="mask"):
        pk.masked_mean(x, torch.ones(2, 3, dtype=torch.complex64))


def test_opcheck():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 9, generator=g)
    w = torch.rand(3, 9, generator=g) * (torch.rand(3, 9, generator=g) > 0.3)
    for mask in (w, w != 0):
        torch.library.opcheck(torch.ops.ppo_kernels.masked_mean.default, (x, mask, None, "zero"))
        torch.library.opcheck(torch.ops.ppo_kernels.masked_mean.default, (x, mask, [1], "nan"))
        torch.library.opcheck(
            torch.ops.ppo_kernels.masked_mean_backward.default,
            (torch.ones(3), x, mask, [1], "zero"),
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.masked_whiten.default, (x, mask, False, True, 1e-8)
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.masked_whiten_backward.default,
            (torch.randn(3, 9), x, mask, True, False, 1e-8),
        )
