// Host stand-ins for the cub block collectives the CUDA kernels use, with cub's API and result
// contract, run by the SIMT emulator's fibers. Like cub they go through TempStorage in shared
// memory with one barrier inside (every thread writes its item, __syncthreads, every thread reads
// what it needs) and none at the end: reusing TempStorage needs the caller's __syncthreads, and a
// missing one shows as a race under the emulator's random fiber order.
#pragma once
#include "testing/simt.h"

namespace cub {

enum BlockScanAlgorithm { BLOCK_SCAN_RAKING, BLOCK_SCAN_RAKING_MEMOIZE, BLOCK_SCAN_WARP_SCANS };
enum BlockReduceAlgorithm {
  BLOCK_REDUCE_RAKING,
  BLOCK_REDUCE_RAKING_COMMUTATIVE_ONLY,
  BLOCK_REDUCE_WARP_REDUCTIONS
};

namespace simt_detail {
template <int BX, int BY, int BZ>
inline int linear_tid() {
  if (static_cast<int>(blockDim.x * blockDim.y * blockDim.z) != BX * BY * BZ) {
    throw ::simt::Error(::simt::Check::kLaunch,
                        "cub block collective declared for a different block size");
  }
  return static_cast<int>(threadIdx.x + threadIdx.y * BX + threadIdx.z * BX * BY);
}
}  // namespace simt_detail

template <typename T, int BLOCK_DIM_X, BlockScanAlgorithm = BLOCK_SCAN_RAKING, int BLOCK_DIM_Y = 1,
          int BLOCK_DIM_Z = 1, int = 0>
class BlockScan {
  static constexpr int kN = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;

 public:
  struct TempStorage {
    T items[kN];
  };
  explicit BlockScan(TempStorage& s)
      : s_(s), tid_(simt_detail::linear_tid<BLOCK_DIM_X, BLOCK_DIM_Y, BLOCK_DIM_Z>()) {}

  // output = init op x_0 op ... op x_{tid-1}; aggregate = x_0 op ... op x_{n-1} (without init).
  template <typename Op>
  void ExclusiveScan(T input, T& output, T initial_value, Op op, T& block_aggregate) {
    share(input);
    T acc = initial_value;
    for (int i = 0; i < tid_; ++i) acc = op(acc, s_.items[i]);
    output = acc;
    block_aggregate = fold(op, kN);
  }
  template <typename Op>
  void ExclusiveScan(T input, T& output, T initial_value, Op op) {
    T agg;
    ExclusiveScan(input, output, initial_value, op, agg);
  }
  template <typename Op>
  void InclusiveScan(T input, T& output, Op op, T& block_aggregate) {
    share(input);
    output = fold(op, tid_ + 1);
    block_aggregate = fold(op, kN);
  }
  template <typename Op>
  void InclusiveScan(T input, T& output, Op op) {
    T agg;
    InclusiveScan(input, output, op, agg);
  }
  void ExclusiveSum(T input, T& output) { ExclusiveScan(input, output, T{}, Plus()); }
  void InclusiveSum(T input, T& output) { InclusiveScan(input, output, Plus()); }

 private:
  struct Plus {
    T operator()(const T& a, const T& b) const { return a + b; }
  };
  void share(const T& input) {
    s_.items[tid_] = input;
    __syncthreads();
  }
  template <typename Op>
  T fold(Op op, int n) const {
    T acc = s_.items[0];
    for (int i = 1; i < n; ++i) acc = op(acc, s_.items[i]);
    return acc;
  }
  TempStorage& s_;
  int tid_;
};

// Reduce / Sum: the result is defined in thread 0 only (cub's contract); the other threads get
// 0xff bytes, so a kernel that reads it elsewhere shows NaN.
template <typename T, int BLOCK_DIM_X, BlockReduceAlgorithm = BLOCK_REDUCE_WARP_REDUCTIONS,
          int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1, int = 0>
class BlockReduce {
  static constexpr int kN = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;

 public:
  struct TempStorage {
    T items[kN];
  };
  explicit BlockReduce(TempStorage& s)
      : s_(s), tid_(simt_detail::linear_tid<BLOCK_DIM_X, BLOCK_DIM_Y, BLOCK_DIM_Z>()) {}

  template <typename Op>
  T Reduce(T input, Op op, int num_valid = kN) {
    s_.items[tid_] = input;
    __syncthreads();
    T out;
    std::memset(static_cast<void*>(&out), 0xff, sizeof(T));
    if (tid_ == 0) {
      out = s_.items[0];
      for (int i = 1; i < num_valid; ++i) out = op(out, s_.items[i]);
    }
    return out;
  }
  T Sum(T input, int num_valid = kN) {
    return Reduce(input, [](const T& a, const T& b) { return a + b; }, num_valid);
  }

 private:
  TempStorage& s_;
  int tid_;
};

}  // namespace cub
