"""The PPO / GRPO policy losses, the value loss, the pairwise losses and masked aggregation.

naive.py (semantics, the eager backend), policy_math.py (the loss types' shared two-stage
math), policy_naive.py (its float64 reference), rollout.py (rollout correction),
triton_kernels.py, op.py (the registered ops' Python side), policy_loss.py (the loss types off
the fused path), and the public functions exported by ppo_kernels: api.py (ppo_policy_loss,
ppo_value_loss), aggregate.py (masked_aggregate), pairwise.py (reward_model_loss, dpo_loss),
rollout.py (rollout_correction)."""
