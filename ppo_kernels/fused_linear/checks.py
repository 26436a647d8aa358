"""The argument checks of an LM-head call (hidden [N, H], weight [V, H], labels [N], bias [V]),
in Python: the registered ops check the same in C++ (csrc/ops/linear_logprobs.cpp); these serve
their fallbacks without the extension and the vocab-parallel forms."""

from __future__ import annotations

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
from .._math import acc_dtype
from .planner import _check_logits_dtype


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
    (ppo_kernels/distributed/vocab_parallel_linear.py), which may be empty, and labels are global ids
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
    rows, dev, acc = labels.shape, hidden.device, (acc_dtype(hidden.dtype),)
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
