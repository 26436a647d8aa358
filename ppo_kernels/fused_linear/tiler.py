"""The logits tiles of the fused-linear engine: each [rows, vocab_chunk] tile of hidden @ W^T + b
computed by a BLAS / cuBLAS matmul into a reused buffer, and the two gradient matmuls of a tile.

Precision (logits_dtype="auto", the default, is one of the two: "input" on a CPU with native
bf16 / fp16 matmuls, "float32" elsewhere; planner.default_logits_dtype).
logits_dtype="float32": float32 accumulation everywhere. On the CPU (and
for float32 inputs) bf16/fp16 inputs are upcast chunk by chunk and all matmuls run in float32. On
CUDA bf16/fp16 matmuls use cuBLAS with float32 output (torch.mm(..., out_dtype=float32)); the
logits-gradient tile is rounded to the input dtype for the two backward matmuls, as the
materialised path (bf16 grad_logits) does (the Triton whole-vocabulary kernel rounds as it
stores: the float32 gradient is never written).
logits_dtype="input" (bf16/fp16 only): every matmul runs in the input dtype -- the logits tile,
the gradient tile and the per-chunk products are rounded to it, exactly the roundings of the
materialised path `token_logprobs(hidden @ weight.T + bias, ...)` in bf16 -- and the reductions
still run in float32 (the fused kernels upcast as they load). Why: the CPU has no bf16 x bf16 ->
float32 matmul (torch.mm(..., out_dtype=float32) is CUDA-only), and its bf16 matmul (AVX-512 BF16 /
AMX) beats the float32 one on the upcast chunks (bench/results/cpu_head_defaults.md). Sums across
chunks stay float32 (grad_hidden across vocabulary chunks, grad_weight across row chunks,
grad_bias). On CUDA the two
gradient products are not rounded per chunk: the bf16 x bf16 -> float32 matmul adds them into the
float32 sums itself (as TRL's fused head does): the whole sum is rounded once, as the materialised
path rounds its one product, and no separate addition pass is needed.
GPU choice: chunked cuBLAS + reduction kernels, not a fused tl.dot kernel -- see the docstring of
triton_kernels.py; bench/gpu_checks/linear_logprobs.py times it. A cost to watch, not timed yet: the
backward walks rows outermost, so each row chunk reads and writes the whole float32 weight-gradient
accumulator once (beta = 1 GEMM): (N / rows) x V x H x 8 bytes. If the GPU check shows it, use
squarer tiles (rows ~ vocab chunk ~ sqrt(budget / 6)) or walk the vocabulary outermost (then the
float32 accumulator is grad_hidden [N, H] instead of grad_weight [V, H]).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import _backend
from .._math import acc_dtype
from .planner import Plan


@functools.cache
def _cpu_accumulate():
    """The compiled `ppo_kernels_C::accumulate_` (a CPU utility, not a routed kernel), or None
    without the extension (or one built before it existed); looked up once."""
    if not _backend.HAS_EXTENSION:
        return None
    op = getattr(torch.ops.ppo_kernels_C, "accumulate_", None)
    return None if op is None else op.default


def _accumulate(acc, x):
    """acc += x: an input-dtype product added into a float32 sum. On the CPU the compiled kernel
    converts x block by block as it adds (torch's `+=` writes a float32 copy of x first, a
    visible share of a bf16 policy-loss step: bench/results/cpu_linear_policy_loss_thp.md); the
    same bits either way."""
    kernel = _cpu_accumulate() if acc.device.type == "cpu" else None
    if kernel is not None:
        kernel(acc, x)
    else:
        acc += x


class Tiler:
    """Computes logits tiles (and the two gradient matmuls of a tile) for one call."""

    def __init__(
        self,
        hidden,
        weight,
        bias,
        plan: Plan,
        fused: bool,
        backward: bool = False,
        softcap: float | None = None,
        order=None,
    ):
        self.h, self.W, self.b, self.plan = hidden, weight, bias, plan
        self.order = order  # rows r0:r1 are hidden[order[r0:r1]] (None: hidden[r0:r1])
        self.cap = softcap
        self.acc = acc_dtype(hidden.dtype)
        self.input_tiles = plan.input_tiles
        # bf16/fp16 float32 tiles straight from matmuls with float32 output (cuBLAS)
        self.lowp = plan.f32_out and not plan.input_tiles
        # the most rows a chunk has (batch-invariant mode: the plan's rows may exceed the call's)
        self.max_rows = min(plan.rows, self.padded(hidden.shape[0]))
        dev, n = hidden.device, self.max_rows * plan.vocab
        # input tiles: the float32 buffer only holds copies of vocabulary-chunk tiles
        need_acc = not self.input_tiles or not (fused and plan.vocab == weight.shape[0])
        self.buf = torch.empty(n if need_acc else 0, dtype=self.acc, device=dev)
        self.buf_in = torch.empty(n if self.input_tiles else 0, dtype=hidden.dtype, device=dev)
        # input-dtype products of one chunk (g @ W, and g^T @ h block by block) before they are
        # added into the float32 accumulators (not with plan.f32_out: the matmuls add them)
        bw = backward and self.input_tiles and not plan.f32_out
        H = hidden.shape[1]
        self.gh_in = torch.empty((self.max_rows, H) if bw else (0,), dtype=hidden.dtype, device=dev)
        self.gw_in = torch.empty((plan.sub, H) if bw else (0,), dtype=hidden.dtype, device=dev)
        # lowp backward: the gradient tile rounded to the input dtype, which the two gradient
        # matmuls read (the planner counts it: 2 bytes per logit beside the float32 tile)
        self.buf_g = torch.empty(
            n if (backward and self.lowp) else 0, dtype=hidden.dtype, device=dev
        )
        # the plan keeps a whole upcast weight only when it fits in half the budget
        self.W_acc = weight.to(self.acc) if plan.whole_weight else None
        # soft-capping's derivative 1 - tanh^2 of one tile, kept for the backward (one tile more
        # than the plan's budget, only with softcap)
        self.dcap = torch.empty(n if (backward and softcap) else 0, dtype=self.acc, device=dev)
        # batch-invariant mode: each row chunk is copied into the start of this [rows, H] buffer,
        # zero-padded (Plan.pad), so that its matmuls have row counts, strides and alignment that
        # the call's other rows do not change
        hdt = self.acc if plan.upcast else hidden.dtype
        self.h_pad = torch.empty((self.max_rows, H) if plan.pad else (0,), dtype=hdt, device=dev)
        # batch-invariant mode on the CPU: the GEMMs on one thread. With two threads MKL may
        # split the inner dimension of a short matmul between them on some CPUs (the hidden
        # gradient g @ W of 32 rows), so a row's sum would depend on the row count.
        cpu_pad = plan.pad and dev.type == "cpu"
        self._gemms = _backend.invariant_threads if cpu_pad else contextlib.nullcontext

    def padded(self, n: int) -> int:
        """The rows a chunk of n rows is computed on: n, or in batch-invariant mode n rounded up
        to a multiple of the plan's `pad` (at most the plan's rows)."""
        k = self.plan.pad
        return min(self.plan.rows, -(-n // k) * k) if k else n

    def rows(self, r0, r1):
        hc = self.h[r0:r1] if self.order is None else self.h.index_select(0, self.order[r0:r1])
        if self.plan.pad:
            n = r1 - r0
            buf = self.h_pad[: self.padded(n)]
            buf[:n].copy_(hc)  # (upcast as it copies)
            buf[n:].zero_()
            return buf
        return hc.to(self.acc) if self.plan.upcast else hc

    def pad(self, t, value=0):
        """A per-row tensor of one row chunk (labels: value=ignore_index), padded as `rows` pads
        the chunk in batch-invariant mode (the padding rows are ignored); unchanged otherwise."""
        n, k = t.shape[0], self.padded(t.shape[0])
        if n == k:
            return t
        out = t.new_full((k,) + tuple(t.shape[1:]), value)
        out[:n] = t
        return out

    def _w(self, s0, s1):
        if self.W_acc is not None:
            return self.W_acc[s0:s1]
        w = self.W[s0:s1]
        return w.to(self.acc) if self.plan.upcast else w

    def logits(self, hc, v0, v1):
        """Tile [rows, v1 - v0] of the logits in a reused buffer: float32, or the input dtype with
        input tiles (matmul, then + bias, each rounded as in the input dtype); soft-capped
        (`cap * tanh(z / cap)`, in the tile's dtype as a model's head does) when softcap is set."""
        with self._gemms():
            tile = self._linear(hc, v0, v1)
        if self.cap:
            tile.div_(self.cap).tanh_().mul_(self.cap)
        return tile

    def softcap_grad(self, tile):
        """Before the tile is overwritten by its gradient: keep d cap*tanh(z/cap) / dz =
        1 - (tile / cap)^2; `apply_softcap_grad` multiplies the gradient tile by it."""
        if not self.cap:
            return
        d = self.dcap[: tile.numel()].view(tile.shape)
        d.copy_(tile).div_(self.cap).square_().neg_().add_(1.0)

    def apply_softcap_grad(self, g):
        if self.cap:
            g.mul_(self.dcap[: g.numel()].view(g.shape))
        return g

    def grad_tile(self, tile, rounds_on_store: bool):
        """Where a whole-vocabulary tile's gradient is written: straight into the input-dtype
        buffer of the lowp backward when the kernel rounds as it stores (Triton) and no
        soft-capping derivative must multiply it in float32 first -- one pass over the tile
        instead of a float32 write and a separate rounding pass; else the tile itself."""
        if rounds_on_store and self.buf_g.numel() and not self.cap:
            return self.buf_g[: tile.numel()].view(tile.shape)
        return tile

    # bf16/fp16 x bf16/fp16 -> float32 matmuls (cuBLAS; torch has them on CUDA only). Static
    # methods: the CPU tests swap in an emulation to run the lowp path there.
    @staticmethod
    def mm_f32(a, b, out):
        torch.mm(a, b, out_dtype=torch.float32, out=out)

    @staticmethod
    def addmm_f32(c, a, b):
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)

    def _linear(self, hc, v0, v1):
        R = hc.shape[0]
        if self.input_tiles:
            tile = self.buf_in[: R * (v1 - v0)].view(R, v1 - v0)
            torch.mm(hc, self.W[v0:v1].T, out=tile)
            if self.b is not None:
                tile += self.b[v0:v1]
            return tile
        tile = self.buf[: R * (v1 - v0)].view(R, v1 - v0)
        if self.lowp:
            self.mm_f32(hc, self.W[v0:v1].T, tile)
            if self.b is not None:
                tile += self.b[v0:v1].to(self.acc)
            return tile
        step = max(1, self.plan.sub if self.plan.upcast else v1 - v0)  # (an empty slice)
        for s0 in range(v0, v1, step):
            s1 = min(v1, s0 + step)
            out = tile[:, s0 - v0 : s1 - v0]
            if self.b is not None:
                torch.addmm(self.b[s0:s1].to(self.acc), hc, self._w(s0, s1).T, out=out)
            else:
                torch.mm(hc, self._w(s0, s1).T, out=out)
        return tile

    def logits_acc(self, hc, v0, v1):
        """The tile in the accumulation dtype, for the per-chunk kernels (a float32 copy of the
        input-dtype tile with input tiles)."""
        tile = self.logits(hc, v0, v1)
        if not self.input_tiles:
            return tile
        return self.buf[: tile.numel()].view(tile.shape).copy_(tile)

    def to_input(self, g):
        """The gradient tile as the matmuls take it: rounded to the input dtype with input tiles
        (into the input-dtype buffer, as the materialised path's bf16 grad_logits)."""
        if not self.input_tiles or g.dtype == self.h.dtype:
            return g
        return self.buf_in[: g.numel()].view(g.shape).copy_(g)

    def grad_matmuls(self, g, hc, v0, v1, gh, gW, gb):
        """gh += g @ W[v0:v1]; gW[v0:v1] += g^T @ hc; gb[v0:v1] += sum(g) (float32 accumulators;
        empty ones are skipped)."""
        with self._gemms():
            self._grad_matmuls(g, hc, v0, v1, gh, gW, gb)

    def _grad_matmuls(self, g, hc, v0, v1, gh, gW, gb):
        if gb.numel():
            gb[v0:v1] += g.sum(0, dtype=gb.dtype)
        if self.plan.f32_out:
            # the products accumulated into the float32 sums by the matmul itself (as TRL's fused
            # head does): one rounding of the whole sum, no separate addition pass. The float32
            # tiles' gradient is rounded to the input dtype first, unless a kernel stored it so;
            # input tiles' gradient already is.
            gc = g if g.dtype == hc.dtype else self.buf_g[: g.numel()].view(g.shape).copy_(g)
            if gh.numel():
                self.addmm_f32(gh, gc, self.W[v0:v1])
            if gW.numel():
                self.addmm_f32(gW[v0:v1], gc.T, hc)
            return
        if self.input_tiles:
            if gh.numel():
                _accumulate(gh, torch.mm(g, self.W[v0:v1], out=self.gh_in[: g.shape[0]]))
            if gW.numel():
                for s0 in range(v0, v1, self.plan.sub):
                    s1 = min(v1, s0 + self.plan.sub)
                    gw = torch.mm(g[:, s0 - v0 : s1 - v0].T, hc, out=self.gw_in[: s1 - s0])
                    _accumulate(gW[s0:s1], gw)
            return
        step = max(1, self.plan.sub if self.plan.upcast else v1 - v0)  # (an empty slice)
        for s0 in range(v0, v1, step):
            s1 = min(v1, s0 + step)
            gs = g[:, s0 - v0 : s1 - v0]
            if gh.numel():
                gh.addmm_(gs, self._w(s0, s1))
            if gW.numel():
                gW[s0:s1].addmm_(gs.T, hc)
