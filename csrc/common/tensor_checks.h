// Host-side helpers shared by the op implementations (CPU and CUDA files).
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "common/row_indexer.h"

namespace ppo_kernels {

// A RowIndexer for the leading dims of `t` (last dim must be contiguous), or nullopt when more
// than kMaxRowDims leading dims remain after collapsing (the caller then copies or refuses).
inline std::optional<RowIndexer> make_row_indexer(const at::Tensor& t) {
  const int64_t nd = t.dim();
  TORCH_CHECK(nd >= 1, "expected at least 1 dimension");
  RowIndexer ri;
  if (t.numel() == 0) return ri;  // no row is read (and an empty tensor's strides can be anything)
  // Collapse leading dims from the innermost out; size-1 dims never matter.
  for (int64_t d = nd - 2; d >= 0; --d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size == 1) continue;
    if (ri.ndim > 0 && ri.stride[ri.ndim - 1] * ri.size[ri.ndim - 1] == stride) {
      ri.size[ri.ndim - 1] *= size;
    } else {
      if (ri.ndim == kMaxRowDims) return std::nullopt;
      ri.size[ri.ndim] = size;
      ri.stride[ri.ndim] = stride;
      ++ri.ndim;
    }
  }
  return ri;
}

// `t` with its RowIndexer, or a contiguous copy of `t` when its leading dims do not collapse.
inline std::pair<at::Tensor, RowIndexer> rows_of(const at::Tensor& t) {
  if (auto ri = make_row_indexer(t)) return {t, *ri};
  at::Tensor c = t.contiguous();
  return {c, *make_row_indexer(c)};
}

inline std::string dtype_name(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kDouble:
      return "float64";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kBool:
      return "bool";
    default:
      return c10::toString(st);
  }
}

// A shape as Python prints a tuple, what torch users read in `tensor.shape`: (2, 16), (5,), ().
inline std::string shape_str(at::IntArrayRef shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// Every tensor argument is on the op's device: a ValueError naming the argument and both devices
// (`mask: expected a tensor on cpu (like logprobs), got meta`). Empty tensors too: a kernel that
// is handed one may still read its pointer, and the caller's mistake is the same.
inline void check_device(const at::Tensor& t, const char* name, const at::Device& device,
                         const char* like) {
  TORCH_CHECK_VALUE(t.device() == device, name, ": expected a tensor on ", device, " (like ", like,
                    "), got ", t.device());
}

// The device of a raw kernel's call and the argument it is read from (for the messages).
struct DeviceOf {
  at::Device device;
  const char* like;
};
inline DeviceOf device_of(const at::Tensor& t, const char* name) { return {t.device(), name}; }

// Argument checks of the raw kernels (torch.ops.ppo_kernels_C.*): each message names the argument,
// so a wrong size, dtype or device is an error, never an out-of-bounds read. As the registered
// ops: TypeError for dtypes, ValueError for devices and sizes.
enum class Kind { kAny, kFloat32, kFloating, kIndex };

inline void check_arg(const at::Tensor& t, const char* name, const DeviceOf& on,
                      Kind kind = Kind::kAny) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  check_device(t, name, on.device, on.like);
  const at::ScalarType st = t.scalar_type();
  switch (kind) {
    case Kind::kAny:
      break;
    case Kind::kFloat32:
      TORCH_CHECK_TYPE(st == at::kFloat, name, ": expected dtype float32, got ", dtype_name(st));
      break;
    case Kind::kFloating:
      TORCH_CHECK_TYPE(
          st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble, name,
          ": expected a float dtype (float32, bfloat16, float16, float64), got ", dtype_name(st));
      break;
    case Kind::kIndex:
      TORCH_CHECK_TYPE(st == at::kLong || st == at::kInt, name,
                       ": expected dtype int64 or int32, got ", dtype_name(st));
      break;
  }
}

// check_arg plus the number of elements (`what` says where that number comes from).
inline void check_arg(const at::Tensor& t, const char* name, const DeviceOf& on, Kind kind,
                      int64_t numel, const char* what) {
  check_arg(t, name, on, kind);
  TORCH_CHECK_VALUE(t.numel() == numel, name, ": expected ", numel, " elements (", what,
                    "), got shape ", shape_str(t.sizes()));
}

inline int64_t leading_numel(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) n *= t.size(d);
  return n;
}

}  // namespace ppo_kernels
