from . import reference  # noqa: F401
from .op import kl_penalized_rewards, kl_penalty  # noqa: F401
from .reference import KLClamp  # noqa: F401
