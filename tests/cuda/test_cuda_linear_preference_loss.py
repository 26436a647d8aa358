"""linear_preference_loss (the preference loss from hidden states, the gradients formed in the
forward) on the GPU: every backend that runs there (cpp: cuBLAS + the CUDA token_logprobs kernels;
triton: cuBLAS + the Triton ones; eager) against autograd of the float64 reference on materialised
logits (ppo_kernels/linear_preference_loss/naive.py, computed on the CPU from the same inputs): the
loss, the metrics, the per-row and per-token outputs and the gradients of hidden, weight and bias,
every output NaN-poisoned. Paired types with a reference head, given reference log-probs or none,
a sorted type (a first pass), an unpaired one; whole pairs per block and pairs longer than a
block; float32 and bf16 with both logits dtypes; the production width H=4096, V=152064."""

import pytest
import torch
from support import sampler_losses as SL
from support.gpu import DEVICE, MARKS, big, close, require
from support.utils import GEMM_TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend

pytestmark = MARKS
OP = "linear_preference_loss"
BACKENDS = ["cpp", "triton", "eager"]
P, T, H, V = 3, 9, 67, 1001
# ~4 rows of float32 tiles per block: a pair (2 x 9 tokens) is longer than a block
SMALL = 20_000


def _inputs(p=P, t=T, h_=H, v=V, dtype=torch.float32, seed=0):
    """CPU tensors (moved by _on): 2p completions of t tokens (the first half chosen), a prompt,
    completions of different lengths, a masked token, a reference head near the policy, given
    reference log-probs near the policy's and each row's desirability (unpaired types)."""
    g = torch.Generator().manual_seed(seed)
    R = 2 * p
    h = torch.randn(R, t, h_, generator=g)
    W = torch.randn(v, h_, generator=g) / h_**0.5
    b = 0.2 * torch.randn(v, generator=g)
    labels = torch.randint(0, v, (R, t), generator=g)
    labels[:, :2] = -100
    labels[1, t - 3 :] = -100
    mask = torch.ones(R, t, dtype=torch.bool)
    mask[2 % R, -1] = False
    rh = h + 0.3 * torch.randn(R, t, h_, generator=g)
    rW = W + 0.1 * torch.randn(v, h_, generator=g) / h_**0.5
    with torch.no_grad():
        lp = torch.log_softmax((h.double() @ W.double().T + b.double()), -1)
        lp = lp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ref = (lp * ((labels != -100) & mask)).sum(-1) + 0.5 * torch.randn(R, generator=g).double()
    cast = lambda x: x.to(dtype)  # noqa: E731
    return dict(h=cast(h), W=cast(W), b=cast(b), labels=labels, mask=mask, rh=cast(rh),
                rW=cast(rW), ref=ref.float(), y=torch.rand(R, generator=g) > 0.4)  # fmt: skip


def _on(x, device):
    return {k: v.to(device) for k, v in x.items()}


_ref_kw, _reference = SL.preference_ref_kw, SL.preference_reference


def _check(x, backend, tol, grad_rel, extra=None, **kw):
    """The op on DEVICE against the reference on the CPU. extra(x) gives the keyword arguments
    that hold tensors (built from the CPU inputs for the reference, the moved ones for the op);
    logits_dtype is always named: "auto" resolves per device."""
    extra = extra or (lambda x: {})
    xd = _on(x, DEVICE)
    h, W, b = [xd[k].detach().requires_grad_() for k in ("h", "W", "b")]
    with use_backend(**{OP: backend}), poisoned():
        loss, st = pk.linear_preference_loss(h, W, xd["labels"], xd["mask"], bias=b, **extra(xd),
                                             **kw)  # fmt: skip
        grads = torch.autograd.grad(loss, (h, W, b))
    rloss, rstats, rrows, rlp, rgrads = _reference(x, **extra(x), **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    close(loss.cpu(), rloss.detach(), **tol)
    for k, v in rstats.items():
        assert not st[k].requires_grad, k
        close(st[k].cpu(), v, **tol)
    for k in ("logps", "rewards", "ref_logps"):
        if k in st:
            close(st[k].cpu(), rrows[k], **tol)
    close(st["token_logprobs"].cpu(), rlp, **tol)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == x["h"].dtype and not g.isnan().any(), name
        close(g.cpu(), r, atol=grad_rel * float(r.abs().max()), rtol=0)
    return loss, st


# (loss types, the reference, options): the reference's three forms, a sorted type (its first
# pass of log-probs), a reference-free combination, an unpaired type
CASES = {
    "sigmoid-head": (("sigmoid",), "head", {}),
    "ipo-given": (("ipo",), "given", dict(beta=0.5)),
    "orpo+sft-none": (("orpo", "sft"), "none", dict(beta=0.2)),
    "aot-head": (("aot",), "head", dict(label_smoothing=0.2)),
    "sigmoid+sft-ld_alpha-given": (
        ("sigmoid", "sft"),
        "given",
        dict(loss_weights=(1.0, 0.5), ld_alpha=0.3),
    ),  # fmt: skip
}


@pytest.mark.parametrize("budget", [None, SMALL])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_paired_types_match_float64(backend, case, budget):
    require(OP, backend)
    types, ref, kw = CASES[case]
    x = _inputs()
    _check(x, backend, GEMM_TOL, 1e-4, extra=lambda x: _ref_kw(x, ref), loss_type=types,
           max_chunk_bytes=budget, logits_dtype="float32", **kw)  # fmt: skip


@pytest.mark.parametrize("budget", [None, SMALL])
@pytest.mark.parametrize("ref", ["head", "given"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_kto_matches_float64(backend, ref, budget):
    require(OP, backend)
    x = _inputs(seed=1)
    _check(x, backend, GEMM_TOL, 1e-4,
           extra=lambda x: dict(_ref_kw(x, ref), desirable=x["y"]), loss_type="kto",
           reference_point=0.4, beta=0.3, desirable_weight=1.3, undesirable_weight=0.7,
           max_chunk_bytes=budget, logits_dtype="float32")  # fmt: skip


@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend, logits_dtype):
    """bf16 heads: the reference sees the same rounded inputs; input tiles round the logits and
    the gradient tile to bf16 (one rounding of a logit moves its log-prob by up to 2^-8 |z|)."""
    require(OP, backend)
    x = _inputs(dtype=torch.bfloat16, seed=2)
    f32 = logits_dtype == "float32"
    tol = GEMM_TOL if f32 else dict(atol=3e-2, rtol=3e-2)
    _check(x, backend, tol, 2e-2 if f32 else 4e-2, extra=lambda x: _ref_kw(x, "head"),
           logits_dtype=logits_dtype, return_entropy=True)  # fmt: skip


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("t", [big(32)])
def test_production_width(backend, t):
    """H=4096, V=152064 in bf16 (a large model's width and vocabulary; one pair of t tokens), the
    default chunk budget, sigmoid DPO with a reference head."""
    require(OP, backend)
    x = _inputs(p=1, t=t, h_=4096, v=152064, dtype=torch.bfloat16, seed=3)
    _check(x, backend, GEMM_TOL, 2e-2, extra=lambda x: _ref_kw(x, "head"),
           logits_dtype="float32")  # fmt: skip
