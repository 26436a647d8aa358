// KL math shared by the CPU (.cpp) and CUDA (.cu) kernels:
//  * the sampled-token KL estimators k1 / abs / k2 / k3 with their clamps and gradients
//    (kl_penalty, kl_penalized_rewards), and
//  * the online statistics of the full-vocabulary KL(softmax(z) || softmax(w)) (full_kl), a
//    two-distribution sibling of softmax_stats.h.
// Semantics: ppo_kernels/kl/reference.py and ppo_kernels/full_kl/reference.py.
#pragma once
#include <cfloat>
#include <cmath>

#include "common/macros.h"
#include "common/softmax_stats.h"

namespace ppo_kernels {

// ---------------------------------------------------------------------------------------------
// Sampled-token estimators, d = logprob - ref_logprob.
enum KLEstimator : int { kK1 = 0, kAbs = 1, kK2 = 2, kK3 = 3 };

// Clamps of one estimator call: d is clamped to [in_lo, in_hi] before the estimator and the value
// to [out_lo, out_hi] after it; an infinite bound is no bound. Like torch.clamp, a finite bound
// stops the gradient where it is active (strictly outside (lo, hi), NaN included).
struct KLClampSpec {
  float in_lo, in_hi, out_lo, out_hi;
};

PPO_HD bool clamp_passes(float v, float lo, float hi) {
  return (lo == -INFINITY || v > lo) && (hi == INFINITY || v < hi);
}

// NaN-propagating clamp (fminf / fmaxf would drop a NaN).
PPO_HD float clamp_nan(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// k3 = exp(x) - x - 1 with x = -d, given ex = exp(x). Near 0 the difference cancels (float32 would
// keep ~1 correct digit at |x| = 1e-3), so there it is a Taylor series with error < 1e-9 relative.
PPO_HD float k3_value(float x, float ex) {
  if (fabsf(x) < 0.25f) {
    const float p = 1.f / 40320.f;
    float t = fmaf(x, p, 1.f / 5040.f);
    t = fmaf(x, t, 1.f / 720.f);
    t = fmaf(x, t, 1.f / 120.f);
    t = fmaf(x, t, 1.f / 24.f);
    t = fmaf(x, t, 1.f / 6.f);
    t = fmaf(x, t, 0.5f);
    return x * x * t;
  }
  return (ex - 1.f) - x;
}

// The argument whose exp k3 needs (the only transcendental), so vectorised callers can compute
// exp in bulk: x = -clamp(d).
PPO_HD float k3_exp_arg(float d, const KLClampSpec& c) { return -clamp_nan(d, c.in_lo, c.in_hi); }

// Value and derivative d(value)/d(d) of one estimator. `ex` = exp(k3_exp_arg(d)) (only read for
// k3). straight_through: the value of `est`, the gradient of k2 (d, unclamped), as verl's "k3+".
struct KLValueGrad {
  float value;
  float grad;
};

PPO_HD KLValueGrad kl_estimate(float d, float ex, int est, const KLClampSpec& c,
                               bool straight_through) {
  const float dc = clamp_nan(d, c.in_lo, c.in_hi);
  float v, g;
  switch (est) {
    case kK1: v = dc; g = 1.f; break;
    case kAbs: v = fabsf(dc); g = dc > 0.f ? 1.f : (dc < 0.f ? -1.f : 0.f); break;
    case kK2: v = 0.5f * dc * dc; g = dc; break;
    default: {  // k3, d/dd (exp(-d) + d - 1) = 1 - exp(-d) = d - k3 (no cancellation near 0)
      v = k3_value(-dc, ex);
      g = dc - v;
      break;
    }
  }
  g = clamp_passes(d, c.in_lo, c.in_hi) ? g : 0.f;
  g = clamp_passes(v, c.out_lo, c.out_hi) ? g : 0.f;
  v = clamp_nan(v, c.out_lo, c.out_hi);
  return {v, straight_through ? d : g};
}

// ---------------------------------------------------------------------------------------------
// Full-vocabulary KL(p || q), p = softmax(z), q = softmax(w), in one pass over both.
// State relative to the running maxes mz, mw, with a_j = z_j - mz and b_j = w_j - mw:
//   sz = sum_j exp(a_j)     sw = sum_j exp(b_j)     u = sum_j exp(a_j) * (a_j - b_j)
// so KL = u / sz - log(sz) + log(sw). Keeping a - b relative to the maxes cancels a constant shift
// between z and w exactly (z = w + c gives KL = 0, not c - c in float32). Terms with p_j = 0
// contribute 0; p_j > 0 with q_j = 0 gives +inf (the true KL). Empty state: {-inf, 0, -inf, 0, 0}.
struct KLStats {
  float mz, sz, mw, sw, u;
};

PPO_HD KLStats kl_stats_empty() { return {-INFINITY, 0.f, -INFINITY, 0.f, 0.f}; }

// Move a state to maxes (mz2, mw2) that are >= its own (or NaN).
PPO_HD KLStats kl_stats_rescale(KLStats a, float mz2, float mw2) {
  KLStats r{mz2, 0.f, mw2, 0.f, 0.f};
  if (a.sz != 0.f) {
    const float dz = a.mz - mz2;
    const float f = expf(dz);
    // a_j - b_j grows by (mz - mz2) - (mw - mw2); if mw was -inf every old p-mass term is already
    // +inf (q_j = 0), and the +inf shift keeps it so.
    const float shift = dz - (a.mw == mw2 ? 0.f : a.mw - mw2);
    r.sz = a.sz * f;
    r.u = a.u == INFINITY ? INFINITY : f * (a.u + shift * a.sz);
  }
  if (a.sw != 0.f) r.sw = a.sw * expf(a.mw - mw2);
  return r;
}

PPO_HD KLStats kl_stats_merge(KLStats a, KLStats b) {
  const float mz = nan_max(a.mz, b.mz);
  const float mw = nan_max(a.mw, b.mw);
  const KLStats ra = kl_stats_rescale(a, mz, mw);
  const KLStats rb = kl_stats_rescale(b, mz, mw);
  return {mz, ra.sz + rb.sz, mw, ra.sw + rb.sw, ra.u + rb.u};
}

// One term's contribution to u, given e = exp(a) and a, b (b = -inf where q_j = 0).
PPO_HD float kl_term(float e, float a, float b) { return e > 0.f ? e * (a - b) : 0.f; }

// Add one pair (z_j, w_j), both already divided by the temperature.
PPO_HD void kl_stats_add(KLStats& st, float z, float w) {
  const float mz = (z <= st.mz) ? st.mz : z;  // larger or NaN
  const float mw = (w <= st.mw) ? st.mw : w;
  if (mz != st.mz || mw != st.mw) st = kl_stats_rescale(st, mz, mw);
  const float b = (st.mw == -INFINITY) ? -INFINITY : w - st.mw;
  if (st.mw != -INFINITY) st.sw += expf(b);
  if (st.mz == -INFINITY) return;  // z = -inf so far: no p mass
  const float a = z - st.mz;
  const float e = expf(a);
  st.sz += e;
  st.u += kl_term(e, a, b);
}

// KL(p || q); NaN when either row is all -inf (undefined distribution) or holds NaN / +inf.
PPO_HD float kl_stats_value(KLStats st) {
  if (st.mz == -INFINITY || st.mw == -INFINITY) return NAN;
  return st.u / st.sz - logf(st.sz) + logf(st.sw);
}

PPO_HD float kl_stats_lse_z(KLStats st) { return st.mz + logf(st.sz); }
PPO_HD float kl_stats_lse_w(KLStats st) { return st.mw + logf(st.sw); }

// Backward, per element: with c = lse_z - lse_w + KL (per row),
//   dKL/dz_j = p_j * ((z_j - w_j) - c),   dKL/dw_j = q_j - p_j,   (both times 1/temperature)
// and p_j = 0 gives 0 for the first (no 0 * inf).
PPO_HD float full_kl_grad_z(float p, float z, float w, float c) { return p > 0.f ? p * ((z - w) - c) : 0.f; }

}  // namespace ppo_kernels
