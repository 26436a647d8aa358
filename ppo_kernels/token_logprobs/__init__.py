"""token_logprobs: naive.py (semantics), triton_kernels.py, op.py (the registered ops' Python
side and the per-backend kernels), api.py (the public function, exported by ppo_kernels)."""
