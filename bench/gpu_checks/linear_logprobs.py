"""GPU check for linear_token_logprobs and causal_lm_logprobs (run by bench/gpu_check.py).

Correctness: tests/cuda/test_cuda_linear_logprobs.py.
Sanitizer: small calls of the CUDA path (whole-vocabulary tiles and vocabulary chunks).
Timing: the issue's target size N=32768, H=4096, V=152064 bf16, forward+backward, against
materialised logits + eager log_softmax and materialised logits + our token_logprobs; the
targets are peak memory <= 1/10 of the materialised path, time <= eager and <= 1.35x fused.
The CUDA path is chunked cuBLAS (bf16 GEMMs with float32 output) + reduction kernels (Triton by
default, CUDA C++ timed beside it), next to TRL 1.16's fused LM head; if it misses the time target,
a fused tl.dot kernel is the next thing to try (see triton_kernels.py).
"""

from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels.token_logprobs import naive as tl_ref

OP = "linear_token_logprobs"
DEVICE = "cuda"


def _inputs(N, H, V, dtype, bias, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(N, H, device=DEVICE, generator=g).to(dtype)
    W = (torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype)
    b = torch.randn(V, device=DEVICE, generator=g).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    y[::7] = -100
    return h, W, b, y


def sanitize_workload():
    for dtype in (torch.float32, torch.bfloat16):
        for budget in (None, 20_000):
            h, W, b, y = _inputs(37, 67, 1001, dtype, True)
            h.requires_grad_(), W.requires_grad_()
            with pk.use_backend(**{OP: "cpp"}):  # the CUDA C++ reductions (default: Triton)
                lp, ent = pk.linear_token_logprobs(
                    h, W, y, bias=b, return_entropy=True, max_chunk_bytes=budget
                )
                (lp.sum() + ent.sum()).backward()


def _with_backend(backend, f):
    with pk.use_backend(**{OP: backend}):
        return f()


def _trl_chunked_logprob(outputs=("log_probs", "entropy")):
    """TRL 1.16's fused LM head (what GRPOTrainer runs with fused_lm_head=True) as add_fused_lm_head
    calls it, asked for `outputs` (its names; run() returns them in that order), or None without
    TRL. Its file, trl/kernels/chunked_logprob.py, needs only torch and
    transformers, but `import trl.kernels` pulls in datasets (not on the device image): the file is
    loaded under a stand-in package whose trainer.utils.maybe_gather_lm_head_ctx (the ZeRO-3 gather
    its backward enters) is the null context it is outside DeepSpeed."""
    import contextlib
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = "_trl_standin"
    for name in (pkg, f"{pkg}.kernels", f"{pkg}.trainer", f"{pkg}.trainer.utils"):
        sys.modules.setdefault(name, types.ModuleType(name)).__path__ = []
    sys.modules[f"{pkg}.trainer.utils"].maybe_gather_lm_head_ctx = lambda *a: (
        contextlib.nullcontext()
    )
    path = f"{list(spec.submodule_search_locations)[0]}/kernels/chunked_logprob.py"
    mod_spec = importlib.util.spec_from_file_location(f"{pkg}.kernels.chunked_logprob", path)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = mod
    mod_spec.loader.exec_module(mod)
    chunk = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in 1.16

    # its forward returns (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), None for
    # each optional output not asked for
    order = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

    def run(h, W, y):
        out = mod.ChunkedLogProbFunction.apply(h, W, None, y, 1.0, chunk, None, 1.0, outputs)
        return tuple(out[order.index(name)] for name in outputs)

    return run


def timing(ctx, N=32768, H=4096, V=152064):
    dtype = torch.bfloat16
    h, W, _, y = _inputs(N, H, V, dtype, False)
    h.requires_grad_(), W.requires_grad_()

    def fwd_bwd(f):
        def run():
            h.grad = W.grad = None
            lp, ent = f()
            (lp.sum() + ent.sum()).backward()

        return run

    y_in = y.clamp(min=0)  # the eager baseline (and TRL) take labels in [0, V): no ignore_index

    def mat_eager():
        z = h @ W.T
        return tl_ref.eager_logprobs(z, y_in), tl_ref.eager_entropy(z)

    fns = {
        "linear_token_logprobs": fwd_bwd(
            lambda: pk.linear_token_logprobs(h, W, y, return_entropy=True)
        ),
        # the CUDA C++ reductions (the default before bench/results/gpu_H200.md)
        "linear_token_logprobs cpp": lambda: _with_backend(
            "cpp", fwd_bwd(lambda: pk.linear_token_logprobs(h, W, y, return_entropy=True))
        ),
        # bf16 logits tiles, as TRL's fused head computes them (mm_buf in the compute dtype)
        'linear_token_logprobs logits_dtype="input"': fwd_bwd(
            lambda: pk.linear_token_logprobs(h, W, y, return_entropy=True, logits_dtype="input")
        ),
        "logits + token_logprobs": fwd_bwd(
            lambda: pk.token_logprobs(h @ W.T, y, return_entropy=True)
        ),
        "eager: logits + log_softmax": fwd_bwd(mat_eager),
    }
    trl_fused = _trl_chunked_logprob()
    if trl_fused is not None:
        fns["trl ChunkedLogProbFunction (fused_lm_head)"] = fwd_bwd(lambda: trl_fused(h, W, y_in))
    ctx.bench(OP, f"N={N} H={H} V={V} bf16 +entropy fwd+bwd", fns, warmup=1, rep=5)

    # log-probs only, next to Liger's fused linear cross-entropy (a summed loss: no entropy, and
    # per-token upstream gradients are not supported there)
    def ours_lp():
        h.grad = W.grad = None
        pk.linear_token_logprobs(h, W, y).sum().backward()

    fns = {"linear_token_logprobs": ours_lp}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

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
        ctx.bench(
            OP,
            f"N={N} H={H} V={V} bf16 forward",
            {
                "linear_token_logprobs": lambda: pk.linear_token_logprobs(h, W, y),
                "logits + token_logprobs": lambda: pk.token_logprobs(h @ W.T, y),
                "eager: logits + log_softmax": lambda: tl_ref.eager_logprobs(h @ W.T, y_in),
            },
            warmup=1,
            rep=5,
        )


def profile(ctx, N=32768, H=4096, V=152064):
    """The top kernels of one bf16 fwd+bwd of linear_token_logprobs (its default backend)."""
    from gpu_checks._profile import top_kernels

    h, W, _, y = _inputs(N, H, V, torch.bfloat16, False)
    h.requires_grad_(), W.requires_grad_()

    def run():
        h.grad = W.grad = None
        lp, ent = pk.linear_token_logprobs(h, W, y, return_entropy=True)
        (lp.sum() + ent.sum()).backward()

    ctx.profile(OP, f"N={N} H={H} V={V} bf16 +entropy fwd+bwd", top_kernels(run, DEVICE))
