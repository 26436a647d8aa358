// Per-token math of the PPO losses, written once, generic over the lane type V: `float` (a CUDA
// thread, or a scalar loop) and `at::vec::Vectorized<float>` (the CPU kernels in
// csrc/cpu/losses.cpp, 8 tokens per AVX2 instruction). Semantics: ppo_kernels/losses/naive.py.
// The gradients are what torch (>= 2.14) autograd gives for the reference composition, including
// its rules at measure-zero points:
//  * at a tie, torch.maximum / torch.minimum send half of the gradient to each side;
//  * torch.clamp with scalar bounds passes no gradient at exactly a bound (older torch passed it
//    there: an exact-boundary-only difference).
// NaN propagates like torch: a NaN input gives a NaN loss and gradient.
#pragma once
#include <cmath>

#include "common/macros.h"

#if !defined(__CUDACC__) && !defined(__HIPCC__)
#include <ATen/cpu/vec/vec.h>
#endif

namespace ppo_kernels {

// Slots of the per-row partial sums the loss kernels produce: the masked loss, the mask, and the
// masked sums of the per-token statistics (TokenTerms::stat, in its order).
enum LossPartial { kSumLoss = 0, kSumMask, kSumStat, kNumPartials = kSumStat + 6 };

// ---- lane primitives: a condition is `bool` for float and a bit mask for Vectorized<float> ----
PPO_HD float lane_select(bool c, float a, float b) { return c ? a : b; }  // a where c
PPO_HD float lane_ind(bool c) { return c ? 1.f : 0.f; }
PPO_HD bool lane_or(bool a, bool b) { return a || b; }
PPO_HD float lane_exp(float x) { return expf(x); }

#if !defined(__CUDACC__) && !defined(__HIPCC__)
using VecF = at::vec::Vectorized<float>;
inline VecF lane_select(const VecF& c, const VecF& a, const VecF& b) {
  return VecF::blendv(b, a, c);
}
inline VecF lane_ind(const VecF& c) { return VecF::blendv(VecF(0.f), VecF(1.f), c); }
inline VecF lane_or(const VecF& a, const VecF& b) { return a | b; }
inline VecF lane_exp(const VecF& x) { return x.exp(); }
#endif

// clamp that keeps NaN (fminf / fmaxf would drop it), like torch.clamp.
template <typename V>
PPO_HD V clamp_nan(V x, V lo, V hi) {
  return lane_select(x < lo, lo, lane_select(x > hi, hi, x));
}

// d max(a, b) / da under torch's rule: 1, 0, or 1/2 at a tie (and for NaN).
template <typename V>
PPO_HD V max_weight_first(V a, V b) {
  const V gt = lane_ind(a > b), lt = lane_ind(a < b);
  return gt + V(0.5f) * (V(1.f) - gt - lt);
}

// torch.maximum / torch.minimum (NaN in either argument propagates).
template <typename V>
PPO_HD V max_nan(V a, V b) {
  return lane_select(lane_or(a != a, a > b), a, b);
}
template <typename V>
PPO_HD V min_nan(V a, V b) {
  return lane_select(lane_or(a != a, a < b), a, b);
}

template <typename V>
struct TokenTerms {
  V loss;  // per-token loss
  V grad;  // d loss / d (logprob or value)
  // policy: clipped, clipped_lo, -log-ratio, ratio, TRL's clip_low, clip_high indicators;
  // value: clipped (the rest unused)
  V stat[6];
};

// Per-token statistics each loss kernel sums (the leading entries of TokenTerms::stat).
constexpr int kPolicyTokenStats = 6;
constexpr int kValueTokenStats = 1;

// Policy loss. lo = 1 - clip_low, hi = 1 + clip_high; dual_c <= 0 disables dual clip; lr_clamp
// bounds the log-ratio (verl: 20) before exp. Statistics: clipped (verl's pg_clipfrac: the clipped
// branch strictly larger), clipped_lo (dual clip bounds the loss: A < 0 and clip1 > -A * c).
template <typename V>
PPO_HD TokenTerms<V> policy_token(V lp, V old_lp, V adv, float lo, float hi, float dual_c,
                                  float lr_clamp) {
  TokenTerms<V> o;
  const V zero(0.f), one(1.f), vlo(lo), vhi(hi), vlr(lr_clamp), vnlr(-lr_clamp);
  const V d = lp - old_lp;
  const V dc = clamp_nan(d, vnlr, vlr);
  const V r = lane_exp(dc);
  const V nadv = zero - adv;
  const V pg1 = nadv * r;
  const V pg2 = nadv * clamp_nan(r, vlo, vhi);
  const V clip1 = max_nan(pg1, pg2);
  // d clip1 / d r = -A * (w1 + (1 - w1) * [lo < r < hi])
  const V w1 = max_weight_first(pg1, pg2);
  V g = nadv * (w1 + (one - w1) * (lane_ind(r > vlo) * lane_ind(r < vhi)));
  V loss = clip1;
  o.stat[0] = lane_ind(pg2 > pg1);
  o.stat[1] = zero;
  if (dual_c > 0.f) {
    const auto neg = adv < zero;
    const V pg3 = nadv * V(dual_c);
    o.stat[1] = lane_ind(neg) * lane_ind(clip1 > pg3);
    loss = lane_select(neg, min_nan(clip1, pg3), clip1);
    g = lane_select(neg, g * max_weight_first(pg3, clip1), g);  // torch.minimum's share for clip1
  }
  o.loss = loss;
  o.grad = g * r * (lane_ind(d > vnlr) * lane_ind(d < vlr));  // the clamp's pass-through
  o.stat[2] = zero - dc;
  o.stat[3] = r;
  // TRL's / Liger's clip indicators (their ratio is this one): below 1 - eps with A < 0, above
  // 1 + eps with A > 0 -- exclusive by A's sign, so their region is their sum. NaN: 0.
  o.stat[4] = lane_ind(r < vlo) * lane_ind(adv < zero);
  o.stat[5] = lane_ind(r > vhi) * lane_ind(adv > zero);
  return o;
}

// Value loss: 0.5 * max((v - G)^2, (clip(v) - G)^2) with clip(v) = max(min(v, v_old + eps),
// v_old - eps) (verl's clip_by_value); clip <= 0: 0.5 * (v - G)^2. Statistic: clipped error
// strictly larger (verl's vf_clipfrac).
template <typename V>
PPO_HD TokenTerms<V> value_token(V v, V v_old, V ret, float clip) {
  TokenTerms<V> o;
  const V zero(0.f), one(1.f), half(0.5f);
  const V e1 = v - ret;
  const V l1 = e1 * e1;
  for (int q = 1; q < 6; ++q) o.stat[q] = zero;
  if (!(clip > 0.f)) {
    o.loss = half * l1;
    o.grad = e1;
    o.stat[0] = zero;
    return o;
  }
  const V hi = v_old + V(clip), lo = v_old - V(clip);
  const V mn = min_nan(v, hi);
  const V vc = max_nan(mn, lo);
  const V dvc = (one - max_weight_first(v, hi)) * max_weight_first(mn, lo);
  const V e2 = vc - ret;
  const V l2 = e2 * e2;
  const V w1 = max_weight_first(l1, l2);
  o.loss = half * max_nan(l1, l2);
  o.grad = w1 * e1 + (one - w1) * e2 * dvc;
  o.stat[0] = lane_ind(l2 > l1);
  return o;
}

}  // namespace ppo_kernels
