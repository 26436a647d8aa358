// KL math shared by the CPU (.cpp) and CUDA (.cu) kernels:
//  * the sampled-token KL estimators k1 / abs / k2 / k3 with their clamps and gradients
//    (kl_penalty, kl_penalized_rewards), and
//  * the online statistics of the full-vocabulary KL(softmax(z) || softmax(w)) (full_kl), a
//    two-distribution sibling of softmax_stats.h.
// Semantics: ppo_kernels/kl/naive.py and ppo_kernels/full_kl/naive.py.
#pragma once
#include <cfloat>
#include <cmath>

#include "common/macros.h"
#include "common/softmax_stats.h"

#if !defined(__CUDACC__) && !defined(__HIPCC__)
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#endif

namespace ppo_kernels {

// ---------------------------------------------------------------------------------------------
// Lane primitives: the estimator math below is generic over the lane type V, `float` (a CUDA
// thread, a scalar loop) or `at::vec::Vectorized<float>` (the CPU kernels, 8 tokens per AVX2
// instruction, branch-free). A condition is `bool` for float and a bit mask for Vectorized.
namespace kl_lanes {
PPO_HD float sel(bool c, float a, float b) { return c ? a : b; }  // a where c
PPO_HD float absv(float x) { return fabsf(x); }
PPO_HD float fma_(float a, float b, float c) { return fmaf(a, b, c); }
#if !defined(__CUDACC__) && !defined(__HIPCC__)
using VecF = at::vec::Vectorized<float>;
inline VecF sel(const VecF& c, const VecF& a, const VecF& b) { return VecF::blendv(b, a, c); }
inline VecF absv(const VecF& x) { return x.abs(); }
inline VecF fma_(const VecF& a, const VecF& b, const VecF& c) { return at::vec::fmadd(a, b, c); }
#endif
}  // namespace kl_lanes

// exp(x) - 1 - x by its Taylor series: error < 1e-9 relative for |x| < kSeriesBound.
constexpr float kSeriesBound = 0.25f;  // below it the series, above it exp(x) (no cancellation)

template <typename V>
PPO_HD V expm1_minus_x_series(V x) {
  using namespace kl_lanes;
  V t = fma_(x, V(1.f / 40320.f), V(1.f / 5040.f));
  t = fma_(x, t, V(1.f / 720.f));
  t = fma_(x, t, V(1.f / 120.f));
  t = fma_(x, t, V(1.f / 24.f));
  t = fma_(x, t, V(1.f / 6.f));
  t = fma_(x, t, V(0.5f));
  return x * x * t;
}

// ---------------------------------------------------------------------------------------------
// Sampled-token estimators, d = logprob - ref_logprob.
enum KLEstimator : int { kK1 = 0, kAbs = 1, kK2 = 2, kK3 = 3 };

// Clamps of one estimator call: d is clamped to [in_lo, in_hi] before the estimator and the value
// to [out_lo, out_hi] after it; an infinite bound is no bound. Like torch.clamp, a finite bound
// stops the gradient where it is active (outside the open interval (lo, hi), NaN included).
struct KLClampSpec {
  float in_lo, in_hi, out_lo, out_hi;
};

// NaN-propagating clamp (fminf / fmaxf would drop a NaN).
template <typename V>
PPO_HD V clamp_keep_nan(V v, float lo, float hi) {
  using namespace kl_lanes;
  return sel(v < V(lo), V(lo), sel(v > V(hi), V(hi), v));
}

// g where v is strictly inside the finite bounds, else 0 (the bounds are uniform: plain branches).
template <typename V>
PPO_HD V clamp_gate(V g, V v, float lo, float hi) {
  using namespace kl_lanes;
  if (lo != -INFINITY) g = sel(v > V(lo), g, V(0.f));
  if (hi != INFINITY) g = sel(v < V(hi), g, V(0.f));
  return g;
}

// k3 = exp(x) - x - 1 with x = -d, given ex = exp(x). Near 0 the difference cancels (float32 would
// keep ~1 correct digit at |x| = 1e-3), so there it is the series.
template <typename V>
PPO_HD V k3_value(V x, V ex) {
  using namespace kl_lanes;
  return sel(absv(x) < V(kSeriesBound), expm1_minus_x_series(x), (ex - V(1.f)) - x);
}

// The argument whose exp k3 needs (the only transcendental), so callers compute exp in bulk.
template <typename V>
PPO_HD V k3_exp_arg(V d, const KLClampSpec& c) {
  return V(0.f) - clamp_keep_nan(d, c.in_lo, c.in_hi);
}

// Value and derivative d(value)/d(d) of one estimator EST. `ex` = exp(k3_exp_arg(d)) (only read
// for k3). straight_through: the value of EST, the gradient of k2 (d, unclamped), as verl's "k3+".
template <typename V>
struct KLValueGrad {
  V value;
  V grad;
};

template <int EST, typename V>
PPO_HD KLValueGrad<V> kl_estimate(V d, V ex, const KLClampSpec& c, bool straight_through) {
  using namespace kl_lanes;
  const V dc = clamp_keep_nan(d, c.in_lo, c.in_hi);
  V v, g;
  if constexpr (EST == kK1) {
    v = dc;
    g = V(1.f);
  } else if constexpr (EST == kAbs) {
    v = absv(dc);
    g = sel(dc > V(0.f), V(1.f), sel(dc < V(0.f), V(-1.f), V(0.f)));
  } else if constexpr (EST == kK2) {
    v = V(0.5f) * dc * dc;
    g = dc;
  } else {  // k3: d/dd (exp(-d) + d - 1) = 1 - exp(-d) = d - k3 (no cancellation near 0)
    v = k3_value(V(0.f) - dc, ex);
    g = dc - v;
  }
  g = clamp_gate(g, d, c.in_lo, c.in_hi);
  g = clamp_gate(g, v, c.out_lo, c.out_hi);
  v = clamp_keep_nan(v, c.out_lo, c.out_hi);
  return {v, straight_through ? d : g};
}

// ---------------------------------------------------------------------------------------------
// Full-vocabulary KL(p || q), p = softmax(z), q = softmax(w), in one pass over both.
// State relative to the running maxes mz, mw, with a_j = z_j - mz and b_j = w_j - mw:
//   sz = sum_j e^a_j     v = sum_j (e^b_j - e^a_j)  (= sw - sz)     u = sum_j e^a_j (a_j - b_j)
// so KL = E_p[a - b] + log(sw / sz) = u / sz + log1p(v / sz). Each term of v is computed as
// e^a expm1(b - a) where b ~ a, so near-identical distributions (the common case: policy close to
// the reference) keep full relative accuracy, where log(sw) - log(sz) would leave ~eps * log V of
// absolute error; a - b relative to the maxes also cancels a constant shift z = w + c exactly.
// Terms with p_j = 0 contribute 0 to u; p_j > 0 with q_j = 0 gives +inf (the true KL).
// Empty state: {-inf, 0, -inf, 0, 0}.
struct KLStats {
  float mz, sz, mw, v, u;
};

PPO_HD KLStats kl_stats_empty() { return {-INFINITY, 0.f, -INFINITY, 0.f, 0.f}; }

// exp(m_old - m_new) for a max that can only grow; 1 when unchanged (also -inf to -inf).
PPO_HD float max_shift(float m_old, float m_new, float& d) {
  d = (m_old == m_new) ? 0.f : m_old - m_new;
  return expf(d);
}

// Move a state to maxes (mz2, mw2) that are >= its own (or NaN).
PPO_HD KLStats kl_stats_rescale(KLStats a, float mz2, float mw2) {
  float dz, dw;
  const float fz = max_shift(a.mz, mz2, dz);
  const float fw = max_shift(a.mw, mw2, dw);
  const float sw = a.sz + a.v;
  KLStats r{mz2, 0.f, mw2, sw * fw, 0.f};  // no p mass: v = sw
  if (a.sz != 0.f) {
    r.sz = a.sz * fz;
    // v' = sw fw - sz fz = v fw + sz fz expm1(dw - dz): the second form when both maxes moved
    // (almost) together, where the first would cancel
    const float x = dw - dz;
    r.v =
        fabsf(x) < kSeriesBound ? a.v * fw + r.sz * (x + expm1_minus_x_series(x)) : sw * fw - r.sz;
    // a_j - b_j grows by dz - dw; if mw was -inf every old p-mass term is already +inf (q_j = 0),
    // and the +inf shift keeps it so.
    r.u = a.u == INFINITY ? INFINITY : fz * (a.u + (dz - dw) * a.sz);
  }
  return r;
}

PPO_HD KLStats kl_stats_merge(KLStats a, KLStats b) {
  const float mz = nan_max(a.mz, b.mz);
  const float mw = nan_max(a.mw, b.mw);
  const KLStats ra = kl_stats_rescale(a, mz, mw);
  const KLStats rb = kl_stats_rescale(b, mz, mw);
  return {mz, ra.sz + rb.sz, mw, ra.v + rb.v, ra.u + rb.u};
}

// One term's contribution to u, given e = exp(a) and a, b (b = -inf where q_j = 0).
PPO_HD float kl_term(float e, float a, float b) { return e > 0.f ? e * (a - b) : 0.f; }

// One term's contribution to v = e^b - e^a, given e = exp(a), eb = exp(b).
PPO_HD float kl_v_term(float e, float eb, float a, float b) {
  const float d = b - a;
  return fabsf(d) < kSeriesBound ? e * (d + expm1_minus_x_series(d)) : eb - e;
}

// Add one pair (z_j, w_j), both already divided by the temperature.
PPO_HD void kl_stats_add(KLStats& st, float z, float w) {
  const float mz = (z <= st.mz) ? st.mz : z;  // larger or NaN
  const float mw = (w <= st.mw) ? st.mw : w;
  if (mz != st.mz || mw != st.mw) st = kl_stats_rescale(st, mz, mw);
  const float b = (st.mw == -INFINITY) ? -INFINITY : w - st.mw;
  const float a = (st.mz == -INFINITY) ? -INFINITY : z - st.mz;
  const float e = expf(a), eb = expf(b);
  st.sz += e;
  st.v += kl_v_term(e, eb, a, b);
  st.u += kl_term(e, a, b);
}

// KL(p || q); NaN when either row is all -inf (undefined distribution) or holds NaN / +inf.
PPO_HD float kl_stats_value(KLStats st) {
  if (st.mz == -INFINITY || st.mw == -INFINITY) return NAN;
  return st.u / st.sz + log1pf(st.v / st.sz);
}

PPO_HD float kl_stats_lse_z(KLStats st) { return st.mz + logf(st.sz); }
PPO_HD float kl_stats_lse_w(KLStats st) { return st.mw + logf(st.sz + st.v); }

// Backward, per element: with c = lse_z - lse_w + KL (per row),
//   dKL/dz_j = p_j * ((z_j - w_j) - c),   dKL/dw_j = q_j - p_j,   (both times 1/temperature)
// and p_j = 0 gives 0 for the first (no 0 * inf).
PPO_HD float full_kl_grad_z(float p, float z, float w, float c) {
  return p > 0.f ? p * ((z - w) - c) : 0.f;
}

}  // namespace ppo_kernels
