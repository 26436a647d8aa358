// Registered ops `ppo_kernels::kl_penalty` (+ its backward) and
// `ppo_kernels::kl_penalized_rewards`: schemas, argument checks, backend routing and autograd.
// Kernels: csrc/cpu/kl.cpp (cpp), ppo_kernels/kl/op.py (triton, eager); semantics:
// ppo_kernels/kl/naive.py.
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/modes.h"
#include "ops/checks.h"
#include "ops/route.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSig = Tensor(const Tensor&, const Tensor&, const std::string&, bool, double, double,
                      double, double);
using BwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                          const std::string&, bool, double, double, double, double,
                                          bool, bool);
using RewardsSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, const std::optional<Tensor>&,
                                                      double, const std::string&, double, double,
                                                      double, double);

const OpRef kPenalty("kl_penalty"), kPenaltyBwd("kl_penalty_backward"),
    kRewards("kl_penalized_rewards"), kFwdKernel("kl_penalty_fwd"), kBwdKernel("kl_penalty_bwd"),
    kRewardsKernel("kl_rewards_fwd");

void check_pair(const Tensor& lp, const Tensor& ref, const std::string& estimator, double in_lo,
                double in_hi, double out_lo, double out_hi) {
  expect_float(lp, "logprobs");
  expect_like(ref, "ref_logprobs", lp, "logprobs", /*same_dtype=*/true);
  mode_index("estimator", kl_estimator_names(), std::string(estimator));
  expect_bounds("clamp log_ratio", in_lo, in_hi);
  expect_bounds("clamp value", out_lo, out_hi);
}

Tensor penalty(const Tensor& lp, const Tensor& ref, const std::string& est, bool st, double in_lo,
               double in_hi, double out_lo, double out_hi) {
  check_pair(lp, ref, est, in_lo, in_hi, out_lo, out_hi);
  const Backend b = backend_for("kl_penalty", lp);
  if (b == Backend::kCpp)
    return kFwdKernel.in<FwdSig>(Ns::kCppKernels)
        .call(lp, ref, est, st, in_lo, in_hi, out_lo, out_hi);
  return kPenalty.python<FwdSig>(b).call(lp, ref, est, st, in_lo, in_hi, out_lo, out_hi);
}

std::tuple<Tensor, Tensor> penalty_backward(const Tensor& grad, const Tensor& lp, const Tensor& ref,
                                            const std::string& est, bool st, double in_lo,
                                            double in_hi, double out_lo, double out_hi,
                                            bool need_lp, bool need_ref) {
  check_pair(lp, ref, est, in_lo, in_hi, out_lo, out_hi);
  expect_float(grad, "grad");
  expect_device(grad, "grad", lp, "logprobs");
  expect_shape(grad, "grad", lp.sizes(), "like logprobs");
  const Backend b = backend_for("kl_penalty", lp);
  if (b == Backend::kCpp)
    return kBwdKernel.in<BwdSig>(Ns::kCppKernels)
        .call(grad, lp, ref, est, st, in_lo, in_hi, out_lo, out_hi, need_lp, need_ref);
  return kPenaltyBwd.python<BwdSig>(b).call(grad, lp, ref, est, st, in_lo, in_hi, out_lo, out_hi,
                                            need_lp, need_ref);
}

class PenaltyFn : public torch::autograd::Function<PenaltyFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& lp, const Tensor& ref,
                        const std::string& est, bool st, double in_lo, double in_hi, double out_lo,
                        double out_hi) {
    Tensor out;
    {
      BelowAutograd guard;
      out = kPenalty.in<FwdSig>(Ns::kOps).call(lp, ref, est, st, in_lo, in_hi, out_lo, out_hi);
    }
    ctx->save_for_backward({lp, ref});
    ctx->saved_data["est"] = est;
    ctx->saved_data["st"] = st;
    ctx->saved_data["b"] = std::vector<double>{in_lo, in_hi, out_lo, out_hi};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool need_lp = ctx->needs_input_grad(0), need_ref = ctx->needs_input_grad(1);
    const auto b = ctx->saved_data["b"].toDoubleVector();
    auto [ga, gb] = kPenaltyBwd.in<BwdSig>(Ns::kOps).call(
        grads[0], saved[0], saved[1], ctx->saved_data["est"].toStringRef(),
        ctx->saved_data["st"].toBool(), b[0], b[1], b[2], b[3], need_lp, need_ref);
    return {need_lp ? ga : Tensor(),
            need_ref ? gb : Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

Tensor penalty_autograd(const Tensor& lp, const Tensor& ref, const std::string& est, bool st,
                        double in_lo, double in_hi, double out_lo, double out_hi) {
  if (!needs_graph(lp, ref)) {
    BelowAutograd guard;
    return kPenalty.in<FwdSig>(Ns::kOps).call(lp, ref, est, st, in_lo, in_hi, out_lo, out_hi);
  }
  return PenaltyFn::apply(lp, ref, est, st, in_lo, in_hi, out_lo, out_hi);
}

std::tuple<Tensor, Tensor, Tensor> rewards(const Tensor& scores, const Tensor& lp,
                                           const Tensor& ref, const Tensor& mask,
                                           const std::optional<Tensor>& beta_t, double beta,
                                           const std::string& est, double in_lo, double in_hi,
                                           double out_lo, double out_hi) {
  check_pair(lp, ref, est, in_lo, in_hi, out_lo, out_hi);
  expect_dim(lp, "logprobs", 2);
  expect_float(scores, "scores");
  expect_device(scores, "scores", lp, "logprobs");
  expect_shape(scores, "scores", {lp.size(0)}, "one per row");
  expect_mask(mask, "mask");
  expect_device(mask, "mask", lp, "logprobs");
  expect_shape(mask, "mask", lp.sizes(), "like logprobs");
  if (beta_t) {
    expect_float(*beta_t, "beta");
    expect_device(*beta_t, "beta", lp, "logprobs");
    TORCH_CHECK_VALUE(beta_t->numel() == 1 || beta_t->numel() == lp.size(0), "beta: expected 1 or ",
                      lp.size(0), " values, got shape ", shape_str(beta_t->sizes()));
  }
  expect_finite("beta", beta);
  const Backend b = backend_for("kl_penalized_rewards", lp);
  if (b == Backend::kCpp)
    return kRewardsKernel.in<RewardsSig>(Ns::kCppKernels)
        .call(scores, lp, ref, mask, beta_t, beta, est, in_lo, in_hi, out_lo, out_hi);
  return kRewards.python<RewardsSig>(b).call(scores, lp, ref, mask, beta_t, beta, est, in_lo, in_hi,
                                             out_lo, out_hi);
}

// No derivative by design (rewards are targets: the API documents its inputs as detached): the op
// runs below autograd and its outputs carry no history whatever requires grad, with no detach
// copies in the API.
std::tuple<Tensor, Tensor, Tensor> rewards_autograd(const Tensor& scores, const Tensor& lp,
                                                    const Tensor& ref, const Tensor& mask,
                                                    const std::optional<Tensor>& beta_t,
                                                    double beta, const std::string& est,
                                                    double in_lo, double in_hi, double out_lo,
                                                    double out_hi) {
  BelowAutograd guard;
  return kRewards.in<RewardsSig>(Ns::kOps).call(scores, lp, ref, mask, beta_t, beta, est, in_lo,
                                                in_hi, out_lo, out_hi);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.kl.op");  // the fake kernels
  // estimator: a name of ppo_kernels/_modes.KL_ESTIMATORS; clamp bounds +-inf = none.
  m.def(
      "kl_penalty(Tensor logprobs, Tensor ref_logprobs, str estimator, bool straight_through, "
      "float in_lo, float in_hi, float out_lo, float out_hi) -> Tensor");
  // (grad_logprobs, grad_ref_logprobs), each an empty tensor when not needed
  m.def(
      "kl_penalty_backward(Tensor grad, Tensor logprobs, Tensor ref_logprobs, str estimator, "
      "bool straight_through, float in_lo, float in_hi, float out_lo, float out_hi, bool need_lp, "
      "bool need_ref) -> (Tensor, Tensor)");
  m.def(
      "kl_penalized_rewards(Tensor scores, Tensor logprobs, Tensor ref_logprobs, Tensor mask, "
      "Tensor? beta_t, float beta, str estimator, float in_lo, float in_hi, float out_lo, "
      "float out_hi) -> (Tensor, Tensor, Tensor)");
}

// One router for every device (route.h: cpu and cuda; others are refused, naming the device).
TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("kl_penalty", &penalty);
  m.impl("kl_penalty_backward", &penalty_backward);
  m.impl("kl_penalized_rewards", &rewards);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("kl_penalty", &penalty_autograd);
  m.impl("kl_penalized_rewards", &rewards_autograd);
}

}  // namespace ppo_kernels
