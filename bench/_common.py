"""Shared benchmark helpers: medians and peak memory, on the CPU and the GPU.

Peak memory is the most bytes a call holds in tensors beyond what existed before it (outputs
included): `peak_extra_bytes`, from ppo_kernels/_memory.py (the trainer's --compare uses the same
measurement): on CUDA torch.cuda.max_memory_allocated over the baseline; on the CPU the running sum
of the torch profiler's allocation events (exact; the resident set misses memory the allocator
reuses).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ppo_kernels._memory import peak_extra_bytes  # noqa: F401  (the benchmarks import it from here)


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


def write_report(lines, out=None):
    """The report's lines to `out` (a path), or to stdout without one."""
    text = "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


def interleaved_medians(modes, reps, warmup=False):
    """({name: median seconds}, (load before, load after)) of the callables in `modes`, run
    interleaved (each mode once per repetition, in order): a busy machine slows all alike. With
    warmup, each mode runs once first, untimed (its buffers, a compilation)."""
    if warmup:
        for fn in modes.values():
            fn()
    times = {n: [] for n in modes}
    load0 = os.getloadavg()[0]
    for _ in range(reps):
        for name, fn in modes.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}, (load0, os.getloadavg()[0])
