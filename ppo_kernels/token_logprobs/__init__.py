from .op import token_logprobs  # noqa: F401
from . import reference  # noqa: F401
