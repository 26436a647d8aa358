"""The public API of token_logprobs (typed arguments, defaults, the vocab-parallel form). Tensor
checks (dtype, shape, device, strides) and the label range run once, in the registered op
(csrc/ops/token_logprobs.cpp); this layer checks the Python scalars and routes `process_group=`
to ppo_kernels/distributed/vocab_parallel_token_logprobs.py."""

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
    """Log-probability of each label under softmax(logits / temperature), in one fused pass.

    With z = logits / temperature, `logprob = z[label] - logsumexp(z)` and, on request,
    `entropy = -sum_j p_j log p_j` with p = softmax(z). A position whose label is `ignore_index`
    gives 0 for both and no gradient. The backward forms `(onehot - p) / temperature` per row.

    Args:
        logits (Tensor): `[..., V]`, float32 / bfloat16 / float16 (float64 runs the float64 eager
            path). The leading dimensions may have any strides: `logits[:, :-1]` is read without
            a copy. The last dimension must be contiguous. The gradient flows to it.
        labels (Tensor): `logits.shape[:-1]`, int64 / int32. Ids in [0, V) or `ignore_index`.
        temperature (float): divides the logits; positive. A runtime value: no kernel recompiles.
            Default 1.0.
        ignore_index (int): the label of a position without a log-prob. Default -100.
        return_entropy (bool): also return the entropy of softmax(logits / temperature).
            Default False.
        inplace_backward (bool): write the gradient into the logits' buffer instead of a new one.
            Only when nothing else needs the logits after the forward. Default False.
        process_group (ProcessGroup, optional): the vocab-parallel form. `logits` is this rank's
            contiguous slice `[..., V_rank]` of the vocabulary (slices may be uneven); labels are
            global ids. Every rank gets the full-vocabulary result from one all-gather of per-row
            softmax statistics. Each rank's gradient is its slice of the unsharded one.
            Default None.
        vocab_start (int, optional): this rank's first vocabulary id. Default None: slices
            contiguous in rank order, found by the forward's own gather and then cached. Under
            torch.compile give it for uneven slices (a clear error says so otherwise).

    Returns:
        Tensor: the log-probs, `labels.shape`, float32 (float64 for float64 logits). With
        `return_entropy=True`, the pair `(logprobs, entropy)`, both of that shape and dtype.

    Why: the trainer's largest tensor is the `[N, V]` logits. A composition of `log_softmax` and
    `gather` writes another `[N, V]` tensor, forward and backward; this op reads the logits once
    and keeps one number per row. It matches verl's `logprobs_from_logits` and TRL's
    `selective_log_softmax`. Formulas: docs/ppo-math.md ("Token log-probs and entropy"). Edge
    cases: ppo_kernels/token_logprobs/naive.py. Vocab-parallel form:
    ppo_kernels/distributed/vocab_parallel_token_logprobs.py.
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
        from ..distributed.vocab_parallel_token_logprobs import vocab_parallel_token_logprobs

        return vocab_parallel_token_logprobs(
            logits, labels, temperature, ignore_index, return_entropy, process_group, vocab_start
        )
    if not _backend.HAS_EXTENSION:
        _check_args(logits, labels, temperature, vocab_parallel=False)
    lp, ent, _ = _token_logprobs(
        logits, labels, float(temperature), ignore_index, return_entropy, inplace_backward
    )
    return (lp, ent) if return_entropy else lp
