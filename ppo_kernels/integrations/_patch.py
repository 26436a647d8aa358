"""The patch machinery shared by the peer adapters: one `Target` per peer function, replaced
wherever the peer can reach it, counted, and put back by `revert`.

A target's replacement receives the call's arguments bound by name to the original's signature
(defaults applied). It raises `Fallback(argument, reason)` -- before doing anything -- when the
call uses something our ops cannot express; under strict=True that becomes `Unsupported` naming
the argument, under strict=False the original runs for that call and the reason is counted.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

import ppo_kernels as pk


class Unsupported(ValueError):
    """A peer call uses an argument value the ppo_kernels op cannot express (strict=True)."""

    def __init__(self, where: str, argument: str, reason: str):
        super().__init__(
            f"{where}: argument {argument!r}: {reason} (ppo_kernels cannot express "
            "this; apply(..., strict=False) runs the peer's own code for such calls)"
        )
        self.argument = argument
        self.reason = reason


class UnsupportedVersion(RuntimeError):
    pass


class Fallback(Exception):
    def __init__(self, argument: str, reason: str):
        super().__init__(argument, reason)
        self.argument, self.reason = argument, reason


class Passthrough(Exception):
    """A caller target has nothing to fuse in this call (e.g. entropy was not asked for): the
    original runs -- its inner functions still patched -- counted in `passed`, never an error."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Unfused(Exception):
    """A caller target ran the original inside its replacement but the fused pass did not happen
    (the peer's pieces did not meet as expected): `result` is the original's, correct but computed
    in two passes. Counted as a fallback; not raised under strict (the call has already run)."""

    def __init__(self, argument: str, reason: str, result):
        super().__init__(argument, reason)
        self.argument, self.reason, self.result = argument, reason, result


@dataclasses.dataclass
class Options:
    strict: bool
    dtype: str  # "peer": the dtype the peer's function returns; "float32": ours

    def out(self, t, dtype):
        """Our float32 result in the dtype the peer would return (dtype="peer")."""
        if self.dtype == "peer" and t is not None and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t


@dataclasses.dataclass
class Target:
    """`module.attr` (attr may be "Class.method") replaced by `make(original, options)`, a
    function `(bound: dict, original, options) -> result`. `registries`: names of dicts in
    `module` whose values may hold the original (verl's ADV_ESTIMATOR_REGISTRY, ...).
    `optional`: a module that does not import here (a peer installed without that caller's
    stack) leaves the target unavailable -- said in `report` -- instead of failing `apply`."""

    module: str
    attr: str
    impl: Callable[..., Any]
    registries: tuple[str, ...] = ()
    optional: bool = False


@dataclasses.dataclass
class _Stats:
    calls: int = 0
    replaced: int = 0
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    passed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    places: list = dataclasses.field(default_factory=list)
    unavailable: str | None = None


class Peer:
    """One peer: its distribution name, supported versions (prefixes) and targets."""

    def __init__(self, name: str, dist: str, versions: tuple[str, ...], targets: list[Target]):
        self.name, self.dist, self.versions, self.targets = name, dist, versions, targets
        self.active: dict | None = None  # attr -> (stats, [(holder, key, original, kind)])
        self.options: Options | None = None
        self.generation = 0  # wrappers of an earlier apply run the original

    # ------------------------------------------------------------------ version
    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def check_version(self, strict: bool):
        v = self.version()
        if v is None:
            raise UnsupportedVersion(
                f"{self.name}: the {self.dist!r} distribution is not installed"
            )
        if not any(v == p or v.startswith(p) for p in self.versions):
            msg = (
                f"{self.name} {v} is not a supported version (supported: "
                f"{', '.join(p + 'x' if p.endswith('.') else p for p in self.versions)}); its "
                "functions may have changed semantics"
            )
            if strict:
                raise UnsupportedVersion(
                    msg + "; apply(..., strict=False) patches it anyway, with a warning"
                )
            warnings.warn(msg + "; patching anyway (strict=False)", stacklevel=3)
        return v

    # ------------------------------------------------------------------ apply / revert
    def apply(self, strict: bool, dtype: str):
        if dtype not in ("peer", "float32"):
            raise ValueError(f"dtype: expected 'peer' or 'float32', got {dtype!r}")
        if self.active is not None:
            self.revert()
        self.check_version(strict)
        self.options = Options(strict=strict, dtype=dtype)
        self.generation += 1
        self.active = {}
        try:
            # every module first, so that the `from ... import` copies a caller's module holds
            # exist when the functions are replaced
            mods = {t.module: _import(t) for t in self.targets}
            for t in self.targets:
                self._apply_target(t, mods[t.module])
        except Exception:
            self.revert()
            raise

    def _apply_target(self, t: Target, mod):
        if isinstance(mod, str):  # an optional target whose module does not import here
            self.active[t.attr] = (_Stats(unavailable=mod), [], None)
            return
        owner, _, name = t.attr.rpartition(".")
        holder = getattr(mod, owner) if owner else mod
        original = inspect.getattr_static(holder, name) if owner else getattr(mod, name)
        func = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        stats = _Stats()
        if inspect.isclass(original) and issubclass(original, torch.autograd.Function):
            # an autograd Function the peer calls as `F.apply(...)`: replaced by a class whose
            # apply binds the arguments of F.forward (without ctx)
            params = list(inspect.signature(original.forward).parameters.values())[1:]
            apply_fn = _make_wrapper(self, t, original.apply, stats, inspect.Signature(params))
            wrapper = type(
                original.__name__,
                (),
                {
                    "apply": staticmethod(apply_fn),
                    "__doc__": original.__doc__,
                    "__ppo_kernels_original__": original,
                },
            )
        else:
            wrapper = _make_wrapper(self, t, func, stats)
        if isinstance(original, staticmethod):
            wrapper = staticmethod(wrapper)
        places = []
        if owner:  # a class attribute (method): the class is the one place
            setattr(holder, name, wrapper)
            places.append((holder, name, original, "attr"))
        else:
            for m in list(sys.modules.values()):  # the defining module and every `from` copy
                d = getattr(m, "__dict__", None)
                if not isinstance(d, dict):
                    continue
                for k, v in list(d.items()):
                    if v is original:
                        setattr(m, k, wrapper)
                        places.append((m, k, original, "attr"))
            for r in t.registries:
                reg = getattr(mod, r)
                for k, v in list(reg.items()):
                    if v is original:
                        reg[k] = wrapper
                        places.append((reg, k, original, "item"))
        stats.places = [
            f"{getattr(h, '__name__', t.module + ' registry')}.{k}"
            if kind == "attr"
            else f"{t.module}.{_registry_name(mod, h)}[{k!r}]"
            for h, k, _, kind in places
        ]
        self.active[t.attr] = (stats, places, wrapper)

    def revert(self):
        active, self.active, self.options = self.active, None, None
        for _stats, places, wrapper in (active or {}).values():
            for holder, key, original, kind in places:
                if kind == "item":
                    if holder.get(key) is wrapper:
                        holder[key] = original
                else:
                    setattr(holder, key, original)
            if places and places[0][3] == "attr" and not inspect.isclass(places[0][0]):
                # modules that imported the replacement after apply
                original = places[0][2]
                for m in list(sys.modules.values()):
                    d = getattr(m, "__dict__", None)
                    if isinstance(d, dict):
                        for k, v in list(d.items()):
                            if v is wrapper:
                                setattr(m, k, original)

    def report(self) -> dict:
        if not self.active:
            return {"peer": self.name, "active": False, "functions": {}}
        functions = {}
        for t in self.targets:
            s = self.active[t.attr][0]
            functions[f"{t.module}.{t.attr}"] = {
                "calls": s.calls,
                "replaced": s.replaced,
                "fallbacks": sum(s.fallbacks.values()),
                "fallback_reasons": dict(s.fallbacks),
                "passed": sum(s.passed.values()),
                "passed_reasons": dict(s.passed),
                "patched_in": list(s.places),
            }
            if s.unavailable is not None:
                functions[f"{t.module}.{t.attr}"]["unavailable"] = s.unavailable
        return {
            "peer": self.name,
            "active": True,
            "version": self.version(),
            "strict": self.options.strict,
            "dtype": self.options.dtype,
            "functions": functions,
        }


def _import(t: Target):
    """The target's module, or (optional targets) the reason it does not import here."""
    try:
        return importlib.import_module(t.module)
    except Exception as e:  # noqa: BLE001 -- a peer's stack fails to import in many ways
        if not t.optional:
            raise
        return f"{t.module} does not import here: {type(e).__name__}: {e}"


def _registry_name(mod, reg):
    for k, v in vars(mod).items():
        if v is reg:
            return k
    return "registry"


def _make_wrapper(peer: Peer, t: Target, original, stats: _Stats, sig=None):
    sig = sig or inspect.signature(original)
    where = f"{peer.name}: {t.module}.{t.attr}"
    generation = peer.generation

    @functools.wraps(original, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    def wrapper(*args, **kwargs):
        stats.calls += 1
        opts = peer.options
        if opts is None or peer.generation != generation:  # reverted (a reference survived)
            return original(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # the peer's own error message
        bound.apply_defaults()
        try:
            out = t.impl(bound.arguments, original, opts)
        except Fallback as f:
            if opts.strict:
                raise Unsupported(where, f.argument, f.reason) from None
            stats.fallbacks[f"{f.argument}: {f.reason}"] += 1
            return original(*args, **kwargs)
        except Passthrough as p:
            stats.passed[p.reason] += 1
            return original(*args, **kwargs)
        except Unfused as u:
            stats.fallbacks[f"{u.argument}: {u.reason}"] += 1
            return u.result
        stats.replaced += 1
        return out

    wrapper.__ppo_kernels_original__ = original
    return wrapper


# ---------------------------------------------------------------------- helpers for adapters


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


# ---------------------------------------------------------------------- caller targets


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
