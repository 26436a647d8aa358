"""Shared benchmark helpers: medians and peak memory, on the CPU and the GPU.

Peak memory on the CPU is the rise of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs) over its resident set just before the call: the memory a call needs beyond
its inputs, outputs included. On CUDA it is torch.cuda.max_memory_allocated over the baseline.
"""
from __future__ import annotations

import gc
import os
import statistics
import time

import torch


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_extra_bytes(fn, device="cpu"):
    """Peak memory `fn()` needs above what is allocated before it runs."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - base
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return float("nan")
    base = _status_kb("VmRSS")
    out = fn()
    peak = _status_kb("VmHWM")
    del out
    return max(0, peak - base) * 1024


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
