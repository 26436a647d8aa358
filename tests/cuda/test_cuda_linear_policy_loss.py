"""linear_policy_loss (the policy loss from hidden states, gradients formed in the forward) on the
GPU: every backend that runs there (cpp: cuBLAS + the CUDA token_logprobs kernels; triton: cuBLAS +
the Triton kernels; eager: cuBLAS + eager tile math) against autograd of the float64 reference
(ppo_kernels/linear_policy_loss/naive.py) computed on the GPU: loss, statistics and the
gradients of hidden, weight and bias. Loss types with a token-level and a sequence-level
(two-pass) configuration, whole-vocabulary tiles and vocabulary chunks, float32 and bf16 / fp16
with both logits dtypes, the exact KL to a reference head, the production width H=4096,
V=152064, and a CUDA-graph capture of forward + backward (no host sync)."""

import pytest
import torch
from support.gpu import DEVICE, MARKS, big, close, graph_replay, require
from support.utils import GEMM_TOL, load_test_file, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend

# autograd of the float64 reference, any device
_reference = load_test_file("ops/test_linear_policy_loss.py")._reference

pytestmark = MARKS
OP = "linear_policy_loss"
BACKENDS = ["cpp", "triton", "eager"]
B, T, H, V = 4, 75, 257, 5003
# ~10 rows of float32 logits per chunk: vocabulary chunks, sequences longer than a chunk
CHUNKS = 200_000

# (loss_type, options): the clipped types, the sequence-level ones (a second pass over a
# sequence longer than a chunk), and a batch statistic (kl_cov)
TYPES = [
    ("ppo", dict(dual_clip=3.0)),
    ("grpo", dict(importance_sampling_level="sequence")),
    ("bnpo", {}),
    ("cispo", dict(clip_low=1.0, clip_high=4.0)),
    ("sapo", {}),
    ("gspo", {}),
    ("geo_mean", {}),
    ("kl_cov", dict(kl_cov_ratio=0.2)),
]


def _ids(p):
    t, kw = p
    return t + ("-" + "-".join(kw) if kw else "")


def _inputs(N=B * T, H=H, V=V, dtype=torch.float32, bias=True, seed=0, T=T):
    """Inputs made on the CPU (the same numbers on any device), old / reference log-probs near
    the current ones (ratios near 1, some clipped), a masked tail and an ignored label."""
    g = torch.Generator().manual_seed(seed)
    shape = (N // T, T)
    h = torch.randn(*shape, H, generator=g) * 0.5
    W = torch.randn(V, H, generator=g) / H**0.5
    b = torch.randn(V, generator=g) * 0.3 if bias else None
    labels = torch.randint(0, V, shape, generator=g)
    labels.view(-1)[3] = -100
    adv = torch.randn(shape, generator=g)
    noise = torch.randn(2, *shape, generator=g) * 0.3
    mask = torch.rand(shape, generator=g) > 0.25
    mask.view(-1)[0] = True
    mask[-1, T // 2 :] = False
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    h, W, b, labels, adv, noise, mask = map(dev, (h, W, b, labels, adv, noise, mask))
    with torch.no_grad():  # float64 log-probs of the float32 numbers
        z = h.double() @ W.double().T + (0 if b is None else b.double())
        lp = z.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    old, ref = (lp + noise[0]).float(), (lp + noise[1]).float()
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return dict(
        h=cast(h), W=cast(W), b=cast(b), labels=labels, adv=adv, old=old, ref=ref, mask=mask
    )


def _leaves(x):
    return [None if t is None else t.detach().requires_grad_() for t in (x["h"], x["W"], x["b"])]


def _ours(x, backend, **kw):
    h, W, b = _leaves(x)
    with use_backend(**{OP: backend}), poisoned():
        loss, stats = pk.linear_policy_loss(
            h, W, x["labels"], x["adv"], x["old"], x["mask"], bias=b, **kw
        )
        grads = torch.autograd.grad(loss, [t for t in (h, W, b) if t is not None])
    return loss, stats, grads


def _check(x, backend, tol, grad_rel, **kw):
    """Loss and every statistic within tol of the reference; each gradient in the input dtype,
    within grad_rel of the largest reference gradient (they are sums whose terms cancel)."""
    loss, stats, grads = _ours(x, backend, **kw)
    rloss, rstats, rgrads = _reference(x, **kw)
    assert loss.dtype == torch.float32
    close(loss, rloss, **tol)
    missing = sorted(set(stats) - set(rstats))
    assert not missing, missing
    for k, v in stats.items():
        assert not v.requires_grad, k
        close(v, rstats[k].to(v.device).reshape(v.shape), **tol)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == x["h"].dtype and not g.isnan().any(), name
        close(g, r, atol=grad_rel * float(r.abs().max()), rtol=0)


@pytest.mark.parametrize("budget", [None, CHUNKS])
@pytest.mark.parametrize("case", TYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_types_match_float64(backend, case, budget):
    """float32, with a k3 KL to given reference log-probs and an entropy bonus."""
    require(OP, backend)
    loss_type, opts = case
    x = _inputs()
    kw = dict(ref_logprobs=x["ref"], kl_coef=0.1, entropy_coef=0.01, max_chunk_bytes=budget)
    _check(x, backend, GEMM_TOL, 1e-4, loss_type=loss_type, **opts, **kw)


@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("budget", [None, CHUNKS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision(backend, budget, dtype, logits_dtype):
    """bf16 / fp16 inputs: the reference sees the same rounded inputs (and with "input" tiles
    rounds its logits to the input dtype, as the op's tiles are); gradients are rounded to the
    input dtype on output. The tolerances are test_linear_policy_loss.py's on the CPU."""
    require(OP, backend)
    x = _inputs(dtype=dtype)
    f32 = logits_dtype == "float32"
    tol = dict(atol=2e-5, rtol=2e-5) if f32 else dict(atol=3e-2, rtol=2e-5)
    kw = dict(ref_logprobs=x["ref"], kl_coef=0.1, entropy_coef=0.01, max_chunk_bytes=budget)
    _check(
        x, backend, tol, 1e-2 if f32 else 3e-2, loss_type="grpo", logits_dtype=logits_dtype, **kw
    )


@pytest.mark.parametrize("opts", [{}, dict(softcap=2.5, temperature=0.8)])
@pytest.mark.parametrize("budget", [None, CHUNKS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_kl_against_a_reference_head(backend, budget, opts):
    """ref_hidden / ref_weight: the exact KL over the vocabulary, the reference logits tile
    computed beside the policy tile (no gradient to it); the reference width differs from H."""
    require(OP, backend)
    x = _inputs(bias=False)
    g = torch.Generator().manual_seed(3)
    rh = (torch.randn(B, T, 129, generator=g)).to(DEVICE)
    rW = (torch.randn(V, 129, generator=g) * 0.1).to(DEVICE)
    rb = (torch.randn(V, generator=g) * 0.2).to(DEVICE)
    kw = dict(ref_hidden=rh, ref_weight=rW, ref_bias=rb, kl_coef=0.3, entropy_coef=0.02)
    _check(x, backend, GEMM_TOL, 1e-4, loss_type="grpo", max_chunk_bytes=budget, **opts, **kw)


@pytest.mark.parametrize("logits_dtype", ["float32", "input"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("N", [big(2048)])
def test_production_width(backend, N, logits_dtype):
    """H=4096, V=152064 in bf16 (a large model's width and vocabulary; 2048 tokens), the default
    chunk budget, against the float64 reference on the GPU."""
    require(OP, backend)
    x = _inputs(N=N, H=4096, V=152064, dtype=torch.bfloat16, bias=False, T=256)
    f32 = logits_dtype == "float32"
    tol = dict(atol=2e-5, rtol=2e-5) if f32 else dict(atol=3e-2, rtol=2e-5)
    kw = dict(ref_logprobs=x["ref"], kl_coef=0.04, kl_estimator="k3", logits_dtype=logits_dtype)
    _check(x, backend, tol, 1e-2 if f32 else 3e-2, loss_type="bnpo", **kw)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_cuda_graph_capture(backend, level):
    """Forward and backward of the fused loss captured in one CUDA graph (no host sync in the
    chunk loop, the loss math or the autograd node); the replay on changed inputs gives what an
    eager call on those inputs gives."""
    require(OP, backend)
    x = _inputs(bias=False)
    h, W, _ = _leaves(x)
    adv = x["adv"].clone()

    def step():
        loss, stats = pk.linear_policy_loss(
            h,
            W,
            x["labels"],
            adv,
            x["old"],
            x["mask"],
            loss_type="grpo",
            importance_sampling_level=level,
            ref_logprobs=x["ref"],
            kl_coef=0.1,
            entropy_coef=0.01,
            max_chunk_bytes=CHUNKS,
        )
        gh, gw = torch.autograd.grad(loss, [h, W])
        return loss, stats["clip_frac"], gh, gw

    new_adv = torch.randn(adv.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with use_backend(**{OP: backend}):
        got = graph_replay(step, change_inputs=lambda: adv.copy_(new_adv))
        want = step()  # adv now holds new_adv
    for a, b in zip(got, want):
        close(a, b, **GEMM_TOL)
