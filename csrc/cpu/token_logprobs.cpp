// token_logprobs: CPU kernels and the schemas of the raw kernels (CUDA impls in
// csrc/cuda/token_logprobs.cu). Semantics: ppo_kernels/token_logprobs/reference.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16-math.h>
#include <torch/library.h>

#include "common/alloc.h"
#include "common/cpu_softmax.h"
#include "common/tensor_checks.h"
#include "common/token_logprobs_host.h"

namespace ppo_kernels {
namespace {

using cpu::block_stats;
using cpu::kBlock;
using cpu::load_scaled;
using cpu::Vec;

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
[[gnu::noinline]] float scaled(float x, float inv_t) { return x * inv_t; }

void check_inv_temperature(double inv_temperature) {
  TORCH_CHECK(inv_temperature > 0 && std::isfinite(static_cast<float>(inv_temperature)),
              "inv_temperature: expected a positive value finite in float32, got ",
              inv_temperature);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd_cpu(const at::Tensor& logits_in,
                                                                      const at::Tensor& labels_in,
                                                                      double inv_temperature,
                                                                      int64_t ignore_index,
                                                                      bool with_entropy) {
  LogprobsCall c = prepare_logprobs_call(logits_in, labels_in, with_entropy);
  const at::Tensor &logits = c.logits, &labels = c.labels;
  at::Tensor &logprobs = c.logprobs, &entropy = c.entropy, &lse = c.lse;
  const RowIndexer rows = c.rows;
  const int64_t N = c.N, V = c.V;
  check_inv_temperature(inv_temperature);
  if (N == 0) return {logprobs, entropy, lse};
  check_labels_on_host(labels, V, ignore_index);
  const float inv_t = static_cast<float>(inv_temperature);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_fwd", [&] {
        AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "token_logprobs_fwd", [&] {
          const scalar_t* x = logits.const_data_ptr<scalar_t>();
          const index_t* lab = labels.const_data_ptr<index_t>();
          float* lp = logprobs.data_ptr<float>();
          float* ent = with_entropy ? entropy.data_ptr<float>() : nullptr;
          float* ls = lse.data_ptr<float>();
          const int64_t grain = std::max<int64_t>(1, 16384 / V);
          at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            float buf[kBlock];
            for (int64_t r = begin; r < end; ++r) {
              const int64_t label = lab[r];
              if (label == ignore_index) {
                lp[r] = 0.f;
                if (ent) ent[r] = 0.f;
                ls[r] = 0.f;
                continue;
              }
              const scalar_t* row = x + rows(r);
              SoftmaxStats st = stats_empty();
              for (int64_t j = 0; j < V; j += kBlock) {
                const int64_t n = std::min(kBlock, V - j);
                const float m = load_scaled(row + j, n, inv_t, buf);
                st = stats_merge(st, block_stats(buf, n, m));
              }
              const float l = stats_lse(st);
              if (std::isfinite(l)) {
                ls[r] = l;
                // (z_label - max) - log s: exact where z_label is close to the max, even when
                // |z| is so large that lse = max + log s rounds log s away
                lp[r] = (scaled(static_cast<float>(row[label]), inv_t) - st.m) - std::log(st.s);
                if (ent) ent[r] = stats_entropy(st);
              } else {
                const RowStats64 s = row_stats64(row, V, inv_temperature);
                ls[r] = static_cast<float>(s.m * inv_temperature + s.log_s);
                lp[r] = static_cast<float>(
                    (static_cast<double>(row[label]) - s.m) * inv_temperature - s.log_s);
                if (ent) ent[r] = static_cast<float>(s.entropy);
              }
            }
          });
        });
      });
  return {logprobs, entropy, lse};
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
    if constexpr (kScale) z = cpu::rounded(z * vt);
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

// grad_logits[r, j] = inv_t * (glp * (onehot_j - p_j) - gent * p_j * (z_j - lse + H)),
// written into grad_logits (which may be the logits buffer itself: each element is read before
// it is overwritten, by the same thread).
void token_logprobs_bwd_cpu(const at::Tensor& grad_logprobs,
                            const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                            const at::Tensor& labels_in, const at::Tensor& lse,
                            const at::Tensor& entropy, double inv_temperature, int64_t ignore_index,
                            at::Tensor grad_logits) {
  const LogprobsGradCall c = prepare_logprobs_grad_call(grad_logprobs, grad_entropy, logits,
                                                        labels_in, lse, entropy, grad_logits);
  const at::Tensor& labels = c.labels;
  const int64_t N = c.N, V = c.V;
  check_inv_temperature(inv_temperature);
  if (N == 0) return;
  check_labels_on_host(labels, V, ignore_index);
  const RowIndexer rin = c.rows, rout = c.grad_rows;
  const float inv_t = static_cast<float>(inv_temperature);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_bwd", [&] {
        AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "token_logprobs_bwd", [&] {
          const scalar_t* x = logits.const_data_ptr<scalar_t>();
          scalar_t* gx = grad_logits.data_ptr<scalar_t>();
          const index_t* lab = labels.const_data_ptr<index_t>();
          const float* glp = c.glp.const_data_ptr<float>();
          const float* gent = c.gent_ptr();
          const float* ls = c.lse.const_data_ptr<float>();
          const float* ent = c.ent_ptr();
          const int64_t grain = std::max<int64_t>(1, 16384 / V);
          at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
              const int64_t label = lab[r];
              const scalar_t* row = x + rin(r);
              scalar_t* grow = gx + rout(r);
              if (label == ignore_index) {
                std::fill(grow, grow + V, scalar_t(0));
                continue;
              }
              const float l = ls[r];
              if (!std::isfinite(l)) {  // scaled logits overflow float32 (see row_stats64)
                const RowStats64 s = row_stats64(row, V, inv_temperature);
                const double a = glp[r] * inv_temperature,
                             b = gent ? gent[r] * inv_temperature : 0.0;
                for (int64_t j = 0; j < V; ++j) {
                  const double logp =
                      (static_cast<double>(row[j]) - s.m) * inv_temperature - s.log_s;
                  const double p = std::exp(logp);
                  const double w = p > 0 ? p * (logp + s.entropy) : 0.0;
                  grow[j] = static_cast<scalar_t>(a * ((j == label ? 1.0 : 0.0) - p) - b * w);
                }
                continue;
              }
              const float a = glp[r] * inv_t;                // weight of onehot - p
              const float b = gent ? gent[r] * inv_t : 0.f;  // weight of -p * (log p + H)
              const float c = gent ? ent[r] - l : -l;        // log p + H = z - lse + H
              grad_row(row, grow, V, label, inv_t, l, a, b, c);
            }
          });
        });
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "token_logprobs_fwd(Tensor logits, Tensor labels, float inv_temperature, int ignore_index, "
      "bool with_entropy) -> (Tensor logprobs, Tensor entropy, Tensor lse)");
  m.def(
      "token_logprobs_bwd(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor "
      "labels, "
      "Tensor lse, Tensor entropy, float inv_temperature, int ignore_index, Tensor(a!) "
      "grad_logits) -> ()");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("token_logprobs_fwd", &token_logprobs_fwd_cpu);
  m.impl("token_logprobs_bwd", &token_logprobs_bwd_cpu);
}

}  // namespace ppo_kernels
