"""linear_preference_loss: naive.py (semantics: the autograd composition on materialised logits),
head.py (the engine's head term), op.py (the registered ops' Python side: the chunk loop per
backend), api.py (the public function, exported by ppo_kernels)."""
