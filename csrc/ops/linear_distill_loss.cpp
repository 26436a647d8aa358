// Registered ops `ppo_kernels::linear_distill_loss` and `ppo_kernels::linear_distill_loss_grads`:
// the distillation loss between a student LM head and a teacher (a second LM head, or its cached
// top-k ids and log-probs) from the hidden states in one chunked pass, with the student's
// gradients formed on the way. Schemas, argument checks naming the argument, backend routing and
// autograd live here; the chunk loop (both logits tiles -> the divergence per row and the
// hard-label log-prob -> per-token coefficients -> the student's gradient tile, written over its
// logits tile -> grad_hidden rows and the weight-gradient sum) is ppo_kernels/distill/op.py, which
// registers it per backend (`ppo_kernels_cpp::` around the compiled distillation and
// token_logprobs tile kernels, `ppo_kernels_triton::`, `ppo_kernels_eager::`), with the fake
// kernels.
//
// linear_distill_loss_grads computes the loss, the statistics and the gradients of hidden / weight
// / bias that are asked for (need_*: a frozen head costs no weight-gradient GEMM); the teacher
// never gets one. linear_distill_loss is its value. Autograd: the Autograd-key kernel calls
// linear_distill_loss_grads below autograd with need_* from requires_grad and saves the gradients;
// the backward scales them by the upstream gradient (no GEMM). The kernels are boxed: they forward
// the arguments and read the ones they check by name from the schema.
//
// linear_distill_loss_sampler (+ _grads): the same loss with the student's distribution the one
// the rollout engine sampled from (a temperature tensor, top-k, top-p, min-p, vLLM's / SGLang's
// rules): the same arguments, then the sampler's. Its own ops, so that the plain call's path
// stays as it was. The student's p is tempered, truncated to its kept set and renormalised; the
// teacher stays whole (a truncated teacher would make every KL infinite where the kept sets
// differ). Forward KL (and jsd at beta 0) is refused with a truncation on: it is +inf wherever
// the teacher has mass outside the kept set. A cached teacher is refused too.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "common/distill_host.h"
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

// Everything linear_distill_loss takes, in order (ppo_kernels/distill/api.py documents each;
// hidden [N, H], the per-token tensors [N], the top-k ones [N, K]).
#define PPO_LDL_ARGS                                                                               \
  "Tensor hidden, Tensor weight, Tensor labels, Tensor? mask, Tensor? bias, "                      \
  "Tensor? teacher_hidden, Tensor? teacher_weight, Tensor? teacher_bias, Tensor? topk_ids, "       \
  "Tensor? topk_logprobs, str divergence, float beta, float temperature, float weight_soft_loss, " \
  "float weight_hard_loss, str topk_tail, int ignore_index, int max_chunk_bytes, "                 \
  "str logits_dtype"

// The sampler's arguments after them (linear_distill_loss_sampler).
#define PPO_LDL_SAMPLER_ARGS                                                         \
  ", Tensor? temperatures, int top_k, Tensor? top_ks, float top_p, Tensor? top_ps, " \
  "float min_p, Tensor? min_ps, str sampler"

constexpr size_t kOutputs = 3;         // loss [], stats [2], token_stats [3, N]
constexpr size_t kSamplerOutputs = 4;  // + outside [N] (bool); stats [3]: + num_outside

c10::OperatorHandle find(const char* name) {
  return fused_loss::find_op(name, "ppo_kernels/distill/op.py");
}

const c10::OperatorHandle& grads_op() {
  static const c10::OperatorHandle h = find("ppo_kernels::linear_distill_loss_grads");
  return h;
}

// The Python implementations of linear_distill_loss_grads per backend (op.py).
const c10::OperatorHandle& impl(Backend b) {
  switch (b) {
    case Backend::kCpp: {
      static const c10::OperatorHandle h = find("ppo_kernels_cpp::linear_distill_loss_grads");
      return h;
    }
    case Backend::kTriton: {
      static const c10::OperatorHandle h = find("ppo_kernels_triton::linear_distill_loss_grads");
      return h;
    }
    default: {
      static const c10::OperatorHandle h = find("ppo_kernels_eager::linear_distill_loss_grads");
      return h;
    }
  }
}

struct Args {
  size_t n, hidden, weight, labels, mask, bias, teacher_hidden, teacher_weight, teacher_bias,
      topk_ids, topk_logprobs, divergence, beta, temperature, weight_soft_loss, weight_hard_loss,
      topk_tail, max_chunk_bytes, logits_dtype;
};

// Argument positions, read once from linear_distill_loss's schema by name (the _grads op takes the
// same arguments, then need_hidden, need_weight, need_bias).
const Args& args_of() {
  static const Args a = [] {
    const auto& s = find("ppo_kernels::linear_distill_loss").schema();
    auto at = [&](const char* name) {
      const auto i = s.argumentIndexWithName(name);
      TORCH_CHECK(i.has_value(), "linear_distill_loss: no argument ", name, " in the schema");
      return static_cast<size_t>(*i);
    };
    Args r{};
    r.n = s.arguments().size();
    r.hidden = at("hidden");
    r.weight = at("weight");
    r.labels = at("labels");
    r.mask = at("mask");
    r.bias = at("bias");
    r.teacher_hidden = at("teacher_hidden");
    r.teacher_weight = at("teacher_weight");
    r.teacher_bias = at("teacher_bias");
    r.topk_ids = at("topk_ids");
    r.topk_logprobs = at("topk_logprobs");
    r.divergence = at("divergence");
    r.beta = at("beta");
    r.temperature = at("temperature");
    r.weight_soft_loss = at("weight_soft_loss");
    r.weight_hard_loss = at("weight_hard_loss");
    r.topk_tail = at("topk_tail");
    r.max_chunk_bytes = at("max_chunk_bytes");
    r.logits_dtype = at("logits_dtype");
    return r;
  }();
  return a;
}

// Metadata checks of every argument the kernels index by (never a host sync; the label and top-k
// id ranges are checked by the loop on the CPU, and on the GPU under strict_checks()).
void check(const Stack& a, const Args& i) {
  const Tensor hidden = a[i.hidden].toTensor();
  expect_float(hidden, "hidden");
  expect_dim(hidden, "hidden", 2);
  const int64_t N = hidden.size(0);
  const Tensor weight = a[i.weight].toTensor();
  expect_float(weight, "weight");
  expect_device(weight, "weight", hidden, "hidden");
  expect_dtype(weight, "weight", hidden.scalar_type(), "like hidden");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    "weight: expected shape (V, ", hidden.size(1), ") (H = hidden.shape[-1]), got ",
                    weight.sizes());
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
  expect_shape(labels, "labels", {N}, "hidden.shape[0]");
  TORCH_CHECK_VALUE(V > 0 || N == 0, "weight: the vocabulary dimension (first) is empty");
  if (auto mask = opt_tensor(a[i.mask])) {
    expect_mask(*mask, "mask");
    expect_device(*mask, "mask", hidden, "hidden");
    expect_shape(*mask, "mask", {N}, "like labels");
  }
  // the teacher: a second LM head, or its cached top-k (exactly one of the two)
  const auto th = opt_tensor(a[i.teacher_hidden]), tw = opt_tensor(a[i.teacher_weight]);
  const auto ids = opt_tensor(a[i.topk_ids]), tlp = opt_tensor(a[i.topk_logprobs]);
  TORCH_CHECK_VALUE(th.has_value() == tw.has_value(), th ? "teacher_weight" : "teacher_hidden",
                    ": teacher_hidden and teacher_weight go together (the teacher's LM head)");
  TORCH_CHECK_VALUE(ids.has_value() == tlp.has_value(), ids ? "topk_logprobs" : "topk_ids",
                    ": topk_ids and topk_logprobs go together (the cached teacher)");
  TORCH_CHECK_VALUE(th.has_value() != ids.has_value(),
                    th ? "topk_ids: give the teacher either as teacher_hidden / teacher_weight or "
                         "as topk_ids / topk_logprobs, not both"
                       : "teacher_hidden: a teacher is needed: teacher_hidden / teacher_weight "
                         "(its LM head) or topk_ids / topk_logprobs (its cached top-k)");
  if (th) {
    expect_float(*th, "teacher_hidden");
    expect_device(*th, "teacher_hidden", hidden, "hidden");
    // both tiles in one dtype: the tile kernels read them side by side
    expect_dtype(*th, "teacher_hidden", hidden.scalar_type(), "like hidden");
    expect_dim(*th, "teacher_hidden", 2);
    TORCH_CHECK_VALUE(th->size(0) == N, "teacher_hidden: expected ", N,
                      " rows (like hidden), got shape ", th->sizes());
    expect_dtype(*tw, "teacher_weight", th->scalar_type(), "like teacher_hidden");
    expect_device(*tw, "teacher_weight", hidden, "hidden");
    TORCH_CHECK_VALUE(tw->dim() == 2 && tw->size(0) == V && tw->size(1) == th->size(1),
                      "teacher_weight: expected shape (", V, ", ", th->size(1),
                      ") (weight's vocabulary, teacher_hidden's width), got ", tw->sizes());
    if (auto tb = opt_tensor(a[i.teacher_bias])) {
      expect_dtype(*tb, "teacher_bias", th->scalar_type(), "like teacher_hidden");
      expect_device(*tb, "teacher_bias", hidden, "hidden");
      expect_shape(*tb, "teacher_bias", {V}, "weight.shape[0]");
    }
  } else {
    TORCH_CHECK_VALUE(a[i.teacher_bias].isNone(),
                      "teacher_bias: needs teacher_hidden and teacher_weight");
    expect_index(*ids, "topk_ids");
    expect_device(*ids, "topk_ids", hidden, "hidden");
    TORCH_CHECK_VALUE(ids->dim() == 2 && ids->size(0) == N, "topk_ids: expected shape (", N,
                      ", K) (hidden.shape[0] rows), got ", ids->sizes());
    expect_float(*tlp, "topk_logprobs");
    expect_device(*tlp, "topk_logprobs", hidden, "hidden");
    expect_shape(*tlp, "topk_logprobs", ids->sizes(), "like topk_ids");
  }
  mode_index("divergence", distill_divergence_names(), a[i.divergence].toStringRef());
  mode_index("topk_tail", distill_topk_tail_names(), a[i.topk_tail].toStringRef());
  const double beta = a[i.beta].toDouble();
  TORCH_CHECK_VALUE(beta >= 0 && beta <= 1, "beta: expected a value in [0, 1], got ", beta);
  expect_temperature(a[i.temperature].toDouble());
  expect_finite("weight_soft_loss", a[i.weight_soft_loss].toDouble());
  expect_finite("weight_hard_loss", a[i.weight_hard_loss].toDouble());
  TORCH_CHECK_VALUE(a[i.max_chunk_bytes].toInt() >= 0,
                    "max_chunk_bytes: expected a non-negative integer (0: the default), got ",
                    a[i.max_chunk_bytes].toInt());
  const auto& ld = a[i.logits_dtype].toStringRef();
  TORCH_CHECK_VALUE(ld == "float32" || ld == "input",
                    "logits_dtype: expected 'float32' or 'input', got '", ld, "'");
}

// linear_distill_loss_grads on the CPU / CUDA keys: check, then the backend's implementation.
void grads_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  const Stack args = arguments(*stack, i.n + 3);  // + need_hidden, need_weight, need_bias
  check(args, i);
  impl(backend_for("linear_distill_loss", args[i.hidden].toTensor())).callBoxed(stack);
}

// linear_distill_loss on the CPU / CUDA keys (no gradient asked for): the _grads op's value.
void loss_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  fused_loss::value(grads_op(), stack);
}

// linear_distill_loss on the Autograd key: the gradients of the student's inputs that require one,
// formed in the forward.
void autograd_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  fused_loss::autograd_call<grads_op, kOutputs>(stack, i.n, i.hidden, i.weight, i.bias);
}

// ---- the sampler's distribution: linear_distill_loss_sampler (+ _grads) ----
c10::OperatorHandle sampler_op() { return find("ppo_kernels::linear_distill_loss_sampler"); }

const c10::OperatorHandle& sampler_grads_op() {
  static const c10::OperatorHandle h = find("ppo_kernels::linear_distill_loss_sampler_grads");
  return h;
}

const c10::OperatorHandle& sampler_impl(Backend b) {
  switch (b) {
    case Backend::kCpp: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_cpp::linear_distill_loss_sampler_grads");
      return h;
    }
    case Backend::kTriton: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_triton::linear_distill_loss_sampler_grads");
      return h;
    }
    default: {
      static const c10::OperatorHandle h =
          find("ppo_kernels_eager::linear_distill_loss_sampler_grads");
      return h;
    }
  }
}

// The sampler's argument positions in linear_distill_loss_sampler's schema (the arguments before
// them are linear_distill_loss's, at the same positions: args_of()).
const SamplerArgs& sampler_args_of() {
  static const SamplerArgs a = sampler_args(sampler_op().schema());
  return a;
}

// linear_distill_loss_sampler_grads on the CPU / CUDA keys: the loss's checks, what the sampler's
// distribution rules out, the sampler's checks (csrc/ops/sampler_checks.h: per-row tensors a
// leading part of labels' [N]), then the backend's chunk loop.
void sampler_grads_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
  const Args& i = args_of();
  const SamplerArgs& s = sampler_args_of();
  const Stack args = arguments(*stack, s.n + 3);  // + need_hidden, need_weight, need_bias
  check(args, i);
  TORCH_CHECK_VALUE(args[i.topk_ids].isNone(),
                    "topk_ids: a cached teacher is not supported with the sampler's options "
                    "(temperature tensor, top_k, top_p, min_p); give the teacher's head "
                    "(teacher_hidden / teacher_weight)");
  const Tensor hidden = args[i.hidden].toTensor();
  const int64_t V = args[i.weight].toTensor().size(0);
  const int64_t top_k = args[s.top_k].toInt();
  const bool truncated = (top_k > 0 && top_k < V) || !args[s.top_ks].isNone() ||
                         args[s.top_p].toDouble() < 1 || !args[s.top_ps].isNone() ||
                         args[s.min_p].toDouble() > 0 || !args[s.min_ps].isNone();
  const auto& div = args[i.divergence].toStringRef();
  TORCH_CHECK_VALUE(
      !truncated || !(div == "forward_kl" || (div == "jsd" && args[i.beta].toDouble() == 0)),
      "divergence: forward_kl (and jsd with beta 0) is +inf under the sampler's "
      "truncation (top_k, top_p, min_p) wherever the teacher has mass outside the "
      "student's kept set; use reverse_kl, jsd with beta > 0 or tv");
  check_sampler_args(args, s, hidden, "hidden", V, args[i.labels].toTensor());
  sampler_impl(backend_for("linear_distill_loss", hidden)).callBoxed(stack);
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
  m.set_python_module("ppo_kernels.distill.op");  // the fake kernels
  // -> (loss [], stats [2]: soft_loss, hard_loss, token_stats [3, N]: the divergence, the
  // hard-label log-prob, the sampled-token reverse KL; float32, float64 for float64 hidden)
  m.def("linear_distill_loss(" PPO_LDL_ARGS ") -> (Tensor loss, Tensor stats, Tensor token_stats)");
  // + the gradients of hidden (hidden's dtype), weight and bias (float32; float64 for float64),
  // each an empty tensor when not asked for
  m.def("linear_distill_loss_grads(" PPO_LDL_ARGS
        ", bool need_hidden, bool need_weight, bool need_bias) -> (Tensor loss, Tensor stats, "
        "Tensor token_stats, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
  // under the sampler's distribution: stats [3] (+ num_outside), + outside [N] (bool: a kept
  // token whose label is outside the student's kept set)
  m.def("linear_distill_loss_sampler(" PPO_LDL_ARGS PPO_LDL_SAMPLER_ARGS
        ") -> (Tensor loss, Tensor stats, Tensor token_stats, Tensor outside)");
  m.def("linear_distill_loss_sampler_grads(" PPO_LDL_ARGS PPO_LDL_SAMPLER_ARGS
        ", bool need_hidden, bool need_weight, bool need_bias) -> (Tensor loss, Tensor stats, "
        "Tensor token_stats, Tensor outside, Tensor grad_hidden, Tensor grad_weight, "
        "Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("linear_distill_loss", torch::CppFunction::makeFromBoxedFunction<&loss_kernel>());
  m.impl("linear_distill_loss_grads", torch::CppFunction::makeFromBoxedFunction<&grads_kernel>());
  m.impl("linear_distill_loss_sampler",
         torch::CppFunction::makeFromBoxedFunction<&sampler_loss_kernel>());
  m.impl("linear_distill_loss_sampler_grads",
         torch::CppFunction::makeFromBoxedFunction<&sampler_grads_kernel>());
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("linear_distill_loss", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  m.impl("linear_distill_loss_sampler",
         torch::CppFunction::makeFromBoxedFunction<&sampler_autograd_kernel>());
}

}  // namespace ppo_kernels
