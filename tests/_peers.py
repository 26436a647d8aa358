"""Peers' real functions for parity tests, loaded from their own source files.

verl's `verl.trainer.ppo.core_algos` cannot be imported without its trainer stack (ray, omegaconf,
tensordict, ...). Its loss and advantage functions only need torch and numpy, so we parse the real
source with `ast`, take the function definitions we test (decorators dropped) and run them in a
namespace that supplies the few helpers they call (verl_F.masked_sum / masked_mean / clip_by_value,
also taken from verl's own source). Nothing of verl is copied into this repository.

Where verl comes from: $VERL_SRC (a folder holding `verl/`, e.g. an unzipped
`pip download --no-deps verl` wheel), else an installed `verl` package (found without importing it).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import types
from collections import defaultdict
from typing import Any, Optional

import numpy as np
import pytest
import torch

SKIP_REASON = ("verl not found: its trainer module needs ray/omegaconf/tensordict to import, so "
               "these tests read its source instead; run `pip download --no-deps verl`, unzip the "
               "wheel and set VERL_SRC to the folder holding verl/ (the literal re-implementations "
               "of verl's semantics run either way)")


def verl_root():
    cands = []
    if os.environ.get("VERL_SRC"):
        cands.append(pathlib.Path(os.environ["VERL_SRC"]))
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        cands += [pathlib.Path(p).parent for p in spec.submodule_search_locations]
    for c in cands:
        if (c / "verl" / "trainer" / "ppo" / "core_algos.py").is_file():
            return c
    return None


def _extract(path, names, ns):
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    found = {n.name for n in nodes}
    if found != set(names):
        pytest.skip(f"verl at {path} lacks {sorted(set(names) - found)} (a different verl version)")
    for n in nodes:
        n.decorator_list = []
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), ns)
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
    root = verl_root()
    if root is None:
        pytest.skip(SKIP_REASON)
    base = {"torch": torch, "np": np, "defaultdict": defaultdict, "Optional": Optional, "Any": Any}
    fns = _extract(root / "verl/utils/torch_functional.py", ["masked_sum", "masked_mean", "clip_by_value"],
                   dict(base))
    ns = dict(base, verl_F=types.SimpleNamespace(**fns), AlgoConfig=type("AlgoConfig", (), {}),
              ActorConfig=Config, DictConfig=Config)
    names = ["agg_loss", "compute_policy_loss_vanilla", "compute_value_loss",
             "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage"]
    out = _extract(root / "verl/trainer/ppo/core_algos.py", names, ns)
    gw = dict(base, _resolve_device=lambda device: torch.device("cpu") if device is None else torch.device(device))
    out.update(_extract(root / "verl/utils/groupwise.py", ["group_mean_std"], gw))
    out["root"] = root
    _cache["verl"] = types.SimpleNamespace(**out)
    return _cache["verl"]
