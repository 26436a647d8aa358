// Registered ops `ppo_kernels::linear_preference_loss` and
// `ppo_kernels::linear_preference_loss_grads`: a preference loss (DPO and TRL's other paired
// types, ORPO / SimPO / CPO, KTO) from the hidden states and the LM head in one chunked pass, with
// its gradients formed on the way. Schemas, argument checks naming the argument, backend routing
// and autograd live here; the chunk loop (logits tile -> token log-probs -> sequence log-probs of
// whole pairs -> the preference math's d loss / d sequence log-prob -> gradient tile -> grad_hidden
// rows and the weight-gradient sum) is ppo_kernels/linear_preference_loss/op.py, which registers
// it per backend (`ppo_kernels_cpp::` around the compiled token_logprobs kernels,
// `ppo_kernels_triton::`, `ppo_kernels_eager::`), with the fake kernels.
//
// linear_preference_loss_grads computes the loss, the statistics and the gradients of hidden /
// weight / bias that are asked for (need_*: a frozen LM head costs no weight-gradient GEMM);
// linear_preference_loss is its value. Autograd: the Autograd-key kernel calls
// linear_preference_loss_grads below autograd with need_* from requires_grad and saves the
// gradients; the backward scales them by the upstream gradient (no GEMM). The kernels are boxed
// (the argument list is long and only forwarded): they read the arguments they check by name.
//
// linear_preference_loss_sampler (+ _grads): the same loss under the rollout sampler's
// distribution (a temperature tensor, top-k, top-p, min-p, vLLM's / SGLang's rules): the same
// arguments, then the sampler's. Ops of their own, so that the plain call's path stays as it was.
// Each head's tiles hold whole rows, reduced by token_logprobs' sampler kernels (op.py:
// engine.SamplerVocab); a label outside either head's kept set leaves its completion's sums by
// default, and is counted.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

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

// Everything linear_preference_loss takes, in order (ppo_kernels/linear_preference_loss/api.py
// documents each; labels / mask are [R, T] (R completions of T tokens), hidden [R * T, H]).
#define PPO_LPREF_ARGS                                                                         \
  "Tensor hidden, Tensor weight, Tensor labels, Tensor? mask, Tensor? bias, Tensor? pairs, "   \
  "Tensor? desirable, Tensor? ref_logps, Tensor? ref_hidden, Tensor? ref_weight, "             \
  "Tensor? ref_bias, Tensor? reference_point, str[] loss_type, float[]? loss_weights, "        \
  "float beta, float label_smoothing, float discopop_tau, str f_divergence_type, "             \
  "float f_alpha_divergence_coef, float simpo_gamma, bool average_log_prob, float? ld_alpha, " \
  "float desirable_weight, float undesirable_weight, float temperature, float? softcap, "      \
  "int ignore_index, int max_chunk_bytes, str logits_dtype, bool with_entropy, "               \
  "bool with_logit_stats"

// The sampler's arguments after them (linear_preference_loss_sampler).
#define PPO_LPREF_SAMPLER_ARGS                                                       \
  ", Tensor? temperatures, int top_k, Tensor? top_ks, float top_p, Tensor? top_ps, " \
  "float min_p, Tensor? min_ps, str sampler, bool mask_outside"

constexpr int64_t kOutputs = 4;  // loss [], stats [K], row_stats [3, R], token_stats [5, R, T]
constexpr int64_t kSamplerOutputs = 5;  // + outside [R, T] (bool)

// The unpaired types (rows flagged desirable or not, no pairs): preference_math.UNPAIRED_TYPES.
bool is_unpaired(const std::string& t) { return t == "kto" || t == "apo_zero_unpaired"; }

c10::OperatorHandle find(const char* name) {
  return fused_loss::find_op(name, "ppo_kernels/linear_preference_loss/op.py");
}

const c10::OperatorHandle& grads_op() {
  static const c10::OperatorHandle h = find("ppo_kernels::linear_preference_loss_grads");
  return h;
}

// The Python implementations of linear_preference_loss_grads per backend (op.py).
const c10::OperatorHandle& impl(Backend b) {
  switch (b) {
    case Backend::kCpp: {
      static const c10::OperatorHandle h = find("ppo_kernels_cpp::linear_preference_loss_grads");
      return h;
    }
    case Backend::kTriton: {
      static const c10::OperatorHandle h = find("ppo_kernels_triton::linear_preference_loss_grads");
      return h;
    }
    default: {
      static const c10::OperatorHandle h = find("ppo_kernels_eager::linear_preference_loss_grads");
      return h;
    }
  }
}

struct Args {
  size_t n, hidden, weight, labels, mask, bias, pairs, desirable, ref_logps, ref_hidden, ref_weight,
      ref_bias, reference_point, loss_type, loss_weights, beta, label_smoothing, discopop_tau,
      f_alpha_divergence_coef, simpo_gamma, ld_alpha, desirable_weight, undesirable_weight,
      temperature, softcap, max_chunk_bytes, logits_dtype;
};

// Argument positions, read once from linear_preference_loss's schema by name (the grads op takes
// the same arguments, then need_hidden, need_weight, need_bias).
const Args& args_of() {
  static const Args a = [] {
    const auto& s = find("ppo_kernels::linear_preference_loss").schema();
    auto at = [&](const char* name) {
      const auto i = s.argumentIndexWithName(name);
      TORCH_CHECK(i.has_value(), "linear_preference_loss: no argument ", name, " in the schema");
      return static_cast<size_t>(*i);
    };
    return Args{.n = s.arguments().size(),
                .hidden = at("hidden"),
                .weight = at("weight"),
                .labels = at("labels"),
                .mask = at("mask"),
                .bias = at("bias"),
                .pairs = at("pairs"),
                .desirable = at("desirable"),
                .ref_logps = at("ref_logps"),
                .ref_hidden = at("ref_hidden"),
                .ref_weight = at("ref_weight"),
                .ref_bias = at("ref_bias"),
                .reference_point = at("reference_point"),
                .loss_type = at("loss_type"),
                .loss_weights = at("loss_weights"),
                .beta = at("beta"),
                .label_smoothing = at("label_smoothing"),
                .discopop_tau = at("discopop_tau"),
                .f_alpha_divergence_coef = at("f_alpha_divergence_coef"),
                .simpo_gamma = at("simpo_gamma"),
                .ld_alpha = at("ld_alpha"),
                .desirable_weight = at("desirable_weight"),
                .undesirable_weight = at("undesirable_weight"),
                .temperature = at("temperature"),
                .softcap = at("softcap"),
                .max_chunk_bytes = at("max_chunk_bytes"),
                .logits_dtype = at("logits_dtype")};
  }();
  return a;
}

// Metadata checks of every argument the loop indexes by (never a host sync; the label range and
// the pairing are read on the CPU by op.py): hidden [R * T, H], weight [V, H], bias [V], labels /
// mask [R, T], pairs [R / 2, 2] (paired types) or desirable [R] (unpaired), ref_logps [R], the
// reference head, the scalars.
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
                    " tokens (hidden.shape[0] = R * T), got shape ", shape_str(labels.sizes()));
  TORCH_CHECK_VALUE(V > 0 || labels.numel() == 0,
                    "weight: the vocabulary dimension (first) is empty");
  const int64_t R = labels.size(0);
  if (auto mask = opt_tensor(a[i.mask])) {
    expect_mask(*mask, "mask");
    expect_device(*mask, "mask", hidden, "hidden");
    expect_shape(*mask, "mask", labels.sizes(), "like labels");
  }
  // the loss types: a non-empty list, one weight each; paired and unpaired ones not mixed
  const auto types = a[i.loss_type].toListRef();
  TORCH_CHECK_VALUE(!types.empty(), "loss_type: expected at least one loss type");
  bool unpaired = false, paired = false;
  for (const auto& t : types) (is_unpaired(t.toStringRef()) ? unpaired : paired) = true;
  TORCH_CHECK_VALUE(!(unpaired && paired),
                    "loss_type: an unpaired type (kto, apo_zero_unpaired) cannot be combined with "
                    "other types");
  if (!a[i.loss_weights].isNone()) {
    const auto w = a[i.loss_weights].toDoubleVector();
    TORCH_CHECK_VALUE(w.size() == types.size(), "loss_weights: expected ", types.size(),
                      " weights (one per loss type), got ", w.size());
    for (double x : w) expect_finite("loss_weights", x);
  }
  const auto pairs = opt_tensor(a[i.pairs]);
  const auto desirable = opt_tensor(a[i.desirable]);
  if (unpaired) {
    TORCH_CHECK_VALUE(!pairs, "pairs: the unpaired types take desirable, not pairs");
    TORCH_CHECK_VALUE(desirable.has_value(),
                      "desirable: the unpaired types need each row's flag (desirable or not)");
    TORCH_CHECK_TYPE(desirable->scalar_type() == at::kBool ||
                         at::isIntegralType(desirable->scalar_type(), false),
                     "desirable: dtype ", dtype_name(desirable->scalar_type()),
                     " is not supported (expected bool or an integer dtype)");
    expect_device(*desirable, "desirable", hidden, "hidden");
    expect_shape(*desirable, "desirable", {R}, "one per row, labels.shape[0]");
  } else {
    TORCH_CHECK_VALUE(!desirable,
                      "desirable: only the unpaired types (kto, apo_zero_unpaired) "
                      "take it");
    TORCH_CHECK_VALUE(R % 2 == 0, "labels: the paired types need an even number of rows (", R,
                      "): chosen and rejected completions");
    if (pairs) {
      expect_index(*pairs, "pairs");
      expect_device(*pairs, "pairs", hidden, "hidden");
      expect_shape(*pairs, "pairs", {R / 2, 2}, "(rows / 2, 2): chosen row, rejected row");
    }
  }
  const auto ref_h = opt_tensor(a[i.ref_hidden]), ref_w = opt_tensor(a[i.ref_weight]);
  if (auto ref = opt_tensor(a[i.ref_logps])) {
    TORCH_CHECK_VALUE(!ref_h,
                      "ref_logps: give either ref_logps or ref_hidden / ref_weight "
                      "(the reference head), not both");
    expect_float(*ref, "ref_logps");
    expect_device(*ref, "ref_logps", hidden, "hidden");
    expect_shape(*ref, "ref_logps", {R}, "one per row, labels.shape[0]");
  }
  TORCH_CHECK_VALUE(ref_h.has_value() == ref_w.has_value(), ref_h ? "ref_weight" : "ref_hidden",
                    ": ref_hidden and ref_weight go together (the reference LM head)");
  if (ref_h) {
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
  if (auto kl = opt_tensor(a[i.reference_point])) {
    expect_float(*kl, "reference_point");
    expect_device(*kl, "reference_point", hidden, "hidden");
    TORCH_CHECK_VALUE(kl->numel() == 1, "reference_point: expected a single value, got shape ",
                      shape_str(kl->sizes()));
  }
  expect_positive("beta", a[i.beta].toDouble());
  expect_finite("label_smoothing", a[i.label_smoothing].toDouble());
  expect_finite("discopop_tau", a[i.discopop_tau].toDouble());
  expect_finite("f_alpha_divergence_coef", a[i.f_alpha_divergence_coef].toDouble());
  expect_finite("simpo_gamma", a[i.simpo_gamma].toDouble());
  expect_finite("desirable_weight", a[i.desirable_weight].toDouble());
  expect_finite("undesirable_weight", a[i.undesirable_weight].toDouble());
  if (!a[i.ld_alpha].isNone()) {
    const double ld = a[i.ld_alpha].toDouble();
    TORCH_CHECK_VALUE(std::isfinite(ld) && ld >= 0,
                      "ld_alpha: expected a non-negative finite number, got ", ld);
  }
  expect_temperature(a[i.temperature].toDouble());
  if (!a[i.softcap].isNone()) expect_positive("softcap", a[i.softcap].toDouble());
  TORCH_CHECK_VALUE(a[i.max_chunk_bytes].toInt() >= 0,
                    "max_chunk_bytes: expected a non-negative integer (0: the default), got ",
                    a[i.max_chunk_bytes].toInt());
  const auto& ld = a[i.logits_dtype].toStringRef();
  TORCH_CHECK_VALUE(ld == "float32" || ld == "input",
                    "logits_dtype: expected 'float32' or 'input', got '", ld, "'");
}

// linear_preference_loss_grads on the CPU / CUDA keys: check, then the backend's implementation.
void grads_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  const size_t n = i.n + 3;  // + need_hidden, need_weight, need_bias
  const Stack args = arguments(*stack, n);
  check(args, i);
  impl(backend_for("linear_preference_loss", args[i.hidden].toTensor())).callBoxed(stack);
}

// linear_preference_loss on the CPU / CUDA keys (no gradient asked for): the grads op's value.
void loss_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  fused_loss::value(grads_op(), stack);
}

// linear_preference_loss on the Autograd key: the gradients of the inputs that require one,
// formed in the forward.
void autograd_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  fused_loss::autograd_call<grads_op, kOutputs>(stack, i.n, i.hidden, i.weight, i.bias);
}

// ---- the sampler's distribution: linear_preference_loss_sampler (+ _grads) ----
c10::OperatorHandle sampler_op() { return find("ppo_kernels::linear_preference_loss_sampler"); }

const c10::OperatorHandle& sampler_grads_op() {
  static const c10::OperatorHandle h = find("ppo_kernels::linear_preference_loss_sampler_grads");
  return h;
}

const c10::OperatorHandle& sampler_impl(Backend b) {
  switch (b) {
    case Backend::kCpp: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_cpp::linear_preference_loss_sampler_grads");
      return h;
    }
    case Backend::kTriton: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_triton::linear_preference_loss_sampler_grads");
      return h;
    }
    default: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_eager::linear_preference_loss_sampler_grads");
      return h;
    }
  }
}

// The sampler's argument positions in linear_preference_loss_sampler's schema (the arguments
// before them are linear_preference_loss's, at the same positions: args_of()).
const SamplerArgs& sampler_args_of() {
  static const SamplerArgs a = sampler_args(sampler_op().schema());
  return a;
}

// linear_preference_loss_sampler_grads on the CPU / CUDA keys: the preference loss's checks, the
// sampler's (csrc/ops/sampler_checks.h: per-row tensors a leading part of labels' [R, T]), then
// the backend's chunk loop.
void sampler_grads_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  const SamplerArgs& s = sampler_args_of();
  const Stack args = arguments(*stack, s.n + 3);  // + need_hidden, need_weight, need_bias
  check(args, i);
  const Tensor hidden = args[i.hidden].toTensor();
  check_sampler_args(args, s, hidden, "hidden", args[i.weight].toTensor().size(0),
                     args[i.labels].toTensor());
  sampler_impl(backend_for("linear_preference_loss", hidden)).callBoxed(stack);
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
  m.set_python_module("ppo_kernels.linear_preference_loss.op");  // the fake kernels
  // -> (loss [], stats [K] (names: op.stat_names), row_stats [3, R]: sequence log-probs, the
  // reference's, rewards; token_stats [5, R, T]: log-probs, entropy, the reference head's
  // log-probs, mean logit, whether the label is the argmax; float32, float64 for float64 hidden)
  m.def("linear_preference_loss(" PPO_LPREF_ARGS
        ") -> (Tensor loss, Tensor stats, Tensor row_stats, Tensor token_stats)");
  // + the gradients of hidden (hidden's dtype), weight and bias (float32; float64 for float64),
  // each an empty tensor when not asked for
  m.def("linear_preference_loss_grads(" PPO_LPREF_ARGS
        ", bool need_hidden, bool need_weight, bool need_bias) -> (Tensor loss, Tensor stats, "
        "Tensor row_stats, Tensor token_stats, Tensor grad_hidden, Tensor grad_weight, "
        "Tensor grad_bias)");
  // under the sampler's distribution: + outside [R, T] (bool: the label is outside the policy's
  // or the reference head's kept set)
  m.def("linear_preference_loss_sampler(" PPO_LPREF_ARGS PPO_LPREF_SAMPLER_ARGS
        ") -> (Tensor loss, Tensor stats, Tensor row_stats, Tensor token_stats, Tensor outside)");
  m.def("linear_preference_loss_sampler_grads(" PPO_LPREF_ARGS PPO_LPREF_SAMPLER_ARGS
        ", bool need_hidden, bool need_weight, bool need_bias) -> (Tensor loss, Tensor stats, "
        "Tensor row_stats, Tensor token_stats, Tensor outside, Tensor grad_hidden, "
        "Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("linear_preference_loss", torch::CppFunction::makeFromBoxedFunction<&loss_kernel>());
  m.impl("linear_preference_loss_grads",
         torch::CppFunction::makeFromBoxedFunction<&grads_kernel>());
  m.impl("linear_preference_loss_sampler",
         torch::CppFunction::makeFromBoxedFunction<&sampler_loss_kernel>());
  m.impl("linear_preference_loss_sampler_grads",
         torch::CppFunction::makeFromBoxedFunction<&sampler_grads_kernel>());
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("linear_preference_loss", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  m.impl("linear_preference_loss_sampler",
         torch::CppFunction::makeFromBoxedFunction<&sampler_autograd_kernel>());
}

}  // namespace ppo_kernels
