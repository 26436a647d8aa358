"""The patch machinery shared by the peer adapters: one `Target` per peer function, replaced
wherever the peer can reach it, counted, and put back by `revert`. The adapters' argument helpers
are in `_args`, the caller-target helpers (one pass for two calls) in `_fused`.

A target's replacement receives the call's arguments bound by name to the original's signature
(defaults applied). It raises `Fallback(argument, reason)` -- before doing anything -- when the
call uses something our ops cannot express; under strict=True that becomes `Unsupported` naming
the argument, under strict=False the original runs for that call and the reason is counted.
"""

from __future__ import annotations

import collections
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


class Unsupported(ValueError):
    """A peer call uses an argument value the ppo_kernels op cannot express (strict=True).

    A ValueError. `apply(..., strict=False)` runs the peer's own code for such calls instead.

    Args:
        where (str): the replaced function.
        argument (str): the argument whose value cannot be expressed; kept as `.argument`.
        reason (str): why not.
    """

    def __init__(self, where: str, argument: str, reason: str):
        super().__init__(
            f"{where}: argument {argument!r}: {reason} (ppo_kernels cannot express "
            "this; apply(..., strict=False) runs the peer's own code for such calls)"
        )
        self.argument = argument
        self.reason = reason


class UnsupportedVersion(RuntimeError):
    """A peer is not installed, or its version is not one the adapter was checked against.

    A RuntimeError raised by `apply(..., strict=True)`; `strict=False` patches another version
    with a warning. `supported_versions(peer)` lists the checked ones.
    """


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


class Noted:
    """An impl's result, replaced, with a note on how (e.g. "the logits path: the LM head is not a
    plain Linear"): counted under `notes` in `report`, the call still counts as replaced."""

    def __init__(self, result, note: str):
        self.result, self.note = result, note


@dataclasses.dataclass
class Options:
    strict: bool
    dtype: str  # "peer": the dtype the peer's function returns; "float32": ours
    extras: dict = dataclasses.field(default_factory=dict)  # a peer's own options (Peer.configure)

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
    notes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    places: list = dataclasses.field(default_factory=list)
    unavailable: str | None = None


class Peer:
    """One peer: its distribution name, supported versions (prefixes) and targets. `configure`:
    the peer's own `apply` options (keywords -> Options.extras, checked), `report_extra` the
    report's keys they add (extras -> dict)."""

    def __init__(
        self,
        name: str,
        dist: str,
        versions: tuple[str, ...],
        targets: list[Target],
        configure: Callable[..., dict] | None = None,
        report_extra: Callable[[dict], dict] | None = None,
    ):
        self.name, self.dist, self.versions, self.targets = name, dist, versions, targets
        self.configure, self.report_extra = configure, report_extra
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
    def apply(self, strict: bool, dtype: str, **options):
        if dtype not in ("peer", "float32"):
            raise ValueError(f"dtype: expected 'peer' or 'float32', got {dtype!r}")
        given = {k: v for k, v in options.items() if v is not None}
        if given and self.configure is None:
            raise ValueError(f"{', '.join(given)}: not an option of the {self.name} patch")
        extras = self.configure(**options) if self.configure is not None else {}
        if self.active is not None:
            self.revert()
        self.check_version(strict)
        self.options = Options(strict=strict, dtype=dtype, extras=extras)
        self.generation += 1
        self.active = {}
        try:
            # every module first, so that the `from ... import` copies a caller's module holds
            # exist when the functions are replaced
            mods = {t.module: _import(t) for t in self.targets}
            copies: dict = {}  # id(original) -> (original, wrapper, places): one scan for all
            for t in self.targets:
                self._apply_target(t, mods[t.module], copies)
            _replace_copies(copies)
            for t in self.targets:
                stats, places, _ = self.active[t.attr]
                stats.places = [
                    _place_name(t, mods[t.module], h, k, kind) for h, k, _, kind in places
                ]
        except Exception:
            self.revert()
            raise

    def _apply_target(self, t: Target, mod, copies: dict):
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
            wrapper = _make_wrapper(self, t, func, stats, _function_apply_signature(func))
        if isinstance(original, staticmethod):
            wrapper = staticmethod(wrapper)
        places = []
        if owner:  # a class attribute (method): the class is the one place
            setattr(holder, name, wrapper)
            places.append((holder, name, original, "attr"))
        else:  # the defining module and every `from` copy: filled by _replace_copies
            copies.setdefault(id(original), (original, wrapper, places))
            for r in t.registries:
                reg = getattr(mod, r)
                for k, v in list(reg.items()):
                    if v is original:
                        reg[k] = wrapper
                        places.append((reg, k, original, "item"))
        self.active[t.attr] = (stats, places, wrapper)

    def revert(self):
        active, self.active, self.options = self.active, None, None
        late = {}  # id(wrapper) -> original, for modules that imported it after apply
        for _stats, places, wrapper in (active or {}).values():
            for holder, key, original, kind in places:
                if kind == "item":
                    if holder.get(key) is wrapper:
                        holder[key] = original
                else:
                    setattr(holder, key, original)
                    if not inspect.isclass(holder):
                        late[id(wrapper)] = (wrapper, original)
        for m, k, v in _module_items():
            hit = late.get(id(v))
            if hit is not None and hit[0] is v:
                setattr(m, k, hit[1])

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
                "notes": dict(s.notes),
                "patched_in": list(s.places),
            }
            if s.unavailable is not None:
                functions[f"{t.module}.{t.attr}"]["unavailable"] = s.unavailable
        extra = self.report_extra(self.options.extras) if self.report_extra is not None else {}
        return {
            "peer": self.name,
            "active": True,
            "version": self.version(),
            "strict": self.options.strict,
            "dtype": self.options.dtype,
            **extra,
            "functions": functions,
        }


def _module_items():
    """(module, name, value) of every loaded module's globals (a snapshot: callers set them)."""
    for m in list(sys.modules.values()):
        d = getattr(m, "__dict__", None)
        if isinstance(d, dict):
            for k, v in list(d.items()):
                yield m, k, v


def _replace_copies(copies: dict):
    """Every module global holding one of the originals (its defining module and each `from ...
    import` copy) set to its wrapper, in one pass over the loaded modules."""
    if not copies:
        return
    for m, k, v in _module_items():
        hit = copies.get(id(v))
        if hit is not None and hit[0] is v:
            setattr(m, k, hit[1])
            hit[2].append((m, k, v, "attr"))


def _place_name(t: Target, mod, holder, key, kind):
    if kind == "attr":
        return f"{getattr(holder, '__name__', t.module + ' registry')}.{key}"
    return f"{t.module}.{_registry_name(mod, holder)}[{key!r}]"


def _import(t: Target):
    """The target's module, or (optional targets) the reason it does not import here."""
    try:
        return importlib.import_module(t.module)
    except Exception as e:  # noqa: BLE001 -- a peer's stack fails to import in many ways
        if not t.optional:
            raise
        return f"{t.module} does not import here: {type(e).__name__}: {e}"


def _function_apply_signature(func):
    """The arguments of `F.forward` (without ctx) when `func` is an autograd Function's bound
    `apply` held under a name of its own (verl's `linear_cross_entropy = LinearCrossEntropy.apply`),
    else None (the function's own signature)."""
    owner = getattr(func, "__self__", None)
    if (
        getattr(func, "__name__", None) == "apply"
        and inspect.isclass(owner)
        and issubclass(owner, torch.autograd.Function)
    ):
        params = list(inspect.signature(owner.forward).parameters.values())[1:]
        return inspect.Signature(params)
    return None


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
        if isinstance(out, Noted):
            stats.notes[out.note] += 1
            out = out.result
        return out

    wrapper.__ppo_kernels_original__ = original
    return wrapper
