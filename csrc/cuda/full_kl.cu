// full_kl: the CUDA kernels of full_kl.cuh, registered for CUDA tensors.
#include <torch/library.h>

#include "cuda/full_kl.cuh"

namespace ppo_kernels {

TORCH_LIBRARY_IMPL(ppo_kernels_C, CUDA, m) {
  m.impl("full_kl_fwd", &full_kl_cuda::fwd<CudaDevice>);
  m.impl("full_kl_bwd", &full_kl_cuda::bwd<CudaDevice>);
}

}  // namespace ppo_kernels
