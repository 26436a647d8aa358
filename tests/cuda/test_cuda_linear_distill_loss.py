"""linear_distill_loss (the distillation loss from hidden states, the student's gradients formed
in the forward) on the GPU: every backend that runs there (cpp: cuBLAS + the Triton distillation
tile kernels, there being no CUDA C++ ones, and the CUDA token_logprobs kernels for a cached
teacher; triton; eager) against autograd of the float64 reference
(ppo_kernels/losses/distill_naive.py) computed on the GPU: the loss, its two terms, the per-token
outputs and the gradients of hidden, weight and bias. A teacher head and a cached top-k teacher,
float32 and bf16 with both logits dtypes, several row blocks, the production width H=4096,
V=152064, and a CUDA-graph capture of forward + backward (no host sync)."""

import math

import pytest
import torch
from support.gpu import DEVICE, MARKS, big, close, graph_replay, require
from support.utils import GEMM_TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.losses import distill_naive as DN

pytestmark = MARKS
OP = "linear_distill_loss"
BACKENDS = ["cpp", "triton", "eager"]
N, H, HT, V, K = 300, 257, 129, 5003, 8
CHUNKS = 400_000  # ~20 rows of two float32 tiles per block


def _inputs(n=N, h_=H, ht=HT, v=V, dtype=torch.float32, T=0.8, seed=0):
    """Inputs made on the CPU (the same numbers on any device): the teacher near the student
    (small divergences), an ignored label, a masked tail, the teacher's top-k at temperature T."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, h_, generator=g) * 0.5
    W = torch.randn(v, h_, generator=g) / h_**0.5
    b = torch.randn(v, generator=g) * 0.3
    th = torch.randn(n, ht, generator=g) * 0.5
    tW = torch.randn(v, ht, generator=g) / ht**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3] = -100
    mask = torch.ones(n, dtype=torch.bool)
    mask[-n // 5 :] = False
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    h, W, b, th, tW, labels, mask = map(dev, (h, W, b, th, tW, labels, mask))
    with torch.no_grad():
        tlp, ids = torch.log_softmax((th.double() @ tW.double().T) / T, -1).topk(K, -1)
    ids[:, 0] = labels.clamp(min=0)  # the sampled token among the ids
    cast = lambda t: t.to(dtype)  # noqa: E731
    return dict(h=cast(h), W=cast(W), b=cast(b), th=cast(th), tW=cast(tW), labels=labels,
                mask=mask, ids=ids, tlp=tlp.float())  # fmt: skip


def _teacher(x, topk):
    if topk:
        return dict(topk_ids=x["ids"], topk_logprobs=x["tlp"])
    return dict(teacher_hidden=x["th"], teacher_weight=x["tW"])


def _check(x, backend, topk, tol, grad_rel, **kw):
    h, W, b = [t.detach().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    with use_backend(**{OP: backend}), poisoned():
        loss, st = pk.linear_distill_loss(h, W, x["labels"], bias=b, mask=x["mask"],
                                          **_teacher(x, topk), **kw)  # fmt: skip
        grads = torch.autograd.grad(loss, (h, W, b))
    ref_kw = {k: v for k, v in kw.items() if k not in ("max_chunk_bytes", "logits_dtype")}
    hd, Wd, bd = [t.detach().double().requires_grad_() for t in (x["h"], x["W"], x["b"])]
    t = _teacher(x, topk)
    rl, soft, hard, d, lp, k = DN.linear_distill_loss(hd, Wd, x["labels"], bias=bd,
                                                      mask=x["mask"], **t, **ref_kw)  # fmt: skip
    rgrads = torch.autograd.grad(rl, (hd, Wd, bd))
    assert loss.dtype == torch.float32
    close(loss, rl, **tol)
    close(st["soft_loss"], soft, **tol)
    close(st["hard_loss"], hard, **tol)
    close(st["divergence"], d, **tol)
    close(st["hard_logprobs"], lp, **tol)
    close(st["sampled_reverse_kl"], k, **tol)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == x["h"].dtype and not g.isnan().any(), name
        close(g, r, atol=grad_rel * float(r.abs().max()), rtol=0)


@pytest.mark.parametrize("budget", [None, CHUNKS])
@pytest.mark.parametrize("div", ["jsd", "reverse_kl", "forward_kl", "tv"])
@pytest.mark.parametrize("topk", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_matches_float64(backend, topk, div, budget):
    require(OP, backend)
    x = _inputs()
    tol = dict(atol=1e-4, rtol=1e-4) if topk else GEMM_TOL
    _check(x, backend, topk, tol, 1e-4, divergence=div, beta=0.3, temperature=0.8,
           weight_hard_loss=0.2, weight_soft_loss=0.9, max_chunk_bytes=budget)  # fmt: skip


@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
@pytest.mark.parametrize("topk", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend, topk, logits_dtype):
    """bf16 heads: the reference sees the same rounded inputs; input tiles round the logits
    and the gradient tile to bf16."""
    require(OP, backend)
    x = _inputs(dtype=torch.bfloat16)
    f32 = logits_dtype == "float32"
    tol = dict(atol=1e-4, rtol=1e-4) if f32 else dict(atol=3e-2, rtol=3e-2)
    _check(x, backend, topk, tol, 2e-2 if f32 else 4e-2, temperature=0.8,
           logits_dtype=logits_dtype)  # fmt: skip


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("n", [big(2048)])
def test_production_width(backend, n):
    """H=4096, V=152064 in bf16 (a large model's width and vocabulary; 2048 tokens), the default
    chunk budget, the teacher head, against the float64 reference on the GPU."""
    require(OP, backend)
    x = _inputs(n=n, h_=4096, ht=4096, v=152064, dtype=torch.bfloat16)
    _check(x, backend, False, dict(atol=1e-4, rtol=1e-4), 2e-2, temperature=1.0)


@pytest.mark.parametrize("topk", [False, True])
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_cuda_graph_capture(backend, topk):
    """Forward and backward captured in one CUDA graph (no host sync in the loop, the loss math
    or the autograd node); the replay on changed inputs gives what an eager call gives."""
    require(OP, backend)
    x = _inputs()
    h, W = x["h"].detach().requires_grad_(), x["W"].detach().requires_grad_()
    th = x["th"].clone()

    def step():
        t = dict(_teacher(x, topk), teacher_hidden=th) if not topk else _teacher(x, topk)
        loss, st = pk.linear_distill_loss(h, W, x["labels"], mask=x["mask"], temperature=0.9,
                                          max_chunk_bytes=CHUNKS, **t)  # fmt: skip
        gh, gw = torch.autograd.grad(loss, [h, W])
        return loss, st["soft_loss"], gh, gw

    new = (th * 1.5).clone()
    with use_backend(**{OP: backend}):
        got = graph_replay(step, change_inputs=lambda: th.copy_(new))
        want = step()
    for a, b in zip(got, want):
        close(a, b, **GEMM_TOL)
    assert math.isfinite(float(want[0]))
