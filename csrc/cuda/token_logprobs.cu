// token_logprobs: the CUDA kernels of token_logprobs.cuh, registered for CUDA tensors.
#include <torch/library.h>

#include "cuda/token_logprobs.cuh"

namespace ppo_kernels {

TORCH_LIBRARY_IMPL(ppo_kernels_C, CUDA, m) {
  m.impl("token_logprobs_fwd", &token_logprobs_cuda::fwd<CudaDevice>);
  m.impl("token_logprobs_bwd", &token_logprobs_cuda::bwd<CudaDevice>);
}

}  // namespace ppo_kernels
