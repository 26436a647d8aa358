"""The phase times `python -m ppo_kernels train` prints before a PPO / GRPO run on the CPU.

Derived from this machine as it is now: a probe times a few SFT steps (on a copy of the Actor,
under its own random state: the run itself is unchanged), and each phase is that time scaled by
its ratio to an SFT step measured on the reference machine (REF), given as a range because the
ratio moves with the machine and the load moves with the clock. Only meaningful near the
default sizes: the ratios were measured there.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch

from .config import TrainConfig
from .first_run import load_note

# Seconds of the default job's phases on one reference machine, one torch thread (only their
# ratios to the SFT step are used): a mean SFT step with either ops, a mean PPO step with either
# ops (64 responses: sampling, scoring, 2 epochs x 2 minibatches) and one held-out evaluation
# (200 prompts). From a `--compare` run of the defaults (the README's "--compare" table); the
# eager SFT step and the evaluation (more for the longer responses of a warmed-up model) timed
# on the same machine.
REF = {
    "sft_step": {"fused": 0.18, "eager": 0.26},
    "rl_step": {"fused": 1.94, "eager": 4.26},
    "eval": 8.0,
}
REF_RESPONSES, REF_EVAL_PROMPTS = 64, 200
# the range around probe x ratio: the probe's median step lands near the mean of a long SFT run,
# the ratios carry the spread of runs at other loads; the upper end leaves room for the load to
# rise during a run of several minutes
SPREAD = (0.8, 1.5)
PROBE_STEPS = 3


def probe_sft_step(cfg: TrainConfig, actor, tok, task, ops_mode: str) -> float:
    """Median wall seconds of one SFT step of `cfg` here and now: PROBE_STEPS steps after an
    untimed first one, on a copy of `actor`."""
    from .algos.sft import sft
    from .ops import Ops

    stamps = []
    probe_cfg = dataclasses.replace(cfg, sft_steps=PROBE_STEPS + 1)
    with torch.random.fork_rng(devices=[]):
        sft(
            probe_cfg,
            copy.deepcopy(actor),
            tok,
            task,
            Ops(ops_mode),
            log=lambda *a: None,
            on_step=lambda s, loss: stamps.append(time.perf_counter()),
        )
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def phase_seconds(cfg: TrainConfig, probe: float, runs: list[str], sft_to_run: bool) -> list:
    """[(phase name, estimated seconds)] from a probe of an SFT step with `cfg.ops`: the SFT
    warm-up (if it runs) and one RL run (steps + two evaluations) per entry of `runs` (ops)."""
    unit = probe / REF["sft_step"][cfg.ops]  # this machine, now, relative to the reference one
    out = []
    if sft_to_run:
        out.append(("SFT warm-up", probe * cfg.sft_steps))
    responses = cfg.prompts_per_step * cfg.group_size
    for ops in runs:
        step = REF["rl_step"][ops] * responses / REF_RESPONSES
        ev = REF["eval"] * cfg.eval_prompts / REF_EVAL_PROMPTS
        out.append((f"{ops} run", unit * (cfg.steps * step + 2 * ev)))
    return out


def _span(lo: float, hi: float) -> str:
    if hi < 90:
        return f"{max(lo, 1):.0f}-{max(hi, 1):.0f} s"
    lo, hi = lo / 60, hi / 60
    spec = ".1f" if hi < 10 else ".0f"
    return f"{lo:{spec}}-{hi:{spec}} min"


def format_estimate(phases: list, probe: float, sft_cached: bool, note: str = "") -> str:
    """One line: each phase as a range (SPREAD around its estimate), then the total; a `note`
    (first_run.load_note: the machine is busy) on a line of its own."""
    lo, hi = SPREAD
    parts = [f"{name} {_span(lo * s, hi * s)}" for name, s in phases]
    if sft_cached:
        parts.insert(0, "SFT warm-up: cached")
    elif phases and phases[0][0] == "SFT warm-up":
        parts[0] += " (cached for later runs)"
    total = sum(s for _, s in phases)
    line = (
        f"phase times from a {PROBE_STEPS}-step probe of this machine ({probe:.2f} s per SFT "
        f"step now): " + ", ".join(parts) + f"; in all {_span(lo * total, hi * total)}"
    )
    return line + (f"\n{note}" if note else "")


def estimate(cfg: TrainConfig, actor, tok, task, runs: list[str], sft_to_run: bool) -> str:
    probe = probe_sft_step(cfg, actor, tok, task, cfg.ops)
    sft_cached = not sft_to_run and cfg.sft_steps > 0
    phases = phase_seconds(cfg, probe, runs, sft_to_run)
    return format_estimate(phases, probe, sft_cached, load_note())
