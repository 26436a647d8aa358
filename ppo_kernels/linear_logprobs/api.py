"""The public API of linear_token_logprobs: the typed function, its defaults and docstring. Tensor
checks (dtype, shape, device, label range on the CPU) run once, in the registered op
(csrc/ops/linear_logprobs.cpp); this layer checks what only it sees (the Python scalars, the
leading dimensions it flattens) and is the one place that routes `process_group=` to the
vocab-parallel form (ppo_kernels/distributed/vocab_parallel_linear.py). causal_lm_logprobs (hf.py) is
built on it."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    check_bool,
    check_float,
    check_int,
    check_temperature,
    check_tensor,
)
from ..fused_linear.planner import _input_tiles, default_logits_dtype, resolve_logits_dtype
from . import op  # noqa: F401  (registers the ops' Python side)

_linear_token_logprobs = _backend.op("linear_token_logprobs")
_F32, _F32_DTYPE = "float32", torch.float32


def _tiles(dtype: torch.dtype, logits_dtype: str) -> str:
    """The tiles the registered op computes: "input" or "float32"."""
    return "input" if _input_tiles(dtype, logits_dtype) else _F32


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
    logits_dtype: str = "auto",
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
            "float32": float32 logits tiles (the CPU upcasts the inputs chunk by chunk; CUDA
            uses bf16/fp16 matmuls with float32 output), more exact than materialised logits.
            "input": matmuls in the input dtype, so the logits and their gradient are rounded to
            it exactly as in `token_logprobs(hidden @ weight.T + bias, ...)` with bf16 logits
            (what a trainer materialising the logits gets); reductions and the sums across
            chunks stay float32 (on CUDA the gradient matmuls accumulate into them directly).
            The roundings of TRL's and Liger's fused LM heads. 2-2.5x faster than "float32" on
            CPUs with native bf16 matmuls (AVX-512 BF16, AMX), ~45x slower where they are
            emulated; on CUDA slower than "float32" (H200: 418 vs 288 ms).
            "auto" (default): `ppo_kernels.default_logits_dtype(hidden.dtype, hidden.device)`:
            "input" on a CPU with native matmuls in that dtype, "float32" elsewhere (the
            environment variable PPO_KERNELS_LOGITS_DTYPE fixes it on every machine).

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
    if (  # the default call on [N, H] hidden: the registered op checks the tensors (named)
        _backend.HAS_EXTENSION
        and bias is None
        and type(temperature) is float
        and temperature == 1.0
        and type(ignore_index) is int
        and ignore_index == -100
        and (return_entropy is False or return_entropy is True)
        and max_chunk_bytes is None
        and logits_dtype == "auto"
        and softcap is None
        and process_group is None
        and type(hidden) is Tensor
        and type(weight) is Tensor
        and type(labels) is Tensor
        and hidden.dim() == 2
        and labels.dim() == 1
    ):
        dt = hidden.dtype
        tiles = _F32 if dt is _F32_DTYPE else _tiles(dt, default_logits_dtype(dt, hidden.device))
        lp, ent, _ = _linear_token_logprobs(
            hidden, weight, labels, None, 1.0, -100, return_entropy, 0, tiles, None
        )
        return (lp, ent) if return_entropy else lp
    check_tensor("hidden", hidden, min_dim=1)
    check_tensor("weight", weight)
    check_tensor("labels", labels)
    if bias is not None:
        check_tensor("bias", bias)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
            f"got {tuple(labels.shape)}"
        )
    temperature = check_temperature(temperature)
    ignore_index = check_int("ignore_index", ignore_index)
    return_entropy = check_bool("return_entropy", return_entropy)
    if softcap is not None:
        check_float("softcap", softcap, positive=True)
        if process_group is not None:
            raise ValueError("softcap: not supported with process_group (vocab-parallel) yet")
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    max_chunk_bytes = check_int("max_chunk_bytes", max_chunk_bytes, min_value=1, allow_none=True)
    tiles = _tiles(hidden.dtype, logits_dtype)
    h2 = hidden.reshape(labels.numel(), hidden.shape[-1])  # not (-1, H): H may be 0
    if process_group is not None:
        from ..distributed.vocab_parallel_linear import vocab_parallel_linear_token_logprobs

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
            tiles,
            reduce_hidden_grad,
        )
        lp = lp.view(labels.shape)
        return (lp, ent.view(labels.shape)) if return_entropy else lp
    lp, ent, _ = _linear_token_logprobs(
        h2,
        weight,
        labels.reshape(-1),
        bias,
        float(temperature),
        ignore_index,
        return_entropy,
        int(max_chunk_bytes or 0),
        tiles,
        None if softcap is None else float(softcap),
    )
    lp = lp.view(labels.shape)
    return (lp, ent.view(labels.shape)) if return_entropy else lp
