"""The public API of token_logprobs (typed arguments, defaults, the vocab-parallel form). Tensor
checks (dtype, shape, device, strides) and the label range run once, in the registered op
(csrc/ops/token_logprobs.cpp); this layer checks the Python scalars and routes `process_group=`
to ppo_kernels/distributed/vocab_parallel.py."""

from __future__ import annotations

from torch import Tensor

from .. import _backend
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_arg,
    check_bool,
    check_int,
    check_temperature,
    check_tensor,
    device_error,
)
from . import op  # noqa: F401  (registers the ops' Python side)

_token_logprobs = _backend.op("token_logprobs")


def _check_args(logits, labels, temperature, vocab_parallel):
    """The registered op's checks, where it does not run them: the vocab-parallel form (whose
    slice may be empty) and the fallback without the compiled extension."""
    check_temperature(temperature)
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    check_arg("labels", labels, logits.device, like="logits", dtypes=INDEX_DTYPES)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
            f"got {tuple(labels.shape)}"
        )
    if logits.shape[-1] == 0 and labels.numel() > 0 and not vocab_parallel:
        raise ValueError("logits: the vocabulary dimension (last) is empty")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            "logits: the last (vocabulary) dimension must be contiguous (stride 1); "
            f"got strides {tuple(logits.stride())}"
        )


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    process_group=None,
    vocab_start: int | None = None,
):
    """Log-probability of each label under softmax(logits / temperature), fused in one pass.

    Args:
        logits: `[..., V]` float32, bfloat16 or float16 (float64 runs the float64 reference). The
            leading dimensions may have any strides (e.g. `logits[:, :-1]` is read without a
            copy); the last dimension must be contiguous.
        labels: int64 or int32 with shape `logits.shape[:-1]`.
        temperature: positive float, a runtime value (no kernel recompiles).
        ignore_index: positions with this label give 0 (log-prob and entropy) and no gradient.
        return_entropy: also return the entropy of softmax(logits / temperature).
        inplace_backward: write the gradient into the logits buffer instead of allocating one
            (the logits must not be needed by anything else afterwards).
        process_group: vocab-parallel (tensor-parallel) form: `logits` is this rank's contiguous
            slice `[..., V_rank]` of the vocabulary (slices may be uneven), `labels` are global
            ids; every rank gets the full-vocabulary results (one all-gather of per-row softmax
            statistics; see ppo_kernels/distributed/vocab_parallel.py). The gradient of each
            rank's slice is its slice of the unsharded gradient.
        vocab_start: this rank's first vocabulary id; default: slices contiguous in rank order,
            settled from the forward's own gather (a new uneven layout costs one more gather,
            then it is cached; under torch.compile it cannot: give vocab_start for uneven
            shards there, or a clear error says so).

    Returns:
        float32 log-probs with `labels.shape` (float64 for float64 logits), or the pair
        `(logprobs, entropy)` when `return_entropy=True`.
    See ppo_kernels/token_logprobs/naive.py for the documented edge cases.
    """
    # the scalars' types (the op checks the temperature's value; exact types pass for free)
    if type(temperature) is not float:
        temperature = check_temperature(temperature)
    if type(ignore_index) is not int:
        ignore_index = check_int("ignore_index", ignore_index)
    if return_entropy is not True and return_entropy is not False:
        return_entropy = check_bool("return_entropy", return_entropy)
    if inplace_backward is not True and inplace_backward is not False:
        inplace_backward = check_bool("inplace_backward", inplace_backward)
    if not isinstance(logits, Tensor):
        check_tensor("logits", logits)
    if not isinstance(labels, Tensor):
        check_tensor("labels", labels)
    if labels.device != logits.device:  # before dispatch: a meta tensor would pick the fake
        raise device_error("labels", labels, logits.device, "logits")
    if process_group is not None:
        if inplace_backward:
            raise ValueError("inplace_backward: not supported with process_group")
        _check_args(logits, labels, temperature, vocab_parallel=True)
        from ..distributed.vocab_parallel import vocab_parallel_token_logprobs

        return vocab_parallel_token_logprobs(
            logits, labels, temperature, ignore_index, return_entropy, process_group, vocab_start
        )
    if not _backend.HAS_EXTENSION:
        _check_args(logits, labels, temperature, vocab_parallel=False)
    lp, ent, _ = _token_logprobs(
        logits, labels, float(temperature), ignore_index, return_entropy, inplace_backward
    )
    return (lp, ent) if return_entropy else lp
