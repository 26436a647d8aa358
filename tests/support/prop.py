"""Helpers of the property-based tests (tests/properties/): every backend that runs here
(support.utils.cpu_backends) against float64 on random shapes, dtypes, strides, masks and
extreme values. A fixed budget keeps CI fast and reproducible: derandomize=True (the same
examples on every run), no example database, and fewer, smaller examples for the Triton
interpreter, which is slow."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppo_kernels import _backend

EXAMPLES = {"cpp": 60, "eager": 40, "triton": 15}
LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
EPS32 = torch.finfo(torch.float32).eps


def run(backend: str, strategy, body):
    """Check `body(case)` for the examples hypothesis draws from `strategy`, on `backend`."""

    @settings(
        max_examples=EXAMPLES[backend],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def check(case):
        body(case)

    check()


def small(backend: str, fast: int, slow: int) -> int:
    """A size bound: `slow` on the Triton interpreter, `fast` elsewhere."""
    return slow if backend == "triton" else fast


@st.composite
def values(draw, shape, *, scale=None, extremes=True):
    """A float64 tensor of `shape`: normal values times a drawn scale (1e-3 .. 1e3), with some
    exact ties and large magnitudes when `extremes`."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    s = scale if scale is not None else draw(st.sampled_from([1e-3, 1.0, 10.0, 1e3]))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * s
    if extremes and x.numel() > 0 and draw(st.booleans()):
        kind = draw(st.sampled_from(["ties", "big"]))
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 4),), generator=g)
        flat[idx] = 0.0 if kind == "ties" else flat[idx].sign() * 1e4
    return x


@st.composite
def masks(draw, shape, *, kinds=("bool", "int", "float")):
    """A mask of `shape`: bool, int 0/1 or float weights; sometimes all zero or all one."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mode = draw(st.sampled_from(["random", "zeros", "ones"]))
    if mode == "zeros":
        m = torch.zeros(shape, dtype=torch.bool)
    elif mode == "ones":
        m = torch.ones(shape, dtype=torch.bool)
    else:
        m = torch.rand(shape, generator=g) > draw(st.sampled_from([0.2, 0.5, 0.8]))
    kind = draw(st.sampled_from(kinds))
    if kind == "int":
        return m.to(torch.int64)
    if kind == "float":
        return m.float() * (0.5 + torch.rand(shape, generator=g))
    return m


def pads_for(draw, ndim):
    """Paddings of the leading dims (0: none) for `embed`: half the time none at all."""
    if ndim < 2 or not draw(st.booleans()):
        return [0] * max(ndim - 1, 0)
    return [draw(st.integers(0, 2)) for _ in range(ndim - 1)]


def embed(x, pads, requires_grad=False):
    """(leaf, view): `x` ([..., V]) copied into a NaN-filled buffer whose leading dims are longer
    by `pads`, and the view of it holding x. With pads the leading dims of the view need not
    collapse (the last stays contiguous); the gradient of the view lands in leaf.grad."""
    big = torch.full(
        [n + p for n, p in zip(x.shape[:-1], pads)] + [x.shape[-1]], float("nan"), dtype=x.dtype
    )
    sl = tuple(slice(0, n) for n in x.shape[:-1])
    big[sl] = x
    leaf = big.requires_grad_(requires_grad)
    return leaf, leaf[sl]


def rounded(x, dtype):
    """x rounded to dtype and back to float64: what the reference sees of a low-precision input."""
    return x.to(dtype).to(torch.float64)


def backend_ctx(op: str, backend: str):
    return _backend.use_backend(**{op: backend})
