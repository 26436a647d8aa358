"""Distributed forms of the ops on torch.distributed (any backend: gloo on the CPU, NCCL on
GPUs): vocab-parallel log-probs (`token_logprobs(..., process_group=tp_group)`), policy loss
(`linear_policy_loss(..., process_group=tp_group)`) and preference loss
(`linear_preference_loss(..., process_group=tp_group)`), sequence-parallel GAE (`gae(...,
process_group=sp_group)`) and data-parallel masked statistics (`masked_mean` /
`masked_whiten(..., process_group=dp_group)`). Each needs one collective (the losses: one per row
block). The vocab-parallel forms take the rollout sampler's options: per-row temperatures and its
truncation (top_k / top_p / min_p: vocab_parallel_sampler.py, a fixed number of collectives per
call or row block)."""

from .data_parallel import combine_moments, global_moments, local_moments  # noqa: F401
from .sequence_parallel import sequence_parallel_gae  # noqa: F401
from .vocab_parallel_full_kl import vocab_parallel_full_kl  # noqa: F401
from .vocab_parallel_linear import vocab_parallel_linear_token_logprobs  # noqa: F401
from .vocab_parallel_linear_sampler import vocab_parallel_linear_sampled  # noqa: F401
from .vocab_parallel_policy import vocab_parallel_linear_policy_loss  # noqa: F401
from .vocab_parallel_preference import vocab_parallel_linear_preference_loss  # noqa: F401
from .vocab_parallel_sampler import vocab_parallel_sampled_logprobs  # noqa: F401
from .vocab_parallel_token_logprobs import vocab_parallel_token_logprobs  # noqa: F401
from .vocab_states import merge_states  # noqa: F401
