"""The one collective the distributed forms use."""

import torch.distributed as dist

# torch >= 2.14 names it all_gather_single (all_gather_into_tensor is deprecated there)
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def require_initialized():
    """A clear error naming the argument when a process_group is passed without a process group."""
    if not dist.is_initialized():
        raise RuntimeError("process_group: torch.distributed is not initialised")


SENT_BYTES = [0]  # bytes this process contributed to collectives (bench/bench_distributed.py)


def all_gather(out, inp, group=None):
    """Gather `inp` of every rank of `group` into `out` (world * inp.numel(), rank order)."""
    SENT_BYTES[0] += inp.numel() * inp.element_size()
    _gather(out, inp, group=group)
