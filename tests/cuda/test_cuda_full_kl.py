"""full_kl on the GPU: the CUDA (cpp) and Triton kernels (and the eager composition) against the
float64 definition, forward and both gradients, up to the Qwen vocabulary, with a mask, a
temperature, strided rows at a misaligned offset, and rows with -inf / NaN entries."""

import pytest
import torch
from support.gpu import DEVICE, MARKS, big, close, require
from support.utils import GRAD_TOL, TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.full_kl import naive as R

pytestmark = MARKS
OP = "full_kl"
BACKENDS = ["cpp", "triton", "eager"]
# (dtype, N, V, temperature, masked, strided)
CASES = [
    big(torch.bfloat16, 48, 152064, 1.0, False, False),
    big(torch.float32, 40, 32000, 0.7, True, False),
    (torch.float16, 33, 1001, 1.0, False, True),
    (torch.bfloat16, 70, 5, 1.3, True, False),
]


def _ref64(z, w, temperature, mask):
    """KL(p || q) per row straight from the definition, in float64, with its float64 leaves."""
    z64 = z.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    logp = torch.log_softmax(z64 / temperature, -1)
    logq = torch.log_softmax(w64 / temperature, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    if mask is not None:
        kl = kl * mask.double()
    return kl, z64, w64


@pytest.mark.parametrize("dtype,n,v,t,masked,strided", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64(backend, dtype, n, v, t, masked, strided):
    require(OP, backend)
    if strided:  # rows at an odd offset: their alignment differs from the reference logits'
        z = (torch.randn(n, v + 3, device=DEVICE) * 3).to(dtype)[:, 1 : v + 1]
    else:
        z = (torch.randn(n, v, device=DEVICE) * 3).to(dtype)
    w = (z.float() + 0.4 * torch.randn(n, v, device=DEVICE)).to(dtype)
    mask = (torch.rand(n, device=DEVICE) > 0.3) if masked else None
    want, z64, w64 = _ref64(z, w, t, mask)
    g = torch.randn_like(want)
    want_gz, want_gw = torch.autograd.grad(want, (z64, w64), g)
    zz = z.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    with use_backend(full_kl=backend), poisoned():
        kl = pk.full_kl(zz, ww, temperature=t, mask=mask)
        gz, gw = torch.autograd.grad(kl, (zz, ww), g.float())
    close(kl, want, **TOL[dtype])
    close(gz, want_gz, **GRAD_TOL[dtype])
    close(gw, want_gw, **GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_edge_rows(backend):
    """-inf entries, q = 0 under p > 0 (+inf), an all -inf row and a NaN (NaN), as documented."""
    require(OP, backend)
    z = torch.randn(5, 4099, device=DEVICE)
    w = torch.randn(5, 4099, device=DEVICE)
    z[0, :100] = -float("inf")
    w[1, 7] = -float("inf")
    z[2] = -float("inf")
    w[3, 5] = float("nan")
    want = R.forward(z.double(), w.double())[0]
    assert want[1].isinf() and want[2].isnan() and want[3].isnan()
    with use_backend(full_kl=backend), poisoned():
        close(pk.full_kl(z, w), want, **TOL[torch.float32])
