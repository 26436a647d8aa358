"""linear_token_logprobs: token log-probs (and entropy) of `hidden @ weight.T + bias` without ever
building the [N, V] logits. Torch ops `ppo_kernels::linear_token_logprobs` (forward) and
`ppo_kernels::linear_token_logprobs_backward`, with fake kernels and registered autograd.

How: the rows (tokens) are walked in chunks, and when a chunk of rows times the whole vocabulary
does not fit the memory budget, the vocabulary is walked in chunks too. Each [rows, vocab_chunk]
tile of the logits is computed by a BLAS / cuBLAS matmul into a reused float32 buffer and reduced
right away:
  * whole vocabulary in one tile, `cpp` and `triton` backends: that backend's fused
    token_logprobs kernels (ppo_kernels/token_logprobs) reduce the tile;
  * vocabulary chunks (or the eager backend): per-chunk kernels merge the softmax stats
    (m, s, u) of csrc/common/softmax_stats.h across chunks (C++: csrc/cpu/linear_logprobs.cpp,
    Triton: triton_kernels.py, eager: reference.py), then one elementwise finish.
The backward recomputes each tile, turns it into d(out)/d(logits) in place (the gradient is
elementwise once lse and entropy are known), and accumulates grad_hidden += g @ W_chunk,
grad_weight[chunk] += g^T @ h_chunk (float32), grad_bias[chunk] += sum(g).

Precision (logits_dtype="float32", the default): float32 accumulation everywhere. On the CPU (and
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
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_bool,
    check_float,
    check_int,
    check_labels_in_range,
    check_same_device,
    check_temperature,
    check_tensor,
)
from ..token_logprobs import op as tl_op
from . import reference
from .planner import (  # noqa: F401
    DEFAULT_MAX_CHUNK_BYTES,
    LOGITS_DTYPES,
    Plan,
    _acc,
    _check_logits_dtype,
    _input_tiles,
    _resolve_budget,
    plan_call,
    plan_chunks,
)
from .tiler import Tiler

# "cpp" = the compiled token_logprobs kernels reduce whole-vocabulary tiles (CPU and CUDA); tiles of
# vocabulary chunks go to csrc/cpu/linear_logprobs.cpp on the CPU and to the Triton kernels on CUDA
# (there is no CUDA C++ version of those). "triton" = the Triton token_logprobs kernels reduce
# whole-vocabulary tiles. Default on CUDA: triton, from the H200 measurements
# (bench/results/gpu_2026-11-30_H200.md): the Triton token_logprobs kernels reach 79-83% of the
# bandwidth, the CUDA C++ ones 44-60%, and only the Triton backward writes the bf16 gradient tile
# the backward matmuls read without a float32 round trip.
OP = _backend.register_op(
    "linear_token_logprobs",
    kernel="token_logprobs_fwd",
    triton=True,
    cuda_default="triton",
    public=("linear_token_logprobs", "causal_lm_logprobs"),
    folder="linear_logprobs",
    delegates={
        ("cpp", "cpu"): "BLAS matmuls (torch.mm) + C++ tile kernels",
        ("cpp", "cuda"): "cuBLAS matmuls (torch.mm); whole-vocabulary tiles: token_logprobs CUDA "
        "kernels; vocabulary-chunk tiles: Triton (eager without triton)",
        ("triton", "cuda"): "cuBLAS matmuls (torch.mm); whole-vocabulary tiles: token_logprobs "
        "Triton kernels; vocabulary-chunk tiles: Triton tile kernels",
        ("eager", "cpu"): "BLAS matmuls (torch.mm) + eager tile math",
        ("eager", "cuda"): "cuBLAS matmuls (torch.mm) + eager tile math",
    },
)


# Per-tile kernels of vocabulary-chunk tiles (contract: reference.tile_stats_ / tile_bwd_), one
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
    from . import triton_kernels

    triton_kernels.tile_stats_(tile, labels, v_start, inv_t, ignore_index, state, zlabel)


@tile_stats_.impl("eager")
def _(tile, labels, v_start, inv_t, ignore_index, state, zlabel):
    with _backend.invariant_threads():
        reference.tile_stats_(tile, labels, v_start, inv_t, ignore_index, state, zlabel)


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
    from . import triton_kernels

    triton_kernels.tile_bwd_(
        tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V
    )


@tile_bwd_.impl("eager")
def _(tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V):
    with _backend.invariant_threads():
        reference.tile_bwd_(
            tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V
        )


def _fused(hidden) -> str | None:
    """The backend ("cpp" or "triton") whose token_logprobs kernels reduce whole-vocabulary tiles
    in one pass each, or None: the per-chunk tile kernels do (eager, float64)."""
    if hidden.dtype == torch.float64:
        return None
    backend = tile_stats_.backend(hidden)
    if backend == "triton":
        return backend
    if backend == "cpp" and _backend.has_compiled_kernel("token_logprobs_fwd", hidden.device.type):
        return backend
    return None


def _check_forward_args(
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
    """What the registered ops are given, whoever calls them (metadata only; label range on the
    CPU): hidden [N, H], weight [V, H], labels [N], bias [V] or None. vocab_slice: weight is one
    rank's slice of a vocab-parallel head (ppo_kernels/distributed/vocab_parallel.py), which may
    be empty, and labels are global ids (checked against the whole vocabulary there)."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, dim=2)
    N, H = hidden.shape
    dev = hidden.device
    check_arg("weight", weight, dev, dtypes=(hidden.dtype,))
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(
            f"weight: expected shape (V, {H}) (H = hidden.shape[-1]), got {tuple(weight.shape)}"
        )
    V = weight.shape[0]
    check_arg("labels", labels, dev, dtypes=INDEX_DTYPES, shape=(N,), what="hidden.shape[:-1]")
    check_arg(
        "bias",
        bias,
        dev,
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


def _check_backward_args(
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
    _check_forward_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    rows, dev, acc = labels.shape, hidden.device, (_acc(hidden.dtype),)
    check_arg(
        "grad_logprobs",
        grad_logprobs,
        dev,
        dtypes=FLOAT_DTYPES,
        shape=rows,
        what="hidden.shape[:-1]",
    )
    check_arg("lse", lse, dev, dtypes=acc, shape=rows, what="hidden.shape[:-1]")
    if grad_entropy is not None and grad_entropy.numel() > 0:
        check_arg(
            "grad_entropy",
            grad_entropy,
            dev,
            dtypes=FLOAT_DTYPES,
            shape=rows,
            what="hidden.shape[:-1]",
        )
        check_arg("entropy", entropy, dev, dtypes=acc, shape=rows, what="hidden.shape[:-1]")


def chunk_states(tiler, plan, hc, lc, V, inv_t, ignore_index, v_offset=0):
    """Softmax state (m, s, u) [3, rows] and label logit [rows] (NaN where the label is not in
    this weight's vocabulary) of one row chunk over the weight's V entries, whose ids start at
    v_offset (a vocab-parallel shard: ppo_kernels/distributed/vocab_parallel.py)."""
    acc, dev = tiler.acc, hc.device
    state = torch.zeros(3, hc.shape[0], dtype=acc, device=dev)
    state[0] = float("-inf")
    zl = torch.full((hc.shape[0],), float("nan"), dtype=acc, device=dev)
    for v0 in range(0, V, plan.vocab):
        v1 = min(V, v0 + plan.vocab)
        tile_stats_(tiler.logits_acc(hc, v0, v1), lc, v_offset + v0, inv_t, ignore_index, state, zl)
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
):
    """Gradients of one row chunk: gh += dL/dh (float32), gW[0:V] += dL/dW, gb += dL/db, over
    the weight's V entries whose ids start at v_offset in a vocabulary of v_total (default V)."""
    v_total = V if v_total is None else v_total
    for v0 in range(0, V, plan.vocab):
        v1 = min(V, v0 + plan.vocab)
        if plan.vocab == V and fused and v_total == V:
            z = tiler.logits(hc, v0, v1)
            tiler.softcap_grad(z)
            # in place, or (Triton, lowp) rounded to the input dtype as it is stored
            g = tiler.grad_tile(z, rounds_on_store=fused == "triton")
            ent = entropy if gent is not None else lse
            tl_op.backward.impls[fused](z, glp, gent, lc, lse, ent, inv_t, ignore_index, g)
            tiler.apply_softcap_grad(g)
        else:
            g = tiler.logits_acc(hc, v0, v1)
            tiler.softcap_grad(g)
            tile_bwd_(g, lc, v_offset + v0, lse, entropy, glp, gent, inv_t, ignore_index, v_total)
            g = tiler.to_input(tiler.apply_softcap_grad(g))
        tiler.grad_matmuls(g, hc, v0, v1, gh, gW, gb)


@torch.library.custom_op("ppo_kernels::linear_token_logprobs", mutates_args=())
def linear_token_logprobs_op(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    max_chunk_bytes: int,
    logits_dtype: str = "float32",
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], labels [N], bias [V] or None. Returns (logprobs, entropy or an
    empty tensor, lse), float32 (float64 for float64 input); lse is saved for backward.
    logits_dtype: "float32" or "input" (see linear_token_logprobs)."""
    _check_forward_args(
        hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes, logits_dtype
    )
    N, H = hidden.shape
    V = weight.shape[0]
    acc = _acc(hidden.dtype)
    dev = hidden.device
    lp = _backend.new_output((N,), acc, dev)
    ent = _backend.new_output((N,) if with_entropy else (0,), acc, dev)
    lse = _backend.new_output((N,), acc, dev)
    if N == 0:
        return lp, ent, lse
    fused = _fused(hidden)
    plan = plan_call(N, V, H, hidden.dtype, dev, max_chunk_bytes, logits_dtype, fused)
    tiler = Tiler(hidden, weight, bias, plan, fused, softcap=softcap)
    inv_t = 1.0 / temperature
    for r0 in range(0, N, plan.rows):
        r1 = min(N, r0 + plan.rows)
        hc, lc = tiler.rows(r0, r1), tiler.pad(labels[r0:r1], ignore_index)
        if plan.vocab == V and fused:
            tile = tiler.logits(hc, 0, V)
            a, e, s = tl_op.forward.impls[fused](tile, lc, inv_t, ignore_index, with_entropy)
        else:
            state, zl = chunk_states(tiler, plan, hc, lc, V, inv_t, ignore_index)
            a, e, s = reference.finalize(state, zl, lc, V, ignore_index)
        lp[r0:r1] = a[: r1 - r0]  # (padded rows in batch-invariant mode)
        lse[r0:r1] = s[: r1 - r0]
        if with_entropy:
            ent[r0:r1] = e[: r1 - r0]
    return lp, ent, lse


@linear_token_logprobs_op.register_fake
def _(
    hidden,
    weight,
    labels,
    bias,
    temperature,
    ignore_index,
    with_entropy,
    max_chunk_bytes,
    logits_dtype="float32",
    softcap=None,
):
    acc = _acc(hidden.dtype)
    N = hidden.shape[0]
    lp = hidden.new_empty((N,), dtype=acc)
    ent = hidden.new_empty((N,) if with_entropy else (0,), dtype=acc)
    return lp, ent, hidden.new_empty((N,), dtype=acc)


@torch.library.custom_op("ppo_kernels::linear_token_logprobs_backward", mutates_args=())
def linear_token_logprobs_backward_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    entropy: Tensor,
    temperature: float,
    ignore_index: int,
    max_chunk_bytes: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    logits_dtype: str = "float32",
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden in hidden's dtype, grad_weight float32, grad_bias float32); a gradient that is
    not needed comes back as an empty tensor. The float32 weight gradient is what this op returns;
    autograd hands the weight its own dtype."""
    _check_backward_args(
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
    )
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
    fused = _fused(hidden)
    plan = plan_call(N, V, H, hidden.dtype, dev, max_chunk_bytes, logits_dtype, fused)
    tiler = Tiler(hidden, weight, bias, plan, fused, backward=True, softcap=softcap)
    inv_t = 1.0 / temperature
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    glp_all = grad_logprobs.to(acc)
    gent_all = grad_entropy.to(acc) if with_ent else None
    gh = torch.empty((plan.rows, H) if need_hidden else (0,), dtype=acc, device=dev)
    for r0 in range(0, N, plan.rows):
        r1 = min(N, r0 + plan.rows)
        hc, lc = tiler.rows(r0, r1), tiler.pad(labels[r0:r1], ignore_index)
        glp, ls = tiler.pad(glp_all[r0:r1]), tiler.pad(lse[r0:r1])
        gent = tiler.pad(gent_all[r0:r1]) if with_ent else None
        en = tiler.pad(entropy[r0:r1]) if with_ent else None
        ghc = gh[: hc.shape[0]].zero_() if need_hidden else gh
        chunk_backward(
            tiler, plan, fused, hc, lc, glp, gent, ls, en, inv_t, ignore_index, V, ghc, gW, gb
        )
        if need_hidden:
            gh_out[r0:r1] = ghc[: r1 - r0]
    return gh_out, gW, gb


@linear_token_logprobs_backward_op.register_fake
def _(
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
    logits_dtype="float32",
    softcap=None,
):
    acc = _acc(hidden.dtype)
    N, H = hidden.shape
    V = weight.shape[0]
    gh = hidden.new_empty((N, H) if need_hidden else (0,))
    gW = hidden.new_empty((V, H) if need_weight else (0,), dtype=acc)
    gb = hidden.new_empty((V,) if (need_bias and bias is not None) else (0,), dtype=acc)
    return gh, gW, gb


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias, temperature, ignore_index, with_entropy, budget = inputs[:8]
    logits_dtype = inputs[8] if len(inputs) > 8 else "float32"
    softcap = inputs[9] if len(inputs) > 9 else None
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, labels, bias, lse, entropy)
    ctx.args = (temperature, ignore_index, budget, logits_dtype, softcap)
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_lp, grad_ent, grad_lse):
    hidden, weight, labels, bias, lse, entropy = ctx.saved_tensors
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    if not (need_h or need_w or need_b):
        return (None,) * ctx.n_inputs
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_ent is not None and grad_ent.numel() == 0:
        grad_ent = None
    temperature, ignore_index, budget, logits_dtype, softcap = ctx.args
    gh, gW, gb = torch.ops.ppo_kernels.linear_token_logprobs_backward(
        grad_lp,
        grad_ent,
        hidden,
        weight,
        labels,
        bias,
        lse,
        entropy,
        temperature,
        ignore_index,
        budget,
        need_h,
        need_w,
        need_b and bias is not None,
        logits_dtype,
        softcap,
    )
    return (
        gh if need_h else None,
        gW.to(weight.dtype) if need_w else None,
        None,
        gb.to(bias.dtype) if (need_b and bias is not None) else None,
        *(None,) * (ctx.n_inputs - 4),
    )


linear_token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    max_chunk_bytes: int | None = None,
    logits_dtype: str = "float32",
    softcap: float | None = None,
    process_group=None,
    vocab_start: int | None = None,
    reduce_hidden_grad: bool = True,
):
    """Per-token log-probs (and entropy) of `labels` under softmax((hidden @ weight.T + bias) / T),
    equal to `token_logprobs(hidden @ weight.T + bias, labels, ...)` but never building the
    [N, V] logits: they are computed and reduced in bounded chunks, forward and backward.

    Args:
        hidden: `[..., H]` float32, bfloat16 or float16 (float64 runs in float64).
        weight: `[V, H]` (the LM head), same dtype and device as hidden.
        labels: int64 or int32 with shape `hidden.shape[:-1]`.
        bias: optional `[V]`.
        temperature: positive float.
        ignore_index: positions with this label give 0 (log-prob and entropy) and no gradient.
        return_entropy: also return the entropy of softmax(logits / temperature).
        softcap: Gemma-2 style `final_logit_softcapping`: the logits are `softcap * tanh(logits /
            softcap)` before the temperature (computed on each tile in the tile's dtype; the
            backward keeps one more tile for the derivative). None: no capping.
        max_chunk_bytes: cap on the chunk buffers (logits tile, upcast copies, per-chunk gradient
            accumulator); default 64 MiB on the CPU, 2 GiB on the GPU. Extra memory beyond it
            is O(N + V) plus, in backward, the float32 weight-gradient accumulator [V, H].
        logits_dtype: the dtype the logits (and their gradient) are computed in, for bf16/fp16
            inputs; float32/float64 inputs ignore it.
            "float32" (default): float32 logits tiles (the CPU upcasts the inputs chunk by chunk;
            CUDA uses bf16/fp16 matmuls with float32 output), more exact than materialised logits.
            "input": matmuls in the input dtype, so the logits and their gradient are rounded to
            it exactly as in `token_logprobs(hidden @ weight.T + bias, ...)` with bf16 logits
            (what a trainer materialising the logits gets); reductions and the sums across
            chunks stay float32 (on CUDA the gradient matmuls accumulate into them directly).
            The roundings of TRL's fused LM head. About 2x faster on CPUs with native bf16
            matmuls (AVX-512 BF16, AMX); on CUDA it moves fewer bytes than the default.

        process_group: vocab-parallel form (a tensor-parallel LM head, Megatron's layout):
            `weight` / `bias` hold this rank's contiguous slice of the vocabulary, `hidden` is
            replicated, labels are global ids; every rank gets the full-vocabulary results (one
            all-gather of per-row softmax statistics). Each rank's weight / bias gradient is its
            slice of the unsharded one; the hidden gradient is all-reduced (the full gradient on
            every rank) unless `reduce_hidden_grad=False` (frameworks whose own layers reduce it).
        vocab_start: this rank's first vocabulary id (default: from the slice sizes, rank order;
            see token_logprobs for torch.compile).

    Returns:
        float32 log-probs with `labels.shape`, or `(logprobs, entropy)`. Gradients flow to
        hidden, weight and bias (the weight gradient is accumulated in float32 and handed to
        autograd in the weight's dtype; `torch.ops.ppo_kernels.linear_token_logprobs_backward`
        returns it in float32).
    """
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, min_dim=1)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, dim=2)
    check_tensor("labels", labels, dtypes=INDEX_DTYPES)
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, dim=1)
    check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    H = hidden.shape[-1]
    V = weight.shape[0]
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"bias: dtype {bias.dtype} differs from hidden's {hidden.dtype}")
    if weight.shape[1] != H:
        raise ValueError(
            f"weight: expected shape (V, {H}) (H = hidden.shape[-1]), got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape[0] != V:
        raise ValueError(f"bias: expected shape ({V},) (weight.shape[0]), got {tuple(bias.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
            f"got {tuple(labels.shape)}"
        )
    if V == 0 and labels.numel() > 0 and process_group is None:
        raise ValueError("weight: the vocabulary dimension (first) is empty")
    temperature = check_temperature(temperature)
    ignore_index = check_int("ignore_index", ignore_index)
    return_entropy = check_bool("return_entropy", return_entropy)
    if softcap is not None:
        check_float("softcap", softcap, positive=True)
        if process_group is not None:
            raise ValueError("softcap: not supported with process_group (vocab-parallel) yet")
    _check_logits_dtype(logits_dtype)
    max_chunk_bytes = check_int("max_chunk_bytes", max_chunk_bytes, min_value=1, allow_none=True)
    if hidden.device.type == "cuda" and _backend.strict() and process_group is None:
        check_labels_in_range(labels, V, ignore_index)  # host sync, by request
    h2 = hidden.reshape(labels.numel(), H)  # not (-1, H): H may be 0
    if process_group is not None:
        from ..distributed.vocab_parallel import vocab_parallel_linear_token_logprobs

        lp, ent = vocab_parallel_linear_token_logprobs(
            h2,
            weight,
            labels.reshape(-1),
            bias,
            temperature,
            ignore_index,
            process_group,
            vocab_start,
            max_chunk_bytes,
            "input" if _input_tiles(hidden.dtype, logits_dtype) else "float32",
            reduce_hidden_grad,
        )
        lp = lp.view(labels.shape)
        return (lp, ent.view(labels.shape)) if return_entropy else lp
    lp, ent, _ = torch.ops.ppo_kernels.linear_token_logprobs(
        h2,
        weight,
        labels.reshape(-1),
        bias,
        float(temperature),
        ignore_index,
        return_entropy,
        int(max_chunk_bytes or 0),
        "input" if _input_tiles(hidden.dtype, logits_dtype) else "float32",
        None if softcap is None else float(softcap),
    )
    lp = lp.view(labels.shape)
    return (lp, ent.view(labels.shape)) if return_entropy else lp
