"""Argument helpers of the peer adapters: checks that fall back (`Fallback`, or `Unsupported` under
strict) naming the argument, and the dtypes the peers' arithmetic gives."""

from __future__ import annotations

import numbers

import torch

import ppo_kernels as pk

from ._patch import Fallback


def need(cond: bool, argument: str, reason: str):
    """Fall back (or raise under strict) unless cond holds."""
    if not cond:
        raise Fallback(argument, reason)


def tensor(x, argument: str, reason: str = "expected a torch.Tensor"):
    need(isinstance(x, torch.Tensor), argument, reason)
    return x


def is_binary_mask(mask: torch.Tensor) -> bool:
    """bool / integer masks are 0/1 by construction for our ops (nonzero = in); a float mask is
    checked (one host sync; the peers' own code syncs more than that on the same call)."""
    if not mask.is_floating_point():
        return mask.dtype == torch.bool or bool(((mask == 0) | (mask == 1)).all())
    return bool(((mask == 0) | (mask == 1)).all())


# A label value no tokenizer produces: the peers have no ignore_index (a negative label is an error).
NO_IGNORE = -(2**62)


def out_dtype(*ts):
    """The floating dtype torch's type promotion gives the peer's arithmetic on these tensors."""
    dt = ts[0].dtype
    for t in ts[1:]:
        if t.is_floating_point():
            dt = torch.promote_types(dt, t.dtype)
    return dt if dt.is_floating_point else torch.get_default_dtype()


def same_shape(x, m, name):
    need(
        tuple(m.shape) == tuple(x.shape),
        name,
        f"shape {tuple(m.shape)} is not that of the values "
        f"{tuple(x.shape)} (broadcasting masks are not supported)",
    )


def logits_arg(a, name="logits"):
    x = tensor(a[name], name)
    need(
        x.dim() >= 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64),
        name,
        f"dtype {x.dtype} / {x.dim()} dims",
    )
    need(x.stride(-1) == 1 or x.shape[-1] == 1, name, "the vocabulary dimension is not contiguous")
    return x


def softmax_dtype(x):
    """The dtype of the peers' softmax-based results for logits x where they are called: x's, or
    float32 under autocast on CUDA (softmax, log_softmax and logsumexp run in float32 there, as in
    verl's forward); asked of torch on an empty tensor."""
    return torch.promote_types(torch.softmax(x.new_empty(0, 1), -1).dtype, x.dtype)


def entropy(x):
    """Entropy of softmax(x) over the last dim with our fused op (no label: a dummy one)."""
    zeros = torch.zeros(x.shape[:-1], dtype=torch.int64, device=x.device)
    return pk.token_logprobs(x, zeros, ignore_index=NO_IGNORE, return_entropy=True)[1]


def labels_arg(a, x, name="labels"):
    y = tensor(a[name], name)
    need(y.dtype in (torch.int64, torch.int32), name, f"dtype {y.dtype}")
    need(tuple(y.shape) == tuple(x.shape[:-1]), name, "shape is not logits.shape[:-1]")
    return y


def matmul_dtype(h, w, argument="vocab_weights"):
    """The dtype of the peer's `hidden @ weight.T` where it is called: the autocast dtype under
    autocast (matmul is on its lower-precision list), else the operands' own (asked of torch on
    empty tensors)."""
    try:
        return torch.matmul(h.new_empty(0, 1), w.new_empty(1, 0)).dtype
    except RuntimeError:  # mismatched dtypes without autocast: the peer raises its own error
        raise Fallback(
            argument, f"dtype {w.dtype} differs from the hidden states' {h.dtype}"
        ) from None


def temperature_arg(t, rows_shape, argument="temperature"):
    """The peers' `logits / temperature` as (scalar, rows): a positive number gives (t, None); a
    tensor broadcasting against the logits [*rows_shape, V] with a vocabulary dimension of 1 (a
    0-dim, per-sample or per-token temperature) gives (1.0, the per-row temperatures, broadcast
    to rows_shape), which linear_token_logprobs takes as hidden / t (logits / t = (hidden / t) W^T).
    A temperature varying along the vocabulary falls back."""
    if isinstance(t, numbers.Real) and not isinstance(t, bool):
        need(t > 0, argument, f"expected a positive number, got {t}")
        return float(t), None
    tensor(t, argument, "expected a number or a tensor")
    need(t.is_floating_point(), argument, f"dtype {t.dtype}")
    rows = t if t.dim() == 0 else t.squeeze(-1) if t.shape[-1] == 1 else None
    need(rows is not None, argument, f"shape {tuple(t.shape)} varies along the vocabulary")
    try:
        ok = torch.broadcast_shapes(rows.shape, rows_shape) == tuple(rows_shape)
    except RuntimeError:
        ok = False
    need(
        ok, argument, f"shape {tuple(t.shape)} does not broadcast to the logits {rows_shape} + [V]"
    )
    return 1.0, rows.detach().expand(rows_shape)
