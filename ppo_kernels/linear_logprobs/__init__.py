"""linear_token_logprobs (token log-probs and entropy through the LM head, the logits never built)
and causal_lm_logprobs: naive.py (semantics, eager tile kernels), triton_kernels.py,
planner.py / tiler.py / chunks.py (the chunk loop), op.py (the registered ops' Python side),
api.py (the public function), hf.py (causal_lm_logprobs on a transformers model)."""
