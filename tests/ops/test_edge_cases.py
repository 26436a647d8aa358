"""Regression tests for the inputs an adversarial pass over the public API found to break it
("No input that breaks it", DEVELOPING.md): each documented edge case on every backend here,
against float64, plus every public op under torch.compile(fullgraph=True, dynamic=True) and the
type checks of every scalar argument. Crash-prone calls live in tests/ops/test_bad_inputs.py."""

import pytest
import torch
from support.utils import TinyCausalLM, cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import _backend
from ppo_kernels.token_logprobs import naive as tlp_ref


# --------------------------------------------------------------------------- token_logprobs
@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
@pytest.mark.parametrize("inplace", [False, True])
def test_token_logprobs_backward_non_collapsing_strides(backend, inplace):
    """x[:, :-1, :-1] of a 4-D tensor: leading dims that do not collapse to two strided dims."""
    x = torch.randn(2, 4, 6, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 3, 5))
    ref = x.clone().requires_grad_()
    lp_r, ent_r = pk.token_logprobs(ref[:, :-1, :-1], labels, temperature=0.7, return_entropy=True)
    (lp_r.sum() + 0.5 * ent_r.sum()).backward()
    base = x.float().clone().requires_grad_()
    with _backend.use_backend(token_logprobs=backend), poisoned():
        view = base * 1.0 if inplace else base  # inplace writes into a non-leaf buffer
        lp, ent = pk.token_logprobs(
            view[:, :-1, :-1],
            labels,
            temperature=0.7,
            return_entropy=True,
            inplace_backward=inplace,
        )
        (lp.sum() + 0.5 * ent.sum()).backward()
    torch.testing.assert_close(lp.double(), lp_r.detach(), atol=5e-5, rtol=2e-5)
    torch.testing.assert_close(base.grad.double(), ref.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
def test_token_logprobs_empty_strided_view(backend):
    """No rows, and strides that do not collapse (an empty tensor keeps any strides, even through
    .contiguous()): empty outputs and gradient."""
    x = torch.randn(3, 0, 4, 6).transpose(0, 2)[:, :, :-1].requires_grad_()  # [4, 0, 2, 6]
    with _backend.use_backend(token_logprobs=backend):
        lp, ent = pk.token_logprobs(x, torch.zeros(4, 0, 2, dtype=torch.long), return_entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert lp.shape == (4, 0, 2) and x.grad.shape == x.shape


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
@pytest.mark.parametrize("with_entropy", [True, False])
def test_token_logprobs_scaled_logit_overflow_is_finite(backend, with_entropy):
    """Logits of 3e38 at temperature 0.5 overflow float32 once scaled; the answer is finite."""
    x = torch.tensor([[3e38, 2.9e38, -3e38, 1e38, 3e38], [-3e38, -3e38, -2.99e38, 0.0, -1e38]])
    labels = torch.tensor([1, 2])
    ref = x.double().requires_grad_()
    lp_r, ent_r = tlp_ref.forward(ref, labels, 0.5, -100, True)[:2]
    (lp_r.sum() + (ent_r.sum() if with_entropy else 0)).backward()  # finite in float64
    xb = x.clone().requires_grad_()
    with _backend.use_backend(token_logprobs=backend), poisoned():
        out = pk.token_logprobs(xb, labels, temperature=0.5, return_entropy=with_entropy)
        lp, ent = out if with_entropy else (out, None)
        (lp.sum() + (ent.sum() if with_entropy else 0)).backward()
    assert torch.isfinite(xb.grad).all()
    torch.testing.assert_close(lp.double(), lp_r.detach().float().double())  # -6e38 -> -inf
    if with_entropy:
        assert torch.isfinite(ent).all()
        torch.testing.assert_close(ent.double(), ent_r.detach(), atol=5e-5, rtol=2e-5)
    torch.testing.assert_close(xb.grad.double(), ref.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_huge_scaled_logits_round_the_product(backend, dtype):
    """Logits near 1e38 at temperature 0.7 (no overflow): the scaled logit is the float32 product
    x * (1 / T), rounded, before the row's max is subtracted. Fused into an FMA the product would
    keep its rounding error (~1e31 here): log-probs off by that much, exp(z - lse) inf. Three tied
    maxima per row: log-prob -log 3 at each. The gradient is only checked to be finite: at this
    magnitude the saved float32 lse cannot hold the log 3 (its ULP is ~1e31), so p at the tied
    maxima comes out 1 in every backend -- a limit of a float32 lse that real logits (|z| << 1e6)
    are far from. The rows are wide enough for the vector loops and their tails."""
    g = torch.Generator().manual_seed(0)
    x = (0.8e38 + 0.1e38 * torch.rand(3, 67, generator=g)).to(dtype)
    inv_t = torch.tensor(1 / 0.7, dtype=torch.float32)
    # the tied maximum: a value whose float32 product rounds down (an unrounded product exceeds the
    # lse built from rounded ones: exp overflows); float64 holds both products exactly
    cands = torch.linspace(0.94e38, 0.96e38, 64).to(dtype).unique()
    c = cands[cands.double() * inv_t.double() > (cands.float() * inv_t).double()][0]
    x[:, [3, 40, 66]] = c  # above every other logit
    labels = torch.tensor([3, 40, 5])
    z = (x.float() * inv_t).double()  # the float32 product, then float64 math
    lp_r, ent_r = tlp_ref.forward(z, labels, 1.0, -100, True)[:2]
    xb = x.clone().requires_grad_()
    with _backend.use_backend(token_logprobs=backend), poisoned():
        lp, ent = pk.token_logprobs(xb, labels, temperature=0.7, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(lp.double(), lp_r, atol=1e-6, rtol=1e-6)
    third = torch.full((2,), 1 / 3, dtype=torch.float64)
    torch.testing.assert_close(lp[:2].double().exp(), third, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent.double(), ent_r, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(xb.grad).all()


def test_token_logprobs_temperature_whose_inverse_overflows_is_refused():
    x = torch.randn(2, 5)
    for t in (1e-40, 2e-39):
        with pytest.raises(ValueError, match="temperature"):
            pk.token_logprobs(x, torch.zeros(2, dtype=torch.long), temperature=t)
    pk.token_logprobs(x, torch.zeros(2, dtype=torch.long), temperature=3e-39)  # 1/T < FLT_MAX


# --------------------------------------------------------------------------- gae
@pytest.mark.parametrize("backend", cpu_backends("gae"))
@pytest.mark.parametrize("which", ["gamma", "lam"])
def test_gae_empty_time_axis_with_one_per_token_tensor(backend, which):
    r = torch.zeros(3, 0)
    kw = {which: torch.full((3, 1), 0.9)}
    with _backend.use_backend(gae=backend):
        adv, ret = pk.gae(r, r.clone(), **kw)
        assert adv.shape == (3, 0) and ret.shape == (3, 0)
        flat = torch.zeros(0)
        cu = torch.tensor([0, 0, 0], dtype=torch.int32)
        adv, ret, (cv, ca) = pk.gae(
            flat, flat.clone(), cu_seqlens=cu, return_carry=True, **{which: torch.full((0,), 0.9)}
        )
        assert adv.shape == (0,) and cv.tolist() == [0.0, 0.0] and ca.tolist() == [0.0, 0.0]


def test_gae_bootstrap_value_not_a_tensor_names_it():
    r = torch.randn(2, 3)
    with pytest.raises(TypeError, match="bootstrap_value"):
        pk.gae(r, r, bootstrap_value=1.0)


# --------------------------------------------------------------------------- masked_whiten
@pytest.mark.parametrize("spread", [1e19, 1e25, 3e38])
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_whiten_huge_spread_is_finite_and_correct(spread, unbiased):
    torch.manual_seed(1)
    x = (torch.rand(4, 9) * 2 - 1) * spread
    mask = torch.rand(4, 9) > 0.3
    out = pk.masked_whiten(x, mask, unbiased=unbiased)
    xd = x.double()
    sel = xd[mask]
    mean = sel.mean()
    var = sel.var(unbiased=unbiased)
    want = (xd - mean) * torch.rsqrt(var + 1e-8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    shifted = pk.masked_whiten(x, mask, unbiased=unbiased, shift_mean=False)
    torch.testing.assert_close(shifted.double(), want + mean, atol=1e-5, rtol=1e-5)


def test_masked_whiten_tiny_values():
    x = torch.tensor([1e-30, -1e-30, 3e-30, 0.0])
    out = pk.masked_whiten(x, torch.ones(4, dtype=torch.bool))
    xd = x.double()
    want = (xd - xd.mean()) * torch.rsqrt(xd.var() + 1e-8)
    torch.testing.assert_close(out.double(), want, atol=1e-12, rtol=1e-5)


# --------------------------------------------------------------------------- unclear errors
def test_ppo_policy_loss_empty_time_axis_norm_mode():
    z = torch.zeros(2, 0)
    for agg in (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ):
        loss, _ = pk.ppo_policy_loss(z, z, z, z.bool(), agg=agg)
        assert loss.item() == 0.0
        loss, _ = pk.ppo_value_loss(z, z, z, z.bool(), agg=agg)
        assert loss.item() == 0.0


@pytest.mark.parametrize("backend", cpu_backends("linear_token_logprobs"))
def test_linear_token_logprobs_empty_hidden_dim(backend):
    """H = 0: the logits are the bias (or 0): a well-defined distribution."""
    h = torch.zeros(2, 3, 0, requires_grad=True)
    w = torch.zeros(5, 0, requires_grad=True)
    bias = torch.randn(5, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    with _backend.use_backend(linear_token_logprobs=backend):
        lp = pk.linear_token_logprobs(h, w, labels, bias=bias)
        lp.sum().backward()
    want = torch.log_softmax(bias.detach(), -1)[labels]
    torch.testing.assert_close(lp, want)
    assert bias.grad is not None and torch.isfinite(bias.grad).all()


def test_beta_nan_is_refused():
    lp = torch.randn(2, 3)
    with pytest.raises(ValueError, match="beta"):
        pk.kl_penalized_rewards(torch.randn(2), lp, lp, torch.ones(2, 3), beta=float("nan"))
    with pytest.raises(ValueError, match="beta"):
        pk.dpo_loss(lp[0], lp[0], lp[0], lp[0], beta=float("nan"))


# --------------------------------------------------------------------------- backend agreement
@pytest.mark.parametrize("backend", cpu_backends("kl_penalized_rewards"))
def test_kl_rewards_float_mask_summing_to_zero(backend):
    lp, ref = torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    with _backend.use_backend(kl_penalized_rewards=backend), poisoned():
        _, _, mean = pk.kl_penalized_rewards(torch.randn(3), lp, ref, mask, beta=0.1)
    d = lp - ref
    assert mean[0].item() == 0.0 and mean[2].item() == 0.0
    torch.testing.assert_close(mean[1], (d[1, :2] * 0.5).sum())


@pytest.mark.parametrize("backend", cpu_backends("group_advantages"))
def test_grpo_eps_zero_equal_scores_is_zero(backend):
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.3, 0.5, 2.0])
    gi = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    with _backend.use_backend(group_advantages=backend), poisoned():
        adv = pk.grpo_advantages(scores, gi, eps=0.0)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[6].item() == 2.0  # singleton: R / (1 + 0)
    x = scores[3:6].double()
    torch.testing.assert_close(adv[3:6].double(), (x - x.mean()) / x.std(), atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- torch.compile
def _compile_cases():
    B, T, V, H = 2, 5, 7, 4
    lp = torch.randn(B, T, requires_grad=True)
    ref = torch.randn(B, T)
    mask = torch.rand(B, T) > 0.3
    logits = torch.randn(B, T + 1, V, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    scores = torch.randn(B)
    hid, w = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    lm = TinyCausalLM(V, H)
    return {
        "token_logprobs": (
            lambda x, y: pk.token_logprobs(x[:, :-1], y, temperature=0.7, return_entropy=True),
            (logits, labels),
        ),
        "linear_token_logprobs": (
            lambda a, b, y: pk.linear_token_logprobs(a, b, y, temperature=0.7),
            (hid, w, labels),
        ),
        "linear_token_logprobs_sampler": (
            lambda a, b, y, t: pk.linear_token_logprobs(
                a, b, y, temperature=t, top_k=4, top_p=0.9, return_entropy=True
            )[1],
            (hid, w, labels, scores.abs() + 0.5),
        ),
        "causal_lm_logprobs": (
            lambda ids, m: pk.causal_lm_logprobs(lm, ids, m, temperature=0.7),
            (labels, mask.long()),
        ),
        "linear_policy_loss": (
            lambda a, b, y, c, d, m: pk.linear_policy_loss(
                a, b, y, c, d, m, loss_type="grpo", ref_logprobs=d, kl_coef=0.1, entropy_coef=0.1
            )[0],
            (hid, w, labels, scores, ref, mask),
        ),
        "linear_policy_loss_sampler": (
            lambda a, b, y, c, d, m, t: pk.linear_policy_loss(
                a, b, y, c, d, m, temperature=t, top_k=4, top_p=0.9, entropy_coef=0.1
            )[0],
            (hid, w, labels, scores, ref, mask, scores.abs() + 0.5),
        ),
        "linear_preference_loss": (
            lambda a, b, y, m, r: pk.linear_preference_loss(
                a, b, y, m, ref_logps=r, loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5)
            )[0],
            (hid, w, labels, mask, scores),
        ),
        "linear_preference_loss_sampler": (
            lambda a, b, y, m, r, t: pk.linear_preference_loss(
                a, b, y, m, ref_logps=r, temperature=t, top_k=4, top_p=0.9
            )[0],
            (hid, w, labels, mask, scores, scores.abs() + 0.5),
        ),
        "linear_preference_loss_kto": (
            lambda a, b, y, d: pk.linear_preference_loss(
                a, b, y, loss_type="kto", desirable=d, reference_point=0.1
            )[0],
            (hid, w, labels, mask[:, 0]),
        ),
        "full_kl": (lambda x, y: pk.full_kl(x, y), (logits, logits.detach() + 1)),
        "kl_penalty": (lambda a, b: pk.kl_penalty(a, b, "k3", clamp="verl"), (lp, ref)),
        "kl_penalty_openrlhf": (
            lambda a, b: pk.kl_penalty(a, b, "k1+", clamp="openrlhf"),
            (lp, ref),
        ),
        "kl_penalized_rewards": (
            lambda s, a, b, m: pk.kl_penalized_rewards(
                s, a, b, m, beta=0.1, estimator="k3", clamp="verl"
            ),
            (scores, lp, ref, mask),
        ),
        "gae": (lambda r, v, m: pk.gae(r, v, m, gamma=0.99, lam=0.95), (ref, ref * 0.5, mask)),
        "masked_whiten": (lambda x, m: pk.masked_whiten(x, m), (ref, mask)),
        "masked_mean": (lambda x, m: pk.masked_mean(x, m), (ref, mask)),
        "ppo_policy_loss": (
            lambda a, b, c, m: pk.ppo_policy_loss(a, b, c, m, dual_clip=3.0)[0],
            (lp, ref, ref, mask),
        ),
        "ppo_policy_loss_gspo_seq": (
            lambda a, b, c, m: pk.ppo_policy_loss(
                a, b, c, m, loss_type="grpo", importance_sampling_level="sequence", delta=2.0
            )[0],
            (lp, ref, ref, mask),
        ),
        "ppo_policy_loss_geo_mean": (
            lambda a, b, c, m: pk.ppo_policy_loss(a, b, c, m, loss_type="geo_mean")[0],
            (lp, ref, ref, mask),
        ),
        "ppo_policy_loss_rollout": (
            lambda a, b, c, m: pk.ppo_policy_loss(
                a,
                b,
                c,
                m,
                loss_type="cispo",
                rollout_logprobs=b - 0.1,
                rollout_is="sequence",
                rollout_is_threshold="0.5_2",
                rollout_rs="token_k1,seq_mean_k3",
                rollout_rs_threshold="0.5_2,0.5",
            )[0],
            (lp, ref, ref, mask),
        ),
        "rollout_correction": (
            lambda a, b, m: pk.rollout_correction(
                a, b, m, rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold=0.5
            )[:2],
            (lp, ref, mask),
        ),
        "masked_aggregate": (
            lambda a, m: pk.masked_aggregate(a, m, "seq-mean-token-mean"),
            (lp, mask),
        ),
        "ppo_value_loss": (
            lambda a, b, c, m: pk.ppo_value_loss(a, b, c, m, clip=0.2)[0],
            (lp, ref, ref, mask),
        ),
        "grpo_advantages": (lambda s: pk.grpo_advantages(s, group_size=1), (scores,)),
        "rloo_advantages": (lambda s: pk.rloo_advantages(s, group_size=2), (scores,)),
        "reward_model_loss": (lambda a, b: pk.reward_model_loss(a, b), (scores, scores.flip(0))),
        "dpo_loss": (lambda a, b: pk.dpo_loss(a, b, b, a, beta=0.1), (scores, scores.flip(0))),
        "linear_distill_loss": (
            lambda a, b, y, m: pk.linear_distill_loss(
                a, b, y, a.detach() * 0.5, b.detach(), mask=m, temperature=0.8, divergence="tv"
            )[0],
            (hid, w, labels, mask),
        ),
        "linear_distill_loss_sampler": (
            lambda a, b, y, m, t: pk.linear_distill_loss(
                a,
                b,
                y,
                a.detach() * 0.5,
                b.detach(),
                mask=m,
                temperature=t,
                top_k=4,
                top_p=0.9,
                divergence="reverse_kl",
            )[0],
            (hid, w, labels, mask, scores.abs() + 0.5),
        ),
        "linear_distill_loss_topk": (
            lambda a, b, y, i, t: pk.linear_distill_loss(
                a, b, y, topk_ids=i, topk_logprobs=t, divergence="reverse_kl"
            )[0],
            (
                hid,
                w,
                labels,
                labels[..., None].expand(B, T, 2),
                lp.detach()[..., None].expand(B, T, 2) - 1,
            ),
        ),
    }


@pytest.mark.parametrize("name", sorted(_compile_cases()))
def test_every_public_op_compiles_with_dynamic_shapes(name):
    fn, args = _compile_cases()[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    got, want = compiled(*args), fn(*args)
    torch.testing.assert_close(got, want, equal_nan=True)
    out = got[0] if isinstance(got, tuple) else got
    if out.requires_grad:
        out.float().sum().backward()


# --------------------------------------------------------------------------- scalar arguments
def _scalar_cases():
    x = torch.randn(2, 5)
    lab = torch.zeros(2, dtype=torch.long)
    lp = torch.randn(2, 3)
    m = torch.ones(2, 3)
    s = torch.randn(2)
    w = torch.randn(5, 4)
    h = torch.randn(2, 4)
    return [
        ("temperature", lambda v: pk.token_logprobs(x, lab, temperature=v)),
        ("ignore_index", lambda v: pk.token_logprobs(x, lab, ignore_index=v)),
        ("return_entropy", lambda v: pk.token_logprobs(x, lab, return_entropy=v)),
        ("inplace_backward", lambda v: pk.token_logprobs(x, lab, inplace_backward=v)),
        ("temperature", lambda v: pk.linear_token_logprobs(h, w, lab, temperature=v)),
        ("ignore_index", lambda v: pk.linear_token_logprobs(h, w, lab, ignore_index=v)),
        ("return_entropy", lambda v: pk.linear_token_logprobs(h, w, lab, return_entropy=v)),
        ("max_chunk_bytes", lambda v: pk.linear_token_logprobs(h, w, lab, max_chunk_bytes=v)),
        ("logits_dtype", lambda v: pk.linear_token_logprobs(h, w, lab, logits_dtype=v)),
        ("temperature", lambda v: pk.full_kl(x, x, temperature=v)),
        ("estimator", lambda v: pk.kl_penalty(lp, lp, v)),
        ("clamp", lambda v: pk.kl_penalty(lp, lp, "k1", clamp=v)),
        ("beta", lambda v: pk.kl_penalized_rewards(s, lp, lp, m, beta=v)),
        ("estimator", lambda v: pk.kl_penalized_rewards(s, lp, lp, m, beta=0.1, estimator=v)),
        ("gamma", lambda v: pk.gae(lp, lp, gamma=v)),
        ("lam", lambda v: pk.gae(lp, lp, lam=v)),
        ("return_carry", lambda v: pk.gae(lp, lp, return_carry=v)),
        ("eps", lambda v: pk.masked_whiten(lp, m, eps=v)),
        ("shift_mean", lambda v: pk.masked_whiten(lp, m, shift_mean=v)),
        ("unbiased", lambda v: pk.masked_whiten(lp, m, unbiased=v)),
        ("clip_low", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, clip_low=v)),
        ("clip_high", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, clip_high=v)),
        ("dual_clip", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, dual_clip=v)),
        ("agg", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, agg=v)),
        ("log_ratio_clamp", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, log_ratio_clamp=v)),
        ("dp_size", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, dp_size=v)),
        ("global_num_tokens", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, global_num_tokens=v)),
        (
            "loss_scale_factor",
            lambda v: pk.ppo_policy_loss(
                lp, lp, lp, m, agg="seq-mean-token-sum-norm", loss_scale_factor=v
            ),
        ),
        ("loss_type", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, loss_type=v)),
        (
            "importance_sampling_level",
            lambda v: pk.ppo_policy_loss(lp, lp, lp, m, importance_sampling_level=v),
        ),
        ("delta", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, loss_type="grpo", delta=v)),
        ("tau_pos", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, loss_type="sapo", tau_pos=v)),
        ("dro_beta", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, loss_type="dro", dro_beta=v)),
        ("clip_cov_ub", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, clip_cov_ub=v)),
        ("kl_cov_ratio", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, kl_cov_ratio=v)),
        ("kl_cov_coef", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, kl_cov_coef=v)),
        ("rollout_is", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, rollout_is=v)),
        ("rollout_rs", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, rollout_rs=v)),
        ("bypass_mode", lambda v: pk.ppo_policy_loss(lp, lp, lp, m, bypass_mode=v)),
        ("rollout_is", lambda v: pk.rollout_correction(lp, lp, m, rollout_is=v)),
        (
            "rollout_is_batch_normalize",
            lambda v: pk.rollout_correction(lp, lp, m, rollout_is_batch_normalize=v),
        ),
        ("clip", lambda v: pk.ppo_value_loss(lp, lp, lp, m, clip=v)),
        ("agg", lambda v: pk.ppo_value_loss(lp, lp, lp, m, agg=v)),
        ("group_size", lambda v: pk.grpo_advantages(s, group_size=v)),
        ("eps", lambda v: pk.grpo_advantages(s, group_size=1, eps=v)),
        ("norm_by_std", lambda v: pk.grpo_advantages(s, group_size=1, norm_by_std=v)),
        ("group_size", lambda v: pk.rloo_advantages(s, group_size=v)),
        ("reduction", lambda v: pk.reward_model_loss(s, s, reduction=v)),
        ("beta", lambda v: pk.dpo_loss(s, s, s, s, beta=v)),
        ("beta", lambda v: pk.linear_preference_loss(h[:, None], w, lab[:, None], beta=v)),
        (
            "loss_type",
            lambda v: pk.linear_preference_loss(h[:, None], w, lab[:, None], loss_type=v),
        ),
        (
            "label_smoothing",
            lambda v: pk.linear_preference_loss(h[:, None], w, lab[:, None], label_smoothing=v),
        ),
        (
            "average_log_prob",
            lambda v: pk.linear_preference_loss(h[:, None], w, lab[:, None], average_log_prob=v),
        ),
        (
            "return_entropy",
            lambda v: pk.linear_preference_loss(h[:, None], w, lab[:, None], return_entropy=v),
        ),
        ("reduction", lambda v: pk.dpo_loss(s, s, s, s, beta=0.1, reduction=v)),
    ]


@pytest.mark.parametrize("i", range(len(_scalar_cases())))
def test_every_scalar_argument_is_type_checked(i):
    """A string where a number, flag or mode belongs (e.g. temperature="0.7", accepted by float())
    is a TypeError / ValueError naming the argument; so is a bool or a list for a number."""
    name, call = _scalar_cases()[i]
    for bad in ("0.7", "hot", [1], object()):
        with pytest.raises((TypeError, ValueError), match=name):
            call(bad)
