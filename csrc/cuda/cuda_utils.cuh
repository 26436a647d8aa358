// Device-only building blocks shared by the CUDA vocabulary kernels (token_logprobs, full_kl):
// 16-byte packs, the scalar head before a row becomes 16-byte aligned, and a block-wide
// reduction of any online state (SoftmaxStats, KLStats) with its merge, and the launch geometry of
// the one-block-per-row vocabulary kernels.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cuda/device.cuh"

namespace ppo_kernels {
namespace dev {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
struct alignas(16) Pack {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

// Elements [0, head) of a row are handled as scalars until p is 16-byte aligned; then packs; then
// a scalar tail. Works for any V and any row alignment.
template <typename T>
__device__ __forceinline__ int64_t head_len(const T* p, int64_t V) {
  const int64_t mis = (reinterpret_cast<uintptr_t>(p) & 15) / sizeof(T);
  const int64_t head = mis == 0 ? 0 : Pack<T>::kN - mis;
  return head < V ? head : V;
}

template <typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Pack i of `row` (elements i * kN ... i * kN + kN - 1) as floats times inv_t: one 16-byte load
// when `packed` (row 16-byte aligned), else kN scalar loads -- the same values in the same order,
// so a reduction over them does not depend on the row's alignment (__fmul_rn: never contracted
// into an FMA with what follows, in either branch).
template <typename T>
__device__ __forceinline__ void load_pack(const T* row, int64_t i, bool packed, float inv_t,
                                          float* out) {
  constexpr int kN = Pack<T>::kN;
  if (packed) {
    const Pack<T> a = reinterpret_cast<const Pack<T>*>(row)[i];
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] = __fmul_rn(static_cast<float>(a.v[k]), inv_t);
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] = __fmul_rn(static_cast<float>(row[i * kN + k]), inv_t);
  }
}

// Lane shuffle of a plain struct of floats.
template <typename S>
__device__ __forceinline__ S shfl_xor(S st, int offset) {
  static_assert(sizeof(S) % sizeof(float) == 0, "state must be a struct of floats");
  S out;
  const float* in = reinterpret_cast<const float*>(&st);
  float* o = reinterpret_cast<float*>(&out);
#pragma unroll
  for (int i = 0; i < int(sizeof(S) / sizeof(float)); ++i)
    o[i] = __shfl_xor_sync(kFullMask, in[i], offset);
  return out;
}

// Merge every thread's state (warp shuffles, then one warp over the per-warp partials); the
// result is valid in thread 0. Every thread of the block must call it.
template <typename S, typename Merge>
__device__ S block_reduce(S st, S empty, Merge merge) {
  PPO_SHARED(S, partial, [32]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_xor(st, o));
  if (lane == 0) partial[warp] = st;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    st = lane < nwarps ? partial[lane] : empty;
    for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_xor(st, o));
  }
  __syncthreads();  // `partial` is reused by the next row
  return st;
}

// Threads per block for a row of V elements read in packs of `vec`: ~4 packs per thread, a power
// of two in [32, 1024].
inline int threads_for_row(int64_t V, int vec) {
  const int64_t want = (V / vec + 3) / 4;
  int t = 32;
  while (t < want && t < 1024) t <<= 1;
  return t;
}

// Blocks for N rows: one per row, grid-stride beyond max_blocks (Dev::max_row_blocks(): 2^20 on
// the GPU; the emulator's tests lower it to reach the grid-stride loop with a few rows).
inline int64_t grid_for_rows(int64_t N, int64_t max_blocks) {
  return std::min<int64_t>(N, max_blocks);
}

}  // namespace dev
}  // namespace ppo_kernels
