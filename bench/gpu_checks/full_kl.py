"""GPU check for full_kl (correctness: tests/cuda/test_cuda_full_kl.py): a compute-sanitizer
workload for the CUDA kernels, and timing at the H200 target (N=8192, V=152064 bf16: 80% or more of
the read bandwidth for the two logits tensors) against the eager two-log_softmax composition."""

from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.full_kl import naive as R

OP = "full_kl"


def sanitize_workload():
    """Forward and backward of the CUDA kernels: fp32 with a mask and a temperature, fp16 rows at a
    misaligned offset with odd V, a tiny bf16 vocabulary."""
    for dtype, n, v, t, masked, strided in [
        (torch.float32, 8, 32000, 0.7, True, False),
        (torch.float16, 8, 1001, 1.0, False, True),
        (torch.bfloat16, 8, 5, 1.3, True, False),
    ]:
        z = (
            torch.randn(n, v + 3, device="cuda").to(dtype)[:, 1 : v + 1]
            if strided
            else torch.randn(n, v, device="cuda").to(dtype)
        )
        w = (z.float() + 0.4 * torch.randn(n, v, device="cuda")).to(dtype)
        mask = (torch.rand(n, device="cuda") > 0.3) if masked else None
        zz, ww = z.detach().requires_grad_(), w.detach().requires_grad_()  # zz keeps its strides
        with use_backend(full_kl="cpp"):
            pk.full_kl(zz, ww, temperature=t, mask=mask).sum().backward()


def timing(ctx):
    n, v = 8192, 152064
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
    case = f"N={n} V={v} bf16 forward"
    fns = {}
    for backend in ("cpp", "triton"):

        def f(b=backend):
            with use_backend(full_kl=b):
                return pk.full_kl(z, w)

        fns[backend] = f
    # eager needs several N x V float32 temporaries (~5 GB each): chunked to fit, as trainers do
    fns["eager (2x log_softmax, 1024-row chunks)"] = lambda: torch.cat(
        [R.eager_full_kl(z[i : i + 1024], w[i : i + 1024]) for i in range(0, n, 1024)]
    )
    ctx.bench(OP, case, fns, bytes_moved=2 * z.numel() * z.element_size())
    zz = z.detach().requires_grad_()
    bw = {}
    for backend in ("cpp", "triton"):
        with use_backend(full_kl=backend):
            kl = pk.full_kl(zz, w)
        gout = torch.ones_like(kl)

        def fb(b=backend, kl=kl, gout=gout):
            with use_backend(full_kl=b):
                return torch.ops.ppo_kernels.full_kl_backward(
                    gout, zz, w, None, kl, kl, kl, 1.0, False
                )

        bw[backend] = fb
    ctx.bench(
        OP,
        f"N={n} V={v} bf16 backward (grad logits only)",
        bw,
        bytes_moved=3 * z.numel() * z.element_size(),
    )
