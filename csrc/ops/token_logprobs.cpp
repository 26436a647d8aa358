// Registered ops `ppo_kernels::token_logprobs` and its backward ops (`token_logprobs_backward`, and
// `token_logprobs_backward_`, which writes the gradient into the logits buffer): schemas, argument
// checks, backend routing and autograd. Kernels: csrc/cpu/token_logprobs.cpp and
// csrc/cuda/token_logprobs.cu (cpp), ppo_kernels/token_logprobs/op.py (triton, eager); semantics:
// ppo_kernels/token_logprobs/naive.py. Label ranges: the CPU kernels check them (IndexError);
// on the GPU they are checked here only under strict_checks() (else NaN rows, no host sync).
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/alloc.h"
#include "ops/checks.h"
#include "ops/route.h"
#include "ops/sampler_checks.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using c10::SymInt;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;

using FwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, double, SymInt,
                                                  bool, bool);
using BwdSig = Tensor(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, double, SymInt);
using BwdInplaceSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, double, SymInt);
// the raw kernels (ppo_kernels_C): inv_temperature = 1 / T; the backward writes grad_logits
using KernelFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, double,
                                                        int64_t, bool);
using KernelBwdSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, double, int64_t, Tensor);

const OpRef kFwd("token_logprobs"), kBwd("token_logprobs_backward"),
    kBwdInplace("token_logprobs_backward_"), kFwdKernel("token_logprobs_fwd"),
    kBwdKernel("token_logprobs_bwd");

constexpr const char* kRows = "logits.shape[:-1]";

void check_forward(const Tensor& logits, const Tensor& labels, double temperature,
                   int64_t ignore_index) {
  expect_float(logits, "logits");
  expect_min_dim(logits, "logits", 1);
  expect_index(labels, "labels");
  expect_device(labels, "labels", logits, "logits");
  expect_shape(labels, "labels", logits.sizes().slice(0, logits.dim() - 1), kRows);
  TORCH_CHECK_VALUE(logits.size(-1) > 0 || labels.numel() == 0,
                    "logits: the vocabulary dimension (last) is empty");
  expect_rows_contiguous(logits, "logits");
  expect_temperature(temperature);
  if (logits.is_cuda() && strict_checks())  // the CPU kernels check the labels themselves
    expect_labels_in_range(labels, logits.size(-1), ignore_index);
}

// A per-row tensor of the backward: float (or exactly the forward's output dtype), on logits'
// device, with logits.shape[:-1].
void check_row(const Tensor& t, const char* name, const Tensor& logits, bool saved) {
  if (saved) {
    TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
    expect_dtype(t, name, out_dtype(logits), "the forward's output dtype");
  } else {
    expect_float(t, name);
  }
  expect_device(t, name, logits, "logits");
  expect_shape(t, name, logits.sizes().slice(0, logits.dim() - 1), kRows);
}

// The backward ops' arguments; returns grad_entropy, or nullopt where it is absent or empty (no
// entropy gradient).
OptTensor check_backward(const Tensor& grad_logprobs, const OptTensor& grad_entropy,
                         const Tensor& logits, const Tensor& labels, const Tensor& lse,
                         const Tensor& entropy, double temperature, int64_t ignore_index) {
  check_forward(logits, labels, temperature, ignore_index);
  check_row(grad_logprobs, "grad_logprobs", logits, false);
  check_row(lse, "lse", logits, true);
  // on logits' device even where not read (no entropy gradient: empty tensors)
  if (entropy.defined()) expect_device(entropy, "entropy", logits, "logits");
  if (grad_entropy && grad_entropy->defined())
    expect_device(*grad_entropy, "grad_entropy", logits, "logits");
  if (!grad_entropy || !grad_entropy->defined() || grad_entropy->numel() == 0) return std::nullopt;
  check_row(*grad_entropy, "grad_entropy", logits, false);
  check_row(entropy, "entropy", logits, true);
  return grad_entropy;
}

std::tuple<Tensor, Tensor, Tensor> forward(const Tensor& logits, const Tensor& labels,
                                           double temperature, SymInt ignore_index,
                                           bool with_entropy, bool inplace_backward) {
  const int64_t ignore = ignore_index.expect_int();
  check_forward(logits, labels, temperature, ignore);
  const Backend b = backend_for("token_logprobs", logits);
  if (b == Backend::kCpp)
    return kFwdKernel.in<KernelFwdSig>(Ns::kCppKernels)
        .call(logits, labels, 1.0 / temperature, ignore, with_entropy);
  return kFwd.python<FwdSig>(b).call(logits, labels, temperature, ignore_index, with_entropy,
                                     inplace_backward);
}

// Writes the gradient into `out` (a new buffer, or the logits themselves for the in-place op).
void backward_into(const Tensor& grad_logprobs, const OptTensor& grad_entropy, const Tensor& logits,
                   const Tensor& labels, const Tensor& lse, const Tensor& entropy,
                   double temperature, int64_t ignore_index, const Tensor& out) {
  kBwdKernel.in<KernelBwdSig>(Ns::kCppKernels)
      .call(grad_logprobs, grad_entropy, logits, labels, lse, entropy, 1.0 / temperature,
            ignore_index, out);
}

Tensor backward(const Tensor& grad_logprobs, const OptTensor& grad_entropy, const Tensor& logits,
                const Tensor& labels, const Tensor& lse, const Tensor& entropy, double temperature,
                SymInt ignore_index) {
  const int64_t ignore = ignore_index.expect_int();
  const OptTensor gent = check_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy,
                                        temperature, ignore);
  const Backend b = backend_for("token_logprobs", logits);
  if (b != Backend::kCpp)
    return kBwd.python<BwdSig>(b).call(grad_logprobs, gent, logits, labels, lse, entropy,
                                       temperature, ignore_index);
  Tensor grad = new_output(logits.sizes(), logits.options());
  backward_into(grad_logprobs, gent, logits, labels, lse, entropy, temperature, ignore, grad);
  return grad;
}

void backward_inplace(const Tensor& grad_logprobs, const OptTensor& grad_entropy,
                      const Tensor& logits, const Tensor& labels, const Tensor& lse,
                      const Tensor& entropy, double temperature, SymInt ignore_index) {
  const int64_t ignore = ignore_index.expect_int();
  const OptTensor gent = check_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy,
                                        temperature, ignore);
  const Backend b = backend_for("token_logprobs", logits);
  if (b != Backend::kCpp)
    return kBwdInplace.python<BwdInplaceSig>(b).call(grad_logprobs, gent, logits, labels, lse,
                                                     entropy, temperature, ignore_index);
  backward_into(grad_logprobs, gent, logits, labels, lse, entropy, temperature, ignore, logits);
}

class TokenLogprobsFn : public torch::autograd::Function<TokenLogprobsFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels,
                               double temperature, SymInt ignore_index, bool with_entropy,
                               bool inplace_backward) {
    Tensor lp, ent, lse;
    {
      BelowAutograd guard;
      std::tie(lp, ent, lse) = kFwd.in<FwdSig>(Ns::kOps).call(
          logits, labels, temperature, ignore_index, with_entropy, inplace_backward);
    }
    ctx->save_for_backward({logits, labels, lse, ent});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["with_entropy"] = with_entropy;
    ctx->saved_data["inplace"] = inplace_backward;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined
    return {lp, ent, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &logits = saved[0], &labels = saved[1], &lse = saved[2], &ent = saved[3];
    const Tensor& grad_lp = grads[0];
    const Tensor& grad_ent = grads[1];
    const Tensor glp = grad_lp.defined() ? grad_lp : at::zeros_like(lse, lse.options());
    // (with_entropy rather than numel: the sizes may be symbolic while tracing)
    const OptTensor gent = ctx->saved_data["with_entropy"].toBool() && grad_ent.defined()
                               ? OptTensor(grad_ent)
                               : std::nullopt;
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const SymInt ignore_index = ctx->saved_data["ignore_index"].toSymInt();
    Tensor grad;
    if (ctx->saved_data["inplace"].toBool()) {
      kBwdInplace.in<BwdInplaceSig>(Ns::kOps).call(glp, gent, logits, labels, lse, ent, temperature,
                                                   ignore_index);
      grad = logits;
    } else {
      grad = kBwd.in<BwdSig>(Ns::kOps).call(glp, gent, logits, labels, lse, ent, temperature,
                                            ignore_index);
    }
    // logits, labels, temperature, ignore_index, with_entropy, inplace_backward
    return {grad, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> forward_autograd(const Tensor& logits, const Tensor& labels,
                                                    double temperature, SymInt ignore_index,
                                                    bool with_entropy, bool inplace_backward) {
  if (!needs_graph(logits, labels)) {
    BelowAutograd guard;
    return kFwd.in<FwdSig>(Ns::kOps).call(logits, labels, temperature, ignore_index, with_entropy,
                                          inplace_backward);
  }
  auto out = TokenLogprobsFn::apply(logits, labels, temperature, std::move(ignore_index),
                                    with_entropy, inplace_backward);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.token_logprobs.op");  // the fake kernels
  // (logprobs, entropy or an empty tensor, lse); lse is saved for the backward.
  m.def(
      "token_logprobs(Tensor logits, Tensor labels, float temperature, SymInt ignore_index, "
      "bool with_entropy, bool inplace_backward) -> (Tensor, Tensor, Tensor)");
  // d(sum(grad_logprobs * logprobs + grad_entropy * entropy)) / d logits (grad_entropy None or
  // empty: no entropy term)
  m.def(
      "token_logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
      "Tensor labels, Tensor lse, Tensor entropy, float temperature, SymInt ignore_index) "
      "-> Tensor");
  // the same gradient written over the logits (flash-attn's inplace_backward)
  m.def(
      "token_logprobs_backward_(Tensor grad_logprobs, Tensor? grad_entropy, Tensor(a!) logits, "
      "Tensor labels, Tensor lse, Tensor entropy, float temperature, SymInt ignore_index) -> ()");
}

// One router for every device (route.h: cpu and cuda; others are refused, naming the device).
TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("token_logprobs", &forward);
  m.impl("token_logprobs_backward", &backward);
  m.impl("token_logprobs_backward_", &backward_inplace);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) { m.impl("token_logprobs", &forward_autograd); }

}  // namespace ppo_kernels

// ---- the sampler's distribution and the head's statistics: ppo_kernels::token_logprobs_sampler --
// token_logprobs under the distribution a rollout engine sampled from (temperature, min-p, top-k,
// top-p; vLLM's or SGLang's rules) and, on request, the head's statistics. Semantics:
// docs/ppo-math.md and ppo_kernels/token_logprobs/naive.py (sampler_forward). Its own op, so the
// plain token_logprobs path stays as it was. Kernels: csrc/cpu/token_logprobs_sampler.cpp,
// csrc/cuda/token_logprobs_sampler.cu (cpp), ppo_kernels/token_logprobs/op.py (triton, eager).
namespace ppo_kernels {
namespace {

using SamplerOuts = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor, Tensor, Tensor>;
using SamplerFwdSig = SamplerOuts(const Tensor&, const Tensor&, double, const OptTensor&, int64_t,
                                  const OptTensor&, double, const OptTensor&, double,
                                  const OptTensor&, c10::string_view, SymInt, bool, bool, bool,
                                  int64_t, bool);
using SamplerBwdSig = Tensor(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                             const OptTensor&, SymInt);
// the raw kernels (ppo_kernels_C): inverse temperatures; per-token tensors of labels.numel()
// contiguous float64 / int64 values
using SamplerKernelFwdSig = SamplerOuts(const Tensor&, const Tensor&, double, const OptTensor&,
                                        int64_t, const OptTensor&, double, const OptTensor&, double,
                                        const OptTensor&, c10::string_view, int64_t, bool, bool,
                                        bool, int64_t, bool);
using SamplerKernelBwdSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                                 const OptTensor&, int64_t, Tensor);

const OpRef kSamplerFwd("token_logprobs_sampler"), kSamplerBwd("token_logprobs_sampler_backward"),
    kSamplerFwdKernel("token_logprobs_sampler_fwd"),
    kSamplerBwdKernel("token_logprobs_sampler_bwd");

constexpr int64_t kMaxStatsTopK = 64;

// A per-row parameter tensor: its shape a leading part of labels.shape.
void expect_param_shape(const Tensor& t, const char* name, const Tensor& labels) {
  TORCH_CHECK_VALUE(t.dim() <= labels.dim() && t.sizes() == labels.sizes().slice(0, t.dim()), name,
                    ": expected a shape that is a leading part of labels.shape ", labels.sizes(),
                    " (per row or per token), got ", t.sizes());
}

// The values of a parameter tensor read on the host: on the CPU always, on the GPU under
// strict_checks() (a host sync; else out-of-range values give NaN rows, as labels do).
bool check_values(const Tensor& t) { return !t.is_cuda() || strict_checks(); }

void check_temperatures(const OptTensor& t, const Tensor& like, const char* like_name,
                        const Tensor& labels) {
  if (!t) return;
  expect_float(*t, "temperature");
  expect_device(*t, "temperatures", like, like_name);  // the schema's names
  expect_param_shape(*t, "temperature", labels);
  if (!check_values(*t) || t->numel() == 0) return;
  constexpr double kFloat32Max = 3.4028234663852886e38;
  const Tensor d = t->to(at::kDouble);
  const bool ok = d.gt(0).logical_and_(d.reciprocal().le(kFloat32Max)).all().item<bool>();
  TORCH_CHECK_VALUE(ok,
                    "temperature: expected positive values whose inverse is finite in float32 "
                    "(> ",
                    1.0 / kFloat32Max, "); got min ", d.min().item<double>());
}

// A per-row probability (top_p: values in (0, 1]; min_p: in [0, 1]); `schema` is the tensor's
// name in the op's schema, which the device message names.
void check_prob_param(const OptTensor& t, const char* name, const char* schema, bool zero_ok,
                      const Tensor& like, const char* like_name, const Tensor& labels) {
  if (!t) return;
  expect_float(*t, name);
  expect_device(*t, schema, like, like_name);
  expect_param_shape(*t, name, labels);
  if (!check_values(*t) || t->numel() == 0) return;
  const Tensor d = t->to(at::kDouble);
  const Tensor low = zero_ok ? d.ge(0) : d.gt(0);
  TORCH_CHECK_VALUE(low.logical_and_(d.le(1)).all().item<bool>(), name, ": expected values in ",
                    zero_ok ? "[0, 1] (0: off)" : "(0, 1] (1: off)");
}

void check_sampler_params(const Tensor& logits, const Tensor& labels, const OptTensor& temperatures,
                          int64_t top_k, const OptTensor& top_ks, double top_p,
                          const OptTensor& top_ps, double min_p, const OptTensor& min_ps,
                          c10::string_view sampler, int64_t stats_top_k) {
  check_sampler_options(logits, "logits", logits.size(-1), labels, temperatures, top_k, top_ks,
                        top_p, top_ps, min_p, min_ps, sampler, stats_top_k);
}

// A per-token tensor as the kernels take it: labels.numel() contiguous values of `dtype`.
OptTensor flat_param(const OptTensor& t, const Tensor& labels, at::ScalarType dtype) {
  if (!t) return std::nullopt;
  std::vector<int64_t> shape(t->sizes().begin(), t->sizes().end());
  shape.resize(labels.dim(), 1);
  return t->to(dtype).reshape(shape).expand(labels.sizes()).reshape({-1}).contiguous();
}

OptTensor inverse_temperatures(const OptTensor& t, const Tensor& labels) {
  if (!t) return std::nullopt;
  return flat_param(t->to(at::kDouble).reciprocal(), labels, at::kDouble);
}

SamplerOuts sampler_forward(const Tensor& logits, const Tensor& labels, double temperature,
                            const OptTensor& temperatures, int64_t top_k, const OptTensor& top_ks,
                            double top_p, const OptTensor& top_ps, double min_p,
                            const OptTensor& min_ps, c10::string_view sampler, SymInt ignore_index,
                            bool with_entropy, bool with_sum_p2, bool with_lse, int64_t stats_top_k,
                            bool with_is_argmax) {
  const int64_t ignore = ignore_index.expect_int();
  check_forward(logits, labels, temperature, ignore);
  check_sampler_params(logits, labels, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps,
                       sampler, stats_top_k);
  const Backend b = backend_for("token_logprobs", logits);
  if (b == Backend::kCpp)
    return kSamplerFwdKernel.in<SamplerKernelFwdSig>(Ns::kCppKernels)
        .call(logits, labels, 1.0 / temperature, inverse_temperatures(temperatures, labels), top_k,
              flat_param(top_ks, labels, at::kLong), top_p, flat_param(top_ps, labels, at::kDouble),
              min_p, flat_param(min_ps, labels, at::kDouble), sampler, ignore, with_entropy,
              with_sum_p2, with_lse, stats_top_k, with_is_argmax);
  return kSamplerFwd.python<SamplerFwdSig>(b).call(
      logits, labels, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps,
      sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k, with_is_argmax);
}

Tensor sampler_backward(const Tensor& grad_logprobs, const OptTensor& grad_entropy,
                        const Tensor& logits, const Tensor& labels, const Tensor& lse,
                        const Tensor& entropy, const Tensor& cut, const Tensor& cut_index,
                        double temperature, const OptTensor& temperatures, SymInt ignore_index) {
  const int64_t ignore = ignore_index.expect_int();
  const OptTensor gent = check_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy,
                                        temperature, ignore);
  check_kept_set(cut, cut_index, logits, "logits", logits.sizes().slice(0, logits.dim() - 1),
                 kRows);
  check_temperatures(temperatures, logits, "logits", labels);
  const Backend b = backend_for("token_logprobs", logits);
  if (b != Backend::kCpp)
    return kSamplerBwd.python<SamplerBwdSig>(b).call(grad_logprobs, gent, logits, labels, lse,
                                                     entropy, cut, cut_index, temperature,
                                                     temperatures, ignore_index);
  Tensor grad = new_output(logits.sizes(), logits.options());
  kSamplerBwdKernel.in<SamplerKernelBwdSig>(Ns::kCppKernels)
      .call(grad_logprobs, gent, logits, labels, lse, entropy, cut, cut_index, 1.0 / temperature,
            inverse_temperatures(temperatures, labels), ignore, grad);
  return grad;
}

class TokenLogprobsSamplerFn : public torch::autograd::Function<TokenLogprobsSamplerFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels,
                               double temperature, const OptTensor& temperatures, int64_t top_k,
                               const OptTensor& top_ks, double top_p, const OptTensor& top_ps,
                               double min_p, const OptTensor& min_ps, c10::string_view sampler,
                               SymInt ignore_index, bool with_entropy, bool with_sum_p2,
                               bool with_lse, int64_t stats_top_k, bool with_is_argmax) {
    SamplerOuts o;
    {
      BelowAutograd guard;
      o = kSamplerFwd.in<SamplerFwdSig>(Ns::kOps).call(
          logits, labels, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps,
          sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k, with_is_argmax);
    }
    auto& [lp, ent, lse, cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax] = o;
    ctx->save_for_backward(
        {logits, labels, lse, ent, cut, cut_index, temperatures.value_or(Tensor())});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["with_entropy"] = with_entropy;
    ctx->mark_non_differentiable(
        {lse, cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax});
    ctx->set_materialize_grads(false);
    return {lp, ent, lse, cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &logits = saved[0], &labels = saved[1], &lse = saved[2], &ent = saved[3],
                 &cut = saved[4], &cut_index = saved[5];
    const OptTensor temperatures = saved[6].defined() ? OptTensor(saved[6]) : std::nullopt;
    const Tensor& grad_lp = grads[0];
    const Tensor& grad_ent = grads[1];
    const Tensor glp = grad_lp.defined() ? grad_lp : at::zeros_like(lse, lse.options());
    const OptTensor gent = ctx->saved_data["with_entropy"].toBool() && grad_ent.defined()
                               ? OptTensor(grad_ent)
                               : std::nullopt;
    Tensor grad = kSamplerBwd.in<SamplerBwdSig>(Ns::kOps).call(
        glp, gent, logits, labels, lse, ent, cut, cut_index,
        ctx->saved_data["temperature"].toDouble(), temperatures,
        ctx->saved_data["ignore_index"].toSymInt());
    variable_list out(17);
    out[0] = grad;
    return out;
  }
};

SamplerOuts sampler_forward_autograd(const Tensor& logits, const Tensor& labels, double temperature,
                                     const OptTensor& temperatures, int64_t top_k,
                                     const OptTensor& top_ks, double top_p, const OptTensor& top_ps,
                                     double min_p, const OptTensor& min_ps,
                                     c10::string_view sampler, SymInt ignore_index,
                                     bool with_entropy, bool with_sum_p2, bool with_lse,
                                     int64_t stats_top_k, bool with_is_argmax) {
  if (!needs_graph(logits, labels)) {
    BelowAutograd guard;
    return kSamplerFwd.in<SamplerFwdSig>(Ns::kOps).call(
        logits, labels, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps,
        sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k, with_is_argmax);
  }
  auto o = TokenLogprobsSamplerFn::apply(logits, labels, temperature, temperatures, top_k, top_ks,
                                         top_p, top_ps, min_p, min_ps, sampler,
                                         std::move(ignore_index), with_entropy, with_sum_p2,
                                         with_lse, stats_top_k, with_is_argmax);
  return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10]};
}

}  // namespace

void check_sampler_options(const Tensor& like, const char* like_name, int64_t V,
                           const Tensor& labels, const OptTensor& temperatures, int64_t top_k,
                           const OptTensor& top_ks, double top_p, const OptTensor& top_ps,
                           double min_p, const OptTensor& min_ps, c10::string_view sampler,
                           int64_t stats_top_k) {
  check_temperatures(temperatures, like, like_name, labels);
  TORCH_CHECK_VALUE(top_k >= 0, "top_k: expected an int >= 0 (0: off), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0 && top_p <= 1, "top_p: expected a value in (0, 1] (1: off), got ",
                    top_p);
  TORCH_CHECK_VALUE(min_p >= 0 && min_p <= 1, "min_p: expected a value in [0, 1] (0: off), got ",
                    min_p);
  if (top_ks) {
    expect_index(*top_ks, "top_k");
    expect_device(*top_ks, "top_ks", like, like_name);
    expect_param_shape(*top_ks, "top_k", labels);
    if (check_values(*top_ks) && top_ks->numel() > 0)
      TORCH_CHECK_VALUE(top_ks->ge(0).all().item<bool>(),
                        "top_k: expected values >= 0 (0: off), got min ",
                        top_ks->min().item<int64_t>());
  }
  check_prob_param(top_ps, "top_p", "top_ps", false, like, like_name, labels);
  check_prob_param(min_ps, "min_p", "min_ps", true, like, like_name, labels);
  TORCH_CHECK_VALUE(sampler == "vllm" || sampler == "sglang",
                    "sampler: expected one of ('vllm', 'sglang'), got '", std::string(sampler),
                    "'");
  TORCH_CHECK_VALUE(stats_top_k >= 0 && stats_top_k <= kMaxStatsTopK, "stats_top_k: expected 0 to ",
                    kMaxStatsTopK, ", got ", stats_top_k);
  TORCH_CHECK_VALUE(stats_top_k <= V || labels.numel() == 0,
                    "stats_top_k: expected at most the vocabulary size ", V, ", got ", stats_top_k);
}

void check_kept_set(const Tensor& cut, const Tensor& cut_index, const Tensor& like,
                    const char* like_name, at::IntArrayRef rows, const char* rows_what) {
  TORCH_CHECK_VALUE(cut.defined(), "cut: expected a tensor");
  expect_dtype(cut, "cut", out_dtype(like), "the forward's output dtype");
  expect_device(cut, "cut", like, like_name);
  expect_shape(cut, "cut", rows, rows_what);
  TORCH_CHECK_VALUE(cut_index.defined(), "cut_index: expected a tensor");
  expect_dtype(cut_index, "cut_index", at::kLong, "the forward's int64 output");
  expect_device(cut_index, "cut_index", like, like_name);
  expect_shape(cut_index, "cut_index", rows, rows_what);
}

SamplerArgs sampler_args(const c10::FunctionSchema& schema) {
  auto at = [&](const char* name) {
    const auto i = schema.argumentIndexWithName(name);
    TORCH_CHECK(i.has_value(), schema.name(), ": no argument ", name, " in the schema");
    return static_cast<size_t>(*i);
  };
  SamplerArgs r{};
  r.n = schema.arguments().size();
  r.temperatures = at("temperatures");
  r.top_k = at("top_k");
  r.top_ks = at("top_ks");
  r.top_p = at("top_p");
  r.top_ps = at("top_ps");
  r.min_p = at("min_p");
  r.min_ps = at("min_ps");
  r.sampler = at("sampler");
  return r;
}

void check_sampler_args(const torch::jit::Stack& a, const SamplerArgs& s, const Tensor& like,
                        const char* like_name, int64_t V, const Tensor& labels) {
  auto opt = [&](size_t i) { return a[i].isNone() ? OptTensor() : OptTensor(a[i].toTensor()); };
  const std::string& sampler = a[s.sampler].toStringRef();
  check_sampler_options(like, like_name, V, labels, opt(s.temperatures), a[s.top_k].toInt(),
                        opt(s.top_ks), a[s.top_p].toDouble(), opt(s.top_ps), a[s.min_p].toDouble(),
                        opt(s.min_ps), c10::string_view(sampler.data(), sampler.size()), 0);
}

void check_sampler_temperatures(const OptTensor& t, const Tensor& like, const char* like_name,
                                const Tensor& labels) {
  check_temperatures(t, like, like_name, labels);
}

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  // (logprobs, entropy or empty, lse of the kept set, the kept set for the backward as (cut,
  // cut_index): x > cut, or x == cut and index <= cut_index, outside (the label is not kept),
  // then the statistics asked for, each empty when not: sum_p2, the full-vocabulary lse, the top
  // stats_top_k ids and their log-probs, is_argmax). A parameter tensor, when given, holds per-row
  // values (its shape a leading part of labels.shape) and replaces the scalar.
  m.def(
      "token_logprobs_sampler(Tensor logits, Tensor labels, float temperature, "
      "Tensor? temperatures, int top_k, Tensor? top_ks, float top_p, Tensor? top_ps, "
      "float min_p, Tensor? min_ps, str sampler, SymInt ignore_index, bool with_entropy, "
      "bool with_sum_p2, bool with_lse, int stats_top_k, bool with_is_argmax) -> (Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // d(sum(grad_logprobs * logprobs + grad_entropy * entropy)) / d logits on the kept set
  m.def(
      "token_logprobs_sampler_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
      "Tensor labels, Tensor lse, Tensor entropy, Tensor cut, Tensor cut_index, float temperature, "
      "Tensor? temperatures, SymInt ignore_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("token_logprobs_sampler", &sampler_forward);
  m.impl("token_logprobs_sampler_backward", &sampler_backward);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("token_logprobs_sampler", &sampler_forward_autograd);
}

}  // namespace ppo_kernels
