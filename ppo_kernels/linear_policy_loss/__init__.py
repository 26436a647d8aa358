"""linear_policy_loss: naive.py (semantics: the autograd composition), op.py (the registered
ops' Python side: the chunk loop per backend), api.py (the public function, exported by
ppo_kernels)."""
