"""`python -m ppo_kernels train ...`: run one training job end to end, write DIR/metrics.jsonl,
DIR/summary.json and DIR/curves.png, and (with --compare) repeat it with the other --ops."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import time

import torch

from .config import ConfigError, TrainConfig, config_from_args
from .ops import Ops
from .task import DecimalAdditionTask


class MetricsWriter:
    def __init__(self, out):
        self.path = os.path.join(out, "metrics.jsonl")
        self.rows = []

    def write(self, row: dict, append=True):
        self.rows.append(row)
        with open(self.path, "a" if append else "w") as f:
            f.write(json.dumps(row) + "\n")


def peak_memory(device: str) -> tuple[int, str]:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(), "cuda_max_memory_allocated"
    # Linux reports kilobytes; the whole process's peak resident set (models, data, Python)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


def _sft_key(cfg: TrainConfig, vocab_size: int) -> str:
    keys = ("model", "arch", "hidden", "layers", "heads", "sft_steps", "sft_batch", "sft_lr",
            "p_tool", "p_format", "seed")
    blob = json.dumps({"vocab": vocab_size, **{k: getattr(cfg, k) for k in keys}},
                      sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def prepare_actor(cfg: TrainConfig, task, ops: Ops, log):
    """The SFT-warmed Actor (cached on disk: fused and eager runs start from the same one)."""
    from . import algos
    from .models import load_actor
    actor, tok = load_actor(cfg)
    actor.to(cfg.device)
    if cfg.sft_steps == 0:
        return actor, tok, 0.0
    cache_dir = cfg.sft_cache or os.path.join(cfg.out, "sft_cache")
    path = os.path.join(cache_dir, f"sft_{_sft_key(cfg, len(tok))}.pt")
    if os.path.exists(path):
        actor.load_state_dict(torch.load(path, map_location=cfg.device))
        log(f"SFT model loaded from {path}")
        return actor, tok, 0.0
    t0 = time.perf_counter()
    algos.sft(cfg, actor, tok, task, ops, log=log)
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(actor.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    return actor, tok, time.perf_counter() - t0


def save_value_model(vm, path):
    torch.save({"config": vm.body.config.to_dict(), "state_dict": vm.state_dict()}, path)


def load_value_model(path, device):
    from transformers import AutoConfig, AutoModel

    from .models import ValueModel
    blob = torch.load(path, map_location=device)
    conf = dict(blob["config"])
    conf_obj = AutoConfig.for_model(conf.pop("model_type"), **conf)
    vm = ValueModel(AutoModel.from_config(conf_obj), conf_obj.hidden_size)
    vm.load_state_dict(blob["state_dict"])
    return vm.to(device).eval()


def _progress(cfg, total, desc):
    if not cfg.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stdout)


def run(cfg: TrainConfig, log=print) -> dict:
    """Run one job; returns (and writes) the summary."""
    from . import algos
    from .models import ValueModel, frozen_copy

    t_start = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    ops = Ops(cfg.ops)
    task = DecimalAdditionTask(cfg.p_tool, cfg.p_format)
    writer = MetricsWriter(cfg.out)
    ckpt_path = os.path.join(cfg.out, "checkpoint.pt")
    resume = torch.load(cfg.resume, map_location=cfg.device, weights_only=False) \
        if cfg.resume else None
    if resume is None and os.path.exists(writer.path):
        os.remove(writer.path)

    actor, tok, sft_seconds = prepare_actor(cfg, task, ops, log)
    eval_problems = task.problems(cfg.eval_prompts, seed=1_000_003 + cfg.seed)
    held_out = {(p.a, p.b) for p in eval_problems}
    eval_seed = cfg.seed + 7

    def train_problems(step):
        rng = random.Random(cfg.seed * 1_000_033 + step)
        out = []
        while len(out) < cfg.prompts_per_step:
            p = task.sample_problem(rng)
            if (p.a, p.b) not in held_out:
                out.append(p)
        return out

    summary = {"algo": cfg.algo, "ops": cfg.ops, "device": cfg.device,
               "torch_threads": torch.get_num_threads(), "sft_seconds": round(sft_seconds, 2)}
    step_times = []

    def rec(step, metrics, phase):
        row = {"step": step, "phase": phase, **{k: (round(v, 6) if isinstance(v, float) else v)
                                                 for k, v in metrics.items()}}
        writer.write(row)
        return row

    if cfg.algo in ("ppo", "grpo"):
        reward_model = critic = None
        if cfg.algo == "ppo":
            if cfg.reward == "rm":
                if cfg.rm_path:
                    rm = load_value_model(cfg.rm_path, cfg.device)
                else:
                    rm, a0, a1 = algos.train_reward_model(
                        cfg, actor, tok, task, ops, cfg.rm_steps, log=log,
                        on_step=lambda s, m: rec(s, m, "rm"))
                    summary.update(rm_pair_accuracy_before=a0, rm_pair_accuracy_after=a1)
                    save_value_model(rm, os.path.join(cfg.out, "reward_model.pt"))
                import copy
                critic = copy.deepcopy(rm).train()  # InstructGPT: the Critic starts as the RM
                reward_model = frozen_copy(rm)
            else:
                critic = ValueModel.from_causal_lm(actor).to(cfg.device)
        ref = frozen_copy(actor)
        trainer = algos.RLTrainer(cfg, actor, ref, critic, tok, task, ops, reward_model)
        start = 0
        if resume is not None:
            trainer.load_state_dict(resume["trainer"])
            start = resume["step"]
            summary["eval_reward_before"] = resume["eval_reward_before"]
            summary["eval_tool_use_before"] = resume["eval_tool_use_before"]
            step_times = list(resume["step_times"])
            writer.rows = []
        else:
            r, tu = algos.evaluate(cfg, actor, tok, task, eval_problems, eval_seed)
            summary.update(eval_reward_before=r, eval_tool_use_before=tu)
            log(f"eval before: reward {r:.3f} (tool use {tu:.2f}) on {len(eval_problems)} "
                f"held-out prompts")
        bar = _progress(cfg, cfg.steps, f"{cfg.algo} ({cfg.ops})")
        if bar is not None:
            bar.update(start)
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            m = trainer.step(train_problems(step))
            dt = time.perf_counter() - t0
            step_times.append(dt)
            rec(step, {**m, "seconds": dt}, cfg.algo)
            if bar is not None:
                bar.set_postfix(score=f"{m['score']:.3f}", kl=f"{m['kl']:.4f}",
                                tool=f"{m['tool_call_frac']:.2f}")
                bar.update(1)
            else:
                log(f"step {step:4d}  score {m['score']:.3f}  kl {m['kl']:.4f}  "
                    f"pg {m['pg_loss']:+.4f}  {dt:.2f}s")
            last = step + 1 == cfg.steps
            if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
                torch.save({"cfg": dataclasses.asdict(cfg), "step": step + 1,
                            "trainer": trainer.state_dict(),
                            "eval_reward_before": summary["eval_reward_before"],
                            "eval_tool_use_before": summary["eval_tool_use_before"],
                            "step_times": step_times}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
        if bar is not None:
            bar.close()
        r, tu = algos.evaluate(cfg, actor, tok, task, eval_problems, eval_seed)
        summary.update(eval_reward_after=r, eval_tool_use_after=tu)
        log(f"eval after:  reward {r:.3f} (tool use {tu:.2f})")
    elif cfg.algo == "dpo":
        r, tu = algos.evaluate(cfg, actor, tok, task, eval_problems, eval_seed)
        summary.update(eval_reward_before=r, eval_tool_use_before=tu)
        log(f"eval before: reward {r:.3f} (tool use {tu:.2f})")
        last_t = [time.perf_counter()]

        def on_step(s, m):
            now = time.perf_counter()
            step_times.append(now - last_t[0])
            last_t[0] = now
            rec(s, {**m, "seconds": step_times[-1]}, "dpo")
        algos.train_dpo(cfg, actor, tok, task, ops, on_step=on_step)
        r, tu = algos.evaluate(cfg, actor, tok, task, eval_problems, eval_seed)
        summary.update(eval_reward_after=r, eval_tool_use_after=tu)
        log(f"eval after:  reward {r:.3f} (tool use {tu:.2f})")
    else:  # rm
        last_t = [time.perf_counter()]

        def on_step(s, m):
            now = time.perf_counter()
            step_times.append(now - last_t[0])
            last_t[0] = now
            rec(s, {**m, "seconds": step_times[-1]}, "rm")
        rm, a0, a1 = algos.train_reward_model(cfg, actor, tok, task, ops, cfg.steps, log=log,
                                              on_step=on_step)
        save_value_model(rm, os.path.join(cfg.out, "reward_model.pt"))
        # for the RM the "reward" being evaluated is its held-out pairwise accuracy
        summary.update(eval_metric="held-out pairwise accuracy", eval_reward_before=a0,
                       eval_reward_after=a1, rm_pair_accuracy_before=a0,
                       rm_pair_accuracy_after=a1)

    mem, kind = peak_memory(cfg.device)
    summary.update(
        seconds_per_step=(sum(step_times) / len(step_times)) if step_times else None,
        steps=cfg.steps, peak_memory_bytes=mem, peak_memory_kind=kind,
        total_seconds=round(time.perf_counter() - t_start, 2),
        ops_fused=sorted(ops.used), ops_eager_fallback=sorted(ops.fallbacks),
        config=dataclasses.asdict(cfg))
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    write_csv(_read_rows(writer.path) if os.path.exists(writer.path) else [],
              os.path.join(cfg.out, "metrics.csv"))
    if cfg.plot:
        try:
            plot(writer.rows if resume is None else _read_rows(writer.path), summary,
                 os.path.join(cfg.out, "curves.png"))
        except Exception as e:  # a plot must never fail a finished run
            log(f"plot skipped: {e}")
    return summary


def write_csv(rows, path):
    import csv
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(rows, summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [("score", "reward (train rollouts)"), ("kl", "KL to Reference (per sequence)")] \
        if any("score" in r for r in rows) else \
        [(k, k) for k in ("dpo_loss", "reward_accuracy", "rm_loss", "train_pair_accuracy")
         if any(k in r for r in rows)][:2]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, (k, title) in zip(axes[0], keys):
        pts = [(r["step"], r[k]) for r in rows if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts])
        ax.set_title(title)
        ax.set_xlabel("step")
        if k == "score" and summary.get("eval_reward_after") is not None:
            ax.axhline(summary["eval_reward_before"], ls="--", c="gray", label="eval before")
            ax.axhline(summary["eval_reward_after"], ls="--", c="green", label="eval after")
            ax.legend(loc="lower right")
    fig.suptitle(f"{summary['algo']} ({summary['ops']} ops)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def compare_table(a: dict, b: dict) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)
    lines = [f"{'':24s} {a['ops']:>12s} {b['ops']:>12s}"]
    for key, spec, scale in (("seconds_per_step", ".3f", 1), ("peak_memory_bytes", ".1f", 2**-20),
                             ("eval_reward_before", ".3f", 1), ("eval_reward_after", ".3f", 1)):
        name = key if key != "peak_memory_bytes" else "peak_memory_MiB"
        va, vb = a.get(key), b.get(key)
        lines.append(f"{name:24s} {fmt(va * scale if va is not None else None, spec):>12s} "
                     f"{fmt(vb * scale if vb is not None else None, spec):>12s}")
    if a.get("peak_memory_kind") == "process_peak_rss":
        lines.append("(CPU memory: each run's process peak RSS, models and Python included)")
    return "\n".join(lines)


def _without(argv, flag_names):
    out, skip = [], False
    for i, x in enumerate(argv):
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, args = config_from_args(argv)
    except ConfigError as e:
        print(f"python -m ppo_kernels train: error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run(cfg)
    except ConfigError as e:
        print(f"python -m ppo_kernels train: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("eval_reward_before", "eval_reward_after",
                                              "seconds_per_step", "peak_memory_bytes")}))
    if summary["ops_eager_fallback"] and cfg.ops == "fused":
        print(f"note: not yet fused in this build, ran eager: {summary['ops_eager_fallback']}")
    if args.compare:
        other = "eager" if cfg.ops == "fused" else "fused"
        other_out = os.path.join(cfg.out, f"compare_{other}")
        cmd = [sys.executable, "-m", "ppo_kernels", "train",
               *_without(argv, {"--ops", "--out", "--compare", "--sft-cache"}),
               "--ops", other, "--out", other_out,
               "--sft-cache", cfg.sft_cache or os.path.join(cfg.out, "sft_cache")]
        print(f"\n--compare: the same run with --ops {other} ({other_out})")
        rc = subprocess.call(cmd)
        if rc != 0:
            return rc
        with open(os.path.join(other_out, "summary.json")) as f:
            other_summary = json.load(f)
        print("\n" + compare_table(summary, other_summary))
    return 0
