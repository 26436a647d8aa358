from .op import grpo_advantages, rloo_advantages  # noqa: F401
