"""`python -m ppo_kernels train ...`: parse the flags, print the phase-time estimate, run one job
(job.run), and with --compare repeat it with the other --ops in a subprocess, then print the
side-by-side table and the closing notes (report.py).

The trainer's modules below this one: config (flags), job (a run end to end), checkpoint (files
for --resume and the SFT cache), report (metrics files, plot, table, notes), estimate (phase
times); imports point from here to them, never back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from . import job, report
from .config import ConfigError, config_from_args


def _without(argv, flag_names):
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        name = x.split("=", 1)[0]
        if name in flag_names:
            if "=" not in x and name != "--compare":
                skip = True
            continue
        out.append(x)
    return out


def _estimator(cfg, compare: bool):
    """The `before_sft` of job.run that prints the phase times (PPO / GRPO on the CPU, rank 0)."""
    if cfg.algo not in ("ppo", "grpo") or cfg.device != "cpu" or os.environ.get("RANK", "0") != "0":
        return None
    from . import estimate

    runs = [cfg.ops] + ([{"fused": "eager", "eager": "fused"}[cfg.ops]] if compare else [])

    def before_sft(actor, tok, task, sft_to_run):
        print(estimate.estimate(cfg, actor, tok, task, runs, sft_to_run), flush=True)

    return before_sft


def _check_dependencies():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return (
            "the trainer needs transformers: pip install 'ppo-kernels[train]' (or pip install "
            "'transformers>=4.45' tqdm matplotlib)"
        )
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, args = config_from_args(argv)
        problem = _check_dependencies()
        if problem:
            raise ConfigError(problem)
        if args.compare and "RANK" in os.environ:
            raise ConfigError("--compare runs one process; run torchrun once per --ops instead")
        summary = job.run(cfg, before_sft=_estimator(cfg, args.compare))
    except ConfigError as e:
        print(f"python -m ppo_kernels train: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") != "0":
        return 0  # data-parallel: rank 0 reports
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "eval_reward_before",
                    "eval_reward_after",
                    "seconds_per_step",
                    "peak_memory_bytes",
                )
            }
        )
    )
    if summary["ops_eager_fallback"] and cfg.ops == "fused":
        print(f"note: not fused as asked: {summary['ops_eager_fallback']}")
    return _compare(argv, cfg, summary) if args.compare else 0


def _compare(argv, cfg, summary) -> int:
    """--compare: the same run with the other --ops in a subprocess (same SFT cache), then the
    table, the overlaid plot and the closing notes."""
    other = "eager" if cfg.ops == "fused" else "fused"
    other_out = os.path.join(cfg.out, f"compare_{other}")
    cmd = [
        sys.executable,
        "-m",
        "ppo_kernels",
        "train",
        *_without(argv, {"--ops", "--out", "--compare", "--sft-cache", "--resume", "--threads"}),
        "--ops",
        other,
        # the first run's threads (--threads 0 chooses from the load, which this run changed)
        "--threads",
        str(summary["torch_threads"]),
        "--out",
        other_out,
        "--sft-cache",
        cfg.sft_cache or os.path.join(cfg.out, "sft_cache"),
        # --compare never resumes this run (it starts over: no --resume above), so no checkpoint
        "--no-checkpoint",
    ]
    print(f"\n--compare: the same run with --ops {other} ({other_out})")
    rc = subprocess.call(cmd)
    if rc != 0:
        return rc
    with open(os.path.join(other_out, "summary.json")) as f:
        other_summary = json.load(f)
    runs = {
        cfg.ops: report.read_rows(os.path.join(cfg.out, "metrics.jsonl")),
        other: report.read_rows(os.path.join(other_out, "metrics.jsonl")),
    }
    plot_path = os.path.join(cfg.out, "curves.png")
    try:
        report.plot(runs, {cfg.ops: summary, other: other_summary}, plot_path)
    except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
        plot_path = f"(plot skipped: {e})"
    table = report.compare_table(summary, other_summary)
    notes = report.closing_notes(summary, other_summary, runs[cfg.ops], runs[other])
    with open(os.path.join(cfg.out, "compare.txt"), "w") as f:
        f.write(table + "\n" + (f"\n{notes}\n" if notes else ""))
    print("\n" + table + f"\nplot: {plot_path}" + (f"\n\n{notes}" if notes else ""))
    return 0
