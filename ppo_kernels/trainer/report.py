"""What a run reports: the metrics files (JSONL rows, CSV), the curves plot, and with --compare
the side-by-side table and the closing notes that say what it shows."""

from __future__ import annotations

import json
import textwrap


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
    ("distill_kl", "reverse KL to the teacher (per token)"),
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
        ("eval tool use before", "eval_tool_use_before", 1, ".2f"),
        ("eval tool use after", "eval_tool_use_after", 1, ".2f"),
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


# what the sampled responses of a step decide alone (the same responses give the same values)
ROLLOUT_STATS = ("score", "response_tokens", "tool_call_frac", "truncated_frac")


def first_divergence(rows_a: list, rows_b: list):
    """The first step whose rollout statistics differ between two runs' metrics rows (None: they
    agree on every step both have)."""
    for ra, rb in zip(rows_a, rows_b):
        if any(ra.get(k) != rb.get(k) for k in ROLLOUT_STATS):
            return ra["step"]
    return None


def _ratio(f: dict, e: dict, key: str):
    vf, ve = f.get(key), e.get(key)
    return vf / ve if vf is not None and ve else None


def closing_notes(a: dict, b: dict, rows_a: list, rows_b: list) -> str:
    """A few plain sentences after the --compare table (PPO / GRPO; "" for the others): what was
    compared, what reward and tool use mean for the embedded task, what the ratios say, and why
    the two runs' rewards part after the first steps. `a`, `b`: the summaries, `rows_*` their
    metrics rows."""
    (fused, rows_f), (eager, rows_e) = sorted(
        [(a, rows_a), (b, rows_b)], key=lambda x: x[0]["ops"] != "fused"
    )
    cfg = fused["config"]
    if cfg["algo"] not in ("ppo", "grpo"):
        return ""
    steps, prompts = cfg["steps"], cfg["prompts_per_step"] * cfg["group_size"]
    rest = (
        "the actor loss (clipped policy term) in the same pass; fused KL-penalised rewards, GAE, "
        "whitening and value loss"
        if cfg["algo"] == "ppo"
        else "the actor loss (clipped policy term and KL to the Reference) in the same pass; "
        "fused group advantages"
    )
    paras = [
        f"What was compared: the same {steps} {cfg['algo'].upper()} steps ({prompts} responses "
        "each) run twice from one SFT model, seed and prompt stream -- once with the ppo_kernels "
        "ops (log-probs and entropy straight from the hidden states and the LM-head weight, the "
        f"[tokens x vocabulary] logits never built; {rest}), once with the eager PyTorch code "
        "trainers run today (logits materialised, then log_softmax and gather, the losses "
        "composed from them; verl's loops).",
    ]

    def evals(s):
        return (
            f"reward {s['eval_reward_before']:.3f} -> {s['eval_reward_after']:.3f}, tool use "
            f"{s['eval_tool_use_before']:.2f} -> {s['eval_tool_use_after']:.2f}"
        )

    trained_on = (
        " (training rewards came from the reward model; the evaluation is the verifier's)"
        if cfg["reward"] == "rm"
        else ""
    )
    paras.append(
        f"Reward is the verifier's mean score on {cfg['eval_prompts']} held-out sums: 1 when "
        "the answer after the last tool output is the exact sum printed with two decimals "
        '("0.10"+"0.20" -> 0.30), else 0. Tool use is the fraction of responses that call the '
        "calculator, which answers in binary floating point (0.30000000000000004): the model "
        f"earns the reward by calling it and rounding its output to cents{trained_on}. "
        f"Fused: {evals(fused)}; eager: {evals(eager)} (one SFT model: the same before)."
    )
    t, c = _ratio(fused, eager, "seconds_per_step"), _ratio(fused, eager, "cpu_seconds_per_step")
    m = _ratio(fused, eager, "peak_memory_bytes")
    said = []
    if t is not None:
        cpu = (
            f"; CPU time {c:.2f}x, the steadier figure on a shared machine with one torch thread"
            if c is not None
            else ""
        )
        said.append(
            f"Time per step: {t:.2f}x ({fused['seconds_per_step']:.2f} s vs "
            f"{eager['seconds_per_step']:.2f} s{cpu}); each step also samples its responses "
            "token by token with the same code in both modes, so the step's ratio is closer to 1 "
            "than the ops' own (bench/)."
        )
    if m is not None:
        said.append(
            f"Peak tensor memory: {m:.2f}x; the eager step holds the float32 logits of its tokens "
            "over the whole vocabulary, the fused ops one tile of them at a time."
        )
    if said:
        paras.append(
            " ".join(["The ratios are fused / eager, below 1x in favour of the fused ops.", *said])
        )
    k = first_divergence(rows_f, rows_e)
    here = (
        f"Here the rollouts' statistics (score, length, tool use) were identical for every one "
        f"of the {min(len(rows_f), len(rows_e))} steps."
        if k is None
        else f"Here they were identical for steps 0-{k - 1} and first differed at step {k}."
        if k > 0
        else "Here they differed from step 0 (which should not happen: the first rollout is "
        "sampled before any update)."
    )
    paras.append(
        "Why the rewards part after the first steps: both runs sample with the same code and "
        "the same random numbers, and every per-token value agrees to float32 rounding (~1e-7: "
        "the fused kernels sum in another order; tests/trainer/test_e2e.py holds two full steps "
        "of both to rtol 1e-4). Through the optimiser steps those last-bit differences move the "
        "parameters apart until one changes a sampled token (one uniform per row against the "
        "token CDF); from there the rollouts differ and the two runs go on like two seeds of "
        f"one run, so their reward curves and final rewards differ by chance, not by error. {here}"
    )
    return "\n\n".join(textwrap.fill(p, 100) for p in paras)
