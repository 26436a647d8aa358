from . import reference  # noqa: F401
from .op import full_kl  # noqa: F401
