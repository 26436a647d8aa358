"""Data-parallel training when launched by torchrun (RANK / WORLD_SIZE / LOCAL_RANK set). Without
torchrun (or with one process) `init` returns None and every function here is the identity.

`--dist ddp` (default): every rank holds the whole models, wrapped in DistributedDataParallel,
whose reducer averages the gradients over the ranks in buckets during the backward.
`--dist fsdp2`: `fully_shard` on each decoder layer and on each model: parameters, gradients and
optimiser state are sharded over the ranks, each layer's parameters all-gathered for its forward
and backward, gradients reduce-scattered. The frozen Reference and reward model are sharded too.

Both hook a module's forward, so every use of a model's weights goes through one: `Policy` puts
the Actor's two uses behind its forward -- generation (the causal LM with its KV cache) and the
trainer's per-token log-probs, which read the hidden states and the LM-head weight directly (the
fused op never builds the logits). The Critic and reward model are `ValueModel`s, called as such.

Exactness: each rank scales its token-mean losses by (its tokens x world / all ranks' tokens), so
the averaged gradient is the one-process gradient of the global token mean, and metrics are
global ratios of all-reduced sums and counts (`global_ratio`), never means of per-rank means.
"""

from __future__ import annotations

import copy
import gc
import os

import torch
import torch.distributed as dist
from torch import nn

MODES = ("ddp", "fsdp2")


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
    """Wait for every rank, then leave the process group. First collect the garbage: modules
    wrapped by DDP / FSDP sit in reference cycles and hold the group; one still alive at
    interpreter exit destroys a gloo group during finalization, which can abort the process
    ("terminate called without an active exception", seen in CI; torchrun ranks of the CLI also
    skip finalization: ppo_kernels/__main__.py)."""
    if group is not None:
        gc.collect()
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


def span(lo: int, hi: int, group) -> tuple[int, int]:
    """This rank's contiguous part of [lo, hi) (parts differ by at most one; none is empty when
    hi - lo >= world)."""
    n, w, r = hi - lo, world(group), rank(group)
    return lo + r * n // w, lo + (r + 1) * n // w


def chunks(n: int, size: int, group) -> list[tuple[int, int]]:
    """[lo, hi) chunks of `size` over n items, a tail smaller than the world merged into the
    chunk before it (so that `span` never leaves a rank without rows; one process: unchanged)."""
    out = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
    if len(out) > 1 and out[-1][1] - out[-1][0] < world(group):
        out[-2:] = [(out[-2][0], n)]
    return out


# ---------------------------------------------------------------------------------------------
# the models behind their forward
# ---------------------------------------------------------------------------------------------
class Policy(nn.Module):
    """The Actor behind one forward. Called like the causal LM (keyword arguments, as generation
    does) it is the causal LM; called with `logprobs={...}` it returns
    `models.token_logprobs(ops, actor, input_ids, attention_mask, position_ids, **logprobs)`,
    and likewise with `actor_loss={...}` `models.actor_loss(...)` (the fused PPO / GRPO actor
    loss), `preference_loss={...}` `models.preference_loss(...)` (the fused DPO loss),
    `distill_loss={...}` `models.distill_loss(...)` and `action_hidden={...}`
    `models.action_hidden(...)` (no ops). A loss is computed inside the wrapper's forward, where
    FSDP2 has the LM head gathered and DDP sees the forward."""

    _MODES = ("logprobs", "actor_loss", "preference_loss", "distill_loss", "action_hidden")

    def __init__(self, actor: nn.Module, ops):
        super().__init__()
        self.actor, self.ops = actor, ops

    def forward(self, input_ids, attention_mask, position_ids, **kw):
        modes = [m for m in self._MODES if kw.get(m) is not None]
        if not modes:
            kw = {k: v for k, v in kw.items() if k not in self._MODES}
            return self.actor(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw
            )
        from . import models

        (mode,) = modes
        inputs = (self.actor, input_ids, attention_mask, position_ids)
        if mode == "action_hidden":
            return models.action_hidden(*inputs, **kw[mode])
        fn = models.token_logprobs if mode == "logprobs" else getattr(models, mode)
        return fn(self.ops, *inputs, **kw[mode])


def wrap(model: nn.Module, mode: str, group):
    """`model` ready for data-parallel calls: DDP for a trained model under --dist ddp (a frozen
    one is used as it is), fully_shard'ed under --dist fsdp2 (in place: the same object, whose
    parameters become DTensor shards -- copy a model before this, never after; build its
    optimiser before its first forward, after which FSDP2 may leave the root's parameters
    unsharded and `parameters()` would list those temporary tensors). One process: `model`."""
    if group is None:
        return model
    p = next(model.parameters())
    if mode == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # over our group on the models' device (the default mesh would pick CUDA whenever a GPU
        # is visible, also for a gloo run on the CPU)
        mesh = DeviceMesh.from_group(group, p.device.type)
        # shard each decoder layer (transformers names their classes in _no_split_modules), then
        # the rest (embeddings, final norm, heads) as the root group
        names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
        for m in list(model.modules()):
            if m is not model and type(m).__name__ in names:
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if mode != "ddp":
        raise ValueError(f"dist mode: expected one of {MODES}, got {mode!r}")
    if not any(p.requires_grad for p in model.parameters()):
        return model
    import inspect

    ddp = nn.parallel.DistributedDataParallel
    # the models hold no buffers that change in training (rotary tables are constants): no
    # broadcast before each forward (torch 2.14 renamed the flag)
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(ddp).parameters
        else {"broadcast_buffers": False}
    )
    return ddp(model, device_ids=[p.device] if p.device.type == "cuda" else None, **no_sync)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (a fully_shard'ed module is its own)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a replicated DTensor (FSDP2's clip_grad_norm_ returns one)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _full(everywhere=False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # the whole tensors, gathered on the CPU of rank 0 (the other ranks get {}: rank 0 saves)
    # or on every rank
    return StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)


def _set():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


def state_dict(model, everywhere=False) -> dict:
    """The whole state dict of `model` (unwrapped, the keys of its own state_dict()); under
    FSDP2 a collective (every rank calls it), rank 0 receives it (`everywhere`: every rank)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(unwrap(model), options=_full(everywhere))


def load_state_dict(model, sd: dict):
    """Load a whole state dict (from `state_dict`) on every rank; FSDP2 keeps each rank's shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # (it replaces the dict's values by this rank's shards: give it a copy)
    set_model_state_dict(unwrap(model), dict(sd), options=_set())


def optim_state_dict(model, opt) -> dict:
    """The optimiser's whole state keyed by parameter names (the same format in every mode, so a
    checkpoint resumes under another --dist or world size)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(unwrap(model), opt, options=_full())


def load_optim_state_dict(model, opt, sd: dict):
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(unwrap(model), opt, copy.deepcopy(sd), options=_set())


# ---------------------------------------------------------------------------------------------
# small collectives
# ---------------------------------------------------------------------------------------------
def _dev(group):
    """Where small host values travel: NCCL moves only CUDA tensors."""
    return torch.cuda.current_device() if dist.get_backend(group) == "nccl" else "cpu"


def all_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of `t` over the ranks (float64, one all-reduce); `t` itself with one process."""
    if group is None:
        return t
    t = t.to(_dev(group), torch.float64, copy=True)  # never reduce the caller's tensor in place
    dist.all_reduce(t, group=group)
    return t


def global_max(t: torch.Tensor, group) -> torch.Tensor:
    """Max of `t` over the ranks (float64); `t` itself with one process."""
    if group is None:
        return t
    t = t.to(_dev(group), torch.float64, copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def global_ratio(sums: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """sum over ranks of `sums` / sum over ranks of `counts`, elementwise, in one all-reduce:
    a global mean of per-rank sums (counts 0 give 0)."""
    both = all_sum(torch.stack([sums.double(), counts.double()]), group)
    s, n = both.unbind(0)
    return torch.where(n != 0, s / torch.where(n != 0, n, 1.0), 0.0)


def global_means(pairs: dict, group) -> dict:
    """{name: (local sum, local count)} -> {name: global sum / global count} as floats."""
    keys = list(pairs)
    to = lambda x: torch.as_tensor(x, dtype=torch.float64).detach().cpu()  # noqa: E731
    r = global_ratio(
        torch.stack([to(pairs[k][0]) for k in keys]),
        torch.stack([to(pairs[k][1]) for k in keys]),
        group,
    )
    return dict(zip(keys, r.tolist()))


def any_true(flag: bool, group) -> bool:
    """Whether `flag` holds on any rank."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], device=_dev(group))
    dist.all_reduce(t, group=group)
    return bool(t.item())
