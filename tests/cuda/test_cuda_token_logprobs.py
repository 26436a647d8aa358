"""token_logprobs on the GPU: the CUDA (cpp) and Triton kernels against the float64 reference,
forward and gradient, up to the Qwen vocabulary (V=152064), strided logits, out-of-range labels and
a CUDA-graph capture (no host sync on the path)."""

import pytest
import torch
from support.gpu import DEVICE, DRY_RUN, MARKS, big, close, close_scaled, graph_replay, require
from support.utils import GRAD_TOL, TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.token_logprobs import naive as ref

pytestmark = MARKS
OP = "token_logprobs"
BACKENDS = ["cpp", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (leading dims, V)
CASES = [((4, 33), 7), ((8, 17), 4099), big((64,), 32000), big((2, 9), 152064), ((3,), 1)]


def _inputs(shape, V, dtype, strided=False, ignore=0.2):
    """Logits (a view skipping one position of the second-to-last dim when strided) and labels
    with a fraction `ignore` of them -100."""
    full = (torch.randn(*shape[:-1], shape[-1] + int(strided), V, device=DEVICE) * 3).to(dtype)
    logits = full[..., :-1, :] if strided else full
    labels = torch.randint(0, V, shape, device=DEVICE)
    labels[torch.rand(shape, device=DEVICE) < ignore] = -100
    return logits, labels


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,V", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64(backend, shape, V, dtype, strided):
    require(OP, backend)
    T = 0.7
    logits, labels = _inputs(shape, V, dtype, strided)
    x = logits.detach().requires_grad_(True)
    with use_backend(backend), poisoned():
        lp, ent = pk.token_logprobs(x, labels, temperature=T, return_entropy=True)
        g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
        (lp * g_lp + ent * g_ent).sum().backward()
    x64 = logits.double().requires_grad_(True)
    lp64, ent64, _ = ref.forward(x64, labels, T)
    (lp64 * g_lp.double() + ent64 * g_ent.double()).sum().backward()
    close(lp, lp64, **TOL[dtype])
    close(ent, ent64, **TOL[dtype])
    assert x.grad.dtype == dtype
    # relative to the largest gradient: the entropy term -p (log p + H) / T cancels, and at
    # |log p| ~ 30 its float32 rounding (~1e-6 of the row's scale) exceeds an absolute 1e-6
    # (at least the upstream gradient's: for V = 1 the reference gradient is exactly 0)
    scale = max(float(x64.grad.abs().max()), float(g_lp.abs().max()))
    close_scaled(x.grad, x64.grad, **GRAD_TOL[dtype], scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_labels_give_nan(backend):
    """On the GPU (no host sync to validate labels) a label outside [0, V) gives a NaN row."""
    require(OP, backend)
    logits, labels = _inputs((16,), 1000, torch.bfloat16, ignore=0.0)
    labels[3], labels[7] = 1000, -5
    want = ref.forward(logits.double(), labels)[0]
    assert want[3].isnan() and want[7].isnan()
    if DRY_RUN:  # the CPU validates labels (no sync to avoid there)
        with pytest.raises(IndexError, match="labels"), use_backend(backend):
            pk.token_logprobs(logits, labels)
        return
    with use_backend(backend), poisoned():
        lp = pk.token_logprobs(logits, labels)
    close(lp, want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_capture(backend):
    require(OP, backend)
    logits, labels = _inputs((64,), 5000, torch.bfloat16)
    with use_backend(backend):
        out = graph_replay(
            lambda: pk.token_logprobs(logits, labels),
            lambda: logits.copy_(torch.randn_like(logits)),
        )
    close(out, ref.forward(logits.double(), labels)[0], **TOL[torch.bfloat16])
