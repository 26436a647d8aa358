"""Imported at start-up by the Ray workers of tests/integrations/test_ray.py (this folder and
tests/ are on their PYTHONPATH): the peers' cluster-only imports stubbed, as in the tests' own process, before
the documented worker_process_setup_hook patches the peers."""

from support import peer_stubs

peer_stubs.install()
