"""The vocabulary layout of the vocab-parallel forms (vocab_parallel_*.py): which contiguous slice
[start, start + size) of the vocabulary each rank of the group holds, negotiated through the
forms' one all-gather.

Each rank gathers a header [start, size, N, how the start was derived] in front of its per-row
states (`gather`). A start that is not given is derived without a collective of its own
(`resolve_vocab_start`: the one learned by an earlier call for this group and slice size, else
rank * slice size) and settled from the gathered headers (`gather_settled`: where a derived start
was wrong, every rank recomputes its states and gathers once more, eager only). The finish ops
validate the gathered headers (`check_layout`: same N everywhere, slices tiling [0, V), derived
starts in rank order) on the host, or, on the GPU once a layout has been validated, against the
cached layout on the device (no host sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _backend
from .._checks import check_labels_in_range, check_tensor, device_error
from ._comm import all_gather as _all_gather
from ._comm import check_same_sizes, cross_checks, require_initialized

HEADER = 4  # vocab_start, V_rank, N, how it was derived (GIVEN 0 / CACHED 1 / GUESSED 2)


def gather(local: Tensor, header: list[int], group) -> Tensor:
    """One all-gather of [header | local states] -> [world, HEADER + local.numel()] (after a tiny
    one of N where cross-rank checks run: the payload's size depends on it)."""
    world = dist.get_world_size(group)
    if cross_checks(local):
        check_same_sizes(group, local.device, labels=header[2])
    flat = torch.cat(
        [torch.tensor(header, dtype=local.dtype, device=local.device), local.reshape(-1)]
    )
    return _all_gather(flat, group).view(world, -1)


def read_header(gathered: Tensor):
    """The gathered headers on the host: (starts, sizes, ns, derived), lists in rank order."""
    h = gathered[:, :HEADER].to(torch.int64).cpu()
    return h[:, 0].tolist(), h[:, 1].tolist(), h[:, 2].tolist(), h[:, 3].tolist()


def _rank_order(starts, sizes, derived) -> list[int] | None:
    """Where some rank derived its start: the starts of slices contiguous in rank order
    (Megatron's layout), after checking that every given start fits it; None where every rank was
    given its start."""
    if not any(derived):
        return None
    expected = [sum(sizes[:r]) for r in range(len(sizes))]
    for r, (st, ex, d) in enumerate(zip(starts, expected, derived)):
        if not d and st != ex:
            raise ValueError(
                f"vocab_start: rank {r} was given {st} but other ranks derive theirs from the "
                f"rank-order layout, where rank {r} starts at {ex} (slice sizes {sizes}); give "
                "vocab_start on every rank or on none"
            )
    return expected


# (rank, world, slice size) -> (starts, sizes) of a layout the host has validated (check_layout):
# later calls with device-side checks compare the gathered headers with it on the device
_layouts: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
DEVICE_CHECKS_ON_CPU = False  # tests: the GPU path's device-side checks on gloo


def device_checks(t: Tensor) -> bool:
    """Whether the gathered headers are checked on the device, without a host sync: on the GPU
    unless `ppo_kernels.strict_checks()` (CPU tensors are always checked on the host)."""
    return (t.device.type != "cpu" or DEVICE_CHECKS_ON_CPU) and not _backend.strict()


def check_layout(gathered: Tensor, labels: Tensor, rank: int, ignore_index: int, v_rank: int):
    """(starts, sizes, ok) of the gathered headers, in rank order. Runs inside the finish ops, so
    also under torch.compile, where it reads the headers at run time: checks that the ranks hold
    the same N, that the slices tile [0, V), and that every derived start is right (eager calls
    have settled them before, gather_settled; under compile a wrong one raises); on the CPU, the
    labels against V. ok is None then. With device_checks (the GPU), once this rank's layout has
    been validated on the host, later calls compare the gathered headers with it on the device
    instead (no host sync): ok is then a 0-dim bool tensor, and the caller gives NaN rows where it
    is false (a different layout or N), as an out-of-range label does on the GPU."""
    world = gathered.shape[0]
    N = labels.numel()
    known = _layouts.get((rank, world, v_rank)) if device_checks(gathered) else None
    if known is not None:
        starts, sizes = known
        want = torch.tensor(
            [[st, sz, N] for st, sz in zip(starts, sizes)],
            dtype=gathered.dtype,
            device=gathered.device,
        )
        return starts, sizes, (gathered[:, :3] == want).all()
    starts, sizes, ns, derived = read_header(gathered)
    _check_rows(ns, N)
    expected = _rank_order(starts, sizes, derived)
    if expected is not None and expected != starts:
        raise ValueError(
            f"vocab_start: the derived slice starts {starts} (rank order) are not the rank-order "
            f"layout {expected} of the slice sizes {sizes}. Under torch.compile a start that is "
            "not given is the one cached by an earlier eager call for this group and slice size, "
            "else rank * slice size (even shards), and cannot be settled by a second gather: "
            "give vocab_start, or make one eager call with this layout first"
        )
    V = _check_tiling(starts, sizes)
    if labels.device.type == "cpu":
        check_labels_in_range(labels, V, ignore_index)
    _layouts[(rank, world, v_rank)] = (starts, sizes)
    return starts, sizes, None


def _check_rows(ns, N):
    if any(n != N for n in ns):
        raise ValueError(
            f"labels: ranks hold different numbers of rows {ns}; every rank of the "
            "vocab-parallel group needs the same tokens"
        )


def _check_tiling(starts, sizes) -> int:
    """V, after checking that the slices tile [0, V) contiguously."""
    world = len(starts)
    order = sorted(range(world), key=lambda r: (starts[r], sizes[r]))  # an empty slice first
    pos = 0
    for r in order:
        if starts[r] != pos:
            raise ValueError(
                f"vocab_start: the ranks' vocabulary slices (start, size) = "
                f"{[(starts[i], sizes[i]) for i in range(world)]} do not tile "
                "[0, V) contiguously"
            )
        pos += sizes[r]
    return pos


def check_layout_device(layout: Tensor):
    """The finish ops' layout output lives on the CPU (whatever the logits' device)."""
    if isinstance(layout, Tensor) and layout.device.type != "cpu":
        raise device_error("layout", layout, "cpu", "the layout output of the forward")


def layout_ints(layout: Tensor) -> tuple[int, int]:
    """(this rank's start, V) of the finish ops' layout output, read by their backward ops."""
    check_layout_device(layout)
    check_tensor("layout", layout, dtypes=(torch.int64,), dim=1)
    if layout.numel() != 2:
        raise ValueError("layout: expected the forward's int64 (2,) CPU tensor (start, V)")
    start, V = layout.tolist()
    return start, V


# (id(group), rank, slice size) -> the slice start learned from a gather (see _settle_start)
_start_cache: dict[tuple[int, int, int], int] = {}
GIVEN, CACHED, GUESSED = 0, 1, 2  # how resolve_vocab_start got the start (derived: not GIVEN)


def forget_layouts():
    """Forget every start learned and layout validated so far (tests: a case that counts gathers
    or expects an error for a new layout must not depend on the cases before it)."""
    _start_cache.clear()
    _layouts.clear()


def resolve_vocab_start(vocab_start, v_rank: int, group) -> tuple[int, int]:
    """(start, how): the given first vocabulary id of this rank (checked; GIVEN), or, when not
    given, a provisional start: the one learned by an earlier call for this (group, slice size)
    (CACHED), else rank * slice size (GUESSED; right for even shards). No collective here:
    a collective only some ranks ran (those whose cache missed) would hang the others, so the
    start is settled from the forward's own gather (_settle_start)."""
    require_initialized()
    if vocab_start is None:
        rank, cached = _cached_start(group, v_rank)
        return (rank * v_rank, GUESSED) if cached is None else (cached, CACHED)
    if not (isinstance(vocab_start, int) and vocab_start >= 0):
        raise ValueError(f"vocab_start: expected a non-negative int, got {vocab_start!r}")
    return vocab_start, GIVEN


@_backend.constant_result
def _cached_start(group, v_rank: int) -> tuple[int, int | None]:
    """(this rank, the start learned for this (group, slice size) or None). A constant of a
    torch.compile graph, evaluated while tracing (torch 2.11's Dynamo cannot trace id() of a
    process group); a start learned later by an eager call does not reach that graph, whose
    finish op checks the start it used (check_layout)."""
    rank = dist.get_rank(group)
    return rank, _start_cache.get((id(group), rank, v_rank))


def _settle_start(gathered: Tensor, group) -> tuple[int, bool]:
    """Eager only, after the gather of headers [start, size, N, derived]: (this rank's start,
    redo). Where no rank was given vocab_start, slices are contiguous in rank order (Megatron's
    layout); a given start must fit that layout when other ranks derive theirs. redo: some derived
    start was wrong, so every rank recomputes its states and gathers again -- decided from the
    gathered headers alone, hence the same on every rank (at most once per new layout: the start
    is cached)."""
    starts, sizes, _, derived = read_header(gathered)
    rank = dist.get_rank(group)
    expected = _rank_order(starts, sizes, derived)
    if expected is None:
        return starts[rank], False
    if derived[rank]:
        _start_cache[(id(group), rank, sizes[rank])] = expected[rank]
    redo = any(d and st != ex for st, ex, d in zip(starts, expected, derived))
    return expected[rank], redo


def gather_settled(states, start: int, derived: int, v_rank: int, n: int, group) -> Tensor:
    """Gather states(start) with its header; when a derived start turns out wrong (_settle_start),
    every rank recomputes with the settled start and gathers once more. Under torch.compile the
    number of collectives cannot depend on the data: no settling there, the finish op checks the
    starts at run time (check_layout) and raises if a derived one was wrong."""
    gathered = gather(states(start), [start, v_rank, n, derived], group)
    if torch.compiler.is_compiling():
        return gathered
    dev = device_checks(gathered)
    if derived != GUESSED and dev:
        return gathered  # the finish op checks the start on the device (no host sync)
    settled, redo = _settle_start(gathered, group)
    if redo:
        flags = gathered[:, 3].tolist()  # host values here already (_settle_start read them)
        if dev and any(f != GUESSED for f in flags):
            # ranks with a given or cached start read nothing on the GPU and would not gather
            # again: raise here rather than leave them waiting
            raise ValueError(
                f"vocab_start: rank {dist.get_rank(group)}'s slice does not start at "
                f"{start} in this layout, and other ranks hold given or cached starts (flags "
                f"{flags}: 0 given, 1 cached, 2 guessed); on the GPU give vocab_start on every "
                "rank when a group's uneven layout changes, or use ppo_kernels.strict_checks()"
            )
        gathered = gather(states(settled), [settled, v_rank, n, derived], group)
    return gathered


def negotiate(vocab_start, v_rank: int, group, device, **same: int) -> tuple[list[int], list[int]]:
    """(starts, sizes) of every rank's slice, in rank order, from ONE all-gather of the headers
    alone, before any per-row work: for forms that need every slice's size first (the
    vocab-parallel linear_policy_loss plans row blocks common to every rank from them). The header
    is [start, size, how it was derived, *same]; `same` are sizes every rank must hold alike (rows,
    shapes, flags: a ValueError naming the first that differs, on every rank). A derived start is
    settled from the gathered sizes at no cost (nothing was computed with it) and cached as
    gather_settled caches it; the slices must tile [0, V). Reads the header on the host: one sync
    per call on the GPU."""
    start, derived = resolve_vocab_start(vocab_start, v_rank, group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor([start, v_rank, derived, *same.values()], dtype=torch.int64, device=device)
    got = _all_gather(mine, group).view(world, -1).cpu()
    starts, sizes, flags = (got[:, j].tolist() for j in range(3))
    for j, name in enumerate(same):
        col = got[:, 3 + j].tolist()
        if any(c != col[0] for c in col):
            raise ValueError(
                f"{name}: the ranks of the process group hold different values {col} (rank "
                "order); every rank of the vocab-parallel group must pass the same"
            )
    expected = _rank_order(starts, sizes, flags)
    if expected is not None:
        if derived:
            _start_cache[(id(group), rank, v_rank)] = expected[rank]
        starts = expected
    _check_tiling(starts, sizes)
    return starts, sizes
