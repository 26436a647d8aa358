"""What a run reports: the metrics files (JSONL rows, CSV), the curves plot, and with --compare
the side-by-side table."""

from __future__ import annotations

import json


def write_csv(rows, path):
    import csv

    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


_CURVES = [
    ("score", "reward (train rollouts)"),
    ("kl", "KL to Reference (per sequence)"),
    ("pg_loss", "policy loss"),
    ("vf_loss", "value loss"),
    ("seconds", "seconds per step"),
    ("dpo_loss", "DPO loss"),
    ("reward_accuracy", "DPO reward accuracy"),
    ("rm_loss", "reward-model loss"),
    ("train_pair_accuracy", "RM train pair accuracy"),
]


def plot(runs: dict, summaries: dict, path):
    """One panel per metric, one line per run ({label: metrics rows}): fused and eager overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(k, t) for k, t in _CURVES if any(k in row for rows in runs.values() for row in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, (k, title) in zip(axes[0], keys):
        for label, rows in runs.items():
            pts = [(row["step"], row[k]) for row in rows if k in row]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{label} ops", alpha=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if k == "score":
            for label, s in summaries.items():
                if s.get("eval_reward_after") is not None:
                    ax.axhline(
                        s["eval_reward_after"],
                        ls="--",
                        lw=0.8,
                        c=ax.lines[list(runs).index(label)].get_color(),
                        label=f"{label}: eval after",
                    )
        ax.legend(fontsize=7)
    algo = next(iter(summaries.values()))["algo"]
    fig.suptitle(f"{algo}: " + " vs ".join(f"{label} ops" for label in runs))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def compare_table(a: dict, b: dict) -> str:
    """Side by side, fused first, with fused / eager ratios."""
    fused, eager = (a, b) if a["ops"] == "fused" else (b, a)
    rows = [
        ("time per step (s)", "seconds_per_step", 1, ".3f"),
        ("CPU time per step (s)", "cpu_seconds_per_step", 1, ".3f"),
        ("peak tensor memory (MiB)", "peak_memory_bytes", 2**-20, ".1f"),
        ("eval reward before", "eval_reward_before", 1, ".3f"),
        ("eval reward after", "eval_reward_after", 1, ".3f"),
    ]
    lines = [f"{'':26s} {'fused':>10s} {'eager':>10s} {'fused/eager':>12s}"]
    for name, key, scale, spec in rows:
        vf, ve = fused.get(key), eager.get(key)
        f = "-" if vf is None else format(vf * scale, spec)
        e = "-" if ve is None else format(ve * scale, spec)
        ratio = (
            f"{vf / ve:.2f}x"
            if key in ("seconds_per_step", "cpu_seconds_per_step", "peak_memory_bytes")
            and vf is not None
            and ve
            else ""
        )
        lines.append(f"{name:26s} {f:>10s} {e:>10s} {ratio:>12s}")
    lines.append(f"(memory: {fused.get('peak_memory_kind')})")
    return "\n".join(lines)
