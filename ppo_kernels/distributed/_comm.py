"""The collectives the distributed forms use: torch.distributed's functional collectives, which
torch.compile traces into the graph (fullgraph=True works) and which run eagerly otherwise."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc

from .. import _backend

# torch >= 2.14 names it all_gather_single (all_gather_tensor is deprecated there)
_gather = getattr(_fc, "all_gather_single", None) or _fc.all_gather_tensor


def require_initialized():
    """A clear error naming the argument when a process_group is passed without a process group."""
    if not dist.is_initialized():
        raise RuntimeError("process_group: torch.distributed is not initialised")


SENT_BYTES = [0]  # bytes this process contributed to collectives (bench/bench_distributed.py)
CALLS = {"all_gather": 0, "all_reduce": 0}  # collectives run eagerly (tests count them)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def all_gather(inp, group):
    """Every rank's `inp` (flattened) in rank order: a new flat tensor of world * inp.numel()."""
    if not _compiling():
        SENT_BYTES[0] += inp.numel() * inp.element_size()
        CALLS["all_gather"] += 1
    return _fc.wait_tensor(_gather(inp.reshape(-1).contiguous(), 0, group))


def all_reduce_(t, group):
    """Sum `t` over the ranks of `group`, in place (the functional all_reduce, copied back)."""
    if not _compiling():
        SENT_BYTES[0] += t.numel() * t.element_size()
        CALLS["all_reduce"] += 1
    t.copy_(_fc.wait_tensor(_fc.all_reduce(t, "sum", group)))
    return t


def cross_checks(t) -> bool:
    """Whether to run the cross-rank checks that read gathered numbers on the host (a sync on the
    GPU) or cost a tiny extra collective: always for CPU tensors, on the GPU under
    `ppo_kernels.strict_checks()`, never while torch.compile traces. Every rank of a group must
    decide alike (the same device type and strict mode), as they run the same collectives."""
    return not _compiling() and (t.device.type == "cpu" or _backend.strict())


def check_same_sizes(group, device, **sizes: int):
    """Before a gather whose payload size depends on these sizes (a mismatched all-gather aborts
    gloo from one of its threads and garbles NCCL): one tiny all-gather of the sizes, raising a
    ValueError naming the first argument whose size differs across the ranks."""
    mine = torch.tensor(list(sizes.values()), dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    got = all_gather(mine, group).view(world, -1).cpu()
    for j, name in enumerate(sizes):
        col = got[:, j].tolist()
        if any(c != col[0] for c in col):
            raise ValueError(
                f"{name}: the ranks of the process group hold different sizes {col} (rank order); "
                "every rank must pass the same shape here"
            )
