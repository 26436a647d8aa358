"""A pytest plugin (tests/conftest.py loads it): `--file-order=reverse` or
`--file-order=shuffle:SEED` runs the collected test files in reversed or shuffled order, each
file's tests together and in their own order. The suite must pass in any file order
(support/state.py checks what a file leaves behind); this is how to show it. `shuffle` alone
draws a seed and prints it."""

from __future__ import annotations

import random

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--file-order",
        default="given",
        metavar="ORDER",
        help="run the test files in this order: given (default), reverse, shuffle or "
        "shuffle:SEED; the tests of a file stay together, in their order",
    )


def _parse(value: str) -> tuple[str, int | None]:
    kind, _, seed = value.partition(":")
    if kind in ("given", "reverse") and not seed:
        return kind, None
    if kind == "shuffle":
        if not seed:
            return kind, random.SystemRandom().randrange(10**6)
        if seed.isdigit():
            return kind, int(seed)
    raise pytest.UsageError(
        f"--file-order: expected given, reverse, shuffle or shuffle:SEED, got {value!r}"
    )


_KEY = pytest.StashKey[tuple]()


def pytest_configure(config):
    kind, seed = _parse(config.getoption("file_order"))
    if kind == "shuffle":  # a drawn seed, written back: pytest-xdist hands the options to its
        config.option.file_order = f"shuffle:{seed}"  # workers, which must all shuffle alike
    config.stash[_KEY] = (kind, seed)


def pytest_report_header(config):
    kind, seed = config.stash[_KEY]
    if kind == "reverse":
        return "file order: reversed"
    if kind == "shuffle":
        return f"file order: shuffled (--file-order=shuffle:{seed} repeats it)"
    return None


def file_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)  # after any plugin that reorders tests within the files
def pytest_collection_modifyitems(config, items):
    kind, seed = config.stash[_KEY]
    if kind == "given":
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(file_of(item), []).append(item)
    order = list(files)
    if kind == "reverse":
        order.reverse()
    else:
        random.Random(seed).shuffle(order)
    items[:] = [item for f in order for item in files[f]]
