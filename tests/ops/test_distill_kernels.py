"""The distillation tile kernels (ppo_kernels/distill/: forward divergence per row, the student
tile's gradient written over the tile) on every CPU backend against the float64 autograd
reference (ppo_kernels/losses/distill_naive.py), NaN-poisoned outputs, the documented edge cases,
gradcheck of the analytic gradient, bad inputs naming the argument, and the whole Liger
JSD distillation loss (LigerFusedLinearJSDLoss) composed from these kernels."""

from __future__ import annotations

import math

import pytest
import torch
from support.peer_stubs import import_peer
from support.skips import requires_extension
from support.utils import GRAD_TOL, TOL, cpu_backends, poisoned

from ppo_kernels import _backend
from ppo_kernels.distill import naive as K
from ppo_kernels.distill import tiles
from ppo_kernels.losses import distill_math as DM
from ppo_kernels.losses import distill_naive as DN

BACKENDS = cpu_backends("linear_distill_loss")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1), ("tv", 0.5)]


def _run(backend, student, teacher, labels=None, mask=None, T=1.0, div="jsd", beta=0.5,
         grad=None, grad_hard=None, ignore_index=-100):  # fmt: skip
    """(forward outputs, the gradient tile) of one backend; the backward writes over a copy of
    the student tile (the tile is its own output)."""
    fwd = tiles.forward.impls[backend](
        student, teacher, labels, mask, 1.0 / T, div, beta, ignore_index
    )
    N = student.shape[0]
    if grad is None:
        grad = torch.ones(N)
    tile = student.clone()
    lse_h = fwd[5] if grad_hard is not None else None
    tiles.backward_.impls[backend](tile, teacher, labels, mask, fwd[1], fwd[2], fwd[3], lse_h, grad,
                                grad_hard, 1.0 / T, div, beta, ignore_index)  # fmt: skip
    return fwd, tile


def _ref(student, teacher, labels, mask, T, div, beta, grad, grad_hard):
    """(value, hard log-prob, d (sum grad D + grad_hard lp) / d student) in float64."""
    z = student.detach().double().requires_grad_()
    d = DN.divergence(z, teacher.double(), div, beta, T)
    keep = torch.ones(z.shape[0], dtype=torch.bool) if mask is None else mask != 0
    zero = torch.zeros_like(d)
    d = torch.where(keep, d, zero)
    h = torch.zeros_like(d)
    if labels is not None:
        h = torch.where(keep, DN.hard_logprobs(z, labels), zero)
    total = (grad.double() * d).sum()
    if grad_hard is not None:
        total = total + (grad_hard.double() * h).sum()
    (g,) = torch.autograd.grad(total, z)
    return d.detach(), h.detach(), g


def _tiles(N, V, dtype, close, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(N, V, generator=g) * scale
    zt = (
        zs + 0.3 * torch.randn(N, V, generator=g)
        if close
        else torch.randn(N, V, generator=g) * scale
    )
    return zs.to(dtype), zt.to(dtype)


# the Triton interpreter's large rows in float32 only (slow)
FWD_BWD = [
    (b, d, V)
    for b in BACKENDS
    for d in DTYPES
    for V in (1, 37, 4099)
    if not (b == "triton" and V > 1000 and d != torch.float32)
]


@pytest.mark.parametrize("div, beta", MODES)
@pytest.mark.parametrize("backend, dtype, V", FWD_BWD)
def test_forward_backward_match_float64(backend, dtype, div, beta, V):
    N = 3 if V > 1000 else 7
    zs, zt = _tiles(N, V, dtype, close=V % 2 == 1)
    labels = torch.randint(0, V, (N,))
    labels[1] = -100
    mask = torch.ones(N, dtype=torch.bool)
    mask[-1] = False
    T = 0.7 if V == 37 else 1.0
    grad, grad_hard = torch.randn(N), torch.randn(N)
    with poisoned():
        fwd, tile = _run(backend, zs, zt, labels, mask, T, div, beta, grad, grad_hard)
    value, hard, g = _ref(zs, zt, labels, mask, T, div, beta, grad, grad_hard)
    assert all(t.dtype == torch.float32 for t in fwd) and tile.dtype == dtype
    torch.testing.assert_close(fwd[0].double(), value, **TOL[dtype])
    torch.testing.assert_close(fwd[4].double(), hard, **TOL[dtype])
    torch.testing.assert_close(tile.double(), g, **GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("div, beta", MODES)
def test_without_labels_and_mask(backend, div, beta):
    zs, zt = _tiles(5, 50, torch.float32, close=False, seed=1)
    with poisoned():
        fwd, tile = _run(backend, zs, zt, None, None, 1.3, div, beta)
    value, _, g = _ref(zs, zt, None, None, 1.3, div, beta, torch.ones(5), None)
    assert fwd[4].numel() == 0 and fwd[5].numel() == 0
    torch.testing.assert_close(fwd[0].double(), value, **TOL[torch.float32])
    torch.testing.assert_close(tile.double(), g, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_distributions_keep_relative_accuracy(backend):
    """KL of nearly equal rows (the policy near its teacher): the C++ one-pass state keeps the
    relative error small; the two-pass kernels an absolute eps * log V."""
    g = torch.Generator().manual_seed(2)
    zs = 4 * torch.randn(4, 3000, generator=g)
    zt = zs + 1e-3 * torch.randn(4, 3000, generator=g)
    for div in ("forward_kl", "reverse_kl"):
        fwd, _ = _run(backend, zs, zt, div=div)
        value, _, _ = _ref(zs, zt, None, None, 1.0, div, 0.5, torch.ones(4), None)
        tol = dict(rtol=1e-3, atol=1e-10) if backend == "cpp" else dict(rtol=0, atol=2e-6)
        torch.testing.assert_close(fwd[0].double(), value, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_rows(backend):
    """A masked row (holding NaN: not read), -inf entries in either tile, a row of all -inf, a row
    with NaN and one with +inf."""
    V = 9
    zs, zt = _tiles(6, V, torch.float32, close=False, seed=3)
    zs[0] = math.nan  # masked
    zs[1, :3] = -math.inf
    zt[1, 5:] = -math.inf
    zt[2, :] = -math.inf
    zs[3, 4] = math.nan
    zt[4, 2] = math.inf
    mask = torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.bool)
    for div, beta in MODES:
        fwd, tile = _run(backend, zs, zt, None, mask, 1.0, div, beta)
        assert fwd[0][0] == 0 and torch.all(tile[0] == 0)
        assert all(math.isnan(fwd[0][r].item()) for r in (2, 3, 4))
        ref, _, g = _ref(zs[1:2], zt[1:2], None, None, 1.0, div, beta, torch.ones(1), None)
        if div == "jsd" or div == "tv":  # finite here; the KLs are +inf by definition
            torch.testing.assert_close(fwd[0][1:2].double(), ref, **TOL[torch.float32])
            torch.testing.assert_close(tile[1:2].double(), g, **GRAD_TOL[torch.float32])
        else:
            assert fwd[0][1].item() == ref.item() == math.inf
        if div != "forward_kl":  # p = 0 there: no gradient (forward_kl's is -q)
            assert torch.all(tile[1, :3] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_in_place_tile(backend):
    """Rows of a larger buffer (row stride > V): only each row's V entries are written."""
    buf = torch.randn(4, 40)
    tbuf = torch.randn(4, 40)
    zs, zt = buf[:, 3:33], tbuf[:, 5:35]
    fwd = tiles.forward.impls[backend](zs, zt, None, None, 1.0, "tv", 0.5, -100)
    value, _, g = _ref(zs, zt, None, None, 1.0, "tv", 0.5, torch.ones(4), None)
    torch.testing.assert_close(fwd[0].double(), value, **TOL[torch.float32])
    before = buf.clone()
    tiles.backward_.impls[backend](zs, zt, None, None, fwd[1], fwd[2], fwd[3], None, torch.ones(4),
                                None, 1.0, "tv", 0.5, -100)  # fmt: skip
    torch.testing.assert_close(buf[:, 3:33].double(), g, **GRAD_TOL[torch.float32])
    assert torch.equal(buf[:, :3], before[:, :3]) and torch.equal(buf[:, 33:], before[:, 33:])


def test_backends_agree_on_empty_tiles():
    for backend in BACKENDS:
        e = torch.zeros(0, 11)
        fwd = tiles.forward.impls[backend](e, e, torch.zeros(0, dtype=torch.long), None, 1.0, "jsd",
                                        0.5, -100)  # fmt: skip
        assert all(t.shape == (0,) for t in fwd)


class _Divergence(torch.autograd.Function):
    """The kernels as an autograd function (float64: the eager backend), for gradcheck."""

    @staticmethod
    def forward(ctx, zs, zt, labels, inv_t, div, beta):
        fwd = tiles.forward(zs, zt, labels, None, inv_t, div, beta, -100)
        ctx.save_for_backward(zs, zt, labels, *fwd)
        ctx.args = (inv_t, div, beta)
        return fwd[0], fwd[4]

    @staticmethod
    def backward(ctx, g, gh):
        zs, zt, labels, _, ls, lt, aux, _, lh = ctx.saved_tensors
        tile = zs.detach().clone()
        inv_t, div, beta = ctx.args
        tiles.backward_(tile, zt, labels, None, ls, lt, aux, lh, g, gh, inv_t, div, beta, -100)
        return tile, None, None, None, None, None


@pytest.mark.parametrize("div, beta", MODES)
def test_gradcheck_of_the_kernel_gradient(div, beta):
    g = torch.Generator().manual_seed(4)
    zs = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(3, 6, generator=g, dtype=torch.float64)
    labels = torch.tensor([2, -100, 5])
    assert _backend.backend_for("linear_distill_loss", zs) == "eager"
    assert torch.autograd.gradcheck(
        lambda z: _Divergence.apply(z, zt, labels, 1 / 0.8, div, beta), (zs,)
    )


@requires_extension
def test_mode_tables_match_the_cpp_ones():
    assert tuple(torch.ops.ppo_kernels_C.distill_divergence_names()) == tiles.DIVERGENCES
    assert tiles.DIVERGENCES == DM.DIVERGENCES == DN.DIVERGENCES == K.DIVERGENCES
    assert tuple(torch.ops.ppo_kernels_C.distill_topk_tail_names()) == DM.TOPK_TAILS


def test_cpp_on_a_device_without_its_kernels_delegates():
    info = _backend.OPS["linear_distill_loss"]
    assert _backend.delegation("linear_distill_loss", "cpp", "cuda") is not None
    assert info.cuda_default == "triton" and info.public == ("linear_distill_loss",)


_x = torch.randn(3, 5)
BAD = [
    (dict(teacher=torch.randn(3, 5).double()), TypeError, "teacher: expected dtype"),
    (dict(student=torch.randint(0, 3, (3, 5))), TypeError, "student: expected a float dtype"),
    (dict(teacher=torch.randn(3, 6)), ValueError, "teacher: expected shape"),
    (dict(student=torch.randn(3, 5, 1), teacher=torch.randn(3, 5, 1)), ValueError, "student: expected a"),
    (dict(student=torch.randn(5, 3).T, teacher=torch.randn(5, 3).T), ValueError, "contiguous"),
    (dict(divergence="kl"), ValueError, "divergence: unknown"),
    (dict(divergence="jsd", beta=0.0), ValueError, "beta: jsd"),
    (dict(inv_temperature=0.0), ValueError, "inv_temperature"),
    (dict(inv_temperature=math.inf), ValueError, "inv_temperature"),
    (dict(labels=torch.tensor([0, 1, 5])), IndexError, "labels"),
    (dict(labels=torch.tensor([0, 1, -2])), IndexError, "labels"),
    (dict(labels=torch.tensor([0.0, 1.0, 2.0])), TypeError, "labels: expected dtype"),
    (dict(labels=torch.tensor([0, 1])), ValueError, "labels: expected 3 elements"),
    (dict(mask=torch.ones(4)), ValueError, "mask: expected 3 elements"),
    (dict(student=torch.randn(2, 0), teacher=torch.randn(2, 0)), ValueError, "vocabulary"),
]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_name_the_argument(backend, case):
    kw, err, match = BAD[case]
    a = dict(student=_x, teacher=torch.randn(3, 5), labels=None, mask=None, inv_temperature=1.0,
             divergence="tv", beta=0.5, ignore_index=-100)  # fmt: skip
    a.update(kw)
    with pytest.raises(err, match=match):
        tiles.forward.impls[backend](*a.values())
    st = a["student"]
    n = st.shape[0] if st.dim() else 0
    with pytest.raises(err, match=match):
        r = torch.zeros(n)
        tiles.backward_.impls[backend](st.clone(), a["teacher"], a["labels"], a["mask"], r, r, r, None,
                                    r, None, *list(a.values())[4:])  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_backward_rows_name_the_argument(backend):
    zs, zt = torch.randn(3, 5), torch.randn(3, 5)
    r, lab = torch.zeros(3), torch.tensor([0, 1, 2])
    args = lambda **k: dict(dict(student=zs.clone(), teacher=zt, labels=lab, mask=None, lse_s=r,  # noqa: E731
                                 lse_t=r, aux=r, lse_hard=r, grad=r, grad_hard=None,
                                 inv_temperature=1.0, divergence="tv", beta=0.5,
                                 ignore_index=-100), **k).values()  # fmt: skip
    for kw, match in (
        (dict(grad=torch.zeros(4)), "grad: expected 3 elements"),
        (dict(aux=torch.zeros(2)), "aux: expected 3"),
        (dict(lse_s=torch.zeros(3, dtype=torch.long)), "lse_student: expected a float dtype"),
        (dict(grad_hard=r, labels=None), "labels: a hard-label gradient"),
        (dict(grad_hard=r, lse_hard=None), "lse_hard: a hard-label gradient"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            tiles.backward_.impls[backend](*args(**kw))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "beta, w_hard, T", [(0.5, 0.5, 1.0), (0.0, 0.3, 2.0), (1.0, 0.0, 1.0), (0.25, 1.0, 0.5)]
)
def test_composes_liger_jsd_distillation_loss(backend, beta, w_hard, T):
    """LigerFusedLinearJSDLoss from the kernels on the materialised tiles: the forward values and
    hard log-probs, distill_math.combine for the coefficients, the backward kernel for the
    student tile's gradient, then the two GEMMs a fused op runs."""
    jsd = import_peer("liger_kernel.chunked_loss.jsd_loss")
    g = torch.Generator().manual_seed(5)
    N, H, Ht, V = 12, 8, 6, 40
    hs = torch.randn(N, H, generator=g, requires_grad=True)
    Ws = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()
    ht, Wt = torch.randn(N, Ht, generator=g), 0.5 * torch.randn(V, Ht, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[2, 7]] = -100
    mod = jsd.LigerFusedLinearJSDLoss(weight_hard_loss=w_hard, weight_soft_loss=1 - w_hard + 0.2,
                                      beta=beta, temperature=T, compiled=False, chunk_size=5,
                                      return_soft_hard_loss=True)  # fmt: skip
    loss, soft, hard = mod(hs, Ws, ht, Wt, labels)
    gh, gW = torch.autograd.grad(loss, (hs, Ws))
    cfg = DM.DistillLossConfig(
        "jsd", beta, T, weight_soft_loss=1 - w_hard + 0.2, weight_hard_loss=w_hard
    )
    div = DM.resolve(cfg.divergence, cfg.beta)
    zs, zt = hs.detach() @ Ws.detach().T, ht @ Wt.T
    keep = labels != -100
    fwd = tiles.forward.impls[backend](zs, zt, labels, keep, 1 / T, div, beta, -100)
    res = DM.combine(cfg, fwd[0], fwd[4], keep)
    tile = zs.clone()
    tiles.backward_.impls[backend](tile, zt, labels, keep, fwd[1], fwd[2], fwd[3], fwd[5],
                                res.d_value, res.d_hard_logprob, 1 / T, div, beta, -100)  # fmt: skip
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.loss, loss.detach(), **tol)
    torch.testing.assert_close(res.soft_loss, soft.detach(), **tol)
    torch.testing.assert_close(res.hard_loss, hard.detach(), **tol)
    torch.testing.assert_close(tile @ Ws.detach(), gh, **tol)
    torch.testing.assert_close(tile.T @ hs.detach(), gW, **tol)
