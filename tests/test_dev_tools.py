"""The developer tooling around the suite: scripts/pip_filter.py (what scripts/dev.sh shows of
pip)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
PEERS = ["verl==0.9.1", "trl==1.16.0", "openrlhf==0.11.2"]  # as scripts/dev.sh passes them


def _filter():
    spec = importlib.util.spec_from_file_location(
        "pip_filter", os.path.join(ROOT, "scripts", "pip_filter.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.filter_lines


def _sample(name):
    # captured from pip (`pip install packaging==19.2` into a venv holding the three peers
    # installed --no-deps; a failed `pip install` of a name that does not exist)
    with open(os.path.join(DATA, name)) as f:
        return f.read().splitlines()


def test_pip_filter_folds_the_peers_pins_into_one_line():
    lines = _sample("pip_peer_conflicts.txt")
    assert sum("which is not installed" in x for x in lines) == 54  # the sample is what we think
    out = list(_filter()(lines, PEERS))
    assert out == [
        "== pip: 56 unmet requirements of the peers openrlhf 0.11.2, verl 0.9.1, trl 1.16.0 not "
        "shown (54 not installed, 2 at another version): they are installed --no-deps on "
        "purpose, tests/_peer_stubs.py stands in for their cluster stack; `pip check` lists them"
    ]


def test_pip_filter_keeps_a_block_with_any_other_package_and_what_follows():
    lines = _sample("pip_peer_conflicts.txt")
    at = next(i for i, x in enumerate(lines) if x.startswith("verl 0.9.1 requires"))
    ours = "accelerate 1.10.1 requires torch>=2.0.0, which is not installed."
    lines = [*lines[:at], ours, *lines[at:], "Successfully installed packaging-19.2"]
    out = list(_filter()(lines, PEERS))
    block = [x for x in lines if not x.startswith("WARNING: Location")]
    assert out == block  # the header and every conflict line, verbatim, in order
    # a peer not named is not a peer
    out = list(_filter()(_sample("pip_peer_conflicts.txt"), ["verl", "trl"]))
    assert out[0].startswith("ERROR: pip's dependency resolver") and len(out) == 57


def test_pip_filter_shows_real_errors_and_keeps_pips_exit_status():
    lines = _sample("pip_not_found.txt")
    out = list(_filter()(lines, PEERS))
    assert out == [
        "ERROR: Could not find a version that satisfies the requirement nonexistent-pkg-zz==1.0 "
        "(from versions: none)",
        "ERROR: No matching distribution found for nonexistent-pkg-zz==1.0",
    ]
    # dev.sh's pip_: pip's status through the filter under pipefail (what `set -euo pipefail`
    # makes of it), the filter's output streamed
    script = os.path.join(ROOT, "scripts", "pip_filter.py")
    sample = os.path.join(DATA, "pip_not_found.txt")
    for status in (0, 1):
        p = subprocess.run(
            ["bash", "-c", f'set -o pipefail; {{ cat "$0"; exit {status}; }} | "$1" "$2" verl']
            + [sample, sys.executable, script],
            capture_output=True,
            text=True,
        )
        assert p.returncode == status
        assert p.stdout.splitlines() == out
