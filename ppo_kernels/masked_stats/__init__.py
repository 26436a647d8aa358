"""masked_mean / masked_whiten: naive.py (verl's version, the benchmark baseline), op.py (the
registered ops' Python side: fakes, the eager implementations), api.py (the public functions,
exported by ppo_kernels)."""
