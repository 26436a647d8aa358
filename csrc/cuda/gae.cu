// gae: the CUDA kernels of gae.cuh, registered for CUDA tensors.
#include <torch/library.h>

#include "cuda/gae.cuh"

namespace ppo_kernels {

TORCH_LIBRARY_IMPL(ppo_kernels_C, CUDA, m) { m.impl("gae_fwd", &gae_cuda::fwd<CudaDevice>); }

}  // namespace ppo_kernels
