"""pytest plugin for running a peer's own test suite (tests/integrations/peer_suites/run_peer_suites.py): the
peers' cluster-only imports stubbed as in our tests (tests/support/peer_stubs.py); with
PPO_KERNELS_PEER_SUITE_PATCH=<peer>, `ppo_kernels.integrations.apply(peer, strict=False)` for the
whole session, before the peer's test modules are imported. Set by run_peer_suites.py where a
suite needs it:
  PPO_KERNELS_PEER_SUITE_ALIASES="private.name=peer.module,...": modules the suite loads from the
      peer's source files under private names (OpenRLHF's tests do): after collection the peer's
      targets of `peer.module` are applied to them too;
  PPO_KERNELS_PEER_SUITE_SHIMS="module:name,...": names the suite imports that this peer
      version removed, set to a stand-in (so that the file collects): `is_*_available` answers
      False, anything else raises;
  PPO_KERNELS_PEER_SUITE_REPORT=FILE: the peer's `report` (and the aliases') written there."""

from __future__ import annotations

import importlib
import json
import os
import sys

from support import peer_stubs

peer_stubs.install()

_aliases = []


def _removed(name):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"{name} is not in this version (a test-suite stand-in)")

    return stand_in


def pytest_configure(config):
    for spec in filter(None, os.environ.get("PPO_KERNELS_PEER_SUITE_SHIMS", "").split(",")):
        mod, name = spec.split(":")
        m = importlib.import_module(mod)
        if not hasattr(m, name):
            unavailable = name.startswith("is_") and name.endswith("_available")
            setattr(m, name, (lambda: False) if unavailable else _removed(f"{mod}.{name}"))
    peer = os.environ.get("PPO_KERNELS_PEER_SUITE_PATCH")
    if peer:
        import ppo_kernels.integrations as pki

        pki.apply(peer, strict=False)


def pytest_collection_finish(session):
    peer = os.environ.get("PPO_KERNELS_PEER_SUITE_PATCH")
    spec = os.environ.get("PPO_KERNELS_PEER_SUITE_ALIASES", "")
    if not peer or not spec:
        return
    from ppo_kernels.integrations import _peer
    from ppo_kernels.integrations._patch import Peer, Target

    base = _peer(peer)
    for alias, module in (s.split("=") for s in spec.split(",")):
        if alias not in sys.modules:
            continue
        targets = [
            Target(alias, t.attr, t.impl, t.registries)
            for t in base.targets
            if t.module == module and hasattr(sys.modules[alias], t.attr.split(".")[0])
        ]
        p = Peer(f"{peer} ({alias})", base.dist, base.versions, targets)
        p.apply(strict=False, dtype="peer")
        _aliases.append(p)


def pytest_sessionfinish(session, exitstatus):
    peer = os.environ.get("PPO_KERNELS_PEER_SUITE_PATCH")
    out = os.environ.get("PPO_KERNELS_PEER_SUITE_REPORT")
    if peer and out:
        import ppo_kernels.integrations as pki

        rep = pki.report(peer)
        rep["aliases"] = [p.report() for p in _aliases]
        with open(out, "w") as f:
            json.dump(rep, f)
