"""From hidden states: the peers' LM-head log-prob kernels and forwards on `linear_token_logprobs`,
the [N, V] logits never built."""

from __future__ import annotations

import contextlib

import torch

import ppo_kernels as pk

from ._args import NO_IGNORE


def linear_logprobs(
    h,
    w,
    y,
    *,
    temperature=1.0,
    rows=None,
    compute_dtype=None,
    bias=None,
    ignore_index=NO_IGNORE,
    with_entropy=True,
    logits_dtype="float32",
    softcap=None,
    stats=None,
    **distributed,
):
    """linear_token_logprobs as the peer's `(hidden @ weight.T) / temperature` computes it: in
    `compute_dtype` (the autocast dtype where the peer's matmul autocasts: the operands are cast
    as autocast casts them), per-row temperatures `rows` folded into the hidden states. Our tiles
    run with autocast off: their dtype is `logits_dtype`'s, not autocast's. `stats`: the head's
    statistics, a HeadStats after the results (linear_token_logprobs' `stats`)."""
    dt = compute_dtype or h.dtype
    h, w = h.to(dt), w.to(dt)
    bias = None if bias is None else bias.to(dt)
    if rows is not None:
        h = h / rows.unsqueeze(-1).to(dt)
    off = (
        torch.autocast(h.device.type, enabled=False)
        if torch.is_autocast_enabled(h.device.type)
        else contextlib.nullcontext()
    )
    with off:
        return pk.linear_token_logprobs(
            h,
            w,
            y,
            bias=bias,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=with_entropy,
            logits_dtype=logits_dtype,
            softcap=softcap,
            stats=stats,
            **distributed,
        )


def half_tiles(dtype) -> str:
    """bf16 / fp16: logits tiles rounded to the input dtype, as a peer that builds bf16 logits
    with `hidden @ weight.T` (then upcasts them) rounds them; float32 tiles otherwise."""
    return "input" if dtype in (torch.bfloat16, torch.float16) else "float32"


def lm_head(model):
    """(head, softcap) of a Hugging Face causal LM whose logits are `head(last hidden state)`
    (soft-capped by `config.final_logit_softcapping` where set), or (None, why not)."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, f"{type(model).__name__} has no get_output_embeddings()"
    if type(head) is not torch.nn.Linear:
        return None, f"its output embeddings are a {type(head).__name__}, not a plain nn.Linear"
    if hasattr(head.weight, "ds_id"):
        return None, "ZeRO-3 partitions the LM head weight outside the head's own forward"
    cfg = getattr(model, "config", None)
    for key in ("logit_scale", "logits_scaling"):  # Cohere / Granite scale after the head
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            return None, f"config.{key}: the model scales its logits after the LM head"
    return head, getattr(cfg, "final_logit_softcapping", None)


class HeadCapture:
    """One call of a peer's caller that runs `model` and reads its logits with an entropy and /
    or a log-prob call. For the call the LM head keeps its input and returns logits with an
    empty vocabulary dimension (nothing N x V is built); the two calls, handed those empty
    logits, run one linear_token_logprobs pass on the kept hidden states. `labels`: the rows'
    labels for an entropy call made before the log-prob call (set later by a hook where only the
    caller computes them). The model's output is checked to be the head's output (or its
    soft-capped form): a model that changes its logits otherwise is run again with its own head
    (`rerun` says so) and the calls are left to the peer's functions."""

    def __init__(self, model, head, softcap, temperature, labels=None):
        self.model, self.head, self.softcap, self.temperature = model, head, softcap, temperature
        self.labels = labels
        self.hidden = self.empty = self._lp = None
        self.rerun = None
        self.passes = 0

    def _head_forward(self, x):
        self.hidden = x
        self.empty = x.new_empty(*x.shape[:-1], 0)
        return self.empty

    def _check_output(self, module, args, kwargs, output):
        try:
            logits = output["logits"]
        except (KeyError, TypeError, IndexError):
            logits = None
        if self.empty is None or logits is self.empty or self.softcap is not None:
            return None
        self.rerun = f"{type(module).__name__} changes its logits after the LM head"
        self.hidden = self.empty = None
        with self._restored():
            return module(*args, **kwargs)

    @contextlib.contextmanager
    def _restored(self):
        swap = vars(self.head).pop("forward")
        try:
            yield
        finally:
            self.head.forward = swap

    @contextlib.contextmanager
    def active(self):
        """The head swapped and the model's output checked, for the caller's call."""
        self.head.forward = self._head_forward
        hook = self.model.register_forward_hook(self._check_output, with_kwargs=True)
        try:
            yield self
        finally:
            hook.remove()
            vars(self.head).pop("forward", None)
            self.hidden = self.empty = self._lp = None

    def _ours(self, logits):
        return (
            self.hidden is not None
            and isinstance(logits, torch.Tensor)
            and logits.shape[-1] == 0
            and tuple(logits.shape[:-1]) == tuple(self.hidden.shape[:-1])
        )

    def _run(self, labels, with_entropy, temperature=1.0):
        h, w = self.hidden, self.head.weight
        self.passes += 1
        return linear_logprobs(
            h,
            w,
            labels,
            temperature=self.temperature * temperature,
            bias=self.head.bias,
            with_entropy=with_entropy,
            logits_dtype=half_tiles(h.dtype),
            softcap=self.softcap,
        )

    def entropy(self, logits):
        """The entropy of the empty logits' rows (one pass, the log-probs kept), or None."""
        y = self.labels
        if not self._ours(logits) or not isinstance(y, torch.Tensor):
            return None
        if tuple(y.shape) != tuple(logits.shape[:-1]):
            return None
        self._lp, ent = self._run(y, True)
        return ent

    def logprobs(self, logits, labels, temperature=1.0):
        """The log-probs of `labels` for the empty logits' rows (those of the entropy call when
        the labels are its labels and the temperature 1), or None."""
        if not self._ours(logits) or tuple(labels.shape) != tuple(logits.shape[:-1]):
            return None
        lp, self._lp, y = self._lp, None, self.labels
        if lp is not None and temperature == 1.0 and (labels is y or torch.equal(labels, y)):
            return lp
        return self._run(labels, False, temperature)
