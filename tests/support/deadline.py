"""A pytest plugin (tests/conftest.py loads it): PPO_KERNELS_TEST_DEADLINE (seconds since the
epoch) skips every test that would start after that time, with a reason that says so. CI's
sanitizer stage sets it, so that a slow machine shortens the stage instead of overrunning CI's 40
minutes; the tests that ran are reported as usual and the skip summary counts the rest. Unset
(the default): no effect."""

from __future__ import annotations

import os
import time

import pytest

ENV = "PPO_KERNELS_TEST_DEADLINE"


def deadline() -> float | None:
    """The deadline from the environment, or None; a value that is not a number is an error."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise pytest.UsageError(f"{ENV}: expected seconds since the epoch, got {raw!r}") from None


def pytest_configure(config):
    config.stash[_KEY] = deadline()


_KEY = pytest.StashKey[float | None]()


# a plain hook: after support.state's (tryfirst) snapshot, before pytest's own (the fixtures)
def pytest_runtest_setup(item):
    end = item.config.stash.get(_KEY, None)
    if end is not None and time.time() > end:
        pytest.skip(f"not run: past {ENV} (the time CI's stage had left)")
