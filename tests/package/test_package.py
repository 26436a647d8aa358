"""The package as a user meets it: import without the compiled extension, `info`, backends."""

import os
import subprocess
import sys

import torch
from support import ROOT, TESTS
from support.utils import registered_ops

import ppo_kernels
from ppo_kernels import _backend


def _run(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_imports_and_works_without_the_extension_with_one_warning():
    code = (
        "import torch, ppo_kernels as pk\n"
        "x = torch.randn(3, 17); y = torch.randint(0, 17, (3,))\n"
        "ref = torch.log_softmax(x, -1).gather(-1, y[:, None])[:, 0]\n"
        "assert torch.allclose(pk.token_logprobs(x, y), ref, atol=1e-6)\n"
        "from ppo_kernels import _backend\n"
        "assert not _backend.HAS_EXTENSION\n"
        "assert _backend.resolve('token_logprobs', 'cpu') == 'eager'\n"
        "print('OK')\n"
    )
    r = _run(code, PPO_KERNELS_NO_EXTENSION="1")
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout
    assert r.stderr.count("compiled extension is not available") == 1, r.stderr


def test_info_lists_every_op_and_backend():
    r = _run("from ppo_kernels.__main__ import main; main(['info'])")
    assert r.returncode == 0, r.stderr
    assert f"torch {torch.__version__}" in r.stdout
    for op in _backend.OPS:
        assert op in r.stdout


def test_every_op_with_kernels_is_a_torch_op():
    for op, info in _backend.OPS.items():
        if not info.public:  # a key of tile kernels whose op is still to come (distill)
            assert any(k.op == op for k in _backend.KERNELS), op
            continue
        if info.kernel is not None or info.triton:
            assert hasattr(torch.ops.ppo_kernels, op), op


def test_cpp_backend_is_the_cpu_default_when_compiled():
    if _backend.HAS_EXTENSION:
        assert _backend.resolve("token_logprobs", "cpu") == "cpp"
    assert ppo_kernels.__version__


def test_every_registered_op_is_opchecked_somewhere():
    """Guard for new ops: each torch.ops.ppo_kernels op must appear in an opcheck call."""
    import glob
    import re

    files = glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)
    src = "".join(open(f).read() for f in files)
    checked = set(re.findall(r"opcheck\(\s*torch\.ops\.ppo_kernels\.(\w+)", src))
    ops = set(registered_ops("ppo_kernels"))  # all of them, not only those used so far
    assert ops, "no ops registered"
    assert ops <= checked, f"ops without an opcheck test: {sorted(ops - checked)}"


def test_extension_built_against_another_torch_is_not_loaded(tmp_path):
    """setup.py records the torch the extension was compiled against; under another torch it is
    not loaded, with one warning naming both versions."""
    import shutil

    shutil.copytree(
        os.path.join(ROOT, "ppo_kernels"),
        tmp_path / "ppo_kernels",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (tmp_path / "ppo_kernels" / "_C.torch_version").write_text("2.0.0+other\n")
    code = (
        "import ppo_kernels, torch\n"
        "from ppo_kernels import _backend\n"
        "assert not _backend.HAS_EXTENSION\n"
        "assert ppo_kernels.token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)).shape == (2,)\n"
        "print('OK')\n"
    )
    r = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    msg = f"built against torch 2.0.0+other but torch {torch.__version__} is running"
    assert r.stderr.count(msg) == 1, r.stderr
    assert "--no-build-isolation" in r.stderr


def test_no_args_prints_help_and_version():
    r = subprocess.run(
        [sys.executable, "-m", "ppo_kernels"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "usage: python -m ppo_kernels" in r.stdout, r.stderr
    assert "info" in r.stdout and "train" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "ppo_kernels", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip() == f"ppo-kernels {ppo_kernels.__version__}"


def test_import_does_not_load_dynamo():
    # torch._dynamo is a slow import; nothing at module level may need it
    r = _run(
        "import sys, ppo_kernels\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    assert r.returncode == 0, r.stderr
    assert "'torch._dynamo'" not in r.stdout, r.stdout


def test_constant_result_marker_is_what_torch_sets():
    # _backend.constant_result marks functions (linear_policy_loss's stat names, the cached
    # vocab-parallel start) as torch.compiler.assume_constant_result does, without importing
    # dynamo: fail here if torch changes the marker
    from ppo_kernels import _backend
    from ppo_kernels.distributed import vocab_layout
    from ppo_kernels.linear_policy_loss import head

    def f():
        return 0

    def g():
        return 0

    marked = torch.compiler.assume_constant_result(f)
    assert vars(marked) == {"_dynamo_marked_constant": True}
    assert vars(_backend.constant_result(g)) == vars(marked)
    assert head._stat_names._dynamo_marked_constant is True
    assert vocab_layout._cached_start._dynamo_marked_constant is True
