"""PPO on the embedded task from Python: a tiny Llama learns to call a float calculator and format
its answer ("0.10" + "0.20" -> "0.30", not 0.30000000000000004).

    python examples/ppo_decimal_tool.py [--ops eager] [--out out/example_ppo]

The same as `python -m ppo_kernels train --algo ppo --out out/example_ppo`; this shows the API.
"""

import argparse

from ppo_kernels.trainer import TrainConfig, run

ap = argparse.ArgumentParser()
ap.add_argument("--ops", default="fused", choices=("fused", "eager"))
ap.add_argument("--out", default="out/example_ppo")
ap.add_argument("--steps", type=int, default=TrainConfig.steps)
args = ap.parse_args()

cfg = TrainConfig(algo="ppo", ops=args.ops, out=args.out, steps=args.steps).validate()
summary = run(cfg)
print(
    f"held-out reward {summary['eval_reward_before']:.3f} -> {summary['eval_reward_after']:.3f}, "
    f"{summary['seconds_per_step']:.2f} s/step; metrics in {args.out}/metrics.jsonl, "
    f"plot in {args.out}/curves.png"
)
