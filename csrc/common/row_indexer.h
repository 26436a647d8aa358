// Rows of a [..., V] tensor whose leading dimensions collapse to at most two strided dims, e.g.
// logits[:, :-1] of a contiguous [B, T+1, V] tensor: row r starts at
//   (r / inner) * stride_outer + (r % inner) * stride_inner
// so sliced logits are read without a copy. All offsets are 64-bit (N x V may exceed 2^31).
#pragma once
#include <cstdint>

#include "common/macros.h"

namespace ppo_kernels {

struct RowIndexer {
  int64_t inner;
  int64_t stride_outer;
  int64_t stride_inner;
  PPO_HD int64_t operator()(int64_t row) const {
    return (row / inner) * stride_outer + (row % inner) * stride_inner;
  }
};

}  // namespace ppo_kernels
