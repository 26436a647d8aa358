// Online softmax statistics: the one-pass log-sum-exp (and entropy) merge used by every
// vocabulary kernel (token_logprobs, full_kl, linear_token_logprobs) on the CPU and the GPU.
#pragma once
#include <cfloat>
#include <cmath>

#include "common/macros.h"

namespace ppo_kernels {

// Statistics of a set of values z, relative to their running max m:
//   s = sum_j exp(z_j - m)          u = sum_j exp(z_j - m) * (z_j - m)
// so logsumexp = m + log(s) and entropy = log(s) - u / s. Keeping u relative to m (instead of
// sum p*z) avoids the cancellation lse - E[z] suffers when logits are large and entropy small.
// The empty set is {-inf, 0, 0}. NaN anywhere propagates into s (and so into every result).
struct SoftmaxStats {
  float m;
  float s;
  float u;
};

PPO_HD SoftmaxStats stats_empty() { return {-INFINITY, 0.f, 0.f}; }

// NaN-propagating max (fmaxf drops NaN, which would hide a NaN logit).
PPO_HD float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// exp(z - m) * (z - m) with the 0 * -inf = NaN case (z = -inf, m finite) mapped to 0.
PPO_HD float weighted_offset(float e, float d) { return e * fmaxf(d, -FLT_MAX); }

// Move a state to a larger (or NaN) max m_new. A state with s == 0 is empty and just takes m_new.
PPO_HD SoftmaxStats stats_rescale(SoftmaxStats a, float m_new) {
  if (a.s == 0.f) return {m_new, 0.f, 0.f};
  const float d = a.m - m_new;
  const float f = expf(d);
  return {m_new, a.s * f, f * (a.u + d * a.s)};
}

// Merge two partial states; associative and commutative (up to rounding).
PPO_HD SoftmaxStats stats_merge(SoftmaxStats a, SoftmaxStats b) {
  if (a.s == 0.f && a.m == -INFINITY) return b;
  if (b.s == 0.f && b.m == -INFINITY) return a;
  const float m = nan_max(a.m, b.m);
  const SoftmaxStats ra = stats_rescale(a, m);
  const SoftmaxStats rb = stats_rescale(b, m);
  return {m, ra.s + rb.s, ra.u + rb.u};
}

// Add one value z (already divided by the temperature). A state whose max is still -inf holds
// only -inf values, which contribute nothing.
PPO_HD void stats_add(SoftmaxStats& st, float z) {
  if (!(z <= st.m)) st = stats_rescale(st, z);  // z > m, or z NaN
  if (st.m == -INFINITY) return;
  const float d = z - st.m;
  const float e = expf(d);
  st.s += e;
  st.u += weighted_offset(e, d);
}

// logsumexp; -inf for an all -inf row, NaN if any value was NaN or +inf (checked explicitly: fast
// vector exp implementations need not map exp(inf - inf) to NaN).
PPO_HD float stats_lse(SoftmaxStats st) { return st.m == INFINITY ? NAN : st.m + logf(st.s); }

// Entropy of softmax(z); NaN for an all -inf row (undefined distribution), NaN or +inf values.
PPO_HD float stats_entropy(SoftmaxStats st) {
  return st.m == INFINITY ? NAN : logf(st.s) - st.u / st.s;
}

}  // namespace ppo_kernels
