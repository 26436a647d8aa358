// Rows of a [..., V] tensor whose last dim is contiguous and whose leading dims have any strides,
// e.g. logits[:, :-1] of a contiguous [B, T+1, V] tensor, or x[:, :-1, :-1] of a 4-D one: the
// leading dims are collapsed where they can be (stride[d] == size[d+1] * stride[d+1]) and row r is
// decomposed over the remaining ones, innermost first. Sliced logits are thus read (and gradients
// written) without a copy. All offsets are 64-bit (N x V may exceed 2^31).
#pragma once
#include <cstdint>

#include "common/macros.h"

namespace ppo_kernels {

// Leading dims that do not collapse, at most (a tensor of up to kMaxRowDims + 1 dims always fits).
constexpr int kMaxRowDims = 8;

struct RowIndexer {
  int ndim = 0;                      // collapsed leading dims (0: a single row)
  int64_t size[kMaxRowDims] = {};    // innermost first
  int64_t stride[kMaxRowDims] = {};  // in elements
  PPO_HD int64_t operator()(int64_t row) const {
    int64_t off = 0;
    for (int d = 0; d + 1 < ndim; ++d) {
      const int64_t q = row / size[d];
      off += (row - q * size[d]) * stride[d];
      row = q;
    }
    return ndim > 0 ? off + row * stride[ndim - 1] : off;
  }
};

}  // namespace ppo_kernels
