"""The training algorithms, one module each; every per-token computation goes through `Ops` (fused
ppo_kernels ops or the eager implementations).

- sft.py       SFT warm-up on generated demonstrations
- evaluate.py  the sampled policy's reward and tool use on held-out problems
- ppo.py       PPO / GRPO: RLTrainer (rollout, scoring, advantages, minibatch updates)
- rm.py        the reward model: training, held-out accuracy, score standardisation
- dpo.py       offline DPO
- common.py    what they share: prompt tokens, the optimiser, preference-pair batches
"""
