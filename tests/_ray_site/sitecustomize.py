"""Imported at start-up by the Ray workers of tests/test_integrations_ray.py (this folder is on
their PYTHONPATH): the peers' cluster-only imports stubbed, as in the tests' own process, before
the documented worker_process_setup_hook patches the peers."""

import _peer_stubs

_peer_stubs.install()
