// What the shared kernel headers (csrc/cuda/*.cuh) see of the device, for the two compilers that
// build them: nvcc (the real CUDA kernels, launched by CudaDevice) and g++ with PPO_SIMT (the
// SIMT emulator of csrc/testing/, launched by SimtDevice on the CPU). The kernel bodies, their
// launch geometry and the host code around the launches are the same text for both; only this
// header differs.
//   PPO_SHARED(type, name, dims)       static shared memory (`__shared__ type name dims`)
//   dev.launch(name, kernel, grid, block, smem, args...)   kernel<<<grid, block, smem, stream>>>
//   Dev::accepts(t), Dev::kTensorKind   the tensors this build's kernels take
//   Dev::sm_count(), Dev::max_row_blocks()  multiprocessors, the grid-stride threshold of the
//                                       row kernels (the emulator's are set by its tests)
#pragma once
#include <ATen/core/Tensor.h>

#if defined(PPO_SIMT)
#include "testing/simt.h"
#include "testing/simt_cub.h"
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_scan.cuh>

#define PPO_SHARED(T, name, ...) __shared__ T name __VA_ARGS__

namespace ppo_kernels {

struct CudaDevice {
  static constexpr const char* kTensorKind = "CUDA";
  static bool accepts(const at::Tensor& t) { return t.is_cuda(); }
  explicit CudaDevice(const at::Tensor& t) : guard(t.device()) {}
  static int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }
  static int64_t max_row_blocks() { return int64_t(1) << 20; }
  template <typename... P, typename... A>
  void launch(const char*, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A&&... a) {
    // clang-format reads .cuh as plain C++ and would split the launch brackets
    // clang-format off
    kernel<<<grid, block, smem, at::cuda::getCurrentCUDAStream()>>>(std::forward<A>(a)...);
    // clang-format on
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  c10::cuda::CUDAGuard guard;
};

}  // namespace ppo_kernels
#endif
