"""gae, masked_whiten, masked_mean: every CPU backend against the float64 sequential reference
(written straight from the formulas), peers' loops, chunking with carries, packed rows."""

import pytest
import torch
from support.skips import need_backend

import ppo_kernels
from ppo_kernels import use_backend
from ppo_kernels.gae import naive as R

try:
    from ppo_kernels.gae import triton_kernels as TK
except ImportError:  # no triton installed: the triton backend is unavailable anyway
    TK = None

from support.utils import cpu_backends, poisoned

BACKENDS = cpu_backends("gae")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32 accumulation over rows of up to a few hundred positions of O(1) rewards and values.
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _small_triton_blocks():
    # Through the interpreter: 16-token blocks, so that rows span several blocks and chunks.
    if TK is None:
        yield
        return
    old = dict(TK.CONFIG)
    TK.CONFIG.update(block=16)
    yield
    TK.CONFIG.clear()
    TK.CONFIG.update(old)


def _mask_rows(B, T):
    """Random masks plus the shapes that matter: all masked, masked prefix and suffix, isolated
    actions, all actions."""
    m = torch.rand(B, T) > 0.35
    kinds = [
        torch.zeros(T, dtype=torch.bool),
        torch.cat(
            [
                torch.zeros(T // 3, dtype=torch.bool),
                torch.ones(T - T // 3 - T // 4, dtype=torch.bool),
                torch.zeros(T // 4, dtype=torch.bool),
            ]
        ),
        torch.arange(T) % 7 == 3,
        torch.ones(T, dtype=torch.bool),
    ]
    for i, k in enumerate(kinds[: max(B - 1, 0)]):
        m[i + 1] = k
    return m


def _inputs(B, T, dtype=torch.float32):
    r = torch.randn(B, T).to(dtype)
    v = torch.randn(B, T).to(dtype)
    return r, v, _mask_rows(B, T)


def _check(got, ref, tol=TOL):
    adv, ret = got[0], got[1]
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref[0], **tol)
    torch.testing.assert_close(ret.double(), ref[1], **tol)
    if len(got) > 2:
        torch.testing.assert_close(got[2][0].double(), ref[2][0], **tol)
        torch.testing.assert_close(got[2][1].double(), ref[2][1], **tol)


def _run(backend, *args, **kw):
    with use_backend(backend), poisoned():
        return ppo_kernels.gae(*args, **kw)


def test_reference_matches_verl_loop_float64():
    # The oracle itself: with only a mask, verl's loop is the definition.
    r, v, m = _inputs(5, 41)
    ref = R.gae_sequential(r, v, m, gamma=0.97, lam=0.9)
    adv, ret = R.verl_gae_loop(r.double(), v.double(), m.double(), 0.97, 0.9)
    torch.testing.assert_close(adv, ref[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ret, ref[1], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 37, 100])
def test_masks_every_dtype(backend, dtype, T):
    r, v, m = _inputs(5, T, dtype)
    ref = R.gae_sequential(r, v, m, gamma=0.99, lam=0.95)
    _check(_run(backend, r, v, m, gamma=0.99, lam=0.95, return_carry=True), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dones_bootstrap_carry(backend):
    B, T = 5, 53
    r, v, m = _inputs(B, T)
    d = torch.rand(B, T) > 0.9
    d[0, T - 1] = True  # terminated at the last position: the bootstrap value is ignored
    d[2, 5] = True
    m[2, 5] = False  # a done at a masked position cuts too
    bv = torch.randn(B)
    ref = R.gae_sequential(r, v, m, gamma=0.9, lam=0.8, dones=d, bootstrap_value=bv)
    _check(
        _run(backend, r, v, m, gamma=0.9, lam=0.8, dones=d, bootstrap_value=bv, return_carry=True),
        ref,
    )
    carry = (torch.randn(B), torch.randn(B))
    ref = R.gae_sequential(r, v, m, gamma=0.9, lam=0.8, dones=d, carry=carry)
    _check(_run(backend, r, v, m, gamma=0.9, lam=0.8, dones=d, carry=carry, return_carry=True), ref)


def test_bootstrap_semantics_by_hand():
    # One action followed by padding in a truncated row: delta = r + gamma * bootstrap - v.
    r = torch.tensor([[1.0, 0.0, 0.0]])
    v = torch.tensor([[0.5, 9.0, 9.0]])
    m = torch.tensor([[True, False, False]])
    adv, ret = ppo_kernels.gae(r, v, m, gamma=0.5, lam=0.5, bootstrap_value=torch.tensor([2.0]))
    assert adv.tolist() == [[1.0 + 0.5 * 2.0 - 0.5, 0.0, 0.0]]
    assert ret.tolist() == [[2.0, 9.0, 9.0]]
    d = torch.tensor([[True, False, False]])  # terminated after the action: no bootstrap
    adv, _ = ppo_kernels.gae(
        r, v, m, gamma=0.5, lam=0.5, dones=d, bootstrap_value=torch.tensor([2.0])
    )
    assert adv.tolist() == [[0.5, 0.0, 0.0]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gl", [(0.0, 0.7), (0.9, 0.0), (1.0, 1.0)])
def test_gamma_lam_extremes(backend, gl):
    r, v, m = _inputs(4, 45)
    d = torch.rand(4, 45) > 0.9
    ref = R.gae_sequential(r, v, m, gamma=gl[0], lam=gl[1], dones=d)
    _check(_run(backend, r, v, m, gamma=gl[0], lam=gl[1], dones=d), ref, dict(atol=5e-5, rtol=2e-5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_gamma_lam(backend):
    B, T = 4, 50
    r, v, m = _inputs(B, T)
    # discount only at turn boundaries: gamma 1 inside a turn, 0.9 at every 10th token
    g = torch.where(torch.arange(T) % 10 == 9, 0.9, 1.0).expand(B, T)
    lam = torch.rand(B, T)
    ref = R.gae_sequential(r, v, m, gamma=g, lam=lam, bootstrap_value=torch.randn(B))
    bv = torch.randn(B)
    ref = R.gae_sequential(r, v, m, gamma=g, lam=lam, bootstrap_value=bv)
    _check(_run(backend, r, v, m, gamma=g, lam=lam, bootstrap_value=bv, return_carry=True), ref)
    # one tensor, one float; a per-row [B, 1] gamma broadcasts
    ref = R.gae_sequential(r, v, m, gamma=g, lam=0.95)
    _check(_run(backend, r, v, m, gamma=g, lam=0.95), ref)
    gr = torch.rand(B, 1)
    ref = R.gae_sequential(r, v, m, gamma=gr, lam=0.95)
    _check(_run(backend, r, v, m, gamma=gr, lam=0.95), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_rows(backend, dtype):
    lens = [0, 1, 23, 0, 40, 1, 17]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N = int(cu[-1])
    r = torch.randn(N).to(dtype)
    v = torch.randn(N).to(dtype)
    m = torch.rand(N) > 0.3
    d = torch.rand(N) > 0.9
    n = len(lens)
    carry = (torch.randn(n), torch.randn(n))
    ref = R.gae_sequential(r, v, m, gamma=0.95, lam=0.9, dones=d, carry=carry, cu_seqlens=cu)
    got = _run(
        backend,
        r,
        v,
        m,
        gamma=0.95,
        lam=0.9,
        dones=d,
        carry=carry,
        cu_seqlens=cu,
        return_carry=True,
    )
    _check(got, ref)
    # empty rows hand their carry straight through
    for i in (0, 3):
        assert got[2][0][i] == carry[0][i] and got[2][1][i] == carry[1][i]
    # packed == each row on its own
    for i in range(n):
        lo, hi = int(cu[i]), int(cu[i + 1])
        if hi > lo:
            one = R.gae_sequential(
                r[None, lo:hi],
                v[None, lo:hi],
                m[None, lo:hi],
                gamma=0.95,
                lam=0.9,
                dones=d[None, lo:hi],
                carry=(carry[0][i : i + 1], carry[1][i : i + 1]),
            )
            torch.testing.assert_close(got[0][lo:hi].double(), one[0][0], **TOL)
    # int64 offsets are accepted
    got64 = _run(backend, r, v, m, gamma=0.95, lam=0.9, dones=d, carry=carry, cu_seqlens=cu.long())
    torch.testing.assert_close(got64[0], got[0], atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_with_carry_equals_whole(backend):
    B, T = 3, 90
    r, v, m = _inputs(B, T)
    d = torch.rand(B, T) > 0.95
    bv = torch.randn(B)
    whole = _run(
        backend, r, v, m, gamma=0.98, lam=0.9, dones=d, bootstrap_value=bv, return_carry=True
    )
    cuts = [0, 13, 14, 50, 90]
    carry = (bv, torch.zeros(B))
    advs, rets = {}, {}
    for lo, hi in reversed(list(zip(cuts[:-1], cuts[1:]))):
        a, rt, carry = _run(
            backend,
            r[:, lo:hi],
            v[:, lo:hi],
            m[:, lo:hi],
            gamma=0.98,
            lam=0.9,
            dones=d[:, lo:hi],
            carry=carry,
            return_carry=True,
        )
        advs[lo], rets[lo] = a, rt
    adv = torch.cat([advs[c] for c in cuts[:-1]], 1)
    ret = torch.cat([rets[c] for c in cuts[:-1]], 1)
    torch.testing.assert_close(adv, whole[0], **TOL)
    torch.testing.assert_close(ret, whole[1], **TOL)
    torch.testing.assert_close(carry[0], whole[2][0], **TOL)
    torch.testing.assert_close(carry[1], whole[2][1], **TOL)


@pytest.mark.parametrize("config", [dict(chunk=48), dict(programs=64), dict(chunk=32, block=32)])
def test_triton_chunk_passes(config):
    """The Triton kernel's three-pass path (chunks not aligned to rows, carries between chunks)."""
    need_backend("gae", "triton")
    TK.CONFIG.update(config)
    B, T = 3, 37
    r, v, m = _inputs(B, T)
    d = torch.rand(B, T) > 0.9
    bv = torch.randn(B)
    ref = R.gae_sequential(r, v, m, gamma=0.9, lam=0.8, dones=d, bootstrap_value=bv)
    _check(
        _run("triton", r, v, m, gamma=0.9, lam=0.8, dones=d, bootstrap_value=bv, return_carry=True),
        ref,
    )
    lens = [5, 0, 60, 1, 30]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    N = int(cu[-1])
    rf, vf, mf = torch.randn(N), torch.randn(N), torch.rand(N) > 0.2
    ref = R.gae_sequential(rf, vf, mf, gamma=0.9, lam=0.8, cu_seqlens=cu)
    _check(_run("triton", rf, vf, mf, gamma=0.9, lam=0.8, cu_seqlens=cu, return_carry=True), ref)


@pytest.mark.parametrize("B,T", [(1, 70001), (3, 40000)])
def test_cpp_long_rows_split_across_threads(B, T):
    """Few long rows: the CPU kernel cuts them into chunks (>= 16384 positions) and fixes up the
    carries; compared with the float64 eager loop (itself checked against the oracle above)."""
    need_backend("gae", "cpp")
    r, v = torch.randn(B, T), torch.randn(B, T)
    m = torch.rand(B, T) > 0.2
    d = torch.rand(B, T) > 0.999
    bv = torch.randn(B)
    ref = R.gae_eager(r.double(), v.double(), m, 0.999, 0.95, d, bv.double())
    got = _run(
        "cpp", r, v, m, gamma=0.999, lam=0.95, dones=d, bootstrap_value=bv, return_carry=True
    )
    tol = dict(atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[0].double(), ref[0], **tol)
    torch.testing.assert_close(got[1].double(), ref[1], **tol)
    torch.testing.assert_close(got[2][0].double(), ref[2], **tol)
    torch.testing.assert_close(got[2][1].double(), ref[3], **tol)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_exactly_verl(backend):
    """Bit for bit verl's compute_gae_advantage_return (before whitening) in float32, with its
    float 0/1 mask, when a row is processed in one piece (the CPU kernel's order of operations
    is verl's; chunked rows and the GPU scan differ by float rounding only)."""
    B, T = 6, 300
    r, v, m = _inputs(B, T)
    adv_v, ret_v = R.verl_gae_loop(r, v, m.float(), 0.99, 0.95)
    adv, ret = _run(backend, r, v, m.float(), gamma=0.99, lam=0.95)
    assert torch.equal(adv, adv_v) and torch.equal(ret, ret_v)
    # and float64 end to end
    adv_v, ret_v = R.verl_gae_loop(r.double(), v.double(), m.double(), 0.99, 0.95)
    adv, ret = _run(backend, r.double(), v.double(), m, gamma=0.99, lam=0.95)
    assert torch.equal(adv, adv_v) and torch.equal(ret, ret_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_triton_matches_verl_to_rounding(backend):
    r, v, m = _inputs(4, 70)
    adv_v, ret_v = R.verl_gae_loop(r.double(), v.double(), m.double(), 0.99, 0.95)
    adv, ret = _run(backend, r, v, m, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv.double(), adv_v, **TOL)
    torch.testing.assert_close(ret.double(), ret_v, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_openrlhf_and_trl_by_premultiplying(backend):
    r, v, m = _inputs(4, 60)
    mf = m.double()
    adv_o, ret_o = R.openrlhf_gae_loop(v.double(), r.double(), mf, 0.99, 0.95)
    adv, ret = _run(backend, r * m, v * m, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv.double(), adv_o, **TOL)
    torch.testing.assert_close(ret.double(), ret_o, **TOL)
    adv_t, ret_t = R.trl_gae_loop(r.double(), v.double(), 0.99, 0.95)
    adv, ret = _run(backend, r, v, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv.double(), adv_t, **TOL)
    torch.testing.assert_close(ret.double(), ret_t, **TOL)
    # and verl's skipping is really different from OpenRLHF's zero steps on these masks
    assert not torch.allclose(R.verl_gae_loop(r.double(), v.double(), mf, 0.99, 0.95)[0], adv_o)


def test_mixed_and_numeric_masks():
    r, v, m = _inputs(3, 20)
    a = ppo_kernels.gae(r, v.half(), m.long(), gamma=0.9, lam=0.9)
    ref = R.gae_sequential(r, v.half().float(), m, gamma=0.9, lam=0.9)
    _check(a, ref)


def test_no_backward():
    r, v, m = _inputs(2, 8)
    v.requires_grad_(True)
    adv, ret = ppo_kernels.gae(r, v, m)
    with pytest.raises(RuntimeError, match="no backward"):
        ret.sum().backward()
    with torch.no_grad():
        adv, _ = ppo_kernels.gae(r, v, m)
    assert not adv.requires_grad


def test_argument_errors():
    r, v, m = _inputs(2, 8)
    with pytest.raises(ValueError, match="values"):
        ppo_kernels.gae(r, v[:, :4], m)
    with pytest.raises(ValueError, match="mask"):
        ppo_kernels.gae(r, v, m[:, :4])
    with pytest.raises(TypeError, match="rewards"):
        ppo_kernels.gae(r.long(), v)
    with pytest.raises(ValueError, match="bootstrap_value and carry"):
        ppo_kernels.gae(
            r, v, bootstrap_value=torch.zeros(2), carry=(torch.zeros(2), torch.zeros(2))
        )
    with pytest.raises(ValueError, match="bootstrap_value"):
        ppo_kernels.gae(r, v, bootstrap_value=torch.zeros(3))
    with pytest.raises(ValueError, match="gamma"):
        ppo_kernels.gae(r, v, gamma=torch.rand(3, 8))
    with pytest.raises(ValueError, match="gamma"):
        ppo_kernels.gae(r, v, gamma=float("nan"))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_kernels.gae(r.flatten(), v.flatten(), cu_seqlens=torch.tensor([0, 5, 4, 16]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_kernels.gae(r.flatten(), v.flatten(), cu_seqlens=torch.tensor([0, 5, 15]))
    with pytest.raises(ValueError, match="rewards"):
        ppo_kernels.gae(r.flatten(), v.flatten())


def test_empty():
    for backend in BACKENDS:
        adv, ret, (cv, ca) = _run(
            backend,
            torch.zeros(3, 0),
            torch.zeros(3, 0),
            return_carry=True,
            bootstrap_value=torch.tensor([1.0, 2.0, 3.0]),
        )
        assert adv.shape == (3, 0) and cv.tolist() == [1.0, 2.0, 3.0] and ca.tolist() == [0.0] * 3


def test_opcheck():
    r, v, m = _inputs(3, 20)
    d = torch.rand(3, 20) > 0.8
    args = (r, v, m, d, None, None, 0.9, 0.8, torch.randn(3), None, None)
    torch.library.opcheck(torch.ops.ppo_kernels.gae.default, args)
    cu = torch.tensor([0, 7, 7, 60], dtype=torch.int32)
    args = (
        r.flatten(),
        v.flatten(),
        m.flatten(),
        None,
        torch.rand(60),
        torch.rand(60),
        1.0,
        1.0,
        None,
        None,
        cu,
    )
    torch.library.opcheck(torch.ops.ppo_kernels.gae.default, args)


def test_compile_fullgraph():
    torch._dynamo.reset()
    r, v, m = _inputs(3, 20)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(r, v, m):
        adv, ret = ppo_kernels.gae(r, v, m, gamma=0.99, lam=0.95)
        return ppo_kernels.masked_whiten(adv, m), ret

    w, ret = f(r, v, m)
    adv_e, ret_e = ppo_kernels.gae(r, v, m, gamma=0.99, lam=0.95)
    torch.testing.assert_close(ret, ret_e)
    torch.testing.assert_close(w, ppo_kernels.masked_whiten(adv_e, m))


# ---- masked_mean / masked_whiten ----


def _whiten64(x, m, unbiased=True, shift_mean=True, eps=1e-8):
    xs = x.double()[m]
    n = xs.numel()
    mean = xs.mean()
    var = ((xs - mean) ** 2).sum() / (n - 1 if unbiased else n)
    out = (x.double() - mean) / torch.sqrt(var + eps)
    return out + mean if not shift_mean else out


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_whiten(dtype):
    x = (torch.randn(4, 30) * 3 + 1).to(dtype)
    m = torch.rand(4, 30) > 0.4
    x_nan = x.clone()
    x_nan[~m] = float("nan")  # masked-out entries never reach the statistics
    for unbiased in (True, False):
        for shift in (True, False):
            got = ppo_kernels.masked_whiten(x_nan, m, unbiased=unbiased, shift_mean=shift)
            assert got.dtype == torch.float32
            ref = _whiten64(x, m, unbiased, shift)
            torch.testing.assert_close(got[m].double(), ref[m], atol=1e-5, rtol=1e-5)
    # verl's numbers (its masked_whiten on a clean tensor, float mask)
    mean = (x.double() * m).sum() / m.sum()
    var = ((x.double() - mean) ** 2 * m).sum() / m.sum() * (m.sum() / (m.sum() - 1))
    torch.testing.assert_close(
        ppo_kernels.masked_whiten(x, m.float()).double(),
        (x.double() - mean) * torch.rsqrt(var + 1e-8),
        atol=1e-5,
        rtol=1e-5,
    )


def test_masked_whiten_too_few_positions():
    x = torch.randn(2, 5)
    m = torch.zeros(2, 5, dtype=torch.bool)
    m[0, 1] = True
    assert ppo_kernels.masked_whiten(x, m).isnan().all()  # no sync: NaN
    assert ppo_kernels.masked_whiten(x, m, unbiased=False).isfinite().all()
    with ppo_kernels.strict_checks(), pytest.raises(ValueError, match="at least two"):
        ppo_kernels.masked_whiten(x, m)


def test_masked_mean():
    x = torch.randn(4, 30)
    m = torch.rand(4, 30) > 0.4
    m[2] = False
    x_nan = torch.where(m, x, float("nan"))
    torch.testing.assert_close(ppo_kernels.masked_mean(x_nan, m), x[m].mean())
    per_row = ppo_kernels.masked_mean(x_nan, m, dim=1)
    for i in range(4):
        exp = x[i][m[i]].mean() if m[i].any() else torch.tensor(0.0)
        torch.testing.assert_close(per_row[i], exp)
    assert ppo_kernels.masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_stats_weighted_mask_and_empty():
    """A float mask weights positions (verl's and OpenRLHF's x * mask sums); empty="nan" gives
    OpenRLHF's 0 / 0 over an empty set."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    w = torch.rand(3, 8, generator=g, dtype=torch.float64) * (torch.rand(3, 8, generator=g) > 0.3)
    w[2] = 0
    torch.testing.assert_close(ppo_kernels.masked_mean(x, w), (x * w).sum() / w.sum())
    per_row = ppo_kernels.masked_mean(x, w, dim=1, empty="nan")
    torch.testing.assert_close(per_row[:2], (x * w).sum(1)[:2] / w.sum(1)[:2])
    assert per_row[2].isnan()
    assert ppo_kernels.masked_mean(x, w, dim=1)[2] == 0
    n = w.sum()
    mean = (x * w).sum() / n
    var = ((x - mean) ** 2 * w).sum() / n * n / (n - 1)
    torch.testing.assert_close(
        ppo_kernels.masked_whiten(x, w), (x - mean) * torch.rsqrt(var + 1e-8)
    )
    with pytest.raises(ValueError, match="empty"):
        ppo_kernels.masked_mean(x, w, empty="none")
