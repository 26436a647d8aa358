"""Run the CPU benchmarks at their embedded default sizes and print a side-by-side table (median
time, speed-up over eager, peak extra memory); also updates bench/results/cpu_benchmarks.md and
.csv (the ops of this run replace their previous rows; the others are kept).

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
    return sorted(p.stem[len("bench_") :] for p in HERE.glob("bench_*.py"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ops", default="", help="comma-separated (default: every bench/bench_<op>.py)"
    )
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
        lines = [
            f"### {op}",
            "",
            "| case | impl | median ms | vs eager | peak extra MiB |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            b = base.get(r["case"])
            speed = (
                f"{b / r['seconds']:.2f}x"
                if b and r["seconds"] == r["seconds"] and r["seconds"] > 0
                else ""
            )
            lines.append(
                f"| {r['case']} | {r['impl']} | {1e3 * r['seconds']:.2f} | {speed} | "
                f"{r['peak_extra_mb']:.1f} |"
            )
        texts.append("\n".join(lines))
        print(texts[-1] + "\n", flush=True)
        all_rows += [dict(op=op, **{k: v for k, v in r.items() if k != "op"}) for r in rows]
    if not all_rows:
        return
    # Merge into the saved results: the ops of this run replace their old sections and rows.
    md, csv_path = out / "cpu_benchmarks.md", out / "cpu_benchmarks.csv"
    sections = {}
    if md.exists():
        for part in md.read_text().split("\n### ")[1:]:
            sections[part.split("\n", 1)[0].strip()] = "### " + part.strip()
    for text in texts:
        sections[text.split("\n", 1)[0][4:].strip()] = text
    md.write_text(
        f"# CPU benchmarks\n\n`python bench/run.py` on {machine()}. Median of the timed runs; peak "
        "extra memory = most bytes held in tensors beyond the inputs (torch profiler allocation "
        "events; outputs and gradients included).\n\n"
        + "\n\n".join(sections[k] for k in sorted(sections))
        + "\n"
    )
    fields = ["op", "case", "impl", "seconds", "peak_extra_mb"]
    ran = {r["op"] for r in all_rows}
    old_rows = []
    if csv_path.exists():
        with open(csv_path, newline="") as f:
            old_rows = [r for r in csv.DictReader(f) if r["op"] not in ran]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: r.get(k) for k in fields} for r in old_rows + all_rows)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
