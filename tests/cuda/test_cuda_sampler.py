"""token_logprobs under the sampler's distribution, full_kl with per-row temperatures and with the
policy truncated (top_k / top_p / min_p), and linear_token_logprobs with the sampler's options on
the GPU: the CUDA (cpp) and Triton kernels against the documented rules and the float64 values on
their kept set (tests/support/sampler.py, token_logprobs/naive.py's sampler), forward and
gradients, every output NaN-poisoned, up to the Qwen vocabulary."""

import math

import pytest
import torch
from support.gpu import DEVICE, MARKS, big, close, close_scaled, require
from support.sampler import check_against_truth, kept_from_cut, kl64, sampler_op
from support.utils import GEMM_GRAD_TOL, GEMM_TOL, GRAD_TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.token_logprobs import naive as TR

pytestmark = MARKS
BACKENDS = ["cpp", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
# (rows, V)
CASES = [(6, 40), big(8, 4099), big(3, 152064)]
SETTINGS = [
    # (T, top_k, top_p, min_p, sampler)
    (0.7, 5, 1.0, 0.0, "vllm"),
    (1.0, 0, 0.9, 0.02, "vllm"),
    (1.3, 20, 0.9, 0.0, "sglang"),
    (1.0, 0, 0.5, 0.1, "sglang"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,V", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_follows_the_rules(backend, N, V, dtype):
    require("token_logprobs", backend)
    logits = (torch.randn(N, V) * 2).to(dtype)
    labels = torch.randint(0, V, (N,))
    labels[::3] = -100
    for T, k, p, mp, sampler in SETTINGS:
        with use_backend(backend), poisoned():
            outs = sampler_op(
                logits.to(DEVICE), labels.to(DEVICE), T, k, p, mp, sampler, stats_top_k=min(V, 5)
            )
        outs = [o.cpu() for o in outs]
        check_against_truth(logits.float(), labels, T, k, p, mp, sampler, outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_gradients_per_row_parameters(backend, dtype):
    require("token_logprobs", backend)
    N, V = 10, 200
    logits = (torch.randn(N, V) * 2).to(dtype)
    labels = torch.randint(0, V, (N,))
    labels[::4] = -100
    T = torch.rand(N) + 0.5
    k = torch.randint(0, 40, (N,))
    p = torch.rand(N) * 0.8 + 0.2
    x = logits.to(DEVICE, copy=True).requires_grad_(True)
    with use_backend(backend), poisoned():
        lp, ent = pk.token_logprobs(
            x, labels.to(DEVICE), temperature=T.to(DEVICE), top_k=k.to(DEVICE),
            top_p=p.to(DEVICE), return_entropy=True,
        )  # fmt: skip
        g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
        (torch.where(torch.isfinite(lp), lp, 0) * g_lp + ent * g_ent).sum().backward()
        outs = sampler_op(x.detach(), labels.to(DEVICE), 1.0, 0, 1.0, 0.0, "vllm",
                          temps=T.to(DEVICE), ks=k.to(DEVICE), ps=p.to(DEVICE))  # fmt: skip
    kept = kept_from_cut(logits, outs[3].cpu(), outs[4].cpu())
    x64 = logits.double().requires_grad_(True)
    z = x64 / T.double().unsqueeze(-1)
    lse = torch.logsumexp(torch.where(kept, z, torch.full_like(z, -math.inf)), -1, keepdim=True)
    logq = torch.where(kept, z - lse, torch.zeros_like(z))
    q = torch.where(kept, logq.exp(), torch.zeros_like(z))
    valid = labels != -100
    lab = labels.clamp(min=0).unsqueeze(-1)
    use = valid & kept.gather(-1, lab).squeeze(-1)
    lp64 = torch.where(use, logq.gather(-1, lab).squeeze(-1), 0)
    ent64 = torch.where(valid, -(q * logq).sum(-1), 0)
    (lp64 * g_lp.cpu().double() + ent64 * g_ent.cpu().double()).sum().backward()
    assert torch.equal(torch.isfinite(lp.cpu()), use | ~valid)
    close_scaled(x.grad.cpu(), x64.grad, **GRAD_TOL[dtype], scale=float(x64.grad.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_kl_per_row_temperature(backend, dtype):
    require("full_kl", backend)
    B, T, V = 3, 5, 300
    x = (torch.randn(B, T, V) * 2).to(dtype)
    y = (torch.randn(B, T, V) * 2).to(dtype)
    temps = torch.rand(B, T) + 0.5
    xg = x.to(DEVICE, copy=True).requires_grad_(True)
    with use_backend(backend), poisoned():
        kl = pk.full_kl(xg, y.to(DEVICE), temperature=temps.to(DEVICE))
        g = torch.randn_like(kl)
        (kl * g).sum().backward()
    x64 = x.double().requires_grad_(True)
    want = kl64(x64, y, temps.double().unsqueeze(-1))
    (want * g.cpu().double()).sum().backward()
    close(kl.cpu(), want.detach(), atol=5e-5, rtol=2e-5)
    close(xg.grad.cpu(), x64.grad, **GRAD_TOL[dtype])


def _per_row(v, n, dtype):
    """A scalar or an [n] tensor as an [n] tensor."""
    t = torch.as_tensor(v, dtype=dtype)
    return t.expand(n).clone() if t.dim() == 0 else t.reshape(n)


def _reference_kept(z, labels, T, k, p, mp, sampler, rel=1e-4):
    """The float64 sampler's outputs on z [N, V] (CPU) and which rows' kept sets do not move when
    p and min_p are nudged by `rel` (a kernel's float32 masses may put a token on either side of
    a boundary that close: those rows are left out of the comparison)."""
    n = z.shape[0]
    f64 = torch.float64
    inv_t, ks = 1.0 / _per_row(T, n, f64), _per_row(k, n, torch.int64)
    ps, mps = _per_row(p, n, f64), _per_row(mp, n, f64)

    def run(ps, mps):
        return TR.sampler_forward(z, labels, inv_t, ks, ps, mps, sampler, -100, True, True,
                                  True, 3, True)  # fmt: skip

    r = run(ps, mps)
    inner = run(ps * (1 - rel), (mps * (1 + rel)).clamp(max=1))
    outer = run((ps * (1 + rel)).clamp(max=1), mps * (1 - rel))
    kept = kept_from_cut(z, r[3], r[4])
    firm = (kept_from_cut(z, inner[3], inner[4]) == kept_from_cut(z, outer[3], outer[4])).all(-1)
    return r, kept, firm


# linear_token_logprobs: B x T rows, a small head (the forward compares with the float64 sampler
# on the float64 logits of the same inputs)
LB, LT, LH, LV = 4, 6, 32, 500
LINEAR_SETTINGS = {
    "scalar-all-vllm": lambda: (dict(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05), "vllm"),
    "per-row-sglang": lambda: (
        dict(
            temperature=torch.rand(LB, LT) + 0.5,
            top_k=torch.tensor([3, 0, 40, 10]),
            top_p=torch.rand(LB, LT) * 0.6 + 0.3,
            min_p=0.02,
        ),
        "sglang",
    ),
}
# two rows per block: several row blocks
LINEAR_SMALL = 2 * 2 * (LV * 4 + LH * 4)


@pytest.mark.parametrize("budget", [None, LINEAR_SMALL])
@pytest.mark.parametrize("setting", sorted(LINEAR_SETTINGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_sampler_matches_float64(backend, setting, budget):
    """Log-probs, entropy, every statistic and the gradients of hidden, weight and bias against
    float64 autograd of the renormalised softmax on the reference's kept set."""
    require("linear_token_logprobs", backend)
    torch.manual_seed(0)
    opts, sampler = LINEAR_SETTINGS[setting]()
    h = torch.randn(LB, LT, LH) * 0.9
    W = torch.randn(LV, LH) * 0.4
    b = torch.randn(LV) * 0.5
    labels = torch.randint(0, LV, (LB, LT))
    labels[0, 1] = labels[2, 3] = -100
    z64 = (h.double() @ W.double().T + b.double()).reshape(-1, LV)
    labels.view(-1)[4:8] = z64[4:8].argmin(-1)  # outside any truncation
    lab = labels.reshape(-1)
    n = lab.numel()

    def per_tok(v):  # a per-sequence [LB] or per-token [LB, LT] tensor as [n]
        if not torch.is_tensor(v):
            return v
        return v.repeat_interleave(LT) if v.dim() == 1 else v.reshape(-1)

    per_tok = {k: per_tok(v) for k, v in opts.items()}
    r, kept, firm = _reference_kept(z64, lab, per_tok.get("temperature", 1.0),
                                    per_tok.get("top_k", 0), per_tok.get("top_p", 1.0),
                                    per_tok.get("min_p", 0.0), sampler)  # fmt: skip
    assert firm.sum() >= n - 2, "too many rows at a boundary: change the seed"
    g_lp, g_ent = torch.randn(n) * firm, torch.randn(n) * firm
    dev = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in opts.items()}
    hd, Wd, bd = [t.to(DEVICE, copy=True).requires_grad_() for t in (h, W, b)]
    with use_backend(linear_token_logprobs=backend), poisoned():
        lp, ent, st = pk.linear_token_logprobs(
            hd, Wd, labels.to(DEVICE), bias=bd, return_entropy=True, max_chunk_bytes=budget,
            sampler=sampler, stats=("outside", "sum_p2", "lse", "topk", "is_argmax"),
            stats_top_k=3, **dev,
        )  # fmt: skip
        obj = torch.where(torch.isfinite(lp), lp, 0).reshape(-1) * g_lp.to(DEVICE)
        (obj + ent.reshape(-1) * g_ent.to(DEVICE)).sum().backward()
    f = firm.view(LB, LT)

    def cmp(got, want):
        close(got.cpu()[f], want.view(LB, LT, *want.shape[1:])[f], **GEMM_TOL)

    cmp(lp, r[0])
    cmp(ent, r[1])
    cmp(st.sum_p2, r[6])
    cmp(st.lse, r[7])
    cmp(st.top_logprobs, r[9])
    for got, want in ((st.outside, r[5]), (st.top_ids, r[8]), (st.is_argmax, r[10])):
        assert torch.equal(got.cpu()[f], want.view(LB, LT, *want.shape[1:])[f])
    assert int(st.outside.sum()) > 0  # the argmin labels fall outside
    # float64 autograd on the reference's kept set (fixed: the selection has no derivative)
    h64, W64, b64 = [t.double().requires_grad_() for t in (h, W, b)]
    zt = (h64 @ W64.T + b64).reshape(-1, LV) * (1.0 / _per_row(
        per_tok.get("temperature", 1.0), n, torch.float64)).unsqueeze(-1)  # fmt: skip
    lse = torch.logsumexp(torch.where(kept, zt, -math.inf), -1, keepdim=True)
    logq = torch.where(kept, zt - lse, 0)
    q = torch.where(kept, logq.exp(), 0)
    valid = lab != -100
    safe = lab.clamp(min=0).unsqueeze(-1)
    use = valid & kept.gather(-1, safe).squeeze(-1)
    lp64 = torch.where(use, logq.gather(-1, safe).squeeze(-1), 0)
    ent64 = torch.where(valid, -(q * logq).sum(-1), 0)
    (lp64 * g_lp.double() + ent64 * g_ent.double()).sum().backward()
    for got, want in ((hd, h64), (Wd, W64), (bd, b64)):
        close_scaled(got.grad.cpu(), want.grad, **GEMM_GRAD_TOL[torch.float32])


FULL_KL_SAMPLER = {
    "topk-seq-temperature": lambda B, T: (dict(temperature=torch.rand(B) + 0.5, top_k=7), "vllm"),
    "topp-minp-sglang": lambda B, T: (
        dict(temperature=torch.rand(B, T) + 0.5, top_p=torch.rand(B, T) * 0.5 + 0.4, min_p=0.01),
        "sglang",
    ),
    "all-vllm": lambda B, T: (dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02), "vllm"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,V", [(2, 3, 300), big(2, 2, 152064)])
@pytest.mark.parametrize("case", sorted(FULL_KL_SAMPLER))
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_kl_sampler_matches_float64(backend, case, B, T, V, dtype):
    """KL(q || r) with q the policy's tempered softmax renormalised on the sampler's kept set and r
    the reference's whole softmax, a mask, and the gradients of both logits, against float64
    autograd on the reference's kept set."""
    require("full_kl", backend)
    torch.manual_seed(0)
    opts, sampler = FULL_KL_SAMPLER[case](B, T)
    x = (torch.randn(B, T, V) * 2).to(dtype)
    y = (x.float() + torch.randn(B, T, V)).to(dtype)
    mask = torch.tensor([[True, False, True], [True, True, True]])[:B, :T]
    n = B * T
    temps = opts.get("temperature", 1.0)
    if torch.is_tensor(temps) and temps.dim() == 1:  # per sequence
        temps = temps.unsqueeze(-1).expand(B, T)
    flat = lambda v: v.reshape(-1) if torch.is_tensor(v) else v  # noqa: E731
    x64 = x.double().reshape(n, V)
    _, kept, firm = _reference_kept(x64, torch.zeros(n, dtype=torch.long), flat(temps),
                                    opts.get("top_k", 0), flat(opts.get("top_p", 1.0)),
                                    opts.get("min_p", 0.0), sampler)  # fmt: skip
    assert firm.sum() >= n - 1, "too many rows at a boundary: change the seed"
    assert not kept.all(), "the truncation must bite"
    g = torch.randn(B, T) * firm.view(B, T)
    xg = x.to(DEVICE, copy=True).requires_grad_()
    yg = y.to(DEVICE, copy=True).requires_grad_()
    dev = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in opts.items()}
    with use_backend(full_kl=backend), poisoned():
        kl = pk.full_kl(xg, yg, mask=mask.to(DEVICE), sampler=sampler, **dev)
        gx, gy = torch.autograd.grad(kl, (xg, yg), g.to(DEVICE))
    z = x.double().requires_grad_()
    w = y.double().requires_grad_()
    inv_t = 1.0 / _per_row(flat(temps), n, torch.float64).unsqueeze(-1)
    logq = torch.log_softmax(torch.where(kept, z.reshape(n, V) * inv_t, -math.inf), -1)
    logq = torch.where(kept, logq, 0.0)  # (no 0 * inf in the gradient of the dropped terms)
    logr = torch.log_softmax(w.reshape(n, V) * inv_t, -1)
    want = torch.where(kept, logq.exp() * (logq - logr), 0.0).sum(-1).reshape(B, T) * mask
    rz, rw = torch.autograd.grad(want, (z, w), g.double())
    f = firm.view(B, T)
    assert kl.dtype == torch.float32
    close(kl.cpu()[f], want.detach()[f], atol=5e-5, rtol=2e-5)
    assert (kl.cpu()[~mask] == 0).all()
    # (tests/ops/test_full_kl.py's tolerances: bf16 gradients are rounded on output)
    gtol = dict(atol=2e-6, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-5, rtol=2**-7)
    close(gx.cpu(), rz, **gtol)
    close(gy.cpu(), rw, **gtol)
