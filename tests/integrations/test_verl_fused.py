"""verl 0.9's hidden-state kernels of `use_fused_kernels=True` on linear_token_logprobs: the
"torch" / "liger" backends' FusedLinearForPPO.forward and the "triton" backend's (and Megatron's)
linear_cross_entropy, patched vs verl's own torch backend and vs verl's unfused path (logits, then
logprobs_from_logits / entropy_from_logits), float32 within 1e-5, gradients to hidden and weight
included; and kl_penalty="full" on full_kl."""

from __future__ import annotations

import pytest
import torch
from support.integration import compare
from support.peer_stubs import import_peer

import ppo_kernels as pk
import ppo_kernels.integrations as pki

H, V = 32, 300
# the weight gradient sums ~1000 rows: float32 round-off of ~1e-5 at |g| ~ 25, verl's and ours alike
# (both that close to float64)
ATOL = 1e-5
FUSED = "verl.utils.experimental.torch_functional.FusedLinearForPPO.forward"
LCE = "verl.utils.kernel.linear_cross_entropy.linear_cross_entropy"


@pytest.fixture(scope="module")
def verl():
    exp = import_peer("verl.utils.experimental.torch_functional")
    kern = import_peer("verl.utils.kernel.linear_cross_entropy")
    tf = import_peer("verl.utils.torch_functional")
    yield exp, kern, tf
    pki.revert("verl")


def _inputs(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, H, generator=g) * 2).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
    y = torch.randint(0, V, shape, generator=g)
    return h, w, y, g


def _both(o):
    return o[0].float() + 0.5 * o[1].float()  # gradients through log-probs and entropy


@pytest.mark.parametrize("shape", [(1, 600), (700,), (3, 5)])  # > verl's 512-row chunk, 2-D, 3-D
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2])
def test_torch_backend(verl, shape, temperature):
    exp, _, _ = verl
    h, w, y, _ = _inputs(shape)
    _, _, rep = compare(
        "verl",
        lambda: exp.FusedLinearForPPO(impl_backend="torch").forward,
        h,
        w,
        y,
        temperature,
        grad_of=_both,
        atol=ATOL,
        # the weight's gradient sums 600-700 rows of float32 products, in another order than
        # verl's 512-row chunks: an element that nearly cancels keeps a rounding of ~1e-5
        grad_atol=4 * ATOL,
    )
    assert rep["functions"][FUSED]["replaced"] == 1


def test_liger_backend(verl, monkeypatch):
    """impl_backend="liger": Liger's kernel where liger-kernel imports (its CPU path here; labels
    -100 give 0; a per-row temperature tensor, which Liger's kernel cannot take, as verl's unfused
    path), else verl's torch route -- both mirrored."""
    exp, _, tf = verl
    h, w, y, _ = _inputs((2, 40))
    y[0, :3] = -100
    if exp._LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY is not None:
        ref, got, _ = compare(
            "verl",
            lambda: exp.FusedLinearForPPO(impl_backend="liger").forward,
            h,
            w,
            y,
            0.8,
            grad_of=_both,
            atol=ATOL,
        )
        assert not got[0][0, :3].any() and not got[1][0, :3].any()
        t = torch.tensor([0.8, 1.3]).view(2, 1, 1)
        with pki.patched("verl", strict=True):
            got = exp.FusedLinearForPPO(impl_backend="liger").forward(h, w, y.clamp(min=0), t)
        _close_to_unfused(tf, got, h, w, y.clamp(min=0), t)
    monkeypatch.setattr(exp, "_LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY", None)
    y[0, :3] = 5
    compare(
        "verl",
        lambda: exp.FusedLinearForPPO(impl_backend="liger").forward,
        h,
        w,
        y,
        0.8,
        grad_of=_both,
        atol=ATOL,
    )


def _unfused(tf, h, w, y, t):
    """verl's unfused path: the logits, scaled, then its per-token functions (unpatched)."""
    logits = (h @ w.t()) / t
    return tf.logprobs_from_logits(logits, y), tf.entropy_from_logits(logits)


def _close_to_unfused(tf, got, h, w, y, t):
    ref = _unfused(tf, h, w, y, t)
    gr = torch.autograd.grad(_both(ref).sum(), (h, w))
    gg = torch.autograd.grad(_both(got).sum(), (h, w))
    for a, b in zip(ref + gr, got + gg):
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_sample", [False, True])
def test_vs_unfused_path(verl, per_sample):
    """Patched fused kernels against verl's unfused path; a per-sample temperature ([batch, 1, 1],
    as `logits / temperature` takes it; verl's own fused kernels refuse a tensor) included."""
    exp, kern, tf = verl
    h, w, y, g = _inputs((3, 17))
    t = torch.rand(3, 1, 1, generator=g) + 0.5 if per_sample else 0.6
    with pki.patched("verl"):
        got = exp.FusedLinearForPPO().forward(h, w, y, t)
        rep = pki.report("verl")["functions"]
        if not per_sample:
            lce = kern.linear_cross_entropy(h, w, y, 0.6, "none")
            _close_to_unfused(tf, tuple(x.view(3, 17) for x in lce), h, w, y, t)
    assert rep[FUSED]["replaced"] == 1
    _close_to_unfused(tf, got, h, w, y, t)


def test_bad_temperature_shape_falls_back(verl):
    exp, _, _ = verl
    h, w, y, _ = _inputs((2, 5))
    with pki.patched("verl"), pytest.raises(pki.Unsupported, match="'temperature'.*vocabulary"):
        exp.FusedLinearForPPO().forward(h, w, y, torch.ones(V))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("shape", [(1, 600), (2, 9)])
def test_triton_backend(verl, reduction, shape):
    """linear_cross_entropy (CUDA-only in verl) patched, against verl's own torch backend (the
    same math): flat [tokens] outputs, float32, the log-probs reduced as asked."""
    exp, kern, _ = verl
    h, w, y, _ = _inputs(shape)
    reduce = {"none": lambda x: x.reshape(-1), "sum": torch.sum, "mean": torch.mean}[reduction]
    ref = exp.FusedLinearForPPO().forward(h, w, y, 0.9)
    ref = reduce(ref[0]), ref[1].reshape(-1)
    with pki.patched("verl"):
        got = kern.linear_cross_entropy(h, w, y, 0.9, reduction)
        rep = pki.report("verl")["functions"][LCE]
    assert rep["replaced"] == 1
    assert got[0].dtype == got[1].dtype == torch.float32 and got[1].shape == (y.numel(),)
    assert got[0].shape == ref[0].shape
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(0.5, 1.5, y.numel())
    grads = [torch.autograd.grad(o[0].sum() + (o[1] * weights).sum(), (h, w)) for o in (ref, got)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_half_precision(verl, dtype):
    """bf16: log-probs float32, entropy in bf16 as verl's torch backend returns them; both within a
    few bf16 units of verl's (the same bf16-rounded logits tiles, float32 reductions)."""
    exp, _, _ = verl
    h, w, y, _ = _inputs((2, 30), dtype=dtype)
    ref = exp.FusedLinearForPPO().forward(h, w, y, 1.0)
    with pki.patched("verl"):
        got = exp.FusedLinearForPPO().forward(h, w, y, 1.0)
    assert (got[0].dtype, got[1].dtype) == (ref[0].dtype, ref[1].dtype) == (torch.float32, dtype)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got[0], ref[0], rtol=4 * eps, atol=4 * eps)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=4 * eps, atol=4 * eps)


def test_autocast(verl):
    """Under autocast verl's `hidden @ weight.T` runs in the autocast dtype: float32 hidden and
    weight give bf16 logits (results in float32 buffers); the patch casts as autocast does."""
    exp, _, _ = verl
    h, w, y, _ = _inputs((2, 30))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = exp.FusedLinearForPPO().forward(h, w, y, 1.0)
        with pki.patched("verl"):
            got = exp.FusedLinearForPPO().forward(h, w, y, 1.0)
    assert got[1].dtype == ref[1].dtype == got[0].dtype == ref[0].dtype == torch.float32
    eps = torch.finfo(torch.bfloat16).eps
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=4 * eps, atol=4 * eps)
    gref = torch.autograd.grad(_both(ref).sum(), (h, w))
    ggot = torch.autograd.grad(_both(got).sum(), (h, w))
    for a, b in zip(gref, ggot):
        assert b.dtype == a.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)  # bf16 gradient tiles


def test_strict_and_fallbacks(verl):
    exp, kern, _ = verl
    h, w, y, _ = _inputs((2, 5))
    with pki.patched("verl"):
        with pytest.raises(pki.Unsupported, match="'input_ids'"):
            exp.FusedLinearForPPO().forward(h, w, y[:, :3], 1.0)
        with pytest.raises(pki.Unsupported, match="'reduction'"):
            kern.linear_cross_entropy(h, w, y, 1.0, "max")
    with pki.patched("verl", strict=False):
        with pytest.raises(AssertionError):  # verl's own check runs: a temperature per vocab id
            kern.linear_cross_entropy(h, w, y, torch.ones(V), "none")
        s = pki.report("verl")["functions"][LCE]
        assert s["fallbacks"] == 1 and "temperature" in next(iter(s["fallback_reasons"]))


# ------------------------------------------------------------------ kl_penalty="full"


def test_kl_penalty_full(verl):
    core = import_peer("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 5, 40, generator=g, requires_grad=True)
    zr = torch.randn(2, 5, 40, generator=g)
    exact = (torch.softmax(z, -1) * (torch.log_softmax(z, -1) - torch.log_softmax(zr, -1))).sum(-1)
    with pytest.raises(NotImplementedError):
        core.kl_penalty(z, zr, "full")  # verl's own
    with pki.patched("verl"):
        kl = core.kl_penalty(z, zr, "full")
        kl2 = core.kl_penalty(torch.log_softmax(z, -1), torch.log_softmax(zr, -1), "full")
        with pytest.raises(ValueError, match=r"\[batch, response_length, vocab\].*full_kl"):
            core.kl_penalty(z[..., 0], zr[..., 0], "full")  # per-token log-probs
        with pytest.raises(pki.Unsupported, match="full\\+"):
            core.kl_penalty(z, zr, "full+")
    with pki.patched("verl", strict=False), pytest.raises(ValueError, match="full_kl"):
        core.kl_penalty(z[..., 0], zr[..., 0], "full")
    torch.testing.assert_close(kl, exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl2, exact, rtol=1e-5, atol=1e-6)
    (ge,) = torch.autograd.grad(exact.sum(), z)
    (gk,) = torch.autograd.grad(kl.sum(), z)
    torch.testing.assert_close(gk, ge, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl, pk.full_kl(z, zr))
