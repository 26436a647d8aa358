"""token_logprobs under the rollout engine's distribution (temperature tensors, top-k, top-p, min-p)
and with the head's statistics, against the plain pass and against an eager sort-and-cumsum
implementation (vLLM's code on a float32 copy: ppo_kernels/token_logprobs/naive.py,
eager_sampled_logprobs). CPU, forward (rollout scoring), interleaved medians.

    python bench/bench_sampler.py [--n 4096] [--v 152064] [--n-eager 256] [--reps 5]
                                  [--out bench/results/cpu_sampler.md] [--csv ...]

Table 1 at the issue's size (N x V): every variant against the plain pass, interleaved. Table 2
at --n-eager rows (the eager baseline's sort holds ~6 copies of the logits: at N=4096 V=152064
float32 that is ~15 GB): the fused call against eager sort-and-cumsum, time and peak memory.
Inputs: logits randn * 2 (a flat row: top-p 0.9 keeps ~24% of the vocabulary, the costly case for
a selection), labels uniform.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import interleaved_medians, machine, peak_extra_bytes, write_report  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels.token_logprobs import naive  # noqa: E402

STATS = ("sum_p2", "lse", "is_argmax")


def inputs(n, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 2).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    t = torch.rand(n, generator=g) * 0.8 + 0.6
    return x, y, t


def variants(x, y, t, xp):
    """name -> callable (no grad): the plain pass, then each option alone, then combinations; xp
    holds peaked rows (randn * 4: top-p 0.9 keeps ~0.4% of the vocabulary, closer to a language
    model's head than randn * 2)."""
    tl = pk.token_logprobs
    return {
        "plain": lambda: tl(x, y),
        "temperature tensor": lambda: tl(x, y, temperature=t),
        "stats sum_p2+lse+is_argmax": lambda: tl(x, y, stats=STATS),
        "stats topk=20": lambda: tl(x, y, stats=("topk",), stats_top_k=20),
        "top_k=50": lambda: tl(x, y, top_k=50),
        "min_p=0.05": lambda: tl(x, y, min_p=0.05),
        "top_p=0.9 (vllm)": lambda: tl(x, y, top_p=0.9),
        "top_p=0.9 (sglang)": lambda: tl(x, y, top_p=0.9, sampler="sglang"),
        "top_k=50 top_p=0.95": lambda: tl(x, y, top_k=50, top_p=0.95),
        "plain, peaked rows": lambda: tl(xp, y),
        "top_p=0.9 (vllm), peaked rows": lambda: tl(xp, y, top_p=0.9),
        "top_p=0.9 (sglang), peaked rows": lambda: tl(xp, y, top_p=0.9, sampler="sglang"),
        "T tensor, top_k=50, top_p=0.95, min_p=0.02": lambda: tl(
            x, y, temperature=t, top_k=50, top_p=0.95, min_p=0.02
        ),
    }


EAGER_CASES = {
    "top_k=50": dict(top_k=50),
    "top_p=0.9": dict(top_p=0.9),
    "min_p=0.05": dict(min_p=0.05),
    "top_k=50 top_p=0.95": dict(top_k=50, top_p=0.95),
}


def ratio_lines(title, med, base, digits=1):
    """A markdown table of each mode's median time and its ratio to `base` (a name, or a function
    of the mode's name giving one)."""
    lines = [title, "", "| variant | ms | vs plain |", "|---|---|---|"]
    for name, sec in med.items():
        ref = med[base(name) if callable(base) else base]
        lines.append(f"| {name} | {sec * 1e3:.{digits}f} | {sec / ref:.2f}x |")
    return lines + [""]


def eager_lines(title, modes, med, names, digits=1):
    """A markdown table of the fused call against the eager one for each of `names` (modes
    "fused <name>" and "eager <name>"): time, speed-up, peak memory; and its rows for the CSV."""
    lines = [
        title,
        "",
        "| options | fused ms | eager ms | speed-up | fused peak MB | eager peak MB | memory ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = []
    for name in names:
        fs, es = med[f"fused {name}"], med[f"eager {name}"]
        fm = peak_extra_bytes(modes[f"fused {name}"]) / 2**20
        em = peak_extra_bytes(modes[f"eager {name}"]) / 2**20
        lines.append(
            f"| {name} | {fs * 1e3:.{digits}f} | {es * 1e3:.{digits}f} | {es / fs:.1f}x | "
            f"{fm:.2f} | {em:.0f} | {fm / em:.4f} |"
        )
        rows.append(dict(variant=name, ms=fs * 1e3, eager_ms=es * 1e3, fused_mb=fm, eager_mb=em))
    return lines + [""], rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--v", type=int, default=152064)
    ap.add_argument("--n-eager", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out")
    ap.add_argument("--csv")
    a = ap.parse_args()
    rows = []
    lines = [
        "# token_logprobs with the sampler's options and the head's statistics (CPU)",
        "",
        f"Machine: {machine()}. Forward only, no grad, cpp backend; interleaved medians of "
        f"{a.reps} repetitions; load average (1 min) before / after each table in its title.",
        "Inputs: logits randn * 2 (flat rows: top-p 0.9 keeps ~24% of the vocabulary), labels "
        "uniform; temperature tensor uniform in [0.6, 1.4]; 'peaked rows': randn * 4 (top-p 0.9 "
        "keeps ~0.4%, a few hundred tokens), against the plain pass on the same rows.",
        "Peak memory counts torch allocations; the CPU kernel's own scratch (per thread, reused "
        "across rows) is not among them: for top-p alone the row's masses, 4 B x V (0.6 MB at "
        "V=152064), its band (12 B a token, a few percent of a flat row; at most 12 B x V) and "
        "3 x 4096 bucket sums (float64); otherwise a 1024-token sample and the band, tens of KB "
        "typically, at most 16 B x V when a band holds the whole row (2.4 MB at V=152064).",
        "",
    ]
    with torch.no_grad(), pk.use_backend("cpp"):
        for dname in a.dtypes.split(","):
            dtype = getattr(torch, dname)
            x, y, t = inputs(a.n, a.v, dtype)
            xp = (x.float() * 2).to(dtype)
            modes = variants(x, y, t, xp)
            med, load = interleaved_medians(modes, a.reps, warmup=True)
            lines += ratio_lines(
                f"## N={a.n} V={a.v} {dname}: each variant vs the plain pass "
                f"(load {load[0]:.1f} / {load[1]:.1f})",
                med,
                lambda name: "plain, peaked rows" if "peaked" in name else "plain",
            )
            for name, sec in med.items():
                ref = med["plain, peaked rows"] if "peaked" in name else med["plain"]
                rows.append(dict(table="vs plain", dtype=dname, n=a.n, v=a.v, variant=name,
                                 ms=sec * 1e3, ratio=sec / ref))  # fmt: skip
            del x, y, t, xp, modes
            # against eager sort-and-cumsum, at fewer rows
            x, y, t = inputs(a.n_eager, a.v, dtype)
            modes = {}
            for name, kw in EAGER_CASES.items():
                modes[f"fused {name}"] = lambda kw=kw, x=x, y=y: pk.token_logprobs(x, y, **kw)
                modes[f"eager {name}"] = lambda kw=kw, x=x, y=y: naive.eager_sampled_logprobs(
                    x, y, **kw
                )
            med, load = interleaved_medians(modes, a.reps, warmup=True)
            table, erows = eager_lines(
                f"## N={a.n_eager} V={a.v} {dname}: fused vs eager sort-and-cumsum "
                f"(load {load[0]:.1f} / {load[1]:.1f})",
                modes,
                med,
                EAGER_CASES,
            )
            lines += table
            rows += [dict(table="vs eager", dtype=dname, n=a.n_eager, v=a.v, **r) for r in erows]
            del x, y, t, modes
    write_report(lines, a.out)
    if a.csv:
        keys = sorted({k for r in rows for k in r})
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
