// token_logprobs_sampler: the CUDA kernels of token_logprobs_sampler.cuh, registered for CUDA
// tensors.
#include <torch/library.h>

#include "cuda/token_logprobs_sampler.cuh"

namespace ppo_kernels {

TORCH_LIBRARY_IMPL(ppo_kernels_C, CUDA, m) {
  m.impl("token_logprobs_sampler_fwd", &token_logprobs_sampler_cuda::fwd<CudaDevice>);
  m.impl("token_logprobs_sampler_bwd", &token_logprobs_sampler_cuda::bwd<CudaDevice>);
}

}  // namespace ppo_kernels
