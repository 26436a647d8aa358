// full_kl: CPU kernels and the schemas of the raw kernels (CUDA impls in csrc/cuda/full_kl.cu).
// Semantics: ppo_kernels/full_kl/naive.py; the online math: csrc/common/kl_stats.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <array>

#include "common/alloc.h"
#include "common/cpu_kl.h"
#include "common/cpu_softmax.h"
#include "common/full_kl_host.h"
#include "common/kl_stats.h"
#include "common/sampler_rules.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {
namespace {

using cpu::block_kl_stats;
using cpu::from_float;
using cpu::hsum;
using cpu::load_scaled;
using cpu::Vec;
constexpr int64_t kBlock = 2048;  // floats per L1-resident block of a row (x2 tensors)

// The sampler's kept set per row (common/sampler_rules.h: x > cut, or x == cut and j <= cut_index),
// as contiguous tensors; null pointers when absent (every token kept).
struct KeptSet {
  at::Tensor cut, cut_index;
  const float* c = nullptr;
  const int64_t* ci = nullptr;
  // Whether row r drops tokens: a cut of -inf keeps the whole row (an undefined row stays NaN).
  bool truncates(int64_t r) const { return c && c[r] > -INFINITY; }
};

KeptSet kept_set(const at::Tensor& cut, const at::Tensor& cut_index, const at::Tensor& logits,
                 int64_t N) {
  const DeviceOf dev = device_of(logits, "logits");
  check_arg(cut, "cut", dev, Kind::kFloat32, N, "logits.shape[:-1]");
  check_arg(cut_index, "cut_index", dev, Kind::kAny, N, "logits.shape[:-1]");
  TORCH_CHECK_TYPE(cut_index.scalar_type() == at::kLong, "cut_index: expected dtype int64, got ",
                   dtype_name(cut_index.scalar_type()));
  KeptSet k{cut.contiguous(), cut_index.contiguous()};
  k.c = k.cut.const_data_ptr<float>();
  k.ci = k.cut_index.const_data_ptr<int64_t>();
  return k;
}

// The policy's scaled logits z[0, n) of the block starting at j0 with the tokens outside the kept
// set at -inf (no mass, no gradient); returns the block's new max.
template <typename scalar_t>
float drop_outside(const scalar_t* x, int64_t j0, int64_t n, float cut, int64_t cut_index,
                   float* z) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (!in_kept_set(static_cast<float>(x[j0 + i]), j0 + i, cut, cut_index)) z[i] = -INFINITY;
    m = std::max(m, z[i]);
  }
  return m;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> full_kl_fwd_impl(
    const at::Tensor& logits_in, const at::Tensor& ref_in, const std::optional<at::Tensor>& mask_in,
    double inv_temperature, const std::optional<at::Tensor>& inv_ts_in, const at::Tensor* cut_in,
    const at::Tensor* cut_index_in) {
  const KLFwdCall c = prepare_kl_fwd(logits_in, ref_in, mask_in, inv_temperature);
  const KLRows& R = c.R;
  const at::Tensor &kl = c.kl, &lz = c.lz, &lw = c.lw, &mask = c.mask;
  const int64_t N = R.N, V = R.V;
  const double* inv_ts = kl_inv_temperatures(inv_ts_in, device_of(logits_in, "logits"), N);
  const KeptSet K = cut_in ? kept_set(*cut_in, *cut_index_in, logits_in, N) : KeptSet();
  if (N == 0) return {kl, lz, lw};
  const float inv_t0 = static_cast<float>(inv_temperature);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, R.logits.scalar_type(), "full_kl_fwd", [&] {
        const scalar_t* x = R.logits.const_data_ptr<scalar_t>();
        const scalar_t* y = R.ref.const_data_ptr<scalar_t>();
        const bool* mk = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
        float* o = kl.data_ptr<float>();
        float* oz = lz.data_ptr<float>();
        float* ow = lw.data_ptr<float>();
        at::parallel_for(0, N, std::max<int64_t>(1, 8192 / V), [&](int64_t begin, int64_t end) {
          std::array<float, kBlock> bz, bw;  // on the stack: no allocation or zero fill per call
          for (int64_t r = begin; r < end; ++r) {
            if (mk && !mk[r]) {
              o[r] = oz[r] = ow[r] = 0.f;
              continue;
            }
            const scalar_t* zr = x + R.rz(r);
            const scalar_t* wr = y + R.rw(r);
            const float inv_t = inv_ts ? static_cast<float>(inv_ts[r]) : inv_t0;  // per row
            KLStats st = kl_stats_empty();
            const bool drops = K.truncates(r);
            for (int64_t j = 0; j < V; j += kBlock) {
              const int64_t n = std::min(kBlock, V - j);
              float mz = load_scaled(zr + j, n, inv_t, bz.data());
              if (drops) mz = drop_outside(zr, j, n, K.c[r], K.ci[r], bz.data());
              const float mw = load_scaled(wr + j, n, inv_t, bw.data());
              st = kl_stats_merge(st, block_kl_stats(bz.data(), bw.data(), n, mz, mw));
            }
            o[r] = kl_stats_value(st);
            oz[r] = kl_stats_lse_z(st);
            ow[r] = kl_stats_lse_w(st);
          }
        });
      });
  return {kl, lz, lw};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> full_kl_fwd_cpu(
    const at::Tensor& logits_in, const at::Tensor& ref_in, const std::optional<at::Tensor>& mask_in,
    double inv_temperature, const std::optional<at::Tensor>& inv_ts_in) {
  return full_kl_fwd_impl(logits_in, ref_in, mask_in, inv_temperature, inv_ts_in, nullptr, nullptr);
}

// KL(q || r) with q the policy's distribution on the sampler's kept set (cut, cut_index).
std::tuple<at::Tensor, at::Tensor, at::Tensor> full_kl_kept_fwd_cpu(
    const at::Tensor& logits_in, const at::Tensor& ref_in, const std::optional<at::Tensor>& mask_in,
    double inv_temperature, const std::optional<at::Tensor>& inv_ts_in, const at::Tensor& cut,
    const at::Tensor& cut_index) {
  return full_kl_fwd_impl(logits_in, ref_in, mask_in, inv_temperature, inv_ts_in, &cut, &cut_index);
}

// grad_logits = g/T * p (z - w - c), grad_ref = g/T * (q - p), c = lse_z - lse_w + KL (p = 0
// outside the kept set when one is given).
void full_kl_bwd_impl(const at::Tensor& grad_in, const at::Tensor& logits_in,
                      const at::Tensor& ref_in, const std::optional<at::Tensor>& mask_in,
                      const at::Tensor& kl_in, const at::Tensor& lz_in, const at::Tensor& lw_in,
                      double inv_temperature, at::Tensor grad_logits,
                      std::optional<at::Tensor> grad_ref,
                      const std::optional<at::Tensor>& inv_ts_in, const at::Tensor* cut_in,
                      const at::Tensor* cut_index_in) {
  const KLGradCall in = prepare_kl_bwd(grad_in, logits_in, ref_in, mask_in, kl_in, lz_in, lw_in,
                                       inv_temperature, grad_logits, grad_ref);
  const KLRows& R = in.R;
  const int64_t N = R.N, V = R.V;
  const double* inv_ts = kl_inv_temperatures(inv_ts_in, device_of(logits_in, "logits"), N);
  const KeptSet K = cut_in ? kept_set(*cut_in, *cut_index_in, logits_in, N) : KeptSet();
  if (N == 0 || V == 0) return;
  const bool need_ref = in.need_ref;
  const at::Tensor &g = in.g, &klc = in.kl, &lzc = in.lz, &lwc = in.lw, &mask = in.mask;
  const float inv_t0 = static_cast<float>(inv_temperature);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, R.logits.scalar_type(), "full_kl_bwd", [&] {
        const scalar_t* x = R.logits.const_data_ptr<scalar_t>();
        const scalar_t* y = R.ref.const_data_ptr<scalar_t>();
        scalar_t* gx = grad_logits.data_ptr<scalar_t>();
        scalar_t* gy = need_ref ? grad_ref->data_ptr<scalar_t>() : nullptr;
        const bool* mk = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
        const float *gp = g.const_data_ptr<float>(), *klp = klc.const_data_ptr<float>();
        const float *lzp = lzc.const_data_ptr<float>(), *lwp = lwc.const_data_ptr<float>();
        at::parallel_for(0, N, std::max<int64_t>(1, 8192 / V), [&](int64_t begin, int64_t end) {
          std::array<float, kBlock> bz, bw;  // on the stack: no allocation or zero fill per call
          for (int64_t r = begin; r < end; ++r) {
            scalar_t* gxr = gx + r * V;
            scalar_t* gyr = gy ? gy + r * V : nullptr;
            if (mk && !mk[r]) {
              std::fill(gxr, gxr + V, scalar_t(0));
              if (gyr) std::fill(gyr, gyr + V, scalar_t(0));
              continue;
            }
            const float inv_t = inv_ts ? static_cast<float>(inv_ts[r]) : inv_t0;  // per row
            const float a = gp[r] * inv_t, lz = lzp[r], lw = lwp[r];
            const float c = lz - lw + klp[r];
            const Vec va(a), vlz(lz), vlw(lw), vc(c), zero(0.f);
            const bool drops = K.truncates(r);
            for (int64_t j = 0; j < V; j += kBlock) {
              const int64_t n = std::min(kBlock, V - j);
              load_scaled(x + R.rz(r) + j, n, inv_t, bz.data());
              if (drops) drop_outside(x + R.rz(r), j, n, K.c[r], K.ci[r], bz.data());
              load_scaled(y + R.rw(r) + j, n, inv_t, bw.data());
              int64_t i = 0;
              for (; i + Vec::size() <= n; i += Vec::size()) {
                const Vec z = Vec::loadu(bz.data() + i), w = Vec::loadu(bw.data() + i);
                const Vec p = (z - vlz).exp();
                if (gyr) (va * ((w - vlw).exp() - p)).store(bw.data() + i);
                Vec::blendv(zero, va * p * ((z - w) - vc), p > zero).store(bz.data() + i);
              }
              for (; i < n; ++i) {
                const float z = bz[i], w = bw[i];
                const float p = std::exp(z - lz);
                if (gyr) bw[i] = a * (std::exp(w - lw) - p);
                bz[i] = a * full_kl_grad_z(p, z, w, c);
              }
              from_float(bz.data(), gxr + j, n);
              if (gyr) from_float(bw.data(), gyr + j, n);
            }
          }
        });
      });
}

void full_kl_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& logits_in,
                     const at::Tensor& ref_in, const std::optional<at::Tensor>& mask_in,
                     const at::Tensor& kl_in, const at::Tensor& lz_in, const at::Tensor& lw_in,
                     double inv_temperature, at::Tensor grad_logits,
                     std::optional<at::Tensor> grad_ref,
                     const std::optional<at::Tensor>& inv_ts_in) {
  full_kl_bwd_impl(grad_in, logits_in, ref_in, mask_in, kl_in, lz_in, lw_in, inv_temperature,
                   grad_logits, grad_ref, inv_ts_in, nullptr, nullptr);
}

void full_kl_kept_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& logits_in,
                          const at::Tensor& ref_in, const std::optional<at::Tensor>& mask_in,
                          const at::Tensor& kl_in, const at::Tensor& lz_in, const at::Tensor& lw_in,
                          double inv_temperature, at::Tensor grad_logits,
                          std::optional<at::Tensor> grad_ref,
                          const std::optional<at::Tensor>& inv_ts_in, const at::Tensor& cut,
                          const at::Tensor& cut_index) {
  full_kl_bwd_impl(grad_in, logits_in, ref_in, mask_in, kl_in, lz_in, lw_in, inv_temperature,
                   grad_logits, grad_ref, inv_ts_in, &cut, &cut_index);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "full_kl_fwd(Tensor logits, Tensor ref_logits, Tensor? mask, float inv_temperature, "
      "Tensor? inv_temperatures=None) -> (Tensor kl, Tensor lse_z, Tensor lse_w)");
  m.def(
      "full_kl_bwd(Tensor grad, Tensor logits, Tensor ref_logits, Tensor? mask, Tensor kl, "
      "Tensor lse_z, Tensor lse_w, float inv_temperature, Tensor(a!) grad_logits, "
      "Tensor(b!)? grad_ref_logits, Tensor? inv_temperatures=None) -> ()");
  // The same on the sampler's kept set of each row of logits (cut, cut_index: the
  // token_logprobs_sampler kernels' outputs): KL(q || r) with q the policy's distribution
  // truncated to it and renormalised, r the reference's whole softmax. CPU only (CUDA: Triton).
  m.def(
      "full_kl_kept_fwd(Tensor logits, Tensor ref_logits, Tensor? mask, float inv_temperature, "
      "Tensor? inv_temperatures, Tensor cut, Tensor cut_index) -> (Tensor kl, Tensor lse_z, "
      "Tensor lse_w)");
  m.def(
      "full_kl_kept_bwd(Tensor grad, Tensor logits, Tensor ref_logits, Tensor? mask, Tensor kl, "
      "Tensor lse_z, Tensor lse_w, float inv_temperature, Tensor(a!) grad_logits, "
      "Tensor(b!)? grad_ref_logits, Tensor? inv_temperatures, Tensor cut, Tensor cut_index) -> ()");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("full_kl_fwd", &full_kl_fwd_cpu);
  m.impl("full_kl_bwd", &full_kl_bwd_cpu);
  m.impl("full_kl_kept_fwd", &full_kl_kept_fwd_cpu);
  m.impl("full_kl_kept_bwd", &full_kl_kept_bwd_cpu);
}

}  // namespace ppo_kernels
