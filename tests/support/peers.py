"""Peers' real functions for parity tests, loaded from their own source files.

verl's `verl.trainer.ppo.core_algos` cannot be imported without its trainer stack (ray, omegaconf,
tensordict, ...). Its loss and advantage functions only need torch and numpy, so we parse the real
source with `ast`, take the function definitions we test (decorators dropped) and run them in a
namespace that supplies the few helpers they call (verl_F.masked_sum / masked_mean / clip_by_value,
also taken from verl's own source). Nothing of verl is copied into this repository.

Where peers come from: a wheel (`pip download --no-deps verl openrlhf`) or an unzipped tree in
$PPO_KERNELS_PEER_WHEELS (or $VERL_SRC), else an installed package (found without importing it).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import types
import zipfile
from collections import defaultdict
from typing import Any, Optional

import numpy as np
import pytest
import torch

from .skips import missing


def _peer_dirs():
    return [
        pathlib.Path(os.environ[v])
        for v in ("PPO_KERNELS_PEER_WHEELS", "VERL_SRC")
        if os.environ.get(v)
    ]


def peer_source(pkg, relpath):
    """(source text, where) of `pkg/relpath` from, in order: a wheel or an unzipped tree in
    $PPO_KERNELS_PEER_WHEELS (or $VERL_SRC), or the installed package (found without importing
    it); (None, None) when none has it."""
    for d in _peer_dirs():
        tree = d / pkg / relpath
        if tree.is_file():
            return tree.read_text(), str(tree)
        for whl in sorted(d.glob(f"{pkg}-*.whl")):
            with zipfile.ZipFile(whl) as z:  # pkg/... or pkg-X.data/purelib/pkg/...
                for member in z.namelist():
                    if member == f"{pkg}/{relpath}" or member.endswith(f"/purelib/{pkg}/{relpath}"):
                        return z.read(member).decode(), f"{whl}!{member}"
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        f = pathlib.Path(loc) / relpath
        if f.is_file():
            return f.read_text(), str(f)
    return None, None


def load_functions(pkg, relpath, names, ns):
    """The named top-level functions of a peer's source file, run in namespace `ns` (decorators
    dropped); skips the calling test when the source or a function is not there."""
    src, where = peer_source(pkg, relpath)
    if src is None:  # not installed, and no wheel or tree in $PPO_KERNELS_PEER_WHEELS
        pytest.skip(missing(pkg))
    nodes = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name in names]
    absent = set(names) - {n.name for n in nodes}
    if absent:
        pytest.skip(f"{where} lacks {sorted(absent)} (a different {pkg} version)")
    for n in nodes:
        n.decorator_list = []
    exec(compile(ast.Module(body=nodes, type_ignores=[]), where, "exec"), ns)  # noqa: S102
    return {n: ns[n] for n in names}


class Config(dict):
    """Stands in for verl's ActorConfig: attribute access plus .get()."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError as e:
            raise AttributeError(k) from e


_cache = {}


def load_verl():
    if "verl" in _cache:
        return _cache["verl"]
    base = {"torch": torch, "np": np, "defaultdict": defaultdict, "Optional": Optional, "Any": Any}
    fns = load_functions(
        "verl",
        "utils/torch_functional.py",
        ["masked_sum", "masked_mean", "clip_by_value"],
        dict(base),
    )
    ns = dict(
        base,
        verl_F=types.SimpleNamespace(**fns),
        AlgoConfig=type("AlgoConfig", (), {}),
        ActorConfig=Config,
        DictConfig=Config,
    )
    names = [
        "agg_loss",
        "compute_policy_loss_vanilla",
        "compute_value_loss",
        "compute_grpo_outcome_advantage",
        "compute_rloo_outcome_advantage",
    ]
    out = load_functions("verl", "trainer/ppo/core_algos.py", names, ns)
    gw = dict(
        base,
        _resolve_device=lambda device: (
            torch.device("cpu") if device is None else torch.device(device)
        ),
    )
    out.update(load_functions("verl", "utils/groupwise.py", ["group_mean_std"], gw))
    _cache["verl"] = types.SimpleNamespace(**out)
    return _cache["verl"]


def trl_trainer_env(trainer_module: str):
    """Generator for a module-scoped fixture of TRL's trainer tests: skips without TRL's trainer
    stack (the distributions, not importable names: peer_stubs may stand in for some) or when
    `trainer_module` does not import; yields bench/e2e_trl.py (the tiny model and tokenizer) with
    one torch thread, and reverts the "trl" patch after the module."""
    import importlib
    import importlib.metadata
    import sys

    import ppo_kernels.integrations as pki

    from . import BENCH

    for dist in ("trl", "transformers", "tokenizers", "datasets", "pandas", "pyarrow"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(missing(dist))
    try:
        importlib.import_module(trainer_module)
    except ImportError as e:
        pytest.skip(f"{trainer_module} does not import here: {e}")
    sys.path.insert(0, BENCH)
    import e2e_trl
    import transformers

    transformers.logging.set_verbosity_error()  # weight-loading progress bars
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits on a shared machine
    yield e2e_trl
    torch.set_num_threads(threads)
    pki.revert("trl")
