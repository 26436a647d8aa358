"""The peers' own test suites with `apply(peer)` active (peer_suites/run_peer_suites.py beside this
file):
every test of theirs that passes unpatched passes patched (the documented known differences
excepted), and our ops ran. verl's from its PyPI sdist (fetched once into .peer_tests/); TRL's,
OpenRLHF's and Liger's only where a checkout is given ($PPO_KERNELS_PEER_SRC_TRL /
$PPO_KERNELS_PEER_SRC_OPENRLHF / $PPO_KERNELS_PEER_SRC_LIGER, a work tree or a bare git mirror):
none ships its tests on PyPI."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from support import ROOT
from support.peer_stubs import import_peer
from support.skips import PEER_TESTS_NOT_ON_PYPI

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "peer_suites"))
import run_peer_suites as peer_suites  # noqa: E402

PROBE = {
    "verl": "verl.trainer.ppo.core_algos",
    "trl": "trl.trainer.utils",
    "openrlhf": "openrlhf.models.loss",
    "liger": "liger_kernel.chunked_loss.grpo_loss",
}


@pytest.mark.parametrize("peer", list(PROBE))
def test_peer_suite_passes_patched(peer):
    import_peer(PROBE[peer])
    src = os.environ.get(f"PPO_KERNELS_PEER_SRC_{peer.upper()}")
    if src is None and not peer_suites.SUITES[peer].get("sdist"):
        pytest.skip(PEER_TESTS_NOT_ON_PYPI)
    cache = pathlib.Path(
        os.environ.get("PPO_KERNELS_PEER_CACHE", pathlib.Path(ROOT) / ".peer_tests")
    )
    try:
        s = peer_suites.run_suite(peer, src, cache)
    except RuntimeError as e:  # e.g. no network for the sdist
        pytest.skip(f"{peer}'s suite cannot run here: {str(e).splitlines()[0]}")
    assert s["unpatched"]["passed"] > 0, s
    assert not s["regressions"], (s["regressions"], s["log"])
    assert sum(c[1] for c in s["calls"].values()) > 0, s["calls"]  # our ops ran in their tests
