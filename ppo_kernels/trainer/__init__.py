"""The thin PPO / GRPO / DPO / reward-model trainer on transformers models, built on ppo_kernels
ops (`python -m ppo_kernels train --help`).

- config.py   TrainConfig (dataclass -> command-line flags, validation with clear errors)
- task.py     the embedded decimal-addition-with-calculator task, verifier, demonstrations
- models.py   Actor / Reference / Critic / reward model on transformers models
- rollout.py  sampling in the multi-turn tool environment; batches with action masks
- ops.py      every per-token computation: the fused op, or the eager code trainers run today
- algos.py    SFT, evaluation, PPO / GRPO steps, reward-model training, DPO
- cli.py      `main(argv)`: run a job, metrics.jsonl, summary.json, curves.png, --compare
"""
from .config import ConfigError, TrainConfig  # noqa: F401
from .ops import Ops  # noqa: F401


def run(cfg: "TrainConfig", log=print) -> dict:
    from .cli import run as _run
    return _run(cfg, log)
