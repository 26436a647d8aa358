"""bench/gpu_check.py's correctness phase: it runs the `cuda` tests in pytest subprocesses and
reads every result back into its report (the GPU run itself cannot happen here)."""

import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import gpu_check  # noqa: E402

FAKE = """
import pytest

@pytest.mark.cuda
def test_ok():
    pass

@pytest.mark.cuda
def test_bad():
    assert 1 == 2, "one | two"

@pytest.mark.cuda
def test_skip():
    pytest.skip("no GPU")

def test_not_marked():  # not a cuda test: not run
    pass
"""


def test_correctness_phase_reads_every_result(tmp_path, monkeypatch):
    (tmp_path / "test_cuda_fake.py").write_text(FAKE)
    monkeypatch.setattr(gpu_check, "CUDA_TESTS", tmp_path)
    ((rows, problems),) = list(gpu_check._correctness(["fake"]))
    assert problems == []
    assert {r["test"]: r["result"] for r in rows} == {
        "test_ok": "passed",
        "test_bad": "**FAILED**",
        "test_skip": "skipped",
    }
    bad = next(r for r in rows if r["test"] == "test_bad")
    assert "one | two" in bad["message"]
    lines, failed = gpu_check._correctness_section(rows, problems)
    assert failed == 1
    assert "1 passed, 1 failed, 1 skipped" in lines
    assert any("one / two" in line for line in lines)  # no stray table cell
    assert list(gpu_check._correctness(["other"])) == []  # --only: no test file, nothing runs


def test_correctness_phase_without_pytest(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else find(name, *a)
    )
    ((rows, problems),) = list(gpu_check._correctness([]))
    assert rows == [] and "pytest is not installed" in problems[0]
    assert gpu_check._correctness_section(rows, problems)[1] == 1
