"""gae on the GPU: the CUDA (cpp) and Triton kernels against float64 references: dense batches up to
B=1024, T=8192 (dones, bootstrap values, carries out), packed rows (empty and length-1 rows,
per-token gamma and lam, carries in and out) and one packed row of 4,194,304 tokens."""

import pytest
import torch
from support.gpu import DEVICE, MARKS, big, close, require
from support.utils import SCAN_TOL, SUM_SCAN_TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.gae import naive as R

pytestmark = MARKS
OP = "gae"
BACKENDS = ["cpp", "triton"]


def _run(backend, *args, **kw):
    require(OP, backend)
    with use_backend(gae=backend), poisoned():
        return pk.gae(*args, **kw)


def _check(got, want, tol):
    """(advantages, returns, (carry value, carry advantage)) against the reference's four."""
    adv, ret, (cv, ca) = got
    close(adv, want[0], **tol)
    close(ret, want[1], **tol)
    close(cv, want[2], **tol)
    close(ca, want[3], **tol)


@pytest.mark.parametrize(
    "B,T,dtype,gamma,lam",
    [
        big(1024, 8192, torch.float32, 0.99, 0.95),
        big(64, 3001, torch.bfloat16, 0.999, 0.9),
        (8, 700, torch.bfloat16, 0.999, 0.9),
        big(7, 20000, torch.float16, 1.0, 1.0),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dense(backend, B, T, dtype, gamma, lam):
    r = torch.randn(B, T, device=DEVICE).to(dtype)
    v = torch.randn(B, T, device=DEVICE).to(dtype)
    m = torch.rand(B, T, device=DEVICE) > 0.2
    d = torch.rand(B, T, device=DEVICE) > 0.9995
    bv = torch.randn(B, device=DEVICE)
    want = R.gae_eager(r.double(), v.double(), m, gamma, lam, d, bv.double())
    got = _run(
        backend, r, v, m, gamma=gamma, lam=lam, dones=d, bootstrap_value=bv, return_carry=True
    )
    _check(got, want, SCAN_TOL if gamma * lam < 1 else SUM_SCAN_TOL)


@pytest.mark.parametrize(
    "lens", [big([0, 1, 5000, 0, 1, 70000, 3, 12345]), [0, 1, 500, 0, 1, 3000, 3]]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows(backend, lens):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    N = int(cu[-1])
    r = torch.randn(N, device=DEVICE)
    v = torch.randn(N, device=DEVICE)
    m = torch.rand(N, device=DEVICE) > 0.3
    d = torch.rand(N, device=DEVICE) > 0.999
    gt = torch.where(torch.rand(N, device=DEVICE) > 0.9, 0.9, 1.0)
    lt = torch.rand(N, device=DEVICE) * 0.5 + 0.5
    carry = (torch.randn(len(lens), device=DEVICE), torch.randn(len(lens), device=DEVICE))
    want = R.gae_eager(
        r.double(),
        v.double(),
        m,
        gt.double(),
        lt.double(),
        d,
        carry[0].double(),
        carry[1].double(),
        cu,
    )
    got = _run(
        backend, r, v, m, gamma=gt, lam=lt, dones=d, carry=carry, cu_seqlens=cu, return_carry=True
    )
    _check(got, want, SCAN_TOL)


def _long_row_ref64(r, v, m, gamma, lam, bootstrap):
    """Float64 GAE of one long row with a mask (no dones), without a loop over 4M positions: on the
    action positions A_k = delta_k + gl * A_{k+1} is a linear recurrence with a constant
    coefficient, solved in blocks of L by a float64 matmul with M[i, j] = gl^(j - i) (j >= i) and
    a short loop over the block carries; masked positions take the next action's advantage."""
    f64 = dict(dtype=torch.float64, device=r.device)
    idx = m.nonzero().squeeze(1)
    K = idx.numel()
    va = v.double()[idx]
    delta = r.double()[idx] + gamma * torch.cat([va[1:], bootstrap.double().reshape(1)]) - va
    gl = gamma * lam
    L = 2048
    C = (K + L - 1) // L
    d = torch.zeros(C * L, **f64)
    d[:K] = delta
    d = d.view(C, L)
    i = torch.arange(L, **f64)
    e = i[None, :] - i[:, None]
    M = torch.where(e >= 0, torch.tensor(gl, **f64) ** e.clamp(min=0), torch.zeros((), **f64))
    loc = d @ M.T  # loc[c, i] = sum_{j>=i} gl^(j-i) d[c, j]
    decay = torch.tensor(gl, **f64) ** (L - i)  # gl^(L - i)
    loc_first = loc[:, 0].cpu()
    firsts = torch.zeros(C + 1, dtype=torch.float64)  # A at the first position of each block
    for c in range(C - 1, -1, -1):
        firsts[c] = loc_first[c] + gl**L * firsts[c + 1]
    A = (loc + decay[None, :] * firsts[1:, None].to(r.device)).flatten()[:K]
    # every position: the advantage of the first action at or after it (0 past the last one)
    k = torch.searchsorted(idx, torch.arange(r.numel(), device=r.device))
    full = torch.where(k < K, A[k.clamp(max=max(K - 1, 0))], torch.zeros((), **f64))
    return full, full + v.double()


@pytest.mark.parametrize("T", [big(4_194_304), big(50_000), 6_000])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_long_row(backend, T):
    """One packed row of T tokens, and the same as a dense [1, T] batch."""
    r = torch.randn(T, device=DEVICE)
    v = torch.randn(T, device=DEVICE)
    m = torch.rand(T, device=DEVICE) > 0.1
    bv = torch.randn(1, device=DEVICE)
    want_adv, want_ret = _long_row_ref64(r, v, m, 0.99, 0.95, bv)
    cu = torch.tensor([0, T], dtype=torch.int32, device=DEVICE)
    adv, ret = _run(backend, r, v, m, gamma=0.99, lam=0.95, bootstrap_value=bv, cu_seqlens=cu)
    close(adv, want_adv, **SCAN_TOL)
    close(ret, want_ret, **SCAN_TOL)
    adv2, ret2 = _run(backend, r[None], v[None], m[None], gamma=0.99, lam=0.95, bootstrap_value=bv)
    close(adv2[0], want_adv, **SCAN_TOL)
    close(ret2[0], want_ret, **SCAN_TOL)


def test_long_row_reference():
    """The blocked float64 reference above against the plain float64 loop on a short row."""
    T = 5000
    r, v = torch.randn(T, dtype=torch.float64), torch.randn(T, dtype=torch.float64)
    m = torch.rand(T) > 0.1
    bv = torch.randn(1, dtype=torch.float64)
    adv, ret = _long_row_ref64(r, v, m, 0.99, 0.95, bv)
    want = R.gae_eager(r[None], v[None], m[None], 0.99, 0.95, None, bv)
    torch.testing.assert_close(adv, want[0][0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, want[1][0], atol=1e-10, rtol=1e-10)
