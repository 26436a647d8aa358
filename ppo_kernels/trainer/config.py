"""The trainer's configuration: one dataclass, its command-line flags, and its validation."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A bad configuration, with a message naming the flag."""


def _f(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # -- run ----------------------------------------------------------------------------------
    algo: str = _f(
        "ppo",
        "ppo | grpo | dpo | rm | distill (on-policy distillation from --teacher)",
        choices=("ppo", "grpo", "dpo", "rm", "distill"),
    )
    ops: str = _f(
        "fused",
        "fused: ppo_kernels ops; eager: plain PyTorch references",
        choices=("fused", "eager"),
    )
    out: str = _f("out/train", "output directory (metrics.jsonl, summary.json, plot, checkpoints)")
    device: str = _f("cpu", "cpu | cuda | cuda:N")
    seed: int = _f(0, "random seed (same seed: same run)")
    threads: int = _f(
        0,
        "torch CPU threads (0: torch's default less the cores the load average says are busy, "
        "at least 1)",
    )
    keep_heap: bool = _f(
        True,
        "on the CPU (glibc): malloc keeps freed memory for reuse (no mmap per large tensor, no "
        "trimming) instead of returning it to the OS and faulting it in again every step",
    )
    # 100: the default PPO demo's fused run is meant to gain at least +0.3 eval reward (README
    # "Measured: ... --compare"); fewer steps fell short of it on some runs (the runs differ like
    # seeds once their last bits part): bench/results/demo_2026-12-04b.md
    steps: int = _f(
        100, "RL steps (ppo/grpo), distillation steps (distill) or optimiser steps (dpo/rm)"
    )
    dist: str = _f(
        "ddp",
        "data parallelism under torchrun: ddp (whole models, DistributedDataParallel) or fsdp2 "
        "(fully_shard per decoder layer: parameters, gradients, optimiser state sharded); "
        "one process: ignored",
        choices=("ddp", "fsdp2"),
    )
    progress: bool = _f(
        True, "progress bars on a terminal (output to a file: a line per phase or step instead)"
    )
    plot: bool = _f(True, "write DIR/curves.png")
    # -- model --------------------------------------------------------------------------------
    model: Optional[str] = _f(None, "local transformers causal LM (dir) instead of the tiny one")
    arch: str = _f("llama", "tiny model architecture", choices=("llama", "qwen2"))
    vocab: int = _f(
        32000,
        "tiny model vocabulary: the task's 22 character tokens, the rest "
        "tokens it never needs (a real LM's head size)",
    )
    hidden: int = _f(64, "tiny model hidden size")
    layers: int = _f(2, "tiny model layers")
    heads: int = _f(4, "tiny model attention heads")
    # -- SFT warm-up (embedded task) ---------------------------------------------------------
    sft_steps: int = _f(800, "SFT steps on generated demonstrations (0: none)")
    sft_batch: int = _f(32, "SFT batch size")
    sft_lr: float = _f(3e-3, "SFT learning rate")
    sft_cache: Optional[str] = _f(None, "dir to cache / reuse the SFT model (keyed by config)")
    p_tool: float = _f(0.5, "fraction of demonstrations that call the calculator")
    p_format: float = _f(0.5, "fraction of tool demonstrations that format its output (A)")
    # -- rollouts -----------------------------------------------------------------------------
    prompts_per_step: int = _f(64, "prompts per RL step")
    group_size: int = _f(1, "responses per prompt (GRPO needs >= 2)")
    group_advantage: str = _f(
        "grpo",
        "critic-free advantage: grpo (mean/std of the group) or rloo (leave-one-out mean)",
        choices=("grpo", "rloo"),
    )
    max_new_tokens: int = _f(40, "response budget incl. tool output; beyond it: truncated")
    temperature: float = _f(1.0, "sampling temperature (log-probs use the same)")
    # -- PPO ----------------------------------------------------------------------------------
    ppo_epochs: int = _f(2, "passes over each rollout batch")
    minibatch_size: int = _f(32, "sequences per optimiser step")
    logprob_micro_batch: int = _f(
        0,
        "sequences per forward pass when a rollout batch is scored (old and Reference log-probs, "
        "values); 0: the whole batch in one pass",
    )
    micro_batch: int = _f(
        0,
        "sequences per forward / backward pass of the update, the gradient accumulated over the "
        "minibatch; 0: the whole minibatch in one pass",
    )
    batch_invariant: bool = _f(
        False,
        "RL phase under ppo_kernels.batch_invariant(): a token's log-prob is bitwise the same "
        "in any batch, so the first update sees a ratio of exactly 1; the update accumulates "
        "its gradient in passes of a fixed 32 sequences (not --micro-batch), so the run does not "
        "depend on the micro-batch sizes (with --ops fused; one process)",
    )
    actor_lr: float = _f(5e-4, "Actor AdamW learning rate (distill: the student's)")
    critic_lr: float = _f(3e-3, "Critic AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    clip_low: float = _f(0.2, "policy ratio clip below 1")
    clip_high: float = _f(0.2, "policy ratio clip above 1")
    dual_clip: Optional[float] = _f(None, "dual clip constant c > 1 (None: off)")
    value_clip: float = _f(0.2, "value clip around the old values")
    vf_coef: float = _f(0.5, "value loss weight (Critic has its own optimiser; scales its loss)")
    ent_coef: float = _f(0.0, "entropy bonus weight")
    max_grad_norm: float = _f(1.0, "gradient clipping (per model)")
    gamma: float = _f(1.0, "discount")
    lam: float = _f(0.95, "GAE lambda")
    whiten_advantages: bool = _f(True, "masked whitening of advantages (PPO)")
    kl_coef: float = _f(0.05, "beta: KL penalty in the reward (PPO) or loss (GRPO)")
    kl_estimator: str = _f("k1", "k1 | abs | k2 | k3", choices=("k1", "abs", "k2", "k3"))
    adaptive_kl: bool = _f(False, "adaptive KL controller (Ziegler et al.)")
    kl_target: float = _f(0.1, "adaptive KL target (per-sequence mean KL)")
    kl_horizon: int = _f(2000, "adaptive KL horizon (sequences)")
    reward: str = _f(
        "verifier",
        "verifier | rm (a trained reward model scores; Critic from RM)",
        choices=("verifier", "rm"),
    )
    rm_path: Optional[str] = _f(None, "reward model dir (from --algo rm); default: train one")
    rm_steps: int = _f(150, "steps of the reward model trained inline for --reward rm")
    # -- DPO / RM -----------------------------------------------------------------------------
    dpo_beta: float = _f(0.1, "DPO beta")
    dpo_nll_coef: float = _f(
        1.0,
        "DPO: weight of the chosen responses' per-token NLL added to the loss (RPO, Pang et al. "
        "2024; 0: plain DPO, whose push-down of rejected tokens leaks probability to tokens no "
        "pair holds, here the unused vocabulary)",
    )
    pairs: int = _f(2048, "preference pairs for dpo / rm training")
    eval_pairs: int = _f(256, "held-out preference pairs (rm accuracy)")
    pref_batch: int = _f(32, "pairs per optimiser step (dpo / rm)")
    pref_lr: float = _f(1e-3, "reward-model learning rate")
    dpo_lr: float = _f(3e-4, "DPO learning rate (higher drifts the policy off the pairs)")
    # -- on-policy distillation ---------------------------------------------------------------
    teacher: Optional[str] = _f(
        None,
        "--algo distill: the teacher, a run directory holding checkpoint.pt (e.g. the --out of "
        "a --algo ppo run) or that file; the student (the SFT Actor) samples --prompts-per-step "
        "responses per step and takes one --actor-lr step on the token mean of the "
        "full-vocabulary reverse KL to the teacher at each sampled prefix",
    )
    # -- eval / checkpoints -------------------------------------------------------------------
    eval_prompts: int = _f(200, "held-out prompts for eval_reward_before / after")
    checkpoint: bool = _f(
        True,
        "write DIR/checkpoint.pt, what --resume needs (PPO / GRPO: models and optimiser states, "
        "~92 MB for the default model; one file, overwritten)",
    )
    save_every: int = _f(0, "checkpoint every N steps (0: only at the end)")
    resume: Optional[str] = _f(
        None, "run directory (or its checkpoint.pt) to resume from; --steps is the new total"
    )

    # ------------------------------------------------------------------------------------------
    def validate(self) -> "TrainConfig":
        def bad(flag, msg):
            raise ConfigError(f"--{flag.replace('_', '-')}: {msg}")

        for f in dataclasses.fields(self):
            ch = f.metadata.get("choices")
            if ch and getattr(self, f.name) not in ch:
                bad(f.name, f"expected one of {list(ch)}, got {getattr(self, f.name)!r}")
        for name in (
            "steps",
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "ppo_epochs",
            "minibatch_size",
            "sft_batch",
            "pairs",
            "pref_batch",
            "eval_prompts",
            "hidden",
            "layers",
            "heads",
            "vocab",
        ):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "temperature",
            "actor_lr",
            "critic_lr",
            "sft_lr",
            "pref_lr",
            "dpo_lr",
            "max_grad_norm",
            "dpo_beta",
            "kl_target",
        ):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("logprob_micro_batch", "micro_batch"):
            if getattr(self, name) < 0:
                bad(name, f"must be >= 0 (0: one pass), got {getattr(self, name)}")
        if self.threads < 0:
            bad("threads", f"must be >= 0 (0: chosen from the idle cores), got {self.threads}")
        for name in ("gamma", "lam", "p_tool", "p_format"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(name, f"must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            bad(
                "clip_low",
                f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}",
            )
        if self.dual_clip is not None and not self.dual_clip > 1:
            bad("dual_clip", f"the dual clip constant must be > 1, got {self.dual_clip}")
        if self.kl_coef < 0 or self.ent_coef < 0 or self.value_clip <= 0:
            bad("kl_coef", "kl_coef and ent_coef must be >= 0 and value_clip > 0")
        if self.hidden % self.heads:
            bad("hidden", f"{self.hidden} is not divisible by --heads {self.heads}")
        if self.algo == "grpo" and self.group_size < 2:
            bad(
                "group_size",
                "GRPO compares responses within a group: it needs --group-size >= 2 "
                f"(got {self.group_size}; with 1 every advantage is 0)",
            )
        if self.algo in ("ppo", "grpo"):
            n = self.prompts_per_step * self.group_size
            if n % self.minibatch_size:
                bad(
                    "minibatch_size",
                    f"the rollout batch of {n} sequences (--prompts-per-step "
                    f"{self.prompts_per_step} x --group-size {self.group_size}) "
                    f"is not divisible into minibatches of {self.minibatch_size}",
                )
        if self.algo in ("dpo", "rm") and self.pairs % self.pref_batch:
            bad(
                "pref_batch",
                f"--pairs {self.pairs} is not divisible by --pref-batch {self.pref_batch}",
            )
        if self.algo == "distill":
            if self.teacher is None:
                bad(
                    "teacher",
                    "--algo distill needs a teacher: the directory of a run that saved a "
                    "checkpoint (e.g. --algo ppo --out DIR), or its checkpoint.pt",
                )
            if not os.path.exists(self.teacher):
                bad("teacher", f"{self.teacher!r} does not exist")
            if self.resume is not None:
                bad("resume", "--algo distill saves no checkpoint to resume from")
        elif self.teacher is not None:
            bad("teacher", f"only --algo distill takes a teacher (got --algo {self.algo})")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                bad("device", f"{self.device!r} requested but torch sees no CUDA GPU")
        elif self.device != "cpu":
            bad("device", f"expected cpu or cuda[:N], got {self.device!r}")
        return self


EXAMPLES = """examples:
  python -m ppo_kernels train --out runs/ppo --compare     # PPO, then eager ops, side by side
  python -m ppo_kernels train --algo grpo --group-size 8 --prompts-per-step 8 --out runs/grpo
  python -m ppo_kernels train --resume runs/ppo --steps 150 --out runs/ppo   # continue a run
  python -m ppo_kernels train --algo distill --teacher runs/ppo --sft-cache runs/ppo/sft_cache --out runs/distill"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ppo_kernels train",
        description="The thin PPO / GRPO / DPO / reward-model / distillation trainer on transformers models, "
        "every per-token computation through ppo_kernels ops (--ops eager: the "
        "eager code trainers run today, materialised logits included). Default: the "
        "embedded decimal-addition-with-calculator task on a tiny random-init Llama "
        "with a 32000-token LM head, SFT-warmed, on the CPU.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kw = {"default": f.default, "help": f.metadata["help"] + f" (default: {f.default})"}
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        typ = {"int": int, "float": float, "str": str}
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        t = t.replace("Optional[", "").rstrip("]")
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        p.add_argument(flag, type=typ.get(t, str), **kw)
    p.add_argument(
        "--compare",
        action="store_true",
        help="after the run, repeat it with the other --ops in a subprocess and print "
        "the fused-vs-eager comparison (time per step, peak memory, reward)",
    )
    return p


def config_from_args(argv) -> tuple[TrainConfig, argparse.Namespace]:
    args = build_parser().parse_args(argv)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    return cfg.validate(), args
