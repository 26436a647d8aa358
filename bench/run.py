"""Run the benchmarks and write their current results into bench/results/: one markdown file and
one CSV per benchmark (`<stem>.md`, `<stem>.csv`), overwritten on every run (history is git's),
and the index bench/results/README.md (claim -> file -> command).

    python bench/run.py                      # the op tables (a few minutes): token_logprobs, kl, ...
    python bench/run.py --only overhead,gae  # named benchmarks (`--list` shows them all)
    python bench/run.py --all                # every benchmark (hours on two cores)
    python bench/run.py --csv-only           # redo each CSV and the index from the markdown

`bash scripts/dev.sh bench ...` runs this in the project's venv. The op tables are measured here
(each bench_<op>.py's `table_rows`); the other benchmarks are their own scripts, run as
subprocesses that write the markdown; the CSV is then read from the markdown's tables (one row
per table row, with the section heading it sits under), so the docs build their tables and plots
from the CSVs alone.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

# name: (the claim the file backs, results stem, how it runs). "table": bench_<name>.py's
# table_rows, measured here; otherwise the argv run from the repository root, with {out} the
# markdown path. A benchmark that writes a fixed path ignores {out}. A str: a study whose
# markdown is written by hand from the runs that str names (run.py only redoes its CSV).
OP_TABLES = ["token_logprobs", "kl", "gae", "losses", "linear_logprobs"]
BENCHMARKS = {
    "token_logprobs": (
        "token log-probs and entropy from logits vs eager, torch.compile and TRL",
        "cpu_token_logprobs",
        "table",
    ),
    "kl": ("kl_penalty, kl_penalized_rewards, full_kl vs eager", "cpu_kl", "table"),
    "gae": ("gae vs verl's and OpenRLHF's loops and a copy of the same bytes", "cpu_gae", "table"),
    "losses": (
        "ppo_policy_loss, ppo_value_loss, grpo_advantages vs eager",
        "cpu_losses",
        "table",
    ),
    "linear_logprobs": (
        "log-probs from hidden states vs materialised logits",
        "cpu_linear_logprobs",
        "table",
    ),
    "sampler": (
        "token_logprobs under the sampler's distribution (top-k / top-p / min-p, per-row "
        "temperatures) and the head's statistics vs the plain pass and eager sort-and-cumsum",
        "cpu_sampler",
        ["bench/bench_sampler.py", "--out", "{out}"],
    ),
    "linear_sampler": (
        "linear_token_logprobs under the sampler's distribution and with the head's statistics "
        "vs the plain pass and F.linear + eager sort-and-cumsum",
        "cpu_linear_sampler",
        ["bench/bench_linear_sampler.py", "--out", "{out}"],
    ),
    "overhead": (
        "per-call cost of every op at 2 x 8 and 64 x 4096, one thread",
        "cpu_overhead",
        ["bench/bench_overhead.py", "--out", "{out}"],
    ),
    "overhead_tricks": (
        "the per-call tricks (hand-built autograd nodes, `os.environ._data`) vs their plain forms",
        "cpu_overhead_tricks",
        "python bench/bench_overhead_tricks.py {env,nodes} {calls,step}",
    ),
    "linear_policy_loss": (
        "the fused policy loss vs our composition, Liger and TRL at 4096x1024x32000 and "
        "1024x256x152064",
        "cpu_linear_policy_loss",
        [
            "bench/bench_linear_policy_loss.py",
            "--reps",
            "3",
            "--threads",
            "2",
            "--sizes",
            "4096,1024,32000",
            "1024,256,152064",
            "--dtypes",
            "bfloat16",
            "float32",
            "--liger-compiled",
            "--skip",
            "trl",
            "float32 tiles",
            "--out",
            "{out}",
        ],
    ),  # fmt: skip
    "head_defaults": (
        "linear_token_logprobs with its defaults vs TRL's fused LM head",
        "cpu_head_defaults",
        ["bench/bench_head_defaults.py", "--reps", "3", "--threads", "1", "--out", "{out}"],
    ),
    "preference": (
        "the fused DPO loss with a reference head vs Liger's LigerFusedLinearDPOLoss and the "
        "materialised logits at 8x512 pairs x 1024 x 32000 and 2x1024 x 256 x 152064",
        "cpu_preference",
        ["bench/bench_preference.py", "--reps", "3", "--threads", "2", "--out", "{out}"],
    ),
    "batch_invariant": (
        "the cost of batch-invariant mode",
        "cpu_batch_invariant",
        ["bench/bench_batch_invariant.py", "--out", "{out}"],
    ),
    "distill": (
        "the fused distillation loss vs Liger's LigerFusedLinearJSDLoss and the materialised "
        "logits at 4096x1024x32000 and 2048x256x152064",
        "cpu_distill",
        ["bench/bench_distill.py", "--reps", "3", "--threads", "2", "--out", "{out}"],
    ),
    "distributed": (
        "bytes per token of the distributed forms' one collective (2 gloo processes)",
        "cpu_distributed",
        ["bench/bench_distributed.py"],
    ),
    "peers": (
        "the peers' per-token paths, callers and hidden-state paths, unpatched vs patched",
        "cpu_peers",
        ["bench/bench_peers.py", "--n", "256", "64", "--reps", "3", "--out", "{out}"],
    ),
    "peers_hidden": (
        "verl's and OpenRLHF's actor forward + backward from hidden states (a section of "
        "cpu_peers.md)",
        "cpu_peers",
        ["bench/bench_peers_hidden.py", "--threads", "1", "--out", "{out}"],
    ),
    "verl_losses": (
        "verl's core_algos step per policy-loss registry entry, unpatched vs patched",
        "cpu_verl_losses",
        [
            "bench/bench_verl_losses.py",
            "--batch",
            "64",
            "--length",
            "1024",
            "--reps",
            "5",
            "--out",
            "{out}",
        ],  # fmt: skip
    ),
    "trl_grpo_loss": (
        "TRL GRPOTrainer.compute_loss: unpatched, our fused head, our fused loss",
        "cpu_trl_grpo_loss",
        ["bench/bench_trl_grpo_loss.py", "--reps", "8", "--threads", "1", "--out", "{out}"],
    ),
    "e2e_verl": (
        "verl PPO / GRPO end to end, patched vs unpatched: same samples, losses, parameters",
        "cpu_e2e_verl",
        ["bench/e2e_verl.py", "--iters", "20", "--out", "{out}"],
    ),
    "e2e_trl": (
        "TRL GRPOTrainer end to end, patched vs unpatched",
        "cpu_e2e_trl",
        [
            "bench/e2e_trl.py",
            "--steps",
            "4",
            "--vocab",
            "512",
            "--reps",
            "5",
            "--threads",
            "1",
            "--out",
            "{out}",
        ],  # fmt: skip
    ),
    "demo": (
        "the demo: PPO fused vs eager (time per step, peak memory, reward)",
        "cpu_demo",
        "demo",
    ),
    "trainer_learning": (
        "every trainer algorithm raises the held-out reward",
        "trainer_learning",
        ["bench/train_learning.py", "--results", "{out}"],
    ),
    "trainer_dp": (
        "the trainer data-parallel (DDP, FSDP2) follows the one-process run",
        "trainer_dp",
        ["bench/train_dp.py", "--results", "{out}"],
    ),
}
DEMO = [
    "-m", "ppo_kernels", "train", "--algo", "ppo", "--compare", "--threads", "1",
    "--no-checkpoint",
]  # fmt: skip
GPU_NOTE = (
    "GPU reports: `gpu_<kind>.md` and `.csv`, one per device kind, written by "
    "`python bench/gpu_check.py` on the lent machine (DEVELOPING.md, the GPU check); each names "
    "its date and commit."
)


def commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def stamp(command, threads=True):
    """The line naming a result's date, commit, machine, load and command. A benchmark run as a
    subprocess sets its own thread count (its text says it): `threads=False` leaves ours out."""
    from _common import machine

    where = machine() if threads else machine().rsplit(", ", 1)[0]
    return (
        f"Measured {datetime.date.today()} at commit {commit() or '?'} on {where}, "
        f"load average {os.getloadavg()[0]:.2f}. Command: `{command}`."
    )


def run_table(name, reps):
    """A bench_<name>.py's table_rows, as markdown and CSV rows."""
    mod = importlib.import_module(f"bench_{name}")
    rows = mod.table_rows(reps=reps)
    base = {}
    for r in rows:
        if r["impl"].startswith("eager"):
            base.setdefault(r["case"], r["seconds"])
    lines = [
        f"# {name} on the CPU",
        "",
        stamp(f"python bench/run.py --only {name} --reps {reps}")
        + " Median of the timed runs; peak extra memory = most bytes held in tensors beyond the"
        " inputs (torch profiler allocation events; outputs and gradients included).",
        "",
        "| case | impl | median ms | vs eager | peak extra MiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get(r["case"])
        ok = b and r["seconds"] == r["seconds"] and r["seconds"] > 0
        speed = f"{b / r['seconds']:.2f}x" if ok else ""
        lines.append(
            f"| {r['case']} | {r['impl']} | {1e3 * r['seconds']:.2f} | {speed} | "
            f"{r['peak_extra_mb']:.1f} |"
        )
    fields = ["case", "impl", "seconds", "peak_extra_mb"]
    return "\n".join(lines) + "\n", [{k: r.get(k) for k in fields} for r in rows]


def run_script(argv, out):
    rel = str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)
    argv = [a.replace("{out}", rel) for a in argv]
    print("$ python " + " ".join(argv), flush=True)
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True)
    shown = " ".join(repr(a) if " " in a else a for a in argv)
    with open(out, "a") as f:
        f.write(f"\n{stamp('python ' + shown, threads=False)}\n")


def run_demo(out):
    """The demo's command in a scratch directory; its compare.txt becomes the result."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *DEMO, "--out", tmp], cwd=ROOT, check=True)
        minutes = (time.perf_counter() - t0) / 60
        text = (pathlib.Path(tmp) / "compare.txt").read_text()
    out.write_text(
        "# The demo: PPO with fused ops vs eager ops (`bash scripts/dev.sh demo`)\n\n"
        + stamp("python " + " ".join(DEMO) + " --out DIR", threads=False)
        + f" The whole command took {minutes:.1f} min (SFT warm-up included, venv and build in"
        " place).\n\n```\n" + text.rstrip() + "\n```\n"
    )


# -- markdown tables -> CSV ----------------------------------------------------------------------


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def md_tables(text):
    """[(section, header, rows)] of every markdown table in `text`; `section` is the nearest
    heading above the table. Tables inside code blocks are skipped."""
    tables, section, in_code = [], "", False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            section = line.lstrip("#").strip()
        elif (
            not in_code
            and line.startswith("|")
            and i + 1 < len(lines)
            and re.fullmatch(r"\|?[\s:|-]+\|?", lines[i + 1].strip())
        ):
            header, rows = _cells(line), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append((section, header, rows))
            continue
        i += 1
    return tables


def _code_table(text):
    """The demo's compare.txt (in a code block): rows of `name  fused  eager  ratio`."""
    m = re.search(r"```\n(.*?)```", text, re.S)
    rows = []
    for line in (m.group(1) if m else "").splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) >= 3 and parts[0] and not line.startswith(" "):
            rows.append((parts + [""])[:4])
    return rows


def write_csv_from_md(md, path):
    """Every table of markdown file `md` into CSV `path`: columns `section`, `table` (its index
    in the file), then the union of the tables' headers."""
    text = md.read_text()
    records, fields = [], ["section", "table"]
    for t, (section, header, rows) in enumerate(md_tables(text)):
        header = [h or f"col{j}" for j, h in enumerate(header)]
        for h in header:
            if h not in fields:
                fields.append(h)
        for row in rows:
            records.append({"section": section, "table": t, **dict(zip(header, row))})
    if not records and "```" in text:  # the demo's report
        fields = ["section", "table", "metric", "fused", "eager", "fused/eager"]
        title = text.splitlines()[0].lstrip("# ")
        for row in _code_table(text):
            records.append({"section": title, "table": 0, **dict(zip(fields[2:], row))})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(records)


def write_index(out):
    """bench/results/README.md: claim -> file -> command, from BENCHMARKS."""
    lines = [
        "# Benchmark results: one current result per claim",
        "",
        "Each file is the latest run of its benchmark, overwritten by the command beside it "
        "(`bash scripts/dev.sh bench` runs `python bench/run.py` in the project's venv); earlier "
        "runs are in git's history. Each markdown file names its date, commit, machine and "
        "command; its `.csv` holds the same tables (the docs' benchmark page is built from the "
        "CSVs).",
        "",
        "| claim | file | command |",
        "|---|---|---|",
    ]
    for name, (claim, stem, how) in BENCHMARKS.items():
        flag = "" if name in OP_TABLES else f" --only {name}"
        command = f"bash scripts/dev.sh bench{flag}"
        if isinstance(how, str) and how not in ("table", "demo"):
            command = how
        lines.append(f"| {claim} | [`{stem}.md`]({stem}.md), [`.csv`]({stem}.csv) | `{command}` |")
    for gpu in sorted(out.glob("gpu_*.md")):
        lines.append(
            f"| the GPU check on {gpu.stem[4:]}: correctness, timings, compute-sanitizer | "
            f"[`{gpu.name}`]({gpu.name}), [`.csv`]({gpu.stem}.csv) | "
            "`python bench/gpu_check.py` (on the lent GPU) |"
        )
    lines += ["", GPU_NOTE, ""]
    (out / "README.md").write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated names (see --list)")
    ap.add_argument("--all", action="store_true", help="every benchmark")
    ap.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    ap.add_argument("--csv-only", action="store_true", help="redo the CSVs and the index only")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the op tables")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.list:
        for name, (claim, stem, _) in BENCHMARKS.items():
            print(f"{name:20s} {stem}.md  {claim}")
        return
    names = list(BENCHMARKS) if args.all else [n for n in args.only.split(",") if n] or OP_TABLES
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; --list shows them")
    if not args.csv_only:
        sys.path.insert(0, str(HERE))
        sys.path.insert(1, str(ROOT))  # the checkout, when ppo_kernels is not installed
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
        for name in names:
            _, stem, how = BENCHMARKS[name]
            md = out / f"{stem}.md"
            if how == "table":
                text, rows = run_table(name, args.reps)
                md.write_text(text)
                print(text, flush=True)
                with open(out / f"{stem}.csv", "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)
                continue
            if isinstance(how, str) and how != "demo":
                print(f"{name}: written by hand from `{how}` (its CSV redone only)", flush=True)
            elif how == "demo":
                run_demo(md)
            else:
                run_script(how, md)
            write_csv_from_md(md, out / f"{stem}.csv")
    else:
        for _, stem, how in BENCHMARKS.values():
            if how != "table" and (out / f"{stem}.md").exists():
                write_csv_from_md(out / f"{stem}.md", out / f"{stem}.csv")
        for gpu in out.glob("gpu_*.md"):
            if not (out / f"{gpu.stem}.csv").exists():
                write_csv_from_md(gpu, out / f"{gpu.stem}.csv")
    write_index(out)


if __name__ == "__main__":
    main()
