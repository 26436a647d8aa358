from .op import gae  # noqa: F401
from . import reference  # noqa: F401
