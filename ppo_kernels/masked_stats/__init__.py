from .op import masked_mean, masked_whiten  # noqa: F401
