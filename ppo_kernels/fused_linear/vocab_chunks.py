"""Tiles of vocabulary chunks: the engine's reduction when a row of V logits does not fit the
memory budget (or no fused whole-vocabulary kernel runs: the eager backend, float64). Each
[rows, vocab_chunk] tile of the logits is reduced by per-chunk kernels that merge the softmax
stats (m, s, u) of csrc/common/softmax_stats.h across chunks (C++: csrc/cpu/linear_logprobs.cpp,
Triton: linear_logprobs/triton_kernels.py, eager: linear_logprobs/naive.py), then one elementwise
finish. The gradient recomputes each chunk's tile, turns it into d(out)/d(logits) in place (the
gradient is elementwise once lse and entropy are known) and multiplies it into the gradients
chunk by chunk. A vocab-parallel shard is a slice [v_offset, v_offset + V) of the vocabulary.
"""

from __future__ import annotations

import torch

from .. import _backend
from ..linear_logprobs import naive

# Per-tile kernels of vocabulary-chunk tiles (contract: naive.tile_stats_ / tile_bwd_), one
# implementation per backend with one signature. There is no CUDA C++ tile kernel: on CUDA the
# cpp backend hands these tiles to Triton (or, without triton, to the eager tile math) and says so
# in the op's `delegates` (python -m ppo_kernels info) and once per process as a warning.
tile_stats_ = _backend.Kernel("linear_token_logprobs", "tile_stats_")
tile_bwd_ = _backend.Kernel("linear_token_logprobs", "tile_bwd_")
_TILE_KERNEL = "linear_logprobs_tile_stats_"


def _tile_delegate(device_type):
    """The backend that runs vocabulary-chunk tiles when the cpp backend has no compiled tile
    kernel for this device."""
    to = "triton" if device_type == "cuda" and _backend.HAS_TRITON else "eager"
    _backend.note_delegation(
        "linear_token_logprobs",
        "cpp",
        device_type,
        f"vocabulary-chunk tiles run on the {to} tile kernels",
    )
    return to


@tile_stats_.impl("cpp")
def _(tile, labels, v_start, inv_t, ignore_index, state, zlabel):
    if not _backend.has_compiled_kernel(_TILE_KERNEL, tile.device.type):
        return tile_stats_.impls[_tile_delegate(tile.device.type)](
            tile, labels, v_start, inv_t, ignore_index, state, zlabel
        )
    _backend.cpp_ops().linear_logprobs_tile_stats_(
        tile, labels, v_start, inv_t, ignore_index, state, zlabel
    )


@tile_stats_.impl("triton")
def _(tile, labels, v_start, inv_t, ignore_index, state, zlabel):
    from ..linear_logprobs import triton_kernels

    triton_kernels.tile_stats_(tile, labels, v_start, inv_t, ignore_index, state, zlabel)


@tile_stats_.impl("eager")
def _(tile, labels, v_start, inv_t, ignore_index, state, zlabel):
    with _backend.invariant_threads():
        naive.tile_stats_(tile, labels, v_start, inv_t, ignore_index, state, zlabel)


@tile_bwd_.impl("cpp")
def _(tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V):
    if not _backend.has_compiled_kernel(_TILE_KERNEL, tile.device.type):
        return tile_bwd_.impls[_tile_delegate(tile.device.type)](
            tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V
        )
    _backend.cpp_ops().linear_logprobs_tile_bwd_(
        tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index
    )


@tile_bwd_.impl("triton")
def _(tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V):
    from ..linear_logprobs import triton_kernels

    triton_kernels.tile_bwd_(
        tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V
    )


@tile_bwd_.impl("eager")
def _(tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V):
    with _backend.invariant_threads():
        naive.tile_bwd_(
            tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V
        )


def _row_scaled(tile, inv_ts):
    """The tile times each row's 1 / T (per-row temperatures, [rows] or None), in place."""
    return tile if inv_ts is None else tile.mul_(inv_ts.unsqueeze(-1))


def chunk_states(
    tiler, plan, hc, lc, V, inv_t, ignore_index, v_offset=0, backend=None, inv_ts=None
):
    """Softmax state (m, s, u) [3, rows] and label logit [rows] (NaN where the label is not in
    this weight's vocabulary) of one row chunk over the weight's V entries, whose ids start at
    v_offset (a vocab-parallel shard: ppo_kernels/distributed/vocab_parallel_linear.py). backend: the
    tile kernels' (None: resolved per tile). inv_ts: each row's 1 / T [rows] (per-row
    temperatures, replacing inv_t: the tile is scaled, the kernels run at temperature 1)."""
    stats = tile_stats_ if backend is None else tile_stats_.impls[backend]
    acc, dev = tiler.acc, hc.device
    state = torch.zeros(3, hc.shape[0], dtype=acc, device=dev)
    state[0] = float("-inf")
    zl = torch.full((hc.shape[0],), float("nan"), dtype=acc, device=dev)
    inv_t = inv_t if inv_ts is None else 1.0
    for v0 in range(0, V, plan.vocab):
        v1 = min(V, v0 + plan.vocab)
        tile = _row_scaled(tiler.logits_acc(hc, v0, v1), inv_ts)
        stats(tile, lc, v_offset + v0, inv_t, ignore_index, state, zl)
    return state, zl


def chunk_backward(
    tiler,
    plan,
    hc,
    lc,
    glp,
    gent,
    lse,
    entropy,
    inv_t,
    ignore_index,
    V,
    gh,
    gW,
    gb,
    v_offset=0,
    v_total=None,
    backend=None,
    inv_ts=None,
):
    """Gradients of one row chunk by vocabulary chunks: gh += dL/dh (float32), gW[0:V] += dL/dW,
    gb += dL/db, over the weight's V entries whose ids start at v_offset in a vocabulary of
    v_total (default V). backend: the tile kernels' (None: resolved per tile). inv_ts: each
    row's 1 / T [rows] (per-row temperatures, replacing inv_t; no softcap)."""
    v_total = V if v_total is None else v_total
    tile_bwd = tile_bwd_ if backend is None else tile_bwd_.impls[backend]
    inv_t = inv_t if inv_ts is None else 1.0
    for v0 in range(0, V, plan.vocab):
        v1 = min(V, v0 + plan.vocab)
        g = tiler.logits_acc(hc, v0, v1)
        tiler.softcap_grad(g)
        g = _row_scaled(g, inv_ts)
        tile_bwd(g, lc, v_offset + v0, lse, entropy, glp, gent, inv_t, ignore_index, v_total)
        g = tiler.to_input(tiler.apply_softcap_grad(_row_scaled(g, inv_ts)))
        tiler.grad_matmuls(g, hc, v0, v1, gh, gW, gb)


class VocabChunks:
    """The engine's reduction of a row block by tiles of vocabulary chunks (the plan's vocab < V,
    or no fused whole-vocabulary kernel: the eager backend, float64): the per-chunk kernels merge
    the softmax states across chunks, then one elementwise finish; the gradient chunk by chunk.
    v_offset / v_total: the weight is the slice [v_offset, v_offset + V) of a vocabulary of
    v_total entries (a vocab-parallel shard)."""

    tiler_fused = False
    rows = None

    def __init__(
        self, plan, backend, temperature, ignore_index, v_offset=0, v_total=None, partial=False,
        inv_ts=None,
    ):  # fmt: skip
        self.plan, self.backend = plan, backend
        self.inv_t, self.ii = 1.0 / temperature, ignore_index
        self.v_offset, self.v_total, self.partial = v_offset, v_total, partial
        self.inv_ts = inv_ts  # each row's 1 / T [N] (per-row temperatures), or None
        self.blk_inv_ts = None

    def at_block(self, r0, r1, pad):
        """The engine's hook before each block: the block's per-row 1 / T, padded as its tile."""
        if self.inv_ts is not None:
            self.blk_inv_ts = pad(self.inv_ts[r0:r1], 1.0)

    def block_stats(self, tiler, hc, rtiler, r0, r1, lc, with_entropy):
        V = tiler.W.shape[0]
        state, zl = chunk_states(
            tiler, self.plan, hc, lc, V, self.inv_t, self.ii, self.v_offset, self.backend,
            self.blk_inv_ts,
        )  # fmt: skip
        return (*naive.finalize(state, zl, lc, V, self.ii), None)

    def block_grad(self, tiler, hc, lc, coefs, st, gk_buf, ghc, gW, gb):
        glp, gent, _ = coefs
        _, ent, lse, _ = st
        chunk_backward(
            tiler, self.plan, hc, lc, glp, gent, lse, ent, self.inv_t, self.ii,
            tiler.W.shape[0], ghc, gW, gb, self.v_offset, self.v_total, self.backend,
            self.blk_inv_ts,
        )  # fmt: skip
