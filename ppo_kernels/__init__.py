"""ppo-kernels: fused kernels for PPO-style RL training of language models.

Every op is a torch op in the `ppo_kernels` namespace (`torch.ops.ppo_kernels.*`) with CPU and CUDA
kernels, a fake kernel for torch.compile and registered autograd; this module is the typed API.
"""

from ._backend import (  # noqa: F401
    BACKENDS,
    HAS_EXTENSION,
    batch_invariant,
    strict_checks,
    use_backend,
)
from ._backend import resolve as resolve_backend  # noqa: F401
from .full_kl import full_kl  # noqa: F401
from .gae import gae  # noqa: F401
from .group_advantages import grpo_advantages, rloo_advantages  # noqa: F401
from .kl.api import kl_penalized_rewards, kl_penalty  # noqa: F401
from .kl.reference import KLClamp  # noqa: F401
from .linear_logprobs import causal_lm_logprobs, linear_token_logprobs  # noqa: F401
from .losses import (  # noqa: F401
    RolloutCorrection,
    dpo_loss,
    masked_aggregate,
    ppo_policy_loss,
    ppo_value_loss,
    reward_model_loss,
    rollout_correction,
)
from .masked_stats import masked_mean, masked_whiten  # noqa: F401
from .token_logprobs import token_logprobs  # noqa: F401

__version__ = "0.1.0"

import os as _os

if _os.environ.get("PPO_KERNELS_PATCH"):  # drop-in for peers in every process (integrations/)
    from .integrations import activate_from_env as _activate_from_env

    _activate_from_env()
