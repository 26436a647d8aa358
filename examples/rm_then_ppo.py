"""The reward-model route: train an RM on "A preferred to B" pairs (pairwise loss), report its
held-out pairwise accuracy, then run PPO with the RM as the reward and the Critic initialised from
the RM (as InstructGPT did). The verifier is used only to evaluate.

    python examples/rm_then_ppo.py [--out out/example_rm]
"""

import argparse
import os

from ppo_kernels.trainer import TrainConfig, run

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="out/example_rm")
args = ap.parse_args()
cache = os.path.join(args.out, "sft_cache")  # both runs start from the same SFT model

rm = run(
    TrainConfig(algo="rm", steps=150, out=os.path.join(args.out, "rm"), sft_cache=cache).validate()
)
print(
    f"RM held-out pairwise accuracy {rm['rm_pair_accuracy_before']:.3f} -> "
    f"{rm['rm_pair_accuracy_after']:.3f}"
)
ppo = run(
    TrainConfig(
        algo="ppo",
        reward="rm",
        out=os.path.join(args.out, "ppo"),
        sft_cache=cache,
        rm_path=os.path.join(args.out, "rm", "reward_model.pt"),
    ).validate()
)
print(
    f"PPO with the RM: held-out verifier reward {ppo['eval_reward_before']:.3f} -> "
    f"{ppo['eval_reward_after']:.3f}"
)
