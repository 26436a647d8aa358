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
from .distill.api import linear_distill_loss  # noqa: F401
from .full_kl.api import full_kl  # noqa: F401
from .fused_linear.planner import default_logits_dtype  # noqa: F401
from .gae.api import gae  # noqa: F401
from .group_advantages.api import grpo_advantages, rloo_advantages  # noqa: F401
from .kl.api import kl_penalized_rewards, kl_penalty  # noqa: F401
from .kl.naive import KLClamp  # noqa: F401
from .linear_logprobs.api import linear_token_logprobs  # noqa: F401
from .linear_logprobs.hf import causal_lm_logprobs  # noqa: F401
from .linear_policy_loss.api import linear_policy_loss  # noqa: F401
from .linear_preference_loss.api import linear_preference_loss  # noqa: F401
from .losses.aggregate import masked_aggregate  # noqa: F401
from .losses.api import ppo_policy_loss, ppo_value_loss  # noqa: F401
from .losses.config import (  # noqa: F401
    AggregationConfig,
    EntropyTermConfig,
    KLTermConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from .losses.distill_config import DistillLossConfig  # noqa: F401
from .losses.pairwise import dpo_loss, reward_model_head_loss, reward_model_loss  # noqa: F401
from .losses.preference_config import PreferenceLossConfig  # noqa: F401
from .losses.rollout_correction import RolloutCorrection, rollout_correction  # noqa: F401
from .masked_stats.api import masked_mean, masked_whiten  # noqa: F401
from .token_logprobs.api import token_logprobs  # noqa: F401

__version__ = "0.1.0"

import os as _os

if _os.environ.get("PPO_KERNELS_PATCH"):  # drop-in for peers in every process (integrations/)
    from .integrations import activate_from_env as _activate_from_env

    _activate_from_env()
