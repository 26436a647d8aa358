"""GPU check for the sampler's options (run by bench/gpu_check.py): token_logprobs,
linear_token_logprobs and full_kl with top_k / top_p / min_p, per-row temperatures and the head's
statistics.

Correctness: tests/cuda/test_cuda_sampler.py.
Sanitizer: small calls of the CUDA (cpp) sampler kernels, forward and backward: scalar and per-row
parameters, both samplers' rules, every statistic, bf16 and float32; linear_token_logprobs with
the sampler over several row blocks; full_kl under a truncation (the kept set from the CUDA
sampler kernels, the masked KL pass on Triton).
Timing at N=16384, V=152064 bf16 (forward: rollout scoring), every variant beside the plain pass
of the same backend (targets: top-k / top-p / min-p <= 1.5x the plain pass, a temperature tensor
and the statistics <= 1.1x); the fused call against the eager sort-and-cumsum baseline
(token_logprobs/naive.py, eager_sampled_logprobs: >= 5x faster at <= 0.2x its peak memory) at
N/8 rows, as the baseline holds ~7 float32 / int64 [N, V] copies (~80 GB at N=16384); and
linear_token_logprobs at N=16384 H=4096 V=152064 bf16, plain vs top-k + top-p (forward).
Inputs: logits randn * 2 (a flat row: top-p 0.9 keeps ~20% of the vocabulary, the costly case for
a selection), labels uniform in [0, V).
"""

from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import _backend, use_backend
from ppo_kernels.token_logprobs import naive as ref

OP = "token_logprobs"
PROFILED = "linear_token_logprobs"  # the op of profile()'s call
DEVICE = "cuda"
STATS = ("sum_p2", "lse", "is_argmax")


def _backends(op):
    return [b for b in ("cpp", "triton") if _backend.available(op, b, DEVICE)[0]]


def _logits(N, V, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (torch.randn(N, V, device=DEVICE, generator=g) * 2).to(dtype)
    y = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    t = torch.rand(N, device=DEVICE, generator=g) * 0.8 + 0.6
    return x, y, t


def sanitize_workload():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for N, V in ((7, 33), (9, 4099), (3, 32003)):
            x = (torch.randn(N, V, generator=g) * 2).to(DEVICE, dtype)
            y = torch.randint(0, V, (N,), generator=g).to(DEVICE)
            y[::3] = -100
            temps = (torch.rand(N, generator=g) + 0.5).to(DEVICE)
            ks = torch.randint(0, 40, (N,), generator=g).to(DEVICE)
            ps = (torch.rand(N, generator=g) * 0.8 + 0.2).to(DEVICE)
            with use_backend(**{OP: "cpp"}):
                for kw in (
                    dict(temperature=0.7, top_k=5, stats=("outside", "topk"), stats_top_k=3),
                    dict(top_p=0.9, min_p=0.02, stats=STATS),
                    dict(temperature=temps, top_k=ks, top_p=ps, sampler="sglang"),
                    dict(temperature=temps, stats=STATS + ("topk",), stats_top_k=min(V, 20)),
                ):
                    xg = x.detach().requires_grad_()
                    lp, ent = pk.token_logprobs(xg, y, return_entropy=True, **kw)[:2]
                    (lp.nan_to_num(neginf=0).sum() + ent.sum()).backward()
    # linear_token_logprobs under the sampler (whole-vocabulary tiles, the cpp reductions), one
    # and several row blocks
    N, H, V = 37, 67, 1001
    h = torch.randn(N, H, generator=g).to(DEVICE).requires_grad_()
    W = (torch.randn(V, H, generator=g) / H**0.5).to(DEVICE).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    y[::7] = -100
    with use_backend(linear_token_logprobs="cpp"):
        for budget in (None, 40_000):
            lp, ent = pk.linear_token_logprobs(
                h, W, y, return_entropy=True, temperature=0.8, top_k=20, top_p=0.9,
                stats=STATS, max_chunk_bytes=budget,
            )[:2]  # fmt: skip
            (lp.nan_to_num(neginf=0).sum() + ent.sum()).backward()
    # full_kl with the policy truncated
    z = torch.randn(2, 5, 4099, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(2, 5, 4099, generator=g).to(DEVICE)
    with use_backend(full_kl="cpp"):
        pk.full_kl(z, w, temperature=0.9, top_k=30, top_p=0.9, min_p=0.01).sum().backward()


def _token_logprobs_variants(x, y, t):
    """name -> kwargs of token_logprobs: the plain pass first (the ratio's denominator)."""
    return {
        "plain": {},
        "temperature tensor": dict(temperature=t),
        "stats sum_p2+lse+is_argmax": dict(stats=STATS),
        "stats topk (stats_top_k=20)": dict(stats=("topk",), stats_top_k=20),
        "top_k=50": dict(top_k=50),
        "top_p=0.9": dict(top_p=0.9),
        "min_p=0.05": dict(min_p=0.05),
        "T tensor, top_k=50, top_p=0.95, min_p=0.02": dict(
            temperature=t, top_k=50, top_p=0.95, min_p=0.02
        ),
    }


def _no_grad(op, backend, f, *args, **kw):
    def run():
        with use_backend(**{op: backend}), torch.no_grad():
            return f(*args, **kw)

    return run


def timing(ctx, N=16384, H=4096, V=152064):
    # Estimates at H100 speed (~3 TB/s): the plain pass reads the 5 GB of bf16 logits once,
    # ~2 ms; a top-p selection a few passes, <= 10 ms. do_bench(warmup 25, rep 100 ms): ~0.2 s
    # per row, 8 variants x 2 backends: ~5 s with the Triton compiles.
    x, y, t = _logits(N, V, torch.bfloat16)
    fns = {}
    for b in _backends(OP):
        for name, kw in _token_logprobs_variants(x, y, t).items():
            fns[f"ppo_kernels[{b}] {name}"] = _no_grad(OP, b, pk.token_logprobs, x, y, **kw)
    ctx.bench(OP, f"N={N} V={V} bf16 forward, vs plain", fns, bytes_moved=x.numel() * 2)

    # Against eager sort-and-cumsum at N/8 rows (N=2048: ~1.2 GB per float32 copy, peak ~10 GB;
    # its sort ~30 ms): 2 settings x 3 rows, ~2 s.
    n = max(1, N // 8)
    xs, ys = x[:n].contiguous(), y[:n].contiguous()
    del x, y, t
    for name, kw in {
        "top_p=0.9": dict(top_p=0.9),
        "T=0.8, top_k=50, top_p=0.95, min_p=0.02": dict(
            temperature=0.8, top_k=50, top_p=0.95, min_p=0.02
        ),
    }.items():
        fns = {
            f"ppo_kernels[{b}]": _no_grad(OP, b, pk.token_logprobs, xs, ys, **kw)
            for b in _backends(OP)
        }

        def eager(kw=kw):
            with torch.no_grad():
                return ref.eager_sampled_logprobs(xs, ys, **kw)

        fns["eager sort+cumsum (float32 copy)"] = eager
        ctx.bench(OP, f"N={n} (N/8) V={V} bf16 forward {name}, vs eager", fns,
                  bytes_moved=xs.numel() * 2)  # fmt: skip

    # linear_token_logprobs: one GEMM of 2 N H V = 20 TFLOP, ~41 ms at 500 TFLOP/s, + the
    # reductions (~10 GB of float32 tiles read a few times): ~50-60 ms per call, ~11 calls per
    # row with warmup 1 / rep 200 ms: ~0.6 s per row, 4 rows: ~3 s.
    op = "linear_token_logprobs"
    g = torch.Generator(device=DEVICE).manual_seed(1)
    h = torch.randn(N, H, device=DEVICE, generator=g).to(torch.bfloat16)
    W = (torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(torch.bfloat16)
    lab = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    fns = {}
    for b in _backends(op):
        fns[f"ppo_kernels[{b}] plain"] = _no_grad(op, b, pk.linear_token_logprobs, h, W, lab)
        fns[f"ppo_kernels[{b}] top_k=50 top_p=0.9"] = _no_grad(
            op, b, pk.linear_token_logprobs, h, W, lab, top_k=50, top_p=0.9
        )
    ctx.bench(op, f"N={N} H={H} V={V} bf16 forward, vs plain", fns, warmup=1, rep=200)


def profile(ctx, N=16384, H=4096, V=152064):
    """The top kernels of one linear_token_logprobs forward with top-k + top-p (its default
    backend): the GEMM against the sampler's selection."""
    from gpu_checks._profile import top_kernels

    g = torch.Generator(device=DEVICE).manual_seed(1)
    h = torch.randn(N, H, device=DEVICE, generator=g).to(torch.bfloat16)
    W = (torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(torch.bfloat16)
    lab = torch.randint(0, V, (N,), device=DEVICE, generator=g)

    def run():
        with torch.no_grad():
            pk.linear_token_logprobs(h, W, lab, top_k=50, top_p=0.9)

    ctx.profile(
        PROFILED, f"N={N} H={H} V={V} bf16 forward top_k=50 top_p=0.9",
        top_kernels(run, DEVICE),
    )  # fmt: skip
