"""The distillation math around the tile kernels (ppo_kernels/losses/distill_math.py): Liger's
reduction of the per-token values, the cached teacher's top-k divergence with its two treatments
of the mass outside the support, and the sampled-token reverse KL -- against the float64 autograd
reference (losses/distill_naive.py), gradcheck, and TRL's own sparse-divergence functions."""

from __future__ import annotations

import math

import pytest
import torch
from support.peer_stubs import import_peer

from ppo_kernels.losses import distill_math as DM
from ppo_kernels.losses import distill_naive as DN

N, V, K = 6, 29, 5
pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")


def _topk(seed=0, T=0.8):
    g = torch.Generator().manual_seed(seed)
    zs = 2 * torch.randn(N, V, generator=g, dtype=torch.float64)
    zt = zs + torch.randn(N, V, generator=g, dtype=torch.float64)
    lq = torch.log_softmax(zt / T, -1)
    vals, ids = lq.topk(K, -1)
    vals[1, 3:] = -math.inf  # unused slots
    vals[4, 4] = -math.inf
    return zs, ids, vals, T


CASES = [(d, b) for d in ("forward_kl", "reverse_kl", "tv") for b in (0.5,)]
CASES += [("jsd", 0.0), ("jsd", 0.25), ("jsd", 0.9), ("jsd", 1.0)]


@pytest.mark.parametrize("divergence, beta", CASES)
@pytest.mark.parametrize("tail", DM.TOPK_TAILS)
def test_topk_divergence_and_its_gradient_match_the_reference(divergence, beta, tail):
    zs, ids, vals, T = _topk()
    z = zs.clone().requires_grad_()
    ref = DN.topk_divergence(z, ids, vals, divergence, beta, T, tail)
    w = torch.randn(N, dtype=torch.float64)
    (g_ref,) = torch.autograd.grad((w * ref).sum(), z)
    lp = torch.log_softmax(zs / T, -1).gather(-1, ids)
    value, d = DM.sparse_divergence(divergence, beta, lp, vals, tail)
    torch.testing.assert_close(value, ref.detach(), rtol=1e-12, atol=1e-14)
    g = DM.topk_logits_grad(zs, ids, w.unsqueeze(-1) * d, T)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-14)
    assert torch.all(d[vals == -math.inf] == 0)


# not tv: |p - q| has kinks; its derivative is checked against autograd above
@pytest.mark.parametrize("divergence, beta", [c for c in CASES if c[0] != "tv"])
@pytest.mark.parametrize("tail", DM.TOPK_TAILS)
def test_gradcheck_of_the_sparse_divergence(divergence, beta, tail):
    _, ids, vals, _ = _topk(1)
    # support log-probs of a distribution whose top-k mass stays below 1
    lp0 = torch.log_softmax(torch.randn(N, K + 3, dtype=torch.float64), -1)[:, :K]

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, lp):
            v, d = DM.sparse_divergence(divergence, beta, lp, vals, tail)
            ctx.save_for_backward(d)
            return v

        @staticmethod
        def backward(ctx, g):
            return g.unsqueeze(-1) * ctx.saved_tensors[0]

    assert torch.autograd.gradcheck(F.apply, (lp0.clone().requires_grad_(),))


def test_a_full_support_equals_the_full_vocabulary_divergence():
    """With every id in the support (and no mass left), both tails are the exact divergence."""
    zs, _, _, T = _topk(2)
    zt = torch.randn(N, V, dtype=torch.float64)
    lq = torch.log_softmax(zt / T, -1)
    ids = torch.arange(V).expand(N, V)
    lp = torch.log_softmax(zs / T, -1)
    for div in ("forward_kl", "reverse_kl", "jsd", "tv"):
        full = DN.divergence(zs, zt, div, 0.4, T)
        v, _ = DM.sparse_divergence(div, 0.4, lp.gather(-1, ids), lq, "renormalize")
        torch.testing.assert_close(v, full)
        v, _ = DM.sparse_divergence(div, 0.4, lp.gather(-1, ids), lq, "bucket")
        torch.testing.assert_close(v, full, atol=1e-5, rtol=0)  # the clamped 1e-7 bucket


@pytest.mark.parametrize("tail", DM.TOPK_TAILS)
def test_matches_trl_server_distillation_sparse_divergence(tail):
    """TRL's server distillation (`loss_add_tail` bucket, or renormalised on the support)."""
    sd = import_peer("trl.experimental.server_distillation.server_distillation_trainer")
    zs, ids, vals, T = _topk(3)
    lp_full = torch.log_softmax(zs / T, -1)
    valid = vals > -math.inf
    ninf = torch.tensor(-math.inf, dtype=torch.float64)
    ls = torch.where(valid, lp_full.gather(-1, ids), ninf)
    lt = torch.where(valid, vals, ninf)
    if tail == "bucket":
        ls2, support = sd._add_tail_bucket(ls, valid)
        lt2, _ = sd._add_tail_bucket(lt, valid)
    else:
        support = valid
        ls2 = ls - torch.logsumexp(ls, -1, keepdim=True)
        lt2 = lt - torch.logsumexp(lt, -1, keepdim=True)
    for beta in (0.0, 0.5, 1.0):
        trl = sd._jsd_divergence(ls2, lt2, beta, support).sum(-1)
        ours, _ = DM.sparse_divergence("jsd", beta, ls, vals, tail)
        torch.testing.assert_close(ours, trl, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("w_hard, w_soft", [(0.5, 0.5), (0.0, 1.0), (1.0, 0.0), (0.3, 2.0)])
def test_combine_is_liger_reduction(w_hard, w_soft):
    cfg = DM.DistillConfig(divergence="jsd", beta=0.3, temperature=0.9, weight_hard_loss=w_hard,
                           weight_soft_loss=w_soft)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    zs = torch.randn(N, V, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(N, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[2] = -100
    mask = torch.ones(N)
    mask[4] = 0
    loss, soft, hard = DN.distill_loss(zs, zt, labels, divergence_type="jsd", beta=0.3,
                                       temperature=0.9, weight_hard_loss=w_hard,
                                       weight_soft_loss=w_soft, mask=mask)  # fmt: skip
    (g_ref,) = torch.autograd.grad(loss, zs)
    z = zs.detach().clone().requires_grad_()
    keep = (labels != -100) & (mask != 0)
    d = DN.divergence(z, zt, "jsd", 0.3, 0.9)
    h = DN.hard_logprobs(z, torch.where(keep, labels, -100))
    res = DM.combine(cfg, d.detach(), h.detach(), keep)
    torch.testing.assert_close(res.loss, loss.detach())
    torch.testing.assert_close(res.soft_loss, soft.detach())
    torch.testing.assert_close(res.hard_loss, hard.detach())
    (g,) = torch.autograd.grad((res.d_value * d + res.d_hard_logprob * h).sum(), z)
    torch.testing.assert_close(g, g_ref)
    # a block of the batch: its share, with the batch's token count
    half = DM.combine(cfg, d.detach()[:3], h.detach()[:3], keep[:3], num_tokens=keep.sum())
    rest = DM.combine(cfg, d.detach()[3:], h.detach()[3:], keep[3:], num_tokens=keep.sum())
    torch.testing.assert_close(half.loss + rest.loss, res.loss)


def test_combine_without_tokens_is_zero():
    cfg = DM.DistillConfig()
    res = DM.combine(cfg, torch.full((3,), math.nan), torch.full((3,), math.nan), torch.zeros(3))
    assert res.loss.item() == 0 and torch.equal(res.d_value, torch.zeros(3))


def test_sampled_reverse_kl():
    g = torch.Generator().manual_seed(5)
    zs = torch.randn(N, V, generator=g, dtype=torch.float64)
    zt = torch.randn(N, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=g)
    ref = DN.sampled_reverse_kl(zs, zt, y, 0.7)
    lp = torch.log_softmax(zs / 0.7, -1).gather(-1, y[:, None]).squeeze(-1)
    lq = torch.log_softmax(zt / 0.7, -1).gather(-1, y[:, None]).squeeze(-1)
    k, adv = DM.sampled_reverse_kl(lp, lq)
    torch.testing.assert_close(k, ref)
    torch.testing.assert_close(adv, -ref)
    # its mean over samples of the student is the reverse KL
    p = torch.softmax(zs / 0.7, -1)
    kl = DN.divergence(zs, zt, "reverse_kl", temperature=0.7)
    full = (p * (torch.log_softmax(zs / 0.7, -1) - torch.log_softmax(zt / 0.7, -1))).sum(-1)
    torch.testing.assert_close(kl, full)


def test_liger_convention_at_beta_0_and_1():
    assert DM.resolve("jsd", 0.0) == "forward_kl" and DM.resolve("jsd", 1.0) == "reverse_kl"
    assert DM.resolve("jsd", 0.5) == "jsd" and DM.resolve("tv", 0.0) == "tv"
    # they are the limits of jsd / beta and jsd / (1 - beta), not of jsd (which goes to 0)
    zs, zt = torch.randn(2, N, V, dtype=torch.float64)
    eps = 1e-6
    fkl = DN.divergence(zs, zt, "forward_kl")
    rkl = DN.divergence(zs, zt, "reverse_kl")
    torch.testing.assert_close(DN.divergence(zs, zt, "jsd", eps) / eps, fkl, rtol=1e-4, atol=0)
    torch.testing.assert_close(DN.divergence(zs, zt, "jsd", 1 - eps) / eps, rkl, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(divergence="kl"), "divergence: unknown"),
        (dict(beta=1.5), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(weight_hard_loss=math.inf), "weight_hard_loss"),
        (dict(topk_tail="drop"), "topk_tail"),
    ],
)
def test_bad_configurations_name_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        DM.check_config(DM.DistillConfig(**kw))
    with pytest.raises(ValueError, match="tail"):
        DM.sparse_divergence("jsd", 0.5, torch.zeros(1, 2), torch.zeros(1, 2), "drop")
