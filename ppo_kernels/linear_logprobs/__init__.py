from . import reference  # noqa: F401
from .hf import causal_lm_logprobs  # noqa: F401
from .op import linear_token_logprobs  # noqa: F401
