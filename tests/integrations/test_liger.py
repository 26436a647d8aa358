"""ppo_kernels.integrations for Liger-Kernel 0.8.x: its fused linear GRPO loss (module, autograd
Function and functional form), patched vs unpatched on the same inputs: the loss, its metrics and
the gradients of the input, the weight and the bias within 1e-5 (float32)."""

from __future__ import annotations

import pytest
import torch
from support.integration import compare
from support.peer_stubs import import_peer

import ppo_kernels.integrations as pki

B, T, H, V = 4, 7, 16, 50


@pytest.fixture(scope="module")
def liger():
    grpo = import_peer("liger_kernel.chunked_loss.grpo_loss")
    functional = import_peer("liger_kernel.chunked_loss.functional")
    yield grpo, functional
    pki.revert("liger")


def _inputs(seed=0, bias=False, dtype=torch.float32, temperature=1.0):
    """(_input, weight, ids, mask, advantages, bias, old, ref): an all-masked row, ignored labels
    (-100) at masked positions, log-ratios spread around 0 (at `temperature`) so that the clip
    bites on some tokens and not on others."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_(True) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    mask[-1] = 0
    ids[mask == 0] = -100
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        z = (h.float() @ w.float().T + (0 if b is None else b.float())) / temperature
        lp = torch.log_softmax(z, -1).gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    return h, w, ids, mask, adv, b, old, ref


def _module(grpo, **kw):
    kw.setdefault("compiled", False)
    kw.setdefault("chunk_size", 2)
    return lambda: grpo.LigerFusedLinearGRPOLoss(**kw)


CASES = [
    ("grpo", "token", {}),
    ("grpo", "sequence", dict(delta=1.5)),
    ("bnpo", "token", dict(delta=1.3, epsilon_high=0.28)),
    ("bnpo", "sequence", {}),
    ("dr_grpo", "token", dict(max_completion_length=11)),
    ("dr_grpo", "sequence", dict(max_completion_length=9)),
    ("dapo", "token", {}),
    ("dapo", "sequence", {}),
    ("cispo", "token", dict(epsilon_high=1.25)),
    ("sapo", "token", dict(sapo_temperature_pos=0.9, sapo_temperature_neg=1.2)),
    ("luspo", "sequence", dict(beta=0.0)),
]


@pytest.mark.parametrize("t,level,kw", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("bias", [False, True])
def test_loss_types(liger, t, level, kw, bias):
    """Every loss type Liger has: loss, (k3 KL mean,) clip fraction, gradients."""
    grpo, _ = liger
    h, w, ids, mask, adv, b, old, ref = _inputs(bias=bias, temperature=0.8)
    kw = dict(dict(beta=0.05, temperature=0.8), **kw)
    get = _module(grpo, loss_type=t, importance_sampling_level=level, **kw)
    _, got, rep = compare(
        "liger", get, h, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old
    )
    assert len(got[1]) == (2 if kw["beta"] else 1)
    fn = rep["functions"][f"{grpo.__name__}.LigerFusedLinearGRPOFunction"]
    assert fn["replaced"] == 1 and fn["fallbacks"] == 0


@pytest.mark.parametrize("t", ["grpo", "dapo", "sapo"])
def test_functional_form_and_function(liger, t):
    """liger_fused_linear_grpo / LigerFusedLinearGRPOFunction.apply, positional as Liger's own
    tests call them: the reference log-probs from the reference head (ref_input, ref_weight,
    ref_bias), a vLLM IS ratio per token."""
    grpo, functional = liger
    h, w, ids, mask, adv, b, old, _ = _inputs(bias=True, seed=1, temperature=0.7)
    g = torch.Generator().manual_seed(5)
    rh = h.detach() + 0.1 * torch.randn(B, T, H, generator=g)
    rw, rb = w.detach() * 0.9, b.detach() + 0.05
    ratio = torch.rand(B, T, generator=g) * 0.9 + 0.1
    args = (h, w, ids, mask, adv, b, None, old, rh, rw, rb, 0.1, 0.2, 0.25, t, None, "token")
    args += (1.0, 1.05, 0.7, False, True, 1, ratio)
    for get in (
        lambda: functional.liger_fused_linear_grpo,
        lambda: grpo.LigerFusedLinearGRPOFunction.apply,
    ):
        _, _, rep = compare("liger", get, *args)
        notes = [n for s in rep["functions"].values() for n in s["notes"]]
        assert any("ref_input" in n for n in notes), rep


@pytest.mark.parametrize("kw", [dict(use_ref_model=False), dict(beta=0.0), {}], ids=str)
def test_no_reference_no_old_logprobs(liger, kw):
    """use_ref_model=False (Liger's KL is then 0 but still reported when beta != 0) and
    old_per_token_logps=None (the ratio is 1: ours takes the current log-probs first)."""
    grpo, _ = liger
    h, w, ids, mask, adv, b, _, ref = _inputs(seed=2)
    get = _module(grpo, loss_type="bnpo", **kw)
    _, got, _ = compare("liger", get, h, w, ids, mask, adv, ref_per_token_logps=ref)
    assert len(got[1]) == (2 if kw.get("beta", 0.04) else 1)


@pytest.mark.parametrize("num_items", [None, 37, "tensor"])
@pytest.mark.parametrize("ratio_shape", [None, (B,), (B, 1)])
def test_dapo_normaliser_and_sequence_ratio(liger, num_items, ratio_shape):
    grpo, _ = liger
    h, w, ids, mask, adv, b, old, ref = _inputs(seed=3)
    n = torch.tensor(41.0) if num_items == "tensor" else num_items
    ratio = None if ratio_shape is None else torch.rand(ratio_shape) + 0.5
    get = _module(grpo, loss_type="dapo")
    compare(
        "liger",
        get,
        h,
        w,
        ids,
        mask,
        adv,
        ref_per_token_logps=ref,
        old_per_token_logps=old,
        vllm_is_ratio=ratio,
        num_items_in_batch=n,
    )


def test_edge_cases(liger):
    """An all-masked batch (every loss 0, no gradient), a float mask, a frozen weight."""
    grpo, _ = liger
    h, w, ids, mask, adv, b, old, ref = _inputs(seed=4)
    for t in ("grpo", "bnpo", "dapo"):
        get = _module(grpo, loss_type=t)
        empty = torch.zeros_like(mask)
        compare(
            "liger", get, h, w, ids, empty, adv, ref_per_token_logps=ref, old_per_token_logps=old
        )
        compare(
            "liger",
            get,
            h,
            w,
            ids,
            mask.float(),
            adv,
            ref_per_token_logps=ref,
            old_per_token_logps=old,
        )
        frozen = w.detach()
        compare(
            "liger",
            get,
            h,
            frozen,
            ids,
            mask,
            adv,
            ref_per_token_logps=ref,
            old_per_token_logps=old,
        )


FALLBACKS = [
    (dict(loss_type="vespo"), "loss_type"),
    (dict(loss_type="grpo", use_bias_correction_kl=True), "use_bias_correction_kl"),
    (dict(loss_type="luspo", beta=0.0), "importance_sampling_level"),
    (dict(loss_type="luspo", importance_sampling_level="sequence"), "beta"),
    (dict(loss_type="grpo", epsilon_low=1.5), "epsilon_low"),
]


@pytest.mark.parametrize("kw,arg", FALLBACKS, ids=lambda c: str(c))
def test_fallbacks(liger, kw, arg):
    """What our op cannot express: strict raises Unsupported naming the argument; strict=False
    runs Liger's own code (the same numbers) and counts the reason in report."""
    grpo, _ = liger
    h, w, ids, mask, adv, b, old, ref = _inputs(seed=5)
    mask[-1, :2] = 1  # vespo's gamma weights need no empty row to stay finite in both runs
    get = _module(grpo, **{"beta": 0.05, **kw})
    call = dict(ref_per_token_logps=ref, old_per_token_logps=old)
    with pki.patched("liger"), pytest.raises(pki.Unsupported, match=repr(arg)):
        get()(h, w, ids, mask, adv, **call)
    _, _, rep = compare(
        "liger", get, h, w, ids, mask, adv, strict=False, expect_replaced=False, **call
    )
    fn = rep["functions"][f"{grpo.__name__}.LigerFusedLinearGRPOFunction"]
    assert fn["replaced"] == 0 and fn["fallbacks"] == 1
    assert next(iter(fn["fallback_reasons"])).startswith(arg + ":")


def test_liger_errors_stay_liger_errors(liger):
    """A configuration Liger refuses falls back, so its own error is what the caller sees."""
    grpo, _ = liger
    h, w, ids, mask, adv, b, old, ref = _inputs(seed=6)
    get = _module(grpo, loss_type="cispo", importance_sampling_level="sequence")
    with pki.patched("liger", strict=False), pytest.raises(ValueError, match="Sequence-level"):
        get()(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)


def test_bfloat16(liger):
    """bf16: the logits GEMMs in the input dtype as Liger's (float32 reductions): within bf16
    rounding of Liger's loss and gradients."""
    grpo, _ = liger
    h, w, ids, mask, adv, b, old, ref = _inputs(seed=7, dtype=torch.bfloat16)
    compare(
        "liger",
        _module(grpo, loss_type="grpo"),
        h,
        w,
        ids,
        mask,
        adv,
        ref_per_token_logps=ref,
        old_per_token_logps=old,
        rtol=2e-2,
        atol=2e-2,
    )


def test_report_and_revert(liger):
    grpo, functional = liger
    original = grpo.LigerFusedLinearGRPOFunction
    rep = pki.apply("liger")
    try:
        assert rep["active"] and rep["version"].startswith("0.8.")
        assert set(rep["functions"]) == {
            f"{grpo.__name__}.LigerFusedLinearGRPOFunction",
            f"{functional.__name__}.liger_fused_linear_grpo",
        }
        assert functional.LigerFusedLinearGRPOFunction is grpo.LigerFusedLinearGRPOFunction
        assert grpo.LigerFusedLinearGRPOFunction is not original
        assert "liger" in pki.format_report("liger")
    finally:
        pki.revert("liger")
    assert grpo.LigerFusedLinearGRPOFunction is original
    assert functional.LigerFusedLinearGRPOFunction is original


def test_float64(liger):
    """float64 input: Liger's log-probs are float32 whatever the input (its loss too); ours
    float64, returned as float32 (dtype="peer"), gradients in the input's dtype."""
    grpo, _ = liger
    h, w, ids, mask, adv, b, old, ref = _inputs(seed=8, bias=True, dtype=torch.float64)
    compare(
        "liger",
        _module(grpo, loss_type="dapo"),
        h,
        w,
        ids,
        mask,
        adv,
        b,
        ref_per_token_logps=ref,
        old_per_token_logps=old,
    )
