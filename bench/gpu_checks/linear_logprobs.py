"""GPU check for linear_token_logprobs and causal_lm_logprobs (run by bench/gpu_check.py).

Correctness: every CUDA backend against the float64 reference on materialised logits, forward and
gradients, whole-vocabulary tiles and vocabulary chunks, odd H and V, bias, temperature.
Timing: the issue's target size N=32768, H=4096, V=152064 bf16, forward+backward, against
materialised logits + eager log_softmax and materialised logits + our token_logprobs; the
targets are peak memory <= 1/10 of the materialised path, time <= eager and <= 1.35x fused.
The CUDA path is chunked cuBLAS (bf16 GEMMs with float32 output) + reduction kernels; if it misses
the time target, a fused tl.dot kernel is the next thing to try (see triton_kernels.py).
"""
from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import _backend, use_backend
from ppo_kernels.linear_logprobs import reference as ref
from ppo_kernels.token_logprobs import reference as tl_ref

OP = "linear_token_logprobs"
DEVICE = "cuda"  # a CPU dry run of this file sets "cpu"


def _inputs(N, H, V, dtype, bias, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(N, H, device=DEVICE, generator=g).to(dtype)
    W = (torch.randn(V, H, device=DEVICE, generator=g) / H ** 0.5).to(dtype)
    b = torch.randn(V, device=DEVICE, generator=g).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    y[::7] = -100
    return h, W, b, y


def _backends():
    return [b for b in _backend.BACKENDS if _backend.available(OP, b, DEVICE)[0]]


CASES = [(300, 257, 5003, torch.float32, True, None), (300, 257, 5003, torch.bfloat16, False, None),
         (300, 257, 5003, torch.float16, True, 200_000), (300, 257, 5003, torch.bfloat16, True, 200_000),
         (1024, 4096, 152064, torch.bfloat16, False, None)]


def correctness(ctx, cases=CASES):
    for N, H, V, dtype, bias, budget in cases:
        h, W, b, y = _inputs(N, H, V, dtype, bias)
        g_lp = torch.randn(N, device=DEVICE)
        g_ent = torch.randn(N, device=DEVICE)
        leaves = [t.detach().double().requires_grad_() for t in (h, W, b) if t is not None]
        hd, Wd = leaves[0], leaves[1]
        bd = leaves[2] if bias else None
        lp_r, ent_r, _ = tl_ref.forward(ref.logits(hd, Wd, bd), y, 0.9, -100, True)
        ((lp_r * g_lp).sum() + (ent_r * g_ent).sum()).backward()
        grads_r = [t.grad for t in leaves]
        # bf16/fp16: the logits-gradient tile is rounded to the input dtype for the backward GEMMs
        lowp = dtype != torch.float32
        for backend in _backends():
            case = f"N={N} H={H} V={V} {str(dtype)[6:]} bias={bias} chunk={budget}"
            ours = [t.detach().clone().requires_grad_() for t in (h, W, b) if t is not None]
            try:
                with use_backend(**{OP: backend}):
                    lp, ent = pk.linear_token_logprobs(ours[0], ours[1], y, bias=ours[2] if bias else None,
                                                       temperature=0.9, return_entropy=True,
                                                       max_chunk_bytes=budget)
                    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                ctx.fail(OP, case, backend, f"{type(e).__name__}: {e}")
                continue
            ctx.compare(OP, case + " logprobs", backend, lp, lp_r, 1e-4, 1e-4)
            ctx.compare(OP, case + " entropy", backend, ent, ent_r, 1e-4, 1e-4)
            for name, t, r in zip(("hidden", "weight", "bias"), ours, grads_r):
                scale = float(r.abs().max())
                ctx.compare(OP, f"{case} grad_{name}", backend, t.grad, r,
                            (2e-2 if lowp else 1e-5) * scale, 2e-2 if lowp else 1e-4)
    # causal_lm_logprobs on a small random Qwen2 (bf16 backbone) against its own logits
    try:
        import transformers
        cfg = transformers.Qwen2Config(vocab_size=1001, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg).to(DEVICE)
        ids = torch.randint(0, 1001, (2, 33), device=DEVICE)
        lp = pk.causal_lm_logprobs(model, ids)
        logp = model(ids).logits[:, :-1].double().log_softmax(-1)
        ctx.compare("causal_lm_logprobs", "qwen2 tiny fp32", "default", lp,
                    logp.gather(-1, ids[:, 1:, None]).squeeze(-1), 1e-4, 1e-4)
    except ImportError:
        pass


def sanitize_workload():
    for dtype in (torch.float32, torch.bfloat16):
        for budget in (None, 20_000):
            h, W, b, y = _inputs(37, 67, 1001, dtype, True)
            h.requires_grad_(), W.requires_grad_()
            lp, ent = pk.linear_token_logprobs(h, W, y, bias=b, return_entropy=True, max_chunk_bytes=budget)
            (lp.sum() + ent.sum()).backward()


def _square(f):
    """Run f with square-ish tiles (rows ~ vocabulary chunk) instead of whole-vocabulary tiles."""
    import os
    old = os.environ.get("PPO_KERNELS_LINEAR_TILES")
    os.environ["PPO_KERNELS_LINEAR_TILES"] = "square"
    try:
        return f()
    finally:
        if old is None:
            del os.environ["PPO_KERNELS_LINEAR_TILES"]
        else:
            os.environ["PPO_KERNELS_LINEAR_TILES"] = old


def timing(ctx):
    N, H, V = 32768, 4096, 152064
    dtype = torch.bfloat16
    h, W, _, y = _inputs(N, H, V, dtype, False)
    h.requires_grad_(), W.requires_grad_()

    def fwd_bwd(f):
        def run():
            h.grad = W.grad = None
            lp, ent = f()
            (lp.sum() + ent.sum()).backward()
        return run

    def mat_eager():
        z = h @ W.T
        return tl_ref.eager_logprobs(z, y), tl_ref.eager_entropy(z)

    fns = {
        "linear_token_logprobs": fwd_bwd(lambda: pk.linear_token_logprobs(h, W, y, return_entropy=True)),
        "linear_token_logprobs 2GiB chunks": fwd_bwd(lambda: pk.linear_token_logprobs(
            h, W, y, return_entropy=True, max_chunk_bytes=2 << 30)),
        "linear_token_logprobs square 1GiB tiles": lambda: _square(fwd_bwd(
            lambda: pk.linear_token_logprobs(h, W, y, return_entropy=True, max_chunk_bytes=1 << 30))),
        "logits + token_logprobs": fwd_bwd(lambda: pk.token_logprobs(h @ W.T, y, return_entropy=True)),
        "eager: logits + log_softmax": fwd_bwd(mat_eager),
    }
    ctx.bench(OP, f"N={N} H={H} V={V} bf16 +entropy fwd+bwd", fns, warmup=1, rep=5)

    # log-probs only, next to Liger's fused linear cross-entropy (a summed loss: no entropy, and
    # per-token upstream gradients are not supported there)
    def ours_lp():
        h.grad = W.grad = None
        pk.linear_token_logprobs(h, W, y).sum().backward()

    fns = {"linear_token_logprobs": ours_lp}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_run():
            h.grad = W.grad = None
            out = liger(W, h, y)
            (out[0] if isinstance(out, tuple) else out).backward()
        fns["liger FusedLinearCrossEntropy (sum)"] = liger_run
    except ImportError:
        pass
    ctx.bench(OP, f"N={N} H={H} V={V} bf16 logprobs-only fwd+bwd", fns, warmup=1, rep=5)
    with torch.no_grad():
        ctx.bench(OP, f"N={N} H={H} V={V} bf16 forward", {
            "linear_token_logprobs": lambda: pk.linear_token_logprobs(h, W, y),
            "logits + token_logprobs": lambda: pk.token_logprobs(h @ W.T, y),
            "eager: logits + log_softmax": lambda: tl_ref.eager_logprobs(h @ W.T, y),
        }, warmup=1, rep=5)
