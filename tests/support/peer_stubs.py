"""Import the real verl / TRL / OpenRLHF packages without their GPU-cluster dependencies.

Installed for the tests (scripts/dev.sh): `pip install --no-deps verl==0.9.1 trl==1.16.0
openrlhf==0.11.2` plus the light pure-Python imports they need at module level (omegaconf,
accelerate, codetiming, orjson), and datasets 5.2.0 (with pandas, pyarrow) for TRL's GRPOTrainer
end to end, and ray 2.55 for tests/integrations/test_ray.py. What only a cluster needs (tensordict,
deepspeed, vllm, flash_attn, ray where absent, ...) is replaced, only when it is not installed, by
an empty stand-in module whose
attributes are inert placeholders -- enough for `import` and decorators, never called by the
per-token functions the tests exercise.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest

# Only imported at module level by the peers' trainer stacks; never on the tested code paths.
CLUSTER_ONLY = (
    "ray",
    "tensordict",
    "pandas",
    "datasets",
    "pyarrow",
    "peft",
    "flash_attn",
    "deepspeed",
    "vllm",
    "pylatexenc",
    "aiohttp",
    "torchdata",
)
# ...but never the fast paths the peers probe for with try/except ImportError: those must stay
# missing, or the peer would take a kernel path that is not there.
NEVER = ("flash_attn.ops",)


class _Placeholder(type):
    def __call__(cls, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:  # used as a decorator
            return a[0]
        return _placeholder("instance")

    def __getattr__(cls, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _placeholder(n)

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __getitem__(cls, k):
        return cls


def _placeholder(name):
    return _Placeholder(name, (), {})


class _StubModule(types.ModuleType):
    __version__ = "0.0.0+stub"

    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _placeholder(n)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if any(name == n or name.startswith(n + ".") for n in NEVER):
            raise ModuleNotFoundError(f"No module named {name!r} (a stand-in package)", name=name)
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


_installed = []


def install():
    """Stub the cluster-only packages that are not installed (once per process)."""
    if not _installed:
        missing = [
            r for r in CLUSTER_ONLY if r not in sys.modules and importlib.util.find_spec(r) is None
        ]
        sys.meta_path.append(_Finder(missing))  # last: anything real is found first
        _installed.append(missing)
    return _installed[0]


def import_peer(module):
    """Import a peer module (stubbing what it cannot import here), or skip the test."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        from .skips import missing  # (imports torch: not at start-up, where bench/ uses this)

        pytest.skip(missing(module.split(".")[0]))
    install()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module} does not import here: {e}")
