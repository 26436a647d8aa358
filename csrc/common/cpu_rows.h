// One row of the vocabulary kernels on the CPU: its softmax statistics and its label's log-prob,
// its gradient, and the float64 recomputation of a row whose scaled logits overflow float32.
// Used by the token_logprobs kernels (csrc/cpu/token_logprobs.cpp: statistics in one pass, the
// gradient in another) and by linear_policy_loss's C++ loop (csrc/cpu/linear_policy_loss.cpp),
// which reduces each row while it is in cache: the statistics with every exp(z_j - m_block) kept
// (row_logprob<true>), the row's loss coefficients, then the gradient from the kept values
// (grad_row_kept): one exp per logit instead of two.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>

#include "common/cpu_softmax.h"

namespace ppo_kernels {
namespace cpu {

// A row whose scaled logits overflow float32 (|x| * inv_t > FLT_MAX, e.g. x = 3e38 at temperature
// 0.5) still has a finite answer: the fast path's lse comes out non-finite there, and the row is
// recomputed in float64 relative to its unscaled max. Rows with NaN / +inf logits, or all -inf,
// give NaN here as in the fast path.
struct RowStats64 {
  double m, log_s, entropy;  // max x, log sum exp((x - m) * inv_t), entropy; NaN: undefined row
};

template <typename scalar_t>
RowStats64 row_stats64(const scalar_t* row, int64_t V, double inv_t) {
  double m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) {
    const double x = static_cast<double>(row[j]);
    if (std::isnan(x) || x == INFINITY) return {NAN, NAN, NAN};
    m = std::max(m, x);
  }
  if (m == -INFINITY) return {NAN, NAN, NAN};
  double s = 0, u = 0;
  for (int64_t j = 0; j < V; ++j) {
    const double d = (static_cast<double>(row[j]) - m) * inv_t;
    const double e = std::exp(d);
    s += e;
    if (e > 0) u += e * d;
  }
  return {m, std::log(s), std::log(s) - u / s};
}

// x * inv_t rounded as load_scaled rounds it: not fused with a subtraction that follows (an FMA
// would keep the product's rounding error, ~1e31 for logits near 1e38).
[[gnu::noinline]] inline float scaled(float x, float inv_t) { return x * inv_t; }

// A row's log-prob of its label, entropy and lse (float32); fast: the float32 statistics held
// (else s64 holds the float64 recomputation and lse is not finite).
struct RowResult {
  float lp, ent, lse;
  bool fast;
  RowStats64 s64;
};

// The statistics of one row (logits x scaled by inv_t) and its label's log-prob, block by block.
// buf: kBlock floats; with kKeep the row's V floats, which are left holding exp(z_j - m_b) for
// each block b, whose max m_b goes to mb[b] (ceil(V / kBlock) floats), for grad_row_kept.
template <bool kKeep, typename scalar_t>
RowResult row_logprob(const scalar_t* row, int64_t V, int64_t label, double inv_temperature,
                      float* buf, float* mb) {
  const float inv_t = static_cast<float>(inv_temperature);
  SoftmaxStats st = stats_empty();
  for (int64_t j = 0, b = 0; j < V; j += kBlock, ++b) {
    const int64_t n = std::min(kBlock, V - j);
    float* blk = kKeep ? buf + j : buf;
    const float m = load_scaled(row + j, n, inv_t, blk);
    if constexpr (kKeep) mb[b] = m;
    st = stats_merge(st, block_stats_impl<kKeep>(blk, n, m));
  }
  const float l = stats_lse(st);
  if (std::isfinite(l)) {
    // (z_label - max) - log s: exact where z_label is close to the max, even when |z| is so large
    // that lse = max + log s rounds log s away
    const float lp = (scaled(static_cast<float>(row[label]), inv_t) - st.m) - std::log(st.s);
    return {lp, stats_entropy(st), l, true, {}};
  }
  const RowStats64 s = row_stats64(row, V, inv_temperature);
  return {static_cast<float>((static_cast<double>(row[label]) - s.m) * inv_temperature - s.log_s),
          static_cast<float>(s.entropy), static_cast<float>(s.m * inv_temperature + s.log_s), false,
          s};
}

// The gradient of a * logprob + b * entropy (a, b already times inv_t) of a row whose float32
// statistics did not hold (see RowStats64), in float64 from s.
template <typename scalar_t>
void grad_row64(const scalar_t* row, scalar_t* grow, int64_t V, int64_t label, double inv_t,
                const RowStats64& s, double a, double b) {
  for (int64_t j = 0; j < V; ++j) {
    const double logp = (static_cast<double>(row[j]) - s.m) * inv_t - s.log_s;
    const double p = std::exp(logp);
    const double w = p > 0 ? p * (logp + s.entropy) : 0.0;
    grow[j] = static_cast<scalar_t>(a * ((j == label ? 1.0 : 0.0) - p) - b * w);
  }
}

// One row of the gradient, in one pass from the logits (read, convert, write; no buffer):
// grad_j = -a p_j - b p_j (z_j + c) + a onehot_j, p_j (z_j + c) taken as 0 where p_j = 0 (z_j =
// -inf), as in the reference. grow may be row itself: each element is read before it is written
// (the label's logit first). At temperature 1 the scaling is skipped (x * 1 is x). The row's lse
// is finite, so it holds no NaN or +inf: clamp_min (one max op) needs no NaN handling.
template <bool kScale, typename scalar_t>
void grad_row_impl(const scalar_t* row, scalar_t* grow, int64_t V, float inv_t, float l, float a,
                   float b, float c) {
  const Vec vt(inv_t), vl(l), va(a), vb(b), vc(c), floor_(-FLT_MAX);
  const auto grad = [=](Vec z) {
    if constexpr (kScale) z = rounded(z * vt);
    const Vec p = (z - vl).exp_u20();
    return Vec(0.f) - va * p - vb * (p * at::vec::clamp_min(z + vc, floor_));
  };
  int64_t j = 0;
  if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    using bVec = at::vec::Vectorized<scalar_t>;
    for (; j + bVec::size() <= V; j += bVec::size()) {
      auto [z0, z1] = at::vec::convert_to_float<scalar_t>(bVec::loadu(row + j));
      at::vec::convert_from_float<scalar_t>(grad(z0), grad(z1)).store(grow + j);
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    for (; j + Vec::size() <= V; j += Vec::size()) grad(Vec::loadu(row + j)).store(grow + j);
  }
  for (; j < V; ++j) {
    const float z = scaled(static_cast<float>(row[j]), inv_t);
    const float p = std::exp(z - l);
    grow[j] = static_cast<scalar_t>(-a * p - b * weighted_offset(p, z + c));
  }
}

template <typename scalar_t>
void grad_row(const scalar_t* row, scalar_t* grow, int64_t V, int64_t label, float inv_t, float l,
              float a, float b, float c) {
  const float xl = scaled(static_cast<float>(row[label]), inv_t);
  if (inv_t == 1.f) {
    grad_row_impl<false>(row, grow, V, inv_t, l, a, b, c);
  } else {
    grad_row_impl<true>(row, grow, V, inv_t, l, a, b, c);
  }
  const float p = std::exp(xl - l);
  grow[label] = static_cast<scalar_t>(-a * p - b * weighted_offset(p, xl + c) + a);
}

// grad_row from the values row_logprob<true> kept: p_j = e_j exp(m_b - l) (e_j = exp(z_j - m_b),
// m_b <= lse: no overflow), the same terms as grad_row up to float32 rounding; the logits are
// read again only for the entropy term (kEntropy: b != 0). grow may be row itself.
template <bool kEntropy, bool kScale, typename scalar_t>
void grad_row_kept_impl(const scalar_t* row, scalar_t* grow, int64_t V, float inv_t, float l,
                        float a, float b, float c, const float* e, const float* mb) {
  const Vec vt(inv_t), va(a), vb(b), vc(c), floor_(-FLT_MAX);
  for (int64_t j0 = 0, k = 0; j0 < V; j0 += kBlock, ++k) {
    const int64_t j1 = std::min(V, j0 + kBlock);
    const float f = std::exp(mb[k] - l);  // (0 for an all -inf block, whose e are 0)
    const Vec vf(f);
    const auto grad = [&](Vec ej, Vec z) {
      const Vec p = ej * vf;
      if constexpr (!kEntropy) return Vec(0.f) - va * p;
      if constexpr (kScale) z = rounded(z * vt);
      return Vec(0.f) - va * p - vb * (p * at::vec::clamp_min(z + vc, floor_));
    };
    int64_t j = j0;
    if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
      using bVec = at::vec::Vectorized<scalar_t>;
      for (; j + bVec::size() <= j1; j += bVec::size()) {
        Vec z0(0.f), z1(0.f);
        if constexpr (kEntropy)
          std::tie(z0, z1) = at::vec::convert_to_float<scalar_t>(bVec::loadu(row + j));
        const Vec g0 = grad(Vec::loadu(e + j), z0), g1 = grad(Vec::loadu(e + j + Vec::size()), z1);
        at::vec::convert_from_float<scalar_t>(g0, g1).store(grow + j);
      }
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      for (; j + Vec::size() <= j1; j += Vec::size()) {
        const Vec z = kEntropy ? Vec::loadu(row + j) : Vec(0.f);
        grad(Vec::loadu(e + j), z).store(grow + j);
      }
    }
    for (; j < j1; ++j) {
      const float p = e[j] * f;
      const float w =
          kEntropy ? weighted_offset(p, scaled(static_cast<float>(row[j]), inv_t) + c) : 0.f;
      grow[j] = static_cast<scalar_t>(-a * p - b * w);
    }
  }
}

template <typename scalar_t>
void grad_row_kept(const scalar_t* row, scalar_t* grow, int64_t V, int64_t label, float inv_t,
                   float l, float a, float b, float c, const float* e, const float* mb) {
  const float xl = scaled(static_cast<float>(row[label]), inv_t);
  const float p = e[label] * std::exp(mb[label / kBlock] - l);
  const scalar_t at_label = static_cast<scalar_t>(-a * p - b * weighted_offset(p, xl + c) + a);
  if (b == 0.f) {
    grad_row_kept_impl<false, false>(row, grow, V, inv_t, l, a, b, c, e, mb);
  } else if (inv_t == 1.f) {
    grad_row_kept_impl<true, false>(row, grow, V, inv_t, l, a, b, c, e, mb);
  } else {
    grad_row_kept_impl<true, true>(row, grow, V, inv_t, l, a, b, c, e, mb);
  }
  grow[label] = at_label;
}

}  // namespace cpu
}  // namespace ppo_kernels
