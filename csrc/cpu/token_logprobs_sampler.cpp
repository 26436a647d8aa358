// token_logprobs under the sampler's distribution, and the head's statistics: the CPU kernels and
// the schemas of the raw kernels (CUDA impls in csrc/cuda/token_logprobs_sampler.cu). The row
// math: csrc/common/cpu_sampler.h; semantics: docs/ppo-math.md and
// ppo_kernels/token_logprobs/naive.py (sampler_forward / sampler_backward).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/cpu_sampler.h"
#include "common/sampler_host.h"

namespace ppo_kernels {
namespace {

using cpu::kBlock;
using cpu::SamplerRowArgs;
using cpu::SamplerRowOut;
using cpu::SamplerWorkspace;
using cpu::Vec;

using SamplerOuts =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

SamplerRowArgs row_args(const SamplerParamPtrs& p, int64_t r, bool sglang, bool with_sum_p2,
                        bool with_is_argmax, int64_t stats_top_k, bool with_entropy) {
  return {static_cast<float>(p.inv_t ? p.inv_t[r] : p.inv_t0),
          p.top_k ? p.top_k[r] : p.top_k0,
          static_cast<float>(p.top_p ? p.top_p[r] : p.top_p0),
          static_cast<float>(p.min_p ? p.min_p[r] : p.min_p0),
          sglang,
          with_sum_p2,
          with_is_argmax,
          stats_top_k,
          with_entropy};
}

SamplerOuts token_logprobs_sampler_fwd_cpu(const at::Tensor& logits_in, const at::Tensor& labels_in,
                                           double inv_temperature,
                                           const std::optional<at::Tensor>& inv_temperatures,
                                           int64_t top_k, const std::optional<at::Tensor>& top_ks,
                                           double top_p, const std::optional<at::Tensor>& top_ps,
                                           double min_p, const std::optional<at::Tensor>& min_ps,
                                           c10::string_view sampler, int64_t ignore_index,
                                           bool with_entropy, bool with_sum_p2, bool with_lse,
                                           int64_t stats_top_k, bool with_is_argmax) {
  SamplerCall c = prepare_sampler_call(logits_in, labels_in, with_entropy, with_sum_p2, with_lse,
                                       stats_top_k, with_is_argmax);
  const int64_t N = c.base.N, V = c.base.V;
  const bool sglang = sampler_is_sglang(sampler);
  const SamplerParamPtrs params =
      sampler_params(device_of(logits_in, "logits"), N, inv_temperature, inv_temperatures, top_k,
                     top_ks, top_p, top_ps, min_p, min_ps);
  for (int64_t r = 0; r < N && params.inv_t; ++r)
    TORCH_CHECK(params.inv_t[r] > 0 && std::isfinite(static_cast<float>(params.inv_t[r])),
                "inv_temperatures: expected positive values finite in float32, got ",
                params.inv_t[r], " at row ", r);
  if (N == 0) return c.outputs();
  check_labels_on_host(c.base.labels, V, ignore_index);
  const RowIndexer rows = c.base.rows;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, c.base.logits.scalar_type(), "token_logprobs_sampler_fwd", [&] {
        AT_DISPATCH_INDEX_TYPES(c.base.labels.scalar_type(), "token_logprobs_sampler_fwd", [&] {
          const scalar_t* x = c.base.logits.const_data_ptr<scalar_t>();
          const index_t* lab = c.base.labels.const_data_ptr<index_t>();
          float* lp = c.base.logprobs.data_ptr<float>();
          float* ent = with_entropy ? c.base.entropy.data_ptr<float>() : nullptr;
          float* lse = c.base.lse.data_ptr<float>();
          float* cut = c.cut.data_ptr<float>();
          int64_t* cut_index = c.cut_index.data_ptr<int64_t>();
          bool* outside = c.outside.data_ptr<bool>();
          float* sum_p2 = with_sum_p2 ? c.sum_p2.data_ptr<float>() : nullptr;
          float* full_lse = with_lse ? c.full_lse.data_ptr<float>() : nullptr;
          int64_t* top_ids = stats_top_k > 0 ? c.top_ids.data_ptr<int64_t>() : nullptr;
          float* top_lp = stats_top_k > 0 ? c.top_lp.data_ptr<float>() : nullptr;
          bool* is_argmax = with_is_argmax ? c.is_argmax.data_ptr<bool>() : nullptr;
          const int64_t grain = std::max<int64_t>(1, 16384 / V);
          at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            SamplerWorkspace ws;
            for (int64_t r = begin; r < end; ++r) {
              const int64_t label = lab[r];
              int64_t* ids = top_ids ? top_ids + r * stats_top_k : nullptr;
              float* tlp = top_lp ? top_lp + r * stats_top_k : nullptr;
              cut[r] = -INFINITY;
              cut_index[r] = V - 1;
              outside[r] = false;
              if (label == ignore_index) {
                lp[r] = 0.f;
                lse[r] = 0.f;
                if (ent) ent[r] = 0.f;
                if (sum_p2) sum_p2[r] = 0.f;
                if (full_lse) full_lse[r] = 0.f;
                if (is_argmax) is_argmax[r] = false;
                for (int64_t i = 0; i < stats_top_k; ++i) ids[i] = -1, tlp[i] = 0.f;
                continue;
              }
              const SamplerRowArgs a = row_args(params, r, sglang, with_sum_p2, with_is_argmax,
                                                stats_top_k, with_entropy);
              const bool plain = !top_k_on(a.top_k, V) && !top_p_on(a.top_p) &&
                                 !min_p_on(a.min_p) && !with_sum_p2 && !with_lse &&
                                 !with_is_argmax && stats_top_k == 0;
              if (plain) {  // as token_logprobs_fwd, bit for bit
                const double inv_t64 = params.inv_t ? params.inv_t[r] : params.inv_t0;
                const cpu::RowResult rr =
                    cpu::row_logprob<false>(x + rows(r), V, label, inv_t64, ws.buf, nullptr);
                lse[r] = rr.lse;
                lp[r] = rr.lp;
                if (ent) ent[r] = rr.ent;
                continue;
              }
              const SamplerRowOut o = cpu::sampler_row(x + rows(r), V, label, a, ws, ids, tlp);
              lp[r] = o.lp;
              lse[r] = o.lse;
              if (ent) ent[r] = o.ent;
              cut[r] = o.cut;
              cut_index[r] = o.cut_index;
              outside[r] = o.outside;
              if (sum_p2) sum_p2[r] = o.sum_p2;
              if (full_lse) full_lse[r] = o.full_lse;
              if (is_argmax) is_argmax[r] = o.is_argmax;
            }
          });
        });
      });
  return c.outputs();
}

// One row of the gradient on the kept set: q_j = exp(z_j - lse_K) for kept j, else 0;
// grad_j = inv_t * (a (onehot_j - q_j) - b q_j (log q_j + H)), a = 0 when the label is not kept.
template <typename scalar_t>
void sampler_grad_row(const scalar_t* row, scalar_t* grow, int64_t V, int64_t label, float inv_t,
                      float l, float a, float b, float c, float cut, int64_t cut_index) {
  const bool scale = inv_t != 1.f;
  const Vec vt(inv_t), vl(l), va(a), vb(b), vc(c), vcut(cut), floor_(-FLT_MAX), zero(0.f);
  const auto grad = [&](Vec x) {
    const Vec z = scale ? cpu::rounded(x * vt) : x;
    const Vec p = (z - vl).exp_u20();
    const Vec g = zero - va * p - vb * (p * at::vec::clamp_min(z + vc, floor_));
    return Vec::blendv(zero, g, x >= vcut);  // kept: x >= cut (ties past cut_index: below)
  };
  int64_t j = 0;
  if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    using bVec = at::vec::Vectorized<scalar_t>;
    for (; j + bVec::size() <= V; j += bVec::size()) {
      auto [x0, x1] = at::vec::convert_to_float<scalar_t>(bVec::loadu(row + j));
      at::vec::convert_from_float<scalar_t>(grad(x0), grad(x1)).store(grow + j);
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    for (; j + Vec::size() <= V; j += Vec::size()) grad(Vec::loadu(row + j)).store(grow + j);
  }
  for (; j < V; ++j) {
    const float x = static_cast<float>(row[j]);
    const float z = scale ? cpu::scaled(x, inv_t) : x;
    const float p = std::exp(z - l);
    const float g = -a * p - b * weighted_offset(p, z + c);
    grow[j] = static_cast<scalar_t>(x >= cut ? g : 0.f);
  }
  if (cut_index < V - 1) {  // a tie group split at the cut (SGLang): the ties past cut_index
    for (int64_t i = cut_index + 1; i < V; ++i)
      if (static_cast<float>(row[i]) == cut) grow[i] = scalar_t(0);
  }
}

void token_logprobs_sampler_bwd_cpu(const at::Tensor& grad_logprobs,
                                    const std::optional<at::Tensor>& grad_entropy,
                                    const at::Tensor& logits, const at::Tensor& labels_in,
                                    const at::Tensor& lse, const at::Tensor& entropy,
                                    const at::Tensor& cut_in, const at::Tensor& cut_index_in,
                                    double inv_temperature,
                                    const std::optional<at::Tensor>& inv_temperatures,
                                    int64_t ignore_index, at::Tensor grad_logits) {
  const LogprobsGradCall c = prepare_logprobs_grad_call(grad_logprobs, grad_entropy, logits,
                                                        labels_in, lse, entropy, grad_logits);
  const int64_t N = c.N, V = c.V;
  const DeviceOf dev = device_of(logits, "logits");
  check_arg(cut_in, "cut", dev, Kind::kFloat32, N, "logits.shape[:-1]");
  check_arg(cut_index_in, "cut_index", dev, Kind::kAny, N, "logits.shape[:-1]");
  TORCH_CHECK_TYPE(cut_index_in.scalar_type() == at::kLong, "cut_index: expected dtype int64, got ",
                   dtype_name(cut_index_in.scalar_type()));
  const SamplerParamPtrs params =
      sampler_params(device_of(logits, "logits"), N, inv_temperature, inv_temperatures, 0,
                     std::nullopt, 1.0, std::nullopt, 0.0, std::nullopt);
  if (N == 0) return;
  check_labels_on_host(c.labels, V, ignore_index);
  const at::Tensor cut = cut_in.contiguous(), cut_index = cut_index_in.contiguous();
  const RowIndexer rin = c.rows, rout = c.grad_rows;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_sampler_bwd", [&] {
        AT_DISPATCH_INDEX_TYPES(c.labels.scalar_type(), "token_logprobs_sampler_bwd", [&] {
          const scalar_t* x = logits.const_data_ptr<scalar_t>();
          scalar_t* gx = grad_logits.data_ptr<scalar_t>();
          const index_t* lab = c.labels.const_data_ptr<index_t>();
          const float* glp = c.glp.const_data_ptr<float>();
          const float* gent = c.gent_ptr();
          const float* ls = c.lse.const_data_ptr<float>();
          const float* ent = c.ent_ptr();
          const float* cuts = cut.const_data_ptr<float>();
          const int64_t* cidx = cut_index.const_data_ptr<int64_t>();
          const int64_t grain = std::max<int64_t>(1, 16384 / V);
          at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            cpu::SamplerWorkspace ws;
            for (int64_t r = begin; r < end; ++r) {
              const int64_t label = lab[r];
              const scalar_t* row = x + rin(r);
              scalar_t* grow = gx + rout(r);
              if (label == ignore_index) {
                std::fill(grow, grow + V, scalar_t(0));
                continue;
              }
              const double inv_t64 = params.inv_t ? params.inv_t[r] : params.inv_t0;
              const float inv_t = static_cast<float>(inv_t64);
              const float cutv = cuts[r];
              const int64_t ci = cidx[r];
              const bool kept_label = in_kept_set(static_cast<float>(row[label]), label, cutv, ci);
              const float l = ls[r];
              if (!std::isfinite(l)) {  // overflowing scaled logits: float64 from the logits
                double xmax = -INFINITY;
                for (int64_t j = 0; j < V; ++j) xmax = std::max(xmax, static_cast<double>(row[j]));
                double s = 0, u = 0;
                for (int64_t j = 0; j < V; ++j) {
                  if (!in_kept_set(static_cast<float>(row[j]), j, cutv, ci)) continue;
                  const double d = (static_cast<double>(row[j]) - xmax) * inv_t64;
                  const double e = std::exp(d);
                  s += e;
                  if (e > 0) u += e * d;
                }
                const double log_s = std::log(s), h = log_s - u / s;
                const double ga = kept_label ? glp[r] * inv_t64 : 0.0;
                const double gb = gent ? gent[r] * inv_t64 : 0.0;
                for (int64_t j = 0; j < V; ++j) {
                  const bool k = in_kept_set(static_cast<float>(row[j]), j, cutv, ci);
                  const double logq = (static_cast<double>(row[j]) - xmax) * inv_t64 - log_s;
                  const double q = k ? std::exp(logq) : 0.0;
                  const double w = q > 0 ? q * (logq + h) : 0.0;
                  grow[j] =
                      static_cast<scalar_t>(ga * ((j == label && k ? 1.0 : 0.0) - q) - gb * w);
                }
                if (!(l == l) || !(xmax == xmax) || xmax == INFINITY || xmax == -INFINITY)
                  for (int64_t j = 0; j < V; ++j) grow[j] = static_cast<scalar_t>(NAN);
                continue;
              }
              const float a = kept_label ? glp[r] * inv_t : 0.f;
              const float b = gent ? gent[r] * inv_t : 0.f;
              const float cc = gent ? ent[r] - l : -l;
              const float xl = static_cast<float>(row[label]);
              const float zl = inv_t != 1.f ? cpu::scaled(xl, inv_t) : xl;
              sampler_grad_row(row, grow, V, label, inv_t, l, a, b, cc, cutv, ci);
              if (kept_label) {
                const float p = std::exp(zl - l);
                grow[label] = static_cast<scalar_t>(-a * p - b * weighted_offset(p, zl + cc) + a);
              }
            }
          });
        });
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // Per-token parameters: labels.numel() contiguous values (float64 inverse temperatures, top-p,
  // min-p; int64 top-k), or None: the scalar for every row. Outputs as the registered op
  // ppo_kernels::token_logprobs_sampler's.
  m.def(
      "token_logprobs_sampler_fwd(Tensor logits, Tensor labels, float inv_temperature, "
      "Tensor? inv_temperatures, int top_k, Tensor? top_ks, float top_p, Tensor? top_ps, "
      "float min_p, Tensor? min_ps, str sampler, int ignore_index, bool with_entropy, "
      "bool with_sum_p2, bool with_lse, int stats_top_k, bool with_is_argmax) -> (Tensor logprobs, "
      "Tensor entropy, Tensor lse, Tensor cut, Tensor cut_index, Tensor outside, Tensor sum_p2, "
      "Tensor full_lse, Tensor top_ids, Tensor top_logprobs, Tensor is_argmax)");
  m.def(
      "token_logprobs_sampler_bwd(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
      "Tensor labels, Tensor lse, Tensor entropy, Tensor cut, Tensor cut_index, "
      "float inv_temperature, Tensor? inv_temperatures, int ignore_index, Tensor(a!) grad_logits) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("token_logprobs_sampler_fwd", &token_logprobs_sampler_fwd_cpu);
  m.impl("token_logprobs_sampler_bwd", &token_logprobs_sampler_bwd_cpu);
}

}  // namespace ppo_kernels
