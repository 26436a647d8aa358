"""A pytest plugin (tests/conftest.py loads it): a test file leaves the process as it found it, so that
the suite passes in any file order.

At the end of each test file (after its module fixtures tore down) it compares what the file can
change for the files after it -- ppo_kernels' modes and backend requests, the environment,
torch's global settings, the peers' patches, the registered ops -- with what it was before the
file's first test, and fails its last test (an error in teardown) naming what changed. Importing
a test file must not register ops either: the op set would depend on which files were collected
(tests/conftest.py imports the modules that register ops, before the first test)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ppo_kernels import _backend


def _peers_patched() -> list[str]:
    """The peers whose functions ppo_kernels.integrations has replaced (only adapters already
    imported are asked: asking imports nothing)."""
    if "ppo_kernels.integrations" not in sys.modules:
        return []
    import ppo_kernels.integrations as pki

    return [
        p
        for p in pki.PEERS
        if f"ppo_kernels.integrations._{p}" in sys.modules and pki.report(p)["active"]
    ]


# Variables a library sets for the whole process when first imported or used, whichever test
# does it first; none changes what a later test computes.
SET_ONCE_ENV = {
    "TORCHINDUCTOR_CACHE_DIR": "torch._inductor, on the first compile",
    "RAY_CLIENT_MODE": "ray, on import",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "verl, on import",
    "VLLM_LOGGING_LEVEL": "trl, on import",
    "TORCH_CUDA_ARCH_LIST": "verl's megatron engine, on an import that fails here",
}


def snapshot() -> dict:
    """What a test file may change for the next ones, by name."""
    env = {k: v for k, v in os.environ.items() if k not in SET_ONCE_ENV}
    return {
        "use_backend layers (ppo_kernels._backend.use_backend)": [dict(x) for x in _backend._stack],
        "the cpp backend's op namespace (use_cpp_namespace)": _backend.cpp_ops().name,
        "strict_checks": _backend.strict(),
        "batch_invariant mode": _backend.invariant(),
        "NaN-poisoned outputs (set_poison)": _backend._poison[0],
        "os.environ": env,
        "torch default dtype": torch.get_default_dtype(),
        "torch grad mode": torch.is_grad_enabled(),
        "torch inference mode": torch.is_inference_mode_enabled(),
        "torch anomaly mode": torch.is_anomaly_enabled(),
        "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch threads": torch.get_num_threads(),
        "peers patched (ppo_kernels.integrations)": _peers_patched(),
    }


def registered_ops() -> frozenset[str]:
    """Every op of the ppo_kernels* namespaces (~15 ms: taken per test file)."""
    return frozenset(
        n for n in torch._C._dispatch_get_all_op_names() if n.startswith("ppo_kernels")
    )


def changes(before: dict, after: dict) -> list[str]:
    out = []
    for name, was in before.items():
        now = after[name]
        if now == was:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
            out.append(f"{name}: {', '.join(keys)}")
        else:
            out.append(f"{name}: {was!r} -> {now!r}")
    return out


def _new_ops(before, after) -> str:
    new = sorted(after - before)
    return f"{len(new)} new ({', '.join(new[:4])}{', ...' if len(new) > 4 else ''})"


_OPS = pytest.StashKey[frozenset]()


def pytest_collection_finish(session):
    session.config.stash[_OPS] = registered_ops()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Importing a test file must not register ops either."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    before = registered_ops()
    report = yield
    after = registered_ops()
    if after != before and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"importing {collector.nodeid} registered ops: {_new_ops(before, after)}; import "
            "their module in tests/conftest.py, so that every test file sees the same ops"
        )
    return report


_FILE = pytest.StashKey[tuple]()  # (path, snapshot) at the start of the running file


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    running = item.config.stash.get(_FILE, None)
    if running is None or running[0] != item.path:
        item.config.stash[_FILE] = (item.path, snapshot())


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """At the end of each file, after its module fixtures tore down: what it left changed."""
    result = yield
    if nextitem is not None and nextitem.path == item.path:
        return result
    path, before = item.config.stash[_FILE]
    problems = changes(before, snapshot())
    known, now = item.config.stash.get(_OPS, None), registered_ops()
    if known is not None and now != known:
        item.config.stash[_OPS] = now
        problems.append(
            f"registered ops: {_new_ops(known, now)} (import their module in "
            "tests/conftest.py, so that every test file sees the same ops)"
        )
    if problems:
        raise AssertionError(
            f"{path.name} left process-wide state changed for the files after it (restore it, "
            "e.g. with a context manager or monkeypatch): " + "; ".join(problems)
        )
    return result
