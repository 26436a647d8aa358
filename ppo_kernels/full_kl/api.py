"""The public API of full_kl (typed arguments, defaults, the vocab-parallel form). Tensor checks
(dtype, shape, device, strides) run once, in the registered op (csrc/ops/full_kl.cpp); this layer
checks the Python scalars, normalises the mask and routes `process_group=` to
ppo_kernels/distributed/vocab_parallel_full_kl.py."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    check_arg,
    check_str,
    check_temperature,
    check_tensor,
    device_error,
)
from ..token_logprobs.api import check_values_here, sampler_options
from ..token_logprobs.naive import SAMPLERS
from . import op  # noqa: F401  (registers the ops' Python side)

_full_kl = _backend.op("full_kl")
_full_kl_rows = _backend.op("full_kl_row_temperature")
_full_kl_sampler = _backend.op("full_kl_sampler")


def _check_args(logits, ref_logits, temperature, vocab_parallel):
    """The registered op's checks, where it does not run them: the vocab-parallel form (whose
    slice may be empty) and the fallback without the compiled extension."""
    check_temperature(temperature)
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_tensor("ref_logits", ref_logits, dtypes=(logits.dtype,))
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(
            f"ref_logits: expected shape {tuple(logits.shape)} (logits.shape), "
            f"got {tuple(ref_logits.shape)}"
        )
    V = logits.shape[-1]
    for name, t in (("logits", logits), ("ref_logits", ref_logits)):
        if t.stride(-1) != 1 and V > 1:
            raise ValueError(
                f"{name}: the last (vocabulary) dimension must be contiguous (stride 1); "
                f"got strides {tuple(t.stride())}"
            )
    if V == 0 and logits.shape[:-1].numel() > 0 and not vocab_parallel:
        raise ValueError("logits: the vocabulary dimension (last) is empty")


def full_kl(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    mask: Tensor | None = None,
    process_group=None,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    sampler: str = "vllm",
) -> Tensor:
    """Exact KL(pi || pi_ref) per token over the whole vocabulary, in one pass over both logits.

    `KL[t] = sum_j p_j (log p_j - log q_j)` with p = softmax(logits / temperature) and
    q = softmax(ref_logits / temperature). Both softmaxes are reduced online (running max and
    sums), so no `[N, V]` temporary is written.

    Args:
        logits (Tensor): `[..., V]`, float32 / bfloat16 / float16 (float64 runs the float64 eager
            path). The policy's logits. The leading dimensions may have any strides; the last
            must be contiguous. The gradient flows to it.
        ref_logits (Tensor): logits' shape and dtype, strides of its own. The reference model's
            logits. The gradient flows to it only when it requires grad.
        temperature (float or Tensor): divides both logits; positive. A float is a runtime
            value (no recompiles). A float tensor gives per-row values: its shape is a leading
            part of `logits.shape[:-1]` (`[B]` per sequence or `[B, T]` per token for
            `[B, T, V]` logits), e.g. a rollout's per-request temperatures; no gradient flows to
            it (the vocab-parallel form takes it too). Default 1.0.
        mask (Tensor, optional): `logits.shape[:-1]`, bool / integer / float. A row with mask 0
            gives KL 0 and no gradient, and is not read. Default None: every row.
        process_group (ProcessGroup, optional): the vocab-parallel form. Both logits hold this
            rank's contiguous slice of the vocabulary (the same slice). Every rank gets the
            full-vocabulary KL from one all-gather of three numbers per row, and its slice of the
            gradients. Default None.
        top_k (int or Tensor, optional): the rollout engine's top-k (0 or >= V: off), a scalar
            or a per-row int tensor shaped like a per-row temperature. With top_p / min_p: the
            policy's distribution is the one the engine sampled from -- tempered, truncated to
            the kept set K of `token_logprobs`' sampler rules on the policy's logits and
            renormalised -- and `KL[t] = sum_{j in K} q_j (log q_j - log r_j)` with r the
            reference's tempered softmax over the whole vocabulary (never truncated). The
            gradient to logits flows on K only. With `process_group` the kept set is found with
            the other ranks (the vocab-parallel `token_logprobs`' search). Default None: off.
        top_p (float or Tensor, optional): the engine's top-p, in (0, 1] (1: off), scalar or per
            row. Default None: off.
        min_p (float or Tensor, optional): the engine's min-p, in [0, 1] (0: off), scalar or per
            row. Default None: off.
        sampler (str): whose truncation rules, "vllm" or "sglang" (docs/ppo-math.md, "The
            distribution the rollout sampled from"). Default "vllm".

    Returns:
        Tensor: the KL, `logits.shape[:-1]`, float32 (float64 for float64 logits).

    Why: the exact KL is what the sampled estimators of `kl_penalty` approximate. Composed from
    `log_softmax` it writes two `[N, V]` tensors; this op reads each logits tensor once. Formulas:
    docs/ppo-math.md ("Full-vocabulary KL"). Edge cases: ppo_kernels/full_kl/naive.py.
    """
    per_row = isinstance(temperature, Tensor)
    if type(temperature) is not float and not per_row:  # the op checks the value (floats: free)
        temperature = check_temperature(temperature)
    if not (isinstance(logits, Tensor) and isinstance(ref_logits, Tensor)):
        check_tensor("logits", logits)
        check_tensor("ref_logits", ref_logits)
    # devices before dispatch: a meta tensor would pick the fake kernel (two CPU tensors: no
    # device objects to build)
    if not (logits.is_cpu and ref_logits.is_cpu) and ref_logits.device != logits.device:
        raise device_error("ref_logits", ref_logits, logits.device, "logits")
    if mask is not None:
        check_arg(
            "mask",
            mask,
            logits.device,
            like="logits",
            shape=logits.shape[:-1],
            what="logits.shape[:-1]",
        )
        if mask.dtype != torch.bool:
            mask = mask != 0
        mask = mask.contiguous()
    if top_k is not None or top_p is not None or min_p is not None:
        return _sampled(logits, ref_logits, temperature, mask, process_group, top_k, top_p, min_p,
                        sampler)  # fmt: skip
    if sampler != "vllm":
        check_str("sampler", sampler, SAMPLERS)
    if per_row:
        check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES)
        rows = tuple(logits.shape[:-1])
        if temperature.device != logits.device:
            raise device_error("temperature", temperature, logits.device, "logits")
        if tuple(temperature.shape) != rows[: temperature.dim()]:
            raise ValueError(
                "temperature: expected a shape that is a leading part of logits.shape[:-1] "
                f"{rows} (per row or per token), got {tuple(temperature.shape)}"
            )
        if process_group is not None:
            if check_values_here(temperature):  # before any collective: every rank raises
                sampler_options(temperature.new_empty(rows, dtype=torch.long), temperature, None,
                                None, None, None, 0, True)  # fmt: skip
            _check_args(logits, ref_logits, 1.0, vocab_parallel=True)
            from ..distributed.vocab_parallel_full_kl import vocab_parallel_full_kl

            return vocab_parallel_full_kl(logits, ref_logits, 1.0, mask, process_group, temperature)
        if not _backend.HAS_EXTENSION:
            _check_args(logits, ref_logits, 1.0, vocab_parallel=False)
            if not bool((temperature > 0).all()):
                raise ValueError("temperature: expected positive values")
        kl, _, _ = _full_kl_rows(logits, ref_logits, temperature, mask)
        return kl
    if process_group is not None:
        _check_args(logits, ref_logits, temperature, vocab_parallel=True)
        from ..distributed.vocab_parallel_full_kl import vocab_parallel_full_kl

        return vocab_parallel_full_kl(logits, ref_logits, temperature, mask, process_group)
    if not _backend.HAS_EXTENSION:
        _check_args(logits, ref_logits, temperature, vocab_parallel=False)
    kl, _, _ = _full_kl(logits, ref_logits, float(temperature), mask)
    return kl


def _sampled(logits, ref_logits, temperature, mask, process_group, top_k, top_p, min_p, sampler):
    """full_kl under the sampler's distribution (the registered op full_kl_sampler)."""
    sampler = check_str("sampler", sampler, SAMPLERS)
    rows = logits.new_empty((), dtype=torch.long).expand(logits.shape[:-1])  # shape and device
    _, _, temp, temps, k, ks, p, ps, mp, mps = sampler_options(
        rows, temperature, top_k, top_p, min_p, None, 0, rows="logits.shape[:-1]",
        values=check_values_here(logits) if process_group is not None else None,
    )  # fmt: skip
    if process_group is not None:
        _check_args(logits, ref_logits, temp, vocab_parallel=True)
        from ..distributed.vocab_parallel_full_kl import vocab_parallel_sampled_full_kl

        return vocab_parallel_sampled_full_kl(
            logits, ref_logits, temp, temps, k, ks, p, ps, mp, mps, sampler, mask, process_group
        )
    if not _backend.HAS_EXTENSION:
        _check_args(logits, ref_logits, temp, vocab_parallel=False)
    kl = _full_kl_sampler(logits, ref_logits, temp, temps, k, ks, p, ps, mp, mps, sampler, mask)
    return kl[0]
