"""The trainer's learning result on the embedded task (benchmark-style: run by hand, not in CI).

Runs `python -m ppo_kernels train` for PPO (fused ops, then eager ops from the same SFT model),
GRPO, reward-model training, PPO with that reward model (Critic initialised from it) and DPO, then
writes bench/results/trainer_learning.md with eval reward before/after on held-out prompts, time
per step and peak memory.

    python bench/train_learning.py [--out out/learning] [--only ppo,ppo_eager,...] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def runs(out, threads):
    # the RL rows at 40 steps, as bench/results/trainer_learning.md records them (the trainer's
    # default became 60 for the demo's margin); rm and dpo set their own below
    rl = ["--steps", "40"]
    sft = [
        "--sft-cache",
        os.path.join(out, "sft_cache"),
        "--threads",
        str(threads),
        "--no-progress",
    ]
    rm_path = os.path.join(out, "rm", "reward_model.pt")
    return {
        "ppo": ["--algo", "ppo", "--ops", "fused", *rl, *sft],
        "ppo_eager": ["--algo", "ppo", "--ops", "eager", *rl, *sft],
        "grpo": [
            "--algo",
            "grpo",
            "--ops",
            "fused",
            "--group-size",
            "8",
            "--prompts-per-step",
            "8",
            "--kl-estimator",
            "k3",
            "--kl-coef",
            "0.02",
            *rl,
            *sft,
        ],
        "rm": ["--algo", "rm", "--ops", "fused", "--steps", "150", *sft],
        "ppo_rm": [
            "--algo",
            "ppo",
            "--ops",
            "fused",
            "--reward",
            "rm",
            "--rm-path",
            rm_path,
            *rl,
            *sft,
        ],
        "dpo": ["--algo", "dpo", "--ops", "fused", "--steps", "64", *sft],
    }


DESCRIPTION = {
    "ppo": "PPO, verifier reward, fused ops",
    "ppo_eager": "PPO, verifier reward, eager ops",
    "grpo": "GRPO (8 responses per prompt, k3 KL loss), fused ops",
    "rm": "reward model (pairwise loss); eval = held-out pairwise accuracy",
    "ppo_rm": "PPO, reward = the trained RM, Critic initialised from the RM",
    "dpo": "offline DPO on the preference pairs",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "learning"))
    ap.add_argument("--only", default="ppo,ppo_eager,grpo,rm,ppo_rm,dpo")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="report every run, reusing the summaries of those not in --only",
    )
    ap.add_argument(
        "--results", default=os.path.join(ROOT, "bench", "results", "trainer_learning.md")
    )
    args = ap.parse_args()
    table = runs(args.out, args.threads)
    names = list(table) if args.reuse else args.only.split(",")
    summaries, walls = {}, {}
    for name in names:
        out = os.path.join(args.out, name)
        if name not in args.only.split(","):  # --reuse: a run from before, not repeated
            if os.path.exists(os.path.join(out, "summary.json")):
                with open(os.path.join(out, "summary.json")) as f:
                    summaries[name] = json.load(f)
                walls[name] = summaries[name]["total_seconds"]
            continue
        out = os.path.join(args.out, name)
        cmd = [sys.executable, "-m", "ppo_kernels", "train", *table[name], "--out", out]
        print("$", " ".join(cmd[1:]), flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        walls[name] = time.perf_counter() - t0
        if rc != 0:
            print(f"{name}: exit code {rc}", file=sys.stderr)
            continue
        with open(os.path.join(out, "summary.json")) as f:
            summaries[name] = json.load(f)
    write_results(args, names, table, summaries, walls)


def write_results(args, names, table, summaries, walls):
    lines = [
        "# Trainer learning result (embedded task)",
        "",
        'Task: add two decimal amounts given as strings exactly ("0.10"+"0.20" -> "0.30"); a '
        "calculator tool answers in binary floating point (0.30000000000000004) and the Actor "
        "must format it. Verifier reward 1 for the exact two-decimal answer, else 0. Tiny "
        "random-init Llama (2 layers, hidden 64, character tokenizer in a "
        f"{next(iter(summaries.values()), {}).get('config', {}).get('vocab', '?')}-token "
        "vocabulary, the trainer's default LM-head size) SFT-warmed on a mix of "
        "demonstrations (half answer without the tool, half call it; of those half copy the "
        "float verbatim, half format it).",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores "
        f"(shared with other jobs while this ran), torch threads {args.threads}, no GPU. "
        f"Eval: mean verifier reward of the sampled policy (temperature 1) on the same held-out "
        f"prompts before and after training.",
        "",
        "| run | eval before | eval after | gain | steps | s/step | PPO wall (s) "
        "| peak tensor memory of a step (MiB) | total wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        s = summaries.get(n)
        if s is None:
            lines.append(f"| {DESCRIPTION[n]} | failed | | | | | | | |")
            continue
        b, a = s["eval_reward_before"], s["eval_reward_after"]
        sps = s["seconds_per_step"] or 0.0
        lines.append(
            f"| {DESCRIPTION[n]} | {b:.3f} | {a:.3f} | {a - b:+.3f} | {s['steps']} | "
            f"{sps:.2f} | {sps * s['steps']:.0f} | {s['peak_memory_bytes'] / 2**20:.0f} | "
            f"{walls[n]:.0f} |"
        )
    lines += [
        "",
        "Held-out prompts: "
        + ", ".join(
            f"{n}: {summaries[n]['config']['eval_prompts']}"
            for n in names
            if n in summaries and n != "rm"
        )
        + (
            f"; RM held-out pairs: {summaries['rm']['config']['eval_pairs']}"
            if "rm" in summaries
            else ""
        )
        + ".",
        "",
    ]
    for n in names:
        s = summaries.get(n)
        if s and s.get("ops_eager_fallback") and s["ops"] == "fused":
            lines.append(
                f"- {n}: ops not fused in this build (ran eager): {s['ops_eager_fallback']}"
            )
        if s and "eval_tool_use_before" in s:
            lines.append(
                f"- {n}: fraction of eval responses calling the tool "
                f"{s['eval_tool_use_before']:.2f} -> {s['eval_tool_use_after']:.2f}"
            )
    sft = [s for s in summaries.values() if s.get("sft_seconds")]
    any_s = next(iter(summaries.values()), None)
    if any_s:
        c = any_s["config"]
        lines.append(
            f"- SFT warm-up: {c['sft_steps']} steps x {c['sft_batch']} demonstrations"
            + (
                f", {sft[0]['sft_seconds']:.0f} s (run once, cached for the others)"
                if sft
                else " (cached from an earlier run)"
            )
            + "; not counted in s/step or PPO wall."
        )
    if "ppo" in summaries and "ppo_eager" in summaries:
        f, e = summaries["ppo"], summaries["ppo_eager"]
        lines.append(
            f"- fused vs eager PPO from the same SFT model and seed: s/step "
            f"{f['seconds_per_step']:.2f} vs {e['seconds_per_step']:.2f}, eval after "
            f"{f['eval_reward_after']:.3f} vs {e['eval_reward_after']:.3f}; peak tensor memory "
            f"{f['peak_memory_bytes'] / 2**20:.0f} vs {e['peak_memory_bytes'] / 2**20:.0f} MiB "
            f"(vocabulary {f['config']['vocab']}, hidden {f['config']['hidden']}). The timings "
            f"are of a shared, loaded 2-core machine and vary run to run."
        )
    lines.append(
        "- RM pairs: chosen = tool call + formatted answer; rejected = the float copied "
        "verbatim, a direct answer off by a cent or a dime, the tool output formatted to a "
        "wrong value, or the chosen response cut off unfinished (without that last kind "
        "an earlier RM rewarded unfinished text and PPO learned to never stop)."
    )
    lines.append(
        "- The trained RM's scores are standardised (its head rescaled: mean 0, std 1 over both "
        "responses of the held-out pairs), so PPO's --kl-coef weighs against a reward of the "
        "verifier's scale; unscaled (about +-5) the KL barely held the policy, which drifted to "
        "responses the RM never saw (unused tokens, wrong tool calls) and scores high."
    )
    lines.append(
        "- DPO adds the chosen responses' per-token NLL to its loss (--dpo-nll-coef 1, RPO); "
        "plain DPO (--dpo-nll-coef 0) lowers the rejected responses' likelihood by moving "
        "probability onto tokens no pair holds, here the vocabulary's unused ids, and its "
        "samples fill with them."
    )
    lines += [
        "",
        "Commands (each also writes DIR/metrics.jsonl, DIR/metrics.csv, DIR/summary.json, DIR/curves.png):",
        "",
    ]
    rel = lambda x: x.replace(ROOT + os.sep, "")  # noqa: E731
    lines += [
        f"    python -m ppo_kernels train {rel(' '.join(table[n]))} --out {rel(args.out)}/{n}"
        for n in names
    ]
    lines.append("")
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
