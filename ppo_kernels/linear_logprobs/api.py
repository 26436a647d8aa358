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
    check_str,
    check_temperature,
    check_tensor,
)
from ..fused_linear.planner import (
    _input_tiles,
    default_logits_dtype,
    resolve_budget,
    resolve_logits_dtype,
)
from ..token_logprobs.api import (
    check_sampler_unused,
    check_values_here,
    only_temperatures,
    per_row,
    sampler_options,
    sampler_requested,
    sampler_result,
)
from ..token_logprobs.naive import SAMPLERS
from . import op  # noqa: F401  (registers the ops' Python side)

_linear_token_logprobs = _backend.op("linear_token_logprobs")
_linear_token_logprobs_sampler = _backend.op("linear_token_logprobs_sampler")
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
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    max_chunk_bytes: int | None = None,
    logits_dtype: str = "auto",
    softcap: float | None = None,
    process_group=None,
    vocab_start: int | None = None,
    reduce_hidden_grad: bool = True,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    sampler: str = "vllm",
    stats=None,
    stats_top_k: int = 0,
):
    """Per-token log-probs (and entropy) from hidden states and an LM head, without the logits.

    Computes `token_logprobs(hidden @ weight.T + bias, labels, ...)`. The `[N, V]` logits exist
    only as tiles of a bounded chunk of rows (and, when a row does not fit, of the vocabulary).
    Each tile is reduced to its softmax statistics, forward and backward. With `softcap`, the
    logits are `softcap * tanh(logits / softcap)` before the temperature.

    Args:
        hidden (Tensor): `[..., H]`, float32 / bfloat16 / float16 (float64 runs in float64). The
            gradient flows to it when it requires grad.
        weight (Tensor): `[V, H]`, hidden's dtype and device. The LM head. The gradient flows to
            it when it requires grad (summed in float32, returned in weight's dtype).
        labels (Tensor): `hidden.shape[:-1]`, int64 / int32. Ids in [0, V) or `ignore_index`.
        bias (Tensor, optional): `[V]`, hidden's dtype. Default None.
        temperature (float or Tensor): divides the logits; positive. A float tensor gives
            per-row values: its shape is a leading part of labels.shape (`[B]` per sequence or
            `[B, T]` per token for `[B, T]` labels). Default 1.0.
        ignore_index (int): the label of a position without a log-prob (0, no gradient).
            Default -100.
        return_entropy (bool): also return the entropy of softmax(logits / temperature).
            Default False.
        max_chunk_bytes (int, optional): the budget of the chunk buffers (logits tile, upcast
            copies, gradient tile). Memory beyond it is O(N + V), plus the float32 `[V, H]` weight
            gradient in the backward. Default None: 64 MiB on the CPU, 2 GiB on a GPU.
        logits_dtype (str): the dtype of the logits tiles for bfloat16 / float16 inputs; float32
            and float64 inputs ignore it. "float32": float32 tiles, more exact than materialised
            logits. "input": GEMMs in the input dtype with float32 reductions, the roundings of
            materialised bf16 logits and of TRL's and Liger's fused heads. "auto":
            `default_logits_dtype(hidden.dtype, hidden.device)`. Default "auto".
        softcap (float, optional): Gemma-2's `final_logit_softcapping`, applied on each tile.
            Not with `process_group`.
            Default None: no capping.
        process_group (ProcessGroup, optional): the vocab-parallel form (Megatron's
            tensor-parallel head). `weight` / `bias` hold this rank's contiguous slice of the
            vocabulary; `hidden` is replicated; labels are global ids. Every rank gets the
            full-vocabulary result from one all-gather of per-row softmax statistics. Each rank's
            weight / bias gradient is its slice of the unsharded one. It takes a temperature
            tensor, `top_k`, `top_p`, `min_p`, `sampler` and every statistic (the same
            result as the unsharded call, up to float32 rounding at a cut). Default None.
        vocab_start (int, optional): this rank's first vocabulary id. Default None: from the slice
            sizes, in rank order (see `token_logprobs` for torch.compile).
        reduce_hidden_grad (bool): with `process_group`, all-reduce the hidden gradient so every
            rank holds the full one. False for frameworks whose own layers reduce it.
            Default True.
        top_k (int or Tensor, optional): the rollout engine's top-k (0 or >= V: off), a scalar
            or a per-row int tensor shaped like a per-row temperature. With top_p / min_p / a
            temperature tensor: `token_logprobs`' sampler on the logits -- the log-probs and
            entropy under the distribution the engine sampled from (temperature, then min-p,
            then top-k and top-p, the kept tokens renormalised; a label outside the kept set
            gets -inf, and no gradient). Every tile then holds whole rows of the vocabulary:
            `max_chunk_bytes` must hold two rows' tiles (the tile and its gradient). With
            `process_group`: whole rows of this rank's slice, the kept set found with the other
            ranks by a fixed number of collectives per row block (docs/ppo-math.md); eager
            only. Default None: off.
        top_p (float or Tensor, optional): the engine's top-p, in (0, 1] (1: off), scalar or per
            row. Default None: off.
        min_p (float or Tensor, optional): the engine's min-p, in [0, 1] (0: off), scalar or per
            row. Default None: off.
        sampler (str): whose truncation rules, "vllm" or "sglang" (docs/ppo-math.md, "The
            distribution the rollout sampled from"). Default "vllm".
        stats (tuple of str, optional): the head's statistics to return per token from the same
            pass: "outside", "sum_p2", "lse", "topk", "is_argmax" (see
            `ppo_kernels.token_logprobs.api.HeadStats`). Default None: none computed.
        stats_top_k (int): how many top tokens "topk" returns, 1 to 64. Default 0.

    Returns:
        Tensor: the log-probs, `labels.shape`, float32 (float64 for float64 hidden). With
        `return_entropy=True`, the pair `(logprobs, entropy)`, both of that shape and dtype.
        With `stats`, a HeadStats follows (the last element of a tuple).

    Why: the `[N, V]` logits dominate a policy step's memory (a 32k-token batch at V = 152k is
    about 20 GB in float32). Chunking keeps the peak at the budget. The tiles come from BLAS /
    cuBLAS GEMMs and are reduced by the `token_logprobs` kernels. It plays the part of TRL's and
    Liger's fused LM heads. The CPU / CUDA defaults of `logits_dtype` and `max_chunk_bytes` follow
    bench/results/cpu_head_defaults.md and bench/results/gpu_H200.md. Formulas:
    docs/ppo-math.md ("Token log-probs and entropy"); the engine: ppo_kernels/fused_linear/.
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
        and top_k is None
        and top_p is None
        and min_p is None
        and stats is None
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
    if sampler_requested(temperature, top_k, top_p, min_p, stats):
        return _sampled(
            hidden, weight, labels, bias, temperature, ignore_index, return_entropy,
            max_chunk_bytes, logits_dtype, softcap, process_group, vocab_start, reduce_hidden_grad,
            top_k, top_p, min_p, sampler, stats, stats_top_k,
        )  # fmt: skip
    if sampler != "vllm" or stats_top_k != 0:
        check_sampler_unused(sampler, stats_top_k)
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


def _sampled(hidden, weight, labels, bias, temperature, ignore_index, return_entropy,
             max_chunk_bytes, logits_dtype, softcap, process_group, vocab_start,
             reduce_hidden_grad, top_k, top_p, min_p, sampler, stats, stats_top_k):  # fmt: skip
    """linear_token_logprobs with the sampler's options or the head's statistics (the registered
    op linear_token_logprobs_sampler)."""
    ignore_index = check_int("ignore_index", ignore_index)
    return_entropy = check_bool("return_entropy", return_entropy)
    sampler = check_str("sampler", sampler, SAMPLERS)
    if softcap is not None:
        check_float("softcap", softcap, positive=True)
        if process_group is not None:
            raise ValueError("softcap: not supported with process_group (vocab-parallel) yet")
    names, stats_top_k, temp, temps, k, ks, p, ps, mp, mps = sampler_options(
        labels, temperature, top_k, top_p, min_p, stats, stats_top_k,
        check_values_here(hidden) if process_group is not None else None,
    )  # fmt: skip
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    max_chunk_bytes = check_int("max_chunk_bytes", max_chunk_bytes, min_value=1, allow_none=True)
    if process_group is not None:
        return _vocab_parallel_sampled(
            hidden, weight, labels, bias, ignore_index, return_entropy, max_chunk_bytes,
            logits_dtype, process_group, vocab_start, reduce_hidden_grad, names, stats_top_k,
            temp, temps, k, ks, p, ps, mp, mps, sampler, stats,
        )  # fmt: skip
    if not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    ):
        # no backward can follow: the logits tile may take the whole budget (the op plans for a
        # gradient tile beside it, half each); fewer, larger blocks read the weight fewer times
        max_chunk_bytes = 2 * resolve_budget(max_chunk_bytes or 0, hidden.device)
    outs = _linear_token_logprobs_sampler(
        hidden.reshape(labels.numel(), hidden.shape[-1]), weight, labels.reshape(-1), bias, temp,
        per_row(temps, labels), k, per_row(ks, labels), p, per_row(ps, labels), mp,
        per_row(mps, labels), sampler, ignore_index, return_entropy, "sum_p2" in names,
        "lse" in names, stats_top_k, "is_argmax" in names, int(max_chunk_bytes or 0),
        _tiles(hidden.dtype, logits_dtype), None if softcap is None else float(softcap),
    )  # fmt: skip
    return sampler_result(outs, labels.shape, return_entropy, stats, names, stats_top_k)


def _vocab_parallel_sampled(hidden, weight, labels, bias, ignore_index, return_entropy,
                            max_chunk_bytes, logits_dtype, process_group, vocab_start,
                            reduce_hidden_grad, names, stats_top_k, temp, temps, k, ks, p, ps, mp,
                            mps, sampler, stats):  # fmt: skip
    """The vocab-parallel linear_token_logprobs with per-row temperatures (the plain form's
    registered ops), or with the sampler's truncation and statistics
    (distributed/vocab_parallel_linear_sampler.py)."""
    tiles = _tiles(hidden.dtype, logits_dtype)
    h2 = hidden.reshape(labels.numel(), hidden.shape[-1])  # not (-1, H): H may be 0
    if only_temperatures(names, k, ks, p, ps, mp, mps):  # the plain form, per-row temperatures
        from ..distributed.vocab_parallel_linear import vocab_parallel_linear_token_logprobs

        lp, ent = vocab_parallel_linear_token_logprobs(
            h2, weight, labels.reshape(-1), bias, temp, ignore_index, process_group, vocab_start,
            max_chunk_bytes, tiles, reduce_hidden_grad, per_row(temps, labels),
        )  # fmt: skip
        lp = lp.view(labels.shape)
        return (lp, ent.view(labels.shape)) if return_entropy else lp
    from ..distributed.vocab_parallel_linear_sampler import vocab_parallel_linear_sampled

    lp, ent, outside, sum_p2, lse, is_argmax, top_ids, top_lp = vocab_parallel_linear_sampled(
        h2, weight, labels.reshape(-1), bias, temp, per_row(temps, labels), k,
        per_row(ks, labels), p, per_row(ps, labels), mp, per_row(mps, labels), sampler,
        ignore_index, process_group, vocab_start, max_chunk_bytes, tiles, reduce_hidden_grad,
        stats_top_k,
    )  # fmt: skip
    empty = lp.new_empty(0)
    outs = (lp, ent, empty, empty, empty, outside, sum_p2, lse, top_ids, top_lp, is_argmax)
    return sampler_result(outs, labels.shape, return_entropy, stats, names, stats_top_k)
