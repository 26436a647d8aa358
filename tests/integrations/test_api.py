"""ppo_kernels.integrations: the API, activation in fresh processes (as Ray workers are), dtypes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support import ROOT, TESTS
from support.peer_stubs import import_peer

import ppo_kernels.integrations as pki


def test_bad_arguments():
    with pytest.raises(ValueError, match="peer"):
        pki.apply("deepspeed")
    with pytest.raises(ValueError, match="dtype"):
        pki.apply("trl", dtype="bf16")
    assert pki.report("trl")["active"] is False
    assert pki.supported_versions("verl") == ("0.9.",)


@pytest.mark.parametrize(
    "sampling,match",
    [
        ({"top_k": -2}, r"sampling\['top_k'\]"),
        ({"top_p": 0.0}, r"sampling\['top_p'\]"),
        ({"min_p": 1.5}, r"sampling\['min_p'\]"),
        ({"top_k": 2.5}, r"sampling\['top_k'\]"),
        ({"sampler": "hf"}, r"sampling\['sampler'\]"),
        ({"temperature": 0.7}, "unknown keys"),
        ("top_k=50,top_p", "key=value"),
        ("top_p=high", r"sampling\['top_p'\]"),
        ([("top_k", 5)], "expected a dict"),
    ],
)
def test_verl_sampling_option_checked(sampling, match):
    with pytest.raises(ValueError, match=match):
        pki.apply("verl", sampling=sampling)
    assert pki.report("verl")["active"] is False  # checked before anything is patched


def test_verl_sampling_option_forms():
    from ppo_kernels.integrations._verl_sampling import RolloutSampling, sampling_option

    # the environment's string form, verl's off values, and the dict form agree
    want = RolloutSampling(top_k=50, top_p=0.9, min_p=None, sampler="sglang")
    assert sampling_option("top_k=50, top_p=0.9, min_p=0, sampler=sglang") == want
    assert sampling_option({"top_k": 50, "top_p": 0.9, "sampler": "sglang"}) == want
    assert sampling_option({"top_k": -1, "top_p": 1.0, "min_p": 0.0}) is None
    assert sampling_option("") is None
    with pytest.raises(ValueError, match="sampling: not an option of the trl patch"):
        pki.apply("trl", sampling={"top_p": 0.9})


def _run(code, **env):
    """Run `code` in a fresh interpreter with the peers' cluster-only imports stubbed."""
    pre = (
        f"import sys; sys.path.insert(0, {TESTS!r}); sys.path.insert(0, {ROOT!r}); "
        "from support import peer_stubs; peer_stubs.install()\n"
    )
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PPO_KERNELS_PATCH", "VERL_USE_EXTERNAL_MODULES")
    }
    e.update(env)
    return subprocess.run(
        [sys.executable, "-c", pre + code],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_verl_external_module_activation():
    import_peer("verl.trainer.ppo.core_algos")
    r = _run(
        "import verl\n"
        "from verl.trainer.ppo import core_algos\n"
        "import ppo_kernels.integrations as pki\n"
        "rep = pki.report('verl')\n"
        "assert rep['active'] and not rep['strict'], rep\n"
        "assert hasattr(core_algos.compute_gae_advantage_return, '__ppo_kernels_original__')\n"
        "caller = rep['functions']['verl.workers.engine.fsdp.transformer_impl."
        "FSDPEngineWithLMHead.prepare_model_outputs']\n"
        "assert 'unavailable' not in caller and caller['patched_in'], caller\n"
        "print('OK')",
        VERL_USE_EXTERNAL_MODULES="ppo_kernels.integrations.verl",
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_env_activation_on_import():
    import_peer("trl.trainer.utils")
    import_peer("openrlhf.models.utils")
    r = _run(
        "import ppo_kernels, ppo_kernels.integrations as pki\n"
        "assert pki.report('trl')['active'] and pki.report('openrlhf')['active']\n"
        "assert not pki.report('verl')['active']\n"
        "pki.revert('trl'); pki.worker_setup()  # Ray's worker_process_setup_hook\n"
        "assert pki.report('trl')['active']\n"
        "print(pki.format_report('openrlhf'))\n"
        "print('OK')",
        PPO_KERNELS_PATCH="trl, openrlhf",
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    assert "openrlhf 0.11.2 patched by ppo_kernels (strict=False" in r.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logprobs(dtype):
    """bf16 / fp16 logits: the peers compute log_softmax in that dtype; we accumulate in float32
    and round once, so ours is within one rounding of the float64 value and theirs within a few:
    the two agree within a few units of the dtype's precision, not 1e-5."""
    tf = import_peer("verl.utils.torch_functional")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, 300, generator=g) * 4).to(dtype)
    y = torch.randint(0, 300, (4, 7), generator=g)
    exact = torch.log_softmax(x.double(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    theirs = tf.logprobs_from_logits(x, y)
    with pki.patched("verl"):
        ours = tf.logprobs_from_logits(x, y)
    with pki.patched("verl", dtype="float32"):
        ours32 = tf.logprobs_from_logits(x, y)
    assert theirs.dtype == ours.dtype == dtype and ours32.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    assert ((ours32.double() - exact).abs() <= 1e-5 * exact.abs().clamp(min=1)).all()
    assert ((ours.double() - exact).abs() <= eps * exact.abs().clamp(min=1)).all()  # one rounding
    assert ((ours.double() - theirs.double()).abs() <= 8 * eps * exact.abs().clamp(min=1)).all()


def test_optional_target_unavailable():
    """A caller target whose module does not import is listed as unavailable; apply succeeds."""
    from ppo_kernels.integrations._patch import Peer, Target

    import_peer("openrlhf.models.utils")
    peer = Peer(
        "openrlhf",
        "openrlhf",
        ("0.11.",),
        [
            Target("openrlhf.models.utils", "masked_mean", lambda a, orig, o: orig(**a)),
            Target("no_such_peer_module", "f", lambda a, orig, o: None, optional=True),
        ],
    )
    peer.apply(strict=True, dtype="peer")
    try:
        rep = peer.report()["functions"]
        assert "ModuleNotFoundError" in rep["no_such_peer_module.f"]["unavailable"]
        assert rep["openrlhf.models.utils.masked_mean"]["patched_in"]
    finally:
        peer.revert()
    with pytest.raises(ModuleNotFoundError):
        Peer("x", "openrlhf", ("0.11.",), [Target("no_such_peer_module", "f", None)]).apply(
            strict=True, dtype="peer"
        )
