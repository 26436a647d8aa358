// Tensor elements to and from float buffers on the CPU: the losses' and the group advantages'
// kernels read every real dtype (bool masks included) through these.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ppo_kernels {
namespace cpu {

// n elements of t (contiguous, any real dtype) from flat offset off, as float.
inline void load_float(const at::Tensor& t, int64_t off, int64_t n, float* buf) {
  if (t.scalar_type() == at::kBool) {
    // as bytes: gcc does not vectorise bool -> float, and its scalar int -> float conversions
    // chain on a false register dependency (several times the cost of the whole pass)
    const uint8_t* p = reinterpret_cast<const uint8_t*>(t.const_data_ptr<bool>()) + off;
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return;
  }
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kBFloat16, at::kHalf, t.scalar_type(), "ppo_load", [&] {
    const scalar_t* p = t.const_data_ptr<scalar_t>() + off;
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  });
}

// The same n elements as float: in place for a float32 tensor, else converted into buf.
inline const float* as_float(const at::Tensor& t, int64_t off, int64_t n, float* buf) {
  if (t.scalar_type() == at::kFloat) return t.const_data_ptr<float>() + off;
  load_float(t, off, n, buf);
  return buf;
}

inline void store_float(at::Tensor& t, int64_t off, int64_t n, const float* buf) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "ppo_store", [&] {
    scalar_t* p = t.data_ptr<scalar_t>() + off;
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<scalar_t>(buf[i]);
  });
}

}  // namespace cpu
}  // namespace ppo_kernels
