"""The op contract (DEVELOPING.md): one backend key per op with an explicit alias table from the
public names, one signature per kernel across backends, mode tables equal on both sides of the
C++ boundary, and a DEVELOPING.md row for every op."""

import os
import re
import subprocess
import sys

import pytest
import torch
from support import ROOT
from support.skips import requires_extension

import ppo_kernels
from ppo_kernels import _backend, _dispatch, _modes

PKG = os.path.join(ROOT, "ppo_kernels")


def test_every_public_name_is_exported_and_maps_to_a_key():
    for name, key in _backend.PUBLIC.items():
        assert key in _backend.OPS, name
    for info in _backend.OPS.values():
        for name in info.public:
            assert callable(getattr(ppo_kernels, name)), f"ppo_kernels.{name} is not exported"
        assert os.path.isfile(os.path.join(PKG, info.folder, "op.py")), info.folder


@pytest.mark.parametrize("name", sorted(_backend.PUBLIC))
def test_use_backend_takes_every_public_name(name):
    with ppo_kernels.use_backend(**{name: "eager"}):
        assert _backend.resolve(_backend.PUBLIC[name], "cpu") == "eager"


def test_unknown_op_names_are_refused():
    with pytest.raises(ValueError, match="unknown op 'token_logprob'"):
        with ppo_kernels.use_backend(token_logprob="eager"):
            pass
    with pytest.raises(ValueError, match="PPO_KERNELS_BACKEND: unknown op"):
        _dispatch._parse_spec("nope=eager", "PPO_KERNELS_BACKEND")


def test_environment_variable_takes_every_public_name():
    names = sorted(_backend.PUBLIC)
    spec = ",".join(f"{n}=eager" for n in names)
    code = (
        "from ppo_kernels import _backend\n"
        f"assert all(_backend.resolve(_backend.PUBLIC[n], 'cpu') == 'eager' for n in {names!r})\n"
        "print('OK')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PPO_KERNELS_BACKEND=spec),
        timeout=300,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_a_global_default_skips_ops_without_that_backend():
    assert not _backend.OPS["masked_whiten"].triton  # the example: an op without Triton kernels
    with ppo_kernels.use_backend("triton"):
        assert _backend.resolve("masked_whiten", "cpu") == _backend.default_backend(
            "masked_whiten", "cpu"
        )
    with pytest.raises(RuntimeError, match="unavailable"):
        with ppo_kernels.use_backend(masked_whiten="triton"):
            _backend.resolve("masked_whiten", "cpu")


def test_every_kernel_has_its_backends_with_one_signature():
    assert _backend.KERNELS
    for k in _backend.KERNELS:
        info = _backend.OPS[k.op]
        assert "eager" in k.impls, f"{k.op}.{k.name} has no eager implementation"
        assert ("cpp" in k.impls) == (info.kernel is not None), f"{k.op}.{k.name}: cpp"
        assert ("triton" in k.impls) == info.triton, f"{k.op}.{k.name}: triton"
    # the signature check is enforced at registration
    k = _backend.Kernel("token_logprobs", "test_only")
    k.impl("eager")(lambda a, b: None)
    with pytest.raises(TypeError, match="takes"):
        k.impl("cpp")(lambda a, c: None)
    _backend.KERNELS.remove(k)


@requires_extension
def test_mode_tables_match_the_cpp_enums():
    for table, names in _modes.TABLES.items():
        assert tuple(torch.ops.ppo_kernels_C.mode_names(table)) == names, table
    with pytest.raises(ValueError, match="agg: unknown mode 'token-avg'"):
        x = torch.zeros(2, 3)
        torch.ops.ppo_kernels_C.ppo_value_loss_fwd(x, x, x, x, None, "token-avg", 1.0, None, None)


def test_no_integer_modes_cross_the_op_schemas():
    """Modes cross as strings and optional values as optional types (no codes, no sentinels)."""
    for name in dir(torch.ops.ppo_kernels):
        if name.startswith("_") or name == "name":
            continue
        schema = str(getattr(torch.ops.ppo_kernels, name).default._schema)
        for arg in ("agg", "estimator", "kind", "reduction"):
            assert not re.search(rf"\bint {arg}\b", schema), schema
        for arg in ("dual_clip", "clip", "global_denom_value"):
            assert not re.search(rf"\bfloat {arg}\b", schema), schema


def test_developing_md_lists_every_op():
    text = open(os.path.join(ROOT, "DEVELOPING.md")).read()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for key, info in _backend.OPS.items():
        for name in info.public:
            row = [r for r in rows if r.startswith(f"| `{name}`")]
            assert row, f"DEVELOPING.md: no row for {name}"
            assert f"`{key}`" in row[0] and f"ppo_kernels/{info.folder}/" in row[0], row[0]
    # every file the table names exists
    for path in re.findall(r"`((?:csrc|ppo_kernels|tests|bench)/[^`*]+)`", "\n".join(rows)):
        assert os.path.exists(os.path.join(ROOT, path)), f"DEVELOPING.md names {path}"
