"""The thin PPO / GRPO / DPO / reward-model trainer on transformers models, built on ppo_kernels
ops (`python -m ppo_kernels train --help`).

- config.py   TrainConfig (dataclass -> command-line flags, validation with clear errors)
- task.py     the embedded decimal-addition-with-calculator task, verifier, demonstrations
- models.py   Actor / Reference / Critic / reward model on transformers models
- rollout.py  sampling in the multi-turn tool environment; batches with action masks
- ops.py      every per-token computation: the fused op, or the eager code trainers run today
- algos/      one module per algorithm: SFT, evaluation, PPO / GRPO, reward model, DPO
- job.py      `run(cfg)`: one job end to end (SFT warm-up, training, evaluation, summary)
- checkpoint.py  the SFT cache, the resumable checkpoint (--resume), the reward model file
- report.py   metrics.jsonl / metrics.csv, curves.png, the --compare table and closing notes
- estimate.py the phase times printed up front, from a probe of this machine
- cli.py      `main(argv)`: the flags, the estimate, a job, --compare
"""

from .config import ConfigError, TrainConfig  # noqa: F401
from .ops import Ops  # noqa: F401


def run(cfg: "TrainConfig", log=print) -> dict:
    from .job import run as _run

    return _run(cfg, log)
