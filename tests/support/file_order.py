"""A pytest plugin (tests/conftest.py loads it) that sets the order of the test files, each
file's tests together and in their own order:

- `cost` (the default): the files that took longest first (support/file_costs.json; a file not
  in it first of all, being unknown). pytest-xdist gives each worker the next file in this order
  (`--dist loadfile`), so the long files start at once instead of ending the run on one worker
  while the other idles (its own default puts files with fewer tests last, and the longest files
  here have few tests: a Ray cluster, 2^31-element heads, end-to-end training).
- `given`: pytest's collection order. `reverse`, `shuffle` or `shuffle:SEED`: reversed or
  shuffled files. The suite must pass in any file order (support/state.py checks what a file
  leaves behind); this is how to show it. `shuffle` alone draws a seed and prints it.

Regenerate the costs (PPO_KERNELS_TEST_FILE_COSTS: another table) after a run with
`--junitxml=FILE`:
`python tests/support/file_order.py FILE` (the times of a loaded machine order the files as well).
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys

import pytest

COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_costs.json")


def pytest_addoption(parser):
    parser.addoption(
        "--file-order",
        default="cost",
        metavar="ORDER",
        help="run the test files in this order: cost (default: the longest first), given, "
        "reverse, shuffle or shuffle:SEED; the tests of a file stay together, in their order",
    )


def _parse(value: str) -> tuple[str, int | None]:
    kind, _, seed = value.partition(":")
    if kind in ("cost", "given", "reverse") and not seed:
        return kind, None
    if kind == "shuffle":
        if not seed:
            return kind, random.SystemRandom().randrange(10**6)
        if seed.isdigit():
            return kind, int(seed)
    raise pytest.UsageError(
        f"--file-order: expected cost, given, reverse, shuffle or shuffle:SEED, got {value!r}"
    )


_KEY = pytest.StashKey[tuple]()


def pytest_configure(config):
    kind, seed = _parse(config.getoption("file_order"))
    if kind == "shuffle":  # a drawn seed, written back: pytest-xdist hands the options to its
        config.option.file_order = f"shuffle:{seed}"  # workers, which must all shuffle alike
    config.stash[_KEY] = (kind, seed)
    # pytest-xdist hands out the files in the collection's order, not sorted by test count
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


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
    if kind == "cost":
        with open(os.environ.get("PPO_KERNELS_TEST_FILE_COSTS", COSTS)) as f:
            costs = json.load(f)
        order.sort(key=lambda name: -costs.get(name, float("inf")))  # stable: ties keep order
    elif kind == "reverse":
        order.reverse()
    else:
        random.Random(seed).shuffle(order)
    items[:] = [item for f in order for item in files[f]]


def _record(junit_xml: str) -> None:
    """file_costs.json from a run's JUnit XML: each file's summed test time, seconds."""
    import xml.etree.ElementTree as ET

    per: collections.Counter = collections.Counter()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        mod = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
        if mod is not None:
            per["/".join(parts[: mod + 1]) + ".py"] += float(case.get("time", 0))
    with open(COSTS, "w") as f:
        json.dump({k: round(v) for k, v in per.most_common() if v >= 1}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    _record(sys.argv[1])
