"""PPO policy / value losses and GRPO advantages: the fused ops vs the eager compositions trainers
run today (verl-style: clamp, exp, three masked means with .item(), dual clip, agg_loss; a Python
loop over groups for GRPO). CPU: pytest-benchmark
    pytest bench/bench_losses.py --benchmark-only
or the side-by-side table of `python bench/run.py --ops losses` (also prints the number of torch
ops and host syncs per call: `python bench/bench_losses.py`). GPU numbers: bench/gpu_check.py.
"""

from __future__ import annotations

import os
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from _common import peak_extra_bytes  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import use_backend  # noqa: E402
from ppo_kernels.group_advantages import naive as gref  # noqa: E402
from ppo_kernels.losses import naive as ref  # noqa: E402

B, T = 64, 4096  # 262k tokens: one micro-batch of long responses
GB, GSIZE = 1024, 8  # GRPO: 128 prompts x 8 responses


def make_inputs(b=B, t=T, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(b, t, generator=g) * 3).to(dtype)
    old = (lp.float() + torch.randn(b, t, generator=g) * 0.1).to(dtype)
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    return lp, old, adv, mask


def _fused_backend():
    return "cpp" if pk.HAS_EXTENSION else "eager"


def policy_impls(agg="token-mean"):
    def fused(lp, old, adv, mask):
        with use_backend(_fused_backend()):
            loss, st = pk.ppo_policy_loss(
                lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg
            )
        return loss

    def eager(lp, old, adv, mask):
        return ref.eager_policy_loss_verl_style(lp, old, adv, mask, 0.2, 0.28, 3.0, agg)[0]

    return {"ppo_kernels": fused, "eager (verl-style, 3 .item())": eager}


def value_impls():
    def fused(v, vo, ret, mask):
        with use_backend(_fused_backend()):
            return pk.ppo_value_loss(v, vo, ret, mask, clip=0.2)[0]

    def eager(v, vo, ret, mask):
        return ref.eager_value_loss_verl_style(v, vo, ret, mask, 0.2)[0]

    return {"ppo_kernels": fused, "eager (verl-style)": eager}


def grpo_impls():
    def fused(s, idx):
        with use_backend(_fused_backend()):
            return pk.grpo_advantages(s, idx)

    def eager_vec(s, idx):
        return gref.group_advantages(s, idx).float()

    def eager_loop(s, idx):
        return gref.eager_grpo_verl_style(s, idx)

    return {
        "ppo_kernels": fused,
        "eager (scatter, float64)": eager_vec,
        "eager (verl-style loop)": eager_loop,
    }


def run_fwd_bwd(fn, x, *rest):
    x = x.detach().requires_grad_(True)
    fn(x, *rest).backward()
    return x.grad


class CountOps(TorchDispatchMode):
    """Top-level torch ops dispatched (each of our fused ops counts as one), host syncs, and the
    peak bytes of live tensors those ops create (intermediates and saved-for-backward tensors: a
    CPU stand-in for CUDA's max_memory_allocated, which RSS is too coarse to show)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.live = {}  # data_ptr -> [tensors alive, nbytes]
        self.cur = 0
        self.peak = 0

    def _release(self, ptr):
        ent = self.live.get(ptr)
        if ent is None:
            return
        ent[0] -= 1
        if ent[0] == 0:
            self.cur -= ent[1]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.syncs += 1
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr in inputs and ptr not in self.live:
                    continue  # a view of an input: no new memory
                ent = self.live.get(ptr)
                if ent is None:
                    self.live[ptr] = ent = [0, t.untyped_storage().nbytes()]
                    self.cur += ent[1]
                    self.peak = max(self.peak, self.cur)
                ent[0] += 1
                weakref.finalize(t, self._release, ptr)
        return out


def count_ops(fn):
    """(torch ops, host syncs, peak live bytes) of one call."""
    with CountOps() as c:
        fn()
    return c.ops, c.syncs, c.peak


def table_rows(reps=5):
    from _common import median_seconds

    rows = []

    def add(op, case, name, call, warmup=1):
        try:
            sec = median_seconds(call, warmup=warmup, reps=reps)
            mem = peak_extra_bytes(call)
            n_ops, n_sync, live = count_ops(call)
        except Exception as e:  # noqa: BLE001
            sec = mem = live = float("nan")
            n_ops = n_sync = -1
            name = f"{name} ({type(e).__name__}: {e})"
        rows.append(
            dict(
                op=op,
                case=case,
                impl=name,
                seconds=sec,
                peak_extra_mb=mem / 2**20,
                peak_live_tensor_mb=live / 2**20,
                torch_ops=n_ops,
                host_syncs=n_sync,
            )
        )

    lp, old, adv, mask = make_inputs()
    for agg in ("token-mean", "seq-mean-token-mean"):
        for name, fn in policy_impls(agg).items():
            add(
                "ppo_policy_loss",
                f"B={B} T={T} f32 {agg} fwd+bwd",
                name,
                lambda fn=fn: run_fwd_bwd(fn, lp, old, adv, mask),
            )
    for name, fn in value_impls().items():
        add(
            "ppo_value_loss",
            f"B={B} T={T} f32 fwd+bwd",
            name,
            lambda fn=fn: run_fwd_bwd(fn, lp, old, adv, mask),
        )
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 2, (GB,), generator=g).float()
    idx = torch.arange(GB) // GSIZE
    for name, fn in grpo_impls().items():
        add("grpo_advantages", f"B={GB} groups of {GSIZE}", name, lambda fn=fn: fn(s, idx))
    return rows


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("impl", list(policy_impls()))
def test_policy_loss(benchmark, impl, agg):
    lp, old, adv, mask = make_inputs()
    fn = policy_impls(agg)[impl]
    benchmark.group = f"ppo_policy_loss B={B} T={T} {agg} fwd+bwd"
    benchmark.extra_info["peak_extra_mb"] = (
        peak_extra_bytes(lambda: run_fwd_bwd(fn, lp, old, adv, mask)) / 2**20
    )
    (
        benchmark.extra_info["torch_ops"],
        benchmark.extra_info["host_syncs"],
        benchmark.extra_info["peak_live_tensor_bytes"],
    ) = count_ops(lambda: run_fwd_bwd(fn, lp, old, adv, mask))
    benchmark.pedantic(run_fwd_bwd, args=(fn, lp, old, adv, mask), rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("impl", list(value_impls()))
def test_value_loss(benchmark, impl):
    lp, old, adv, mask = make_inputs()
    fn = value_impls()[impl]
    benchmark.group = f"ppo_value_loss B={B} T={T} fwd+bwd"
    benchmark.extra_info["peak_extra_mb"] = (
        peak_extra_bytes(lambda: run_fwd_bwd(fn, lp, old, adv, mask)) / 2**20
    )
    benchmark.pedantic(run_fwd_bwd, args=(fn, lp, old, adv, mask), rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("impl", list(grpo_impls()))
def test_grpo_advantages(benchmark, impl):
    s = torch.randint(0, 2, (GB,)).float()
    idx = torch.arange(GB) // GSIZE
    benchmark.group = f"grpo_advantages B={GB} group={GSIZE}"
    benchmark.pedantic(grpo_impls()[impl], args=(s, idx), rounds=5, warmup_rounds=1)


if __name__ == "__main__":
    import argparse

    from _common import machine

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(machine())
    print(
        "| op | case | impl | median ms | peak live tensors MiB | torch ops / call | host syncs |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table_rows(reps=a.reps):
        print(
            f"| {r['op']} | {r['case']} | {r['impl']} | {1e3 * r['seconds']:.2f} | "
            f"{r['peak_live_tensor_mb']:.1f} | {r['torch_ops']} | {r['host_syncs']} |"
        )
