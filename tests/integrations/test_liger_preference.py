"""ppo_kernels.integrations for Liger-Kernel 0.8.x, the preference half: its fused linear DPO, ORPO,
SimPO, CPO and KTO losses (modules, autograd Functions and functional forms), patched vs
unpatched on the same inputs: the loss, every aux output and the gradients of the input, the
weight and the bias within 1e-5 (float32), for every configuration the constructors accept; what
cannot be expressed raises under strict and falls back otherwise."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.integration import compare
from support.peer_stubs import import_peer

import ppo_kernels.integrations as pki

P, T, H, V = 3, 7, 16, 50


@pytest.fixture(scope="module")
def liger():
    mods = {k: import_peer(f"liger_kernel.chunked_loss.{k}_loss")
            for k in ("dpo", "orpo", "simpo", "cpo", "kto")}  # fmt: skip
    mods["functional"] = import_peer("liger_kernel.chunked_loss.functional")
    yield mods
    pki.revert("liger")


def _inputs(seed=0, rows=2 * P, bias=False, dtype=torch.float32):
    """(_input, weight, target, bias, ref_input, ref_weight, ref_bias): prompts ignored (-100),
    completions of different lengths, a reference head near the policy's."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, T, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_(True) if bias else None
    y = torch.randint(0, V, (rows, T), generator=g)
    y[:, :2] = -100
    y[0, -2:] = -100
    y[rows - 1, 4:] = -100
    rh = (h.detach() + 0.2 * torch.randn(rows, T, H, generator=g)).to(dtype)
    rw = (w.detach() + 0.05 * torch.randn(V, H, generator=g)).to(dtype)
    rb = None if b is None else (b.detach() + 0.05).to(dtype)
    return h, w, y, b, rh, rw, rb


def _module(lib, name, **kw):
    kw.setdefault("compiled", False)
    kw.setdefault("chunk_size", 1)
    return lambda: getattr(lib, name)(**kw)


def _replaced(rep, lib, fn):
    s = rep["functions"][f"{lib.__name__}.{fn}"]
    assert s["replaced"] == 1 and s["fallbacks"] == 0, s


DPO_TYPES = ["sigmoid", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
             "apo_zero", "apo_down", "discopop"]  # fmt: skip


@pytest.mark.parametrize("t", DPO_TYPES)
@pytest.mark.parametrize(
    "nll, average, use_ref, bias",
    [(False, False, True, False), (True, True, True, True), (True, False, False, False)],
    ids=lambda c: str(c),
)
def test_dpo(liger, t, nll, average, use_ref, bias):
    lib = liger["dpo"]
    eps = {"exo_pair": 1e-3, "robust": 0.1}.get(t, 0.0)
    h, w, y, b, rh, rw, rb = _inputs(seed=1, bias=bias)
    get = _module(lib, "LigerFusedLinearDPOLoss", beta=0.3, alpha=0.7, compute_nll_loss=nll,
                  average_log_prob=average, use_ref_model=use_ref, loss_type=t,
                  label_smoothing=eps, discopop_tau=0.2)  # fmt: skip
    ref = (rh, rw, rb) if use_ref else (None, None, None)
    _, got, rep = compare("liger", get, w, h, y, b, *ref)
    assert len(got[1]) == 7
    _replaced(rep, lib, "LigerFusedLinearDPOFunction")


@pytest.mark.parametrize("nll, bias", [(False, False), (True, True)])
def test_orpo(liger, nll, bias):
    lib = liger["orpo"]
    h, w, y, b, *_ = _inputs(seed=2, bias=bias)
    get = _module(lib, "LigerFusedLinearORPOLoss", beta=0.25, compute_nll_loss=nll)
    _, got, rep = compare("liger", get, w, h, y, b)
    assert len(got[1]) == 9
    _replaced(rep, lib, "LigerFusedLinearORPOFunction")


@pytest.mark.parametrize(
    "nll, eps, gamma, bias", [(True, 0.0, 0.5, False), (False, 0.1, 0.3, True)], ids=str
)
def test_simpo(liger, nll, eps, gamma, bias):
    lib = liger["simpo"]
    h, w, y, b, *_ = _inputs(seed=3, bias=bias)
    get = _module(lib, "LigerFusedLinearSimPOLoss", beta=0.2, alpha=0.6, label_smoothing=eps,
                  compute_nll_loss=nll, gamma=gamma)  # fmt: skip
    _, _, rep = compare("liger", get, w, h, y, b)
    _replaced(rep, lib, "LigerFusedLinearSimPOFunction")


@pytest.mark.parametrize("nll, average, eps", list(itertools.product([False, True], [False, True], [0.0, 0.05])))  # fmt: skip
def test_cpo(liger, nll, average, eps):
    lib = liger["cpo"]
    h, w, y, b, *_ = _inputs(seed=4, bias=True)
    get = _module(lib, "LigerFusedLinearCPOLoss", beta=0.15, alpha=0.8, label_smoothing=eps,
                  compute_nll_loss=nll, average_log_prob=average)  # fmt: skip
    _, _, rep = compare("liger", get, w, h, y, b)
    _replaced(rep, lib, "LigerFusedLinearCPOFunction")


@pytest.mark.parametrize("use_ref, kl, average", [(True, 0.3, False), (True, None, True),
                                                  (False, None, False), (False, 0.1, True)])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_kto(liger, use_ref, kl, average, bias):
    lib = liger["kto"]
    rows = 5
    h, w, y, b, rh, rw, rb = _inputs(seed=5, rows=rows, bias=bias)
    lab = torch.tensor([True, False, False, True, True])
    get = _module(lib, "LigerFusedLinearKTOLoss", beta=0.2, use_ref_model=use_ref,
                  average_log_prob=average)  # fmt: skip
    ref = (rh, rw, rb) if use_ref else (None, None, None)
    klt = None if kl is None else torch.tensor(kl)
    _, got, rep = compare("liger", get, h, w, y, b, lab, *ref, klt)
    assert len(got[1]) == 6
    _replaced(rep, lib, "LigerFusedLinearKTOFunction")


def test_functional_forms_and_functions(liger):
    """liger_fused_linear_* and Liger*Function.apply, positional as Liger's own tests call them."""
    f = liger["functional"]
    h, w, y, b, rh, rw, rb = _inputs(seed=6, bias=True)
    dpo = (h, w, y, b, rh, rw, rb, -100, 0.1, True, False, True, False, 1, "sigmoid", 0.0, 0.05,
           0.5)  # fmt: skip
    for get in (lambda: f.liger_fused_linear_dpo,
                lambda: liger["dpo"].LigerFusedLinearDPOFunction.apply):  # fmt: skip
        compare("liger", get, *dpo)
    compare("liger", lambda: f.liger_fused_linear_orpo, h, w, y, b, -100, 0.1, True)
    compare("liger", lambda: f.liger_fused_linear_simpo, h, w, y, b, -100, 0.1, 0.5, 0.1, True)
    compare("liger", lambda: f.liger_fused_linear_cpo, h, w, y, b, -100, 0.1, 1.0, 0.0, True)
    lab = torch.tensor([True, False, False, True, True, False])
    compare("liger", lambda: f.liger_fused_linear_kto, h, w, y, lab, b, rh, rw, rb,
            torch.tensor(0.2), -100, 0.1, False, True)  # fmt: skip


def test_bf16_and_a_frozen_head(liger):
    lib = liger["dpo"]
    h, w, y, b, rh, rw, rb = _inputs(seed=7, dtype=torch.bfloat16)
    get = _module(lib, "LigerFusedLinearDPOLoss", beta=0.3)
    # bf16: Liger accumulates its gradients in bf16 chunk by chunk, ours in float32 once
    compare("liger", get, w, h, y, None, rh, rw, rb, rtol=2e-2, atol=2e-2)
    h, w, y, b, rh, rw, rb = _inputs(seed=8)
    compare("liger", get, w.detach(), h, y, None, rh, rw, rb)


FALLBACKS = [
    ("orpo", dict(), dict(nll_target=True), "nll_target"),
    ("dpo", dict(average_log_prob=True), dict(empty_row=True), "average_log_prob"),
    ("dpo", dict(compute_nll_loss=True), dict(no_chosen=True), "compute_nll_loss"),
    ("kto", dict(), dict(kl_rows=True), "kl"),
]


@pytest.mark.parametrize("loss,kw,data,arg", FALLBACKS, ids=lambda c: str(c))
def test_fallbacks(liger, loss, kw, data, arg):
    """What our op cannot express: strict raises Unsupported naming the argument; strict=False
    runs Liger's own code (the same numbers) and counts the reason in report."""
    lib = liger[loss]
    rows = 5 if loss == "kto" else 2 * P
    h, w, y, b, rh, rw, rb = _inputs(seed=9, rows=rows)
    if data.get("empty_row"):
        y[1] = -100
    if data.get("no_chosen"):
        y[:P] = -100
    name = {"orpo": "ORPO", "dpo": "DPO", "kto": "KTO"}[loss]
    get = _module(lib, f"LigerFusedLinear{name}Loss", **kw)
    if loss == "orpo":
        args, extra = (w, h, y, None), dict(nll_target=y.clone())
    elif loss == "dpo":
        args, extra = (w, h, y, None, rh, rw, rb), {}
    else:
        lab = torch.tensor([True, False, True, False, True])
        args, extra = (h, w, y, None, lab), dict(kl=torch.rand(rows))
    with pki.patched("liger"), pytest.raises(pki.Unsupported, match=repr(arg)):
        get()(*args, **extra)
    _, _, rep = compare("liger", get, *args, strict=False, expect_replaced=False, grads=False,
                        **extra)  # fmt: skip
    fn = rep["functions"][f"{lib.__name__}.LigerFusedLinear{name}Function"]
    assert fn["replaced"] == 0 and fn["fallbacks"] == 1
    assert next(iter(fn["fallback_reasons"])).startswith(arg + ":")


def test_report_and_revert(liger):
    originals = {k: getattr(liger[k], f"LigerFusedLinear{n}Function")
                 for k, n in (("dpo", "DPO"), ("orpo", "ORPO"), ("simpo", "SimPO"), ("cpo", "CPO"),
                              ("kto", "KTO"))}  # fmt: skip
    rep = pki.apply("liger")
    try:
        f = liger["functional"]
        for k, orig in originals.items():
            name = orig.__name__
            assert f"{liger[k].__name__}.{name}" in rep["functions"]
            assert f"{f.__name__}.liger_fused_linear_{k}" in rep["functions"]
            assert getattr(liger[k], name) is not orig
            assert getattr(f, name) is getattr(liger[k], name)
    finally:
        pki.revert("liger")
    for k, orig in originals.items():
        assert getattr(liger[k], orig.__name__) is orig
        assert getattr(liger["functional"], orig.__name__) is orig
