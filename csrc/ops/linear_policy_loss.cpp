// Registered ops `ppo_kernels::linear_policy_loss` and `ppo_kernels::linear_policy_loss_grads`:
// the policy loss (every loss type, KL to a reference, entropy bonus, rollout correction) from the
// hidden states and the LM head in one chunked pass, with its gradients formed on the way.
// Schemas, argument checks naming the argument, backend routing and autograd live here; the chunk
// loop (logits tile -> row statistics -> per-token dL/dlogprob and dL/dentropy -> gradient tile ->
// grad_hidden rows and the weight-gradient sum) is ppo_kernels/linear_policy_loss/op.py, which
// registers it per backend (`ppo_kernels_cpp::` around the compiled token_logprobs kernels,
// `ppo_kernels_triton::`, `ppo_kernels_eager::`), with the fake kernels; its cpp route hands the
// float32 CPU calls of the ppo-surrogate types to one C++ loop (csrc/cpu/linear_policy_loss.cpp).
//
// linear_policy_loss_grads computes the loss, the statistics and the gradients of hidden / weight
// / bias that are asked for (the need_* flags: a frozen LM head costs no weight-gradient GEMM);
// linear_policy_loss is its value. Autograd: the Autograd-key kernel calls linear_policy_loss_grads
// below autograd with need_* from requires_grad and saves the gradients; the backward scales them
// by the upstream gradient (no GEMM). The argument list is long and only forwarded, so the kernels
// are boxed: they read the arguments they check by name from the schema.
//
// linear_policy_loss_sampler (+ _grads): the same loss under the rollout sampler's distribution
// (a temperature tensor, top-k, top-p, min-p, vLLM's / SGLang's rules): the same arguments, then
// the sampler's. Its own ops, so that the plain call's path (and its per-call cost) stays as it
// was. Every backend runs the Python chunk loop with whole-vocabulary tiles reduced by the
// sampler kernels of token_logprobs (op.py: engine.SamplerVocab); labels outside the kept set are
// masked out of the loss by default (a first pass finds them) and counted.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/alloc.h"
#include "common/modes.h"
#include "ops/checks.h"
#include "ops/fused_loss.h"
#include "ops/route.h"
#include "ops/sampler_checks.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using fused_loss::arguments;
using fused_loss::opt_tensor;
using torch::jit::Stack;

// Everything linear_policy_loss takes, in order (see ppo_kernels/linear_policy_loss/api.py for
// the meaning of each; the per-token tensors are [B, T], hidden [B * T, H]).
#define PPO_LPL_ARGS                                                                             \
  "Tensor hidden, Tensor weight, Tensor labels, Tensor advantages, Tensor old_logprobs, "        \
  "Tensor mask, Tensor? bias, Tensor? ref_logprobs, Tensor? weights, Tensor? global_denom, "     \
  "Tensor? ref_hidden, Tensor? ref_weight, Tensor? ref_bias, "                                   \
  "str loss_type, float clip_low, float clip_high, float? dual_clip, float? delta, "             \
  "float log_ratio_clamp, str importance_sampling_level, float tau_pos, float tau_neg, "         \
  "float? dro_beta, float clip_cov_ratio, float clip_cov_lb, float clip_cov_ub, "                \
  "float kl_cov_ratio, float kl_cov_coef, str agg, float scale, float? global_denom_value, "     \
  "float kl_coef, str kl_estimator, bool kl_straight_through, float kl_in_lo, float kl_in_hi, "  \
  "float kl_out_lo, float kl_out_hi, float entropy_coef, float z_loss, float temperature, "      \
  "float? softcap, "                                                                             \
  "int ignore_index, int max_chunk_bytes, str logits_dtype, bool bypass_mode, str? rollout_is, " \
  "str? rollout_is_threshold, bool rollout_is_batch_normalize, str? rollout_rs, "                \
  "str? rollout_rs_threshold, Generator? generator"

// The sampler's arguments after them (linear_policy_loss_sampler).
#define PPO_LPL_SAMPLER_ARGS                                                         \
  ", Tensor? temperatures, int top_k, Tensor? top_ks, float top_p, Tensor? top_ps, " \
  "float min_p, Tensor? min_ps, str sampler, bool mask_outside"

constexpr int64_t kOutputs = 3;         // loss [], stats [K], token_stats [3, B, T]
constexpr int64_t kSamplerOutputs = 4;  // + outside [B, T] (bool)

c10::OperatorHandle find(const char* name) {
  return fused_loss::find_op(name, "ppo_kernels/linear_policy_loss/op.py");
}

const c10::OperatorHandle& grads_op() {
  static const c10::OperatorHandle h = find("ppo_kernels::linear_policy_loss_grads");
  return h;
}

// The Python implementations of linear_policy_loss_grads per backend (op.py): the chunk loop
// around the compiled token_logprobs kernels (cpp), the Triton ones, or the eager tile math.
const c10::OperatorHandle& impl(Backend b) {
  switch (b) {
    case Backend::kCpp: {
      static const c10::OperatorHandle h = find("ppo_kernels_cpp::linear_policy_loss_grads");
      return h;
    }
    case Backend::kTriton: {
      static const c10::OperatorHandle h = find("ppo_kernels_triton::linear_policy_loss_grads");
      return h;
    }
    default: {
      static const c10::OperatorHandle h = find("ppo_kernels_eager::linear_policy_loss_grads");
      return h;
    }
  }
}

struct Args {
  size_t n, hidden, weight, labels, advantages, old_logprobs, mask, bias, ref_logprobs, weights,
      global_denom, ref_hidden, ref_weight, ref_bias, agg, kl_estimator, kl_in_lo, kl_in_hi,
      kl_out_lo, kl_out_hi, kl_coef, entropy_coef, z_loss, temperature, softcap, max_chunk_bytes,
      logits_dtype, clip_low, clip_high, log_ratio_clamp, scale, loss_type, dual_clip, delta,
      importance_sampling_level, global_denom_value, kl_straight_through, ignore_index, bypass_mode;
};

// Argument positions, read once from linear_policy_loss's schema by name (linear_policy_loss_grads
// takes the same arguments, then need_hidden, need_weight, need_bias).
const Args& args_of() {
  static const Args a = [] {
    const auto& s = find("ppo_kernels::linear_policy_loss").schema();
    auto at = [&](const char* name) {
      const auto i = s.argumentIndexWithName(name);
      TORCH_CHECK(i.has_value(), "linear_policy_loss: no argument ", name, " in the schema");
      return static_cast<size_t>(*i);
    };
    return Args{.n = s.arguments().size(),
                .hidden = at("hidden"),
                .weight = at("weight"),
                .labels = at("labels"),
                .advantages = at("advantages"),
                .old_logprobs = at("old_logprobs"),
                .mask = at("mask"),
                .bias = at("bias"),
                .ref_logprobs = at("ref_logprobs"),
                .weights = at("weights"),
                .global_denom = at("global_denom"),
                .ref_hidden = at("ref_hidden"),
                .ref_weight = at("ref_weight"),
                .ref_bias = at("ref_bias"),
                .agg = at("agg"),
                .kl_estimator = at("kl_estimator"),
                .kl_in_lo = at("kl_in_lo"),
                .kl_in_hi = at("kl_in_hi"),
                .kl_out_lo = at("kl_out_lo"),
                .kl_out_hi = at("kl_out_hi"),
                .kl_coef = at("kl_coef"),
                .entropy_coef = at("entropy_coef"),
                .z_loss = at("z_loss"),
                .temperature = at("temperature"),
                .softcap = at("softcap"),
                .max_chunk_bytes = at("max_chunk_bytes"),
                .logits_dtype = at("logits_dtype"),
                .clip_low = at("clip_low"),
                .clip_high = at("clip_high"),
                .log_ratio_clamp = at("log_ratio_clamp"),
                .scale = at("scale"),
                .loss_type = at("loss_type"),
                .dual_clip = at("dual_clip"),
                .delta = at("delta"),
                .importance_sampling_level = at("importance_sampling_level"),
                .global_denom_value = at("global_denom_value"),
                .kl_straight_through = at("kl_straight_through"),
                .ignore_index = at("ignore_index"),
                .bypass_mode = at("bypass_mode")};
  }();
  return a;
}

// Metadata checks of every argument the kernels index by (never a host sync): hidden [N, H],
// weight [V, H], bias [V], labels / old_logprobs / mask / ref_logprobs / weights [B, T] with
// B * T = N, advantages [B, T] or [B].
void check(const Stack& a, const Args& i) {
  const Tensor hidden = a[i.hidden].toTensor();
  expect_float(hidden, "hidden");
  expect_dim(hidden, "hidden", 2);
  const Tensor weight = a[i.weight].toTensor();
  expect_float(weight, "weight");
  expect_device(weight, "weight", hidden, "hidden");
  expect_dtype(weight, "weight", hidden.scalar_type(), "like hidden");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    "weight: expected shape (V, ", hidden.size(1), ") (H = hidden.shape[-1]), got ",
                    shape_str(weight.sizes()));
  const int64_t V = weight.size(0);
  if (auto bias = opt_tensor(a[i.bias])) {
    expect_float(*bias, "bias");
    expect_device(*bias, "bias", hidden, "hidden");
    expect_dtype(*bias, "bias", hidden.scalar_type(), "like hidden");
    expect_shape(*bias, "bias", {V}, "weight.shape[0]");
  }
  const Tensor labels = a[i.labels].toTensor();
  expect_index(labels, "labels");
  expect_device(labels, "labels", hidden, "hidden");
  expect_dim(labels, "labels", 2);
  TORCH_CHECK_VALUE(labels.numel() == hidden.size(0), "labels: expected ", hidden.size(0),
                    " tokens (hidden.shape[0] = B * T), got shape ", shape_str(labels.sizes()));
  TORCH_CHECK_VALUE(V > 0 || labels.numel() == 0,
                    "weight: the vocabulary dimension (first) is empty");
  const auto bt = labels.sizes();
  const Tensor old = a[i.old_logprobs].toTensor();
  expect_float(old, "old_logprobs");
  expect_device(old, "old_logprobs", hidden, "hidden");
  expect_shape(old, "old_logprobs", bt, "like labels");
  const Tensor adv = a[i.advantages].toTensor();
  expect_float(adv, "advantages");
  expect_device(adv, "advantages", hidden, "hidden");
  TORCH_CHECK_VALUE(adv.sizes() == bt || adv.sizes() == bt.slice(0, 1),
                    "advantages: expected shape ", shape_str(bt), " (per token) or ",
                    shape_str(bt.slice(0, 1)), " (per sequence), got ", shape_str(adv.sizes()));
  const Tensor mask = a[i.mask].toTensor();
  expect_mask(mask, "mask");
  expect_device(mask, "mask", hidden, "hidden");
  expect_shape(mask, "mask", bt, "like labels");
  for (auto [k, name] : {std::pair{i.ref_logprobs, "ref_logprobs"}, {i.weights, "weights"}}) {
    if (auto t = opt_tensor(a[k])) {
      expect_float(*t, name);
      expect_device(*t, name, hidden, "hidden");
      expect_shape(*t, name, bt, "like labels");
    }
  }
  // the exact KL against a reference LM head: its hidden states [N, H_ref] and head [V, H_ref]
  const auto ref_h = opt_tensor(a[i.ref_hidden]), ref_w = opt_tensor(a[i.ref_weight]);
  TORCH_CHECK_VALUE(ref_h.has_value() == ref_w.has_value(), ref_h ? "ref_weight" : "ref_hidden",
                    ": ref_hidden and ref_weight go together (the reference LM head)");
  if (ref_h) {
    TORCH_CHECK_VALUE(a[i.ref_logprobs].isNone(),
                      "ref_logprobs: give either ref_logprobs (sampled KL estimators) or "
                      "ref_hidden / ref_weight (the exact KL), not both");
    expect_float(*ref_h, "ref_hidden");
    expect_device(*ref_h, "ref_hidden", hidden, "hidden");
    expect_dim(*ref_h, "ref_hidden", 2);
    TORCH_CHECK_VALUE(ref_h->size(0) == hidden.size(0), "ref_hidden: expected ", hidden.size(0),
                      " rows (like hidden), got shape ", shape_str(ref_h->sizes()));
    expect_dtype(*ref_w, "ref_weight", ref_h->scalar_type(), "like ref_hidden");
    expect_device(*ref_w, "ref_weight", hidden, "hidden");
    TORCH_CHECK_VALUE(ref_w->dim() == 2 && ref_w->size(0) == V && ref_w->size(1) == ref_h->size(1),
                      "ref_weight: expected shape (", V, ", ", ref_h->size(1),
                      ") (weight's vocabulary, ref_hidden's width), got ",
                      shape_str(ref_w->sizes()));
    if (auto rb = opt_tensor(a[i.ref_bias])) {
      expect_dtype(*rb, "ref_bias", ref_h->scalar_type(), "like ref_hidden");
      expect_device(*rb, "ref_bias", hidden, "hidden");
      expect_shape(*rb, "ref_bias", {V}, "weight.shape[0]");
    }
  } else {
    TORCH_CHECK_VALUE(a[i.ref_bias].isNone(), "ref_bias: needs ref_hidden and ref_weight");
  }
  if (auto gd = opt_tensor(a[i.global_denom])) {
    expect_mask(*gd, "global_denom");
    expect_device(*gd, "global_denom", hidden, "hidden");
    TORCH_CHECK_VALUE(gd->numel() == 1, "global_denom: expected a single value, got shape ",
                      shape_str(gd->sizes()));
  }
  mode_index("agg", agg_names(), a[i.agg].toStringRef());
  mode_index("kl_estimator", kl_estimator_names(), a[i.kl_estimator].toStringRef());
  expect_bounds("kl clamp log_ratio", a[i.kl_in_lo].toDouble(), a[i.kl_in_hi].toDouble());
  expect_bounds("kl clamp value", a[i.kl_out_lo].toDouble(), a[i.kl_out_hi].toDouble());
  expect_finite("kl_coef", a[i.kl_coef].toDouble());
  expect_finite("entropy_coef", a[i.entropy_coef].toDouble());
  const double z_loss = a[i.z_loss].toDouble();
  TORCH_CHECK_VALUE(z_loss >= 0 && std::isfinite(z_loss),
                    "z_loss: expected a finite coefficient >= 0 (0: no term), got ", z_loss);
  expect_finite("clip_low", a[i.clip_low].toDouble());
  expect_finite("clip_high", a[i.clip_high].toDouble());
  expect_finite("scale", a[i.scale].toDouble());
  const double lrc = a[i.log_ratio_clamp].toDouble();
  TORCH_CHECK_VALUE(lrc > 0, "log_ratio_clamp: expected a positive number (inf: none), got ", lrc);
  expect_positive("temperature", a[i.temperature].toDouble());
  if (!a[i.softcap].isNone()) expect_positive("softcap", a[i.softcap].toDouble());
  TORCH_CHECK_VALUE(a[i.max_chunk_bytes].toInt() >= 0,
                    "max_chunk_bytes: expected a non-negative integer (0: the default), got ",
                    a[i.max_chunk_bytes].toInt());
  const auto& ld = a[i.logits_dtype].toStringRef();
  TORCH_CHECK_VALUE(ld == "float32" || ld == "input",
                    "logits_dtype: expected 'float32' or 'input', got '", ld, "'");
}

// ---- the C++ loop (csrc/cpu/linear_policy_loss.cpp) ----
// The cpp backend's calls it runs: on the CPU, float32 or bf16 / fp16 with logits_dtype="input",
// at least one token, a clipped type at token level without delta (policy_math.is_ppo_surrogate),
// no caller weights, bypass-mode rollout correction, soft-cap, reference head or z-loss, not
// batch-invariant, the compiled kernels (not a test's emulated ones). The rest takes the Python
// chunk loop (op.py run, `ppo_kernels_cpp::`): the same computation around the token_logprobs
// kernels (two passes over each tile) at a higher cost per call
// (bench/results/cpu_linear_policy_loss_cpp_loop.md).
bool cpp_loop(const Stack& a, const Args& i) {
  const Tensor hidden = a[i.hidden].toTensor();
  const at::ScalarType dt = hidden.scalar_type();
  const bool input_tiles =
      (dt == at::kBFloat16 || dt == at::kHalf) && a[i.logits_dtype].toStringRef() == "input";
  if (!hidden.device().is_cpu() || (dt != at::kFloat && !input_tiles) || hidden.size(0) == 0 ||
      a[i.weight].toTensor().size(0) == 0)
    return false;
  if (!a[i.weights].isNone() || !a[i.ref_hidden].isNone() || !a[i.softcap].isNone() ||
      !a[i.delta].isNone() || a[i.bypass_mode].toBool() || a[i.z_loss].toDouble() != 0 ||
      a[i.importance_sampling_level].toStringRef() != "token")
    return false;
  const auto& types = clip_loss_type_names();
  if (std::find(types.begin(), types.end(), a[i.loss_type].toStringRef()) == types.end())
    return false;
  return !batch_invariant_mode() && cpp_kernels_compiled();
}

// The loop's statistics (csrc/cpu/linear_policy_loss.cpp: its own six, then ppo_policy_loss_fwd's
// verl four and TRL five), and the order of the op's `stats` (op.stat_names: "ppo" reports verl's,
// TRL's types both, in policy_math's order; kl_* with a reference).
constexpr std::array<const char*, 15> kLoopStats = {
    "pg_loss",          "entropy_loss",      "entropy_mean",      "masked_fraction",
    "kl_loss",          "kl_mean",           "clip_frac",         "clip_frac_lower",
    "approx_kl",        "ratio_mean",        "clip_low_frac",     "clip_high_frac",
    "clip_region_frac", "clip_low_frac_min", "clip_high_frac_max"};

std::vector<int64_t> order_of(std::initializer_list<const char*> names) {
  std::vector<int64_t> out;
  for (const char* n : names) {
    const auto it = std::find_if(kLoopStats.begin(), kLoopStats.end(),
                                 [&](const char* s) { return std::strcmp(s, n) == 0; });
    TORCH_INTERNAL_ASSERT(it != kLoopStats.end(), n);
    out.push_back(it - kLoopStats.begin());
  }
  return out;
}

const std::vector<int64_t>& stat_order(bool trl, bool has_ref) {
  static const std::vector<int64_t> orders[4] = {
      order_of({"pg_loss", "entropy_loss", "entropy_mean", "masked_fraction", "clip_frac",
                "clip_frac_lower", "approx_kl", "ratio_mean"}),
      order_of({"pg_loss", "entropy_loss", "entropy_mean", "masked_fraction", "kl_loss", "kl_mean",
                "clip_frac", "clip_frac_lower", "approx_kl", "ratio_mean"}),
      order_of({"pg_loss", "entropy_loss", "entropy_mean", "masked_fraction", "clip_low_frac",
                "clip_high_frac", "clip_region_frac", "clip_frac", "clip_frac_lower", "approx_kl",
                "ratio_mean", "clip_low_frac_min", "clip_high_frac_max"}),
      order_of({"pg_loss", "entropy_loss", "entropy_mean", "masked_fraction", "kl_loss", "kl_mean",
                "clip_low_frac", "clip_high_frac", "clip_region_frac", "clip_frac",
                "clip_frac_lower", "approx_kl", "ratio_mean", "clip_low_frac_min",
                "clip_high_frac_max"})};
  return orders[2 * trl + has_ref];
}

using LoopSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
    std::optional<double>, double, double, std::optional<double>, double, const std::string&,
    double, double, const std::string&, bool, double, double, double, double, double, double,
    int64_t, int64_t, at::IntArrayRef, bool, bool, bool);

// The stack's n arguments replaced by linear_policy_loss_grads' outputs, from the C++ loop.
void run_cpp_loop(Stack* stack, const Stack& a, const Args& i, size_t n) {
  static const OpRef kLoop("linear_policy_loss_ppo");
  const auto loop = kLoop.in<LoopSig>(Ns::kCppKernels);  // (cpp_loop: the compiled kernels)
  const auto ref = opt_tensor(a[i.ref_logprobs]);
  const auto& order = stat_order(a[i.loss_type].toStringRef() != "ppo", ref.has_value());
  auto out = loop.call(
      a[i.hidden].toTensor(), a[i.weight].toTensor(), opt_tensor(a[i.bias]), a[i.labels].toTensor(),
      a[i.advantages].toTensor(), a[i.old_logprobs].toTensor(), a[i.mask].toTensor(), ref,
      opt_tensor(a[i.global_denom]), a[i.global_denom_value].toOptional<double>(),
      a[i.clip_low].toDouble(), a[i.clip_high].toDouble(), a[i.dual_clip].toOptional<double>(),
      a[i.log_ratio_clamp].toDouble(), a[i.agg].toStringRef(), a[i.scale].toDouble(),
      a[i.kl_coef].toDouble(), a[i.kl_estimator].toStringRef(), a[i.kl_straight_through].toBool(),
      a[i.kl_in_lo].toDouble(), a[i.kl_in_hi].toDouble(), a[i.kl_out_lo].toDouble(),
      a[i.kl_out_hi].toDouble(), a[i.entropy_coef].toDouble(), 1.0 / a[i.temperature].toDouble(),
      a[i.ignore_index].toInt(), a[i.max_chunk_bytes].toInt(), order, a[i.n].toBool(),
      a[i.n + 1].toBool(), a[i.n + 2].toBool());
  torch::jit::drop(*stack, n);
  std::apply([&](auto&... t) { (stack->emplace_back(std::move(t)), ...); }, out);
}

// linear_policy_loss_grads on the CPU / CUDA keys: check, then the backend's implementation.
void grads_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  const size_t n = i.n + 3;  // + need_hidden, need_weight, need_bias
  const Stack args = arguments(*stack, n);
  check(args, i);
  const Backend b = backend_for("linear_policy_loss", args[i.hidden].toTensor());
  if (b == Backend::kCpp && cpp_loop(args, i)) return run_cpp_loop(stack, args, i, n);
  impl(b).callBoxed(stack);
}

// linear_policy_loss on the CPU / CUDA keys (no gradient asked for): linear_policy_loss_grads'
// value.
void loss_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  fused_loss::value(grads_op(), stack);
}

// linear_policy_loss on the Autograd key: the gradients of the inputs that require one, formed in
// the forward.
void autograd_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  fused_loss::autograd_call<grads_op, kOutputs>(stack, i.n, i.hidden, i.weight, i.bias);
}

// ---- the sampler's distribution: linear_policy_loss_sampler (+ _grads) ----
c10::OperatorHandle sampler_op() { return find("ppo_kernels::linear_policy_loss_sampler"); }

const c10::OperatorHandle& sampler_grads_op() {
  static const c10::OperatorHandle h = find("ppo_kernels::linear_policy_loss_sampler_grads");
  return h;
}

const c10::OperatorHandle& sampler_impl(Backend b) {
  switch (b) {
    case Backend::kCpp: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_cpp::linear_policy_loss_sampler_grads");
      return h;
    }
    case Backend::kTriton: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_triton::linear_policy_loss_sampler_grads");
      return h;
    }
    default: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_eager::linear_policy_loss_sampler_grads");
      return h;
    }
  }
}

// The sampler's argument positions in linear_policy_loss_sampler's schema (the arguments before
// them are linear_policy_loss's, at the same positions: args_of()).
const SamplerArgs& sampler_args_of() {
  static const SamplerArgs a = sampler_args(sampler_op().schema());
  return a;
}

// linear_policy_loss_sampler_grads on the CPU / CUDA keys: the policy loss's checks, the
// sampler's (csrc/ops/sampler_checks.h: per-row tensors a leading part of labels' [B, T]), then
// the backend's chunk loop.
void sampler_grads_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  const SamplerArgs& s = sampler_args_of();
  const Stack args = arguments(*stack, s.n + 3);  // + need_hidden, need_weight, need_bias
  check(args, i);
  const Tensor hidden = args[i.hidden].toTensor();
  TORCH_CHECK_VALUE(args[i.ref_hidden].isNone(),
                    "ref_hidden: the exact KL against a reference head is not supported with the "
                    "sampler's options (temperature tensor, top_k, top_p, min_p) yet; give "
                    "ref_logprobs (the sampled KL estimators)");
  check_sampler_args(args, s, hidden, "hidden", args[i.weight].toTensor().size(0),
                     args[i.labels].toTensor());
  sampler_impl(backend_for("linear_policy_loss", hidden)).callBoxed(stack);
}

void sampler_loss_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  fused_loss::value(sampler_grads_op(), stack);
}

void sampler_autograd_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  fused_loss::autograd_call<sampler_grads_op, kSamplerOutputs>(stack, sampler_args_of().n, i.hidden,
                                                               i.weight, i.bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.linear_policy_loss.op");  // the fake kernels
  // -> (loss [], stats [K] (names: op.stat_names), token_stats [3, B, T]: log-probs, entropy,
  // KL; float32, float64 for float64 hidden)
  m.def("linear_policy_loss(" PPO_LPL_ARGS ") -> (Tensor loss, Tensor stats, Tensor token_stats)");
  // + the gradients of hidden (hidden's dtype), weight and bias (float32; float64 for float64),
  // each an empty tensor when not asked for
  m.def("linear_policy_loss_grads(" PPO_LPL_ARGS
        ", bool need_hidden, bool need_weight, bool need_bias) -> (Tensor loss, Tensor stats, "
        "Tensor token_stats, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
  // under the sampler's distribution: + outside [B, T] (bool: the label is outside the kept set)
  m.def("linear_policy_loss_sampler(" PPO_LPL_ARGS PPO_LPL_SAMPLER_ARGS
        ") -> (Tensor loss, Tensor stats, Tensor token_stats, Tensor outside)");
  m.def("linear_policy_loss_sampler_grads(" PPO_LPL_ARGS PPO_LPL_SAMPLER_ARGS
        ", bool need_hidden, bool need_weight, bool need_bias) -> (Tensor loss, Tensor stats, "
        "Tensor token_stats, Tensor outside, Tensor grad_hidden, Tensor grad_weight, "
        "Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("linear_policy_loss", torch::CppFunction::makeFromBoxedFunction<&loss_kernel>());
  m.impl("linear_policy_loss_grads", torch::CppFunction::makeFromBoxedFunction<&grads_kernel>());
  m.impl("linear_policy_loss_sampler",
         torch::CppFunction::makeFromBoxedFunction<&sampler_loss_kernel>());
  m.impl("linear_policy_loss_sampler_grads",
         torch::CppFunction::makeFromBoxedFunction<&sampler_grads_kernel>());
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("linear_policy_loss", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  m.impl("linear_policy_loss_sampler",
         torch::CppFunction::makeFromBoxedFunction<&sampler_autograd_kernel>());
}

}  // namespace ppo_kernels
