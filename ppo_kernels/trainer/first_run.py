"""What `bash scripts/dev.sh demo` spends before the trainer starts, printed before it is spent:
installing torch and the dependencies (when the venv lacks them) and compiling the extension
(when it is not built or its sources changed). The trainer then prints its own phase times
(estimate.py), from a probe of this machine.

Standard library only: dev.sh runs it with the system Python before anything is installed,

    python3 -I ppo_kernels/trainer/first_run.py --venv .venv --want "<dev.sh's dependency list>"
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Seconds, as (low, high) ranges: one C++ source compiled by one job (its share of a build with
# the torch headers precompiled: the README's first-run table), one CUDA source by nvcc, the
# installs of the CPU-only and of the CUDA torch (uv from a local index at the low end, pip
# downloading the wheels at the high end).
CPP_FILE = (12.0, 30.0)
CU_FILE = (50.0, 180.0)
INSTALL_CPU = (10.0, 180.0)
INSTALL_CUDA = (30.0, 600.0)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_note() -> str:
    """'' on a quiet machine; else a warning that the times move with the load (other processes
    keep at least one core busy)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    if load < 1.0:
        return ""
    return (
        f"note: this machine is busy (load average {load:.1f} on {cores()} cores): the times "
        "move with the load"
    )


def _sources(root: str, cuda: bool) -> tuple[list[str], list[str]]:
    cpp = [
        f
        for d in ("csrc", "csrc/cpu", "csrc/ops")
        for f in sorted(glob.glob(os.path.join(root, d, "*.cpp")))
    ]
    cu = sorted(glob.glob(os.path.join(root, "csrc/cuda/*.cu"))) if cuda else []
    return cpp, cu


def _to_compile(root: str, cuda: bool) -> tuple[int, int]:
    """(C++ files, CUDA files) a build compiles now: all without a built extension; with one, the
    sources newer than it (every source when a header is: which include it is not known here)."""
    cpp, cu = _sources(root, cuda)
    built = glob.glob(os.path.join(root, "ppo_kernels", "_C*.so"))
    if not built:
        return len(cpp), len(cu)
    t = min(os.path.getmtime(f) for f in built)
    headers = [
        f
        for pattern in ("csrc/**/*.h", "csrc/**/*.cuh")
        for f in glob.glob(os.path.join(root, pattern), recursive=True)
    ]
    if any(os.path.getmtime(f) > t for f in headers):
        return len(cpp), len(cu)
    return (
        sum(os.path.getmtime(f) > t for f in cpp),
        sum(os.path.getmtime(f) > t for f in cu),
    )


def phases(root: str, venv: str, want: str, jobs: int, cuda: bool) -> list[tuple[str, tuple]]:
    """[(phase, (low, high) seconds)] of what runs before the trainer; [] when nothing does."""
    out = []
    try:
        with open(os.path.join(venv, ".ppo_deps")) as f:
            have = f.read().strip()
    except OSError:
        have = None
    if have != want.strip():
        what = "the CUDA torch" if cuda else "torch"
        out.append(
            (f"installing {what} and the dependencies", INSTALL_CUDA if cuda else INSTALL_CPU)
        )
    n_cpp, n_cu = _to_compile(root, cuda)
    if n_cpp or n_cu:
        par = max(1, min(jobs, cores()))
        lo = (n_cpp * CPP_FILE[0] + n_cu * CU_FILE[0]) / par
        hi = (n_cpp * CPP_FILE[1] + n_cu * CU_FILE[1]) / par
        files = f"{n_cpp} C++" + (f" + {n_cu} CUDA" if n_cu else "")
        out.append((f"compiling the extension ({files} files, {par} at a time)", (lo, hi)))
    return out


def _span(lo: float, hi: float) -> str:
    if hi < 90:
        return f"{max(lo, 1):.0f}-{max(hi, 1):.0f} s"
    if lo < 60:  # seconds to minutes
        return f"{max(lo, 1):.0f} s-{hi / 60:.0f} min"
    return f"{lo / 60:.0f}-{hi / 60:.0f} min"


def describe(ph: list) -> str:
    """One line: each phase and its range, then the total; '' when nothing runs first."""
    if not ph:
        return ""
    lo, hi = sum(p[1][0] for p in ph), sum(p[1][1] for p in ph)
    parts = ", ".join(f"{name} {_span(*r)}" for name, r in ph)
    return f"before training (first run): {parts}; in all {_span(lo, hi)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", required=True)
    ap.add_argument("--want", default="", help="the dependency list dev.sh installs")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", "2") or 2))
    ap.add_argument("--cuda", action="store_true", help="a CUDA build (torch and kernels)")
    args = ap.parse_args(argv)
    line = describe(phases(ROOT, args.venv, args.want, args.jobs, args.cuda))
    note = load_note()
    for text in (line, note if line else ""):
        if text:
            print(f"== {text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
