"""The chunk loop of linear_token_logprobs: token log-probs (and entropy) of
`hidden @ weight.T + bias` and their gradients without ever building the [N, V] logits. The
registered ops (csrc/ops/linear_logprobs.cpp; their Python side is op.py) run `forward` /
`backward` below on every backend; the vocab-parallel form (ppo_kernels/distributed/
vocab_parallel.py) runs `chunk_states` / `chunk_backward` on its vocabulary slice.

How: the rows (tokens) are walked in chunks, and when a chunk of rows times the whole vocabulary
does not fit the memory budget, the vocabulary is walked in chunks too. Each [rows, vocab_chunk]
tile of the logits is computed by a BLAS / cuBLAS matmul into a reused float32 buffer and reduced
right away:
  * whole vocabulary in one tile, `cpp` and `triton` backends: that backend's fused
    token_logprobs kernels (ppo_kernels/token_logprobs) reduce the tile;
  * vocabulary chunks (or the eager backend): per-chunk kernels merge the softmax stats
    (m, s, u) of csrc/common/softmax_stats.h across chunks (C++: csrc/cpu/linear_logprobs.cpp,
    Triton: triton_kernels.py, eager: naive.py), then one elementwise finish.
The backward recomputes each tile, turns it into d(out)/d(logits) in place (the gradient is
elementwise once lse and entropy are known), and accumulates grad_hidden += g @ W_chunk,
grad_weight[chunk] += g^T @ h_chunk (float32), grad_bias[chunk] += sum(g).

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
AMX) is ~2x faster than the float32 one on the upcast chunks. Sums across chunks stay float32
(grad_hidden across vocabulary chunks, grad_weight across row chunks, grad_bias). On CUDA the two
gradient products are not rounded per chunk: the bf16 x bf16 -> float32 matmul adds them into the
float32 sums itself (as TRL's fused head does): the whole sum is rounded once, as the materialised
path rounds its one product, and no separate addition pass is needed.
GPU choice: chunked cuBLAS + reduction kernels, not a fused tl.dot kernel -- see the docstring of
triton_kernels.py; bench/gpu_checks/linear_logprobs.py measures it. Unmeasured cost to watch: the
backward walks rows outermost, so each row chunk reads and writes the whole float32 weight-gradient
accumulator once (beta = 1 GEMM): (N / rows) x V x H x 8 bytes. If the GPU check shows it, use
squarer tiles (rows ~ vocab chunk ~ sqrt(budget / 6)) or walk the vocabulary outermost (then the
float32 accumulator is grad_hidden [N, H] instead of grad_weight [V, H]).
"""

from __future__ import annotations

import torch

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_devices,
    check_int,
    check_labels_in_range,
    check_temperature,
    check_tensor,
)
from ..linear_logprobs import naive
from .planner import Plan, _acc, _check_logits_dtype, plan_call
from .tiler import Tiler

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


def fused_backend(hidden, backend: str) -> str | None:
    """The backend ("cpp" or "triton") whose token_logprobs kernels reduce whole-vocabulary tiles
    in one pass each when the op runs on `backend`, or None: the per-chunk tile kernels do (eager,
    float64)."""
    if hidden.dtype == torch.float64:
        return None
    if backend == "triton":
        return backend
    if backend == "cpp" and _backend.has_compiled_kernel("token_logprobs_fwd", hidden.device.type):
        return backend
    return None


def check_args(
    hidden,
    weight,
    labels,
    bias,
    temperature,
    ignore_index,
    max_chunk_bytes,
    logits_dtype,
    vocab_slice=False,
):
    """What the chunk loop is given, in Python (metadata only; label range on the CPU): the
    registered ops check it in C++ (csrc/ops/linear_logprobs.cpp); this serves their fallback
    without the extension and the vocab-parallel form. hidden [N, H], weight [V, H], labels [N],
    bias [V] or None. vocab_slice: weight is one rank's slice of a vocab-parallel head
    (ppo_kernels/distributed/vocab_parallel.py), which may be empty, and labels are global ids
    (checked against the whole vocabulary there)."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, dim=2)
    N, H = hidden.shape
    dev = hidden.device
    check_arg("weight", weight, dev, like="hidden", dtypes=(hidden.dtype,))
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(
            f"weight: expected shape (V, {H}) (H = hidden.shape[-1]), got {tuple(weight.shape)}"
        )
    V = weight.shape[0]
    check_arg(
        "labels",
        labels,
        dev,
        like="hidden",
        dtypes=INDEX_DTYPES,
        shape=(N,),
        what="hidden.shape[:-1]",
    )
    check_arg(
        "bias",
        bias,
        dev,
        like="hidden",
        dtypes=(hidden.dtype,),
        shape=(V,),
        what="weight.shape[0]",
        allow_none=True,
    )
    if V == 0 and N > 0 and not vocab_slice:
        raise ValueError("weight: the vocabulary dimension (first) is empty")
    check_temperature(temperature)
    check_int("ignore_index", ignore_index)
    check_int("max_chunk_bytes", max_chunk_bytes, min_value=0)
    _check_logits_dtype(logits_dtype)
    if (dev.type == "cpu" or _backend.strict()) and not vocab_slice:
        check_labels_in_range(labels, V, ignore_index)


def check_backward_args(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight,
    labels,
    bias,
    lse,
    entropy,
    temperature,
    ignore_index,
    max_chunk_bytes,
    logits_dtype,
):
    check_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    rows, dev, acc = labels.shape, hidden.device, (_acc(hidden.dtype),)
    check_devices("hidden", hidden, grad_entropy=grad_entropy, entropy=entropy)
    check_arg(
        "grad_logprobs",
        grad_logprobs,
        dev,
        like="hidden",
        dtypes=FLOAT_DTYPES,
        shape=rows,
        what="hidden.shape[:-1]",
    )
    check_arg("lse", lse, dev, like="hidden", dtypes=acc, shape=rows, what="hidden.shape[:-1]")
    if grad_entropy is not None and grad_entropy.numel() > 0:
        check_arg(
            "grad_entropy",
            grad_entropy,
            dev,
            like="hidden",
            dtypes=FLOAT_DTYPES,
            shape=rows,
            what="hidden.shape[:-1]",
        )
        check_arg(
            "entropy", entropy, dev, like="hidden", dtypes=acc, shape=rows, what="hidden.shape[:-1]"
        )


def plan_for(hidden, V, max_chunk_bytes, logits_dtype, fused) -> Plan:
    """The chunks of hidden [N, H] against V vocabulary rows (planner.plan_chunks) within
    max_chunk_bytes (0: the device's default); in batch-invariant mode planner.plan_invariant."""
    N, H = hidden.shape
    return plan_call(N, V, H, hidden.dtype, hidden.device, max_chunk_bytes, logits_dtype, fused)


def chunk_states(tiler, plan, hc, lc, V, inv_t, ignore_index, v_offset=0, backend=None):
    """Softmax state (m, s, u) [3, rows] and label logit [rows] (NaN where the label is not in
    this weight's vocabulary) of one row chunk over the weight's V entries, whose ids start at
    v_offset (a vocab-parallel shard: ppo_kernels/distributed/vocab_parallel.py). backend: the
    tile kernels' (None: resolved per tile)."""
    stats = tile_stats_ if backend is None else tile_stats_.impls[backend]
    acc, dev = tiler.acc, hc.device
    state = torch.zeros(3, hc.shape[0], dtype=acc, device=dev)
    state[0] = float("-inf")
    zl = torch.full((hc.shape[0],), float("nan"), dtype=acc, device=dev)
    for v0 in range(0, V, plan.vocab):
        v1 = min(V, v0 + plan.vocab)
        stats(tiler.logits_acc(hc, v0, v1), lc, v_offset + v0, inv_t, ignore_index, state, zl)
    return state, zl


def chunk_backward(
    tiler,
    plan,
    fused,
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
    tl_backward=None,
):
    """Gradients of one row chunk: gh += dL/dh (float32), gW[0:V] += dL/dW, gb += dL/db, over
    the weight's V entries whose ids start at v_offset in a vocabulary of v_total (default V).
    backend: the tile kernels' (None: resolved per tile); tl_backward: token_logprobs' backward
    kernel (a `_backend.Kernel`), which reduces whole-vocabulary tiles when `fused`."""
    v_total = V if v_total is None else v_total
    tile_bwd = tile_bwd_ if backend is None else tile_bwd_.impls[backend]
    for v0 in range(0, V, plan.vocab):
        v1 = min(V, v0 + plan.vocab)
        if plan.vocab == V and fused and v_total == V:
            z = tiler.logits(hc, v0, v1)
            tiler.softcap_grad(z)
            # in place, or (Triton, lowp) rounded to the input dtype as it is stored
            g = tiler.grad_tile(z, rounds_on_store=fused == "triton")
            ent = entropy if gent is not None else lse
            tl_backward.impls[fused](z, glp, gent, lc, lse, ent, inv_t, ignore_index, g)
            tiler.apply_softcap_grad(g)
        else:
            g = tiler.logits_acc(hc, v0, v1)
            tiler.softcap_grad(g)
            tile_bwd(g, lc, v_offset + v0, lse, entropy, glp, gent, inv_t, ignore_index, v_total)
            g = tiler.to_input(tiler.apply_softcap_grad(g))
        tiler.grad_matmuls(g, hc, v0, v1, gh, gW, gb)


def forward(
    hidden,
    weight,
    labels,
    bias,
    temperature,
    ignore_index,
    with_entropy,
    max_chunk_bytes,
    logits_dtype,
    softcap,
    backend,
    tl_forward,
):
    """The registered op `linear_token_logprobs` on `backend` (arguments checked): (logprobs,
    entropy or an empty tensor, lse) [N], float32 (float64 for float64 input). tl_forward:
    token_logprobs' forward kernel (a `_backend.Kernel`), which reduces whole-vocabulary tiles
    (handed down by the registered op: a kernel module does not import an op)."""
    N, H = hidden.shape
    V = weight.shape[0]
    acc = _acc(hidden.dtype)
    dev = hidden.device
    lp = _backend.new_output((N,), acc, dev)
    ent = _backend.new_output((N,) if with_entropy else (0,), acc, dev)
    lse = _backend.new_output((N,), acc, dev)
    if N == 0:
        return lp, ent, lse
    fused = fused_backend(hidden, backend)
    plan = plan_for(hidden, V, max_chunk_bytes, logits_dtype, fused)
    tiler = Tiler(hidden, weight, bias, plan, fused, softcap=softcap)
    inv_t = 1.0 / temperature
    for r0 in range(0, N, plan.rows):
        r1 = min(N, r0 + plan.rows)
        hc, lc = tiler.rows(r0, r1), tiler.pad(labels[r0:r1], ignore_index)
        if plan.vocab == V and fused:
            tile = tiler.logits(hc, 0, V)
            a, e, s = tl_forward.impls[fused](tile, lc, inv_t, ignore_index, with_entropy)
        else:
            state, zl = chunk_states(tiler, plan, hc, lc, V, inv_t, ignore_index, backend=backend)
            a, e, s = naive.finalize(state, zl, lc, V, ignore_index)
        lp[r0:r1] = a[: r1 - r0]  # (padded rows in batch-invariant mode)
        lse[r0:r1] = s[: r1 - r0]
        if with_entropy:
            ent[r0:r1] = e[: r1 - r0]
    return lp, ent, lse


def backward(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight,
    labels,
    bias,
    lse,
    entropy,
    temperature,
    ignore_index,
    max_chunk_bytes,
    need_hidden,
    need_weight,
    need_bias,
    logits_dtype,
    softcap,
    backend,
    tl_backward,
):
    """The registered op `linear_token_logprobs_backward` on `backend` (arguments checked):
    (grad_hidden in hidden's dtype, grad_weight float32, grad_bias float32), an empty tensor
    where not needed. tl_backward: token_logprobs' backward kernel (see `forward`)."""
    N, H = hidden.shape
    V = weight.shape[0]
    acc = _acc(hidden.dtype)
    dev = hidden.device
    need_bias = need_bias and bias is not None
    gh_out = _backend.new_output((N, H) if need_hidden else (0,), hidden.dtype, dev)
    gW = torch.zeros((V, H) if need_weight else (0,), dtype=acc, device=dev)
    gb = torch.zeros((V,) if need_bias else (0,), dtype=acc, device=dev)
    if N == 0:
        return gh_out.zero_(), gW, gb
    fused = fused_backend(hidden, backend)
    plan = plan_for(hidden, V, max_chunk_bytes, logits_dtype, fused)
    tiler = Tiler(hidden, weight, bias, plan, fused, backward=True, softcap=softcap)
    inv_t = 1.0 / temperature
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    glp_all = grad_logprobs.to(acc)
    gent_all = grad_entropy.to(acc) if with_ent else None
    gh = torch.empty((tiler.max_rows, H) if need_hidden else (0,), dtype=acc, device=dev)
    for r0 in range(0, N, plan.rows):
        r1 = min(N, r0 + plan.rows)
        hc, lc = tiler.rows(r0, r1), tiler.pad(labels[r0:r1], ignore_index)
        glp, ls = tiler.pad(glp_all[r0:r1]), tiler.pad(lse[r0:r1])
        gent = tiler.pad(gent_all[r0:r1]) if with_ent else None
        en = tiler.pad(entropy[r0:r1]) if with_ent else None
        ghc = gh[: hc.shape[0]].zero_() if need_hidden else gh
        chunk_backward(
            tiler, plan, fused, hc, lc, glp, gent, ls, en, inv_t, ignore_index, V, ghc, gW, gb,
            backend=backend, tl_backward=tl_backward,
        )  # fmt: skip
        if need_hidden:
            gh_out[r0:r1] = ghc[: r1 - r0]
    return gh_out, gW, gb
