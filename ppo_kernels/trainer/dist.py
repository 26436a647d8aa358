"""Data-parallel training when launched by torchrun (RANK / WORLD_SIZE / LOCAL_RANK set): every
rank holds the whole Actor and Critic, takes its contiguous share of each step's prompts, and
gradients are averaged over ranks before each optimiser step. Without torchrun (or with one
process) `init` returns None and nothing changes.

Gradients are averaged here rather than by wrapping the models in DDP: the trainer reads the
Actor's hidden states and LM-head weight directly (`models.token_logprobs`), so the wrapper's
forward, which DDP's reducer relies on, is never called. One all-reduce of the flattened
gradients per model and optimiser step is what DDP would do, in one bucket.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init(device: str):
    """(process group or None, device): the world group under torchrun, gloo on the CPU and NCCL
    on GPUs (each process on cuda:LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ or world == 1:
        return None, device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.group.WORLD, device


def close(group):
    """Wait for every rank, then leave the process group."""
    if group is not None:
        dist.barrier(group)
        dist.destroy_process_group()


def rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def world(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def share(items: list, group) -> tuple[list, int]:
    """(this rank's contiguous share of `items`, its offset); len(items) divides by the world."""
    n = len(items) // world(group)
    lo = rank(group) * n
    return items[lo : lo + n], lo


def average_grads(params, group):
    """Average the gradients of `params` over the ranks (one all-reduce)."""
    if group is None:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world(group)
    for g, v in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(v.view_as(g))


def _dev(group):
    """Where small host values travel: NCCL moves only CUDA tensors."""
    return torch.cuda.current_device() if dist.get_backend(group) == "nccl" else "cpu"


def mean_metrics(m: dict, group) -> dict:
    """Every float metric averaged over the ranks (each rank holds the same number of rows)."""
    if group is None:
        return m
    keys = sorted(k for k, v in m.items() if isinstance(v, float))
    t = torch.tensor([m[k] for k in keys], dtype=torch.float64, device=_dev(group))
    dist.all_reduce(t, group=group)
    return {**m, **dict(zip(keys, (t / world(group)).tolist()))}


def any_true(flag: bool, group) -> bool:
    """Whether `flag` holds on any rank."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], device=_dev(group))
    dist.all_reduce(t, group=group)
    return bool(t.item())
