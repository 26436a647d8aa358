// PPO policy / value losses, masked_aggregate and the pairwise (reward-model / DPO) loss: CPU
// kernels and the schemas of the raw kernels. Semantics: ppo_kernels/losses/naive.py.
//
// The losses take one pass over the tokens: rows are cut into chunks of kChunk tokens, each chunk
// (a parallel work item) produces the partial sums of LossPartial (masked loss, mask, statistics)
// in double, then one serial pass over the rows combines them into the per-row aggregation weights,
// the loss and the statistics -- deterministic whatever the thread count. The backward pass
// recomputes the per-token gradient from the inputs: grad = g * row_coef[b] * mask * dloss/dlp.
// The per-token math (csrc/common/loss_math.h) runs on at::vec lanes, 8 tokens at a time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common/alloc.h"
#include "common/cpu_load.h"
#include "common/loss_math.h"
#include "common/modes.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {
namespace {

constexpr int64_t kChunk = 1024;

using cpu::as_float;
using cpu::load_float;
using cpu::store_float;

struct Shape2 {
  int64_t B, T, nch;
};

Shape2 rows_of(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(),
                    "loss kernels expect contiguous (B, T) inputs, got shape ",
                    shape_str(x.sizes()));
  const int64_t B = x.size(0), T = x.size(1);
  return {B, T, T == 0 ? 0 : (T + kChunk - 1) / kChunk};
}

void check_like(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK_VALUE(b.sizes() == a.sizes() && b.is_contiguous(), name,
                    ": expected a contiguous tensor of shape ", shape_str(a.sizes()), ", got ",
                    shape_str(b.sizes()));
}

// The names of a loss kernel's three [B, T] inputs, for the argument checks; masked_aggregate has
// one (the per-token values are the loss: no second or third input is read).
using Names = std::array<const char*, 3>;
constexpr Names kPolicyNames{"logprobs", "old_logprobs", "advantages"};
constexpr Names kValueNames{"values", "old_values", "returns"};
constexpr Names kAggregateNames{"loss_mat", nullptr, nullptr};

void check_loss_args(const Names& n, const at::Tensor& x, const at::Tensor& y, const at::Tensor& z,
                     const at::Tensor& mask) {
  const DeviceOf dev = device_of(x, n[0]);
  check_arg(x, n[0], dev, Kind::kFloating);
  if (n[1] != nullptr) {
    check_arg(y, n[1], dev, Kind::kFloating);
    check_arg(z, n[2], dev, Kind::kFloating);
  }
  check_arg(mask, "mask", dev);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(), n[0],
                    ": expected a contiguous (B, T) tensor, got shape ", shape_str(x.sizes()));
  if (n[1] != nullptr) {
    check_like(x, y, n[1]);
    check_like(x, z, n[2]);
  }
  check_like(x, mask, "mask");
  TORCH_CHECK_TYPE(!at::isComplexType(mask.scalar_type()), "mask: complex masks are not supported");
}

// One pass: per-chunk partial sums of (loss, mask, the NS per-token statistics), then the serial
// combine. The statistics out: each per-token one's masked mean; the policy loss (NS = 6) adds
// TRL's clip_region_frac (low + high: exclusive) and the min / max over the rows with a token of
// the row's clip_low / clip_high fraction (NaN when no row has one).
template <int NS, typename Fn>
std::tuple<at::Tensor, at::Tensor, at::Tensor> loss_fwd(
    const at::Tensor& x, const at::Tensor& y, const at::Tensor& z, const at::Tensor& mask,
    const std::string& agg_name, double scale, const std::optional<at::Tensor>& global_denom,
    std::optional<double> global_denom_value, const Names& names, Fn fn) {
  constexpr bool kTrl = NS == kPolicyTokenStats;
  constexpr int64_t n_stats = kTrl ? NS + 3 : NS;
  check_loss_args(names, x, y, z, mask);
  const int64_t agg = mode_index("agg", agg_names(), agg_name);
  const Shape2 s = rows_of(x);
  if (global_denom.has_value() && global_denom->defined()) {
    check_arg(*global_denom, "global_denom", device_of(x, names[0]), Kind::kAny, 1,
              "a single value");
  }
  const int64_t items = s.B * s.nch;
  const bool one_input = names[1] == nullptr;
  std::vector<std::array<double, kNumPartials>> part(items);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    float a[kChunk], b[kChunk], c[kChunk], m[kChunk];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t row = it / s.nch, t0 = (it % s.nch) * kChunk;
      const int64_t n = std::min(kChunk, s.T - t0), off = row * s.T + t0;
      load_float(mask, off, n, m);
      const float* pa = as_float(x, off, n, a);
      const float* pb = one_input ? pa : as_float(y, off, n, b);
      const float* pc = one_input ? pa : as_float(z, off, n, c);
      // 8 tokens per step; the tail is a partial load whose missing lanes have mask 0
      const VecF vzero(0.f);
      VecF acc[2 + NS];
      for (auto& v : acc) v = vzero;
      for (int64_t i = 0; i < n; i += VecF::size()) {
        const int64_t k = std::min<int64_t>(VecF::size(), n - i);
        const VecF vm = VecF::loadu(m + i, k);
        const VecF keep = vm != vzero;  // masked positions never contribute, even if NaN
        const VecF va = VecF::loadu(pa + i, k);
        const TokenTerms<VecF> o =
            one_input ? fn(va, va, va) : fn(va, VecF::loadu(pb + i, k), VecF::loadu(pc + i, k));
        acc[kSumLoss] = acc[kSumLoss] + VecF::blendv(vzero, vm * o.loss, keep);
        acc[kSumMask] = acc[kSumMask] + vm;
        for (int q = 0; q < NS; ++q)
          acc[kSumStat + q] = acc[kSumStat + q] + VecF::blendv(vzero, vm * o.stat[q], keep);
      }
      std::array<double, kNumPartials> sums{};
      for (int q = 0; q < 2 + NS; ++q) {
        float lanes[VecF::size()];
        acc[q].store(lanes);
        for (float v : lanes) sums[q] += v;
      }
      part[it] = sums;
    }
  });
  // Serial combine over rows (cheap: B * nch items).
  std::vector<double> row_loss(s.B, 0.0), row_n(s.B, 0.0);
  std::array<double, NS + 1> stat{};  // (+ 1: a zero-length array is not portable)
  double n_total = 0.0, n_seqs = 0.0;
  double low_min = INFINITY, high_max = -INFINITY;  // over the rows with a token
  for (int64_t r = 0; r < s.B; ++r) {
    double low = 0.0, high = 0.0;
    for (int64_t c = 0; c < s.nch; ++c) {
      const auto& p = part[r * s.nch + c];
      row_loss[r] += p[kSumLoss];
      row_n[r] += p[kSumMask];
      for (int k = 0; k < NS; ++k) stat[k] += p[kSumStat + k];
      if (kTrl) {
        low += p[kSumStat + 4];
        high += p[kSumStat + 5];
      }
    }
    if (kTrl && row_n[r] > 0.0) {
      low_min = std::min(low_min, low / row_n[r]);
      high_max = std::max(high_max, high / row_n[r]);
    }
    n_total += row_n[r];
    n_seqs += row_n[r] > 0.0 ? 1.0 : 0.0;
  }
  double denom = agg == kTokenMean ? n_total : n_seqs;
  if (global_denom.has_value() && global_denom->defined()) {
    denom = global_denom->to(at::kDouble).item<double>();  // a CPU tensor: no device sync
  } else if (global_denom_value.has_value()) {
    denom = *global_denom_value;
  }
  const double per = denom != 0.0 ? scale / denom : 0.0;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor coef = new_output({s.B}, f32);
  at::Tensor loss = new_output({}, f32);
  at::Tensor stats = new_output({n_stats}, f32);
  float* cp = coef.data_ptr<float>();
  double total = 0.0;
  for (int64_t r = 0; r < s.B; ++r) {
    double c;
    if (agg == kTokenMean)
      c = per;
    else if (!(row_n[r] > 0.0))
      c = 0.0;
    else
      c = agg == kSeqMeanTokenMean ? per / row_n[r] : per;
    cp[r] = static_cast<float>(c);
    total += c * row_loss[r];
  }
  loss.fill_(total);
  float* sp = stats.data_ptr<float>();
  for (int64_t k = 0; k < NS; ++k)
    sp[k] = n_total != 0.0 ? static_cast<float>(stat[k] / n_total) : 0.f;
  if (kTrl) {
    sp[NS] = n_total != 0.0 ? static_cast<float>((stat[4] + stat[5]) / n_total) : 0.f;
    sp[NS + 1] = std::isinf(low_min) ? NAN : static_cast<float>(low_min);
    sp[NS + 2] = std::isinf(high_max) ? NAN : static_cast<float>(high_max);
  }
  return {loss, stats, coef};
}

template <typename Fn>
at::Tensor loss_bwd(const at::Tensor& grad_loss, const at::Tensor& x, const at::Tensor& y,
                    const at::Tensor& z, const at::Tensor& mask, const at::Tensor& row_coef,
                    const Names& names, Fn fn) {
  const DeviceOf dev = device_of(x, names[0]);
  check_arg(row_coef, "row_coef", dev, Kind::kFloat32);
  check_arg(grad_loss, "grad_loss", dev, Kind::kFloating);
  check_loss_args(names, x, y, z, mask);
  const Shape2 s = rows_of(x);
  check_arg(row_coef, "row_coef", dev, Kind::kFloat32, s.B, "one per row");
  check_arg(grad_loss, "grad_loss", dev, Kind::kFloating, 1, "the 0-dim loss");
  at::Tensor grad = new_output(x.sizes(), x.options());
  const float g = grad_loss.to(at::kFloat).item<float>();
  const at::Tensor coef_c = row_coef.contiguous();
  const float* coef = coef_c.const_data_ptr<float>();
  const bool f32 = grad.scalar_type() == at::kFloat;
  at::parallel_for(0, s.B * s.nch, 1, [&](int64_t begin, int64_t end) {
    float a[kChunk], b[kChunk], c[kChunk], m[kChunk];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t row = it / s.nch, t0 = (it % s.nch) * kChunk;
      const int64_t n = std::min(kChunk, s.T - t0), off = row * s.T + t0;
      load_float(mask, off, n, m);
      const float* pa = as_float(x, off, n, a);
      const float* pb = as_float(y, off, n, b);
      const float* pc = as_float(z, off, n, c);
      float* out = f32 ? grad.data_ptr<float>() + off : a;  // float32: written in place
      const VecF w(g * coef[row]), vzero(0.f);
      for (int64_t i = 0; i < n; i += VecF::size()) {
        const int64_t k = std::min<int64_t>(VecF::size(), n - i);
        const VecF vm = VecF::loadu(m + i, k);
        const TokenTerms<VecF> o =
            fn(VecF::loadu(pa + i, k), VecF::loadu(pb + i, k), VecF::loadu(pc + i, k));
        VecF::blendv(vzero, w * vm * o.grad, vm != vzero).store(out + i, k);
      }
      if (!f32) store_float(grad, off, n, a);
    }
  });
  return grad;
}

// dual_clip / clip: none = off (policy_token / value_token take a non-positive value as off).
auto policy_fn(double clip_low, double clip_high, std::optional<double> dual_clip,
               double lr_clamp) {
  const float lo = static_cast<float>(1.0 - clip_low), hi = static_cast<float>(1.0 + clip_high);
  const float dc = static_cast<float>(dual_clip.value_or(0.0)), lrc = static_cast<float>(lr_clamp);
  return [=](const VecF& lp, const VecF& old, const VecF& adv) {
    return policy_token(lp, old, adv, lo, hi, dc, lrc);
  };
}

auto value_fn(std::optional<double> clip) {
  const float c = static_cast<float>(clip.value_or(0.0));
  return [=](const VecF& v, const VecF& vo, const VecF& ret) { return value_token(v, vo, ret, c); };
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ppo_policy_loss_fwd_cpu(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& mask, double clip_low, double clip_high, std::optional<double> dual_clip,
    double log_ratio_clamp, const std::string& agg, double scale,
    const std::optional<at::Tensor>& global_denom, std::optional<double> global_denom_value) {
  return loss_fwd<kPolicyTokenStats>(logprobs, old_logprobs, advantages, mask, agg, scale,
                                     global_denom, global_denom_value, kPolicyNames,
                                     policy_fn(clip_low, clip_high, dual_clip, log_ratio_clamp));
}

at::Tensor ppo_policy_loss_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& logprobs,
                                   const at::Tensor& old_logprobs, const at::Tensor& advantages,
                                   const at::Tensor& mask, const at::Tensor& row_coef,
                                   double clip_low, double clip_high,
                                   std::optional<double> dual_clip, double log_ratio_clamp) {
  return loss_bwd(grad_loss, logprobs, old_logprobs, advantages, mask, row_coef, kPolicyNames,
                  policy_fn(clip_low, clip_high, dual_clip, log_ratio_clamp));
}

// masked_aggregate: the token "loss" is the given value (its statistics unused); one pass computes
// the rows' masked sums and mask totals in double, the row coefficients and the loss.
std::tuple<at::Tensor, at::Tensor> masked_aggregate_fwd_cpu(
    const at::Tensor& loss_mat, const at::Tensor& mask, const std::string& agg, double scale,
    const std::optional<at::Tensor>& global_denom, std::optional<double> global_denom_value) {
  const auto identity = [](const VecF& v, const VecF&, const VecF&) {
    const VecF zero(0.f);
    return TokenTerms<VecF>{v, VecF(1.f), {zero, zero, zero, zero, zero, zero}};
  };
  auto [loss, stats, coef] =
      loss_fwd<0>(loss_mat, loss_mat, loss_mat, mask, agg, scale, global_denom, global_denom_value,
                  kAggregateNames, identity);
  return {loss, coef};
}

// grad = grad_loss * row_coef[b] * mask where mask != 0, else 0, in `dtype` (loss_mat's).
at::Tensor masked_aggregate_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& mask,
                                    const at::Tensor& row_coef, at::ScalarType dtype) {
  const DeviceOf dev = device_of(mask, "mask");
  check_arg(row_coef, "row_coef", dev, Kind::kFloat32);
  check_arg(grad_loss, "grad_loss", dev, Kind::kFloating);
  const Shape2 s = rows_of(mask);
  check_arg(row_coef, "row_coef", dev, Kind::kFloat32, s.B, "one per row");
  check_arg(grad_loss, "grad_loss", dev, Kind::kFloating, 1, "the 0-dim loss");
  TORCH_CHECK_TYPE(at::isFloatingType(dtype), "dtype: expected a floating dtype, got ",
                   dtype_name(dtype));
  at::Tensor grad = new_output(mask.sizes(), mask.options().dtype(dtype));
  const float g = grad_loss.to(at::kFloat).item<float>();
  const at::Tensor coef_c = row_coef.contiguous();
  const float* coef = coef_c.const_data_ptr<float>();
  const bool f32 = dtype == at::kFloat;
  at::parallel_for(0, s.B * s.nch, 1, [&](int64_t begin, int64_t end) {
    float a[kChunk], m[kChunk];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t row = it / s.nch, t0 = (it % s.nch) * kChunk;
      const int64_t n = std::min(kChunk, s.T - t0), off = row * s.T + t0;
      load_float(mask, off, n, m);
      const VecF w(g * coef[row]), vzero(0.f);
      float* out = f32 ? grad.data_ptr<float>() + off : a;  // float32: written in place
      for (int64_t i = 0; i < n; i += VecF::size()) {
        const int64_t k = std::min<int64_t>(VecF::size(), n - i);
        const VecF vm = VecF::loadu(m + i, k);
        VecF::blendv(vzero, w * vm, vm != vzero).store(out + i, k);
      }
      if (!f32) store_float(grad, off, n, a);
    }
  });
  return grad;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ppo_value_loss_fwd_cpu(
    const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
    const at::Tensor& mask, std::optional<double> clip, const std::string& agg, double scale,
    const std::optional<at::Tensor>& global_denom, std::optional<double> global_denom_value) {
  return loss_fwd<kValueTokenStats>(values, old_values, returns, mask, agg, scale, global_denom,
                                    global_denom_value, kValueNames, value_fn(clip));
}

at::Tensor ppo_value_loss_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& values,
                                  const at::Tensor& old_values, const at::Tensor& returns,
                                  const at::Tensor& mask, const at::Tensor& row_coef,
                                  std::optional<double> clip) {
  return loss_bwd(grad_loss, values, old_values, returns, mask, row_coef, kValueNames,
                  value_fn(clip));
}

// reward_model_loss / dpo_loss: z = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
// per pair (no references: beta * (chosen - rejected)), loss = -log sigmoid(z) = softplus(-z),
// stable for any z (log1p of exp(-|z|) in (0, 1]), and coef = d loss / d z = -sigmoid(-z), / n for
// the mean: all the backward reads. Pairs are few (one per sequence): one serial pass, the sum in
// double (deterministic).
std::tuple<at::Tensor, at::Tensor> pairwise_logsigmoid_loss_fwd_cpu(
    const at::Tensor& chosen, const at::Tensor& rejected,
    const std::optional<at::Tensor>& ref_chosen, const std::optional<at::Tensor>& ref_rejected,
    double beta, const std::string& reduction_name) {
  const DeviceOf dev = device_of(chosen, "chosen");
  check_arg(chosen, "chosen", dev, Kind::kFloating);
  check_arg(rejected, "rejected", dev, Kind::kFloating, chosen.numel(), "like chosen");
  TORCH_CHECK_VALUE(ref_chosen.has_value() == ref_rejected.has_value(),
                    "ref_chosen, ref_rejected: expected both or neither");
  if (ref_chosen) {
    check_arg(*ref_chosen, "ref_chosen", dev, Kind::kFloating, chosen.numel(), "like chosen");
    check_arg(*ref_rejected, "ref_rejected", dev, Kind::kFloating, chosen.numel(), "like chosen");
  }
  const int64_t reduction = mode_index("reduction", reduction_names(), reduction_name);
  const int64_t n = chosen.numel();
  const auto opts = chosen.options().dtype(at::kFloat);
  at::Tensor coef = new_output(chosen.sizes(), opts);
  at::Tensor loss = new_output(reduction == kReduceNone ? chosen.sizes() : at::IntArrayRef{}, opts);
  // float32 views (a no-op for float32 inputs; bf16 / fp16 pairs are few)
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const at::Tensor c = f32(chosen), r = f32(rejected);
  const at::Tensor rc = ref_chosen ? f32(*ref_chosen) : at::Tensor();
  const at::Tensor rr = ref_rejected ? f32(*ref_rejected) : at::Tensor();
  const float* pc = c.const_data_ptr<float>();
  const float* pr = r.const_data_ptr<float>();
  const float* prc = rc.defined() ? rc.const_data_ptr<float>() : nullptr;
  const float* prr = rr.defined() ? rr.const_data_ptr<float>() : nullptr;
  float* out = loss.data_ptr<float>();
  float* g = coef.data_ptr<float>();
  const float b = static_cast<float>(beta);
  const float w = reduction == kReduceMean && n > 0 ? 1.f / static_cast<float>(n) : 1.f;
  // loss = max(-z, 0) + log1p(e), d loss / dz = -sigmoid(-z) = -(z >= 0 ? e : 1) / (1 + e), with
  // e = exp(-|z|): finite for any finite z; NaN z gives NaN (the maximum keeps a NaN).
  using Vec = at::vec::Vectorized<float>;
  const auto margin = [&](int64_t i) {
    return prc ? (pc[i] - prc[i]) - (pr[i] - prr[i]) : pc[i] - pr[i];
  };
  double total = 0.0;  // the sum, from float partial sums of kChunk pairs
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t c1 = std::min(n, c0 + kChunk);
    Vec vsum(0.f);
    int64_t i = c0;
    for (; i + Vec::size() <= c1; i += Vec::size()) {
      Vec m = Vec::loadu(pc + i) - Vec::loadu(pr + i);
      if (prc) m = m - (Vec::loadu(prc + i) - Vec::loadu(prr + i));
      const Vec z = Vec(b) * m, one(1.f);
      const Vec e = (Vec(0.f) - z.abs()).exp();
      const Vec l = at::vec::maximum(Vec(0.f) - z, Vec(0.f)) + e.log1p();
      const Vec sig_neg = Vec::blendv(one, e, z >= Vec(0.f)) / (one + e);
      (Vec(-w) * sig_neg).store(g + i);
      if (reduction == kReduceNone)
        l.store(out + i);
      else
        vsum = vsum + l;
    }
    float part = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, vsum);
    for (; i < c1; ++i) {
      const float z = b * margin(i);
      const float e = std::exp(-std::abs(z));
      const float l = std::max(-z, 0.f) + std::log1p(e);  // NaN z: NaN (std::max keeps its first)
      g[i] = -((z >= 0.f ? e : 1.f) / (1.f + e)) * w;
      if (reduction == kReduceNone)
        out[i] = l;
      else
        part += l;
    }
    total += part;
  }
  if (reduction != kReduceNone)
    *out = static_cast<float>(reduction == kReduceMean && n > 0 ? total / n : total);
  return {loss, coef};
}

// (d loss / d chosen, d loss / d rejected) = (g * coef * beta, -g * coef * beta) in the given
// dtypes (d / d ref_rejected and d / d ref_chosen are the same); grad_loss is 0-dim (mean, sum)
// or shaped like coef (none).
std::tuple<at::Tensor, at::Tensor> pairwise_logsigmoid_loss_bwd_cpu(const at::Tensor& grad_loss,
                                                                    const at::Tensor& coef,
                                                                    double beta,
                                                                    at::ScalarType chosen_dtype,
                                                                    at::ScalarType rejected_dtype) {
  const DeviceOf dev = device_of(coef, "coef");
  check_arg(coef, "coef", dev, Kind::kFloat32);
  const bool per_pair = grad_loss.dim() > 0;
  check_arg(grad_loss, "grad_loss", dev, Kind::kFloating, per_pair ? coef.numel() : 1,
            per_pair ? "one per pair" : "the 0-dim loss");
  TORCH_CHECK_TYPE(at::isFloatingType(chosen_dtype) && at::isFloatingType(rejected_dtype),
                   "chosen_dtype, rejected_dtype: expected floating dtypes, got ",
                   dtype_name(chosen_dtype), ", ", dtype_name(rejected_dtype));
  const int64_t n = coef.numel();
  const at::Tensor cf = coef.contiguous();
  const at::Tensor gl = grad_loss.to(at::kFloat).contiguous();
  const float* pc = cf.const_data_ptr<float>();
  const float* pg = gl.const_data_ptr<float>();
  const float b = static_cast<float>(beta);
  at::Tensor gc = new_output(coef.sizes(), coef.options().dtype(chosen_dtype));
  at::Tensor gr = new_output(coef.sizes(), coef.options().dtype(rejected_dtype));
  std::array<float, kChunk> buf;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {  // float32 straight out, else through buf
    const int64_t len = std::min(kChunk, n - c0);
    float* a = chosen_dtype == at::kFloat ? gc.data_ptr<float>() + c0 : buf.data();
    for (int64_t i = 0; i < len; ++i) a[i] = pg[per_pair ? c0 + i : 0] * pc[c0 + i] * b;
    if (a == buf.data()) store_float(gc, c0, len, a);
    if (rejected_dtype == at::kFloat) {
      float* r = gr.data_ptr<float>() + c0;
      for (int64_t i = 0; i < len; ++i) r[i] = -a[i];
    } else {
      for (int64_t i = 0; i < len; ++i) buf[i] = -a[i];
      store_float(gr, c0, len, buf.data());
    }
  }
  return {gc, gr};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "ppo_policy_loss_fwd(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, "
      "float clip_low, float clip_high, float? dual_clip, float log_ratio_clamp, str agg, float "
      "scale, "
      "Tensor? global_denom, float? global_denom_value) -> (Tensor loss, Tensor stats, Tensor "
      "row_coef)");
  m.def(
      "ppo_policy_loss_bwd(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor "
      "advantages, "
      "Tensor mask, Tensor row_coef, float clip_low, float clip_high, float? dual_clip, "
      "float log_ratio_clamp) -> Tensor");
  m.def(
      "ppo_value_loss_fwd(Tensor values, Tensor old_values, Tensor returns, Tensor mask, float? "
      "clip, "
      "str agg, float scale, Tensor? global_denom, float? global_denom_value) "
      "-> (Tensor loss, Tensor stats, Tensor row_coef)");
  m.def(
      "ppo_value_loss_bwd(Tensor grad_loss, Tensor values, Tensor old_values, Tensor returns, "
      "Tensor mask, Tensor row_coef, float? clip) -> Tensor");
  m.def(
      "masked_aggregate_fwd(Tensor loss_mat, Tensor mask, str agg, float scale, "
      "Tensor? global_denom, float? global_denom_value) -> (Tensor loss, Tensor row_coef)");
  m.def(
      "masked_aggregate_bwd(Tensor grad_loss, Tensor mask, Tensor row_coef, ScalarType dtype) "
      "-> Tensor");
  // reduction: mean, sum or none; returns (loss, coef = d loss / d z per pair)
  m.def(
      "pairwise_logsigmoid_loss_fwd(Tensor chosen, Tensor rejected, Tensor? ref_chosen, "
      "Tensor? ref_rejected, float beta, str reduction) -> (Tensor loss, Tensor coef)");
  m.def(
      "pairwise_logsigmoid_loss_bwd(Tensor grad_loss, Tensor coef, float beta, "
      "ScalarType chosen_dtype, ScalarType rejected_dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("ppo_policy_loss_fwd", &ppo_policy_loss_fwd_cpu);
  m.impl("ppo_policy_loss_bwd", &ppo_policy_loss_bwd_cpu);
  m.impl("ppo_value_loss_fwd", &ppo_value_loss_fwd_cpu);
  m.impl("ppo_value_loss_bwd", &ppo_value_loss_bwd_cpu);
  m.impl("masked_aggregate_fwd", &masked_aggregate_fwd_cpu);
  m.impl("masked_aggregate_bwd", &masked_aggregate_bwd_cpu);
  m.impl("pairwise_logsigmoid_loss_fwd", &pairwise_logsigmoid_loss_fwd_cpu);
  m.impl("pairwise_logsigmoid_loss_bwd", &pairwise_logsigmoid_loss_bwd_cpu);
}

}  // namespace ppo_kernels
