from .aggregate import masked_aggregate  # noqa: F401
from .op import dpo_loss, ppo_policy_loss, ppo_value_loss, reward_model_loss  # noqa: F401
from .rollout import RolloutCorrection, rollout_correction  # noqa: F401
