"""gae: naive.py (semantics), triton_kernels.py, op.py (the registered op's Python side),
api.py (the public function, exported by ppo_kernels)."""
