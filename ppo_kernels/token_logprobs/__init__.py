from . import reference  # noqa: F401
from .op import token_logprobs  # noqa: F401
