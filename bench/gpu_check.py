"""The GPU check: one command that builds the extension, checks every GPU kernel (Triton and CUDA)
against the float64 reference on fresh random data, runs compute-sanitizer on the CUDA kernels,
times everything against eager PyTorch and peers, and writes a dated report.

    python bench/gpu_check.py [--skip-build] [--skip-sanitizer] [--only OP,...] [--out DIR]

Each op adds bench/gpu_checks/<op>.py with up to three functions:
    correctness(ctx)        ctx.compare(...) every backend against the float64 reference
    sanitize_workload()     small calls of the CUDA (cpp) kernels, run under compute-sanitizer
    timing(ctx)             ctx.bench(...) fused backends vs eager and peers, with bytes moved
The report (markdown + CSV) goes to bench/results/gpu_check_<date>_<gpu>.{md,csv} (or --out, e.g.
$OUT on the device machine), rewritten after each phase (correctness, timing, sanitizer: the slowest
last) so a run cut short by its time limit still leaves what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _modules(only):
    names = sorted(p.stem for p in (ROOT / "bench" / "gpu_checks").glob("*.py") if not p.stem.startswith("_"))
    if only:
        names = [n for n in names if n in only]
    return [(n, importlib.import_module(f"gpu_checks.{n}")) for n in names]


class Ctx:
    def __init__(self):
        import torch
        self.torch = torch
        self.rows = []        # correctness rows
        self.timings = []     # timing rows
        self.failures = 0
        self.bandwidth = None

    # -- correctness --
    def compare(self, op, case, backend, got, ref, atol, rtol):
        torch = self.torch
        try:
            got = got.double()
            ref = ref.double().to(got.device)
            both_nan = got.isnan() & ref.isnan()
            err = torch.where(both_nan, torch.zeros_like(got), (got - ref).abs())
            bound = atol + rtol * ref.abs()
            ok = bool(((err <= bound) | both_nan).all())
            worst = float(err.max()) if err.numel() else 0.0
        except Exception as e:  # noqa: BLE001
            ok, worst = False, float("nan")
            case = f"{case} ({type(e).__name__}: {e})"
        self.rows.append(dict(op=op, case=case, backend=backend, ok=ok, max_err=worst, atol=atol, rtol=rtol))
        self.failures += not ok
        return ok

    def fail(self, op, case, backend, why):
        self.rows.append(dict(op=op, case=f"{case}: {why}", backend=backend, ok=False, max_err=float("nan"),
                              atol=0, rtol=0))
        self.failures += 1

    # -- timing --
    def measure_bandwidth(self):
        """Device-to-device copy bandwidth (read + write), the floor every op is compared to."""
        torch = self.torch
        import triton.testing
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200)
        self.bandwidth = 2 * x.numel() / (ms * 1e-3)
        del x, y
        return self.bandwidth

    def bench(self, op, case, fns, bytes_moved=None, warmup=25, rep=100):
        """fns: {name: zero-arg callable}. Records median ms, peak extra memory, % of bandwidth."""
        torch = self.torch
        import triton.testing
        for name, fn in fns.items():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
                bw = (bytes_moved / (ms * 1e-3) / self.bandwidth) if (bytes_moved and self.bandwidth) else None
                self.timings.append(dict(op=op, case=case, impl=name, ms=ms, peak_mb=peak / 2**20,
                                         pct_bw=None if bw is None else 100 * bw))
            except Exception as e:  # noqa: BLE001
                self.timings.append(dict(op=op, case=case, impl=name, ms=float("nan"), peak_mb=float("nan"),
                                         pct_bw=None, error=f"{type(e).__name__}: {str(e)[:200]}"))


def _build():
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 4), PPO_KERNELS_FORCE_CUDA="1")
    t = time.time()
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    return r.returncode, time.time() - t, (r.stdout + r.stderr)[-3000:]


def _sanitize(only, tools):
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        return [("all", "skipped", "compute-sanitizer not found")]
    out = []
    for name, _ in _modules(only):
        for tool in tools:
            r = subprocess.run([exe, "--tool", tool, "--error-exitcode", "3", sys.executable, __file__,
                                "--sanitize-target", name], cwd=ROOT, capture_output=True, text=True,
                               timeout=300)
            tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
            out.append((name, tool, "ok" if r.returncode == 0 else f"FAILED rc={r.returncode}: {' | '.join(tail)}"))
    return out


def _write_report(out_dir, lines, ctx, gpu):
    """The markdown report and the timing CSV (rewritten after each phase)."""
    import csv
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{datetime.date.today()}_{gpu.replace(' ', '_')}"
    (out / f"{stem}.md").write_text("\n".join(lines))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["op", "case", "impl", "ms", "peak_mb", "pct_bw", "error"])
        w.writeheader()
        for r in ctx.timings:
            w.writerow({k: r.get(k) for k in w.fieldnames})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-sanitizer", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--sanitizer-tools", default="memcheck",
                    help="comma-separated compute-sanitizer tools (memcheck,racecheck,initcheck)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--sanitize-target", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]

    if args.sanitize_target:
        mod = importlib.import_module(f"gpu_checks.{args.sanitize_target}")
        if hasattr(mod, "sanitize_workload"):
            mod.sanitize_workload()
            import torch
            torch.cuda.synchronize()
        return 0

    lines = []
    build = None
    if not args.skip_build:
        build = _build()
        print(f"build: rc={build[0]} in {build[1]:.0f}s", flush=True)
    import torch
    import ppo_kernels
    from ppo_kernels import _backend
    ctx = Ctx()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    gpu = torch.cuda.get_device_name()
    import triton
    lines += [f"# GPU check {datetime.date.today()} on {gpu}", "",
              f"commit {commit}; torch {torch.__version__}, triton {triton.__version__}, "
              f"CUDA {torch.version.cuda}; extension: {_backend.HAS_EXTENSION}", ""]
    if build:
        lines += [f"build: rc={build[0]} in {build[1]:.0f}s", ""]
        if build[0] != 0:
            lines += ["```", build[2], "```", ""]

    mods = _modules(only)
    for name, mod in mods:
        if hasattr(mod, "correctness"):
            t = time.time()
            try:
                mod.correctness(ctx)
            except Exception:  # noqa: BLE001
                ctx.fail(name, "correctness", "-", traceback.format_exc(limit=3).replace("\n", " "))
            print(f"correctness {name}: {time.time() - t:.1f}s", flush=True)
    lines += ["## Correctness against the float64 reference", "",
              f"{sum(r['ok'] for r in ctx.rows)} passed, {ctx.failures} failed", "",
              "| op | case | backend | ok | max abs err | atol | rtol |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['case']} | {r['backend']} | {'ok' if r['ok'] else '**FAIL**'} | "
              f"{r['max_err']:.3g} | {r['atol']:.0e} | {r['rtol']:.0e} |" for r in ctx.rows]
    lines.append("")

    _write_report(args.out, lines, ctx, gpu)

    if not args.skip_timing:
        bw = ctx.measure_bandwidth()
        lines += ["## Timing (triton.testing.do_bench median, CUDA events)", "",
                  f"measured copy bandwidth (read+write): {bw / 1e9:.0f} GB/s", "",
                  "| op | case | impl | median ms | peak extra MiB | % of bandwidth |", "|---|---|---|---|---|---|"]
        for name, mod in mods:
            if hasattr(mod, "timing"):
                t = time.time()
                try:
                    mod.timing(ctx)
                except Exception:  # noqa: BLE001
                    ctx.timings.append(dict(op=name, case="timing", impl="-", ms=float("nan"),
                                            peak_mb=float("nan"), pct_bw=None,
                                            error=traceback.format_exc(limit=3).replace("\n", " ")))
                print(f"timing {name}: {time.time() - t:.1f}s", flush=True)
        for r in ctx.timings:
            pct = "" if r.get("pct_bw") is None else f"{r['pct_bw']:.0f}%"
            err = f" ({r['error']})" if r.get("error") else ""
            lines.append(f"| {r['op']} | {r['case']} | {r['impl']}{err} | {r['ms']:.4f} | {r['peak_mb']:.1f} | {pct} |")
        lines.append("")

    _write_report(args.out, lines, ctx, gpu)

    if not args.skip_sanitizer:
        t = time.time()
        san = _sanitize(only, [tool for tool in args.sanitizer_tools.split(",") if tool])
        print(f"sanitizer: {time.time() - t:.0f}s", flush=True)
        lines += ["## compute-sanitizer (CUDA kernels)", "", "| op | tool | result |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in san]
        lines.append("")

    _write_report(args.out, lines, ctx, gpu)
    print("\n".join(lines))
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())
