"""kl_penalty / kl_penalized_rewards: naive.py (semantics), triton_kernels.py, op.py (the
registered ops' Python side), api.py (the public functions, exported by ppo_kernels)."""
