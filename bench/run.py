"""Run the CPU benchmarks at their embedded default sizes and print a side-by-side table (median
time, speed-up over eager, peak extra memory); also writes bench/results/cpu_benchmarks.md and
.csv (all ops of the run together).

    python bench/run.py [--ops token_logprobs,gae,...] [--reps 5]
"""
from __future__ import annotations

import argparse
import csv
import importlib
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the checkout, when ppo_kernels is not installed

from _common import machine  # noqa: E402


def discover():
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="", help="comma-separated (default: every bench/bench_<op>.py)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o] or discover()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}\n")
    texts, all_rows = [], []
    for op in ops:
        mod = importlib.import_module(f"bench_{op}")
        if not hasattr(mod, "table_rows"):
            continue
        rows = mod.table_rows(reps=args.reps)
        base = {}
        for r in rows:
            if r["impl"].startswith("eager"):
                base.setdefault(r["case"], r["seconds"])
        lines = [f"### {op}", "",
                 "| case | impl | median ms | vs eager | peak extra MiB |", "|---|---|---|---|---|"]
        for r in rows:
            b = base.get(r["case"])
            speed = f"{b / r['seconds']:.2f}x" if b and r["seconds"] == r["seconds"] and r["seconds"] > 0 else ""
            lines.append(f"| {r['case']} | {r['impl']} | {1e3 * r['seconds']:.2f} | {speed} | "
                         f"{r['peak_extra_mb']:.1f} |")
        texts.append("\n".join(lines))
        print(texts[-1] + "\n", flush=True)
        all_rows += [dict(op=op, **{k: v for k, v in r.items() if k != "op"}) for r in rows]
    if not all_rows:
        return
    (out / "cpu_benchmarks.md").write_text(
        f"# CPU benchmarks\n\n`python bench/run.py` on {machine()}. Median of the timed runs; peak "
        "extra memory = most bytes held in tensors beyond the inputs (torch profiler allocation "
        "events; outputs and gradients included).\n\n" + "\n\n".join(texts) + "\n")
    with open(out / "cpu_benchmarks.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["op", "case", "impl", "seconds", "peak_extra_mb"])
        w.writeheader()
        w.writerows({k: r.get(k) for k in w.fieldnames} for r in all_rows)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
