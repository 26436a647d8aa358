"""linear_token_logprobs and causal_lm_logprobs on the GPU: every backend that runs on the GPU
against the float64 reference on materialised logits, forward (log-probs, entropy) and the
gradients of hidden, weight and bias; whole-vocabulary tiles and vocabulary chunks, odd H and V,
bias, temperature, and the production size H=4096, V=152064."""

import pytest
import torch
from support.gpu import DEVICE, MARKS, big, close, close_scaled, require
from support.skips import need
from support.utils import GEMM_GRAD_TOL, GEMM_TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.linear_logprobs import naive as ref
from ppo_kernels.token_logprobs import naive as tl_ref

pytestmark = MARKS
OP = "linear_token_logprobs"
BACKENDS = ["cpp", "triton", "eager"]
# (N, H, V, dtype, bias, max_chunk_bytes): None = one whole-vocabulary tile; 200 kB = chunks
CASES = [
    (300, 257, 5003, torch.float32, True, None),
    (300, 257, 5003, torch.bfloat16, False, None),
    (300, 257, 5003, torch.float16, True, 200_000),
    (300, 257, 5003, torch.bfloat16, True, 200_000),
    big(1024, 4096, 152064, torch.bfloat16, False, None),
]


@pytest.mark.parametrize("N,H,V,dtype,bias,budget", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64(backend, N, H, V, dtype, bias, budget):
    require(OP, backend)
    h = torch.randn(N, H, device=DEVICE).to(dtype)
    W = (torch.randn(V, H, device=DEVICE) / H**0.5).to(dtype)
    b = torch.randn(V, device=DEVICE).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), device=DEVICE)
    y[::7] = -100
    g_lp, g_ent = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    inputs = [t for t in (h, W, b) if t is not None]
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    lp_r, ent_r, _ = tl_ref.forward(ref.logits(*leaves), y, 0.9, -100, True)
    ((lp_r * g_lp).sum() + (ent_r * g_ent).sum()).backward()
    ours = [t.detach().clone().requires_grad_() for t in inputs]
    with use_backend(**{OP: backend}), poisoned():
        lp, ent = pk.linear_token_logprobs(
            ours[0],
            ours[1],
            y,
            bias=ours[2] if bias else None,
            temperature=0.9,
            return_entropy=True,
            max_chunk_bytes=budget,
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    close(lp, lp_r, **GEMM_TOL)
    close(ent, ent_r, **GEMM_TOL)
    for name, t, r in zip(("hidden", "weight", "bias"), ours, leaves):
        assert t.grad.dtype == dtype, name
        close_scaled(t.grad, r.grad, **GEMM_GRAD_TOL[dtype])


@pytest.mark.parametrize("budget", [None, 200_000])
@pytest.mark.parametrize("backend", BACKENDS)
def test_input_logits_dtype_matches_materialised(backend, budget):
    """logits_dtype="input" (bf16 logits and gradient tiles; on CUDA the gradient matmuls add
    into the float32 sums themselves) against float64 on the bf16 logits a trainer materialises
    (h @ W.T + b in bf16): forward within 2 bf16 ulps of the largest logit (cuBLAS may sum a
    row chunk in another order than the whole matrix: a logit can differ by an ulp), gradients
    within the rounding of the gradient tile to bf16."""
    require(OP, backend)
    N, H, V = 300, 257, 5003
    h = torch.randn(N, H, device=DEVICE).to(torch.bfloat16)
    W = (torch.randn(V, H, device=DEVICE) / H**0.5).to(torch.bfloat16)
    b = torch.randn(V, device=DEVICE).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device=DEVICE)
    y[::7] = -100
    g_lp, g_ent = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    z = (h @ W.T + b).double().requires_grad_()
    lp_r, ent_r, _ = tl_ref.forward(z, y, 0.9, -100, True)
    ((lp_r * g_lp).sum() + (ent_r * g_ent).sum()).backward()
    gz = z.grad
    want = (gz @ W.double(), gz.T @ h.double(), gz.sum(0))
    ours = [t.detach().clone().requires_grad_() for t in (h, W, b)]
    with use_backend(**{OP: backend}), poisoned():
        lp, ent = pk.linear_token_logprobs(
            *ours[:2],
            y,
            bias=ours[2],
            temperature=0.9,
            return_entropy=True,
            max_chunk_bytes=budget,
            logits_dtype="input",
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    ulp = 2.0**-8 * float(z.detach().abs().max()) / 0.9
    close(lp, lp_r, atol=2 * ulp, rtol=0)
    close(ent, ent_r, atol=2 * ulp, rtol=0)
    for name, t, r in zip(("hidden", "weight", "bias"), ours, want):
        assert t.grad.dtype == torch.bfloat16, name
        close_scaled(t.grad, r, **GEMM_GRAD_TOL[torch.bfloat16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_lm_logprobs_tiny_qwen2(backend):
    """causal_lm_logprobs on a small random Qwen2 against the float64 log-softmax of its logits."""
    transformers = need("transformers")
    require(OP, backend)
    cfg = transformers.Qwen2Config(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg).to(DEVICE)
    ids = torch.randint(0, 1001, (2, 33), device=DEVICE)
    with torch.no_grad():
        logp = model(ids).logits[:, :-1].double().log_softmax(-1)
        with use_backend(**{OP: backend}), poisoned():
            lp = pk.causal_lm_logprobs(model, ids)
    close(lp, logp.gather(-1, ids[:, 1:, None]).squeeze(-1), **GEMM_TOL)
