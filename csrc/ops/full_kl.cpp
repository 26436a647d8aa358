// Registered ops `ppo_kernels::full_kl` (+ `full_kl_backward`): schemas, argument checks, backend
// routing and autograd. Kernels: csrc/cpu/full_kl.cpp and csrc/cuda/full_kl.cu (cpp),
// ppo_kernels/full_kl/op.py (triton, eager); semantics: ppo_kernels/full_kl/naive.py.
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/alloc.h"
#include "ops/checks.h"
#include "ops/route.h"
#include "ops/sampler_checks.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;

using FwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, double,
                                                  const OptTensor&);
using BwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                          const OptTensor&, const Tensor&, const Tensor&,
                                          const Tensor&, double, bool);
// the raw kernels (ppo_kernels_C): inv_temperature = 1 / T; the backward writes grad_logits (and
// grad_ref_logits when given)
// (the last: per-row inverse temperatures, or None)
using KernelFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                        const OptTensor&, double, const OptTensor&);
using KernelBwdSig = void(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                          const Tensor&, const Tensor&, const Tensor&, double, Tensor, OptTensor,
                          const OptTensor&);

const OpRef kFwd("full_kl"), kBwd("full_kl_backward"), kFwdKernel("full_kl_fwd"),
    kBwdKernel("full_kl_bwd");

constexpr const char* kRows = "logits.shape[:-1]";

void check_forward(const Tensor& logits, const Tensor& ref_logits, double temperature,
                   const OptTensor& mask) {
  expect_float(logits, "logits");
  expect_min_dim(logits, "logits", 1);
  expect_like(ref_logits, "ref_logits", logits, "logits", /*same_dtype=*/true);
  expect_rows_contiguous(logits, "logits");
  expect_rows_contiguous(ref_logits, "ref_logits");
  const auto rows = logits.sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK_VALUE(logits.size(-1) > 0 || c10::multiply_integers(rows) == 0,
                    "logits: the vocabulary dimension (last) is empty");
  expect_temperature(temperature);
  if (mask && mask->defined()) {
    expect_mask(*mask, "mask");
    expect_device(*mask, "mask", logits, "logits");
    expect_shape(*mask, "mask", rows, kRows);
  }
}

// A saved per-row result of the forward: its output dtype, logits' device, logits.shape[:-1].
void check_saved(const Tensor& t, const char* name, const Tensor& logits) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  expect_dtype(t, name, out_dtype(logits), "the forward's output dtype");
  expect_device(t, name, logits, "logits");
  expect_shape(t, name, logits.sizes().slice(0, logits.dim() - 1), kRows);
}

std::tuple<Tensor, Tensor, Tensor> forward(const Tensor& logits, const Tensor& ref_logits,
                                           double temperature, const OptTensor& mask) {
  check_forward(logits, ref_logits, temperature, mask);
  const Backend b = backend_for("full_kl", logits);
  if (b == Backend::kCpp)
    return kFwdKernel.in<KernelFwdSig>(Ns::kCppKernels)
        .call(logits, ref_logits, mask, 1.0 / temperature, std::nullopt);
  return kFwd.python<FwdSig>(b).call(logits, ref_logits, temperature, mask);
}

std::tuple<Tensor, Tensor> backward(const Tensor& grad, const Tensor& logits,
                                    const Tensor& ref_logits, const OptTensor& mask,
                                    const Tensor& kl, const Tensor& lse_z, const Tensor& lse_w,
                                    double temperature, bool need_ref) {
  check_forward(logits, ref_logits, temperature, mask);
  expect_float(grad, "grad");
  expect_device(grad, "grad", logits, "logits");
  expect_shape(grad, "grad", logits.sizes().slice(0, logits.dim() - 1), kRows);
  check_saved(kl, "kl", logits);
  check_saved(lse_z, "lse_z", logits);
  check_saved(lse_w, "lse_w", logits);
  const Backend b = backend_for("full_kl", logits);
  if (b != Backend::kCpp)
    return kBwd.python<BwdSig>(b).call(grad, logits, ref_logits, mask, kl, lse_z, lse_w,
                                       temperature, need_ref);
  Tensor gz = new_output(logits.sizes(), logits.options());
  Tensor gw = need_ref ? new_output(ref_logits.sizes(), ref_logits.options())
                       : at::empty({0}, ref_logits.options());
  kBwdKernel.in<KernelBwdSig>(Ns::kCppKernels)
      .call(grad, logits, ref_logits, mask, kl, lse_z, lse_w, 1.0 / temperature, gz,
            need_ref ? OptTensor(gw) : std::nullopt, std::nullopt);
  return {gz, gw};
}

class FullKLFn : public torch::autograd::Function<FullKLFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& ref_logits,
                               double temperature, const OptTensor& mask) {
    Tensor kl, lse_z, lse_w;
    {
      BelowAutograd guard;
      std::tie(kl, lse_z, lse_w) =
          kFwd.in<FwdSig>(Ns::kOps).call(logits, ref_logits, temperature, mask);
    }
    ctx->save_for_backward({logits, ref_logits, mask.value_or(Tensor()), kl, lse_z, lse_w});
    ctx->saved_data["temperature"] = temperature;
    ctx->mark_non_differentiable({lse_z, lse_w});
    return {kl, lse_z, lse_w};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& mask = saved[2];
    const bool need_ref = ctx->needs_input_grad(1);
    auto [gz, gw] = kBwd.in<BwdSig>(Ns::kOps).call(
        grads[0], saved[0], saved[1], mask.defined() ? OptTensor(mask) : std::nullopt, saved[3],
        saved[4], saved[5], ctx->saved_data["temperature"].toDouble(), need_ref);
    // logits, ref_logits, temperature, mask
    return {gz, need_ref ? gw : Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> forward_autograd(const Tensor& logits, const Tensor& ref_logits,
                                                    double temperature, const OptTensor& mask) {
  if (!needs_graph(logits, ref_logits, mask)) {
    BelowAutograd guard;
    return kFwd.in<FwdSig>(Ns::kOps).call(logits, ref_logits, temperature, mask);
  }
  auto out = FullKLFn::apply(logits, ref_logits, temperature, mask);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.full_kl.op");  // the fake kernels
  // (kl, lse_z, lse_w) with logits.shape[:-1]; the log-sum-exps are saved for the backward.
  m.def(
      "full_kl(Tensor logits, Tensor ref_logits, float temperature, Tensor? mask) "
      "-> (Tensor, Tensor, Tensor)");
  // (grad_logits, grad_ref_logits or an empty tensor when not need_ref)
  m.def(
      "full_kl_backward(Tensor grad, Tensor logits, Tensor ref_logits, Tensor? mask, Tensor kl, "
      "Tensor lse_z, Tensor lse_w, float temperature, bool need_ref) -> (Tensor, Tensor)");
}

// One router for every device (route.h: cpu and cuda; others are refused, naming the device).
TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("full_kl", &forward);
  m.impl("full_kl_backward", &backward);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) { m.impl("full_kl", &forward_autograd); }

}  // namespace ppo_kernels

// ---- full_kl with per-row temperatures: ppo_kernels::full_kl_row_temperature (+ backward) ------
// KL(softmax(x / T_r) || softmax(y / T_r)) with a temperature per row (the sampler's per-sequence
// or per-token temperatures, as token_logprobs takes them): its own op, so full_kl's scalar path
// stays as it was. The kernels are full_kl's, given the per-row inverse temperatures.
namespace ppo_kernels {
namespace {

using RowFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                     const OptTensor&);
using RowBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                             const OptTensor&, const Tensor&, const Tensor&,
                                             const Tensor&, const Tensor&, bool);
const OpRef kRowFwd("full_kl_row_temperature"), kRowBwd("full_kl_row_temperature_backward");

// temperatures: float, on logits' device, its shape a leading part of logits.shape[:-1]; values
// positive with a float32-finite inverse (read on the CPU; on the GPU under strict_checks()).
void check_temperatures(const Tensor& t, const Tensor& logits) {
  TORCH_CHECK_VALUE(t.defined(), "temperature: expected a tensor");
  expect_float(t, "temperature");
  expect_device(t, "temperatures", logits, "logits");  // the schema's name
  const auto rows = logits.sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK_VALUE(
      t.dim() <= static_cast<int64_t>(rows.size()) && t.sizes() == rows.slice(0, t.dim()),
      "temperature: expected a shape that is a leading part of logits.shape[:-1] ", rows,
      " (per row or per token), got ", t.sizes());
  if ((t.is_cuda() && !strict_checks()) || t.numel() == 0) return;
  constexpr double kFloat32Max = 3.4028234663852886e38;
  const Tensor d = t.to(at::kDouble);
  TORCH_CHECK_VALUE(d.gt(0).logical_and_(d.reciprocal().le(kFloat32Max)).all().item<bool>(),
                    "temperature: expected positive values whose inverse is finite in float32 (> ",
                    1.0 / kFloat32Max, "); got min ", d.min().item<double>());
}

// 1 / T per row of logits: float64, contiguous, logits.shape[:-1].numel() values.
Tensor row_inverse_temperatures(const Tensor& t, const Tensor& logits) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.resize(logits.dim() - 1, 1);
  return t.to(at::kDouble)
      .reciprocal()
      .reshape(shape)
      .expand(logits.sizes().slice(0, logits.dim() - 1))
      .reshape({-1})
      .contiguous();
}

std::tuple<Tensor, Tensor, Tensor> row_forward(const Tensor& logits, const Tensor& ref_logits,
                                               const Tensor& temperatures, const OptTensor& mask) {
  check_forward(logits, ref_logits, 1.0, mask);
  check_temperatures(temperatures, logits);
  const Backend b = backend_for("full_kl", logits);
  if (b == Backend::kCpp)
    return kFwdKernel.in<KernelFwdSig>(Ns::kCppKernels)
        .call(logits, ref_logits, mask, 1.0, row_inverse_temperatures(temperatures, logits));
  return kRowFwd.python<RowFwdSig>(b).call(logits, ref_logits, temperatures, mask);
}

std::tuple<Tensor, Tensor> row_backward(const Tensor& grad, const Tensor& logits,
                                        const Tensor& ref_logits, const OptTensor& mask,
                                        const Tensor& kl, const Tensor& lse_z, const Tensor& lse_w,
                                        const Tensor& temperatures, bool need_ref) {
  check_forward(logits, ref_logits, 1.0, mask);
  check_temperatures(temperatures, logits);
  expect_float(grad, "grad");
  expect_device(grad, "grad", logits, "logits");
  expect_shape(grad, "grad", logits.sizes().slice(0, logits.dim() - 1), kRows);
  check_saved(kl, "kl", logits);
  check_saved(lse_z, "lse_z", logits);
  check_saved(lse_w, "lse_w", logits);
  const Backend b = backend_for("full_kl", logits);
  if (b != Backend::kCpp)
    return kRowBwd.python<RowBwdSig>(b).call(grad, logits, ref_logits, mask, kl, lse_z, lse_w,
                                             temperatures, need_ref);
  Tensor gz = new_output(logits.sizes(), logits.options());
  Tensor gw = need_ref ? new_output(ref_logits.sizes(), ref_logits.options())
                       : at::empty({0}, ref_logits.options());
  kBwdKernel.in<KernelBwdSig>(Ns::kCppKernels)
      .call(grad, logits, ref_logits, mask, kl, lse_z, lse_w, 1.0, gz,
            need_ref ? OptTensor(gw) : std::nullopt,
            row_inverse_temperatures(temperatures, logits));
  return {gz, gw};
}

class FullKLRowFn : public torch::autograd::Function<FullKLRowFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& ref_logits,
                               const Tensor& temperatures, const OptTensor& mask) {
    Tensor kl, lse_z, lse_w;
    {
      BelowAutograd guard;
      std::tie(kl, lse_z, lse_w) =
          kRowFwd.in<RowFwdSig>(Ns::kOps).call(logits, ref_logits, temperatures, mask);
    }
    ctx->save_for_backward(
        {logits, ref_logits, mask.value_or(Tensor()), kl, lse_z, lse_w, temperatures});
    ctx->mark_non_differentiable({lse_z, lse_w});
    return {kl, lse_z, lse_w};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& mask = saved[2];
    const bool need_ref = ctx->needs_input_grad(1);
    auto [gz, gw] = kRowBwd.in<RowBwdSig>(Ns::kOps).call(
        grads[0], saved[0], saved[1], mask.defined() ? OptTensor(mask) : std::nullopt, saved[3],
        saved[4], saved[5], saved[6], need_ref);
    // logits, ref_logits, temperatures (a constant), mask
    return {gz, need_ref ? gw : Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> row_forward_autograd(const Tensor& logits,
                                                        const Tensor& ref_logits,
                                                        const Tensor& temperatures,
                                                        const OptTensor& mask) {
  if (!needs_graph(logits, ref_logits, mask)) {
    BelowAutograd guard;
    return kRowFwd.in<RowFwdSig>(Ns::kOps).call(logits, ref_logits, temperatures, mask);
  }
  auto out = FullKLRowFn::apply(logits, ref_logits, temperatures, mask);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  // temperatures: per-row values, their shape a leading part of logits.shape[:-1]
  m.def(
      "full_kl_row_temperature(Tensor logits, Tensor ref_logits, Tensor temperatures, "
      "Tensor? mask) -> (Tensor, Tensor, Tensor)");
  m.def(
      "full_kl_row_temperature_backward(Tensor grad, Tensor logits, Tensor ref_logits, "
      "Tensor? mask, Tensor kl, Tensor lse_z, Tensor lse_w, Tensor temperatures, bool need_ref) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("full_kl_row_temperature", &row_forward);
  m.impl("full_kl_row_temperature_backward", &row_backward);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("full_kl_row_temperature", &row_forward_autograd);
}

}  // namespace ppo_kernels

// ---- full_kl under the sampler's distribution: ppo_kernels::full_kl_sampler (+ backward) -------
// KL(q || r) with q the policy's distribution as the rollout engine sampled from it (temperature,
// min-p, top-k, top-p: token_logprobs_sampler's kept set on the policy's logits, renormalised) and
// r the reference's whole tempered softmax. Every backend runs the same two steps in Python
// (ppo_kernels/full_kl/op.py): the sampler's kernels for each row's kept set (cut, cut_index),
// then the full-KL kernels with the tokens outside it dropped. full_kl's own paths are untouched.
namespace ppo_kernels {
namespace {

using SamplerFwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, double, const OptTensor&, int64_t, const OptTensor&, double,
    const OptTensor&, double, const OptTensor&, c10::string_view, const OptTensor&);
using SamplerBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                 const OptTensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, const Tensor&,
                                                 double, const OptTensor&, bool);
const OpRef kSamplerFwd("full_kl_sampler"), kSamplerBwd("full_kl_sampler_backward");

// The per-row parameters are checked against a tensor of logits.shape[:-1] (their shape a leading
// part of it; the messages call it labels.shape, as token_logprobs' do).
Tensor rows_like(const Tensor& logits) {
  return at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kLong));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sampler_forward(
    const Tensor& logits, const Tensor& ref_logits, double temperature,
    const OptTensor& temperatures, int64_t top_k, const OptTensor& top_ks, double top_p,
    const OptTensor& top_ps, double min_p, const OptTensor& min_ps, c10::string_view sampler,
    const OptTensor& mask) {
  check_forward(logits, ref_logits, temperature, mask);
  check_sampler_options(logits, "logits", logits.size(-1), rows_like(logits), temperatures, top_k,
                        top_ks, top_p, top_ps, min_p, min_ps, sampler, 0);
  const Backend b = backend_for("full_kl", logits);
  return kSamplerFwd.python<SamplerFwdSig>(b).call(logits, ref_logits, temperature, temperatures,
                                                   top_k, top_ks, top_p, top_ps, min_p, min_ps,
                                                   sampler, mask);
}

std::tuple<Tensor, Tensor> sampler_backward(const Tensor& grad, const Tensor& logits,
                                            const Tensor& ref_logits, const OptTensor& mask,
                                            const Tensor& kl, const Tensor& lse_z,
                                            const Tensor& lse_w, const Tensor& cut,
                                            const Tensor& cut_index, double temperature,
                                            const OptTensor& temperatures, bool need_ref) {
  check_forward(logits, ref_logits, temperature, mask);
  check_sampler_temperatures(temperatures, logits, "logits", rows_like(logits));
  expect_float(grad, "grad");
  expect_device(grad, "grad", logits, "logits");
  expect_shape(grad, "grad", logits.sizes().slice(0, logits.dim() - 1), kRows);
  check_saved(kl, "kl", logits);
  check_saved(lse_z, "lse_z", logits);
  check_saved(lse_w, "lse_w", logits);
  check_kept_set(cut, cut_index, logits, "logits", logits.sizes().slice(0, logits.dim() - 1),
                 kRows);
  const Backend b = backend_for("full_kl", logits);
  return kSamplerBwd.python<SamplerBwdSig>(b).call(grad, logits, ref_logits, mask, kl, lse_z, lse_w,
                                                   cut, cut_index, temperature, temperatures,
                                                   need_ref);
}

class FullKLSamplerFn : public torch::autograd::Function<FullKLSamplerFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& ref_logits,
                               double temperature, const OptTensor& temperatures, int64_t top_k,
                               const OptTensor& top_ks, double top_p, const OptTensor& top_ps,
                               double min_p, const OptTensor& min_ps, c10::string_view sampler,
                               const OptTensor& mask) {
    Tensor kl, lse_z, lse_w, cut, cut_index;
    {
      BelowAutograd guard;
      std::tie(kl, lse_z, lse_w, cut, cut_index) = kSamplerFwd.in<SamplerFwdSig>(Ns::kOps).call(
          logits, ref_logits, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p,
          min_ps, sampler, mask);
    }
    ctx->save_for_backward({logits, ref_logits, mask.value_or(Tensor()), kl, lse_z, lse_w, cut,
                            cut_index, temperatures.value_or(Tensor())});
    ctx->saved_data["temperature"] = temperature;
    ctx->mark_non_differentiable({lse_z, lse_w, cut, cut_index});
    return {kl, lse_z, lse_w, cut, cut_index};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto opt = [](const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; };
    const bool need_ref = ctx->needs_input_grad(1);
    auto [gz, gw] = kSamplerBwd.in<SamplerBwdSig>(Ns::kOps).call(
        grads[0], saved[0], saved[1], opt(saved[2]), saved[3], saved[4], saved[5], saved[6],
        saved[7], ctx->saved_data["temperature"].toDouble(), opt(saved[8]), need_ref);
    // logits, ref_logits, then the sampler's parameters and mask (constants)
    variable_list out(12);
    out[0] = gz;
    if (need_ref) out[1] = gw;
    return out;
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sampler_forward_autograd(
    const Tensor& logits, const Tensor& ref_logits, double temperature,
    const OptTensor& temperatures, int64_t top_k, const OptTensor& top_ks, double top_p,
    const OptTensor& top_ps, double min_p, const OptTensor& min_ps, c10::string_view sampler,
    const OptTensor& mask) {
  if (!needs_graph(logits, ref_logits)) {
    BelowAutograd guard;
    return kSamplerFwd.in<SamplerFwdSig>(Ns::kOps).call(logits, ref_logits, temperature,
                                                        temperatures, top_k, top_ks, top_p, top_ps,
                                                        min_p, min_ps, sampler, mask);
  }
  auto out = FullKLSamplerFn::apply(logits, ref_logits, temperature, temperatures, top_k, top_ks,
                                    top_p, top_ps, min_p, min_ps, sampler, mask);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  // (kl, lse_z of the kept set, lse_w, the kept set as (cut, cut_index): x > cut, or x == cut and
  // index <= cut_index). A parameter tensor holds per-row values (its shape a leading part of
  // logits.shape[:-1]) and replaces the scalar.
  m.def(
      "full_kl_sampler(Tensor logits, Tensor ref_logits, float temperature, Tensor? temperatures, "
      "int top_k, Tensor? top_ks, float top_p, Tensor? top_ps, float min_p, Tensor? min_ps, "
      "str sampler, Tensor? mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "full_kl_sampler_backward(Tensor grad, Tensor logits, Tensor ref_logits, Tensor? mask, "
      "Tensor kl, Tensor lse_z, Tensor lse_w, Tensor cut, Tensor cut_index, float temperature, "
      "Tensor? temperatures, bool need_ref) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("full_kl_sampler", &sampler_forward);
  m.impl("full_kl_sampler_backward", &sampler_backward);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("full_kl_sampler", &sampler_forward_autograd);
}

}  // namespace ppo_kernels
