"""The documented worker activation in real Ray workers: a local Ray (`ray.init(num_cpus=2)`, no
cluster) started with the README's runtime_env recipe (PPO_KERNELS_PATCH + the
`ppo_kernels.integrations.worker_setup` hook for TRL and OpenRLHF, VERL_USE_EXTERNAL_MODULES for
verl); each peer's patched functions run in worker processes and each worker's `report` shows our
ops ran there, while this driver process stays unpatched. Skipped only where Ray is not installed
or cannot start (scripts/dev.sh installs it with the peers)."""

from __future__ import annotations

import os

import pytest
from support import ROOT, TESTS
from support.peer_stubs import import_peer
from support.skips import missing

import ppo_kernels.integrations as pki

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray", reason=missing("ray"))
    for m in ("verl.trainer.ppo.core_algos", "trl.trainer.utils", "openrlhf.models.loss"):
        import_peer(m)  # skips where a peer is not installed
    path = os.pathsep.join(
        [ROOT, os.path.join(HERE, "_ray_site"), TESTS, os.environ.get("PYTHONPATH", "")]
    )
    runtime_env = {  # the README's recipe (plus this checkout and the peers' stubs on the path)
        "env_vars": {
            "PPO_KERNELS_PATCH": "trl,openrlhf",
            "VERL_USE_EXTERNAL_MODULES": "ppo_kernels.integrations.verl",
            "PYTHONPATH": path,
        },
        "worker_process_setup_hook": "ppo_kernels.integrations.worker_setup",
    }
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=runtime_env,
            namespace="ppo_kernels_tests",
        )
    except Exception as e:  # noqa: BLE001 -- no permission for shared memory, sockets, ...
        pytest.skip(f"a local Ray does not start here: {type(e).__name__}: {e}")
    try:
        yield ray
    finally:
        ray.shutdown()


def test_peers_patched_in_ray_workers(ray):
    """verl and TRL in a Ray task, OpenRLHF in a Ray actor (verl's and OpenRLHF's workers are
    actors), both at once: two worker processes, one per CPU of the local Ray (a third would wait
    for a CPU, and each one starts torch and the peers)."""
    from support import ray_tasks

    @ray.remote(num_cpus=1)
    class Worker:
        def run(self):
            return ray_tasks.openrlhf()

    def verl_and_trl():
        return {"verl": ray_tasks.verl(), "trl": ray_tasks.trl()}

    task = ray.remote(num_cpus=1)(verl_and_trl).remote()
    actor = Worker.remote().run.remote()
    got, got["openrlhf"] = ray.get([task, actor], timeout=300)
    assert got["verl"]["pid"] == got["trl"]["pid"] != got["openrlhf"]["pid"], got
    for peer, rep in got.items():
        assert rep["pid"] != os.getpid(), peer  # a worker process
        assert rep["active"] and rep["strict"] is False, (peer, rep)  # environment activation
        assert not rep["fallbacks"], (peer, rep)
    assert set(got["verl"]["replaced"]) >= {
        "verl.trainer.ppo.core_algos.compute_gae_advantage_return",
        "verl.trainer.ppo.core_algos.kl_penalty",
        "verl.utils.torch_functional.logprobs_from_logits",
        "verl.utils.experimental.torch_functional.FusedLinearForPPO.forward",
    }, got["verl"]
    assert set(got["trl"]["replaced"]) == {
        "trl.trainer.utils.selective_log_softmax",
        "trl.trainer.utils.selective_log_softmax_and_entropy",
    }, got["trl"]
    assert set(got["openrlhf"]["replaced"]) == {
        "openrlhf.models.utils.compute_approx_kl",
        "openrlhf.models.utils.log_probs_from_logits",
        "openrlhf.models.loss.PolicyLoss.forward",
    }, got["openrlhf"]
    for peer in got:  # the recipe acts in the workers only
        assert not pki.report(peer)["active"], peer
