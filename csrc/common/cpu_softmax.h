// CPU-only building blocks of the vocabulary kernels (token_logprobs, linear_token_logprobs):
// dtype <-> float32 block conversion and the softmax stats of one L1-resident block, vectorised
// with at::vec. The merge across blocks is the shared host/device code of softmax_stats.h.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16-math.h>

#include <algorithm>

#include "common/softmax_stats.h"

namespace ppo_kernels {
namespace cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 2048;  // floats per L1-resident block of a row

// dtype <-> float32 conversion of a block, vectorised for bf16 / fp16 (at::vec::convert's
// generic path is scalar).
template <typename scalar_t>
inline void to_float(const scalar_t* x, float* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::copy(x, x + n, buf);
  } else if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    using bVec = at::vec::Vectorized<scalar_t>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(bVec::loadu(x + i));
      a.store(buf + i);
      b.store(buf + i + Vec::size());
    }
    for (; i < n; ++i) buf[i] = static_cast<float>(x[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(x[i]);
  }
}

template <typename scalar_t>
inline void from_float(const float* buf, scalar_t* y, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::copy(buf, buf + n, y);
  } else if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    using bVec = at::vec::Vectorized<scalar_t>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      at::vec::convert_from_float<scalar_t>(Vec::loadu(buf + i), Vec::loadu(buf + i + Vec::size()))
          .store(y + i);
    }
    for (; i < n; ++i) y[i] = static_cast<scalar_t>(buf[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<scalar_t>(buf[i]);
  }
}

// v as computed, rounded: GCC contracts a product and a following subtraction into one FMA even
// across statements (-ffp-contract=fast), which keeps the product's rounding error (~1e31 for
// scaled logits near 1e38). An empty asm makes the value opaque to that.
inline Vec rounded(Vec v) {
#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
  __m256 r = v;
  asm("" : "+x"(r));
  return Vec(r);
#elif defined(__GNUC__)
  float t[Vec::size()];
  v.store(t);
  asm volatile("" : : "r"(t) : "memory");
  return Vec::loadu(t);
#else
  return v;  // (MSVC contracts only under /fp:contract)
#endif
}

// Load n values as float32 scaled by inv_t into buf; returns their (NaN-propagating) max. One
// pass: each vector is converted, scaled and stored as it is read. The product is rounded when it
// is stored (the kernels read it back: no later subtraction can fuse with it into an FMA).
template <typename scalar_t>
inline float load_scaled(const scalar_t* x, int64_t n, float inv_t, float* buf) {
  const Vec vt(inv_t);
  Vec vmax(-INFINITY);
  int64_t i = 0;
  if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    using bVec = at::vec::Vectorized<scalar_t>;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(bVec::loadu(x + i));
      a = a * vt;
      b = b * vt;
      a.store(buf + i);
      b.store(buf + i + Vec::size());
      vmax = at::vec::maximum(vmax, at::vec::maximum(a, b));  // propagates NaN
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec z = Vec::loadu(x + i) * vt;
      z.store(buf + i);
      vmax = at::vec::maximum(vmax, z);
    }
  }
  float m = -INFINITY;
  for (; i < n; ++i) {
    buf[i] = static_cast<float>(x[i]) * inv_t;
    m = nan_max(m, buf[i]);
  }
  float lanes[Vec::size()];
  vmax.store(lanes);
  for (float v : lanes) m = nan_max(m, v);
  return m;
}

// Softmax stats of one block (values already scaled), relative to its max m. kKeep: each value
// z_j is overwritten by exp(z_j - m) as it is summed (0 in an all -inf block), for a gradient
// pass that follows while the row is in cache (cpu_rows.h).
template <bool kKeep>
inline SoftmaxStats block_stats_impl(float* z, int64_t n, float m) {
  if (m == -INFINITY) {  // all -inf: contributes nothing
    if constexpr (kKeep) std::fill(z, z + n, 0.f);
    return stats_empty();
  }
  if (m == INFINITY || m != m) return {m, NAN, NAN};  // +inf / NaN poison the row
  const Vec vm(m), floor_(-FLT_MAX);
  Vec vs(0.f), vu(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec d = Vec::loadu(z + i) - vm;
    const Vec e = d.exp_u20();
    if constexpr (kKeep) e.store(z + i);
    vs = vs + e;
    vu = at::vec::fmadd(e, at::vec::clamp_min(d, floor_), vu);  // (no NaN here: one max op)
  }
  float s = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, vs);
  float u = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, vu);
  for (; i < n; ++i) {
    const float d = z[i] - m;
    const float e = std::exp(d);
    if constexpr (kKeep) z[i] = e;
    s += e;
    u += weighted_offset(e, d);
  }
  return {m, s, u};
}

// Softmax stats of one L1-resident block (values already scaled), relative to its max m.
inline SoftmaxStats block_stats(const float* z, int64_t n, float m) {
  return block_stats_impl<false>(const_cast<float*>(z), n, m);  // (read only)
}

}  // namespace cpu
}  // namespace ppo_kernels
