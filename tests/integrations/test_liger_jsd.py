"""ppo_kernels.integrations for Liger-Kernel 0.8.x, distillation: its fused linear JSD loss
(module, autograd Function and functional form) patched vs unpatched on the same inputs -- the
loss (and its soft / hard terms), the gradients of the student's input, weight and bias within
1e-5 (float32) -- for every configuration its constructor accepts, that `report()` shows our op
ran, and what it cannot express raising under strict and falling back otherwise."""

from __future__ import annotations

import pytest
import torch
from support.integration import compare
from support.peer_stubs import import_peer

import ppo_kernels.integrations as pki

N, H, HT, V = 14, 16, 12, 50


@pytest.fixture(scope="module")
def liger():
    jsd = import_peer("liger_kernel.chunked_loss.jsd_loss")
    functional = import_peer("liger_kernel.chunked_loss.functional")
    yield jsd, functional
    pki.revert("liger")


def _inputs(seed=0, bias=False, dtype=torch.float32, shape=(N,), ignore=-100, tv=V):
    """(student_input, student_weight, teacher_input, teacher_weight, labels, student_bias,
    teacher_bias): the teacher near the student on a part of the vocabulary, two ignored labels."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.4).to(dtype).requires_grad_(True)
    th = torch.randn(*shape, HT, generator=g).to(dtype)
    tw = (torch.randn(tv, HT, generator=g) * 0.4).to(dtype)
    labels = torch.randint(0, V, shape, generator=g)
    labels.view(-1)[[1, 5]] = ignore
    sb = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_(True) if bias else None
    tb = (torch.randn(tv, generator=g) * 0.3).to(dtype) if bias else None
    return h, w, th, tw, labels, sb, tb


def _module(jsd, **kw):
    kw.setdefault("compiled", False)
    return lambda: jsd.LigerFusedLinearJSDLoss(**kw)


# every constructor option: weights (one term alone, both, scaled), beta (the two KLs and
# jsd), ignore_index, temperature, chunk_size, return_soft_hard_loss
CONFIGS = [
    {},
    dict(beta=0.0),
    dict(beta=1.0),
    dict(beta=0.3, temperature=0.7),
    dict(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.8),
    dict(weight_hard_loss=1.0, weight_soft_loss=0.0, temperature=2.0),
    dict(weight_hard_loss=0.2, weight_soft_loss=1.7, return_soft_hard_loss=True),
    dict(ignore_index=-1, chunk_size=3, beta=0.0, temperature=1.5, return_soft_hard_loss=True),
    dict(chunk_size=4, beta=1.0, temperature=0.5, return_soft_hard_loss=True),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_every_configuration(liger, kw, bias):
    jsd, _ = liger
    h, w, th, tw, labels, sb, tb = _inputs(bias=bias, ignore=kw.get("ignore_index", -100))
    _, got, rep = compare("liger", _module(jsd, **kw), h, w, th, tw, labels, sb, tb)
    if kw.get("return_soft_hard_loss"):
        assert isinstance(got, tuple) and len(got) == 3
    fn = rep["functions"][f"{jsd.__name__}.LigerFusedLinearJSDFunction"]
    assert fn["replaced"] == 1 and fn["fallbacks"] == 0


def test_batched_input_and_compiled_flag(liger):
    """[B, T, H] inputs with [B, T] labels, as Liger takes them; compiled=True only changes how
    Liger computes (the patched call runs our op)."""
    jsd, _ = liger
    h, w, th, tw, labels, sb, tb = _inputs(shape=(2, 7), bias=True)
    compare("liger", _module(jsd, beta=0.4, compiled=False), h, w, th, tw, labels, sb, tb)
    with pki.patched("liger"):
        a = jsd.LigerFusedLinearJSDLoss(compiled=True)(h, w, th, tw, labels, sb, tb)
        rep = pki.report("liger")
    b = jsd.LigerFusedLinearJSDLoss(compiled=False)(h, w, th, tw, labels, sb, tb)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert rep["functions"][f"{jsd.__name__}.LigerFusedLinearJSDFunction"]["replaced"] == 1


def test_function_and_functional_forms(liger):
    jsd, functional = liger
    h, w, th, tw, labels, sb, tb = _inputs(bias=True)
    args = (h, w, th, tw, labels, sb, tb, 0.3, 0.9, 0.25, -100, 0.8, False, 5, True)
    compare("liger", lambda: jsd.LigerFusedLinearJSDFunction.apply, *args)
    _, _, rep = compare("liger", lambda: functional.liger_fused_linear_jsd, *args)
    assert rep["functions"][f"{functional.__name__}.liger_fused_linear_jsd"]["replaced"] == 1


def test_backward_with_an_upstream_gradient(liger):
    """Liger scales its saved gradients by the upstream gradient: so do we."""
    jsd, _ = liger
    h, w, th, tw, labels, sb, tb = _inputs()
    compare("liger", _module(jsd, beta=0.6), h, w, th, tw, labels, grad_of=lambda o: 3.0 * o)


@pytest.mark.parametrize(
    "change, argument",
    [
        (dict(tv=V + 3), "teacher_weight"),  # Liger pads the student's logits with zeros
        (dict(teacher_dtype=torch.float64), "teacher_input"),
        (dict(temperature=-1.0), "temperature"),
        (dict(beta=1.5), "beta"),
        (dict(weight_soft_loss=float("inf")), "weight_soft_loss"),
    ],
)
def test_inexpressible_raises_under_strict_and_falls_back(liger, change, argument):
    jsd, _ = liger
    change = dict(change)
    tv = change.pop("tv", V)
    tdt = change.pop("teacher_dtype", None)
    h, w, th, tw, labels, _, _ = _inputs(tv=tv)
    if tdt is not None:
        th, tw = th.to(tdt), tw.to(tdt)
    get = _module(jsd, **change)
    with pki.patched("liger", strict=True):
        with pytest.raises(pki.Unsupported, match=argument):
            get()(h, w, th, tw, labels)
    got = err = None
    with pki.patched("liger", strict=False):
        try:
            got = get()(h, w, th, tw, labels)
        except Exception as e:  # noqa: BLE001 -- the original's own error, compared below
            err = e
        rep = pki.report("liger")
    fn = rep["functions"][f"{jsd.__name__}.LigerFusedLinearJSDFunction"]
    assert fn["fallbacks"] == 1 and fn["replaced"] == 0
    assert any(argument in r for r in fn["fallback_reasons"])
    if err is not None:  # unpatched, the same error
        with pytest.raises(type(err)):
            get()(h, w, th, tw, labels)
    else:
        want = get()(h, w, th, tw, labels)
        torch.testing.assert_close(got, want, equal_nan=True)


def test_bf16_runs_our_op_with_a_note(liger):
    """bf16 heads: our op with the GEMMs in bf16 (as Liger's) and the softmax math in float32
    (Liger's soft loss runs in bf16): close to Liger's, noted in the report."""
    jsd, _ = liger
    h, w, th, tw, labels, sb, tb = _inputs(dtype=torch.bfloat16, bias=True)
    want = jsd.LigerFusedLinearJSDLoss(compiled=False)(h, w, th, tw, labels, sb, tb)
    with pki.patched("liger"):
        got = jsd.LigerFusedLinearJSDLoss(compiled=False)(h, w, th, tw, labels, sb, tb)
        rep = pki.report("liger")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    fn = rep["functions"][f"{jsd.__name__}.LigerFusedLinearJSDFunction"]
    assert fn["replaced"] == 1 and fn["notes"]


def test_report_and_revert(liger):
    jsd, functional = liger
    original = jsd.LigerFusedLinearJSDFunction
    rep = pki.apply("liger")
    try:
        assert {
            f"{jsd.__name__}.LigerFusedLinearJSDFunction",
            f"{functional.__name__}.liger_fused_linear_jsd",
        } <= set(rep["functions"])
        assert functional.LigerFusedLinearJSDFunction is jsd.LigerFusedLinearJSDFunction
        assert jsd.LigerFusedLinearJSDFunction is not original
    finally:
        pki.revert("liger")
    assert jsd.LigerFusedLinearJSDFunction is original
    assert functional.LigerFusedLinearJSDFunction is original
