"""Sequence-parallel GAE: each rank of a sequence/context-parallel group holds a contiguous time
slice of the same rows (rank 0 the start). The reverse scan is affine in the carry (next value,
next advantage) flowing in from the right (docs/ppo-math.md, csrc/common/gae_combine.h), so:

  1. each rank reduces its slice to that affine map, carry_out = M @ carry_in + c, per row: one
     call of the gae kernel on the slice stacked three times with the probe carries (0, 0), (1, 0)
     and (0, 1) -- c and the two columns of M by superposition;
  2. ONE all-gather exchanges the maps ([B, 6] float32 per rank: 24 bytes per row, independent of
     T, vs 8-12 bytes per token to gather the rows);
  3. each rank composes the maps of the ranks to its right, applied to the right edge of the last
     rank (its bootstrap value or carry; 0 = terminated), to get its incoming carry;
  4. and runs its slice with that carry.
The result on every rank equals the whole-row result (up to float32 rounding of the composition).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._comm import all_gather as _all_gather
from ._comm import require_initialized


def _apply(maps: Tensor, carry: Tensor) -> Tensor:
    """maps [B, 6] = (M00, M01, M10, M11, c0, c1); carry [B, 2] -> M @ carry + c."""
    v = maps[:, 0] * carry[:, 0] + maps[:, 1] * carry[:, 1] + maps[:, 4]
    a = maps[:, 2] * carry[:, 0] + maps[:, 3] * carry[:, 1] + maps[:, 5]
    return torch.stack([v, a], 1)


def sequence_parallel_gae(
    gae_fn,
    rewards,
    values,
    mask,
    *,
    gamma,
    lam,
    dones,
    bootstrap_value,
    carry,
    return_carry,
    process_group,
):
    """The body of gae(..., process_group=...). `gae_fn` is the single-device gae."""
    require_initialized()
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    B, T = rewards.shape
    dev = rewards.device
    acc = torch.float64 if rewards.dtype == torch.float64 else torch.float32

    def stack3(x):  # the slice three times (a per-token gamma / lam broadcast first)
        if not isinstance(x, Tensor) or x.dim() == 0:
            return x
        x = x.expand(B, T)
        return torch.cat([x, x, x], 0)

    probes = torch.zeros(3 * B, 2, dtype=acc, device=dev)
    probes[B : 2 * B, 0] = 1.0
    probes[2 * B :, 1] = 1.0
    kw = dict(
        gamma=stack3(gamma) if isinstance(gamma, Tensor) else gamma,
        lam=stack3(lam) if isinstance(lam, Tensor) else lam,
        dones=None if dones is None else stack3(dones),
    )
    _, _, (cv, ca) = gae_fn(
        stack3(rewards),
        stack3(values),
        None if mask is None else stack3(mask),
        carry=(probes[:, 0], probes[:, 1]),
        return_carry=True,
        **kw,
    )
    out = torch.stack([cv, ca], 1).to(acc).view(3, B, 2)
    c = out[0]
    maps = torch.cat([out[1] - c, out[2] - c, c], 1)  # (M00, M10, M01, M11, c0, c1)
    maps = maps[:, [0, 2, 1, 3, 4, 5]].contiguous()  # -> (M00, M01, M10, M11, c0, c1)
    # the right edge of the whole row, owned by the last rank (zeros elsewhere)
    edge = torch.zeros(B, 2, dtype=acc, device=dev)
    if bootstrap_value is not None:
        edge[:, 0] = bootstrap_value.to(acc)
    if carry is not None:
        edge[:, 0], edge[:, 1] = carry[0].to(acc), carry[1].to(acc)
    payload = torch.cat([maps, edge], 1)  # [B, 8]
    gathered = torch.empty(world * B * 8, dtype=acc, device=dev)
    _all_gather(gathered, payload.reshape(-1), group=process_group)
    gathered = gathered.view(world, B, 8)
    incoming = gathered[world - 1, :, 6:8]
    for r in range(world - 1, rank, -1):
        incoming = _apply(gathered[r, :, :6], incoming)
    res = gae_fn(
        rewards,
        values,
        mask,
        gamma=gamma,
        lam=lam,
        dones=dones,
        carry=(incoming[:, 0].contiguous(), incoming[:, 1].contiguous()),
        return_carry=return_carry,
    )
    return res
