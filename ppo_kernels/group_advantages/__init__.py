"""grpo_advantages / rloo_advantages: naive.py (semantics), triton_kernels.py, op.py (the
registered op's Python side), api.py (the public functions and group_ids, exported by
ppo_kernels)."""
