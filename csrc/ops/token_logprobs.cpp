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
