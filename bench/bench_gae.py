"""gae: the fused scan vs the Python loops over time that trainers run today (verl's
compute_gae_advantage_return, OpenRLHF's get_advantages_and_returns), and vs a plain copy moving
the same bytes (the bandwidth floor: read rewards, values, mask; write advantages, returns =
17 bytes per token in float32 with a bool mask). Also masked_whiten vs verl's (two host syncs).
    pytest bench/bench_gae.py --benchmark-only      or      python bench/run.py --ops gae
GPU numbers come from bench/gpu_check.py (bench/gpu_checks/gae.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import median_seconds, peak_extra_bytes  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import use_backend  # noqa: E402
from ppo_kernels.gae import naive as R  # noqa: E402
from ppo_kernels.masked_stats import naive as MS  # noqa: E402

B, T = 256, 4096
LONG = 1_000_000  # one long row: the chunked path across threads
GAMMA, LAM = 0.99, 0.95
FUSED = "cpp" if pk.HAS_EXTENSION else "eager"
BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 4


def inputs(b, t):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(b, t, generator=g)
    v = torch.randn(b, t, generator=g)
    m = torch.rand(b, t, generator=g) > 0.1
    return r, v, m


def _copy_of(n_tokens):
    src = torch.empty(n_tokens * BYTES_PER_TOKEN // 2, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _cases():
    """(case, impl, callable)"""
    out = []
    r, v, m = inputs(B, T)
    mf = m.float()
    case = f"B={B} T={T} f32"

    def fused(r=r, v=v, m=m):
        with use_backend(gae=FUSED):
            return pk.gae(r, v, m, gamma=GAMMA, lam=LAM)

    def fused_float_mask(r=r, v=v, mf=mf):
        with use_backend(gae=FUSED):
            return pk.gae(r, v, mf, gamma=GAMMA, lam=LAM)

    out += [
        (case, "eager (verl loop)", lambda: R.verl_gae_loop(r, v, mf, GAMMA, LAM)),
        (case, "eager (OpenRLHF loop)", lambda: R.openrlhf_gae_loop(v, r, mf, GAMMA, LAM)),
        (case, "ppo_kernels (bool mask)", fused),
        (case, "ppo_kernels (float mask)", fused_float_mask),
        (case, "copy (same bytes moved)", _copy_of(B * T)),
    ]
    r1, v1, m1 = inputs(1, LONG)

    def fused_long(r1=r1, v1=v1, m1=m1):
        with use_backend(gae=FUSED):
            return pk.gae(r1, v1, m1, gamma=GAMMA, lam=LAM)

    case = f"B=1 T={LONG} f32"
    out += [
        (case, "ppo_kernels (bool mask)", fused_long),
        (case, "copy (same bytes moved)", _copy_of(LONG)),
    ]
    adv = torch.randn(B, T)
    case = f"masked_whiten B={B} T={T}"
    out += [
        (case, "eager (verl masked_whiten)", lambda: MS.verl_masked_whiten(adv, mf)),
        (case, "ppo_kernels", lambda: pk.masked_whiten(adv, m)),
    ]
    return out


def table_rows(reps=5):
    rows = []
    for case, impl, fn in _cases():
        loop = "loop" in impl
        sec = median_seconds(
            fn, warmup=0 if loop else 2, reps=min(reps, 3) if loop else max(reps, 20)
        )
        mem = peak_extra_bytes(fn)
        rows.append(dict(op="gae", case=case, impl=impl, seconds=sec, peak_extra_mb=mem / 2**20))
    return rows


CASES = _cases()


@pytest.mark.parametrize(
    "i", range(len(CASES)), ids=[f"{c}-{i}".replace(" ", "_") for c, i, _ in CASES]
)
def test_gae(benchmark, i):
    case, impl, fn = CASES[i]
    benchmark.group = case
    benchmark.extra_info["peak_extra_mb"] = peak_extra_bytes(fn) / 2**20
    loop = "loop" in impl
    benchmark.pedantic(fn, rounds=3 if loop else 20, warmup_rounds=0 if loop else 2)


if __name__ == "__main__":
    rows = table_rows()
    base = {}
    for r in rows:
        base.setdefault(r["case"], {})[r["impl"]] = r["seconds"]
    for r in rows:
        b = base[r["case"]]
        verl = b.get("eager (verl loop)")
        cp = b.get("copy (same bytes moved)")
        extra = ""
        if verl:
            extra += f"  {verl / r['seconds']:8.1f}x vs verl loop"
        if cp:
            extra += f"  {r['seconds'] / cp:6.2f}x copy time"
        print(
            f"{r['case']:<28} {r['impl']:<28} {1e3 * r['seconds']:10.3f} ms "
            f"{r['peak_extra_mb']:8.1f} MiB{extra}"
        )
