"""bench/gpu_check.py: its correctness phase runs the `cuda` tests in pytest subprocesses and reads
every result back into its report; the timing and sanitizer workloads of the ops never timed on the
device yet are rehearsed on the CPU (the GPU run itself cannot happen here)."""

import importlib
import importlib.util
import sys

import pytest
from support import BENCH

sys.path.insert(0, BENCH)
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


def test_only_selects_an_ops_test_files():
    """--only OP: test_cuda_OP.py and test_cuda_OP_*.py (the sampler's losses with the sampler),
    no other op's whose name starts alike."""
    names = [f.stem for f in sorted(gpu_check.CUDA_TESTS.glob("test_cuda_*.py"))]
    ops = [n.removeprefix("test_cuda_") for n in names]
    assert [n for n in ops if gpu_check._selected(n, ["sampler"])] == ["sampler", "sampler_losses"]
    assert [n for n in ops if gpu_check._selected(n, ["kl"])] == ["kl"]
    assert [n for n in ops if gpu_check._selected(n, ["linear_logprobs"])] == ["linear_logprobs"]


def test_correctness_phase_without_pytest(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else find(name, *a)
    )
    ((rows, problems),) = list(gpu_check._correctness([]))
    assert rows == [] and "pytest is not installed" in problems[0]
    assert gpu_check._correctness_section(rows, problems)[1] == 1


class _RunOnce:
    """A Ctx stand-in: each timed callable runs once; what raised is kept."""

    def __init__(self):
        self.ran, self.errors, self.profiles = [], [], []

    def profile(self, op, case, rows):
        self.profiles.append((op, case, rows))

    def bench(self, op, case, fns, bytes_moved=None, warmup=25, rep=100):
        for name, fn in fns.items():
            try:
                fn()
                self.ran.append(name)
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{case} / {name}: {type(e).__name__}: {e}")


@pytest.mark.parametrize(
    "op",
    [
        "linear_logprobs",
        "linear_policy_loss",
        "linear_distill_loss",
        "linear_preference_loss",
        "sampler",
    ],
)
def test_timing_and_sanitizer_workloads_rehearsed_on_the_cpu(op, monkeypatch):
    """The device runs these only when a GPU is lent (seldom, and briefly): their Python
    -- argument names, the peers' calls -- is rehearsed here at small sizes on the CPU, so a
    mistake in it does not cost device time."""
    mod = importlib.import_module(f"gpu_checks.{op}")
    monkeypatch.setattr(mod, "DEVICE", "cpu")
    if op == "linear_policy_loss":
        monkeypatch.setattr(mod, "T", 64)  # tokens per sequence: N=256 is 4 sequences
        # Liger's default is compiled chunks; eager ones run the same calls without a compile
        # (the module's own _liger still returns None without Liger)
        eager_liger = mod.liger_module
        monkeypatch.setattr(mod, "liger_module", lambda compiled: eager_liger(False))
    if op == "linear_preference_loss":
        monkeypatch.setattr(mod, "T", 64)  # tokens per completion: N=256 is 2 pairs
    if op == "sampler":  # the Triton interpreter runs the sampler's search per element (minutes
        # here); the Triton rows are the same public calls under another backend name
        backends = mod._backends
        monkeypatch.setattr(mod, "_backends", lambda o: [b for b in backends(o) if b != "triton"])
    if op in ("linear_distill_loss", "linear_preference_loss"):  # Liger's compiled default as
        liger = mod._liger  # eager chunks (as above)
        monkeypatch.setattr(mod, "_liger", lambda compiled=True: liger(False))
    ctx = _RunOnce()
    mod.timing(ctx, N=256, H=64, V=1000)
    assert ctx.errors == []
    assert len(ctx.ran) >= 4, ctx.ran
    mod.sanitize_workload()
    mod.profile(ctx, N=256, H=64, V=1000)  # (CPU ops here, CUDA kernels on the device)
    (got,) = ctx.profiles
    assert (
        got[0] == getattr(mod, "PROFILED", mod.OP) and got[2] and all(r["ms"] > 0 for r in got[2])
    )
    table = gpu_check.profile_section(ctx.profiles)
    assert any("aten::mm" in line or "aten::addmm" in line for line in table), table
