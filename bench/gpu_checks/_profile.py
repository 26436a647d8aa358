"""A profile of one fused call for the GPU check's report: the kernels that took the time.

`top_kernels(fn)` runs fn once to warm up, then once under torch.profiler (CUDA activity on a
GPU, CPU ops elsewhere: the CPU rehearsal) and returns the kernels (or ops) ranked by their
self time: name, calls, total ms, share of the step. The engine's waste (a kernel that should not
be there, a copy, a GEMM slower than its floor) is read off this table between device sessions.
"""

from __future__ import annotations

import torch


def top_kernels(fn, device: str, top: int = 15) -> list[dict]:
    fn()  # warm up: compiles, autotunes and allocates outside the profile
    if device == "cuda":
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
    else:
        activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
        if us > 0:
            rows.append(dict(kernel=e.key, calls=e.count, ms=us / 1e3))
    total = sum(r["ms"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["ms"])
    for r in rows:
        r["pct"] = 100.0 * r["ms"] / total
    return rows[:top]
