"""distill: the fused distillation loss from hidden states (`linear_distill_loss`) -- api.py (the
public function), op.py (the registered op's Python side, its reductions and the distillation
tile kernels as `_backend.Kernel` objects), head.py (its head term), naive.py (the tile kernels'
semantics, the eager backend and the materialised-logits baseline), triton_kernels.py."""
