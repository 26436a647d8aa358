"""The developer tooling around the suite: scripts/pip_filter.py (what scripts/dev.sh shows of
pip) and the suite's own pytest plugins (tests/support/): the one-line-per-reason skip summary,
the file order, the state check and the quiet run's notes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

from support import ROOT, TESTS

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
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
        "purpose, tests/support/peer_stubs.py stands in for their cluster stack; `pip check` lists them"
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


def test_skip_summary_is_one_line_per_reason(tmp_path):
    """An inner pytest run with the plugin: 5 skips over 2 reasons from 3 sites, a failure and an
    xfail; -ra gives one line per reason with its count, pytest's lines for the rest."""
    (tmp_path / "test_a.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.parametrize("i", range(3))
            def test_gpu(i):
                pytest.skip("needs a CUDA GPU")

            @pytest.mark.skip(reason="needs a CUDA GPU")
            def test_gpu_marked():
                pass

            def test_peer():
                pytest.skip("verl is not installed")

            def test_fails():
                assert 1 == 2

            @pytest.mark.xfail(reason="known")
            def test_xfail():
                assert False
            """
        )
    )

    def inner(*args):
        env = {**os.environ, "PYTHONPATH": TESTS}
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "support.skip_summary",
            "-p",
            "no:cacheprovider",
        ]
        return subprocess.run(
            [*cmd, "--rootdir", str(tmp_path), *args, str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        ).stdout

    out = inner("-ra")
    lines = out.splitlines()
    skips = [x for x in lines if x.startswith("SKIPPED")]
    assert skips == ["SKIPPED [4] needs a CUDA GPU", "SKIPPED [1] verl is not installed"], out
    assert any("5 skipped, 2 reasons" in x for x in lines), out
    assert any(x.startswith("FAILED") and "test_fails" in x for x in lines), out
    assert any(x.startswith("XFAIL") and "test_xfail" in x for x in lines), out
    # before pytest's short summary: the failures stay last
    assert lines.index(skips[-1]) < next(i for i, x in enumerate(lines) if x.startswith("XFAIL"))
    assert "5 skipped" in lines[-1] and "1 failed" in lines[-1], out
    # without -rs there are none; --no-fold-skipped lists each test as pytest does
    assert "SKIPPED" not in inner("-rf")
    per_test = [x for x in inner("-ra", "--no-fold-skipped").splitlines() if "SKIPPED" in x]
    assert len(per_test) == 5, per_test
