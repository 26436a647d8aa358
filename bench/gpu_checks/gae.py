"""GPU check for gae: the CUDA (cpp) and Triton kernels against float64 references, a
compute-sanitizer workload covering every kernel path (aligned single pass, map/carry/final passes,
packed rows), and timing at the H200 targets (B=1024, T=8192 and one packed row of 4,194,304
tokens: 50% or more of the copy bandwidth, 1000x or more faster than the Python loops)."""
from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.gae import reference as R

OP = "gae"
KERNELS = ("cpp", "triton")
TOL = (1e-4, 1e-4)  # float32 scan vs float64, gamma * lam < 1 (errors do not accumulate)


def _gen():
    return torch.Generator(device="cuda").manual_seed(0)


def _long_row_ref64(r, v, m, gamma, lam, bootstrap):
    """Float64 GAE of one long row with a mask (no dones), without a loop over 4M positions: on the
    action positions A_k = delta_k + gl * A_{k+1} is a linear recurrence with a constant
    coefficient, solved in blocks of L by a float64 matmul with M[i, j] = gl^(j - i) (j >= i) and
    a short loop over the block carries; masked positions take the next action's advantage."""
    idx = m.nonzero().squeeze(1)
    K = idx.numel()
    r64, v64 = r.double(), v.double()
    va = v64[idx]
    nxt = torch.cat([va[1:], bootstrap.double().reshape(1)])
    delta = r64[idx] + gamma * nxt - va
    gl = gamma * lam
    L = 2048
    C = (K + L - 1) // L
    d = torch.zeros(C * L, dtype=torch.float64, device=r.device)
    d[:K] = delta
    d = d.view(C, L)
    i = torch.arange(L, device=r.device, dtype=torch.float64)
    e = i[None, :] - i[:, None]
    M = torch.where(e >= 0, torch.pow(torch.tensor(gl, dtype=torch.float64, device=r.device), e.clamp(min=0)),
                    torch.zeros((), dtype=torch.float64, device=r.device))
    loc = d @ M.T                                    # loc[c, i] = sum_{j>=i} gl^(j-i) d[c, j]
    decay = torch.pow(torch.tensor(gl, dtype=torch.float64, device=r.device), L - i)  # gl^(L - i)
    loc_first = loc[:, 0].cpu()
    fc = torch.zeros(C + 1, dtype=torch.float64)
    gL = gl ** L
    for c in range(C - 1, -1, -1):
        fc[c] = loc_first[c] + gL * fc[c + 1]
    firsts = fc.to(r.device)
    A = (loc + decay[None, :] * firsts[1:, None]).flatten()[:K]
    # every position: the advantage of the first action at or after it (0 past the last one)
    pos = torch.arange(r.numel(), device=r.device)
    k = torch.searchsorted(idx, pos)
    full = torch.where(k < K, A[k.clamp(max=max(K - 1, 0))], torch.zeros((), dtype=torch.float64, device=r.device))
    return full, full + v64


def _run(backend, *args, **kw):
    with use_backend(gae=backend):
        return pk.gae(*args, **kw)


def correctness(ctx):
    g = _gen()
    dev = dict(device="cuda")
    # many rows: float64 eager loop on the GPU as the reference
    for name, (B, T), dtype, gam, lam in [("B=1024 T=8192 f32", (1024, 8192), torch.float32, 0.99, 0.95),
                                          ("B=64 T=3001 bf16", (64, 3001), torch.bfloat16, 0.999, 0.9),
                                          ("B=7 T=20000 fp16 gamma=lam=1", (7, 20000), torch.float16, 1.0, 1.0)]:
        r = torch.randn(B, T, generator=g, **dev).to(dtype)
        v = torch.randn(B, T, generator=g, **dev).to(dtype)
        m = torch.rand(B, T, generator=g, **dev) > 0.2
        d = torch.rand(B, T, generator=g, **dev) > 0.9995
        bv = torch.randn(B, generator=g, **dev)
        want = R.gae_eager(r.double(), v.double(), m, gam, lam, d, bv.double())
        # gamma = lam = 1: plain sums over up to 20000 positions, float32 rounding accumulates
        tol = TOL if gam * lam < 1 else (1e-2, 1e-4)
        for backend in KERNELS:
            try:
                adv, ret, (cv, ca) = _run(backend, r, v, m, gamma=gam, lam=lam, dones=d, bootstrap_value=bv,
                                          return_carry=True)
            except Exception as e:  # noqa: BLE001
                ctx.fail(OP, name, backend, f"{type(e).__name__}: {e}")
                continue
            ctx.compare(OP, name + " advantages", backend, adv, want[0], *tol)
            ctx.compare(OP, name + " returns", backend, ret, want[1], *tol)
            ctx.compare(OP, name + " carry", backend, torch.stack([cv, ca]), torch.stack([want[2], want[3]]), *tol)
    # packed rows with empty and length-1 rows, per-token gamma/lam, carries
    lens = [0, 1, 5000, 0, 1, 70000, 3, 12345]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    N = int(cu[-1])
    r = torch.randn(N, generator=g, **dev)
    v = torch.randn(N, generator=g, **dev)
    m = torch.rand(N, generator=g, **dev) > 0.3
    d = torch.rand(N, generator=g, **dev) > 0.999
    gt = torch.where(torch.rand(N, generator=g, **dev) > 0.9, 0.9, 1.0)
    lt = torch.rand(N, generator=g, **dev) * 0.5 + 0.5
    carry = (torch.randn(len(lens), generator=g, **dev), torch.randn(len(lens), generator=g, **dev))
    want = R.gae_eager(r.double(), v.double(), m, gt.double(), lt.double(), d, carry[0].double(),
                       carry[1].double(), cu)
    for backend in KERNELS:
        try:
            adv, ret, (cv, ca) = _run(backend, r, v, m, gamma=gt, lam=lt, dones=d, carry=carry, cu_seqlens=cu,
                                      return_carry=True)
        except Exception as e:  # noqa: BLE001
            ctx.fail(OP, "packed", backend, f"{type(e).__name__}: {e}")
            continue
        ctx.compare(OP, "packed rows (empty, length 1) per-token gamma/lam", backend, adv, want[0], *TOL)
        ctx.compare(OP, "packed rows returns", backend, ret, want[1], *TOL)
        ctx.compare(OP, "packed rows carry", backend, torch.stack([cv, ca]), torch.stack([want[2], want[3]]), *TOL)
    # one packed row of 4,194,304 tokens (and the same as a [1, T] batch)
    T = 4_194_304
    r = torch.randn(T, generator=g, **dev)
    v = torch.randn(T, generator=g, **dev)
    m = torch.rand(T, generator=g, **dev) > 0.1
    bv = torch.randn(1, generator=g, **dev)
    want = _long_row_ref64(r, v, m, 0.99, 0.95, bv)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    for backend in KERNELS:
        try:
            adv, ret = _run(backend, r, v, m, gamma=0.99, lam=0.95, bootstrap_value=bv, cu_seqlens=cu)
            adv2, _ = _run(backend, r[None], v[None], m[None], gamma=0.99, lam=0.95, bootstrap_value=bv)
        except Exception as e:  # noqa: BLE001
            ctx.fail(OP, "one row of 4M", backend, f"{type(e).__name__}: {e}")
            continue
        ctx.compare(OP, f"one packed row T={T} advantages", backend, adv, want[0], *TOL)
        ctx.compare(OP, f"one packed row T={T} returns", backend, ret, want[1], *TOL)
        ctx.compare(OP, f"one dense row [1, {T}] advantages", backend, adv2[0], want[0], *TOL)


def sanitize_workload():
    g = _gen()
    dev = dict(device="cuda")
    for (B, T) in [(600, 4096), (3, 5000), (2000, 7)]:  # aligned single pass; 3 passes; tiny rows
        r = torch.randn(B, T, generator=g, **dev).bfloat16()
        v = torch.randn(B, T, generator=g, **dev).bfloat16()
        m = torch.rand(B, T, generator=g, **dev) > 0.2
        d = torch.rand(B, T, generator=g, **dev) > 0.99
        _run("cpp", r, v, m, gamma=0.99, lam=0.95, dones=d, bootstrap_value=torch.randn(B, **dev))
    lens = [0, 1, 3000, 0, 1, 9000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    N = int(cu[-1])
    r, v = torch.randn(N, **dev), torch.randn(N, **dev)
    _run("cpp", r, v, torch.rand(N, **dev) > 0.5, gamma=torch.rand(N, **dev), lam=0.9,
         carry=(torch.randn(6, **dev), torch.randn(6, **dev)), cu_seqlens=cu)


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
    fns = {b: (lambda b=b: _run(b, r1, v1, m1, gamma=0.99, lam=0.95, cu_seqlens=cu)) for b in KERNELS}
    fns.update({f"{b} (dense [1, T])": (lambda b=b: _run(b, r1[None], v1[None], m1[None], gamma=0.99, lam=0.95))
                for b in KERNELS})
    # the loops at this length take minutes: time 8192 steps of them and scale by N / 8192
    fns["eager (verl loop, 8192 steps; x512 for the row)"] = lambda: R.verl_gae_loop(
        r1[None, :8192], v1[None, :8192], m1[None, :8192].float(), 0.99, 0.95)
    ctx.bench(OP, f"one packed row T={N} f32", fns, bytes_moved=N * 17, warmup=1, rep=50)
