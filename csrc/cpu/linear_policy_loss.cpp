// linear_policy_loss's chunk loop on the CPU in one C++ call, for the calls the Python loop
// (ppo_kernels/linear_policy_loss/op.py, run) spends most of its time around rather than in: the
// types whose per-token loss is ppo's clipped surrogate at token level (ppo, grpo, bnpo, dr_grpo,
// dapo, luspo: policy_math.is_ppo_surrogate), float32 (or bf16 / fp16 with logits_dtype="input":
// input-dtype tiles and GEMMs), whole-vocabulary tiles, not batch-invariant, without caller
// weights, rollout correction, soft-capping or a reference LM head. There the Python loop runs many
// small torch ops per call, slower on small calls than an eager loss on materialised logits
// (bench/results/cpu_linear_policy_loss_small.md). Here each row chunk is a BLAS matmul for the
// logits tile, then each row reduced while it is in cache (cpu_rows.h): its statistics with every
// exp(z - m_block) kept, its token's loss and KL terms (loss_math.h's policy_token, kl_stats.h's
// estimators: the loss and KL kernels' math), and its gradient from the kept exps -- one exp per
// logit, where the token_logprobs kernels' two passes take two -- then the two gradient matmuls.
// The same three GEMMs, the same statistics as the Python loop's kernel route (op.py _Loss with
// `ppo`), which the tests compare it with (the gradient tiles agree to float32 rounding).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/alloc.h"
#include "common/cpu_rows.h"
#include "common/kl_stats.h"
#include "common/loss_math.h"
#include "common/modes.h"
#include "common/tensor_checks.h"
#include "common/token_logprobs_host.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using std::optional;

// The other raw kernels this loop calls (csrc/cpu/linear_logprobs.cpp, csrc/cpu/losses.cpp).
using AccumulateSig = void(Tensor, const Tensor&);
using AggSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const std::string&, double,
                                          const optional<Tensor>&, optional<double>);
using PolicySig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                     const Tensor&, double, double,
                                                     optional<double>, double, const std::string&,
                                                     double, const optional<Tensor>&,
                                                     optional<double>);

template <class Sig>
c10::TypedOperatorHandle<Sig> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The statistics the loop computes: its own six (pg_loss, entropy_loss, entropy_mean,
// masked_fraction, kl_loss, kl_mean), then ppo_policy_loss_fwd's (verl's four, TRL's five);
// `stat_order` picks the call's from them (csrc/ops/linear_policy_loss.cpp names them).
constexpr int64_t kOwnStats = 6;
constexpr int64_t kPolicyStats = kPolicyTokenStats + 3;
constexpr int64_t kLoopStats = kOwnStats + kPolicyStats;

// Rows per chunk: linear_logprobs' planner (ppo_kernels/fused_linear/planner.py, plan_chunks
// with "rows" tiles, fused whole-vocabulary tiles) on the CPU -- as many rows of whole-vocabulary
// tiles plus their per-row buffers as fit in the budget (default 64 MiB); below 16 rows (or N),
// up to 16 rows that would fit with 64-entry tiles (linear_policy_loss keeps whole-vocabulary
// tiles). float32: 4-byte tiles and a float32 grad_hidden row. bf16 / fp16 input tiles
// (_plan_input_tiles): the input-dtype tile, a [sub, H] input-dtype block of the weight-gradient
// product beside its float32 copy, and per row the float32 grad_hidden accumulator, the
// input-dtype product and its copy -- this loop writes grad_hidden straight from the matmul (the
// same bits: one product per row) but keeps the planner's rows. Checked against the planner by
// tests/test_linear_policy_loss.py (the GEMMs per call).
constexpr int64_t kDefaultCpuChunkBytes = int64_t{64} << 20;
constexpr int64_t kMinRows = 16;

struct RowPlan {
  int64_t rows, sub;  // rows per chunk; vocabulary rows per weight-gradient product block
};

RowPlan plan_rows(int64_t N, int64_t V, int64_t H, int64_t isz, int64_t max_chunk_bytes) {
  const int64_t budget = max_chunk_bytes > 0 ? max_chunk_bytes : kDefaultCpuChunkBytes;
  const bool input = isz != 4;
  const int64_t sub = input ? std::max<int64_t>(1, std::min(V, (budget / 4) / ((isz + 4) * H))) : V;
  const int64_t avail = input ? std::max<int64_t>(budget - sub * (isz + 4) * H, 0) : budget;
  const int64_t row_fixed = input ? (8 + isz) * H : 4 * H;
  const int64_t rows = avail / (isz * V + row_fixed);
  if (rows >= std::min(N, kMinRows)) return {std::max<int64_t>(1, std::min(N, rows)), sub};
  const int64_t chunked = input ? isz + 4 : 4;
  const int64_t fit = avail / (row_fixed + chunked * std::min<int64_t>(V, 64));
  return {std::max<int64_t>(1, std::min({N, kMinRows, fit})), sub};
}

// Value and d(value)/d(lp - ref) of the sampled KL estimator `est` (kl_stats.h, as kl_penalty).
KLValueGrad<float> kl_token(int64_t est, float d, const KLClampSpec& c, bool straight_through) {
  switch (est) {
    case kK1:
      return kl_estimate<kK1>(d, 1.f, c, straight_through);
    case kAbs:
      return kl_estimate<kAbs>(d, 1.f, c, straight_through);
    case kK2:
      return kl_estimate<kK2>(d, 1.f, c, straight_through);
    default:
      return kl_estimate<kK3>(d, std::exp(k3_exp_arg(d, c)), c, straight_through);
  }
}

void check_per_token(const Tensor& t, const char* name, const DeviceOf& dev, const Tensor& labels,
                     Kind kind) {
  check_arg(t, name, dev, kind);
  TORCH_CHECK_VALUE(t.sizes() == labels.sizes(), name, ": expected shape ",
                    shape_str(labels.sizes()), " (like labels), got ", shape_str(t.sizes()));
}

// -> (loss [], stats [len(stat_order)], token_stats [3, B, T] (log-probs, entropy, KL),
// grad_hidden [N, H], grad_weight [V, H], grad_bias [V]; each gradient empty when not asked for).
// hidden [N, H] and weight [V, H] (and bias [V]) float32, or all bf16 / fp16 (input-dtype tiles;
// grad_hidden then in that dtype, grad_weight / grad_bias float32 sums); the per-token tensors [B,
// T] with B * T = N, advantages [B, T] or [B]; max_chunk_bytes: the chunk budget (0: the default);
// stats[j] is the loop's statistic stat_order[j] (see kLoopStats).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> linear_policy_loss_ppo_cpu(
    const Tensor& hidden, const Tensor& weight, const optional<Tensor>& bias,
    const Tensor& labels_in, const Tensor& advantages, const Tensor& old_logprobs,
    const Tensor& mask, const optional<Tensor>& ref_logprobs, const optional<Tensor>& global_denom,
    optional<double> global_denom_value, double clip_low, double clip_high,
    optional<double> dual_clip, double log_ratio_clamp, const std::string& agg, double scale,
    double kl_coef, const std::string& kl_estimator, bool kl_straight_through, double kl_in_lo,
    double kl_in_hi, double kl_out_lo, double kl_out_hi, double entropy_coef,
    double inv_temperature, int64_t ignore_index, int64_t max_chunk_bytes,
    at::IntArrayRef stat_order, bool need_hidden, bool need_weight, bool need_bias) {
  const DeviceOf dev = device_of(hidden, "hidden");
  const at::ScalarType dt = hidden.scalar_type();
  // every tensor on hidden's device first, then that device is the CPU (this kernel's)
  check_arg(weight, "weight", dev);
  if (bias) check_arg(*bias, "bias", dev);
  check_arg(labels_in, "labels", dev, Kind::kIndex);
  check_arg(advantages, "advantages", dev, Kind::kFloating);
  check_arg(old_logprobs, "old_logprobs", dev, Kind::kFloating);
  check_arg(mask, "mask", dev);
  if (ref_logprobs) check_arg(*ref_logprobs, "ref_logprobs", dev, Kind::kFloating);
  if (global_denom) check_arg(*global_denom, "global_denom", dev);
  TORCH_CHECK_VALUE(dev.device.is_cpu(), "hidden: expected a CPU tensor, got device ", dev.device);
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                   "hidden: expected dtype float32, bfloat16 or float16, got ", dtype_name(dt));
  TORCH_CHECK_VALUE(hidden.dim() == 2, "hidden: expected shape (N, H), got ",
                    shape_str(hidden.sizes()));
  const int64_t N = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK_TYPE(weight.scalar_type() == dt, "weight: expected dtype ", dtype_name(dt),
                   " (hidden's), got ", dtype_name(weight.scalar_type()));
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == H, "weight: expected shape (V, ", H,
                    "), got ", shape_str(weight.sizes()));
  const int64_t V = weight.size(0);
  if (bias) {
    check_arg(*bias, "bias", dev, Kind::kAny, V, "weight.shape[0]");
    TORCH_CHECK_TYPE(bias->scalar_type() == dt, "bias: expected dtype ", dtype_name(dt),
                     " (hidden's), got ", dtype_name(bias->scalar_type()));
  }
  TORCH_CHECK_VALUE(labels_in.dim() == 2 && labels_in.numel() == N,
                    "labels: expected shape (B, T) with B * T = ", N, " (hidden.shape[0]), got ",
                    shape_str(labels_in.sizes()));
  TORCH_CHECK_VALUE(N > 0 && V > 0,
                    "hidden / weight: expected at least one token and one vocabulary entry (the "
                    "Python loop takes empty calls)");
  const int64_t B = labels_in.size(0), T = labels_in.size(1);
  check_per_token(old_logprobs, "old_logprobs", dev, labels_in, Kind::kFloating);
  check_per_token(mask, "mask", dev, labels_in, Kind::kAny);
  if (ref_logprobs) check_per_token(*ref_logprobs, "ref_logprobs", dev, labels_in, Kind::kFloating);
  TORCH_CHECK_VALUE(
      advantages.sizes() == labels_in.sizes() || (advantages.dim() == 1 && advantages.size(0) == B),
      "advantages: expected shape ", shape_str(labels_in.sizes()), " or (", B, ",), got ",
      shape_str(advantages.sizes()));
  TORCH_CHECK(max_chunk_bytes >= 0, "max_chunk_bytes: expected a non-negative integer, got ",
              max_chunk_bytes);
  for (const int64_t j : stat_order) {
    TORCH_CHECK(j >= 0 && j < kLoopStats, "stat_order: expected entries in [0, ", kLoopStats,
                "), got ", j);
  }
  const bool has_ref = ref_logprobs.has_value();
  const int64_t est =
      has_ref ? mode_index("kl_estimator", kl_estimator_names(), kl_estimator) : int64_t{kK1};
  // (int64: the row loop reads them without a dispatch on the index type)
  const Tensor labels = labels_in.to(at::kLong).contiguous().view({N});
  check_labels_on_host(labels, V, ignore_index);  // all of them first: positions in the batch

  const auto f32 = hidden.options().dtype(at::kFloat);
  const Tensor m = mask.to(at::kFloat).contiguous();
  const Tensor old = old_logprobs.to(at::kFloat).contiguous();
  const Tensor adv = (advantages.dim() == 1 ? advantages.unsqueeze(-1).expand({B, T}) : advantages)
                         .to(at::kFloat)
                         .contiguous();
  const Tensor ref = has_ref ? ref_logprobs->to(at::kFloat).contiguous() : Tensor();

  // the aggregation's row coefficients c_b (they depend on the mask only)
  static const auto aggregate = kernel<AggSig>("ppo_kernels_C::masked_aggregate_fwd");
  const Tensor coef =
      std::get<1>(aggregate.call(m, m, agg, scale, global_denom, global_denom_value));

  const bool input_tiles = dt != at::kFloat;
  Tensor token_stats = new_output({3, B, T}, f32);
  Tensor grad_h =
      new_output(need_hidden ? at::IntArrayRef{N, H} : at::IntArrayRef{0}, hidden.options());
  Tensor grad_w = need_weight ? at::zeros({V, H}, f32) : at::empty({0}, f32);
  const bool with_b = need_bias && bias.has_value();
  Tensor grad_b = with_b ? at::zeros({V}, f32) : at::empty({0}, f32);
  const bool any_grad = need_hidden || need_weight || with_b;

  const RowPlan plan = plan_rows(N, V, H, hidden.element_size(), max_chunk_bytes);
  const int64_t R = plan.rows;
  Tensor tile = at::empty({R, V}, hidden.options());
  // input tiles: a [sub, H] block of the weight-gradient product, added into the float32 sums
  Tensor gw_in = input_tiles && need_weight ? at::empty({plan.sub, H}, hidden.options()) : Tensor();
  const Tensor wt = weight.t();

  const int64_t* plab = labels.const_data_ptr<int64_t>();
  const float* pm = m.const_data_ptr<float>();
  const float* po = old.const_data_ptr<float>();
  const float* pa = adv.const_data_ptr<float>();
  const float* pr = has_ref ? ref.const_data_ptr<float>() : nullptr;
  const float* pc = coef.const_data_ptr<float>();
  float* out_lp = token_stats.data_ptr<float>();
  float* out_ent = out_lp + N;
  float* out_kl = out_lp + 2 * N;
  const float lo = static_cast<float>(1.0 - clip_low), hi = static_cast<float>(1.0 + clip_high);
  const float dc = static_cast<float>(dual_clip.value_or(0.0));
  const float lrc = static_cast<float>(log_ratio_clamp);
  const float klc = static_cast<float>(kl_coef), nec = static_cast<float>(-entropy_coef);
  const float inv_t = static_cast<float>(inv_temperature);
  const KLClampSpec spec{static_cast<float>(kl_in_lo), static_cast<float>(kl_in_hi),
                         static_cast<float>(kl_out_lo), static_cast<float>(kl_out_hi)};
  const int64_t n_blocks = (V + cpu::kBlock - 1) / cpu::kBlock;

  // One row (token t) of a chunk's tile, in cache from its statistics to its gradient: log-prob,
  // entropy and KL into token_stats; dL/dlogprob = c_b m (policy + kl_coef KL') and dL/dentropy =
  // -entropy_coef c_b m (op.py _Loss.ppo_policy and kl_and_entropy) turned into the row's
  // gradient, written over the row. keep / mb: the row's kept exps (V floats, ceil(V / kBlock)
  // block maxima), per thread.
  const auto reduce_row = [&](auto* row, int64_t t, float* keep, float* mb) {
    using scalar_t = std::remove_pointer_t<decltype(row)>;
    const int64_t label = plab[t];
    const bool ignored = label == ignore_index;  // log-prob and entropy 0, no gradient
    // (the exps are kept only for a gradient; without one keep is a block buffer)
    const cpu::RowResult rr =
        ignored    ? cpu::RowResult{0.f, 0.f, 0.f, false, {}}
        : any_grad ? cpu::row_logprob<true>(row, V, label, inv_temperature, keep, mb)
                   : cpu::row_logprob<false>(row, V, label, inv_temperature, keep, nullptr);
    const float x = rr.lp, mi = pm[t];
    out_lp[t] = x;
    out_ent[t] = rr.ent;
    out_kl[t] = 0.f;
    float g = 0.f, ge = 0.f;
    if (mi != 0.f) {  // tokens off the mask contribute nothing
      const float k = pc[t / T] * mi;
      g = k * policy_token(x, po[t], pa[t], lo, hi, dc, lrc).grad;
      if (has_ref) {
        const KLValueGrad<float> kl = kl_token(est, x - pr[t], spec, kl_straight_through);
        out_kl[t] = kl.value;
        if (klc != 0.f) g += klc * (k * kl.grad);
      }
      ge = entropy_coef != 0 ? nec * k : 0.f;
    }
    if (!any_grad) return;
    if (ignored || (rr.fast && g == 0.f && ge == 0.f)) {  // (0 without reading the row)
      std::fill(row, row + V, scalar_t(0));
    } else if (rr.fast) {
      const float l = rr.lse;
      // weight of onehot - p, of -p * (log p + H); log p + H = z - lse + H
      cpu::grad_row_kept(row, row, V, label, inv_t, l, g * inv_t, ge * inv_t,
                         ge != 0.f ? rr.ent - l : -l, keep, mb);
    } else {  // scaled logits overflow float32 (cpu_rows.h, RowStats64)
      cpu::grad_row64(row, row, V, label, inv_temperature, rr.s64,
                      static_cast<double>(g) * inv_temperature,
                      static_cast<double>(ge) * inv_temperature);
    }
  };

  double ent_k = 0, ent_m = 0, kl_k = 0, kl_m = 0, total = 0;  // (in token order)
  static const auto accumulate = kernel<AccumulateSig>("ppo_kernels_C::accumulate_");
  for (int64_t r0 = 0; r0 < N; r0 += R) {
    const int64_t n = std::min(R, N - r0);
    const Tensor hc = hidden.narrow(0, r0, n);
    Tensor z = tile.narrow(0, 0, n);
    if (input_tiles) {  // matmul, then + bias, each rounded to the input dtype (Tiler._linear)
      at::mm_out(z, hc, wt);
      if (bias) z.add_(*bias);
    } else if (bias) {
      at::addmm_out(z, *bias, hc, wt);
    } else {
      at::mm_out(z, hc, wt);
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "linear_policy_loss_rows", [&] {
      scalar_t* zp = z.data_ptr<scalar_t>();
      const int64_t grain = std::max<int64_t>(1, 16384 / V);
      at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> keep(V), mb(n_blocks);
        for (int64_t i = begin; i < end; ++i)
          reduce_row(zp + i * V, r0 + i, keep.data(), mb.data());
      });
    });
    // the entropy / KL sums, aggregated like the policy term (k = c_b m) and masked
    for (int64_t t = r0; t < r0 + n; ++t) {
      const float mi = pm[t];
      total += mi;
      if (mi == 0.f) continue;
      const float k = pc[t / T] * mi;
      ent_k += static_cast<double>(k) * out_ent[t];
      ent_m += static_cast<double>(mi) * out_ent[t];
      kl_k += static_cast<double>(k) * out_kl[t];
      kl_m += static_cast<double>(mi) * out_kl[t];
    }
    if (!any_grad) continue;
    if (need_hidden) {  // (input tiles: one product per row, rounded once as the Python loop's)
      Tensor gh = grad_h.narrow(0, r0, n);
      at::mm_out(gh, z, weight);
    }
    if (need_weight) {
      if (input_tiles) {  // block by block: the input-dtype product added into the float32 sums
        for (int64_t s0 = 0; s0 < V; s0 += plan.sub) {
          const int64_t s1 = std::min(V, s0 + plan.sub);
          Tensor gw = gw_in.narrow(0, 0, s1 - s0);
          at::mm_out(gw, z.narrow(1, s0, s1 - s0).t(), hc);
          Tensor acc = grad_w.narrow(0, s0, s1 - s0);
          accumulate.call(acc, gw);
        }
      } else {
        grad_w.addmm_(z.t(), hc);
      }
    }
    if (with_b) grad_b.add_(input_tiles ? z.sum(0, false, at::kFloat) : z.sum(0));
  }

  // the policy term and its statistics (verl's, TRL's) by the loss kernel on every log-prob
  static const auto policy = kernel<PolicySig>("ppo_kernels_C::ppo_policy_loss_fwd");
  const Tensor lp_all = token_stats.select(0, 0);
  const auto [pg, pstats, pcoef] =
      policy.call(lp_all, old, adv, m, clip_low, clip_high, dual_clip, log_ratio_clamp, agg, scale,
                  global_denom, global_denom_value);
  TORCH_CHECK(pstats.numel() == kPolicyStats, "ppo_policy_loss_fwd: expected ", kPolicyStats,
              " statistics, got ", pstats.numel());
  const double pgv = pg.item<double>();
  double loss = pgv - entropy_coef * ent_k;
  if (has_ref) loss += kl_coef * kl_k;
  float all[kLoopStats];
  all[0] = static_cast<float>(pgv);
  all[1] = static_cast<float>(ent_k);
  all[2] = total != 0 ? static_cast<float>(ent_m / total) : 0.f;
  all[3] = 0.f * all[1];  // masked_fraction: nothing is rejected here (NaN like the entropy's sum)
  all[4] = static_cast<float>(kl_k);
  all[5] = total != 0 ? static_cast<float>(kl_m / total) : 0.f;
  std::copy_n(pstats.const_data_ptr<float>(), kPolicyStats, all + kOwnStats);
  Tensor stats = new_output({static_cast<int64_t>(stat_order.size())}, f32);
  float* st = stats.data_ptr<float>();
  for (size_t j = 0; j < stat_order.size(); ++j) st[j] = all[stat_order[j]];
  return {at::scalar_tensor(loss, f32), stats, token_stats, grad_h, grad_w, grad_b};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "linear_policy_loss_ppo(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
      "Tensor advantages, Tensor old_logprobs, Tensor mask, Tensor? ref_logprobs, "
      "Tensor? global_denom, float? global_denom_value, float clip_low, float clip_high, "
      "float? dual_clip, float log_ratio_clamp, str agg, float scale, float kl_coef, "
      "str kl_estimator, bool kl_straight_through, float kl_in_lo, float kl_in_hi, "
      "float kl_out_lo, float kl_out_hi, float entropy_coef, float inv_temperature, "
      "int ignore_index, int max_chunk_bytes, int[] stat_order, "
      "bool need_hidden, bool need_weight, bool need_bias) -> (Tensor loss, Tensor stats, "
      "Tensor token_stats, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("linear_policy_loss_ppo", &linear_policy_loss_ppo_cpu);
}

}  // namespace ppo_kernels
