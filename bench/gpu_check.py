"""The GPU check: one command that builds the extension, checks every GPU kernel (Triton and CUDA)
against the float64 reference on fresh random data, runs compute-sanitizer on the CUDA kernels,
times everything against eager PyTorch and peers, and writes a dated report.

    python bench/gpu_check.py [--skip-build] [--skip-sanitizer] [--only OP,...] [--out DIR]

Correctness is the `cuda` pytest tests, tests/cuda/test_cuda_<op>.py (tolerances and
NaN-poisoning from tests/support/utils.py), run here in one pytest subprocess per op (a kernel that
corrupts the CUDA context fails its op only); their pass/fail table goes into the report. pytest must be installed
(see DEVELOPING.md); without it that phase is reported as not run and the exit status is 1.
Each op adds bench/gpu_checks/<op>.py with up to two functions:
    sanitize_workload()     small calls of the CUDA (cpp) kernels, run under compute-sanitizer
    timing(ctx)             ctx.bench(...) fused backends vs eager and peers, with bytes moved
    profile(ctx)            ctx.profile(...) the top kernels of one large call (torch.profiler)
The report (markdown + CSV) goes to bench/results/gpu_<kind>.{md,csv}, one per device kind (e.g.
gpu_H200.md; it names its date and commit; history is git's), or to --out (e.g. $OUT on the device
machine), rewritten after each phase (correctness, timing, sanitizer: the slowest
last) so a run cut short by its time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _modules(only):
    names = sorted(
        p.stem for p in (ROOT / "bench" / "gpu_checks").glob("*.py") if not p.stem.startswith("_")
    )
    if only:
        names = [n for n in names if n in only]
    return [(n, importlib.import_module(f"gpu_checks.{n}")) for n in names]


class Ctx:
    """What the timing functions of bench/gpu_checks/<op>.py record into."""

    def __init__(self):
        import torch

        self.torch = torch
        self.timings = []  # timing rows
        self.profiles = []  # (op, case, top kernels)
        self.bandwidth = None

    def profile(self, op, case, rows):
        self.profiles.append((op, case, rows))

    # -- timing --
    def measure_bandwidth(self):
        """Device-to-device copy bandwidth (read + write), the floor every op is compared to."""
        torch = self.torch
        import triton.testing

        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200)
        self.bandwidth = 2 * x.numel() / (ms * 1e-3)
        return self.bandwidth  # x and y (4 GiB) are freed on return

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
                bw = (
                    (bytes_moved / (ms * 1e-3) / self.bandwidth)
                    if (bytes_moved and self.bandwidth)
                    else None
                )
                self.timings.append(
                    dict(
                        op=op,
                        case=case,
                        impl=name,
                        ms=ms,
                        peak_mb=peak / 2**20,
                        pct_bw=None if bw is None else 100 * bw,
                    )
                )
            except Exception as e:  # noqa: BLE001
                self.timings.append(
                    dict(
                        op=op,
                        case=case,
                        impl=name,
                        ms=float("nan"),
                        peak_mb=float("nan"),
                        pct_bw=None,
                        error=f"{type(e).__name__}: {str(e)[:200]}",
                    )
                )


CUDA_TESTS = ROOT / "tests" / "cuda"
TEST_TIMEOUT_S = 600  # per op: a hung kernel must not take the whole device time


def _selected(name, only):
    """--only OP runs tests/cuda/test_cuda_OP.py and test_cuda_OP_*.py (e.g. sampler: the
    sampler's options of the fused losses too)."""
    return any(name == op or name.startswith(op + "_") for op in only)


def _correctness(only):
    """Run the `cuda` tests of each op (tests/cuda/test_cuda_<op>.py) in its own pytest
    subprocess. Yields, op after op, (rows, problems): a row per test (op, test, result, seconds,
    message), and the lines that say why an op, or the whole phase, did not run."""
    if importlib.util.find_spec("pytest") is None:
        yield (
            [],
            [
                "pytest is not installed here: the correctness tests did NOT run (`pip download "
                "-d wheels/ pytest` on a machine with internet, then `pip install --no-deps "
                "wheels/*.whl` here; see DEVELOPING.md)"
            ],
        )
        return
    import xml.etree.ElementTree as ET

    files = sorted(CUDA_TESTS.glob("test_cuda_*.py"))
    if only:
        files = [f for f in files if _selected(f.stem.removeprefix("test_cuda_"), only)]
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            rows, problems = [], []
            op = f.stem.removeprefix("test_cuda_")
            xml = pathlib.Path(tmp) / f"{op}.xml"
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "cuda",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junit-xml={xml}",
                str(f),
            ]
            t = time.time()
            try:
                r = subprocess.run(
                    cmd, cwd=ROOT, capture_output=True, text=True, timeout=TEST_TIMEOUT_S
                )
                rc, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[-3:]
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", [f"killed after {TEST_TIMEOUT_S} s"]
            print(f"correctness {op}: rc={rc} in {time.time() - t:.0f}s", flush=True)
            if not xml.exists():  # pytest itself died (e.g. a crash in a kernel), or timed out
                yield [], [f"{op}: pytest rc={rc}, no results: {' | '.join(tail)}"]
                continue
            for case in ET.parse(xml).iter("testcase"):
                result, msg = "passed", ""
                for tag, name in (
                    ("failure", "**FAILED**"),
                    ("error", "**ERROR**"),
                    ("skipped", "skipped"),
                ):
                    el = case.find(tag)
                    if el is not None:
                        result, msg = name, " ".join((el.get("message") or el.text or "").split())
                        break
                rows.append(
                    dict(
                        op=op,
                        test=case.get("name"),
                        result=result,
                        seconds=float(case.get("time") or 0),
                        message=msg[:400],
                    )
                )
            if rc not in (0, 1):  # 1: some tests failed (in the rows); anything else is a problem
                problems.append(f"{op}: pytest rc={rc}: {' | '.join(tail)}")
            yield rows, problems


def _correctness_section(rows, problems):
    """The report's correctness lines and the number of failures (failed tests, and ops or a
    phase that did not run)."""
    failed = len(problems) + sum(r["result"] in ("**FAILED**", "**ERROR**") for r in rows)
    count = {k: sum(r["result"] == k for r in rows) for k in ("passed", "skipped")}
    lines = [
        "## Correctness against the float64 reference (`pytest -m cuda tests/cuda`)",
        "",
        f"{count['passed']} passed, {failed} failed, {count['skipped']} skipped",
        "",
    ]
    lines += [f"- {p}" for p in problems] + ([""] if problems else [])
    lines += ["| op | test | result | s | message |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['op']} | {r['test']} | {r['result']} | {r['seconds']:.1f} | "
        f"{r['message'].replace('|', '/')} |"
        for r in rows
    ]
    return lines + [""], failed


def _build():
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 4), PPO_KERNELS_FORCE_CUDA="1")
    t = time.time()
    r = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    log = r.stdout + r.stderr
    # a compile error is far above the traceback that ends the log: its lines first
    errors = [ln for ln in log.splitlines() if "error" in ln.lower() and "Traceback" not in ln]
    return r.returncode, time.time() - t, "\n".join(errors[:30])[-4000:] + "\n...\n" + log[-1500:]


def _sanitize(only, tools):
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        return [("all", "skipped", "compute-sanitizer not found")]
    out = []
    for name, mod in _modules(only):
        if not hasattr(mod, "sanitize_workload"):  # Triton / eager only: no CUDA C++ kernel
            out.append((name, "-", "no CUDA C++ kernel (nothing to sanitize)"))
            continue
        for tool in tools:
            r = subprocess.run(
                [
                    exe,
                    "--tool",
                    tool,
                    "--error-exitcode",
                    "3",
                    sys.executable,
                    __file__,
                    "--sanitize-target",
                    name,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
            out.append(
                (
                    name,
                    tool,
                    "ok" if r.returncode == 0 else f"FAILED rc={r.returncode}: {' | '.join(tail)}",
                )
            )
    return out


def _timing_rows(ctx):
    rows = []
    for r in ctx.timings:
        pct = "" if r.get("pct_bw") is None else f"{r['pct_bw']:.0f}%"
        err = f" ({r['error']})" if r.get("error") else ""
        rows.append(
            f"| {r['op']} | {r['case']} | {r['impl']}{err} | {r['ms']:.4f} | {r['peak_mb']:.1f} | {pct} |"
        )
    return rows + [""]


def _write_report(out_dir, lines, ctx, gpu):
    """The markdown report and the timing CSV (rewritten after each phase)."""
    import csv

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_" + gpu.removeprefix("NVIDIA ").replace(" ", "_")  # one report per device kind
    (out / f"{stem}.md").write_text("\n".join(lines))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["op", "case", "impl", "ms", "peak_mb", "pct_bw", "error"])
        w.writeheader()
        for r in ctx.timings:
            w.writerow({k: r.get(k) for k in w.fieldnames})


def profile_section(profiles) -> list[str]:
    """The report's profile tables: per op, its top kernels by self time."""
    out = ["## Profile (torch.profiler, one call after a warm-up; kernels by self time)", ""]
    for op, case, rows in profiles:
        out += [f"### {op}: {case}", "", "| kernel | calls | ms | % of step |", "|---|---|---|---|"]
        out += [
            f"| `{r['kernel'][:90]}` | {r['calls']} | {r['ms']:.2f} | {r['pct']:.1f} |"
            for r in rows
        ]
        out.append("")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-sanitizer", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument(
        "--only", default="", help="comma-separated ops (names of bench/gpu_checks/*.py)"
    )
    ap.add_argument(
        "--sanitizer-tools",
        default="memcheck",
        help="comma-separated compute-sanitizer tools (memcheck,racecheck,initcheck)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default="", help="the commit to name in the report")
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
        if build[0] != 0:  # nothing after it means anything: stop before spending device time
            print(build[2], flush=True)
            out = pathlib.Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_build_failed.md").write_text(
                f"# GPU check {datetime.date.today()}: the build failed (rc={build[0]}, "
                f"{build[1]:.0f} s)\n\n```\n{build[2]}\n```\n"
            )
            return 1
    import torch

    from ppo_kernels import _backend

    ctx = Ctx()
    # the device tool's copy of the tree can carry an older .git than the files: pass --commit
    commit = args.commit or (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or "unknown"
    )
    gpu = torch.cuda.get_device_name()
    import triton

    lines += [
        f"# GPU check {datetime.date.today()} on {gpu}",
        "",
        f"commit {commit}; torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}; extension: {_backend.HAS_EXTENSION}",
        "",
    ]
    if build:
        lines += [f"build: rc={build[0]} in {build[1]:.0f}s", ""]  # a failed build stopped above

    failed = 0
    if args.skip_correctness:
        lines += ["## Correctness: skipped (--skip-correctness)", ""]
    else:
        rows, problems = [], []
        for op_rows, op_problems in _correctness(only):  # the report so far after each op
            rows, problems = rows + op_rows, problems + op_problems
            _write_report(args.out, lines + _correctness_section(rows, problems)[0], ctx, gpu)
        section, failed = _correctness_section(rows, problems)
        lines += section
    mods = _modules(only)

    _write_report(args.out, lines, ctx, gpu)

    if not args.skip_timing:
        bw = ctx.measure_bandwidth()
        head = [
            "## Timing (triton.testing.do_bench median, CUDA events)",
            "",
            f"measured copy bandwidth (read+write): {bw / 1e9:.0f} GB/s",
            "",
            "| op | case | impl | median ms | peak extra MiB | % of bandwidth |",
            "|---|---|---|---|---|---|",
        ]
        for name, mod in mods:
            if hasattr(mod, "timing"):
                t = time.time()
                try:
                    mod.timing(ctx)
                except Exception:  # noqa: BLE001
                    ctx.timings.append(
                        dict(
                            op=name,
                            case="timing",
                            impl="-",
                            ms=float("nan"),
                            peak_mb=float("nan"),
                            pct_bw=None,
                            error=traceback.format_exc(limit=3).replace("\n", " "),
                        )
                    )
                print(f"timing {name}: {time.time() - t:.1f}s", flush=True)
                # the rows so far after each op: a run cut short keeps what it timed
                _write_report(args.out, lines + head + _timing_rows(ctx), ctx, gpu)
        lines += head + _timing_rows(ctx)

    _write_report(args.out, lines, ctx, gpu)

    if not args.skip_profile:
        for name, mod in mods:
            if hasattr(mod, "profile"):
                t = time.time()
                try:
                    mod.profile(ctx)
                except Exception:  # noqa: BLE001
                    err = traceback.format_exc(limit=3).replace("\n", " ")
                    ctx.profiles.append((name, "profile", [dict(kernel=err, calls=0, ms=0, pct=0)]))
                print(f"profile {name}: {time.time() - t:.1f}s", flush=True)
        lines += profile_section(ctx.profiles)
        _write_report(args.out, lines, ctx, gpu)

    if not args.skip_sanitizer:
        t = time.time()
        san = _sanitize(only, [tool for tool in args.sanitizer_tools.split(",") if tool])
        print(f"sanitizer: {time.time() - t:.0f}s", flush=True)
        lines += [
            "## compute-sanitizer (CUDA kernels)",
            "",
            "| op | tool | result |",
            "|---|---|---|",
        ]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in san]
        lines.append("")

    _write_report(args.out, lines, ctx, gpu)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
