"""GPU check for gae (correctness: tests/cuda/test_cuda_gae.py): a compute-sanitizer workload
covering every kernel path (aligned single pass, map/carry/final passes, packed rows), and timing
at the H200 targets (B=1024, T=8192 and one packed row of 4,194,304 tokens: 50% or more of the copy
bandwidth, 1000x or more faster than the Python loops)."""

from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.gae import naive as R

OP = "gae"
KERNELS = ("cpp", "triton")


def _gen():
    return torch.Generator(device="cuda").manual_seed(0)


def _run(backend, *args, **kw):
    with use_backend(gae=backend):
        return pk.gae(*args, **kw)


def sanitize_workload():
    g = _gen()
    dev = dict(device="cuda")
    for B, T in [(600, 4096), (3, 5000), (2000, 7)]:  # aligned single pass; 3 passes; tiny rows
        r = torch.randn(B, T, generator=g, **dev).bfloat16()
        v = torch.randn(B, T, generator=g, **dev).bfloat16()
        m = torch.rand(B, T, generator=g, **dev) > 0.2
        d = torch.rand(B, T, generator=g, **dev) > 0.99
        _run("cpp", r, v, m, gamma=0.99, lam=0.95, dones=d, bootstrap_value=torch.randn(B, **dev))
    lens = [0, 1, 3000, 0, 1, 9000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    N = int(cu[-1])
    r, v = torch.randn(N, **dev), torch.randn(N, **dev)
    _run(
        "cpp",
        r,
        v,
        torch.rand(N, **dev) > 0.5,
        gamma=torch.rand(N, **dev),
        lam=0.9,
        carry=(torch.randn(6, **dev), torch.randn(6, **dev)),
        cu_seqlens=cu,
    )


def timing(ctx):
    g = _gen()
    dev = dict(device="cuda")
    B, T = 1024, 8192
    r = torch.randn(B, T, generator=g, **dev)
    v = torch.randn(B, T, generator=g, **dev)
    m = torch.rand(B, T, generator=g, **dev) > 0.1
    mf = m.float()
    bytes_moved = B * T * (4 + 4 + 1 + 4 + 4)
    fns = {b: (lambda b=b: _run(b, r, v, m, gamma=0.99, lam=0.95)) for b in KERNELS}
    fns["cpp (float mask)"] = lambda: _run("cpp", r, v, mf, gamma=0.99, lam=0.95)
    fns["eager (verl loop)"] = lambda: R.verl_gae_loop(r, v, mf, 0.99, 0.95)
    fns["eager (OpenRLHF loop)"] = lambda: R.openrlhf_gae_loop(v, r, mf, 0.99, 0.95)
    ctx.bench(OP, f"B={B} T={T} f32 bool mask", fns, bytes_moved=bytes_moved, warmup=1, rep=50)
    N = 4_194_304
    r1 = torch.randn(N, generator=g, **dev)
    v1 = torch.randn(N, generator=g, **dev)
    m1 = torch.rand(N, generator=g, **dev) > 0.1
    cu = torch.tensor([0, N], dtype=torch.int32, device="cuda")
    fns = {
        b: (lambda b=b: _run(b, r1, v1, m1, gamma=0.99, lam=0.95, cu_seqlens=cu)) for b in KERNELS
    }
    fns.update(
        {
            f"{b} (dense [1, T])": (
                lambda b=b: _run(b, r1[None], v1[None], m1[None], gamma=0.99, lam=0.95)
            )
            for b in KERNELS
        }
    )
    # the loops at this length take minutes: time 8192 steps of them and scale by N / 8192
    fns["eager (verl loop, 8192 steps; x512 for the row)"] = lambda: R.verl_gae_loop(
        r1[None, :8192], v1[None, :8192], m1[None, :8192].float(), 0.99, 0.95
    )
    ctx.bench(OP, f"one packed row T={N} f32", fns, bytes_moved=N * 17, warmup=1, rep=50)
