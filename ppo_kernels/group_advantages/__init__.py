from .op import group_ids, grpo_advantages, rloo_advantages  # noqa: F401
