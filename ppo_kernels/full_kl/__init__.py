"""full_kl: naive.py (semantics), triton_kernels.py, op.py (the registered ops' Python side),
api.py (the public function, exported by ppo_kernels)."""
