"""Shared benchmark helpers: medians and peak memory, on the CPU and the GPU.

Peak memory is the most bytes a call holds in tensors beyond what existed before it (outputs
included): on CUDA torch.cuda.max_memory_allocated over the baseline; on the CPU the running sum of
the torch profiler's allocation events (exact; the resident set misses memory the allocator reuses).
"""
from __future__ import annotations

import gc
import os
import statistics
import time

import torch


def peak_extra_bytes(fn, device="cpu"):
    """Peak bytes of tensors `fn()` allocates above what is allocated before it runs."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - base
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    return peak


def median_seconds(fn, *, warmup=1, reps=5, device="cpu", min_time=0.0):
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < reps or time.perf_counter() < t_end:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine():
    import platform
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
