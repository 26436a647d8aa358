// Host-side helpers shared by the op implementations (CPU and CUDA files).
#pragma once
#include <torch/types.h>

#include <optional>

#include "common/row_indexer.h"

namespace ppo_kernels {

// A RowIndexer for the leading dims of `t` (last dim must be contiguous), or nullopt when the
// leading dims do not collapse to two strided dims (the caller then makes `t` contiguous).
inline std::optional<RowIndexer> make_row_indexer(const at::Tensor& t) {
  const int64_t nd = t.dim();
  TORCH_CHECK(nd >= 1, "expected at least 1 dimension");
  // Collapse leading dims from the innermost out; size-1 dims never matter.
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride), innermost first
  for (int64_t d = nd - 2; d >= 0; --d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size == 1) continue;
    if (!dims.empty() && dims.back().second * dims.back().first == stride) {
      dims.back().first *= size;
    } else {
      dims.push_back({size, stride});
    }
  }
  if (dims.empty()) return RowIndexer{1, 0, t.size(-1)};
  if (dims.size() == 1) return RowIndexer{dims[0].first, 0, dims[0].second};
  if (dims.size() == 2) return RowIndexer{dims[0].first, dims[1].second, dims[0].second};
  return std::nullopt;
}

// `t` with its RowIndexer, or a contiguous copy of `t` when its leading dims do not collapse.
inline std::pair<at::Tensor, RowIndexer> rows_of(const at::Tensor& t) {
  if (auto ri = make_row_indexer(t)) return {t, *ri};
  at::Tensor c = t.contiguous();
  return {c, *make_row_indexer(c)};
}

inline int64_t leading_numel(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) n *= t.size(d);
  return n;
}

}  // namespace ppo_kernels
