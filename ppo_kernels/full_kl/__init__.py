from .op import full_kl  # noqa: F401
from . import reference  # noqa: F401
