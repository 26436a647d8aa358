"""ppo_policy_loss, ppo_value_loss, reward_model_loss and dpo_loss on every backend available for CPU
tensors here (cpp, Triton through the interpreter, eager), against float64 compositions written
from verl's / TRL's documented semantics, against verl's real functions where its source is
available (tests/support/peers.py), and through opcheck, gradcheck and torch.compile."""

import math

import pytest
import torch
from support.peers import Config, load_verl
from support.utils import PassThroughMode, cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.losses import api as loss_api

BACKENDS = cpu_backends("ppo_policy_loss")
VBACKENDS = cpu_backends("ppo_value_loss")
AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
DTYPES = [torch.float32, torch.bfloat16]
# float32 kernels against the float64 composition on dtype-rounded inputs
LOSS_TOL = dict(atol=2e-6, rtol=2e-5)
GRAD_TOL = {
    torch.float32: dict(atol=1e-7, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-7, rtol=8e-3),
    torch.float16: dict(atol=1e-7, rtol=1e-3),
}


# ----------------------------------------------------------------------------- literal semantics
# Written from verl's documented semantics (core_algos.agg_loss / compute_policy_loss_vanilla /
# compute_value_loss), in float64, except that an empty denominator gives 0 (verl: NaN).
def lit_agg(
    loss_mat,
    mask,
    mode,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    m = mask.to(loss_mat.dtype)
    masked = torch.where(m != 0, loss_mat, 0.0) * m
    if mode == "token-mean":
        n = (
            m.sum()
            if batch_num_tokens is None
            else torch.as_tensor(batch_num_tokens, dtype=m.dtype)
        )
        return torch.where(n != 0, masked.sum() / n * dp_size, 0.0)
    row_n = m.sum(-1)
    nonempty = row_n > 0
    s = (
        nonempty.sum().to(m.dtype)
        if global_batch_size is None
        else torch.as_tensor(global_batch_size, dtype=m.dtype)
    )
    seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        seq = torch.where(nonempty, seq / torch.where(nonempty, row_n, 1.0), 0.0)
    loss = torch.where(s != 0, torch.where(nonempty, seq, 0.0).sum() / s * dp_size, 0.0)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def lit_masked_mean(x, m):
    m = m.to(x.dtype)
    n = m.sum()
    return torch.where(
        n != 0, (torch.where(m != 0, x, 0.0) * m).sum() / torch.where(n != 0, n, 1.0), 0.0
    )


def lit_policy(
    lp,
    old,
    adv,
    mask,
    clip_low=0.2,
    clip_high=None,
    dual=None,
    agg="token-mean",
    lrc=20.0,
    w=None,
    **kw,
):
    clip_high = clip_low if clip_high is None else clip_high
    d = torch.clamp(lp - old, -lrc, lrc)
    r = torch.exp(d)
    pg1 = -adv * r
    pg2 = -adv * torch.clamp(r, 1 - clip_low, 1 + clip_high)
    c1 = torch.maximum(pg1, pg2)
    if dual is not None:
        pg3 = -adv * dual
        pg = torch.where(adv < 0, torch.min(pg3, c1), c1)
        lower = lit_masked_mean(((c1 > pg3) & (adv < 0)).to(lp.dtype), mask)
    else:
        pg = c1
        lower = torch.zeros((), dtype=lp.dtype)
    stats = dict(
        clip_frac=lit_masked_mean((pg2 > pg1).to(lp.dtype), mask),
        clip_frac_lower=lower,
        approx_kl=lit_masked_mean(-d, mask),
        ratio_mean=lit_masked_mean(r, mask),
    )
    return lit_agg(pg if w is None else pg * w, mask, agg, **kw), stats


def lit_value(v, vo, ret, mask, clip=None, agg="token-mean", **kw):
    l1 = (v - ret) ** 2
    if clip is None:
        return 0.5 * lit_agg(l1, mask, agg, **kw), dict(clip_frac=torch.zeros((), dtype=v.dtype))
    vc = torch.max(torch.min(v, vo + clip), vo - clip)
    l2 = (vc - ret) ** 2
    return (
        0.5 * lit_agg(torch.max(l1, l2), mask, agg, **kw),
        dict(clip_frac=lit_masked_mean((l2 > l1).to(v.dtype), mask)),
    )


def _inputs(B=5, T=37, dtype=torch.float32, spread=0.4, empty_row=True, mask_dtype=torch.bool):
    lp = (-torch.rand(B, T) * 3).to(dtype)
    old = (lp.float() + torch.randn(B, T) * spread).to(dtype)
    adv = torch.randn(B, T).to(dtype)
    mask = torch.rand(B, T) > 0.3
    if empty_row:
        mask[1] = False
    return lp, old, adv, mask.to(mask_dtype)


def _ref_policy(lp, old, adv, mask, **kw):
    x = lp.double().requires_grad_(True)
    loss, stats = lit_policy(x, old.double(), adv.double(), mask, **kw)
    loss.backward()
    return loss.detach(), stats, x.grad


def _run_policy(backend, lp, old, adv, mask, **kw):
    x = lp.clone().requires_grad_(True)
    with use_backend(ppo_policy_loss=backend), poisoned():
        loss, stats = pk.ppo_policy_loss(x, old, adv, mask, **kw)
        loss.backward()
    return loss, stats, x.grad


def _check_policy(backend, lp, old, adv, mask, grad_tol=None, **kw):
    """kw in the literal reference's names (dual, lrc, batch_num_tokens, ...)."""
    rename = {
        "dual": "dual_clip",
        "lrc": "log_ratio_clamp",
        "batch_num_tokens": "global_num_tokens",
    }
    api_kw = {rename.get(k, k): v for k, v in kw.items()}
    loss, stats, grad = _run_policy(backend, lp, old, adv, mask, **api_kw)
    rloss, rstats, rgrad = _ref_policy(lp, old, adv, mask, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), rloss, **LOSS_TOL)
    for k in rstats:
        torch.testing.assert_close(stats[k].double(), rstats[k], **LOSS_TOL, msg=f"stat {k}")
    assert grad.dtype == lp.dtype
    torch.testing.assert_close(
        grad.double(), rgrad.to(lp.dtype).double(), **(grad_tol or GRAD_TOL[lp.dtype])
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_matches_reference(backend, agg, dtype, dual):
    lp, old, adv, mask = _inputs(dtype=dtype)
    _check_policy(backend, lp, old, adv, mask, agg=agg, dual=dual, clip_low=0.2, clip_high=0.28)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_long_rows_and_mask_dtypes(backend):
    """Rows longer than one chunk (C++ 1024, Triton 1024 tokens), float16 input, every mask dtype."""
    lp, old, adv, mask = _inputs(B=2, T=2500, dtype=torch.float16)
    for mdt in (torch.bool, torch.int64, torch.float32, torch.uint8):
        _check_policy(backend, lp, old, adv, mask.to(mdt), agg="seq-mean-token-mean", dual=3.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_float_mask_weights(backend):
    lp, old, adv, mask = _inputs()
    w = mask.float() * torch.rand(mask.shape)
    for agg in ("token-mean", "seq-mean-token-mean"):
        _check_policy(backend, lp, old, adv, w, agg=agg)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", AGGS)
def test_policy_loss_all_zero_mask(backend, agg):
    """Documented: loss 0, stats 0, gradient 0 -- not NaN (verl gives 0/0 = NaN)."""
    lp, old, adv, mask = _inputs()
    mask = torch.zeros_like(mask)
    loss, stats, grad = _run_policy(backend, lp, old, adv, mask, agg=agg, dual_clip=3.0)
    assert float(loss.detach()) == 0.0
    assert all(float(v) == 0.0 for v in stats.values())
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_extreme_log_ratios(backend):
    """|log-ratio| > 30 is clamped to 20 (verl): finite loss, no gradient through the clamp."""
    lp, old, adv, mask = _inputs()
    old[:, ::3] = lp[:, ::3] - 35.0
    old[:, 1::3] = lp[:, 1::3] + 45.0
    loss, stats, grad = _run_policy(backend, lp, old, adv, mask, dual_clip=3.0)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[:, ::3], torch.zeros_like(grad[:, ::3]))
    _check_policy(backend, lp, old, adv, mask, dual=3.0)
    # exactly at the clamp (lp on a 1/8 grid, so lp - old == +-20 exactly in float32 too): the
    # documented convention (torch 2.14's scalar clamp) passes no gradient there
    lp8 = torch.round(lp * 8) / 8
    for old8 in (lp8 - 20.0, lp8 + 20.0):
        loss, _, grad = _run_policy(backend, lp8, old8, adv, mask)
        assert torch.isfinite(loss) and torch.equal(grad, torch.zeros_like(grad))
        rloss, _ = lit_policy(lp8.double(), old8.double(), adv.double(), mask)
        torch.testing.assert_close(loss.double(), rloss, **LOSS_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_ignores_nan_outside_mask(backend):
    lp, old, adv, mask = _inputs()
    lp2, old2, adv2 = lp.clone(), old.clone(), adv.clone()
    for t in (lp2, old2, adv2):
        t[~mask] = float("nan")
    a = _run_policy(backend, lp, old, adv, mask, agg="seq-mean-token-sum", dual_clip=3.0)
    b = _run_policy(backend, lp2, old2, adv2, mask, agg="seq-mean-token-sum", dual_clip=3.0)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    assert torch.equal(b[2][~mask], torch.zeros_like(b[2][~mask]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_ties_like_autograd(backend):
    """Exact ties that happen in practice: ratio == 1 (on-policy first epoch: -A * rho equals the
    clipped branch) and A == 0 (GRPO groups of equal scores). torch gives each side of a
    torch.maximum / torch.minimum tie half of the gradient; the kernels agree."""
    lp, old, adv, mask = _inputs(B=3, T=20)
    old[0] = lp[0]  # ratio exactly 1
    adv[1] = 0.0  # A exactly 0
    adv[2, ::2] = -adv[2, ::2].abs()
    for dual in (None, 3.0):
        _check_policy(backend, lp, old, adv, mask, dual=dual)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_global_denominators(backend):
    lp, old, adv, mask = _inputs()
    n_tok, n_seq = 123.0, 7.0
    _check_policy(backend, lp, old, adv, mask, agg="token-mean", dp_size=4, batch_num_tokens=n_tok)
    for agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        _check_policy(backend, lp, old, adv, mask, agg=agg, dp_size=2, global_batch_size=n_seq)
    _check_policy(
        backend,
        lp,
        old,
        adv,
        mask,
        agg="seq-mean-token-sum-norm",
        dp_size=2,
        global_batch_size=n_seq,
        loss_scale_factor=4096,
    )
    # a 0-dim tensor denominator (an all-reduced count: no host sync) gives the same result
    a = _run_policy(
        backend, lp, old, adv, mask, agg="token-mean", dp_size=4, global_num_tokens=n_tok
    )
    b = _run_policy(
        backend,
        lp,
        old,
        adv,
        mask,
        agg="token-mean",
        dp_size=4,
        global_num_tokens=torch.tensor(n_tok),
    )
    c = _run_policy(
        backend,
        lp,
        old,
        adv,
        mask,
        agg="token-mean",
        dp_size=4,
        global_num_tokens=torch.tensor(int(n_tok)),
    )
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[0], c[0])
    torch.testing.assert_close(a[2], b[2])
    z = _run_policy(
        backend, lp, old, adv, mask, agg="token-mean", global_num_tokens=torch.tensor(0.0)
    )
    assert float(z[0].detach()) == 0.0 and torch.equal(z[2], torch.zeros_like(z[2]))


def test_policy_loss_leading_dims_and_1d():
    lp, old, adv, mask = _inputs(B=6, T=11)
    a, sa = pk.ppo_policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean")
    b, sb = pk.ppo_policy_loss(
        lp.view(2, 3, 11),
        old.view(2, 3, 11),
        adv.view(2, 3, 11),
        mask.view(2, 3, 11),
        agg="seq-mean-token-mean",
    )
    torch.testing.assert_close(a, b)
    one, _ = pk.ppo_policy_loss(lp[0], old[0], adv[0], mask[0])
    ref, _ = lit_policy(lp[0:1].double(), old[0:1].double(), adv[0:1].double(), mask[0:1])
    torch.testing.assert_close(one.double(), ref, **LOSS_TOL)


def test_policy_loss_argument_errors():
    lp, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="old_logprobs"):
        pk.ppo_policy_loss(lp, old[:, 1:], adv, mask)
    with pytest.raises(ValueError, match="mask"):
        pk.ppo_policy_loss(lp, old, adv, mask[:, 1:])
    with pytest.raises(TypeError, match="advantages"):
        pk.ppo_policy_loss(lp, old, adv.long(), mask)
    with pytest.raises(ValueError, match="agg"):
        pk.ppo_policy_loss(lp, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="dual_clip"):
        pk.ppo_policy_loss(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="global_num_tokens"):
        pk.ppo_policy_loss(lp, old, adv, mask, dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        pk.ppo_policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum", dp_size=2)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        pk.ppo_policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match="empty"):
        pk.ppo_policy_loss(lp, old, adv, mask, empty="inf")
    with pytest.raises(ValueError, match="approx_kl"):
        pk.ppo_policy_loss(lp, old, adv, mask, approx_kl="k3")
    with pytest.raises(ValueError, match="clip_low"):
        pk.ppo_policy_loss(lp, old, adv, mask, clip_low=1.5)


# ----------------------------------------------------------------------------- value loss
def _run_value(backend, v, vo, ret, mask, **kw):
    x = v.clone().requires_grad_(True)
    with use_backend(ppo_value_loss=backend), poisoned():
        loss, stats = pk.ppo_value_loss(x, vo, ret, mask, **kw)
        loss.backward()
    return loss, stats, x.grad


def _check_value(backend, v, vo, ret, mask, **kw):
    loss, stats, grad = _run_value(backend, v, vo, ret, mask, **kw)
    lkw = dict(kw)
    if "global_num_tokens" in lkw:
        lkw["batch_num_tokens"] = lkw.pop("global_num_tokens")
    x = v.double().requires_grad_(True)
    rloss, rstats = lit_value(x, vo.double(), ret.double(), mask, **lkw)
    rloss.backward()
    torch.testing.assert_close(loss.double(), rloss.detach(), **LOSS_TOL)
    torch.testing.assert_close(stats["clip_frac"].double(), rstats["clip_frac"], **LOSS_TOL)
    torch.testing.assert_close(grad.double(), x.grad.to(v.dtype).double(), **GRAD_TOL[v.dtype])


def _value_inputs(B=5, T=37, dtype=torch.float32):
    vo = torch.randn(B, T)
    v = (vo + torch.randn(B, T) * 0.3).to(dtype)
    ret = (vo + torch.randn(B, T)).to(dtype)
    mask = torch.rand(B, T) > 0.3
    mask[B // 2] = False
    return v, vo.to(dtype), ret, mask


@pytest.mark.parametrize("backend", VBACKENDS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_reference(backend, agg, dtype, clip):
    _check_value(backend, *_value_inputs(dtype=dtype), agg=agg, clip=clip)


@pytest.mark.parametrize("backend", VBACKENDS)
def test_value_loss_edges(backend):
    v, vo, ret, mask = _value_inputs(B=2, T=2100)
    _check_value(
        backend, v, vo, ret, mask, clip=0.1, agg="token-mean", dp_size=3, global_num_tokens=999
    )
    # v exactly on the clip bounds (a 1/8 grid: exact in float32 and float64): torch.min / max ties
    vo = torch.round(vo * 8) / 8
    v2 = vo.clone()
    v2[:, ::2] = vo[:, ::2] + 0.25
    v2[:, 1::2] = vo[:, 1::2] - 0.25
    _check_value(backend, v2, vo, ret, mask, clip=0.25)
    z = _run_value(backend, v, vo, ret, torch.zeros_like(mask), clip=0.2, agg="seq-mean-token-mean")
    assert float(z[0].detach()) == 0.0 and float(z[1]["clip_frac"]) == 0.0
    assert torch.equal(z[2], torch.zeros_like(z[2]))


# ----------------------------------------------------------------------------- gradcheck, opcheck, compile
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradcheck_float64(agg):
    lp, old, adv, mask = _inputs(B=3, T=9)
    lp, old, adv = lp.double(), old.double(), adv.double()
    x = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: pk.ppo_policy_loss(x, old, adv, mask, agg=agg, dual_clip=2.0, clip_high=0.3)[0],
        (x,),
    )
    v, vo, ret, vmask = _value_inputs(B=3, T=9)
    y = v.double().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda y: pk.ppo_value_loss(y, vo.double(), ret.double(), vmask, clip=0.2, agg=agg)[0], (y,)
    )


def lit_trl_clip_stats(lp, old, adv, mask, clip_low, clip_high, lr_clamp):
    """TRL's / Liger's clip statistics of the registered op, written from their semantics in
    float64: the token fractions below 1 - eps with A < 0 (low), above 1 + eps with A > 0
    (high), either (region) over the mask, and the min / max over the rows with a token of the
    row's low / high fraction (NaN when no row has a token)."""
    m = mask.double()
    keep = m != 0
    r = torch.exp(torch.clamp(lp.double() - old.double(), -lr_clamp, lr_clamp))
    a = adv.double()
    low = ((r < 1 - clip_low) & (a < 0) & keep).double()
    high = ((r > 1 + clip_high) & (a > 0) & keep).double()
    region = ((low + high) > 0).double()
    n = m.sum()

    def mean(x):
        return (x * m).sum() / n if n != 0 else torch.zeros((), dtype=torch.float64)

    rn = m.sum(-1)
    has = rn > 0
    lo_rows, hi_rows = (low * m).sum(-1)[has] / rn[has], (high * m).sum(-1)[has] / rn[has]
    nan = torch.tensor(math.nan, dtype=torch.float64)
    return torch.stack(
        [
            mean(low),
            mean(high),
            mean(region),
            lo_rows.min() if has.any() else nan,
            hi_rows.max() if has.any() else nan,
        ]
    )


@pytest.mark.parametrize(
    "case", ["random", "long_rows", "many_rows", "float_mask", "nan_masked", "all_empty"]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_statistics_include_trl_clip_statistics(backend, case):
    """The registered op's statistics: verl's four (checked through the public API above), then
    TRL's five from the same pass, on every backend: rows that cross the kernels' chunks, more
    rows than the Triton combine's block with the tokens in its last rows, a float mask, NaN /
    inf under the mask, an all-empty mask (means 0, min / max NaN)."""
    torch.manual_seed(3)
    B, T = {"long_rows": (3, 1500), "many_rows": (300, 7)}.get(case, (6, 37))
    lp, old, adv, mask = _inputs(B, T, spread=0.5)
    if case == "many_rows":
        mask[:250] = False
    if case == "float_mask":
        mask = mask.float() * torch.rand(B, T) * 2
    if case == "nan_masked":
        lp[~mask] = math.nan
        old[0, ~mask[0]] = math.inf
    if case == "all_empty":
        mask = torch.zeros_like(mask)
    adv[0, :5] = 0.0  # A = 0 is in neither fraction
    args = (0.2, 0.28, 3.0, 10.0, "seq-mean-token-mean", 1.0, None, None)
    with use_backend(ppo_policy_loss=backend), poisoned():
        _, stats, _ = torch.ops.ppo_kernels.ppo_policy_loss(lp, old, adv, mask, *args)
    assert stats.shape == (9,)
    want = lit_trl_clip_stats(lp, old, adv, mask, 0.2, 0.28, 10.0)
    assert (want[:2] > 0).all() or case == "all_empty"  # both fractions occur
    torch.testing.assert_close(stats[4:].double(), want, atol=1e-6, rtol=1e-6, equal_nan=True)
    if case == "all_empty":
        assert stats[4:7].eq(0).all() and stats[7:].isnan().all()


def _opcheck_args(backend_dtype=torch.float32):
    lp, old, adv, mask = _inputs(B=3, T=13, dtype=backend_dtype)
    return lp.requires_grad_(True), old, adv, mask


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    lp, old, adv, mask = _opcheck_args()
    with use_backend(backend):
        torch.library.opcheck(
            torch.ops.ppo_kernels.ppo_policy_loss.default,
            (lp, old, adv, mask, 0.2, 0.28, 3.0, 20.0, "seq-mean-token-mean", 1.0, None, None),
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.ppo_policy_loss.default,
            (lp, old, adv, mask, 0.2, 0.2, None, 20.0, "token-mean", 2.0, torch.tensor(50.0), None),
        )
        coef = torch.rand(3)
        torch.library.opcheck(
            torch.ops.ppo_kernels.ppo_policy_loss_backward.default,
            (torch.tensor(1.5), lp.detach(), old, adv, mask, coef, 0.2, 0.2, 3.0, 20.0),
        )
        v = lp.detach().clone().requires_grad_(True)
        torch.library.opcheck(
            torch.ops.ppo_kernels.ppo_value_loss.default,
            (v, old, adv, mask, 0.2, "seq-mean-token-sum", 1.0, None, 4.0),
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.ppo_value_loss_backward.default,
            (torch.tensor(1.0), v.detach(), old, adv, mask, coef, 0.2),
        )


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    lp, old, adv, mask = _inputs(B=3, T=17)
    v, vo, ret, _ = _value_inputs(B=3, T=17)

    def step(lp, v):
        pl, st = pk.ppo_policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean", dual_clip=3.0)
        vl, vst = pk.ppo_value_loss(v, vo, ret, mask, clip=0.2)
        return pl + 0.5 * vl, st["clip_frac"], vst["clip_frac"]

    cf = torch.compile(step, fullgraph=True, backend="aot_eager")
    x1, y1 = lp.clone().requires_grad_(True), v.clone().requires_grad_(True)
    x2, y2 = lp.clone().requires_grad_(True), v.clone().requires_grad_(True)
    a = cf(x1, y1)
    b = step(x2, y2)
    a[0].backward()
    b[0].backward()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(y1.grad, y2.grad)


# ----------------------------------------------------------------------------- verl's real code
def _verl_cfg(clip_low, clip_high, c=3.0, **gbi):
    return Config(
        clip_ratio=clip_low,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=c,
        global_batch_info=gbi,
    )


@pytest.mark.parametrize("agg", AGGS)
def test_parity_with_verl_functions(agg):
    verl = load_verl()
    lp, old, adv, mask = _inputs(B=6, T=40, empty_row=False)
    m = mask.float()
    # agg_loss, local and with data-parallel globals
    lm = torch.randn(6, 40, dtype=torch.float64)
    gkw = dict(batch_num_tokens=150) if agg == "token-mean" else dict(global_batch_size=9)
    for kw in (
        {},
        dict(dp_size=4, **gkw),
        dict(loss_scale_factor=512) if agg.endswith("norm") else {},
    ):
        want = verl.agg_loss(lm, m.double(), agg, **kw)
        got = lit_agg(lm, m.double(), agg, **kw)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-7)
    # the vanilla policy loss (verl always applies dual clip, c = 3 by default)
    x = lp.clone().requires_grad_(True)
    want, metrics = verl.compute_policy_loss_vanilla(old, x, adv, m, agg, _verl_cfg(0.2, 0.28))
    want.backward()
    for backend in BACKENDS:
        loss, stats, grad = _run_policy(
            backend, lp, old, adv, m, agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0
        )
        torch.testing.assert_close(loss, want.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(grad, x.grad, atol=1e-8, rtol=1e-5)
        assert float(stats["clip_frac"]) == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
        assert float(stats["clip_frac_lower"]) == pytest.approx(
            metrics["actor/pg_clipfrac_lower"], abs=1e-6
        )
        assert float(stats["approx_kl"]) == pytest.approx(metrics["actor/ppo_kl"], abs=1e-6)
    # with data-parallel normalisation through config.global_batch_info
    gbi = (
        dict(dp_size=2, batch_num_tokens=100)
        if agg == "token-mean"
        else dict(dp_size=2, global_batch_size=11)
    )
    want2, _ = verl.compute_policy_loss_vanilla(old, lp, adv, m, agg, _verl_cfg(0.2, 0.2, **gbi))
    api = dict(global_num_tokens=100) if agg == "token-mean" else dict(global_batch_size=11)
    got2, _ = pk.ppo_policy_loss(lp, old, adv, m, agg=agg, dual_clip=3.0, dp_size=2, **api)
    torch.testing.assert_close(got2, want2, atol=1e-6, rtol=1e-5)
    # the value loss
    v, vo, ret, vmask = _value_inputs(B=6, T=40)
    vm = vmask.float()
    vm[3, 0] = 1.0  # verl's seq modes need every row non-empty for a finite result; keep one token
    y = v.clone().requires_grad_(True)
    wl, wcf = verl.compute_value_loss(y, ret, vo, vm, 0.2, agg)
    wl.backward()
    for backend in VBACKENDS:
        loss, stats, grad = _run_value(backend, v, vo, ret, vm, clip=0.2, agg=agg)
        torch.testing.assert_close(loss, wl.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(stats["clip_frac"], wcf, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(grad, y.grad, atol=1e-8, rtol=1e-5)


# ----------------------------------------------------------------------------- TRL's GRPO loss math
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_grpo_loss_types(loss_type):
    """TRL's GRPOTrainer loss (no log-ratio clamp there; |d| < 20 here) maps onto an agg mode:
    grpo = per-sequence token mean, averaged over ALL B sequences; bnpo = token mean;
    dr_grpo = token sum / (B * max_completion_length); dapo = token sum / (global tokens / processes)."""
    B, T, L, procs, items = 6, 24, 32, 4, 240
    lp, old, adv_seq, mask = _inputs(B=B, T=T)
    adv = adv_seq[:, :1].expand(B, T)  # TRL: one advantage per sequence
    x = lp.double().requires_grad_(True)
    coef1 = torch.exp(x - old.double())
    coef2 = torch.clamp(coef1, 1 - 0.2, 1 + 0.28)
    per_tok = -torch.min(coef1 * adv.double(), coef2 * adv.double())
    m = mask.double()
    want = {
        "grpo": lambda: ((per_tok * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(),
        "bnpo": lambda: (per_tok * m).sum() / m.sum().clamp(min=1.0),
        "dr_grpo": lambda: (per_tok * m).sum() / (B * L),
        "dapo": lambda: (per_tok * m).sum() / (torch.tensor(float(items)) / procs),
    }[loss_type]()
    want.backward()
    kw = {
        "grpo": dict(agg="seq-mean-token-mean", global_batch_size=B),
        "bnpo": dict(agg="token-mean"),
        "dr_grpo": dict(agg="seq-mean-token-sum-norm", global_batch_size=B, loss_scale_factor=L),
        "dapo": dict(agg="token-mean", global_num_tokens=items, dp_size=procs),
    }[loss_type]
    for backend in BACKENDS:
        loss, _, grad = _run_policy(
            backend, lp, old, adv.contiguous(), mask, clip_low=0.2, clip_high=0.28, **kw
        )
        torch.testing.assert_close(loss.double(), want.detach(), **LOSS_TOL)
        torch.testing.assert_close(grad.double(), x.grad, atol=1e-7, rtol=1e-5)


# ----------------------------------------------------------------------------- reward model and DPO
PBACKENDS = cpu_backends("pairwise_logsigmoid_loss")


@pytest.mark.parametrize("backend", PBACKENDS)
def test_reward_model_loss(backend):
    c = torch.randn(64) * 3
    r = torch.randn(64) * 3
    c[:4] = torch.tensor([1000.0, -1000.0, 80.0, -80.0])
    r[:4] = 0.0
    x, y = c.double().requires_grad_(True), r.double().requires_grad_(True)
    d = x - y
    want = torch.log1p(torch.exp(-d.abs())) + torch.clamp(
        -d, min=0
    )  # softplus(-d), stable, float64
    xc, yc = c.clone().requires_grad_(True), r.clone().requires_grad_(True)
    with use_backend(reward_model_loss=backend), poisoned():
        got = pk.reward_model_loss(xc, yc)
        want.mean().backward()
        got.backward()
        per = pk.reward_model_loss(c, r, reduction="none")
        empty = pk.reward_model_loss(c[:0], r[:0])
    torch.testing.assert_close(got.double(), want.mean().detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(xc.grad.double(), x.grad, atol=1e-8, rtol=1e-5)
    torch.testing.assert_close(yc.grad.double(), y.grad, atol=1e-8, rtol=1e-5)
    assert per.shape == (64,) and torch.isfinite(per).all()
    assert float(per[0]) == 0.0 and float(per[1]) == 1000.0
    torch.testing.assert_close(per.double(), want.detach(), atol=1e-6, rtol=1e-6)
    assert float(empty) == 0.0 and empty.shape == ()
    assert torch.autograd.gradcheck(
        lambda a, b: pk.reward_model_loss(a, b, reduction="sum"),
        (x[:8].detach().requires_grad_(True), y[:8].detach().requires_grad_(True)),
    )
    # the checks' fast path lets nothing through: each failure names its argument
    with pytest.raises(TypeError, match="rejected_scores"):
        pk.reward_model_loss(c, r.long())
    with pytest.raises(TypeError, match="chosen_scores"):
        pk.reward_model_loss(c.tolist(), r)
    with pytest.raises(ValueError, match="rejected_scores"):
        pk.reward_model_loss(c, r[:3])
    with pytest.raises(ValueError, match="reduction"):
        pk.reward_model_loss(c, r, reduction="avg")


@pytest.mark.parametrize("backend", PBACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_dpo_loss(backend, reduction):
    n, beta = 32, 0.1
    pw, pl_, rw, rl = (torch.randn(n) * 50 - 200 for _ in range(4))
    pw[0], pl_[0] = 1e4, -1e4  # margin 2e4 * beta: saturated, still finite
    pw[1], pl_[1] = -1e4, 1e4  # the other side: loss 2e3, gradient beta
    ins = [t.double().requires_grad_(True) for t in (pw, pl_, rw, rl)]
    z = beta * ((ins[0] - ins[2]) - (ins[1] - ins[3]))
    want = torch.nn.functional.softplus(-z)
    want = {"mean": want.mean(), "sum": want.sum(), "none": want}[reduction]
    up = torch.randn(n, dtype=torch.float64) if reduction == "none" else torch.tensor(1.7).double()
    (want * up).sum().backward()
    got_ins = [t.clone().requires_grad_(True) for t in (pw, pl_, rw, rl)]
    with use_backend(dpo_loss=backend), poisoned():
        got = pk.dpo_loss(*got_ins, beta=beta, reduction=reduction)
        (got * up.float()).sum().backward()
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-4, rtol=1e-6)
    for g, w in zip(got_ins, ins):
        torch.testing.assert_close(g.grad.double(), w.grad, atol=1e-7, rtol=1e-5)
    with use_backend(dpo_loss=backend):
        per = pk.dpo_loss(pw, pl_, rw, rl, beta=beta, reduction="none")
        assert torch.isfinite(per).all() and float(per[0]) == 0.0
        d64 = [t.double()[:6].detach().requires_grad_(True) for t in (pw, pl_, rw, rl)]
        assert torch.autograd.gradcheck(lambda *a: pk.dpo_loss(*a, beta=0.5), d64)
    with pytest.raises(ValueError, match="beta"):
        pk.dpo_loss(pw, pl_, rw, rl, beta=0.0)
    with pytest.raises(ValueError, match="ref_rejected_lp"):
        pk.dpo_loss(pw, pl_, rw, rl[:3], beta=0.1)


@pytest.mark.parametrize("backend", PBACKENDS)
def test_pairwise_mixed_dtypes_and_frozen_references(backend):
    """bf16 policy log-probs with float32 references: each gradient in its input's dtype, none
    for what does not require grad (the usual frozen reference), the values float32's."""
    g = torch.Generator().manual_seed(3)
    pw, pl_ = (torch.randn(3, 5, generator=g) * 4).bfloat16(), (torch.randn(3, 5, generator=g) * 4)
    rw, rl = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g).half()
    for req in ((True, True, False, False), (False, True, True, True)):
        a = [t.clone().requires_grad_(q) for t, q in zip((pw, pl_, rw, rl), req)]
        w = [t.double().requires_grad_(q) for t, q in zip((pw, pl_, rw, rl), req)]
        with use_backend(dpo_loss=backend), poisoned():
            got = pk.dpo_loss(*a, beta=0.3)
            got.backward()
        want = torch.nn.functional.softplus(-0.3 * ((w[0] - w[2]) - (w[1] - w[3]))).mean()
        want.backward()
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-6, rtol=1e-6)
        for t, r, q in zip(a, w, req):
            if not q:
                assert t.grad is None
                continue
            assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
            tol = 1e-2 if t.dtype in (torch.bfloat16, torch.float16) else 1e-6
            torch.testing.assert_close(t.grad.double(), r.grad, atol=tol * 1e-2, rtol=tol)


def test_pairwise_op_checks_and_opcheck():
    """The registered op checks its own arguments (named as its schema names them) and passes
    torch.library.opcheck on each backend; NaN margins give NaN, infinite ones the limits."""
    op = torch.ops.ppo_kernels.pairwise_logsigmoid_loss
    a, b = torch.randn(6, requires_grad=True), torch.randn(6)
    with pytest.raises(ValueError, match="rejected"):
        op(a, b[:3], None, None, 1.0, "mean")
    with pytest.raises(ValueError, match="ref_chosen, ref_rejected"):
        op(a, b, b, None, 1.0, "mean")
    with pytest.raises(ValueError, match="beta"):
        op(a, b, None, None, float("nan"), "mean")
    with pytest.raises(ValueError, match="reduction"):
        op(a, b, None, None, 1.0, "avg")
    with pytest.raises(TypeError, match="ref_rejected"):
        op(a, b, b, b.long(), 1.0, "mean")
    bwd = torch.ops.ppo_kernels.pairwise_logsigmoid_loss_backward
    with pytest.raises(ValueError, match="grad_loss"):
        bwd(torch.ones(5), torch.ones(6), 1.0, torch.float32, torch.float32)
    for backend in PBACKENDS:
        with use_backend(reward_model_loss=backend):
            for red in ("mean", "sum", "none"):
                torch.library.opcheck(
                    torch.ops.ppo_kernels.pairwise_logsigmoid_loss, (a, b, None, None, 1.0, red)
                )
                torch.library.opcheck(
                    torch.ops.ppo_kernels.pairwise_logsigmoid_loss,
                    (a, b, b * 0.5, b * 2, 0.3, red),
                )
                coef = op(a, b, None, None, 1.0, red)[1]
                g = torch.ones(6) if red == "none" else torch.tensor(2.0)
                torch.library.opcheck(
                    torch.ops.ppo_kernels.pairwise_logsigmoid_loss_backward,
                    (g, coef, 0.5, torch.bfloat16, torch.float32),
                )
            z = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
            loss = op(z, torch.zeros(4), None, None, 1.0, "none")[0]
            assert torch.isnan(loss[0]) and loss[1] == 0 and loss[2] == float("inf")
            assert loss[3].item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("dynamic", [False, True])
def test_pairwise_compile(dynamic):
    """The registered op under torch.compile: its fake kernels trace, gradients included."""
    assert hasattr(torch.ops.ppo_kernels, "pairwise_logsigmoid_loss")
    torch._dynamo.reset()

    def step(a, b, c, d):
        return pk.dpo_loss(a, b, c, d, beta=0.2) + pk.reward_model_loss(a, b, reduction="sum")

    f = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for n in (5, 7):
        a = [torch.randn(n, requires_grad=True) for _ in range(4)]
        b = [t.detach().clone().requires_grad_(True) for t in a]
        got, want = f(*a), step(*b)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        for x, y in zip(a, b):
            torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("refs", [False, True])
def test_pairwise_graph_node_equals_the_function(refs):
    """Plain tensors get the hand-built node (PairwiseLogsigmoidLossBackward), traced ones the
    torch::autograd::Function: the same loss and gradients bit for bit, a retained graph
    differentiated twice alike, only the gradients asked for."""
    import contextlib

    g = torch.Generator().manual_seed(6)
    base = [torch.randn(7, generator=g) * 3 for _ in range(4 if refs else 2)]

    def run(mode):
        leaves = [t.clone().requires_grad_() for t in base]
        with mode:
            loss = (
                pk.dpo_loss(*leaves, beta=0.4)
                if refs
                else pk.reward_model_loss(*leaves, reduction="sum")
            )
            first = torch.autograd.grad(loss, leaves, retain_graph=True)
            second = torch.autograd.grad(loss, leaves)
        return loss, first, second, loss.grad_fn.name()

    plain, traced = run(contextlib.nullcontext()), run(PassThroughMode())
    assert plain[3] == "PairwiseLogsigmoidLossBackward" and traced[3] != plain[3]
    assert torch.equal(plain[0], traced[0])
    for x, y, z in zip(plain[1], traced[1], plain[2]):
        assert torch.equal(x, y) and torch.equal(x, z)
    a, b = [t.clone().requires_grad_() for t in base[:2]]
    (ga,) = torch.autograd.grad(pk.reward_model_loss(a, b), [a])
    both = torch.autograd.grad(pk.reward_model_loss(a, b), [a, b])
    assert b.grad is None and torch.equal(ga, both[0])  # one edge asked for: the same value


def test_module_exports():
    assert loss_api.ppo_policy_loss is pk.ppo_policy_loss


def test_torch_compile_inductor_fullgraph():
    """The fake kernels and autograd under inductor: the loss and its gradient inside a compiled
    training step, with a device-side token count (no host sync)."""
    torch._dynamo.reset()
    lp, old, adv, mask = _inputs(B=4, T=16)
    ntok = mask.sum()

    def step(x):
        loss, st = pk.ppo_policy_loss(
            x * 1.0, old, adv, mask, dual_clip=3.0, global_num_tokens=ntok
        )
        return loss * 2.0, st["approx_kl"] + 0.0

    x1, x2 = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    a = torch.compile(step, fullgraph=True)(x1)
    b = step(x2)
    a[0].backward()
    b[0].backward()
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(x1.grad, x2.grad)


def test_policy_loss_entropy_mean_statistic():
    B, T = 3, 7
    lp, old, adv = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    mask = torch.rand(B, T) > 0.4
    ent = torch.rand(B, T) * 3
    _, stats = pk.ppo_policy_loss(lp, old, adv, mask, entropy=ent)
    want = (ent.double() * mask).sum() / mask.sum()
    torch.testing.assert_close(stats["entropy_mean"].double(), want, atol=1e-6, rtol=1e-6)
    _, stats = pk.ppo_policy_loss(lp, old, adv, mask)
    assert "entropy_mean" not in stats
    with pytest.raises(ValueError, match="entropy"):
        pk.ppo_policy_loss(lp, old, adv, mask, entropy=ent[:, :3])


# ----------------------------------------------------------------------------- masked_aggregate
def _agg64(x, m, agg, dp=1, n_tok=None, n_seq=None, lsf=None):
    """verl's agg_loss written out in float64 (plus token-sum)."""
    x, m = x.double(), m.double()
    s = torch.where(m != 0, x, 0.0) * m
    if agg == "token-mean":
        return s.sum() / (m.sum() if n_tok is None else n_tok) * dp
    if agg == "token-sum":
        return s.sum() * dp
    rows, cnt = s.sum(-1), m.sum(-1)
    S = (cnt > 0).sum() if n_seq is None else n_seq
    if agg == "seq-mean-token-mean":
        rows = torch.where(cnt > 0, rows / cnt.clamp(min=1e-300), 0.0)
    out = rows.sum() / S * dp
    return out / (m.shape[-1] if lsf is None else lsf) if agg.endswith("norm") else out


ABACKENDS = cpu_backends("masked_aggregate")
AGG_ALL = ["token-mean", "token-sum"] + AGGS[1:]


def _agg_inputs(dtype=torch.float32, weighted=True, B=5, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g).to(dtype)
    m = torch.rand(B, T, generator=g) > 0.4
    m[3] = False
    if weighted:
        m = m.float() * torch.rand(B, T, generator=g)
    return x, m


@pytest.mark.parametrize("backend", ABACKENDS)
@pytest.mark.parametrize("agg", AGG_ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_masked_aggregate(backend, agg, dtype, weighted):
    x, m = _agg_inputs(dtype, weighted)
    x_nan = torch.where(m != 0, x, float("nan"))  # masked-out NaN never reach the result
    kw = dict(
        dp_size=2, global_num_tokens=torch.tensor(9.0), global_batch_size=6, loss_scale_factor=3
    )
    for k in ({}, kw, dict(kw, global_num_tokens=9, global_batch_size=torch.tensor(6))):
        xg = x_nan.clone().requires_grad_(True)
        with use_backend(backend), poisoned():
            got = pk.masked_aggregate(xg, m, agg, **k)
            got.backward(torch.tensor(1.5))
        xr = x.double().requires_grad_(True)
        ref = _agg64(
            xr, m, agg, k.get("dp_size", 1), 9.0 if k else None, 6 if k else None, 3 if k else None
        )
        (1.5 * ref).backward()
        assert got.dtype == torch.float32 and got.shape == ()
        torch.testing.assert_close(got.double(), ref, **LOSS_TOL)
        assert xg.grad.dtype == dtype
        torch.testing.assert_close(xg.grad.double(), xr.grad.to(dtype).double(), **GRAD_TOL[dtype])
    with use_backend(backend):
        assert pk.masked_aggregate(x, torch.zeros_like(m), agg).item() == 0.0
        nan = pk.masked_aggregate(x, torch.zeros_like(m), agg, empty="nan")
        assert nan.isnan() if agg != "token-sum" else nan.item() == 0.0
        xg = x_nan.clone().requires_grad_(True)
        with torch.no_grad():  # no graph built: bitwise the value of the call with one
            plain = pk.masked_aggregate(xg, m, agg)
        assert not plain.requires_grad
        assert plain.item() == pk.masked_aggregate(xg, m, agg).item()
    with pytest.raises(ValueError, match="agg"):
        pk.masked_aggregate(x, m, "mean")
    with pytest.raises(ValueError, match="mask"):
        pk.masked_aggregate(x, m[:, 1:], agg)
    with pytest.raises(ValueError, match="empty"):
        pk.masked_aggregate(x, m, agg, empty="inf")


@pytest.mark.parametrize("agg", AGG_ALL)
def test_masked_aggregate_gradcheck(agg):
    x, m = _agg_inputs(torch.float64)
    kw = dict(
        dp_size=2, global_num_tokens=torch.tensor(9.0), global_batch_size=6, loss_scale_factor=3
    )
    xd = x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: pk.masked_aggregate(t, m.double(), agg, **kw), (xd,))


@pytest.mark.parametrize("backend", ABACKENDS)
def test_masked_aggregate_leading_dims_and_rows_of_many_chunks(backend):
    """[..., T] inputs flatten to rows; rows longer than one C++ chunk (1024) and their sums."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 2500, generator=g)
    m = torch.rand(2, 3, 2500, generator=g) > 0.5
    m[1, 2] = False
    for agg in AGG_ALL:
        xg = x.clone().requires_grad_(True)
        with use_backend(backend):
            got = pk.masked_aggregate(xg, m, agg)
            got.backward()
        xr = x.double().reshape(6, -1).requires_grad_(True)
        ref = _agg64(xr, m.reshape(6, -1), agg)
        ref.backward()
        torch.testing.assert_close(got.double(), ref, **LOSS_TOL)
        torch.testing.assert_close(xg.grad.double().reshape(6, -1), xr.grad, **GRAD_TOL[x.dtype])


@pytest.mark.parametrize("backend", ABACKENDS)
def test_masked_aggregate_opcheck(backend):
    x, m = _agg_inputs(weighted=False)
    x.requires_grad_(True)
    with use_backend(backend):
        torch.library.opcheck(
            torch.ops.ppo_kernels.masked_aggregate.default,
            (x, m, "seq-mean-token-mean", 1.0, None, None),
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.masked_aggregate.default,
            (x, m.float(), "token-mean", 2.0, torch.tensor(9.0), None),
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.masked_aggregate_backward.default,
            (torch.tensor(1.5), m, torch.rand(5), torch.bfloat16),
        )


@pytest.mark.parametrize("dynamic", [False, True])
def test_masked_aggregate_compile(dynamic):
    """Traced with its gradient, a device-side global count included."""
    torch._dynamo.reset()

    def step(a, b, n):
        return pk.masked_aggregate(a, b, "seq-mean-token-mean") + pk.masked_aggregate(
            a, b, "token-mean", dp_size=2, global_num_tokens=n
        )

    f = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for T in (4, 6):
        x, m = torch.randn(3, T, requires_grad=True), torch.rand(3, T) > 0.3
        y = x.detach().clone().requires_grad_(True)
        n = m.sum() * 2
        got, want = f(x, m, n), step(y, m, n)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("agg", AGGS)
def test_masked_aggregate_graph_node_equals_the_function(agg):
    """Plain tensors get the hand-built node (MaskedAggregateBackward), traced ones the
    torch::autograd::Function: the same loss and gradient bit for bit, twice from a retained
    graph; a mask modified in place after the forward is refused."""
    import contextlib

    g = torch.Generator().manual_seed(7)
    x0, m = torch.randn(3, 8, generator=g), torch.rand(3, 8, generator=g) > 0.3

    def run(mode):
        x = x0.clone().requires_grad_()
        with mode:
            loss = pk.masked_aggregate(x, m, agg)
            first = torch.autograd.grad(loss, x, retain_graph=True)[0]
            second = torch.autograd.grad(loss, x)[0]
        return loss, first, second, loss.grad_fn.name()

    plain, traced = run(contextlib.nullcontext()), run(PassThroughMode())
    assert plain[3] == "MaskedAggregateBackward" and traced[3] != plain[3]
    assert torch.equal(plain[0], traced[0])
    assert torch.equal(plain[1], traced[1]) and torch.equal(plain[1], plain[2])
    x, mm = x0.clone().requires_grad_(), m.clone()
    loss = pk.masked_aggregate(x, mm, agg)
    mm.logical_not_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("agg", AGGS)
def test_per_token_weights(agg):
    """weights (verl's rollout IS weights) multiply each token's loss; denominators and stats
    stay the mask's."""
    g = torch.Generator().manual_seed(4)
    B, T = 4, 9
    lp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5 - 1
    old = lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[-1] = False
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg)
    x = lp.float().requires_grad_(True)
    loss, st = pk.ppo_policy_loss(x, old.float(), adv.float(), mask, weights=w.float(), **kw)
    xr = lp.clone().requires_grad_(True)
    ref, rst = lit_policy(xr, old, adv, mask, 0.2, 0.28, 3.0, agg, w=w)
    torch.testing.assert_close(loss.double(), ref, **LOSS_TOL)
    for k in rst:
        torch.testing.assert_close(st[k].double(), rst[k], **LOSS_TOL)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-7, rtol=1e-5)
    # weights of one are the unweighted fused kernel
    one, _ = pk.ppo_policy_loss(lp.float(), old.float(), adv.float(), mask, **kw)
    torch.testing.assert_close(
        pk.ppo_policy_loss(
            lp.float(), old.float(), adv.float(), mask, weights=torch.ones(B, T), **kw
        )[0],
        one,
    )
    v = torch.randn(B, T, generator=g, requires_grad=True)
    lv, _ = pk.ppo_value_loss(
        v, v.detach() + 0.1, adv.float(), mask, clip=0.05, agg=agg, weights=w.float()
    )
    vd, vo = v.detach().double(), v.detach().double() + 0.1
    vc = torch.max(torch.min(vd, vo + 0.05), vo - 0.05)
    per_token = 0.5 * torch.maximum((vd - adv) ** 2, (vc - adv) ** 2)
    torch.testing.assert_close(lv.double(), lit_agg(per_token * w, mask, agg), **LOSS_TOL)
    with pytest.raises(ValueError, match="weights"):
        pk.ppo_policy_loss(lp.float(), old.float(), adv.float(), mask, weights=w[:, 1:].float())
