"""No size limit: the boundaries where 32-bit index arithmetic or a float32 position
would break, on every CPU backend that can run the size here (Triton's interpreter copies whole
storages and runs Python per program, so its large cases run on a GPU: tests/cuda).

- token_logprobs on strided views whose element offsets pass 2^31 (a 2^31-element storage costs
  no memory until touched: only the rows read are written);
- GAE on one packed stream of 2^24 + 1 tokens (positions past float32's exact integers);
- linear_token_logprobs at N = 16384, V = 152064 (N x V = 2.5 x 10^9 logits, past 2^31, 10 GB as
  float32; it must run within 1 GiB) with gradients, checked on rows at both ends of the
  stream; the fused policy loss linear_policy_loss at the same size.
"""

import pytest
import torch
from support.utils import GEMM_GRAD_TOL, GEMM_TOL, TOL, cpu_backends, peak_extra_bytes, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.gae import naive as GR
from ppo_kernels.token_logprobs import naive as TR

BIG = 2**31 + 4096  # elements past int32's range

pytestmark = pytest.mark.slow


def _cpu_large(op):
    return [b for b in cpu_backends(op) if b != "triton"]


@pytest.mark.parametrize("backend", _cpu_large("token_logprobs"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_rows_past_2_31_elements(backend, dtype):
    V = 1000
    storage = torch.empty(BIG + V, dtype=dtype)  # virtual memory: only two rows are touched
    # rows at element offsets 0, 2^31 - 512 (straddling 2^31) and BIG (past it)
    offsets = [0, 2**31 - 512, BIG]
    rows = torch.stack([torch.randn(V) * 3 for _ in offsets]).to(dtype)
    for off, r in zip(offsets, rows):
        storage[off : off + V] = r
    # a [3, V] view with irregular row offsets: as a [3, 1, V] gather of strided pieces
    views = [storage.as_strided((1, V), (V, 1), off) for off in offsets]
    labels = torch.tensor([3, V - 1, 0])
    want_lp, want_ent, _ = TR.forward(rows.double(), labels, 1.0, -100, True)
    with use_backend(token_logprobs=backend), poisoned():
        for i, v in enumerate(views):
            x = v.detach().requires_grad_(True)
            lp, ent = pk.token_logprobs(x, labels[i : i + 1], return_entropy=True)
            torch.testing.assert_close(lp.double(), want_lp[i : i + 1], **TOL[dtype])
            torch.testing.assert_close(ent.double(), want_ent[i : i + 1], **TOL[dtype])
            (lp.sum() + ent.sum()).backward()
            ref = rows[i : i + 1].double().requires_grad_(True)
            rl, re, _ = TR.forward(ref, labels[i : i + 1], 1.0, -100, True)
            (rl.sum() + re.sum()).backward()
            torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-2, rtol=2e-2)
    # one view of two rows 2^31 + 4096 elements apart: the stride itself passes int32
    two = storage.as_strided((2, V), (BIG, 1), 0)
    with use_backend(token_logprobs=backend):
        lp = pk.token_logprobs(two, labels[[0, 2]])
    torch.testing.assert_close(lp.double(), want_lp[[0, 2]], **TOL[dtype])


@pytest.mark.parametrize("backend", _cpu_large("gae"))
def test_gae_packed_stream_of_2_24_tokens(backend):
    g = torch.Generator().manual_seed(0)
    N = 2**24 + 1
    # rows of 1 .. 4095 tokens, the last one reaching the end of the stream
    lens = torch.randint(1, 4096, (N // 2048 + 2,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    cu = cu[cu < N]
    cu = torch.cat([cu, torch.tensor([N])])
    rewards = torch.randn(N, generator=g) * 0.1
    values = torch.randn(N, generator=g)
    mask = torch.rand(N, generator=g) > 0.1
    kw = dict(gamma=0.99, lam=0.95, cu_seqlens=cu)
    with use_backend(gae=backend), poisoned():
        adv, ret = pk.gae(rewards, values, mask, **kw)
    # the float64 eager implementation, on the first and the last rows of the stream
    for r in (0, 1, cu.numel() - 3, cu.numel() - 2):
        a, b = int(cu[r]), int(cu[r + 1])
        wa, wr, _ = GR.gae_sequential(
            rewards[None, a:b].double(),
            values[None, a:b].double(),
            mask[None, a:b],
            gamma=0.99,
            lam=0.95,
        )
        torch.testing.assert_close(adv[a:b].double(), wa[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ret[a:b].double(), wr[0], atol=1e-4, rtol=1e-4)
    assert int(cu[-2]) > 2**24 - 4096  # the last row's positions pass float32's exact integers


# cpp only: the eager backend's chunks through torch ops are far slower at this size (its index
# arithmetic is torch's); cpp fits the suite's time
@pytest.mark.parametrize("backend", [b for b in _cpu_large("linear_token_logprobs") if b == "cpp"])
def test_linear_token_logprobs_at_n_16384_v_152064(backend):
    torch.manual_seed(0)
    N, V, H = 16384, 152064, 16
    hidden = (torch.randn(N, H) * 0.5).requires_grad_(True)
    weight = (torch.randn(V, H) * 0.5).requires_grad_(True)
    labels = torch.randint(0, V, (N,))
    # rows checked against float64: at both ends of the stream (offsets past 2^31 logits); the
    # upstream gradient is zero elsewhere, so the weight gradient's reference needs only them
    check = torch.tensor([0, 1, 2, N // 2, N - 3, N - 2, N - 1])
    g_lp = torch.zeros(N)
    g_lp[check] = torch.randn(check.numel())
    g_ent = torch.zeros(N)
    g_ent[check] = torch.randn(check.numel())
    out = {}

    def run():
        lp, ent = pk.linear_token_logprobs(hidden, weight, labels, return_entropy=True)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        out["lp"], out["ent"] = lp.detach(), ent.detach()

    with use_backend(linear_token_logprobs=backend):
        peak = peak_extra_bytes(run)
    assert peak < 2**30, f"peak {peak / 2**30:.1f} GiB"  # the logits: 9.3 GiB
    h = hidden.detach()[check].double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    z = h @ w.T
    lsm = torch.log_softmax(z, -1)
    lp = lsm.gather(-1, labels[check][:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    torch.testing.assert_close(out["lp"][check].double(), lp.detach(), **GEMM_TOL)
    torch.testing.assert_close(out["ent"][check].double(), ent.detach(), **GEMM_TOL)
    ((lp * g_lp[check].double()).sum() + (ent * g_ent[check].double()).sum()).backward()
    tol = GEMM_GRAD_TOL[torch.float32]
    torch.testing.assert_close(hidden.grad[check].double(), h.grad, **tol)
    others = torch.ones(N, dtype=torch.bool)
    others[check] = False
    assert hidden.grad[others].abs().max() == 0
    torch.testing.assert_close(weight.grad.double(), w.grad, **tol)


# cpp only, as above (the eager backend's tile math through torch ops is far slower here)
@pytest.mark.parametrize("backend", [b for b in _cpu_large("linear_policy_loss") if b == "cpp"])
def test_linear_policy_loss_at_n_16384_v_152064(backend):
    """The fused policy loss (default PPO, a sampled KL and an entropy term) at the same size,
    forward + backward. Only 7 tokens at both ends of the stream are on the mask: every row still
    runs through the chunk loop, the others' gradients are exactly zero, and the float64
    reference on those 7 tokens alone (one sequence: the same token-mean) is the exact check."""
    from ppo_kernels.linear_policy_loss import api, naive

    torch.manual_seed(0)
    B, T, V, H = 16, 1024, 152064, 16
    N = B * T
    hidden = (torch.randn(B, T, H) * 0.5).requires_grad_(True)
    weight = (torch.randn(V, H) * 0.5).requires_grad_(True)
    labels = torch.randint(0, V, (B, T))
    check = torch.tensor([0, 1, 2, N // 2, N - 3, N - 2, N - 1])
    mask = torch.zeros(N, dtype=torch.bool)
    mask[check] = True
    mask = mask.view(B, T)
    h = hidden.detach().view(N, H)[check].double()
    w = weight.detach().double()
    lab = labels.view(-1)[check]
    lp_check = torch.log_softmax(h @ w.T, -1).gather(-1, lab[:, None])[:, 0]
    # old / ref log-probs near the current ones on the checked tokens (some ratios clipped)
    old = torch.randn(N) - 12
    old[check] = (lp_check + 0.3 * torch.randn(check.numel())).float()
    ref = old + 0.2 * torch.randn(N)
    adv = torch.randn(N)
    kw = dict(ref_logprobs=ref.view(B, T), kl_coef=0.1, entropy_coef=0.01)
    out = {}

    def run():
        loss, st = pk.linear_policy_loss(
            hidden, weight, labels, adv.view(B, T), old.view(B, T), mask, **kw
        )
        loss.backward()
        out["loss"], out["st"] = loss.detach(), st

    with use_backend(linear_policy_loss=backend):
        peak = peak_extra_bytes(run)
    assert peak < 2**30, f"peak {peak / 2**30:.1f} GiB"  # the logits: 9.3 GiB
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def sub(t):
        return t.reshape(-1)[check][None]

    call, _, _ = api.arguments(
        hr[None], wr, lab[None], sub(adv), sub(old), sub(mask),
        **dict(kw, ref_logprobs=sub(ref)),
    )  # fmt: skip
    loss, stats = naive.linear_policy_loss(call._replace(hidden=hr), call.generator)
    torch.testing.assert_close(out["loss"].double(), loss.detach(), **GEMM_TOL)
    for name in ("logprobs", "entropy", "kl"):
        got = out["st"][name].reshape(-1)[check].double()
        torch.testing.assert_close(got, stats[name].reshape(-1).detach(), **GEMM_TOL)
    loss.backward()
    tol = GEMM_GRAD_TOL[torch.float32]
    grad_h = hidden.grad.view(N, H)
    torch.testing.assert_close(grad_h[check].double(), hr.grad, **tol)
    others = torch.ones(N, dtype=torch.bool)
    others[check] = False
    assert grad_h[others].abs().max() == 0
    torch.testing.assert_close(weight.grad.double(), wr.grad, **tol)
