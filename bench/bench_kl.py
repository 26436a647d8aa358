"""KL ops: the fused kernels vs the eager compositions trainers run today (verl-style kl_penalty,
apply_kl_penalty-style rewards, two log_softmax for the full KL). Reports median time, peak extra
memory and ATen ops per call (each one a kernel launch on the GPU). CPU:
    pytest bench/bench_kl.py --benchmark-only      or      python bench/run.py --ops kl
GPU numbers come from bench/gpu_check.py (bench/gpu_checks/kl.py, full_kl.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from _common import median_seconds, peak_extra_bytes  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import use_backend  # noqa: E402
from ppo_kernels.full_kl import naive as fref  # noqa: E402
from ppo_kernels.kl import naive as kref  # noqa: E402

B, T = 64, 4096  # sampled-token ops: 256k tokens
N, V = 256, 32000  # full_kl on the CPU (the GPU target N=8192, V=152064 is in gpu_checks)
FUSED = "cpp" if pk.HAS_EXTENSION else "eager"


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn):
    """ATen ops one call dispatches (fused: the one kernel per direction, plus small glue)."""
    with _CountOps() as c:
        fn()
    return c.n


def kl_inputs(dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(B, T, generator=g) * 5).to(dtype).requires_grad_(requires_grad)
    ref = (lp.detach().float() + 0.3 * torch.randn(B, T, generator=g)).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.2
    scores = torch.randn(B, generator=g)
    return lp, ref, mask, scores


def full_kl_inputs(dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(N, V, generator=g) * 2).to(dtype).requires_grad_(requires_grad)
    w = (z.detach().float() + 0.5 * torch.randn(N, V, generator=g)).to(dtype)
    return z, w


def kl_penalty_impls(est):
    def fused(lp, ref):
        with use_backend(kl_penalty=FUSED):
            return pk.kl_penalty(lp, ref, est, clamp="verl")

    return {
        "ppo_kernels": fused,
        "eager (verl-style)": lambda lp, ref: kref.eager_kl_penalty_verl(lp, ref, est),
    }


def rewards_impls(est):
    def fused(s, lp, ref, m):
        with use_backend(kl_penalized_rewards=FUSED):
            return pk.kl_penalized_rewards(s, lp, ref, m, beta=0.05, estimator=est, clamp="verl")

    return {
        "ppo_kernels": fused,
        "eager (verl/OpenRLHF-style)": lambda s, lp, ref, m: kref.eager_kl_rewards(
            s, lp, ref, m.float(), 0.05, est
        ),
    }


def full_kl_impls():
    def fused(z, w):
        with use_backend(full_kl=FUSED):
            return pk.full_kl(z, w)

    return {"ppo_kernels": fused, "eager (2x log_softmax)": fref.eager_full_kl}


def _cases():
    """(op, case, impl, forward callable, fwd+bwd callable or None)"""
    out = []
    for est in ("k1", "k3"):
        lp, ref, mask, scores = kl_inputs(requires_grad=True)
        for name, fn in kl_penalty_impls(est).items():

            def fwd(fn=fn, lp=lp, ref=ref):
                with torch.no_grad():
                    return fn(lp, ref)

            def fb(fn=fn, lp=lp, ref=ref):
                lp.grad = None
                fn(lp, ref).sum().backward()
                return lp.grad

            out.append(("kl_penalty", f"B={B} T={T} f32 {est}", name, fwd, fb))
        for name, fn in rewards_impls(est).items():

            def fwd(fn=fn, lp=lp, ref=ref, mask=mask, scores=scores):
                with torch.no_grad():
                    return fn(scores, lp, ref, mask)

            out.append(("kl_penalized_rewards", f"B={B} T={T} f32 {est}", name, fwd, None))
    for dtype in (torch.float32, torch.bfloat16):
        z, w = full_kl_inputs(dtype, requires_grad=True)
        for name, fn in full_kl_impls().items():

            def fwd(fn=fn, z=z, w=w):
                with torch.no_grad():
                    return fn(z, w)

            def fb(fn=fn, z=z, w=w):
                z.grad = None
                fn(z, w).sum().backward()
                return z.grad

            out.append(("full_kl", f"N={N} V={V} {str(dtype)[6:]}", name, fwd, fb))
    return out


def table_rows(reps=5):
    rows = []
    for op, case, impl, fwd, fb in _cases():
        for mode, call in (("forward", fwd), ("fwd+bwd", fb)):
            if call is None:
                continue
            try:
                sec = median_seconds(call, warmup=1, reps=reps)
                mem = peak_extra_bytes(call)
                ops = count_ops(call)
            except Exception as e:  # noqa: BLE001
                sec, mem, ops = float("nan"), float("nan"), -1
                impl = f"{impl} ({type(e).__name__})"
            rows.append(
                dict(
                    op=op,
                    case=f"{op} {case} {mode}",
                    impl=impl,
                    seconds=sec,
                    peak_extra_mb=mem / 2**20,
                    aten_ops=ops,
                )
            )
    return rows


CASE_IDS = [f"{op}-{case}-{impl}".replace(" ", "_") for op, case, impl, _, _ in _cases()]


@pytest.mark.parametrize("i", range(len(CASE_IDS)), ids=CASE_IDS)
@pytest.mark.parametrize("mode", ["forward", "fwd+bwd"])
def test_kl_ops(benchmark, i, mode):
    op, case, impl, fwd, fb = _cases()[i]
    call = fwd if mode == "forward" else fb
    if call is None:
        pytest.skip("no gradient")
    benchmark.group = f"{op} {case} {mode}"
    benchmark.extra_info["peak_extra_mb"] = peak_extra_bytes(call) / 2**20
    benchmark.extra_info["aten_ops"] = count_ops(call)
    benchmark.pedantic(call, rounds=5, warmup_rounds=1)


if __name__ == "__main__":
    for r in table_rows():
        print(
            f"{r['case']:<55} {r['impl']:<30} {1e3 * r['seconds']:9.2f} ms  "
            f"{r['peak_extra_mb']:8.1f} MiB  {r['aten_ops']:4d} ops"
        )
