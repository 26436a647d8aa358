"""Plugin: the Triton interpreter (TRITON_INTERPRET=1) without its repeated patching.

A kernel launch patches triton.language's builtins for the interpreter and restores them when it
ends. Every call of a @triton.jit device function inside the kernel patches them again
(`_patch_lang`: a scan of every member of triton.language, its tensor and math modules, about
2 ms), though the launch's patch still holds; a kernel that calls its helpers once per tile
spends about half its interpreted time there. While a launch's patch holds, a device function
whose triton.language modules it covers is not patched again: the same functions run, as the
launch patched them. Nothing changes where the interpreter's internals differ from what this
expects (another triton): it then runs as shipped, only slower.
"""

import inspect
import os
import threading


class _Held:
    """The scope of a patch the launch already made: nothing to restore."""

    def restore(self):
        pass


def install():
    """Wraps the interpreter's `_patch_lang` once per process; returns whether it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or hasattr(patch, "wrapped"):  # absent, or installed already
        return False
    params = list(inspect.signature(patch).parameters)
    if params != ["fn"] or not hasattr(interpreter, "InterpretedFunction"):
        return False
    held = threading.local()  # the language modules the running launch patched (ids)
    langs_of = {}  # a function's triton.language modules (its module's globals: read once)

    def _langs(fn):
        langs = langs_of.get(fn)
        if langs is None:
            mods = (tl, tl.core)
            langs = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in mods))
            langs_of[fn] = langs
        return langs

    def _patch_lang(fn):
        langs = _langs(fn)
        outer = getattr(held, "langs", None)
        if outer is not None and langs and langs <= outer:
            return _Held()
        scope = _patch_lang.wrapped(fn)
        held.langs = langs if outer is None else outer | langs
        restore = scope.restore

        def _restore():
            restore()
            held.langs = outer

        scope.restore = _restore
        return scope

    _patch_lang.wrapped = patch  # the interpreter's own
    interpreter._patch_lang = _patch_lang
    return True


def pytest_configure(config):
    install()
