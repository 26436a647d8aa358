"""A pytest plugin (tests/conftest.py loads it): each test file leaves the process as it found it,
so that the suite passes in any file order.

At the end of each test file (after its module fixtures tore down) it compares what the file can
change for the files after it -- ppo_kernels' modes and backend requests, the environment,
torch's global settings, the peers' patches, the registered ops -- with what it was before the
file's first test. What changed fails the file's last test (an error in its teardown, naming it)
and is put back, so that the files after it run as they would have. Importing a test file must
not register ops either: the op set would depend on which files were collected (tests/conftest.py
imports the modules that register ops, before the first test)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ppo_kernels import _backend, _dispatch, _extension, _outputs, _settings

# Variables set by pytest for the running test, or by a library for the whole process when first
# imported or used (whichever test does it first); none changes what a later test computes.
SET_ONCE_ENV = {
    "PYTEST_CURRENT_TEST": "pytest, for each test and phase",
    "TORCHINDUCTOR_CACHE_DIR": "torch._inductor, on the first compile",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "torch._inductor, on a CPU compile",
    "KMP_DUPLICATE_LIB_OK": "torch._inductor, on a CPU compile",
    "TORCH_WARM_POOL": "torch._inductor, on its compile workers' start",
    "TRITON_CACHE_DIR": "torch._inductor, on a GPU compile",
    "TRITON_PTXAS_PATH": "torch._inductor, on a GPU compile",
    "TRITON_LIBDEVICE_PATH": "torch._inductor, on a GPU compile",
    "CUDA_HOME": "torch._inductor, on a GPU compile",
    "RAY_CLIENT_MODE": "ray, on import",
    "RAY_USAGE_STATS_ENABLED": "ray, on ray.init",
    "PYTHONBREAKPOINT": "ray, on ray.init",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "verl, on import",
    "VLLM_LOGGING_LEVEL": "trl, on import",
    "TORCH_CUDA_ARCH_LIST": "verl's megatron engine, on an import that fails here",
}


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


def _set_env(env: dict):
    for k in [k for k in os.environ if k not in env and k not in SET_ONCE_ENV]:
        del os.environ[k]
    os.environ.update(env)


def _set_stack(stack: list, values: list, sync):
    stack[:] = values
    sync()


def _set_cpp_namespace(names: list):
    _extension._cpp_namespace[:] = names
    if _backend.HAS_EXTENSION:
        torch.ops.ppo_kernels_C.set_cpp_namespace(names[-1])


def _revert_peers(patched: list):
    if "ppo_kernels.integrations" in sys.modules:
        import ppo_kernels.integrations as pki

        for p in set(_peers_patched()) - set(patched):
            pki.revert(p)


# name: (read, put back). The modes are stacks (one layer per open context): a context entered
# and never left shows as a layer more.
STATE = {
    "use_backend layers": (
        lambda: [dict(x) for x in _dispatch._stack],
        lambda v: _set_stack(_dispatch._stack, v, _dispatch._invalidate),
    ),
    "the cpp backend's op namespaces (use_cpp_namespace)": (
        lambda: list(_extension._cpp_namespace),
        _set_cpp_namespace,
    ),
    "strict_checks layers": (
        lambda: list(_settings._strict),
        lambda v: _set_stack(_settings._strict, v, _settings._mirror_strict),
    ),
    "batch_invariant layers": (
        lambda: list(_settings._invariant),
        lambda v: _set_stack(_settings._invariant, v, _settings._sync_invariant),
    ),
    "NaN-poisoned outputs (set_poison)": (lambda: _outputs._poison[0], _outputs.set_poison),
    "os.environ": (
        lambda: {k: v for k, v in os.environ.items() if k not in SET_ONCE_ENV},
        _set_env,
    ),
    "torch default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "torch grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "torch anomaly mode": (torch.is_anomaly_enabled, torch.autograd.set_detect_anomaly),
    "torch deterministic algorithms": (
        torch.are_deterministic_algorithms_enabled,
        torch.use_deterministic_algorithms,
    ),
    "torch threads": (torch.get_num_threads, torch.set_num_threads),
    "peers patched (ppo_kernels.integrations)": (_peers_patched, _revert_peers),
}


def snapshot() -> dict:
    """What a test file may change for the next ones, by name."""
    return {name: read() for name, (read, _) in STATE.items()}


def changes(before: dict, after: dict) -> list[str]:
    """What differs, in words; puts it back as it was before."""
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
        STATE[name][1](was)
    return out


def registered_ops() -> frozenset[str]:
    """Every op of the ppo_kernels* namespaces (some ms: taken per test file)."""
    return frozenset(
        n for n in torch._C._dispatch_get_all_op_names() if n.startswith("ppo_kernels")
    )


def _new_ops(before, after) -> str:
    new = sorted(after - before)
    return f"{len(new)} new ({', '.join(new[:4])}{', ...' if len(new) > 4 else ''})"


_OPS = pytest.StashKey[frozenset]()
_FILE = pytest.StashKey[tuple]()  # (path, snapshot) at the start of the running file
_ADVICE = "import their module in tests/conftest.py, so that every test file sees the same ops"


def pytest_collection_finish(session):
    session.config.stash[_OPS] = registered_ops()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Importing a test file must not register ops."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    before = registered_ops()
    report = yield
    after = registered_ops()
    if after != before and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"importing {collector.nodeid} registered ops: {_new_ops(before, after)}; {_ADVICE}"
        )
    return report


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
        problems.append(f"registered ops: {_new_ops(known, now)} ({_ADVICE})")
    if problems:
        raise AssertionError(
            f"{path.name} left process-wide state changed for the files after it (put back "
            "now; restore it in the test, e.g. with a context manager or monkeypatch): "
            + "; ".join(problems)
        )
    return result
