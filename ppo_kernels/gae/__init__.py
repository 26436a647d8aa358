from .op import gae  # noqa: F401
from .whiten import masked_mean, masked_whiten  # noqa: F401
from . import reference  # noqa: F401
