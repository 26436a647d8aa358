"""Sequence-parallel GAE: each rank of a sequence/context-parallel group holds a contiguous time
slice of the data (rank 0 the start). The reverse scan is affine in the carry (next value, next
advantage) flowing in from the right (docs/ppo-math.md, csrc/common/gae_combine.h), so:

  1. each rank reduces its slice to that affine map, carry_out = M @ carry_in + c: one call of the
     gae kernel on the slice stacked three times with the probe carries (0, 0), (1, 0) and (0, 1)
     -- c and the two columns of M by superposition;
  2. ONE all-gather exchanges the maps;
  3. each rank composes the maps of the ranks to its right to get its incoming carry;
  4. and runs its slice with that carry.
The result on every rank equals the single-device result (up to float rounding of the
composition).

Dense rows (`[B, T_rank]`, every rank holds a time slice of the same B rows): one map per row,
[B, 8] per rank (the map and the right edge of the last rank: its bootstrap value or carry) --
32 bytes per row whatever T, vs 8-12 bytes per token to gather the rows.

Packed rows (`[N_rank]` slices of one flat stream of n rows, `cu_seqlens` the stream's row
offsets minus this rank's first token index, the same n + 1 numbers on every rank up to that
shift): row i covers local positions [cu[i], cu[i+1]) -- negative where it started on a rank to
the left, past N_rank where it continues on one to the right -- so each rank sees its pieces,
clamp(cu, 0, N_rank), and where it sits in the stream (-cu[0]). Only the row crossing a rank's
right border receives a carry from the right, and only the row crossing its left border passes
one on (a row boundary on a border resets the carry: M = 0 then), so one map per rank does:
[11] float64 (n, N_rank, start, total, valid, M, c) -- 88 bytes per rank, whatever the tokens.
bootstrap_value / carry are per row ([n], the same on every rank): each rank uses those of the
rows that end in its slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _backend
from .._checks import check_devices
from .._math import acc_dtype
from ._comm import all_gather as _all_gather
from ._comm import check_same_sizes, cross_checks, require_initialized


def _apply(maps: Tensor, carry: Tensor) -> Tensor:
    """maps [B, 6] = (M00, M01, M10, M11, c0, c1); carry [B, 2] -> M @ carry + c."""
    v = maps[:, 0] * carry[:, 0] + maps[:, 1] * carry[:, 1] + maps[:, 4]
    a = maps[:, 2] * carry[:, 0] + maps[:, 3] * carry[:, 1] + maps[:, 5]
    return torch.stack([v, a], 1)


def _incoming(maps: Tensor, edge: Tensor, rank: int) -> Tensor:
    """The carry at this rank's right border: the maps [world, B, 6] of the ranks to the right
    applied, right to left, to the right edge [B, 2] of the last rank."""
    carry = edge
    for r in range(maps.shape[0] - 1, rank, -1):
        carry = _apply(maps[r], carry)
    return carry


def _maps_from_probes(out: Tensor) -> Tensor:
    """The carries [3, B, 2] the slice leaves with probes (0, 0), (1, 0), (0, 1) coming in ->
    maps [B, 6] = (M00, M01, M10, M11, c0, c1)."""
    c = out[0]
    m0, m1 = out[1] - c, out[2] - c  # the columns of M
    return torch.stack([m0[:, 0], m1[:, 0], m0[:, 1], m1[:, 1], c[:, 0], c[:, 1]], 1)


def _stack3(x):
    """The slice three times along dim 0; floats and None as they are."""
    if not isinstance(x, Tensor):
        return x
    return torch.cat([x, x, x], 0)


def _edge(init_value, init_adv, n, acc, dev):
    """The right-edge carry (value, advantage) [n] of each row: the bootstrap value or carry
    (checked by the public API), else 0."""
    v = torch.zeros(n, dtype=acc, device=dev) if init_value is None else init_value.to(acc)
    a = torch.zeros(n, dtype=acc, device=dev) if init_adv is None else init_adv.to(acc)
    return v, a


def sequence_parallel_gae(
    rewards,
    values,
    mask,
    dones,
    gamma_t,
    lam_t,
    gamma,
    lam,
    init_value,
    init_adv,
    cu_seqlens,
    *,
    return_carry,
    process_group,
):
    """The body of gae(..., process_group=...): the registered op's arguments as the public API
    normalised them (`ppo_kernels::gae`'s schema; init_value / init_adv the right edge)."""
    check_devices(
        "rewards", rewards, values=values, mask=mask, dones=dones, gamma_t=gamma_t, lam_t=lam_t,
        init_value=init_value, init_adv=init_adv, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    require_initialized()
    gae = _backend.op("gae")
    if cu_seqlens is not None:
        if return_carry:
            raise ValueError(
                "return_carry: not supported with cu_seqlens and process_group (a rank's left "
                "edge is inside one row)"
            )
        return _packed(
            gae,
            rewards,
            values,
            mask,
            dones,
            gamma_t,
            lam_t,
            gamma,
            lam,
            init_value,
            init_adv,
            cu_seqlens,
            process_group,
        )
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    B, T = rewards.shape
    dev = rewards.device
    acc = acc_dtype(rewards.dtype)
    if cross_checks(rewards):  # the payload's size depends on B
        check_same_sizes(process_group, dev, rewards=B)

    probes = torch.zeros(3 * B, 2, dtype=acc, device=dev)
    probes[B : 2 * B, 0] = 1.0
    probes[2 * B :, 1] = 1.0
    per_token = [_stack3(x) for x in (rewards, values, mask, dones, gamma_t, lam_t)]
    _, _, cv, ca = gae(*per_token, gamma, lam, probes[:, 0], probes[:, 1], None)
    maps = _maps_from_probes(torch.stack([cv, ca], 1).to(acc).view(3, B, 2))
    # the right edge of the whole row, owned by the last rank (the others' is not used)
    edge = torch.stack(_edge(init_value, init_adv, B, acc, dev), 1)
    gathered = _all_gather(torch.cat([maps, edge], 1), process_group).view(world, B, 8)
    incoming = _incoming(gathered[:, :, :6], gathered[world - 1, :, 6:8], rank)
    adv, ret, cv, ca = gae(
        rewards,
        values,
        mask,
        dones,
        gamma_t,
        lam_t,
        gamma,
        lam,
        incoming[:, 0].contiguous(),
        incoming[:, 1].contiguous(),
        None,
    )
    return (adv, ret, (cv, ca)) if return_carry else (adv, ret)


def _packed(
    gae, rewards, values, mask, dones, gamma_t, lam_t, gamma, lam, init_value, init_adv, cu, group
):
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    (L,) = rewards.shape
    n = cu.numel() - 1
    dev = rewards.device
    acc = acc_dtype(rewards.dtype)
    c = cu.long()
    # Local validity, exchanged rather than raised here: a rank that raised before the collective
    # would leave the others waiting in it.
    valid = ((c[1:] >= c[:-1]).all() & (c[0] <= 0) & (c[-1] >= L)).to(torch.float64)
    # This rank's pieces of the rows: non-decreasing offsets from 0 to L whatever cu holds (so the
    # kernel never sees bad offsets; a bad cu is reported after the exchange).
    pc = c.clamp(0, L).cummax(0).values
    pc = torch.cat([pc.new_zeros(1), pc[1:-1], pc.new_full((1,), L)]) if n > 0 else pc * 0
    right = (c[:-1] < L) & (c[1:] > L)  # the row continuing on the rank to the right
    left = (c[:-1] < 0) & (c[1:] > 0)  # the row that started on a rank to the left
    edge_v, edge_a = _edge(init_value, init_adv, n, acc, dev)

    # probes (0, 0), (1, 0), (0, 1) into the row crossing the right border, the rows' own edges
    # into the others; the map is what leaves the row crossing the left border
    probe_v = torch.tensor([0.0, 1.0, 0.0], dtype=acc, device=dev).repeat_interleave(n)
    probe_a = torch.tensor([0.0, 0.0, 1.0], dtype=acc, device=dev).repeat_interleave(n)
    right3 = right.repeat(3)
    per_token = [_stack3(x) for x in (rewards, values, mask, dones, gamma_t, lam_t)]
    _, _, cv, ca = gae(
        *per_token,
        gamma,
        lam,
        torch.where(right3, probe_v, edge_v.repeat(3)),
        torch.where(right3, probe_a, edge_a.repeat(3)),
        torch.cat([pc, pc[1:] + L, pc[1:] + 2 * L]).to(torch.int32),
    )
    out = torch.stack([cv, ca], 1).to(torch.float64).view(3, n, 2)
    out = torch.where(left.view(1, n, 1), out, torch.zeros_like(out)).sum(1, keepdim=True)
    maps = _maps_from_probes(out).view(6)  # zero when no row crosses the left border
    header = torch.stack([c.new_tensor(n), c.new_tensor(L), -c[0], c[-1] - c[0]]).to(torch.float64)
    payload = torch.cat([header, valid.view(1), maps])
    gathered = _all_gather(payload, group).view(world, 11)
    if cross_checks(rewards):
        _check_packed(gathered[:, :5].cpu())
    # the last rank's right border ends the stream: nothing comes in there
    incoming = _incoming(
        gathered[:, None, 5:], torch.zeros(1, 2, dtype=torch.float64, device=dev), rank
    )
    inc = incoming.to(acc)
    adv, ret, _, _ = gae(
        rewards,
        values,
        mask,
        dones,
        gamma_t,
        lam_t,
        gamma,
        lam,
        torch.where(right, inc[0, 0], edge_v).contiguous(),
        torch.where(right, inc[0, 1], edge_a).contiguous(),
        pc.to(torch.int32),
    )
    return adv, ret


def _check_packed(h: Tensor):
    """h [world, 5] = (rows, tokens, start, total, valid) per rank: every rank has the same rows
    and stream, a valid cu_seqlens, and the slices tile the stream in rank order."""
    rows, toks, start, total, ok = (h[:, j].long().tolist() for j in range(5))
    if any(x != rows[0] for x in rows):
        raise ValueError(
            f"cu_seqlens: the ranks hold different numbers of rows {rows}; every rank passes the "
            "stream's n + 1 row offsets (minus its first token index)"
        )
    bad = [r for r, x in enumerate(ok) if not x]
    if bad:
        raise ValueError(
            f"cu_seqlens: on rank(s) {bad} not non-decreasing offsets with cu_seqlens[0] <= 0 <= "
            "rewards.shape[0] <= cu_seqlens[-1] (the stream's offsets minus the rank's first token "
            "index, so that its slice lies inside the stream)"
        )
    pos = 0
    for r in range(len(rows)):
        if start[r] != pos or total[r] != total[0]:
            raise ValueError(
                f"cu_seqlens: the ranks' slices (start = -cu_seqlens[0], tokens) = "
                f"{list(zip(start, toks))} do not tile the stream of {total[0]} tokens in rank "
                "order; pass the stream's offsets minus each rank's first token index "
                "(cu_seqlens - t0)"
            )
        pos += toks[r]
    if pos != total[0]:
        raise ValueError(
            f"cu_seqlens: the ranks' slices hold {pos} tokens, the stream (cu_seqlens[-1] - "
            f"cu_seqlens[0]) {total[0]}"
        )
