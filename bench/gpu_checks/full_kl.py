"""GPU check for full_kl: every backend against the float64 definition, compute-sanitizer workload
for the CUDA kernels, and timing at the H200 target (N=8192, V=152064 bf16: 80% or more of the
read bandwidth for the two logits tensors) against the eager two-log_softmax composition."""
from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.full_kl import reference as R

OP = "full_kl"


def _ref64(z, w, temperature, mask):
    z64 = z.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    logp = torch.log_softmax(z64 / temperature, -1)
    logq = torch.log_softmax(w64 / temperature, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    if mask is not None:
        kl = kl * mask
    return kl, z64, w64


def _cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda")
    out = []
    for name, dtype, (n, v), t, masked, strided in [
        ("qwen-vocab bf16", torch.bfloat16, (48, 152064), 1.0, False, False),
        ("llama-vocab fp32 T=0.7 masked", torch.float32, (40, 32000), 0.7, True, False),
        ("odd V fp16 strided (misaligned rows)", torch.float16, (33, 1001), 1.0, False, True),
        ("tiny V bf16", torch.bfloat16, (70, 5), 1.3, True, False),
    ]:
        if strided:
            big = (torch.randn(n, v + 3, generator=g, **dev) * 3).to(dtype)
            z = big[:, 1:v + 1]  # strided rows at an odd offset: alignment differs from w's
            w = (z.float() + 0.4 * torch.randn(n, v, generator=g, **dev)).to(dtype)
        else:
            z = (torch.randn(n, v, generator=g, **dev) * 3).to(dtype)
            w = (z.float() + 0.4 * torch.randn(n, v, generator=g, **dev)).to(dtype)
        mask = (torch.rand(n, generator=g, **dev) > 0.3) if masked else None
        out.append((f"{name} N={n} V={v}", z, w, t, mask))
    return out


def correctness(ctx):
    for case, z, w, t, mask in _cases():
        want, z64, w64 = _ref64(z, w, t, None if mask is None else mask.double())
        g = torch.randn_like(want)
        rz, rw = torch.autograd.grad(want, (z64, w64), g)
        for backend in ("cpp", "triton", "eager"):
            try:
                zz = z.detach().clone().requires_grad_()
                ww = w.detach().clone().requires_grad_()
                with use_backend(full_kl=backend):
                    kl = pk.full_kl(zz, ww, temperature=t, mask=mask)
                    gz, gw = torch.autograd.grad(kl, (zz, ww), g.float())
            except Exception as e:  # noqa: BLE001
                ctx.fail(OP, case, backend, f"{type(e).__name__}: {e}")
                continue
            ctx.compare(OP, case + " kl", backend, kl, want.detach(), 5e-5, 2e-5)
            gtol = (2e-6, 1e-4) if z.dtype == torch.float32 else (1e-5, 2 ** -7)
            ctx.compare(OP, case + " grad_logits", backend, gz, rz, *gtol)
            ctx.compare(OP, case + " grad_ref", backend, gw, rw, *gtol)
    # edge rows on the GPU: -inf entries, q = 0 under p > 0, all -inf, NaN
    z = torch.randn(5, 4099, device="cuda")
    w = torch.randn(5, 4099, device="cuda")
    z[0, :100] = -float("inf")
    w[1, 7] = -float("inf")
    z[2] = -float("inf")
    w[3, 5] = float("nan")
    want = R.forward(z.double(), w.double())[0]

    def finite(t):  # +-inf as a large finite value: ctx.compare treats inf - inf as a mismatch
        return torch.where(t.isinf(), t.sign() * 1e30, t)
    for backend in ("cpp", "triton"):
        with use_backend(full_kl=backend):
            ctx.compare(OP, "edge rows", backend, finite(pk.full_kl(z, w).double()), finite(want), 5e-5, 2e-5)


def sanitize_workload():
    for case, z, w, t, mask in _cases()[1:]:
        zz = z[:8].detach().clone().requires_grad_()
        ww = w[:8].detach().clone().requires_grad_()
        with use_backend(full_kl="cpp"):
            kl = pk.full_kl(zz, ww, temperature=t, mask=None if mask is None else mask[:8])
            kl.sum().backward()


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
        [R.eager_full_kl(z[i:i + 1024], w[i:i + 1024]) for i in range(0, n, 1024)])
    ctx.bench(OP, case, fns, bytes_moved=2 * z.numel() * z.element_size())
    zz = z.detach().requires_grad_()
    bw = {}
    for backend in ("cpp", "triton"):
        with use_backend(full_kl=backend):
            kl = pk.full_kl(zz, w)
        gout = torch.ones_like(kl)

        def fb(b=backend, kl=kl, gout=gout):
            with use_backend(full_kl=b):
                return torch.ops.ppo_kernels.full_kl_backward(gout, zz, w, None, kl, kl, kl, 1.0, False)
        bw[backend] = fb
    ctx.bench(OP, f"N={n} V={v} bf16 backward (grad logits only)", bw,
              bytes_moved=3 * z.numel() * z.element_size())
