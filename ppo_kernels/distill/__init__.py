"""distill: the distillation tile kernels -- naive.py (semantics, the eager backend),
triton_kernels.py, op.py (the `_backend.Kernel` objects and the backend key)."""
