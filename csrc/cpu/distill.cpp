// distill: the distillation tile kernels on the CPU and the schemas of the raw kernels. Per row of
// a student tile z_s and a teacher tile z_t [N, V] (whole vocabulary): the forward divergence
// (forward_kl, reverse_kl, jsd(beta), tv) at temperature T with what the backward needs, and the
// student's hard-label log-prob at temperature 1 (Liger's hard loss); the backward writes
// d L / d z_s = g dD/dz_s + g_hard (onehot - softmax(z_s)) over the student tile, in place.
// Semantics: ppo_kernels/distill/naive.py; per-entry math: csrc/common/distill_math.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <array>

#include "common/cpu_kl.h"
#include "common/cpu_softmax.h"
#include "common/distill_host.h"
#include "common/kl_stats.h"

namespace ppo_kernels {
namespace {

using cpu::block_kl_stats;
using cpu::from_float;
using cpu::hsum;
using cpu::load_scaled;
using cpu::Vec;
constexpr int64_t kBlock = cpu::kBlock;

Vec vsign(const Vec& x) {
  const Vec one(1.f), zero(0.f);
  return Vec::blendv(zero, one, x > zero) - Vec::blendv(zero, one, x < zero);
}

// log x for a normal x > 0, NaN or +inf (x itself for those two), within 2 ulp: x = 2^k m with
// m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1) (|s| < 0.18: five terms of
// the series reach float32's precision). A quarter of the time of at::vec's log (Sleef's 1-ulp
// one), which was half of the jsd tiles' per-entry work: the forward and the gradient each take
// one log per entry.
Vec vlog(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 v = x;
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i k = _mm256_srai_epi32(_mm256_sub_epi32(bits, _mm256_set1_epi32(0x3f3504f3)), 23);
  const __m256 m = _mm256_castsi256_ps(_mm256_sub_epi32(bits, _mm256_slli_epi32(k, 23)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 s = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
  const __m256 z = _mm256_mul_ps(s, s);
  __m256 c = _mm256_set1_ps(2.f / 9.f);
  c = _mm256_fmadd_ps(c, z, _mm256_set1_ps(2.f / 7.f));
  c = _mm256_fmadd_ps(c, z, _mm256_set1_ps(2.f / 5.f));
  c = _mm256_fmadd_ps(c, z, _mm256_set1_ps(2.f / 3.f));
  const __m256 lm = _mm256_fmadd_ps(_mm256_mul_ps(c, z), s, _mm256_add_ps(s, s));
  // k ln 2 in two parts: the low one keeps k ln 2's rounding below half an ulp of the result
  const __m256 fk = _mm256_cvtepi32_ps(k);
  const __m256 r =
      _mm256_fmadd_ps(fk, _mm256_set1_ps(0.693145751953125f),
                      _mm256_fmadd_ps(fk, _mm256_set1_ps(1.4286068202862268e-06f), lm));
  return _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
#else
  return x.log();
#endif
}

// log m of the mixture m = (1 - beta) p + beta q (distill_math.h log_mix), vectorised.
Vec vlog_mix(const Vec& p, const Vec& q, const Vec& v1mb, const Vec& vb) {
  return vlog(at::vec::maximum(v1mb * p + vb * q, Vec(1.17549435e-38f)));
}

struct RowOut {
  float value, lse_s, lse_t, aux, lse_h;
};

struct Buffers {
  std::array<float, kBlock> s, t, raw;  // on the stack: no allocation or zero fill per row
};

// One row's forward. `hard_sep`: the hard term's log-sum-exp at temperature 1 needs its own
// statistics (T != 1); otherwise it is lse_s.
template <typename scalar_t>
RowOut row_forward(const scalar_t* s, const scalar_t* t, const DistillCall& c, bool hard_sep,
                   Buffers& buf) {
  const int64_t V = c.V;
  const float inv_t = c.inv_t;
  SoftmaxStats h = stats_empty();
  RowOut o{};
  if (c.mode == kForwardKL || c.mode == kReverseKL) {
    const bool rev = c.mode == kReverseKL;
    KLStats st = kl_stats_empty();
    for (int64_t j = 0; j < V; j += kBlock) {
      const int64_t n = std::min(kBlock, V - j);
      const float ms = load_scaled(s + j, n, inv_t, buf.s.data());
      const float mt = load_scaled(t + j, n, inv_t, buf.t.data());
      st = kl_stats_merge(st, rev ? block_kl_stats(buf.s.data(), buf.t.data(), n, ms, mt)
                                  : block_kl_stats(buf.t.data(), buf.s.data(), n, mt, ms));
      if (hard_sep) {
        const float m1 = load_scaled(s + j, n, 1.f, buf.raw.data());
        h = stats_merge(h, cpu::block_stats(buf.raw.data(), n, m1));
      }
    }
    o.value = kl_stats_value(st);
    o.lse_s = rev ? kl_stats_lse_z(st) : kl_stats_lse_w(st);
    o.lse_t = rev ? kl_stats_lse_w(st) : kl_stats_lse_z(st);
    o.aux = rev ? o.value : 0.f;
  } else {
    SoftmaxStats a = stats_empty(), b = stats_empty();
    for (int64_t j = 0; j < V; j += kBlock) {
      const int64_t n = std::min(kBlock, V - j);
      const float ms = load_scaled(s + j, n, inv_t, buf.s.data());
      const float mt = load_scaled(t + j, n, inv_t, buf.t.data());
      a = stats_merge(a, cpu::block_stats(buf.s.data(), n, ms));
      b = stats_merge(b, cpu::block_stats(buf.t.data(), n, mt));
      if (hard_sep) {
        const float m1 = load_scaled(s + j, n, 1.f, buf.raw.data());
        h = stats_merge(h, cpu::block_stats(buf.raw.data(), n, m1));
      }
    }
    o.lse_s = stats_lse(a);
    o.lse_t = stats_lse(b);
    const float beta = c.beta;
    const Vec vls(o.lse_s), vlt(o.lse_t), zero(0.f), half(0.5f), vb(beta), v1mb(1.f - beta);
    Vec vval(0.f), vaux(0.f);
    float val = 0.f, aux = 0.f;
    for (int64_t j = 0; j < V; j += kBlock) {
      const int64_t n = std::min(kBlock, V - j);
      load_scaled(s + j, n, inv_t, buf.s.data());
      load_scaled(t + j, n, inv_t, buf.t.data());
      int64_t i = 0;
      for (; i + Vec::size() <= n; i += Vec::size()) {
        const Vec lp = Vec::loadu(buf.s.data() + i) - vls;
        const Vec lq = Vec::loadu(buf.t.data() + i) - vlt;
        const Vec p = lp.exp(), q = lq.exp();
        if (c.mode == kJSD) {
          const Vec lm = vlog_mix(p, q, v1mb, vb);
          const Vec kp = Vec::blendv(zero, p * (lp - lm), p > zero);
          const Vec kq = Vec::blendv(zero, q * (lq - lm), q > zero);
          vval = vval + vb * kq + v1mb * kp;
          vaux = vaux + kp;
        } else {
          vval = vval + half * (p - q).abs();
          vaux = vaux + p * vsign(p - q);
        }
      }
      for (; i < n; ++i) {
        const float lp = buf.s[i] - o.lse_s, lq = buf.t[i] - o.lse_t;
        const float p = std::exp(lp), q = std::exp(lq);
        val += c.mode == kJSD ? jsd_term(lp, lq, p, q, beta, aux) : tv_term(p, q, aux);
      }
    }
    o.value = val + hsum(vval);
    o.aux = aux + hsum(vaux);
  }
  // an undefined distribution (a row of -inf) or a NaN / +inf logit: NaN
  if (!std::isfinite(o.lse_s) || !std::isfinite(o.lse_t)) o.value = o.aux = NAN;
  o.lse_h = hard_sep ? stats_lse(h) : o.lse_s;
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> distill_fwd_cpu(
    const at::Tensor& student, const at::Tensor& teacher,
    const std::optional<at::Tensor>& labels_in, const std::optional<at::Tensor>& mask_in,
    double inv_temperature, const std::string& divergence, double beta, int64_t ignore_index) {
  const DistillCall c = prepare_distill(student, teacher, labels_in, mask_in, inv_temperature,
                                        divergence, beta, ignore_index);
  const int64_t N = c.N;
  const auto f32 = student.options().dtype(at::kFloat);
  at::Tensor value = new_output({N}, f32), lse_s = new_output({N}, f32);
  at::Tensor lse_t = new_output({N}, f32), aux = new_output({N}, f32);
  const bool hard = c.labels.defined();
  at::Tensor hard_lp = hard ? new_output({N}, f32) : at::empty({0}, f32);
  at::Tensor lse_h = hard ? new_output({N}, f32) : at::empty({0}, f32);
  if (N == 0) return {value, lse_s, lse_t, aux, hard_lp, lse_h};
  const bool hard_sep = hard && c.inv_t != 1.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.s.scalar_type(), "distill_fwd", [&] {
    const scalar_t* sp = c.s.const_data_ptr<scalar_t>();
    const scalar_t* tp = c.t.const_data_ptr<scalar_t>();
    const bool* mk = c.mask.defined() ? c.mask.const_data_ptr<bool>() : nullptr;
    const int64_t* lab = hard ? c.labels.const_data_ptr<int64_t>() : nullptr;
    float *ov = value.data_ptr<float>(), *os = lse_s.data_ptr<float>();
    float *ot = lse_t.data_ptr<float>(), *oa = aux.data_ptr<float>();
    float* oh = hard ? hard_lp.data_ptr<float>() : nullptr;
    float* ol = hard ? lse_h.data_ptr<float>() : nullptr;
    at::parallel_for(0, N, std::max<int64_t>(1, 8192 / c.V), [&](int64_t begin, int64_t end) {
      Buffers buf;
      for (int64_t r = begin; r < end; ++r) {
        if (mk && !mk[r]) {
          ov[r] = os[r] = ot[r] = oa[r] = 0.f;
          if (hard) oh[r] = ol[r] = 0.f;
          continue;
        }
        const scalar_t* sr = sp + r * c.ss;
        const RowOut o = row_forward(sr, tp + r * c.ts, c, hard_sep, buf);
        ov[r] = o.value;
        os[r] = o.lse_s;
        ot[r] = o.lse_t;
        oa[r] = o.aux;
        if (hard) {
          ol[r] = o.lse_h;
          const int64_t y = lab[r];
          // at T = 1 the label's logit is read as the statistics read it (scaled by 1 / T = 1)
          oh[r] = y == ignore_index ? 0.f : static_cast<float>(sr[y]) - o.lse_h;
        }
      }
    });
  });
  return {value, lse_s, lse_t, aux, hard_lp, lse_h};
}

// d D / d z of one vector of entries (the caller scales by g / T), MODE known at compile time.
template <int MODE>
Vec vgrad(const Vec& lp, const Vec& lq, const Vec& p, const Vec& q, const Vec& aux, const Vec& vb,
          const Vec& v1mb) {
  const Vec zero(0.f);
  if constexpr (MODE == kForwardKL) {
    return p - q;
  } else if constexpr (MODE == kReverseKL) {
    return Vec::blendv(zero, p * ((lp - lq) - aux), p > zero);
  } else if constexpr (MODE == kJSD) {
    const Vec lm = vlog_mix(p, q, v1mb, vb);
    return Vec::blendv(zero, v1mb * p * ((lp - lm) - aux), p > zero);
  } else {
    return Vec(0.5f) * p * (vsign(p - q) - aux);
  }
}

template <int MODE, typename scalar_t>
void row_backward(scalar_t* s, const scalar_t* t, const DistillCall& c, float lse_s, float lse_t,
                  float aux, float ga, float gh, float lse_h, int64_t y, bool hard_sep,
                  Buffers& buf) {
  const float inv_t = c.inv_t, beta = c.beta;
  const Vec vls(lse_s), vlt(lse_t), vaux(aux), vga(ga), vgh(gh), vlh(lse_h);
  const Vec vb(beta), v1mb(1.f - beta);
  const bool hard = gh != 0.f;
  for (int64_t j = 0; j < c.V; j += kBlock) {
    const int64_t n = std::min(kBlock, c.V - j);
    // the whole block is read before any of it is written: the tile may be its own output
    load_scaled(s + j, n, inv_t, buf.s.data());
    load_scaled(t + j, n, inv_t, buf.t.data());
    if (hard && hard_sep) load_scaled(s + j, n, 1.f, buf.raw.data());
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec lp = Vec::loadu(buf.s.data() + i) - vls;
      const Vec lq = Vec::loadu(buf.t.data() + i) - vlt;
      // (exp_u20: the gradient's exps, as the token_logprobs kernels' gradient tiles; reverse_kl
      // reads log q only)
      const Vec p = lp.exp_u20(), q = MODE == kReverseKL ? Vec(0.f) : lq.exp_u20();
      Vec g = vga * vgrad<MODE>(lp, lq, p, q, vaux, vb, v1mb);
      if (hard) g = g - vgh * (hard_sep ? (Vec::loadu(buf.raw.data() + i) - vlh).exp() : p);
      g.store(buf.s.data() + i);
    }
    for (; i < n; ++i) {
      const float lp = buf.s[i] - lse_s, lq = buf.t[i] - lse_t;
      const float p = std::exp(lp), q = std::exp(lq);
      float g = ga * distill_grad(MODE, lp, lq, p, q, aux, beta);
      if (hard) g -= gh * (hard_sep ? std::exp(buf.raw[i] - lse_h) : p);
      buf.s[i] = g;
    }
    if (hard && y >= j && y < j + n) buf.s[y - j] += gh;
    from_float(buf.s.data(), s + j, n);
  }
}

void distill_bwd_cpu(at::Tensor student, const at::Tensor& teacher,
                     const std::optional<at::Tensor>& labels_in,
                     const std::optional<at::Tensor>& mask_in, const at::Tensor& lse_s_in,
                     const at::Tensor& lse_t_in, const at::Tensor& aux_in,
                     const std::optional<at::Tensor>& lse_h_in, const at::Tensor& grad_in,
                     const std::optional<at::Tensor>& grad_hard_in, double inv_temperature,
                     const std::string& divergence, double beta, int64_t ignore_index) {
  const DistillCall c = prepare_distill(student, teacher, labels_in, mask_in, inv_temperature,
                                        divergence, beta, ignore_index);
  const at::Tensor ls = distill_row_arg(lse_s_in, "lse_student", c);
  const at::Tensor lt = distill_row_arg(lse_t_in, "lse_teacher", c);
  const at::Tensor ax = distill_row_arg(aux_in, "aux", c);
  const at::Tensor g = distill_row_arg(grad_in, "grad", c);
  const bool hard = grad_hard_in.has_value() && grad_hard_in->defined();
  at::Tensor gh, lh;
  if (hard) {
    TORCH_CHECK_VALUE(c.labels.defined(), "labels: a hard-label gradient (grad_hard) needs them");
    TORCH_CHECK_VALUE(lse_h_in.has_value() && lse_h_in->defined(),
                      "lse_hard: a hard-label gradient (grad_hard) needs it (the forward's)");
    gh = distill_row_arg(*grad_hard_in, "grad_hard", c);
    lh = distill_row_arg(*lse_h_in, "lse_hard", c);
  }
  if (c.N == 0 || c.V == 0) return;
  const bool hard_sep = hard && c.inv_t != 1.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.s.scalar_type(), "distill_bwd_", [&] {
    scalar_t* sp = student.data_ptr<scalar_t>();
    const scalar_t* tp = c.t.const_data_ptr<scalar_t>();
    const bool* mk = c.mask.defined() ? c.mask.const_data_ptr<bool>() : nullptr;
    const int64_t* lab = hard ? c.labels.const_data_ptr<int64_t>() : nullptr;
    const float *lsp = ls.const_data_ptr<float>(), *ltp = lt.const_data_ptr<float>();
    const float *axp = ax.const_data_ptr<float>(), *gp = g.const_data_ptr<float>();
    const float* ghp = hard ? gh.const_data_ptr<float>() : nullptr;
    const float* lhp = hard ? lh.const_data_ptr<float>() : nullptr;
    at::parallel_for(0, c.N, std::max<int64_t>(1, 8192 / c.V), [&](int64_t begin, int64_t end) {
      Buffers buf;
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* sr = sp + r * c.ss;
        if (mk && !mk[r]) {
          std::fill(sr, sr + c.V, scalar_t(0));
          continue;
        }
        const int64_t y = hard ? lab[r] : -1;
        const float ghr = (hard && y != ignore_index) ? ghp[r] : 0.f;
        const float lhr = hard ? lhp[r] : 0.f;
        const float ga = gp[r] * c.inv_t;
        auto run = [&](auto mode) {
          row_backward<decltype(mode)::value>(sr, tp + r * c.ts, c, lsp[r], ltp[r], axp[r], ga, ghr,
                                              lhr, y, hard_sep, buf);
        };
        switch (c.mode) {
          case kForwardKL:
            run(std::integral_constant<int, kForwardKL>{});
            break;
          case kReverseKL:
            run(std::integral_constant<int, kReverseKL>{});
            break;
          case kJSD:
            run(std::integral_constant<int, kJSD>{});
            break;
          default:
            run(std::integral_constant<int, kTV>{});
        }
      }
    });
  });
}

std::vector<std::string> divergence_names_op() { return distill_divergence_names(); }
std::vector<std::string> topk_tail_names_op() { return distill_topk_tail_names(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "distill_fwd(Tensor student, Tensor teacher, Tensor? labels, Tensor? mask, "
      "float inv_temperature, str divergence, float beta, int ignore_index) -> (Tensor value, "
      "Tensor lse_student, Tensor lse_teacher, Tensor aux, Tensor hard_logprob, Tensor lse_hard)");
  m.def(
      "distill_bwd_(Tensor(a!) student, Tensor teacher, Tensor? labels, Tensor? mask, "
      "Tensor lse_student, Tensor lse_teacher, Tensor aux, Tensor? lse_hard, Tensor grad, "
      "Tensor? grad_hard, float inv_temperature, str divergence, float beta, int ignore_index) "
      "-> ()");
  m.def("distill_divergence_names() -> str[]", &divergence_names_op);
  m.def("distill_topk_tail_names() -> str[]", &topk_tail_names_op);
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("distill_fwd", &distill_fwd_cpu);
  m.impl("distill_bwd_", &distill_bwd_cpu);
}

}  // namespace ppo_kernels
