// Argument checks of the registered ops (`ppo_kernels::*`), run once per call before any backend:
// each message starts with the argument's name. Wrong dtypes are TypeErrors, wrong shapes,
// devices and values ValueErrors (TORCH_CHECK_TYPE / TORCH_CHECK_VALUE), so Python sees the same
// exception types as from the public API. Metadata only: never a host sync.
#pragma once
#include <torch/types.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>

#include "common/tensor_checks.h"

namespace ppo_kernels {

inline bool is_value_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble;
}

// float32 / bfloat16 / float16 / float64
inline void expect_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  TORCH_CHECK_TYPE(is_value_dtype(t.scalar_type()), name, ": dtype ", dtype_name(t.scalar_type()),
                   " is not supported (expected one of float32, bfloat16, float16, float64)");
}

// int64 / int32
inline void expect_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kLong || st == at::kInt, name, ": dtype ", dtype_name(st),
                   " is not supported (expected one of int64, int32)");
}

// a mask: bool, integer or float (not complex)
inline void expect_mask(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kBool || at::isIntegralType(st, false) || is_value_dtype(st), name,
                   ": dtype ", dtype_name(st),
                   " is not supported (expected bool, an integer or a float dtype)");
}

// `t` on the op's device, `like`'s (common/tensor_checks.h: check_device).
inline void expect_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                          const char* like_name) {
  check_device(t, name, like.device(), like_name);
}

inline void expect_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                         const char* what) {
  TORCH_CHECK_VALUE(t.sizes() == shape, name, ": expected shape ", shape_str(shape), " (", what,
                    "), got ", shape_str(t.sizes()));
}

inline void expect_dim(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": expected ", dim, " dimensions, got shape ",
                    shape_str(t.sizes()));
}

inline void expect_dtype(const at::Tensor& t, const char* name, at::ScalarType st,
                         const char* what) {
  TORCH_CHECK_TYPE(t.scalar_type() == st, name, ": expected dtype ", dtype_name(st), " (", what,
                   "), got ", dtype_name(t.scalar_type()));
}

// `t` on `like`'s device with `like`'s shape (and dtype when same_dtype)
inline void expect_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                        const char* like_name, bool same_dtype) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  expect_device(t, name, like, like_name);
  if (same_dtype) {
    TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, ": expected dtype ",
                     dtype_name(like.scalar_type()), " (like ", like_name, "), got ",
                     dtype_name(t.scalar_type()));
  }
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), name, ": expected shape ", shape_str(like.sizes()),
                    " (like ", like_name, "), got ", shape_str(t.sizes()));
}

// lo <= hi (+-inf allowed; NaN never passes)
inline void expect_bounds(const char* name, double lo, double hi) {
  TORCH_CHECK_VALUE(lo <= hi, name, ": bounds must satisfy lo <= hi, got (", lo, ", ", hi, ")");
}

inline double expect_finite(const char* name, double x) {
  TORCH_CHECK_VALUE(std::isfinite(x), name, ": expected a finite number, got ", x);
  return x;
}

inline double expect_positive(const char* name, double x) {
  TORCH_CHECK_VALUE(std::isfinite(x) && x > 0, name, ": expected a positive finite number, got ",
                    x);
  return x;
}

inline void expect_min_dim(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() >= dim, name, ": expected at least ", dim, " dimension(s), got shape ",
                    shape_str(t.sizes()));
}

// [..., V] with the last (vocabulary) dimension contiguous (a size-1 one may have any stride)
inline void expect_rows_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1 || t.size(-1) <= 1, name,
                    ": the last (vocabulary) dimension must be contiguous (stride 1); got strides ",
                    shape_str(t.strides()));
}

// A positive finite temperature whose inverse is finite in float32 (the kernels' 1 / T).
inline double expect_temperature(double t) {
  TORCH_CHECK_VALUE(std::isfinite(t) && t > 0,
                    "temperature: expected a positive finite number, got ", t);
  constexpr double kFloat32Max = 3.4028234663852886e38;
  TORCH_CHECK_VALUE(1.0 / t <= kFloat32Max, "temperature: ", t,
                    " is too small (1 / temperature overflows float32; the smallest accepted is ",
                    1.0 / kFloat32Max, ")");
  return t;
}

// Every label in [0, V) or equal to ignore_index, else an IndexError naming the first one outside.
// Reads the labels: a host sync on the GPU, where callers run it only under strict_checks()
// (route.h); the CPU kernels check their labels themselves.
inline void expect_labels_in_range(const at::Tensor& labels, int64_t V, int64_t ignore_index) {
  const at::Tensor bad =
      labels.ne(ignore_index).logical_and_(labels.lt(0).logical_or_(labels.ge(V)));
  if (!bad.any().item<bool>()) return;
  const int64_t pos = bad.flatten().nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_INDEX(false, "labels: value ", labels.flatten()[pos].item<int64_t>(),
                    " at flat position ", pos, " is outside the vocabulary [0, ", V,
                    ") and is not ignore_index (", ignore_index, ")");
}

// The per-token output dtype: float32, float64 for float64 inputs.
inline at::ScalarType out_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace ppo_kernels
