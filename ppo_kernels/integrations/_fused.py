"""Caller targets: a peer function that computes two results of the same logits with two calls
(entropy, then log-probs) runs with those calls swapped for one fused pass (`FusedPair`)."""

from __future__ import annotations

import contextlib
import inspect

import torch

import ppo_kernels as pk

from ._args import NO_IGNORE
from ._patch import Unfused


@contextlib.contextmanager
def swapped(holder, name: str, value):
    """`holder.name = value` for the duration (a module global or an instance attribute)."""
    had = name in vars(holder)
    old = vars(holder).get(name)
    setattr(holder, name, value)
    try:
        yield
    finally:
        if had:
            setattr(holder, name, old)
        else:
            delattr(holder, name)


def call(original, a: dict):
    """Call `original` with the arguments an impl received bound by name (*args / **kwargs
    parameters spread again)."""
    b = inspect.BoundArguments(inspect.signature(original), a)
    return original(*b.args, **b.kwargs)


class FusedPair:
    """One call of a peer's caller that computes the entropy, then the log-probs, of the same
    logits with two functions: the entropy call runs one `token_logprobs(return_entropy=True)`
    pass and keeps the log-probs; the log-prob call on the same logits and labels returns them.
    Either call on anything else is left to the function it replaces (`None` here)."""

    def __init__(self, labels=None):
        self.labels = labels  # set before the entropy call (or by a hook on the peer's unpad)
        self._logits = self._lp = None
        self.fused = self.used = 0

    def entropy(self, x):
        y = self.labels
        if not (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and y.dtype in (torch.int64, torch.int32)
            and x.dim() >= 1
            and tuple(x.shape[:-1]) == tuple(y.shape)
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
            and (x.stride(-1) == 1 or x.shape[-1] == 1)
        ):
            return None
        lp, ent = pk.token_logprobs(x, y, ignore_index=NO_IGNORE, return_entropy=True)
        self._logits, self._lp = x, lp
        self.fused += 1
        return ent

    def logprobs(self, x, y):
        if self._lp is None or x is not self._logits:
            return None
        if y is not self.labels and not (
            isinstance(y, torch.Tensor)
            and y.shape == self.labels.shape
            and torch.equal(y, self.labels)
        ):
            return None
        lp, self._logits, self._lp = self._lp, None, None
        self.used += 1
        return lp

    @property
    def complete(self) -> bool:
        return self.fused == 1 and self.used == 1

    def run(self, original, a: dict, swaps):
        """The caller `original` with `swaps` ((holder, name, value), ...) in place for the call;
        Unfused (with the output) when its two calls did not share the logits."""
        with contextlib.ExitStack() as stack:
            for holder, name, value in swaps:
                stack.enter_context(swapped(holder, name, value))
            out = call(original, a)
        if not self.complete:
            raise Unfused("output", "the entropy and log-prob calls did not share the logits", out)
        return out
