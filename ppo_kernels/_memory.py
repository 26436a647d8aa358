"""Peak bytes held in tensors while some code runs (the benchmarks' and the trainer's memory figure).

On CUDA: torch.cuda.max_memory_allocated over what was allocated before. On the CPU: the running
sum of the torch profiler's allocation events, which sees every allocation of the CPU allocator
(the kernels' internal temporaries included); the process's resident set would miss memory the
allocator reuses and count models, Python and libraries. Native stderr is silenced while the
profiler runs: Kineto logs its start and stop (and a failing CUDA probe on a machine without a
GPU), and the allocator warns about every block freed that was allocated before it started.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile

import torch


@contextlib.contextmanager
def _quiet_native_stderr():
    """Send file descriptor 2 to /dev/null (C++ log lines); Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class TensorPeak:
    """Filled in when the `tensor_peak` block ends: `bytes`, the peak above the starting level."""

    bytes: int | None = None


@contextlib.contextmanager
def tensor_peak(device: str = "cpu"):
    """`with tensor_peak(device) as peak: ...` then `peak.bytes`: the most bytes the block held in
    tensors beyond those allocated when it started (what it returns included)."""
    rec = TensorPeak()
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield rec
        torch.cuda.synchronize()
        rec.bytes = torch.cuda.max_memory_allocated() - base
        return
    from torch.profiler import ProfilerActivity, profile
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof:
        yield rec
    with _quiet_native_stderr(), tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    rec.bytes = peak


def peak_extra_bytes(fn, device: str = "cpu") -> int:
    """Peak bytes of tensors `fn()` allocates above what is allocated before it runs."""
    with tensor_peak(device) as peak:
        out = fn()
        del out
    return peak.bytes
