// kl_penalty and kl_penalized_rewards: CPU kernels and the schemas of the raw kernels.
// Semantics: ppo_kernels/kl/naive.py; the estimator math is csrc/common/kl_stats.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common/alloc.h"
#include "common/cpu_softmax.h"
#include "common/kl_stats.h"
#include "common/modes.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTile = 256;

using cpu::from_float;
using cpu::to_float;

// d = lp - ref for one tile, as float32.
template <typename scalar_t>
void tile_log_ratio(const scalar_t* lp, const scalar_t* ref, int64_t n, float* d) {
  float tmp[kTile];
  to_float(lp, d, n);
  to_float(ref, tmp, n);
  for (int64_t i = 0; i < n; ++i) d[i] -= tmp[i];
}

// Estimator value and gradient for one lane group (Vec or float): the shared math of kl_stats.h.
template <int EST, typename V>
KLValueGrad<V> estimate(V d, const KLClampSpec& c, bool st) {
  V ex(1.f);
  if constexpr (EST == kK3) {
    if constexpr (std::is_same_v<V, float>)
      ex = std::exp(k3_exp_arg(d, c));
    else
      ex = k3_exp_arg(d, c).exp();
  }
  return kl_estimate<EST>(d, ex, c, st);
}

// Calls f(std::integral_constant<int, EST>) for the estimator named `name` (kl_estimator_names()).
template <typename F>
void dispatch_estimator(const std::string& name, F&& f) {
  switch (mode_index("estimator", kl_estimator_names(), name)) {
    case kK1:
      f(std::integral_constant<int, kK1>());
      break;
    case kAbs:
      f(std::integral_constant<int, kAbs>());
      break;
    case kK2:
      f(std::integral_constant<int, kK2>());
      break;
    case kK3:
      f(std::integral_constant<int, kK3>());
      break;
    default:
      TORCH_CHECK(false, "kl: estimator table and KLEstimator disagree");
  }
}

KLClampSpec make_spec(double in_lo, double in_hi, double out_lo, double out_hi) {
  return {static_cast<float>(in_lo), static_cast<float>(in_hi), static_cast<float>(out_lo),
          static_cast<float>(out_hi)};
}

bool unclamped(const KLClampSpec& c) {
  return c.in_lo == -INFINITY && c.in_hi == INFINITY && c.out_lo == -INFINITY &&
         c.out_hi == INFINITY;
}

void check_pair(const at::Tensor& lp, const at::Tensor& ref) {
  const DeviceOf on = device_of(lp, "logprobs");
  check_arg(lp, "logprobs", on, Kind::kFloating);
  check_arg(ref, "ref_logprobs", on);
  TORCH_CHECK_VALUE(lp.sizes() == ref.sizes(), "ref_logprobs: expected shape ",
                    shape_str(lp.sizes()), " (like logprobs), got ", shape_str(ref.sizes()));
  TORCH_CHECK_TYPE(lp.scalar_type() == ref.scalar_type(), "ref_logprobs: expected dtype ",
                   dtype_name(lp.scalar_type()), " (like logprobs), got ",
                   dtype_name(ref.scalar_type()));
}

at::Tensor kl_penalty_fwd_cpu(const at::Tensor& lp_in, const at::Tensor& ref_in,
                              const std::string& est, bool straight_through, double in_lo,
                              double in_hi, double out_lo, double out_hi) {
  check_pair(lp_in, ref_in);
  const at::Tensor lp = lp_in.contiguous(), ref = ref_in.contiguous();
  at::Tensor out = new_output(lp.sizes(), lp.options().dtype(at::kFloat));
  const int64_t n = lp.numel();
  if (n == 0) return out;
  const KLClampSpec c = make_spec(in_lo, in_hi, out_lo, out_hi);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, lp.scalar_type(), "kl_penalty_fwd", [&] {
        const scalar_t* a = lp.const_data_ptr<scalar_t>();
        const scalar_t* b = ref.const_data_ptr<scalar_t>();
        float* o = out.data_ptr<float>();
        dispatch_estimator(est, [&](auto E) {
          constexpr int EST = decltype(E)::value;
          if constexpr (EST == kK1 && std::is_same_v<scalar_t, float>) {
            // unclamped float32 k1 is the difference itself: one pass, no tile buffer (the same
            // float subtraction as below; the clamps at +-inf would return it unchanged)
            if (unclamped(c)) {
              at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
                int64_t i = i0;
                for (; i + Vec::size() <= i1; i += Vec::size())
                  (Vec::loadu(a + i) - Vec::loadu(b + i)).store(o + i);
                for (; i < i1; ++i) o[i] = a[i] - b[i];
              });
              return;
            }
          }
          at::parallel_for(0, (n + kTile - 1) / kTile, 16, [&](int64_t t0, int64_t t1) {
            float d[kTile];
            for (int64_t t = t0; t < t1; ++t) {
              const int64_t s = t * kTile, m = std::min(kTile, n - s);
              tile_log_ratio(a + s, b + s, m, d);
              int64_t i = 0;
              for (; i + Vec::size() <= m; i += Vec::size()) {
                estimate<EST>(Vec::loadu(d + i), c, false).value.store(o + s + i);
              }
              for (; i < m; ++i) o[s + i] = estimate<EST>(d[i], c, false).value;
            }
          });
        });
      });
  return out;
}

// grad_lp = grad * dv/dd, grad_ref = -grad_lp (each only when asked for; else an empty tensor).
std::tuple<at::Tensor, at::Tensor> kl_penalty_bwd_cpu(const at::Tensor& grad_in,
                                                      const at::Tensor& lp_in,
                                                      const at::Tensor& ref_in,
                                                      const std::string& est, bool straight_through,
                                                      double in_lo, double in_hi, double out_lo,
                                                      double out_hi, bool need_lp, bool need_ref) {
  check_pair(lp_in, ref_in);
  const at::Tensor lp = lp_in.contiguous(), ref = ref_in.contiguous();
  check_arg(grad_in, "grad", device_of(lp_in, "logprobs"), Kind::kFloating, lp_in.numel(),
            "like logprobs");
  const at::Tensor grad = grad_in.to(at::kFloat).contiguous();

  at::Tensor glp = need_lp ? new_output(lp.sizes(), lp.options()) : at::empty({0}, lp.options());
  at::Tensor gref = need_ref ? new_output(lp.sizes(), lp.options()) : at::empty({0}, lp.options());
  const int64_t n = lp.numel();
  if (n == 0 || (!need_lp && !need_ref)) return {glp, gref};
  const KLClampSpec c = make_spec(in_lo, in_hi, out_lo, out_hi);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, lp.scalar_type(), "kl_penalty_bwd", [&] {
        const scalar_t* a = lp.const_data_ptr<scalar_t>();
        const scalar_t* b = ref.const_data_ptr<scalar_t>();
        const float* g = grad.const_data_ptr<float>();
        scalar_t* ga = need_lp ? glp.data_ptr<scalar_t>() : nullptr;
        scalar_t* gb = need_ref ? gref.data_ptr<scalar_t>() : nullptr;
        dispatch_estimator(est, [&](auto E) {
          constexpr int EST = decltype(E)::value;
          at::parallel_for(0, (n + kTile - 1) / kTile, 16, [&](int64_t t0, int64_t t1) {
            float d[kTile], out[kTile];
            for (int64_t t = t0; t < t1; ++t) {
              const int64_t s = t * kTile, m = std::min(kTile, n - s);
              tile_log_ratio(a + s, b + s, m, d);
              int64_t i = 0;
              for (; i + Vec::size() <= m; i += Vec::size()) {
                (Vec::loadu(g + s + i) * estimate<EST>(Vec::loadu(d + i), c, straight_through).grad)
                    .store(out + i);
              }
              for (; i < m; ++i) out[i] = g[s + i] * estimate<EST>(d[i], c, straight_through).grad;
              if (ga) from_float(out, ga + s, m);
              if (gb) {
                for (int64_t i = 0; i < m; ++i) out[i] = -out[i];
                from_float(out, gb + s, m);
              }
            }
          });
        });
      });
  return {glp, gref};
}

// One pass per row: kl (masked), rewards with the score on the last action, mean kl over the mask.
std::tuple<at::Tensor, at::Tensor, at::Tensor> kl_rewards_fwd_cpu(
    const at::Tensor& scores_in, const at::Tensor& lp_in, const at::Tensor& ref_in,
    const at::Tensor& mask_in, const std::optional<at::Tensor>& beta_t, double beta,
    const std::string& est, double in_lo, double in_hi, double out_lo, double out_hi) {
  check_pair(lp_in, ref_in);
  TORCH_CHECK_VALUE(lp_in.dim() == 2, "logprobs: expected 2 dimensions (B, T), got shape ",
                    shape_str(lp_in.sizes()));
  const DeviceOf on = device_of(lp_in, "logprobs");
  const int64_t B = lp_in.size(0), T = lp_in.size(1);
  check_arg(scores_in, "scores", on, Kind::kFloating, B, "one per row");
  check_arg(mask_in, "mask", on);
  TORCH_CHECK_VALUE(mask_in.sizes() == lp_in.sizes(), "mask: expected shape ",
                    shape_str(lp_in.sizes()), " (like logprobs), got ", shape_str(mask_in.sizes()));
  const at::Tensor lp = lp_in.contiguous(), ref = ref_in.contiguous();
  const at::Tensor scores = scores_in.to(at::kFloat).contiguous();
  at::Tensor mask = mask_in.contiguous();
  if (mask.scalar_type() != at::kBool && mask.scalar_type() != at::kFloat)
    mask = mask.to(at::kFloat);
  at::Tensor betas;
  if (beta_t.has_value() && beta_t->defined()) {
    check_arg(*beta_t, "beta", on, Kind::kFloating);
    TORCH_CHECK_VALUE(beta_t->numel() == 1 || beta_t->numel() == B, "beta: expected 1 or ", B,
                      " elements, got shape ", shape_str(beta_t->sizes()));
    betas = beta_t->to(at::kFloat).contiguous();
  }
  const auto f32 = lp.options().dtype(at::kFloat);
  at::Tensor rewards = new_output({B, T}, f32), kl = new_output({B, T}, f32),
             mean = new_output({B}, f32);
  if (B == 0) return {rewards, kl, mean};
  const KLClampSpec c = make_spec(in_lo, in_hi, out_lo, out_hi);
  const float beta_f = static_cast<float>(beta);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, lp.scalar_type(), "kl_rewards_fwd", [&] {
        const scalar_t* a = lp.const_data_ptr<scalar_t>();
        const scalar_t* b = ref.const_data_ptr<scalar_t>();
        const float* sc = scores.const_data_ptr<float>();
        const float* bt = betas.defined() ? betas.const_data_ptr<float>() : nullptr;
        const int64_t bstride = betas.defined() && betas.numel() == B ? 1 : 0;
        float* r = rewards.data_ptr<float>();
        float* k = kl.data_ptr<float>();
        float* mk = mean.data_ptr<float>();
        const bool mbool = mask.scalar_type() == at::kBool;
        const bool* mb = mbool ? mask.const_data_ptr<bool>() : nullptr;
        const float* mf = mbool ? nullptr : mask.const_data_ptr<float>();
        dispatch_estimator(est, [&](auto E) {
          constexpr int EST = decltype(E)::value;
          at::parallel_for(
              0, B, std::max<int64_t>(1, 4096 / std::max<int64_t>(T, 1)),
              [&](int64_t r0, int64_t r1) {
                float d[kTile], w[kTile];
                for (int64_t row = r0; row < r1; ++row) {
                  const float be = bt ? bt[row * bstride] * beta_f : beta_f;
                  const int64_t o = row * T;
                  Vec vsum(0.f), vcnt(0.f);
                  float sum = 0.f, cnt = 0.f;
                  int64_t last = -1;
                  for (int64_t s = 0; s < T; s += kTile) {
                    const int64_t m = std::min(kTile, T - s);
                    tile_log_ratio(a + o + s, b + o + s, m, d);
                    if (mbool) {
                      for (int64_t i = 0; i < m; ++i) w[i] = mb[o + s + i] ? 1.f : 0.f;
                    } else {
                      std::copy(mf + o + s, mf + o + s + m, w);
                    }
                    for (int64_t i = m - 1; i >= 0; --i) {
                      if (w[i] != 0.f) {
                        last = s + i;
                        break;
                      }
                    }
                    // kl where the mask is nonzero (else 0, never 0 * inf), rewards -beta * kl *
                    // mask
                    auto terms = [&](auto dv, auto wv) {
                      using V = decltype(dv);
                      using namespace kl_lanes;
                      const auto act = wv != V(0.f);
                      const V v = sel(act, estimate<EST>(dv, c, false).value, V(0.f));
                      const V wk = sel(act, v * wv, V(0.f));
                      return std::make_tuple(v, wk, sel(act, V(-be) * wk, V(0.f)));
                    };
                    int64_t i = 0;
                    for (; i + Vec::size() <= m; i += Vec::size()) {
                      const Vec wv = Vec::loadu(w + i);
                      auto [v, wk, rr] = terms(Vec::loadu(d + i), wv);
                      v.store(k + o + s + i);
                      rr.store(r + o + s + i);
                      vsum = vsum + wk;
                      vcnt = vcnt + wv;
                    }
                    for (; i < m; ++i) {
                      auto [v, wk, rr] = terms(d[i], w[i]);
                      k[o + s + i] = v;
                      r[o + s + i] = rr;
                      sum += wk;
                      cnt += w[i];
                    }
                  }
                  sum += at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, vsum);
                  cnt += at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, vcnt);
                  if (last >= 0) r[o + last] += sc[row];
                  mk[row] = last >= 0 && cnt != 0.f ? sum / cnt : 0.f;  // weights summing to 0: 0
                }
              });
        });
      });
  return {rewards, kl, mean};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "kl_penalty_fwd(Tensor logprobs, Tensor ref_logprobs, str estimator, bool straight_through, "
      "float in_lo, float in_hi, float out_lo, float out_hi) -> Tensor");
  m.def(
      "kl_penalty_bwd(Tensor grad, Tensor logprobs, Tensor ref_logprobs, str estimator, "
      "bool straight_through, float in_lo, float in_hi, float out_lo, float out_hi, bool need_lp, "
      "bool need_ref) -> (Tensor, Tensor)");
  m.def(
      "kl_rewards_fwd(Tensor scores, Tensor logprobs, Tensor ref_logprobs, Tensor mask, Tensor? "
      "beta_t, "
      "float beta, str estimator, float in_lo, float in_hi, float out_lo, float out_hi) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("kl_penalty_fwd", &kl_penalty_fwd_cpu);
  m.impl("kl_penalty_bwd", &kl_penalty_bwd_cpu);
  m.impl("kl_rewards_fwd", &kl_rewards_fwd_cpu);
}

}  // namespace ppo_kernels
