"""kl_penalty and kl_penalized_rewards against float64 references written from the formulas
(ppo_kernels/kl/naive.py), the peers' literal semantics, and the peers' own functions when
their source is available."""

import math
import typing

import pytest
import torch
from support.peers import load_functions
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import KLClamp, kl_penalized_rewards, kl_penalty, use_backend
from ppo_kernels.kl import naive as R

BACKENDS = cpu_backends("kl_penalty")
ESTIMATORS = ["k1", "abs", "k2", "k3", "k1+", "k3+", "low_var_kl", "mse+"]
CLAMPS = ["none", "verl", "openrlhf", KLClamp(log_ratio=(-3.0, None), value=(None, 2.5))]
# float32 kernels against the float64 formulas on the same (rounded) inputs
VTOL = dict(atol=2e-6, rtol=2e-5)  # d = lp - ref rounds to float32: exp amplifies it
GTOL = dict(atol=2e-6, rtol=2e-5)


def _pairs(n=700, dtype=torch.float32):
    """logprobs / ref_logprobs whose log-ratios cover tiny, typical, clamp-crossing and extreme
    (|d| > 30) values."""
    lp = -torch.rand(n) * 8
    d = torch.cat(
        [
            torch.randn(n // 4) * 1e-3,
            torch.randn(n // 4),
            torch.randn(n // 4) * 12,
            torch.empty(n - 3 * (n // 4)).uniform_(-60, 60),
        ]
    )
    d = d[torch.randperm(n)]
    return lp.to(dtype), (lp - d).to(dtype)


def _ref(lp, ref, estimator, clamp):
    code, st = R.parse_estimator(estimator)
    a = lp.detach().double().requires_grad_()
    b = ref.detach().double().requires_grad_()
    v = R.kl_penalty(a, b, code, st, R.resolve_clamp(clamp, code))
    return v, a, b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("clamp", CLAMPS, ids=["none", "verl", "openrlhf", "custom"])
def test_kl_penalty_matches_float64(backend, estimator, clamp):
    lp, ref = _pairs()
    lp.requires_grad_()
    ref.requires_grad_()
    with use_backend(kl_penalty=backend), poisoned():
        v = kl_penalty(lp, ref, estimator, clamp=clamp)
        g = torch.randn_like(v)
        ga, gb = torch.autograd.grad(v, (lp, ref), g)
    v64, a, b = _ref(lp, ref, estimator, clamp)
    ra, rb = torch.autograd.grad(v64, (a, b), g.double())
    assert v.dtype == torch.float32 and v.shape == lp.shape
    # float32 overflow (k3 at d < -88 with no value clamp) is +inf where float64 is finite
    over = v64 > torch.finfo(torch.float32).max
    assert torch.isinf(v[over]).all()
    torch.testing.assert_close(v[~over].double(), v64[~over].detach(), **VTOL)
    gover = ra.abs() > 1e30
    torch.testing.assert_close(ga[~gover].double(), ra[~gover], **GTOL)
    torch.testing.assert_close(gb[~gover].double(), rb[~gover], **GTOL)
    assert not v.isnan().any() and not ga.isnan().any() and not gb.isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kl_penalty_low_precision_inputs(backend, dtype):
    lp, ref = _pairs(300, dtype)
    lp.requires_grad_()
    with use_backend(kl_penalty=backend), poisoned():
        v = kl_penalty(lp, ref, "k3", clamp="verl")
        (ga,) = torch.autograd.grad(v.sum(), (lp,))
    v64, a, _ = _ref(lp, ref, "k3", "verl")
    (ra,) = torch.autograd.grad(v64.sum(), (a,))
    assert v.dtype == torch.float32 and ga.dtype == dtype
    torch.testing.assert_close(v.double(), v64.detach(), **VTOL)
    torch.testing.assert_close(ga.double(), ra, atol=1e-5, rtol=2**-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty_clamp_gradients_are_zero_where_active(backend):
    d = torch.tensor([-25.0, -20.0, -5.0, 0.0, 1e-4, 5.0, 20.0, 25.0])
    lp = torch.zeros(8, requires_grad=True)
    ref = -d
    with use_backend(kl_penalty=backend):
        v = kl_penalty(lp, ref, "k3", clamp="verl")
        (g,) = torch.autograd.grad(v.sum(), (lp,))
    # |d| >= 20: log-ratio clamp active; d <= -5: k3 > 10, value clamp active
    assert g[[0, 1, 2, 6, 7]].eq(0).all()
    assert v[[0, 1, 2]].eq(10).all()
    # straight-through: the k2 gradient (d itself), clamps or not
    with use_backend(kl_penalty=backend):
        v = kl_penalty(lp, ref, "k3+", clamp="verl")
        (g,) = torch.autograd.grad(v.sum(), (lp,))
    torch.testing.assert_close(g, d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty_tiny_log_ratios_are_accurate(backend):
    d = torch.tensor([1e-6, -1e-5, 3e-4, -2e-3, 0.1, -0.2499, 0.2501])
    lp = torch.full((7,), -1.0)
    with use_backend(kl_penalty=backend):
        v = kl_penalty(lp, lp - d, "k3")
    x = -(lp.double() - (lp - d).double())
    exact = torch.expm1(x) - x
    torch.testing.assert_close(v.double(), exact, atol=0, rtol=1e-5)


def test_kl_penalty_float64_gradcheck():
    lp = (-torch.rand(12, dtype=torch.float64) * 3).requires_grad_()
    ref = (-torch.rand(12, dtype=torch.float64) * 3).requires_grad_()
    for est in ["k1", "abs", "k2", "k3"]:  # "+" variants are not gradients by design
        for clamp in ["none", "verl", KLClamp(log_ratio=(-0.5, 0.5), value=(None, 0.1))]:
            torch.autograd.gradcheck(lambda a, b: kl_penalty(a, b, est, clamp=clamp), (lp, ref))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty_opcheck(backend):
    lp, ref = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    with use_backend(kl_penalty=backend):
        torch.library.opcheck(
            torch.ops.ppo_kernels.kl_penalty.default,
            (lp, ref, "k3", True, -20.0, 20.0, -10.0, 10.0),
        )
        torch.library.opcheck(
            torch.ops.ppo_kernels.kl_penalty_backward.default,
            (
                torch.randn(3, 5),
                lp.detach(),
                ref.detach(),
                "abs",
                False,
                -math.inf,
                math.inf,
                -10.0,
                10.0,
                True,
                False,
            ),
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty_strided_and_empty(backend):
    x = torch.randn(4, 10)
    with use_backend(kl_penalty=backend):
        v = kl_penalty(x[:, ::2], x[:, 1::2].t().contiguous().t(), "k2")
        e = kl_penalty(torch.empty(0, 3), torch.empty(0, 3), "k3")
    torch.testing.assert_close(v, 0.5 * (x[:, ::2] - x[:, 1::2]) ** 2)
    assert e.shape == (0, 3)


def test_kl_penalty_argument_errors():
    a = torch.randn(3)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(a, a, "k4")
    with pytest.raises(ValueError, match="clamp"):
        kl_penalty(a, a, "k3", clamp="deepspeed")
    with pytest.raises(ValueError, match="clamp"):
        kl_penalty(a, a, "k3", clamp=KLClamp(value=(1.0, -1.0)))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(a, torch.randn(4))
    with pytest.raises(TypeError, match="logprobs"):
        kl_penalty(a.long(), a)


# ------------------------------------------------------------------------------------------------
# kl_penalized_rewards


def _rewards_ref(scores, lp, ref, mask, beta, estimator, clamp):
    """float64, written as the per-row loop of the definition."""
    code, _ = R.parse_estimator(estimator)
    B, T = lp.shape
    v = R.kl_penalty(lp.double(), ref.double(), code, False, R.resolve_clamp(clamp, code))
    m = mask.double()
    betas = (
        beta.double().expand(B)
        if isinstance(beta, torch.Tensor)
        else torch.full((B,), float(beta)).double()
    )
    rew = torch.zeros(B, T, dtype=torch.float64)
    kl = torch.zeros(B, T, dtype=torch.float64)
    mean = torch.zeros(B, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if m[b, t] != 0]
        for t in idx:
            kl[b, t] = v[b, t]
            rew[b, t] = -betas[b] * v[b, t] * m[b, t]
        if idx:
            rew[b, idx[-1]] += scores[b].double()
            mean[b] = sum(v[b, t] * m[b, t] for t in idx) / m[b].sum()
    return rew, kl, mean


@pytest.mark.parametrize("backend", cpu_backends("kl_penalized_rewards"))
@pytest.mark.parametrize("estimator", ["k1", "k3", "abs", "k2+"])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "int"])
@pytest.mark.parametrize("beta_kind", ["float", "scalar_tensor", "per_row"])
def test_kl_penalized_rewards(backend, estimator, mask_kind, beta_kind):
    B, T = 6, 37
    lp, ref = _pairs(B * T)
    lp, ref = lp.view(B, T), ref.view(B, T)
    scores = torch.randn(B)
    mask = torch.rand(B, T) > 0.3
    mask[1] = False  # a row with no action
    mask[2, -1] = True  # last action on the last position
    mask[3, :5] = False
    mask[3, 5:] = False
    mask[3, 4] = True  # a single action
    mask_in = {"bool": mask, "float": mask.float() * torch.rand(B, T).add(0.5), "int": mask.int()}[
        mask_kind
    ]
    beta = {"float": 0.05, "scalar_tensor": torch.tensor(0.05), "per_row": torch.rand(B)}[beta_kind]
    with use_backend(kl_penalized_rewards=backend), poisoned():
        r, k, mk = kl_penalized_rewards(
            scores, lp, ref, mask_in, beta=beta, estimator=estimator, clamp="verl"
        )
    rr, kr, mr = _rewards_ref(scores, lp, ref, mask_in, beta, estimator, "verl")
    for got, want in ((r, rr), (k, kr), (mk, mr)):
        assert got.dtype == torch.float32
        assert not got.isnan().any()
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert r[1].eq(0).all() and mk[1] == 0 and k[1].eq(0).all()


@pytest.mark.parametrize("backend", cpu_backends("kl_penalized_rewards"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kl_penalized_rewards_low_precision_long_rows(backend, dtype):
    B, T = 3, 2600  # longer than one Triton block / CPU tile
    lp, ref = _pairs(B * T, dtype)
    lp, ref = lp.view(B, T), ref.view(B, T)
    mask = torch.rand(B, T) > 0.5
    mask[2, 2000:] = False
    scores = torch.randn(B)
    with use_backend(kl_penalized_rewards=backend), poisoned():
        r, k, mk = kl_penalized_rewards(
            scores, lp, ref, mask, beta=0.1, estimator="k3", clamp="openrlhf"
        )
    rr, kr, mr = _rewards_ref(scores, lp, ref, mask, 0.1, "k3", "openrlhf")
    torch.testing.assert_close(r.double(), rr, atol=1e-5, rtol=2e-5)
    torch.testing.assert_close(k.double(), kr, atol=1e-5, rtol=2e-5)
    torch.testing.assert_close(mk.double(), mr, atol=1e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", cpu_backends("kl_penalized_rewards"))
def test_kl_penalized_rewards_edge_shapes_and_infinite_padding(backend):
    with use_backend(kl_penalized_rewards=backend), poisoned():
        r, k, m = kl_penalized_rewards(
            torch.randn(3),
            torch.empty(3, 0),
            torch.empty(3, 0),
            torch.empty(3, 0, dtype=torch.bool),
            beta=0.1,
        )
        assert r.shape == (3, 0) and m.eq(0).all()
        r, k, m = kl_penalized_rewards(
            torch.randn(0),
            torch.empty(0, 4),
            torch.empty(0, 4),
            torch.empty(0, 4, dtype=torch.bool),
            beta=0.1,
        )
        assert r.shape == (0, 4) and m.shape == (0,)
        # -inf log-probs at padding must not leak NaN through 0 * inf
        lp = torch.tensor([[-1.0, -2.0, -math.inf]])
        ref = torch.tensor([[-1.5, -math.inf, -3.0]])
        mask = torch.tensor([[True, False, False]])
        r, k, m = kl_penalized_rewards(torch.tensor([2.0]), lp, ref, mask, beta=0.1, estimator="k3")
    assert not r.isnan().any() and not k.isnan().any()
    torch.testing.assert_close(r[0, 1:], torch.zeros(2))
    assert r[0, 0] == pytest.approx(2.0 - 0.1 * (math.exp(-0.5) + 0.5 - 1), rel=1e-6)


def test_kl_penalized_rewards_argument_errors():
    lp = torch.randn(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="scores"):
        kl_penalized_rewards(torch.randn(3), lp, lp, m, beta=0.1)
    with pytest.raises(ValueError, match="mask"):
        kl_penalized_rewards(torch.randn(2), lp, lp, m[:, :2], beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        kl_penalized_rewards(torch.randn(2), lp, lp, m, beta=torch.ones(3))
    with pytest.raises(ValueError, match="logprobs"):
        kl_penalized_rewards(torch.randn(2), lp[0], lp[0], m[0], beta=0.1)


@pytest.mark.parametrize("backend", cpu_backends("kl_penalized_rewards"))
def test_kl_penalized_rewards_opcheck(backend):
    lp, ref = torch.randn(3, 5), torch.randn(3, 5)
    with use_backend(kl_penalized_rewards=backend):
        torch.library.opcheck(
            torch.ops.ppo_kernels.kl_penalized_rewards.default,
            (
                torch.randn(3),
                lp,
                ref,
                torch.rand(3, 5) > 0.5,
                torch.rand(3),
                1.0,
                "k3",
                -20.0,
                20.0,
                -10.0,
                10.0,
            ),
        )


def test_compile_fullgraph_tensor_beta_does_not_recompile():
    torch._dynamo.reset()

    def step(scores, lp, ref, mask, beta):
        r, k, m = kl_penalized_rewards(
            scores, lp, ref, mask, beta=beta, estimator="k3", clamp="verl"
        )
        loss = kl_penalty(lp, ref, "k3+", clamp="verl").mean()
        return r, m, loss

    f = torch.compile(step, fullgraph=True)
    lp, ref = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.3
    scores = torch.randn(4)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for beta in (0.1, 0.2):
            r, m, loss = f(scores, lp, ref, mask, torch.tensor(beta))
            rr, _, mr = kl_penalized_rewards(
                scores, lp, ref, mask, beta=beta, estimator="k3", clamp="verl"
            )
            torch.testing.assert_close(r, rr)
            torch.testing.assert_close(m, mr)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, (lp - ref).detach() / lp.numel())


# ------------------------------------------------------------------------------------------------
# Peers: literal re-implementations of their semantics (always), and their own functions when their
# source can be loaded (a pip-installed package, or wheels in $PPO_KERNELS_PEER_WHEELS, whose
# module-level dependencies -- ray, deepspeed, omegaconf -- are not needed by these functions).


def verl_literal_kl(logprob, ref_logprob, name):
    st = name.endswith("+")
    base = name[:-1] if st else name
    if base in ("kl", "k1"):
        v = logprob - ref_logprob
    elif base == "abs":
        v = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        v = 0.5 * (logprob - ref_logprob).square()
    else:
        x = (ref_logprob - logprob).clamp(-20, 20)
        v = (x.exp() - x - 1).clamp(-10, 10)
    if st and base not in ("mse", "k2"):
        s = 0.5 * (logprob - ref_logprob).square()
        v = s - s.detach() + v.detach()
    return v


def openrlhf_literal_kl(log_probs, log_probs_base, kl_estimator):
    r = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k1":
        v = r
    elif kl_estimator == "k2":
        v = r * r / 2
    else:
        v = torch.exp(-r) - 1 + r
    return v.clamp(-10, 10)


def openrlhf_literal_reward(r, kl_coef, kl, action_mask):
    """Score on the last action of each row (the last position for a row without actions)."""
    out = -kl_coef * kl
    for i in range(kl.shape[0]):
        idx = [t for t in range(kl.shape[1]) if action_mask[i, t]]
        out[i, idx[-1] if idx else kl.shape[1] - 1] += r[i]
    return out


def _peer_ns():
    return {
        "torch": torch,
        **{k: getattr(typing, k) for k in ("Optional", "Union", "Tuple", "Any")},
    }


@pytest.mark.parametrize(
    "name", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k3+", "k1+", "k2+"]
)
def test_parity_verl_kl_penalty(name):
    lp, ref = _pairs(400)
    lp.requires_grad_()
    fns = [verl_literal_kl]
    try:
        peer = load_functions(
            "verl", "trainer/ppo/core_algos.py", ["kl_penalty", "kl_penalty_forward"], _peer_ns()
        )
        fns.append(peer["kl_penalty"])
    except pytest.skip.Exception as e:  # verl's own function: the literal semantics still run
        skipped = e.msg
    else:
        skipped = None
    v = kl_penalty(lp, ref, name, clamp="verl")
    (g,) = torch.autograd.grad(v.sum(), lp)
    for fn in fns:
        a = lp.detach().double().requires_grad_()
        want = fn(a, ref.double(), name)
        (gw,) = torch.autograd.grad(want.sum(), a)
        torch.testing.assert_close(v.double(), want.detach(), **VTOL)
        torch.testing.assert_close(g.double(), gw, **GTOL)
    if skipped:
        pytest.skip(skipped)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_parity_openrlhf_compute_approx_kl(name):
    lp, ref = _pairs(400)
    fns = [openrlhf_literal_kl]
    try:
        fns.append(
            load_functions("openrlhf", "models/utils.py", ["compute_approx_kl"], _peer_ns())[
                "compute_approx_kl"
            ]
        )
    except pytest.skip.Exception as e:  # OpenRLHF's own function: the literal semantics still run
        skipped = e.msg
    else:
        skipped = None
    lp.requires_grad_()
    v = kl_penalty(lp, ref, name, clamp="openrlhf")
    (g,) = torch.autograd.grad(v.sum(), lp)
    for fn in fns:
        a = lp.detach().double().requires_grad_()
        want = fn(a, ref.double(), kl_estimator=name)  # computes in float32, as OpenRLHF does
        (gw,) = torch.autograd.grad(want.sum(), a)
        torch.testing.assert_close(v.double(), want.detach().double(), **VTOL)
        torch.testing.assert_close(g.double(), gw, **GTOL)
    if skipped:
        pytest.skip(skipped)


def test_parity_openrlhf_compute_reward_on_rows_with_actions():
    B, T = 5, 11
    lp, ref = torch.randn(B, T), torch.randn(B, T)
    mask = torch.rand(B, T) > 0.4
    mask[:, 0] = True
    scores = torch.randn(B)
    kl = openrlhf_literal_kl(lp, ref, "k1") * mask
    fns = [openrlhf_literal_reward]
    try:
        fns.append(
            load_functions("openrlhf", "models/utils.py", ["compute_reward"], _peer_ns())[
                "compute_reward"
            ]
        )
    except pytest.skip.Exception:
        pass
    r, k, _ = kl_penalized_rewards(scores, lp, ref, mask, beta=0.07, clamp="openrlhf")
    for fn in fns:
        torch.testing.assert_close(r, fn(scores, 0.07, kl, action_mask=mask), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, kl)


def test_parity_trl_literal_no_clamps():
    """TRL (GRPO's per-token KL, PPO's k1 / k3 estimators) clamps nothing."""
    lp, ref = _pairs(400)
    keep = (lp - ref).abs() < 60  # float64 stays finite; float32 k3 overflows beyond ~88
    lp, ref = lp[keep].requires_grad_(), ref[keep]
    for name, literal in (
        ("k1", lambda a, b: a - b),
        ("k3", lambda a, b: torch.exp(b - a) - (b - a) - 1),
    ):
        v = kl_penalty(lp, ref, name, clamp="trl")
        (g,) = torch.autograd.grad(v.sum(), lp)
        a = lp.detach().double().requires_grad_()
        want = literal(a, ref.double())
        (gw,) = torch.autograd.grad(want.sum(), a)
        torch.testing.assert_close(v.double(), want.detach(), **VTOL)
        torch.testing.assert_close(g.double(), gw, **GTOL)


def test_importance_weighted_straight_through():
    """is_logprobs: OpenRLHF's unbiased_gradient with log_probs_old -- the value of the estimator,
    the k2 gradient times w = min(exp(logprobs - is_logprobs), is_clip), detached."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 6, generator=g, dtype=torch.float64)
    old = lp.detach() + torch.randn(3, 6, generator=g, dtype=torch.float64)
    old[0, 0] = lp[0, 0].item() - 5.0  # w = e^5 > is_clip: clipped
    for est in ("k1+", "k3+"):
        v = kl_penalty(lp, ref, est, clamp="openrlhf", is_logprobs=old, is_clip=10.0)
        torch.testing.assert_close(v, kl_penalty(lp, ref, est, clamp="openrlhf"))
        (gl,) = torch.autograd.grad(v.sum(), lp)
        w = (lp.detach() - old).exp().clamp(max=10.0)
        torch.testing.assert_close(gl, w * (lp.detach() - ref))
    with pytest.raises(ValueError, match="is_logprobs"):
        kl_penalty(lp, ref, "k3", is_logprobs=old)
    with pytest.raises(ValueError, match="is_logprobs"):
        kl_penalty(lp, ref, "k3+", is_logprobs=old[:, 1:])


def test_penalized_rewards_precomputed_kl_token_scores_and_openrlhf_placement():
    g = torch.Generator().manual_seed(1)
    B, T, beta = 4, 6, 0.1
    kl = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    mask[-1] = 0
    scores = torch.randn(B, generator=g)
    r, k, m = kl_penalized_rewards(scores, None, None, mask, beta=beta, kl=kl)
    r2, k2, m2 = kl_penalized_rewards(scores, kl, torch.zeros_like(kl), mask, beta=beta)
    torch.testing.assert_close((r, k, m), (r2, k2, m2))
    tok = torch.randn(B, T, generator=g)  # verl's token-level scores
    rt, _, _ = kl_penalized_rewards(tok, None, None, mask, beta=beta, kl=kl)
    torch.testing.assert_close(rt, tok - beta * kl * mask)
    # OpenRLHF: the penalty everywhere, the score on the last action (or the last position)
    ro, _, _ = kl_penalized_rewards(
        scores, None, None, mask, beta=beta, kl=kl, convention="openrlhf"
    )
    exp = -beta * kl
    for b in range(B):
        nz = mask[b].nonzero()
        exp[b, int(nz[-1]) if len(nz) else T - 1] += scores[b]
    torch.testing.assert_close(ro, exp)
    with pytest.raises(ValueError, match="convention"):
        kl_penalized_rewards(scores, None, None, mask, beta=beta, kl=kl, convention="trl")
    with pytest.raises(ValueError, match="kl"):
        kl_penalized_rewards(scores, kl, kl, mask, beta=beta, kl=kl)
    with pytest.raises(ValueError, match="logprobs"):
        kl_penalized_rewards(scores, None, None, mask, beta=beta)


def test_unclamped_k1_of_float32_is_torchs_subtraction_bit_for_bit():
    """The API's shortcut (one torch subtraction, no custom op) for unclamped float32 k1 gives
    the kernels' values and gradients bit for bit; it is not taken when a backend is requested
    (the kernel runs: poisoned outputs would show), for other dtypes, clamps or shapes."""
    g = torch.Generator().manual_seed(5)
    lp = (-torch.rand(3, 37, generator=g) * 5).requires_grad_(True)
    ref = (lp.detach() + torch.randn(3, 37, generator=g)).requires_grad_(True)
    gout = torch.randn(3, 37, generator=g)
    fast = pk.kl_penalty(lp, ref, "k1")
    assert fast.grad_fn is not None and "Sub" in type(fast.grad_fn).__name__
    fast_g = torch.autograd.grad(fast, (lp, ref), gout)
    for backend in cpu_backends("kl_penalty"):
        with use_backend(kl_penalty=backend), poisoned():
            got = pk.kl_penalty(lp, ref, "kl")
            assert "Sub" not in type(got.grad_fn).__name__
            got_g = torch.autograd.grad(got, (lp, ref), gout)
        assert torch.equal(got, fast)
        for a, b in zip(got_g, fast_g):
            assert torch.equal(a, b)
    # not taken: a clamp, another dtype, a straight-through estimator, mismatched shapes
    for out in (
        pk.kl_penalty(lp, ref, "k1", clamp="openrlhf"),
        pk.kl_penalty(lp.double(), ref.double(), "k1"),
        pk.kl_penalty(lp, ref, "k1+"),
    ):
        assert "Sub" not in type(out.grad_fn).__name__
    with pytest.raises(ValueError, match="ref_logprobs"):
        pk.kl_penalty(lp, ref[:, :5], "k1")
