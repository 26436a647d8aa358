"""The developer tooling around the suite: scripts/pip_filter.py (what scripts/dev.sh shows of
pip), scripts/uv_args.py (pip's configuration as uv's arguments) and the suite's own pytest
plugins (tests/support/): the one-line-per-reason skip summary, the file order, the state check,
the quiet run's notes, the deadline and the Triton interpreter's single patch per launch."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
from support import ROOT, TESTS, skips
from support.skips import requires_triton

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PEERS = ["verl==0.9.1", "trl==1.16.0", "openrlhf==0.11.2"]  # as scripts/dev.sh passes them

try:  # a kernel that calls a device function in a loop, for the Triton interpreter's plugin
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled_exp(x, s):
        return tl.exp(x) * s

    @triton.jit
    def _exp_sum_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        acc = tl.zeros([N], dtype=tl.float32)
        for i in range(STEPS):
            acc += _scaled_exp(x, i + 1.0)
        tl.store(out_ptr + offs, acc)

except ImportError:
    pass


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


def _uv_script():
    spec = importlib.util.spec_from_file_location(
        "uv_args", os.path.join(ROOT, "scripts", "uv_args.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _uv_args(lines):
    return _uv_script().uv_args(lines)


def test_uv_args_follow_pips_configuration():
    # `pip config list` of a machine with local indexes (its files and PIP_* variables)
    conf = [
        ":env:.cert='/etc/ssl/certs/ca.crt'",
        ":env:.find-links='/opt/wheels /opt/more'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/ignored/by/the/environment'",
        "global.index-url='https://mirror.example/simple'",
        "global.no-index='false'",
        "download.dest='/tmp/not-install'",
        "install.pre='true'",
    ]
    assert _uv_args(conf) == [
        "--index-strategy", "unsafe-best-match",
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels", "--find-links", "/opt/more",
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--prerelease=allow",
    ]  # fmt: skip
    assert _uv_args(["global.no-index='true'"])[2:] == ["--no-index"]
    assert _uv_args([]) == ["--index-strategy", "unsafe-best-match"]
    # what uv reads from the environment: pip's certificate bundle and timeout, unless already set
    conf += [":env:.default-timeout='180'"]
    uv_env = _uv_script().uv_env
    assert uv_env(conf, environ={}) == [
        "SSL_CERT_FILE=/etc/ssl/certs/ca.crt",
        "UV_HTTP_TIMEOUT=180",
    ]
    assert uv_env(conf, environ={"SSL_CERT_FILE": "/mine.pem"}) == ["UV_HTTP_TIMEOUT=180"]
    assert uv_env([], environ={}) == []


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


def _pytest(folder, plugin, *args):
    """An inner pytest run of the test files in `folder` with one of the suite's plugins (and
    none of its conftest). No other installed plugin is loaded (importing hypothesis and the
    rest is most of an inner run's time), but pytest-xdist where `-n` asks for workers."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([TESTS, ROOT]),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    cmd = [sys.executable, "-m", "pytest", "-p", plugin, "-p", "no:cacheprovider"]
    if "-n" in args:
        cmd += ["-p", "xdist"]
    return subprocess.run(
        [*cmd, "--rootdir", str(folder), *args, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=300,
    )


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
        return _pytest(tmp_path, "support.skip_summary", "-q", *args).stdout

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


def _files(folder, **files):
    for name, text in files.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text))


def test_file_order_moves_whole_files(tmp_path):
    """--file-order=cost (the default) / reverse / shuffle:SEED reorder the files, each file's
    tests together and in their order; a seed gives the same order every time; a bad value is a
    usage error."""
    two = "def test_1():\n    pass\n\ndef test_2():\n    pass\n"
    _files(tmp_path, **{f"test_{c}": two for c in "abcde"})

    def order(*args):
        r = _pytest(tmp_path, "support.file_order", "--collect-only", "-q", *args)
        return [x for x in r.stdout.splitlines() if "::" in x]

    given = order()
    assert given == [f"test_{c}.py::test_{i}" for c in "abcde" for i in (1, 2)]
    assert order("--file-order=reverse") == [
        f"test_{c}.py::test_{i}" for c in "edcba" for i in (1, 2)
    ]
    shuffled = {seed: order(f"--file-order=shuffle:{seed}") for seed in (1, 2)}
    for got in shuffled.values():
        files = [x.split("::")[0] for x in got[::2]]
        assert got == [f"{f}::test_{i}" for f in files for i in (1, 2)]  # whole files, in order
        assert sorted(files) == [f"test_{c}.py" for c in "abcde"]
    assert given not in shuffled.values() and shuffled[1] != shuffled[2]
    assert order("--file-order=shuffle:1") == shuffled[1]
    # cost (the default): the recorded longest first, a file without a record before them
    costs = tmp_path / "costs.json"
    costs.write_text('{"test_c.py": 50, "test_a.py": 10, "test_e.py": 30, "test_b.py": 1}')
    os.environ["PPO_KERNELS_TEST_FILE_COSTS"] = str(costs)
    try:
        by_cost = order()
    finally:
        del os.environ["PPO_KERNELS_TEST_FILE_COSTS"]
    assert by_cost == [f"test_{c}.py::test_{i}" for c in "dceab" for i in (1, 2)]
    assert order("--file-order=given") == given
    bad = _pytest(tmp_path, "support.file_order", "--file-order=backwards")
    assert bad.returncode == 4 and "--file-order: expected" in bad.stderr, bad.stderr


def test_state_check_names_what_a_file_leaves_changed(tmp_path):
    """A file that leaves an environment variable, torch's default dtype or a ppo_kernels mode
    changed, or registers ops, fails (its last test, at teardown), naming what; a file that
    restores what it changed passes."""
    _files(
        tmp_path,
        test_a="""
            import os
            import torch
            from ppo_kernels import _backend

            def test_leaks():
                os.environ["PPO_KERNELS_BACKEND"] = "eager"
                torch.set_default_dtype(torch.float64)
                _backend.set_poison(True)

            def test_last():
                pass
            """,
        test_b="""
            import os
            import torch
            from ppo_kernels import _backend

            def test_restores(monkeypatch):
                monkeypatch.setenv("PPO_KERNELS_BACKEND", "eager")
                with _backend.use_backend("eager"):
                    pass
                torch.set_default_dtype(torch.float32)
                _backend.set_poison(False)
                os.environ.pop("PPO_KERNELS_BACKEND", None)
            """,
        test_d="""
            import torch

            LIBS = []

            def test_registers():
                LIBS.append(torch.library.Library("ppo_kernels_test_run", "DEF"))
                LIBS[-1].define("g(Tensor x) -> Tensor")
            """,
    )
    r = _pytest(tmp_path, "support.state", "-q")
    out = r.stdout
    assert "test_a.py left process-wide state changed" in out, out
    assert "os.environ: PPO_KERNELS_BACKEND" in out, out
    assert "torch default dtype: torch.float32 -> torch.float64" in out, out
    assert "NaN-poisoned outputs (set_poison): False -> True" in out, out
    assert "test_d.py left" in out and "1 new (ppo_kernels_test_run::g)" in out, out
    assert "test_b.py" not in out.split("short test summary")[-1], out
    assert "4 passed, 2 errors" in out, out
    # registering ops on import: a collection error
    _files(
        tmp_path,
        test_c="""
            import torch

            LIB = torch.library.Library("ppo_kernels_test_import", "DEF")
            LIB.define("f(Tensor x) -> Tensor")
            """,
    )
    out = _pytest(tmp_path, "support.state", "-q", str(tmp_path / "test_c.py")).stdout
    assert "importing test_c.py registered ops: 1 new (ppo_kernels_test_import::f)" in out, out


def test_quiet_run_names_the_running_file(tmp_path):
    """-q: a silence longer than --quiet-notes seconds gets a line naming the running file, in
    one process and under pytest-xdist; none without -q or with --quiet-notes=0."""
    _files(
        tmp_path,
        test_slow="import time\n\ndef test_slow():\n    time.sleep(3)\n",
        test_fast="def test_fast():\n    pass\n",
    )
    note = re.compile(r"^\[\d+ s in test_slow\.py\]$", re.M)
    for args in (["-q"], ["-q", "-n", "2"]):
        out = _pytest(tmp_path, "support.progress", "--quiet-notes=1", *args).stdout
        assert note.search(out) and "2 passed" in out, (args, out)
    for args in (["--quiet-notes=1"], ["-q", "--quiet-notes=0"]):
        out = _pytest(tmp_path, "support.progress", *args).stdout
        assert "s in test_slow.py]" not in out and "2 passed" in out, (args, out)


def test_deadline_skips_the_tests_that_would_start_after_it(tmp_path, monkeypatch):
    """PPO_KERNELS_TEST_DEADLINE: the tests before it run, those after it are skipped with a
    reason naming it, and a module fixture of a file wholly past it never runs."""
    _files(
        tmp_path,
        test_a="""
            import time

            def test_first():
                time.sleep(2)

            def test_second():
                pass
            """,
        test_b="""
            import pytest

            @pytest.fixture(scope="module")
            def costly():
                raise AssertionError("set up past the deadline")

            def test_b(costly):
                pass
            """,
    )
    # the deadline 1 s after the inner run's start (its conftest, read before the plugin's
    # configure), not this process's clock: the inner interpreter's start on a loaded machine
    # took longer than that
    conftest = tmp_path / "conftest.py"
    conftest.write_text(
        "import os, time\n\nos.environ['PPO_KERNELS_TEST_DEADLINE'] = str(time.time() + 1)\n"
    )
    p = _pytest(tmp_path, "support.deadline", "-q", "-rs")
    conftest.unlink()
    assert "1 passed, 2 skipped" in p.stdout, p.stdout
    assert "past PPO_KERNELS_TEST_DEADLINE" in p.stdout, p.stdout
    monkeypatch.setenv("PPO_KERNELS_TEST_DEADLINE", "soon")
    p = _pytest(tmp_path, "support.deadline", "-q")
    assert p.returncode != 0 and "expected seconds since the epoch" in p.stdout + p.stderr
    monkeypatch.delenv("PPO_KERNELS_TEST_DEADLINE")
    p = _pytest(tmp_path, "support.deadline", "-q")
    assert p.returncode != 0 and "set up past the deadline" in p.stdout  # unset: everything runs


def test_skip_reasons_come_from_support_skips():
    """Every skip of the suite takes its reason from support/skips.py (a name there, or a string
    built at run time with what went wrong): a literal reason written at the call is a second
    wording of a cause the skip summary would list twice. pytest.importorskip without a reason
    is one too (support.skips.need says how the package gets installed)."""
    import ast
    import glob

    def literal(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    found = []
    for path in glob.glob(os.path.join(TESTS, "**", "*.py"), recursive=True):
        if path.endswith(os.path.join("support", "skips.py")):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if "skip" not in name:  # pytest.skip, .importorskip, .mark.skip, .mark.skipif
                continue
            reason = [k.value for k in node.keywords if k.arg == "reason"]
            if name == "pytest.skip" and node.args:
                reason.append(node.args[0])
            if any(literal(r) for r in reason) or (name == "pytest.importorskip" and not reason):
                found.append(f"{os.path.relpath(path, TESTS)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "reasons not from support/skips.py:\n" + "\n".join(found)


@requires_triton
def test_triton_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """support/triton_interpreter.py: under TRITON_INTERPRET=1 (the suite's setting without a
    GPU) a launch patches triton.language once, not again in each device-function call; the
    kernel's result is the one its math gives, and the builtins are restored after the launch."""
    import torch
    from support import triton_interpreter
    from triton.runtime import interpreter

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(skips.NOT_INTERPRETED)
    assert hasattr(interpreter._patch_lang, "wrapped")  # the suite installed it
    assert not triton_interpreter.install()  # once per process
    calls = []
    wrapped = interpreter._patch_lang.wrapped
    monkeypatch.setattr(
        interpreter._patch_lang, "wrapped", lambda fn: calls.append(fn.__name__) or wrapped(fn)
    )
    x = torch.linspace(-2, 2, 16)
    out = torch.full_like(x, float("nan"))
    _exp_sum_kernel[(1,)](x, out, N=16, STEPS=5)
    # the launch's patch (and a helper's module that names triton.language.core besides), not
    # one for each of the 5 calls of _scaled_exp, whose module the launch's patch covers
    assert calls[0] == "_exp_sum_kernel" and "_scaled_exp" not in calls, calls
    torch.testing.assert_close(out, x.exp() * 15)
    assert tl.core.is_builtin(tl.exp)  # restored: the interpreter's patch is gone
