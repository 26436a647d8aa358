from . import reference  # noqa: F401
from .op import gae  # noqa: F401
