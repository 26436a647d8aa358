"""The public API of token_logprobs (typed arguments, defaults, the vocab-parallel form). Tensor
checks (dtype, shape, device, strides) and the label range run once, in the registered op
(csrc/ops/token_logprobs.cpp); this layer checks the Python scalars and routes `process_group=`
to ppo_kernels/distributed/vocab_parallel_token_logprobs.py."""

from __future__ import annotations

from typing import NamedTuple

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
    check_str,
    check_temperature,
    check_tensor,
    device_error,
)
from . import op  # noqa: F401  (registers the ops' Python side)
from .naive import MAX_STATS_TOP_K, SAMPLERS, STATS

_token_logprobs = _backend.op("token_logprobs")
_token_logprobs_sampler = _backend.op("token_logprobs_sampler")


class HeadStats(NamedTuple):
    """The head's statistics `token_logprobs(..., stats=...)` returns (None where not asked);
    per token with labels.shape, no gradient. See docs/ppo-math.md."""

    outside: Tensor | None  # bool: the label is outside the sampler's kept set (log-prob -inf)
    num_outside: Tensor | None  # int64, 0-dim: how many labels are outside
    sum_p2: Tensor | None  # sum_j q_j^2 under the sampler's distribution
    lse: Tensor | None  # log sum_j exp(logits_j / T) over the whole vocabulary
    top_ids: Tensor | None  # int64 [..., stats_top_k]: the first tokens in rank order
    top_logprobs: Tensor | None  # their log-probs under the sampler's distribution
    is_argmax: Tensor | None  # bool: the label's logit is the row maximum


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
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    sampler: str = "vllm",
    stats=None,
    stats_top_k: int = 0,
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
        temperature (float or Tensor): divides the logits; positive. A float is a runtime value
            (no kernel recompiles). A float tensor gives per-row values: its shape is a leading
            part of labels.shape (`[B]` per sequence or `[B, T]` per token for `[B, T]` labels).
            Default 1.0.
        ignore_index (int): the label of a position without a log-prob. Default -100.
        return_entropy (bool): also return the entropy of softmax(logits / temperature).
            Default False.
        inplace_backward (bool): write the gradient into the logits' buffer instead of a new one.
            Only when nothing else needs the logits after the forward. Default False.
        process_group (ProcessGroup, optional): the vocab-parallel form. `logits` is this rank's
            contiguous slice `[..., V_rank]` of the vocabulary (slices may be uneven); labels are
            global ids. Every rank gets the full-vocabulary result from one all-gather of per-row
            softmax statistics. Each rank's gradient is its slice of the unsharded one. It takes
            a temperature tensor, `top_k`, `top_p`, `min_p`, `sampler` and every statistic:
            the same result as the single-device op on the gathered logits, up to
            float32 rounding at a cut, from a fixed number of collectives (docs/ppo-math.md).
            Default None.
        vocab_start (int, optional): this rank's first vocabulary id. Default None: slices
            contiguous in rank order, found by the forward's own gather and then cached. Under
            torch.compile give it for uneven slices (a clear error says so otherwise).
        top_k (int or Tensor, optional): the rollout engine's top-k (0 or >= V: off), a scalar
            or a per-row int tensor shaped like a per-row temperature. With top_p / min_p: the
            log-probs and entropy under the distribution the engine sampled from (temperature,
            then min-p, then top-k and top-p, the kept tokens renormalised). A label outside the
            kept set gets -inf. Default None: off.
        top_p (float or Tensor, optional): the engine's top-p, in (0, 1] (1: off), scalar or per
            row. Default None: off.
        min_p (float or Tensor, optional): the engine's min-p, in [0, 1] (0: off), scalar or per
            row. Default None: off.
        sampler (str): whose truncation rules, "vllm" or "sglang" (docs/ppo-math.md, "The
            distribution the rollout sampled from", says where they differ). Default "vllm".
        stats (tuple of str, optional): the head's statistics to return per token from the same
            pass: "outside", "sum_p2", "lse", "topk", "is_argmax" (see HeadStats). "outside"
            counts the labels outside the kept set (an engine / trainer mismatch). Default None:
            none computed.
        stats_top_k (int): how many top tokens "topk" returns, 1 to 64. Default 0.

    Returns:
        Tensor: the log-probs, `labels.shape`, float32 (float64 for float64 logits). With
        `return_entropy=True`, the pair `(logprobs, entropy)`, both of that shape and dtype.
        With `stats`, a HeadStats follows (the last element of a tuple).

    Why: the trainer's largest tensor is the `[N, V]` logits. A composition of `log_softmax` and
    `gather` writes another `[N, V]` tensor, forward and backward; this op reads the logits once
    and keeps one number per row. It matches verl's `logprobs_from_logits` and TRL's
    `selective_log_softmax`. Formulas: docs/ppo-math.md ("Token log-probs and entropy"). Edge
    cases: ppo_kernels/token_logprobs/naive.py. Vocab-parallel form:
    ppo_kernels/distributed/vocab_parallel_token_logprobs.py.
    """
    if sampler_requested(temperature, top_k, top_p, min_p, stats):
        return _sampled(
            logits, labels, temperature, ignore_index, return_entropy, inplace_backward,
            process_group, vocab_start, top_k, top_p, min_p, sampler, stats, stats_top_k,
        )  # fmt: skip
    if sampler != "vllm" or stats_top_k != 0:
        check_sampler_unused(sampler, stats_top_k)
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


def sampler_requested(temperature, top_k, top_p, min_p, stats) -> bool:
    """Whether a call asks for the sampler's distribution or the head's statistics."""
    return (
        top_k is not None
        or top_p is not None
        or min_p is not None
        or stats is not None
        or isinstance(temperature, Tensor)
    )


def check_sampler_unused(sampler, stats_top_k):
    """The sampler's own arguments of a call without its options: valid, and no top-k stats."""
    check_str("sampler", sampler, SAMPLERS)
    check_int("stats_top_k", stats_top_k, min_value=0)
    if stats_top_k:
        raise ValueError('stats_top_k: only used with stats=("topk", ...)')


def _param(name, x, dtypes, labels, check, rows="labels.shape"):
    """A truncation parameter: (scalar, tensor or None). A tensor's shape is a leading part of
    labels.shape (`rows` names that shape in the messages); its values are checked by the
    registered op."""
    if isinstance(x, Tensor):
        check_tensor(name, x, dtypes=dtypes)
        if x.device != labels.device:
            raise device_error(name, x, labels.device, rows.split(".")[0])
        if tuple(x.shape) != tuple(labels.shape[: x.dim()]):
            raise ValueError(
                f"{name}: expected a shape that is a leading part of {rows} "
                f"{tuple(labels.shape)} (per row or per token), got {tuple(x.shape)}"
            )
        return None, x
    return check(x), None


def _check_top_p(x):
    v = check_float("top_p", x)
    if not (0.0 < v <= 1.0):
        raise ValueError(f"top_p: expected a value in (0, 1], got {v}")
    return v


def _check_min_p(x):
    v = check_float("min_p", x)
    if not (0.0 <= v <= 1.0):
        raise ValueError(f"min_p: expected a value in [0, 1], got {v}")
    return v


def _sampled(logits, labels, temperature, ignore_index, return_entropy, inplace_backward,
             process_group, vocab_start, top_k, top_p, min_p, sampler, stats,
             stats_top_k):  # fmt: skip
    """token_logprobs with the sampler's options or the head's statistics (the registered op
    token_logprobs_sampler)."""
    ignore_index = check_int("ignore_index", ignore_index)
    return_entropy = check_bool("return_entropy", return_entropy)
    inplace_backward = check_bool("inplace_backward", inplace_backward)
    sampler = check_str("sampler", sampler, SAMPLERS)
    check_tensor("logits", logits)
    check_tensor("labels", labels)
    if labels.device != logits.device:
        raise device_error("labels", labels, logits.device, "logits")
    if inplace_backward:
        raise ValueError(
            "inplace_backward: not supported with the sampler's options (temperature tensor, "
            "top_k, top_p, min_p) or stats"
        )
    if process_group is not None:
        return _vocab_parallel_sampled(
            logits, labels, temperature, ignore_index, return_entropy, process_group,
            vocab_start, top_k, top_p, min_p, sampler, stats, stats_top_k,
        )  # fmt: skip
    names, stats_top_k, temp, temps, k, ks, p, ps, mp, mps = sampler_options(
        labels, temperature, top_k, top_p, min_p, stats, stats_top_k
    )
    if not _backend.HAS_EXTENSION:
        _check_args(logits, labels, temp, vocab_parallel=False)
    outs = _token_logprobs_sampler(
        logits, labels, temp, temps, k, ks, p, ps, mp, mps, sampler, ignore_index,
        return_entropy, "sum_p2" in names, "lse" in names, stats_top_k, "is_argmax" in names,
    )  # fmt: skip
    return sampler_result(outs, labels.shape, return_entropy, stats, names, stats_top_k)


def per_row(t, labels):
    """A per-row parameter tensor (shape a leading part of labels.shape) as the ops take it: one
    value per flat row [N]."""
    if t is None:
        return None
    return (
        t.reshape(tuple(t.shape) + (1,) * (labels.dim() - t.dim())).expand(labels.shape).reshape(-1)
    )


def only_temperatures(names, k, ks, p, ps, mp, mps) -> bool:
    """Whether sampler_options' result asks for no truncation and no statistics (at most
    per-row temperatures: the plain softmax, row by row)."""
    off = ks is None and ps is None and mps is None
    return off and not names and k == 0 and p == 1.0 and mp == 0.0


def check_values_here(t) -> bool:
    """Whether the vocab-parallel forms check the values of the per-row parameters in Python
    (a host read), before any collective, so that every rank raises alike: for CPU tensors and on
    the GPU under strict_checks(), not while torch.compile traces."""
    return not torch.compiler.is_compiling() and (t.device.type == "cpu" or _backend.strict())


def _vocab_parallel_sampled(logits, labels, temperature, ignore_index, return_entropy,
                            process_group, vocab_start, top_k, top_p, min_p, sampler, stats,
                            stats_top_k):  # fmt: skip
    """The vocab-parallel token_logprobs with per-row temperatures (the plain form's registered
    ops), or with the sampler's truncation and statistics (distributed/vocab_parallel_sampler.py)."""
    names, stats_top_k, temp, temps, k, ks, p, ps, mp, mps = sampler_options(
        labels, temperature, top_k, top_p, min_p, stats, stats_top_k, check_values_here(logits)
    )
    _check_args(logits, labels, temp, vocab_parallel=True)
    if only_temperatures(names, k, ks, p, ps, mp, mps):  # the plain form, per-row temperatures
        from ..distributed.vocab_parallel_token_logprobs import vocab_parallel_token_logprobs

        return vocab_parallel_token_logprobs(
            logits, labels, temp, ignore_index, return_entropy, process_group, vocab_start,
            per_row(temps, labels),
        )  # fmt: skip
    from ..distributed.vocab_parallel_sampler import vocab_parallel_sampled_logprobs

    outs = vocab_parallel_sampled_logprobs(
        logits, labels, temp, temps, k, ks, p, ps, mp, mps, sampler, ignore_index, process_group,
        vocab_start, stats_top_k,
    )  # fmt: skip
    return sampler_result(outs, labels.shape, return_entropy, stats, names, stats_top_k)


def sampler_options(labels, temperature, top_k, top_p, min_p, stats, stats_top_k, values=None,
                    rows="labels.shape"):  # fmt: skip
    """The sampler's options and the statistics asked for, checked (the registered ops check the
    tensors' values; here too without the compiled extension, or when `values` is True): (stats
    names, stats_top_k (0 unless "topk"), then the scalar and the tensor (or None) of the
    temperature, top-k, top-p and min-p, the scalar being the neutral value where a tensor is
    given). `rows`: what the messages call labels.shape (the rows the tensors follow)."""
    names = ()
    if stats is not None:
        if isinstance(stats, str):
            stats = (stats,)
        names = tuple(check_str("stats", s, STATS) for s in stats)
    stats_top_k = check_int("stats_top_k", stats_top_k, min_value=0)
    if "topk" in names:
        if not 1 <= stats_top_k <= MAX_STATS_TOP_K:
            raise ValueError(
                f'stats_top_k: stats "topk" needs 1 <= stats_top_k <= {MAX_STATS_TOP_K}, '
                f"got {stats_top_k}"
            )
    elif stats_top_k:
        raise ValueError('stats_top_k: only used with stats=("topk", ...)')
    temp, temps = _param("temperature", temperature, FLOAT_DTYPES, labels, check_temperature, rows)
    k, ks = _param("top_k", 0 if top_k is None else top_k, INDEX_DTYPES, labels,
                   lambda x: check_int("top_k", x, min_value=0), rows)  # fmt: skip
    p, ps = _param("top_p", 1.0 if top_p is None else top_p, FLOAT_DTYPES, labels, _check_top_p,
                   rows)  # fmt: skip
    mp, mps = _param("min_p", 0.0 if min_p is None else min_p, FLOAT_DTYPES, labels, _check_min_p,
                     rows)  # fmt: skip
    if values or (values is None and not _backend.HAS_EXTENSION):  # the op's (a host read)
        for name, t, ok in (
            ("temperature", temps, lambda v: (v > 0) & (1.0 / v.double() <= 3.4028234663852886e38)),
            ("top_k", ks, lambda v: v >= 0),
            ("top_p", ps, lambda v: (v > 0) & (v <= 1)),
            ("min_p", mps, lambda v: (v >= 0) & (v <= 1)),
        ):
            if t is not None and not bool(ok(t).all()):
                raise ValueError(f"{name}: a value is out of range (see the docstring)")
    return (
        names, stats_top_k, 1.0 if temp is None else float(temp), temps, int(k or 0), ks,
        1.0 if p is None else float(p), ps, 0.0 if mp is None else float(mp), mps,
    )  # fmt: skip


def sampler_result(outs, shape, return_entropy, stats, names, stats_top_k):
    """What the public function returns from a sampler op's outputs (flat or with `shape`)."""
    lp = outs[0].view(shape)
    result = (lp, outs[1].view(shape)) if return_entropy else (lp,)
    if stats is None:
        return result if return_entropy else lp
    outside = outs[5].view(shape) if "outside" in names else None
    topk = "topk" in names
    head = HeadStats(
        outside,
        outside.sum() if outside is not None else None,
        outs[6].view(shape) if "sum_p2" in names else None,
        outs[7].view(shape) if "lse" in names else None,
        outs[8].view(*shape, stats_top_k) if topk else None,
        outs[9].view(*shape, stats_top_k) if topk else None,
        outs[10].view(shape) if "is_argmax" in names else None,
    )
    return (*result, head)
