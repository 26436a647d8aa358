// Per-token math of the PPO losses, written once for the CPU kernels (csrc/cpu/losses.cpp) and any
// CUDA kernel. Semantics: ppo_kernels/losses/reference.py. The gradients are exactly what torch
// autograd gives for the reference composition, including its rules at measure-zero points:
//  * at a tie, torch.maximum / torch.minimum send half of the gradient to each side;
//  * torch.clamp with scalar bounds passes no gradient at exactly a bound (torch >= 2.14; older
//    torch passed it there: an exact-boundary-only difference).
#pragma once
#include <cmath>

#include "common/macros.h"

namespace ppo_kernels {

// Slots of the per-row partial sums both loss kernels produce.
enum LossPartial { kSumLoss = 0, kSumMask, kSumClip, kSumClipLower, kSumNegLogRatio, kSumRatio,
                   kNumPartials };

// clamp that keeps NaN (fminf / fmaxf would drop it), like torch.clamp.
PPO_HD float clamp_nan(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

// d max(a, b) / da under torch's rule: 1, 0, or 1/2 at a tie.
PPO_HD float max_weight_first(float a, float b) { return a > b ? 1.f : (a < b ? 0.f : 0.5f); }

struct PolicyToken {
  float loss;        // per-token policy loss
  float grad;        // d loss / d logprob
  float clipped;     // 1 where the clipped branch is strictly larger (verl's pg_clipfrac)
  float clipped_lo;  // 1 where dual clip bounds the loss (A < 0 and clip1 > -A * c)
  float neg_log_ratio;
  float ratio;
};

// lo = 1 - clip_low, hi = 1 + clip_high; dual_c <= 0 disables dual clip; lr_clamp bounds the
// log-ratio (verl: 20) before exp.
PPO_HD PolicyToken policy_token(float lp, float old_lp, float adv, float lo, float hi,
                                float dual_c, float lr_clamp) {
  PolicyToken o;
  const float d = lp - old_lp;
  const float dc = clamp_nan(d, -lr_clamp, lr_clamp);
  const float r = expf(dc);
  const float rc = clamp_nan(r, lo, hi);
  const float pg1 = -adv * r;
  const float pg2 = -adv * rc;
  const float clip1 = (pg1 != pg1 || pg1 > pg2) ? pg1 : pg2;  // torch.maximum (NaN propagates)
  // d clip1 / d r = -adv * (w1 + w2 * [lo <= r <= hi])
  const float w1 = max_weight_first(pg1, pg2);
  const float in_clip = (r > lo && r < hi) ? 1.f : 0.f;
  float g = -adv * (w1 + (1.f - w1) * in_clip);
  float loss = clip1;
  o.clipped = pg2 > pg1 ? 1.f : 0.f;
  o.clipped_lo = 0.f;
  if (dual_c > 0.f && adv < 0.f) {
    const float pg3 = -adv * dual_c;
    o.clipped_lo = clip1 > pg3 ? 1.f : 0.f;
    loss = (clip1 != clip1 || clip1 < pg3) ? clip1 : pg3;  // torch.minimum
    g *= max_weight_first(pg3, clip1);  // torch.minimum's share for clip1
  }
  const float in_lr = (d > -lr_clamp && d < lr_clamp) ? 1.f : 0.f;  // clamp's pass-through
  o.loss = loss;
  o.grad = g * r * in_lr;
  o.neg_log_ratio = -dc;
  o.ratio = r;
  return o;
}

struct ValueToken {
  float loss;     // 0.5 * max((v - G)^2, (clip(v) - G)^2)
  float grad;     // d loss / d v
  float clipped;  // 1 where the clipped error is strictly larger (verl's vf_clipfrac)
};

// clip <= 0: no clipping. clip(v) = max(min(v, v_old + eps), v_old - eps), as verl's clip_by_value.
PPO_HD ValueToken value_token(float v, float v_old, float ret, float clip) {
  ValueToken o;
  const float e1 = v - ret;
  const float l1 = e1 * e1;
  if (!(clip > 0.f)) {
    o.loss = 0.5f * l1;
    o.grad = e1;
    o.clipped = 0.f;
    return o;
  }
  const float hi = v_old + clip, lo = v_old - clip;
  const float mn = (v != v || v < hi) ? v : hi;    // torch.min(v, hi)
  const float vc = (mn != mn || mn > lo) ? mn : lo;  // torch.max(., lo)
  const float dvc = (1.f - max_weight_first(v, hi)) * max_weight_first(mn, lo);
  const float e2 = vc - ret;
  const float l2 = e2 * e2;
  const float w1 = max_weight_first(l1, l2);
  o.loss = 0.5f * ((l1 != l1 || l1 > l2) ? l1 : l2);
  o.grad = w1 * e1 + (1.f - w1) * e2 * dvc;
  o.clipped = l2 > l1 ? 1.f : 0.f;
  return o;
}

// -log(sigmoid(z)) = softplus(-z), stable for any z.
PPO_HD float neg_log_sigmoid(float z) { return fmaxf(-z, 0.f) + log1pf(expf(-fabsf(z))); }

}  // namespace ppo_kernels
