// Shared by the CPU (.cpp) and CUDA (.cu) kernels: one definition of the math, host and device.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PPO_HD __host__ __device__ __forceinline__
#else
#define PPO_HD inline
#endif
