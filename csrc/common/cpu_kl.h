// CPU-only: the online KL statistics (kl_stats.h's KLStats) of one L1-resident block of two
// rows, vectorised with at::vec: the terms kl_stats_add sums, relative to the block's own maxes.
// The merge across blocks is the shared host/device code of kl_stats.h. Used by full_kl and the
// distillation tile kernels.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>

#include "common/cpu_softmax.h"
#include "common/kl_stats.h"

namespace ppo_kernels {
namespace cpu {

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v);
}

// KLStats of one block relative to its own maxes (mz, mw); the same terms as kl_stats_add.
inline KLStats block_kl_stats(const float* z, const float* w, int64_t n, float mz, float mw) {
  KLStats st{mz, 0.f, mw, 0.f, 0.f};
  const bool w_empty = mw == -INFINITY, z_empty = mz == -INFINITY;
  const Vec vmz(mz), vmw(mw), zero(0.f), ninf(-INFINITY), bound(kSeriesBound);
  Vec vsz(0.f), vv(0.f), vu(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec a = z_empty ? ninf : Vec::loadu(z + i) - vmz;
    const Vec b = w_empty ? ninf : Vec::loadu(w + i) - vmw;
    const Vec e = a.exp(), eb = b.exp(), d = b - a;
    vsz = vsz + e;
    vv = vv + Vec::blendv(eb - e, e * (d + expm1_minus_x_series(d)), d.abs() < bound);
    vu = vu + Vec::blendv(zero, e * (a - b), e > zero);
  }
  st.sz = hsum(vsz);
  st.v = hsum(vv);
  st.u = hsum(vu);
  for (; i < n; ++i) {
    const float a = z_empty ? -INFINITY : z[i] - mz;
    const float b = w_empty ? -INFINITY : w[i] - mw;
    const float e = std::exp(a), eb = std::exp(b);
    st.sz += e;
    st.v += kl_v_term(e, eb, a, b);
    st.u += kl_term(e, a, b);
  }
  return st;
}

}  // namespace cpu
}  // namespace ppo_kernels
