"""What tests/integrations/test_ray.py runs in Ray worker processes: each peer's patched
functions on small inputs, then that worker's `report` (its pid with it). Nothing here applies a
patch: the runtime_env recipe must have done it (PPO_KERNELS_PATCH + worker_process_setup_hook,
or VERL_USE_EXTERNAL_MODULES on `import verl`)."""

from __future__ import annotations

import os

import torch


def _replaced(peer):
    import ppo_kernels.integrations as pki

    rep = pki.report(peer)
    return {
        "pid": os.getpid(),
        "active": rep["active"],
        "strict": rep.get("strict"),
        "replaced": {k: s["replaced"] for k, s in rep["functions"].items() if s["replaced"]},
        "fallbacks": {k: s["fallbacks"] for k, s in rep["functions"].items() if s["fallbacks"]},
    }


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 6, generator=g)
    return g, lp, lp + 0.1 * torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)


def verl():
    import verl  # noqa: F401 -- VERL_USE_EXTERNAL_MODULES patches here
    from verl.trainer.ppo import core_algos
    from verl.utils import torch_functional as tf
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    g, lp, old, adv = _data()
    mask = torch.ones(4, 6)
    core_algos.compute_gae_advantage_return(adv, old, mask, 1.0, 0.95)
    core_algos.kl_penalty(lp, old, "low_var_kl")
    tf.logprobs_from_logits(torch.randn(4, 6, 20, generator=g), torch.randint(0, 20, (4, 6)))
    h, w = torch.randn(4, 6, 8, generator=g), torch.randn(20, 8, generator=g)
    FusedLinearForPPO().forward(h, w, torch.randint(0, 20, (4, 6), generator=g), 0.7)
    return _replaced("verl")


def trl():
    from trl.trainer import utils

    g, _, _, _ = _data()
    x, y = torch.randn(4, 6, 20, generator=g), torch.randint(0, 20, (4, 6), generator=g)
    utils.selective_log_softmax(x, y)
    utils.selective_log_softmax_and_entropy(x, y)
    return _replaced("trl")


def openrlhf():
    from openrlhf.models import loss, utils

    g, lp, old, adv = _data()
    mask = torch.ones(4, 6)
    utils.compute_approx_kl(lp, old, kl_estimator="k3")
    utils.log_probs_from_logits(torch.randn(4, 6, 20, generator=g), torch.randint(0, 20, (4, 6)))
    loss.PolicyLoss()(lp, old, adv, mask)
    return _replaced("openrlhf")
