// Distillation math shared by the CPU (.cpp) and, when written, CUDA (.cu) tile kernels: the
// per-entry terms of the full-vocabulary divergences between a student row p = softmax(z_s / T)
// and a teacher row q = softmax(z_t / T), and their gradients with respect to the student's
// logits. Semantics: ppo_kernels/distill/naive.py (eager) and ppo_kernels/losses/distill_naive.py
// (the float64 reference). The KL modes' values come from kl_stats.h's one-pass state (accurate
// for close distributions); jsd and tv take a second pass once both log-sum-exps are known.
#pragma once
#include <cmath>

#include "common/macros.h"

namespace ppo_kernels {

// Order = the names of distill_divergence_names() (distill_host.h) = the Python table
// ppo_kernels/distill/op.py DIVERGENCES (tests/test_distill_kernels.py compares them).
enum Divergence : int { kForwardKL = 0, kReverseKL = 1, kJSD = 2, kTV = 3 };

// log(exp(a) + exp(b)); -inf when both are -inf (no NaN from -inf - -inf).
PPO_HD float log_add_exp(float a, float b) {
  const float m = a > b ? a : b;
  if (m == -INFINITY) return -INFINITY;
  return m + log1pf(expf(-fabsf(a - b)));
}

// One entry of jsd(beta) = beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q,
// given the log-probs and probabilities; `aux` gets the entry's part of KL(p || m), which the
// gradient needs. Zero probabilities contribute 0.
PPO_HD float jsd_term(float lp, float lq, float p, float q, float log1mb, float logb, float beta,
                      float& aux) {
  const float lm = log_add_exp(lp + log1mb, lq + logb);
  const float kp = p > 0.f ? p * (lp - lm) : 0.f;
  aux += kp;
  return (q > 0.f ? beta * q * (lq - lm) : 0.f) + (1.f - beta) * kp;
}

PPO_HD float sign_of(float x) { return x > 0.f ? 1.f : (x < 0.f ? -1.f : 0.f); }

// One entry of tv = sum |p - q| / 2; `aux` gets p sgn(p - q).
PPO_HD float tv_term(float p, float q, float& aux) {
  aux += p * sign_of(p - q);
  return 0.5f * fabsf(p - q);
}

// d D / d z_j (z = logits / T: the caller multiplies by the upstream gradient and 1 / T), with
// lp = z_s - lse_s, lq = z_t - lse_t, p = e^lp, q = e^lq and the row's aux:
//   forward_kl  p - q
//   reverse_kl  p (lp - lq - KL(p || q))                   (aux = the value)
//   jsd         (1 - beta) p (lp - log m - KL(p || m))      (aux = KL(p || m))
//   tv          p (sgn(p - q) - sum_i p_i sgn(p_i - q_i)) / 2
// A zero p gives 0 (no 0 * inf).
PPO_HD float distill_grad(int mode, float lp, float lq, float p, float q, float aux, float log1mb,
                          float logb, float beta) {
  switch (mode) {
    case kForwardKL:
      return p - q;
    case kReverseKL:
      return p > 0.f ? p * ((lp - lq) - aux) : 0.f;
    case kJSD: {
      if (!(p > 0.f)) return 0.f;
      const float lm = log_add_exp(lp + log1mb, lq + logb);
      return (1.f - beta) * p * ((lp - lm) - aux);
    }
    default:
      return 0.5f * p * (sign_of(p - q) - aux);
  }
}

}  // namespace ppo_kernels
