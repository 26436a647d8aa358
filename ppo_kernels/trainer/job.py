"""One training job end to end: `run(cfg)` writes DIR/metrics.jsonl, DIR/metrics.csv,
DIR/summary.json and DIR/curves.png (and for PPO / GRPO the checkpoint) and returns the summary.

`run(cfg)` is: `_Run` (seeds, output files, resume state) -> the SFT-warmed Actor -> one of
`_train_rl` / `_train_dpo` / `_train_rm` / `_train_distill` (each steps through `_Run.step`, which times every step
and measures the tensor peak of one) -> `_Run.finish` (summary, CSV, plot).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import json
import os
import platform
import random
import sys
import time

import torch

from .. import _memory, batch_invariant
from . import checkpoint, dist
from .config import ConfigError, TrainConfig
from .ops import Ops
from .report import plot, read_rows, write_csv
from .task import DecimalAdditionTask


def _progress(cfg, total, desc):
    """A progress bar on a terminal; None otherwise (a log file gets the phases' lines instead of
    a carriage-return update per step)."""
    if not cfg.progress or not sys.stdout.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stdout, leave=True)


def prepare_actor(cfg: TrainConfig, task, ops: Ops, log, main=True, before_sft=None):
    """The SFT-warmed Actor (cached on disk: fused and eager runs start from the same one).
    `before_sft(actor, tok, task, sft_to_run)`: called once the Actor is built (the CLI's
    estimate)."""
    from .algos.sft import sft
    from .models import load_actor

    actor, tok = load_actor(cfg)
    actor.to(cfg.device)
    path = checkpoint.sft_cache_path(cfg, len(tok))
    if before_sft is not None:
        before_sft(actor, tok, task, cfg.sft_steps > 0 and not os.path.exists(path))
    if cfg.sft_steps == 0:
        return actor, tok, 0.0
    if os.path.exists(path):
        actor.load_state_dict(torch.load(path, map_location=cfg.device))
        log(f"SFT model loaded from {path}")
        return actor, tok, 0.0
    t0 = time.perf_counter()
    bar = _progress(cfg, cfg.sft_steps, "SFT warm-up")
    sft(
        cfg,
        actor,
        tok,
        task,
        ops,
        log=log if bar is None else (lambda *a: None),
        on_step=(lambda s, loss: (bar.set_postfix(loss=f"{loss:.3f}"), bar.update(1)))
        if bar is not None
        else None,
    )
    if bar is not None:
        bar.close()
    if main:  # data-parallel: every rank ran the same SFT; one writes it
        checkpoint.save_atomic(actor.state_dict(), path)
    return actor, tok, time.perf_counter() - t0


def _check_data_parallel(cfg: TrainConfig, w: int):
    """The global batch sizes split into equal shares (each rank's rows of a PPO minibatch may
    differ: the losses are weighted by tokens); every rank gets held-out rows to evaluate."""
    if cfg.algo in ("ppo", "grpo", "distill") and cfg.prompts_per_step % w:
        raise ConfigError(
            f"--prompts-per-step {cfg.prompts_per_step} must divide by the {w} data-parallel "
            "processes"
        )
    if cfg.micro_batch or cfg.batch_invariant:
        raise ConfigError(
            "--micro-batch / --batch-invariant: the update's gradient accumulation runs in one "
            "process only (not yet under torchrun)"
        )
    pairs = cfg.algo in ("dpo", "rm") or (cfg.reward == "rm" and not cfg.rm_path)
    if pairs and cfg.pref_batch % w:
        raise ConfigError(
            f"--pref-batch {cfg.pref_batch} must divide by the {w} data-parallel processes"
        )
    for name in ("eval_prompts", "eval_pairs"):
        if getattr(cfg, name) < w:
            raise ConfigError(
                f"--{name.replace('_', '-')} {getattr(cfg, name)}: fewer than the {w} "
                "data-parallel processes"
            )


def auto_threads() -> tuple[int, str]:
    """(torch threads, why) for --threads 0: torch's default (its physical cores, or
    OMP_NUM_THREADS / torchrun's choice when set) less the cores other processes keep busy (the
    1-minute load average, rounded), at least 1. An OpenMP region waits for its slowest thread:
    with more threads than idle cores every step waits on threads the OS has descheduled, and a
    busy 2-core machine ran the tiny model's steps many times slower with 2 threads than with 1."""
    default = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return default, "OMP_NUM_THREADS"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return default, "torch's default"
    n = max(1, min(default, round(cores - load)))
    return n, f"{cores} cores, load average {load:.1f}"


def keep_heap() -> bool:
    """glibc malloc: no mmap for large blocks and no trimming, so the tensors freed after a step
    are reused by the next instead of being unmapped and page-faulted in again: without it,
    system time (minor faults) was a large share of an eager PPO step, for a modest rise of the
    peak RSS (README, the trainer's timings). Both --ops alike. Returns whether it applied (not
    on other C libraries)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


class _Run:
    """One job's state outside the models: config, ops, task, metrics file, timings, resume."""

    def __init__(self, cfg: TrainConfig, log):
        self.group, device = dist.init(cfg.device)
        if self.group is not None:
            cfg = dataclasses.replace(cfg, device=device)
            _check_data_parallel(cfg, dist.world(self.group))
        # rank 0 alone logs and writes metrics, summary, plot and checkpoints
        self.main = dist.rank(self.group) == 0
        self.cfg, self.log = cfg, (log if self.main else lambda *a: None)
        self.t_start = time.perf_counter()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        else:
            n, why = auto_threads()
            torch.set_num_threads(n)
            self.log(f"torch threads: {n} ({why}; --threads N to choose)")
        if cfg.keep_heap and torch.device(cfg.device).type == "cpu":
            keep_heap()
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        os.makedirs(cfg.out, exist_ok=True)
        self.ops = Ops(cfg.ops)
        self.task = DecimalAdditionTask(cfg.p_tool, cfg.p_format)
        self.metrics_path = os.path.join(cfg.out, "metrics.jsonl")
        self.ckpt_path = os.path.join(cfg.out, checkpoint.CHECKPOINT)
        self.resume = checkpoint.load_checkpoint(cfg.resume, cfg.device) if cfg.resume else None
        if self.main and self.resume is None and os.path.exists(self.metrics_path):
            os.remove(self.metrics_path)
        self.step_times: list[float] = list(self.resume["step_times"]) if self.resume else []
        self.peak_bytes = self.resume.get("peak_memory_bytes") if self.resume else None
        self.profiled_seconds = None
        # CPU seconds of the process per step: with one torch thread, about the step's time on an
        # idle machine, whatever else runs here
        self.cpu_times: list[float] = list(self.resume.get("cpu_times", [])) if self.resume else []
        self.summary = {
            "algo": cfg.algo,
            "ops": cfg.ops,
            "device": cfg.device,
            "torch_threads": torch.get_num_threads(),
            "world_size": dist.world(self.group),
        }
        # the step whose tensor peak is measured: not the first (optimizer state is created then)
        self.measured_step = min(1, cfg.steps - 1)

    def save_checkpoint(self, step: int, trainer_state: dict):
        timings = {
            "step_times": self.step_times,
            "cpu_times": self.cpu_times,
            "peak_memory_bytes": self.peak_bytes,
        }
        checkpoint.save_checkpoint(
            self.ckpt_path, self.cfg, step, trainer_state, timings, self.summary
        )

    def record(self, step: int, metrics: dict, phase: str):
        # 6 digits, or every bit under --batch-invariant (runs meant to be compared bitwise)
        exact = self.cfg.batch_invariant
        row = {
            "step": step,
            "phase": phase,
            **{
                k: (round(v, 6) if isinstance(v, float) and not exact else v)
                for k, v in metrics.items()
            },
        }
        if not self.main:
            return row
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    @contextlib.contextmanager
    def step(self, step: int):
        """Times a step; measures the tensor peak of `measured_step` (profiled, so its time is
        left out of seconds_per_step unless it is the only step)."""
        measure = step == self.measured_step and self.peak_bytes is None
        peak = _memory.tensor_peak(self.cfg.device) if measure else contextlib.nullcontext()
        t0, c0 = time.perf_counter(), time.process_time()
        with peak as p:
            yield
        self.last_seconds = time.perf_counter() - t0
        if measure:
            self.peak_bytes, self.profiled_seconds = p.bytes, self.last_seconds
        else:
            self.step_times.append(self.last_seconds)
            self.cpu_times.append(time.process_time() - c0)

    def evaluate(self, actor, tok, problems, seed, when):
        from .algos.evaluate import evaluate

        r, tu = evaluate(self.cfg, actor, tok, self.task, problems, seed, group=self.group)
        self.summary.update({f"eval_reward_{when}": r, f"eval_tool_use_{when}": tu})
        self.log(
            f"eval {when}: reward {r:.3f} (tool use {tu:.2f}) on {len(problems)} held-out prompts"
        )

    def finish(self) -> dict:
        cfg = self.cfg
        kind = (
            "cuda_max_memory_allocated"
            if cfg.device.startswith("cuda")
            else "torch profiler allocation events"
        )
        self.summary.update(
            seconds_per_step=(sum(self.step_times) / len(self.step_times))
            if self.step_times
            else self.profiled_seconds,
            cpu_seconds_per_step=(sum(self.cpu_times) / len(self.cpu_times))
            if self.cpu_times
            else None,
            steps=cfg.steps,
            peak_memory_bytes=self.peak_bytes,
            peak_memory_kind=f"tensor peak of step {self.measured_step} above the models and "
            f"optimizer state ({kind})",
            total_seconds=round(time.perf_counter() - self.t_start, 2),
            ops_fused=sorted(self.ops.used),
            ops_eager_fallback=sorted(self.ops.fallbacks),
            config=dataclasses.asdict(cfg),
        )
        if not self.main:
            return self.summary
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=2)
        rows = read_rows(self.metrics_path) if os.path.exists(self.metrics_path) else []
        write_csv(rows, os.path.join(cfg.out, "metrics.csv"))
        if cfg.plot:
            try:
                plot({cfg.ops: rows}, {cfg.ops: self.summary}, os.path.join(cfg.out, "curves.png"))
            except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
                self.log(f"plot skipped: {e}")
        return self.summary


def _train_problems(cfg, task, held_out):
    def problems(step):
        rng = random.Random(cfg.seed * 1_000_033 + step)
        out = []
        while len(out) < cfg.prompts_per_step:
            p = task.sample_problem(rng)
            if (p.a, p.b) not in held_out:
                out.append(p)
        return out

    return problems


def _rl_models(r: _Run, actor, tok):
    """(critic, reward_model) for PPO / GRPO: a Critic from the Actor's backbone, or from the
    reward model (InstructGPT) when the reward is a trained RM."""
    from .algos.rm import train_reward_model
    from .models import ValueModel, frozen_copy

    cfg = r.cfg
    if cfg.algo == "grpo":
        return None, None
    if cfg.reward != "rm":
        return ValueModel.from_causal_lm(actor).to(cfg.device), None
    if cfg.rm_path:
        rm = checkpoint.load_value_model(cfg.rm_path, cfg.device)
    else:
        rm, a0, a1 = train_reward_model(
            cfg,
            actor,
            tok,
            r.task,
            r.ops,
            cfg.rm_steps,
            log=r.log,
            on_step=lambda s, m: r.record(s, m, "rm"),
            group=r.group,
        )
        r.summary.update(rm_pair_accuracy_before=a0, rm_pair_accuracy_after=a1)
        if r.main:
            checkpoint.save_value_model(rm, os.path.join(cfg.out, "reward_model.pt"))
    return copy.deepcopy(rm).train(), frozen_copy(rm)


def _train_rl(r: _Run, actor, tok, eval_problems, eval_seed):
    from .algos.ppo import RLTrainer
    from .models import frozen_copy

    cfg = r.cfg
    critic, reward_model = _rl_models(r, actor, tok)
    trainer = RLTrainer(
        cfg, actor, frozen_copy(actor), critic, tok, r.task, r.ops, reward_model, r.group
    )
    start = 0
    if r.resume is not None:
        trainer.load_state_dict(r.resume["trainer"])
        start = r.resume["step"]
        for k in checkpoint.CARRIED:
            r.summary[k] = r.resume[k]
    else:
        r.evaluate(trainer.policy, tok, eval_problems, eval_seed, "before")
    problems = _train_problems(cfg, r.task, {(p.a, p.b) for p in eval_problems})
    bar = _progress(cfg, cfg.steps, f"{cfg.algo} ({cfg.ops} ops)") if r.main else None
    if bar is not None:
        bar.update(start)
    for step in range(start, cfg.steps):
        with r.step(step):
            m = trainer.step(problems(step))
        r.record(step, {**m, "seconds": r.last_seconds}, cfg.algo)
        if bar is not None:
            bar.set_postfix(
                score=f"{m['score']:.3f}", kl=f"{m['kl']:.4f}", tool=f"{m['tool_call_frac']:.2f}"
            )
            bar.update(1)
        else:
            r.log(
                f"step {step:4d}  score {m['score']:.3f}  kl {m['kl']:.4f}  "
                f"pg {m['pg_loss']:+.4f}  {r.last_seconds:.2f}s"
            )
        if checkpoint.due(cfg, step):
            state = trainer.state_dict()  # FSDP2: gathers the shards (every rank calls it)
            if r.main:
                r.save_checkpoint(step + 1, state)
    if bar is not None:
        bar.close()
    r.evaluate(trainer.policy, tok, eval_problems, eval_seed, "after")


def _on_step(r: _Run, phase: str):
    return lambda s, m: r.record(s, {**m, "seconds": r.last_seconds}, phase)


def _train_dpo(r: _Run, actor, tok, eval_problems, eval_seed):
    from .algos.dpo import train_dpo

    r.evaluate(actor, tok, eval_problems, eval_seed, "before")
    policy = train_dpo(
        r.cfg,
        actor,
        tok,
        r.task,
        r.ops,
        on_step=_on_step(r, "dpo"),
        around_step=r.step,
        group=r.group,
    )
    r.evaluate(policy, tok, eval_problems, eval_seed, "after")


def _train_rm(r: _Run, actor, tok, eval_problems, eval_seed):
    from .algos.rm import train_reward_model

    rm, a0, a1 = train_reward_model(
        r.cfg,
        actor,
        tok,
        r.task,
        r.ops,
        r.cfg.steps,
        log=r.log,
        on_step=_on_step(r, "rm"),
        around_step=r.step,
        group=r.group,
    )
    if r.main:
        checkpoint.save_value_model(rm, os.path.join(r.cfg.out, "reward_model.pt"))
    # for the RM the "reward" being evaluated is its held-out pairwise accuracy
    r.summary.update(
        eval_metric="held-out pairwise accuracy",
        eval_reward_before=a0,
        eval_reward_after=a1,
        rm_pair_accuracy_before=a0,
        rm_pair_accuracy_after=a1,
    )


def _train_distill(r: _Run, actor, tok, eval_problems, eval_seed):
    from .algos.distill import DistillTrainer

    cfg = r.cfg
    teacher, teacher_vocab = checkpoint.load_teacher(cfg.teacher, cfg.device)
    if teacher_vocab != len(tok):
        raise ConfigError(
            f"--teacher: its tokenizer has {teacher_vocab} tokens, the student's {len(tok)} "
            "(distillation compares next-token distributions over one vocabulary)"
        )
    trainer = DistillTrainer(cfg, actor, teacher, tok, r.task, r.ops, r.group)
    r.evaluate(teacher, tok, eval_problems, eval_seed, "teacher")
    r.evaluate(trainer.policy, tok, eval_problems, eval_seed, "before")
    problems = _train_problems(cfg, r.task, {(p.a, p.b) for p in eval_problems})
    for step in range(cfg.steps):
        with r.step(step):
            m = trainer.step(problems(step))
        r.record(step, {**m, "seconds": r.last_seconds}, "distill")
        r.log(
            f"step {step:4d}  reverse KL {m['distill_kl']:.4f}  score {m['score']:.3f}  "
            f"{r.last_seconds:.2f}s"
        )
    r.evaluate(trainer.policy, tok, eval_problems, eval_seed, "after")


_TRAIN = {
    "ppo": _train_rl,
    "grpo": _train_rl,
    "dpo": _train_dpo,
    "rm": _train_rm,
    "distill": _train_distill,
}


def run(cfg: TrainConfig, log=print, before_sft=None) -> dict:
    """Run one job; returns (and writes) the summary. `before_sft`: see `prepare_actor` (rank 0
    alone calls it)."""
    r = _Run(cfg, log)
    cfg = r.cfg  # data-parallel on GPUs: this rank's device
    actor, tok, sft_seconds = prepare_actor(
        cfg, r.task, r.ops, r.log, r.main, before_sft if r.main else None
    )
    r.summary["sft_seconds"] = round(sft_seconds, 2)
    eval_problems = r.task.problems(cfg.eval_prompts, seed=1_000_003 + cfg.seed)
    # the training phase only: the SFT warm-up (and its cache) is the same with or without it
    with batch_invariant(cfg.batch_invariant):
        _TRAIN[cfg.algo](r, actor, tok, eval_problems, cfg.seed + 7)
    summary = r.finish()
    group = r.group
    del r, actor, tok  # the models (DDP / FSDP wrappers hold the group) before the group
    dist.close(group)
    return summary
