"""The rough phase times `python -m ppo_kernels train` prints before a PPO / GRPO run on the CPU."""

from __future__ import annotations

import os

from .checkpoint import sft_cache_path
from .config import TrainConfig

# The up-front estimate: CPU seconds of the default job, one torch thread, on the 2-core AMD EPYC
# of README's table (about the wall time there when the machine is otherwise idle).
_EST = {"sft_step": 0.15, "fused_step": 2.6, "eager_step": 4.5, "eval": 10.0}


def estimate(cfg: TrainConfig, compare: bool) -> str:
    """Rough phase times, scaled from the reference machine's (only meaningful near defaults)."""

    def mins(s):
        return f"~{max(s / 60, 0.1):.1f} min"

    parts = []
    cached = os.path.exists(sft_cache_path(cfg, cfg.vocab))
    if cfg.sft_steps and cfg.model is None:
        parts.append(
            "SFT warm-up: cached"
            if cached
            else f"SFT warm-up {mins(_EST['sft_step'] * cfg.sft_steps)} (cached for later runs)"
        )
    runs = [cfg.ops] + ([{"fused": "eager", "eager": "fused"}[cfg.ops]] if compare else [])
    for ops in runs:
        parts.append(f"{ops} run {mins(_EST[f'{ops}_step'] * cfg.steps + 2 * _EST['eval'])}")
    return "rough phase times on an idle 2-core CPU: " + ", ".join(parts)
