"""How linear_token_logprobs walks the work: rows (tokens) in chunks and, when a chunk of rows
times the whole vocabulary does not fit the memory budget, the vocabulary in chunks too. Pure
arithmetic on sizes (no tensors): the chunk loop (chunks.py) and the tiler (tiler.py) follow the
Plan."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from .. import _backend
from .._checks import check_str

# Default cap on the chunk buffers (logits tile + upcast copies + per-chunk gradient accumulator).
# CPU: a few hundred rows of a 32k-152k vocabulary. GPU: ~2300 rows at V = 152k; each row chunk
# adds its product into the float32 [V, H] weight gradient (5 GB of traffic at H = 4096), so fewer,
# larger chunks pay. 2 GiB was faster than 512 MiB at a lower peak, and a larger budget gained
# little more for a larger peak (bench/results/gpu_H200.md).
DEFAULT_MAX_CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 2 << 30}
_MIN_ROWS = 16  # below this many rows per chunk, chunk the vocabulary instead


# Devices with bf16/fp16 x bf16/fp16 -> float32 matmuls (torch.mm(..., out_dtype=float32) is
# CUDA-only): there bf16/fp16 inputs are not upcast, the tiles come straight out of the matmul in
# float32 ("lowp" in tiler.py). A tuple so that tests can add "cpu" with an emulated matmul.
F32_OUT_MATMUL_DEVICES = ("cuda",)


LOGITS_DTYPES = ("float32", "input")
_LOGITS_DTYPE_ARGS = LOGITS_DTYPES + ("auto",)  # what the APIs take: "auto" resolves per machine


def _cpu_native(dtype: torch.dtype) -> bool:
    """Does this CPU multiply `dtype` natively (oneDNN's bf16 / fp16 GEMMs)? Where it does not,
    the GEMMs are emulated and several times slower than float32 ones
    (bench/results/cpu_linear_policy_loss_issue_sizes.md)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    elif dtype == torch.float16:
        probes = ("_is_amx_fp16_supported",)
    else:
        return False
    return any(getattr(cpu, p, lambda: False)() for p in probes)


# Read once: the resolution is a pure function of (dtype, device) afterwards (torch.compile-safe).
_CPU_NATIVE = {dt: _cpu_native(dt) for dt in (torch.bfloat16, torch.float16)}
_ENV_DEFAULT = os.environ.get("PPO_KERNELS_LOGITS_DTYPE") or "auto"


def default_logits_dtype(dtype: torch.dtype, device) -> str:
    """What `logits_dtype="auto"` means for a fused LM head's inputs of this dtype on this device.

    "input" (GEMMs in the input dtype, float32 reductions) on a CPU that multiplies bf16 / fp16
    natively: bf16 with AVX-512 BF16 or AMX, fp16 with AMX-FP16. "float32" elsewhere: on CPUs that
    emulate those GEMMs, on CUDA (bf16 GEMMs with a float32 output beat input-dtype tiles there),
    and for float32 / float64 inputs. The environment variable PPO_KERNELS_LOGITS_DTYPE
    ("float32" / "input", read at import) fixes the answer on every machine.

    Args:
        dtype (torch.dtype): the dtype of the hidden states and the LM head.
        device (torch.device | str): where they live ("cpu", "cuda", ...).

    Returns:
        str: "float32" or "input".

    Why: on a CPU with native bf16 GEMMs, "input" tiles are the fastest. They also give the
    peers' precision (TRL's and Liger's fused heads). Where the GEMMs are emulated, they are much
    slower than float32 ones. Evidence: bench/results/cpu_head_defaults.md (CPU) and
    bench/results/gpu_H200.md (CUDA).
    """
    if _ENV_DEFAULT != "auto":
        return _ENV_DEFAULT
    dev = device.type if isinstance(device, torch.device) else str(device)
    if dev == "cpu" and _CPU_NATIVE.get(dtype, False):
        return "input"
    return "float32"


def resolve_logits_dtype(logits_dtype, dtype: torch.dtype, device) -> str:
    """logits_dtype as given ("float32" / "input"), or "auto" / None resolved for (dtype, device)."""
    if logits_dtype is None or logits_dtype == "auto":
        return default_logits_dtype(dtype, device)
    check_str("logits_dtype", logits_dtype, _LOGITS_DTYPE_ARGS)
    return logits_dtype


def _check_logits_dtype(logits_dtype: str):
    check_str("logits_dtype", logits_dtype, LOGITS_DTYPES)


if _ENV_DEFAULT != "auto":
    check_str("PPO_KERNELS_LOGITS_DTYPE", _ENV_DEFAULT, _LOGITS_DTYPE_ARGS)


def _input_tiles(dtype: torch.dtype, logits_dtype: str) -> bool:
    """Tiles and gradient matmuls in the input dtype (logits_dtype="input"; bf16/fp16 only)."""
    return logits_dtype == "input" and dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Plan:
    rows: int  # rows per chunk
    vocab: int  # vocabulary entries per tile (V: one tile covers the vocabulary)
    sub: int  # vocabulary entries per upcast weight block (CPU bf16/fp16)
    upcast: bool
    whole_weight: bool = False  # upcast the whole weight once (it fits in half the budget)
    input_tiles: bool = False  # logits_dtype="input": tiles in the input dtype; `sub` then sizes
    # the input-dtype block of the grad_weight product instead
    f32_out: bool = False  # bf16/fp16 matmuls with float32 output (F32_OUT_MATMUL_DEVICES): the
    # float32 tiles come from them (no upcast), and with input tiles the gradient products are
    # accumulated into the float32 sums by them
    pad: int = 0  # batch-invariant mode: every row chunk is zero-padded to a multiple of `pad` rows
    # (at most `rows`; the Tiler); 0: not padded


def plan_chunks(
    N: int,
    V: int,
    H: int,
    dtype: torch.dtype,
    device_type: str,
    max_chunk_bytes: int,
    tiles: str | None = None,
    logits_dtype: str = "float32",
    fused: bool = True,
) -> Plan:
    """Chunk sizes whose buffers fit in max_chunk_bytes: the logits tile, the upcast copies of the
    hidden chunk and of a weight block, and the per-chunk float32 grad_hidden accumulator.

    tiles: "rows" (default) takes as many rows as fit with the whole vocabulary (the fused
    token_logprobs kernels then reduce each tile); "square" takes rows ~ vocabulary chunk, which
    cuts the weight-gradient accumulator traffic (see the module docstring). Default from the
    environment variable PPO_KERNELS_LINEAR_TILES, for measuring both on a GPU.

    logits_dtype="input" (bf16/fp16): see _plan_input_tiles. fused: whole-vocabulary tiles are
    reduced by the fused kernels straight from the input dtype (else they need a float32 copy)."""
    if tiles is None:
        tiles = _backend.getenv("PPO_KERNELS_LINEAR_TILES", "rows")
    if tiles not in ("rows", "square"):
        raise ValueError(f"PPO_KERNELS_LINEAR_TILES: expected 'rows' or 'square', got {tiles!r}")
    f32_out = device_type in F32_OUT_MATMUL_DEVICES and dtype in (torch.bfloat16, torch.float16)
    if _input_tiles(dtype, logits_dtype):
        return _plan_input_tiles(N, V, H, dtype, max_chunk_bytes, tiles, fused, f32_out)
    acc = 8 if dtype == torch.float64 else 4
    upcast = dtype not in (torch.float32, torch.float64) and not f32_out
    tile_elem = acc + (2 if f32_out else 0)  # + the rounded gradient tile on the GPU
    row_fixed = acc * H * (2 if upcast else 1)  # upcast hidden chunk + grad_hidden accumulator
    B = max(int(max_chunk_bytes), 1)
    # Upcast weight blocks: the whole weight once when its copy takes at most half the budget
    # (then each row chunk reuses it), else blocks of a quarter of the budget per row chunk.
    whole = upcast and V * H * acc <= B // 2
    sub = V if (whole or not upcast) else max(1, min(V, (B // 4) // max(acc * H, 1)))
    avail = max(B - (sub * acc * H if upcast else 0), 0)
    if tiles == "square":
        rows = max(1, min(N, math.isqrt(avail // tile_elem)))
        vocab = max(1, min(V, (avail // rows - row_fixed) // tile_elem))
        return Plan(rows, vocab, min(sub, vocab), upcast, whole, f32_out=f32_out)
    rows = avail // (V * tile_elem + row_fixed)
    if rows >= min(N, _MIN_ROWS):
        return Plan(max(1, min(N, rows)), V, sub, upcast, whole, f32_out=f32_out)
    rows = max(1, min(N, _MIN_ROWS, avail // (row_fixed + tile_elem * min(V, 64))))
    vocab = max(1, min(V, (avail // rows - row_fixed) // tile_elem))
    return Plan(rows, vocab, min(sub, vocab), upcast, whole, f32_out=f32_out)


def _plan_input_tiles(N, V, H, dtype, max_chunk_bytes, tiles, fused, f32_out=False) -> Plan:
    """Buffers of logits_dtype="input": the input-dtype tile (plus its float32 copy for the
    per-chunk kernels of vocabulary chunks), per row the float32 grad_hidden accumulator and the
    input-dtype product g @ W, and a [sub, H] input-dtype block of the product g^T @ h that is
    added into the float32 grad_weight (no [V, H] temporary). The two products count twice: adding
    an input-dtype tensor into a float32 one makes a float32 copy of it first.
    f32_out (CUDA): the matmuls add the products into the float32 sums themselves -- no product
    buffers, only the grad_hidden accumulator per row."""
    isz = dtype.itemsize
    B = max(int(max_chunk_bytes), 1)
    if f32_out:
        sub, avail, row_fixed = V, B, 4 * H
    else:
        sub = max(1, min(V, (B // 4) // max((isz + 4) * H, 1)))
        avail = max(B - sub * (isz + 4) * H, 0)
        row_fixed = (4 + isz + 4) * H
    chunked = isz + 4  # tile + float32 copy
    if tiles == "square":
        rows = max(1, min(N, math.isqrt(avail // chunked)))
        vocab = max(1, min(V, (avail // rows - row_fixed) // chunked))
        return Plan(rows, vocab, min(sub, vocab), False, False, True, f32_out)
    rows = avail // (V * (isz if fused else chunked) + row_fixed)
    if rows >= min(N, _MIN_ROWS):
        return Plan(max(1, min(N, rows)), V, sub, False, False, True, f32_out)
    rows = max(1, min(N, _MIN_ROWS, avail // (row_fixed + chunked * min(V, 64))))
    vocab = max(1, min(V, (avail // rows - row_fixed) // chunked))
    return Plan(rows, vocab, min(sub, vocab), False, False, True, f32_out)


# Batch-invariant mode (plan_invariant). A BLAS computes a row of a matmul with instructions that
# depend on the matmul's shape: MKL runs 1-3 rows with other code, and on some CPUs it changes its
# kernels with the row count even between multiples of 32 (a short hidden gradient g @ W), as
# cuBLAS picks its algorithm by shape. So every row chunk is zero-padded to exactly the plan's
# rows (one matmul shape per (V, H)) and, on the CPU, its GEMMs run on one thread (tiler.py). A
# row's result then does not depend on its position in the tile
# (tests/ops/test_batch_invariance.py::test_matmul_rows_do_not_depend_on_their_position).
# The most rows per tile, beside the default budget's: fewer waste less on small calls (padded to
# them), more keep the matmul efficient. The GPU value has no benchmark yet.
INVARIANT_MAX_ROWS = {"cpu": 256, "cuda": 2048}
# rows are a multiple of this: a [rows, vocab] float32 tile never ends in the scalar remainder of
# a vectorised loop (the eager tile math), whatever the vocabulary size
INVARIANT_ROW_MULTIPLE = 32
_ANY_N = 1 << 40


def plan_invariant(
    V: int,
    H: int,
    dtype: torch.dtype,
    device_type: str,
    tiles: str | None = None,
    logits_dtype: str = "float32",
    fused: bool = True,
    budget_share: int = 1,
) -> Plan:
    """The plan of batch-invariant mode: a function of (V, H, dtype, device, logits_dtype) only --
    never of the number of rows or of max_chunk_bytes -- so that every call walks the same
    vocabulary tiles and its rows through matmuls of the same shapes: the default budget's
    chunking for an unbounded number of rows, at most INVARIANT_MAX_ROWS rows (a multiple of
    INVARIANT_ROW_MULTIPLE), each row chunk zero-padded to exactly `rows` rows.
    budget_share: the plan of 1 / budget_share of the default budget (an op that keeps that many
    tiles side by side: linear_policy_loss's exact KL), a constant of the op, not of the call."""
    budget = DEFAULT_MAX_CHUNK_BYTES.get(device_type, DEFAULT_MAX_CHUNK_BYTES["cuda"])
    budget = max(1, budget // budget_share)
    p = plan_chunks(_ANY_N, V, H, dtype, device_type, budget, tiles, logits_dtype, fused)
    cap = INVARIANT_MAX_ROWS.get(device_type, INVARIANT_MAX_ROWS["cuda"])
    k = INVARIANT_ROW_MULTIPLE
    rows = max(k, min(p.rows, cap) // k * k)
    return dataclasses.replace(p, rows=rows, pad=rows)


def resolve_budget(max_chunk_bytes: int, device: torch.device) -> int:
    if max_chunk_bytes > 0:
        return max_chunk_bytes
    return DEFAULT_MAX_CHUNK_BYTES.get(device.type, DEFAULT_MAX_CHUNK_BYTES["cuda"])


def plan_call(N, V, H, dtype, device: torch.device, max_chunk_bytes, logits_dtype, fused) -> Plan:
    """The plan of one call of the op: plan_chunks under the call's budget, or in batch-invariant
    mode plan_invariant (which depends on neither N nor the budget)."""
    if _backend.invariant():
        return plan_invariant(V, H, dtype, device.type, logits_dtype=logits_dtype, fused=fused)
    budget = resolve_budget(max_chunk_bytes, device)
    return plan_chunks(N, V, H, dtype, device.type, budget, logits_dtype=logits_dtype, fused=fused)
