// What the fused losses from hidden states share on the C++ side (linear_policy_loss,
// linear_preference_loss, linear_distill_loss): each `<op>_grads` forms the gradients of hidden,
// weight and bias in the forward; `<op>` on the CPU / CUDA keys is its value without them, and on
// the Autograd key a node that hands the formed gradients over in the backward.
#pragma once

#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <optional>
#include <string>
#include <vector>

#include "ops/route.h"

namespace ppo_kernels {
namespace fused_loss {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using torch::jit::Stack;

// An op by its full name (a clear error when its Python side, `module`, is not registered yet).
inline c10::OperatorHandle find_op(const std::string& name, const char* module) {
  auto h = c10::Dispatcher::singleton().findOp({name, ""});
  TORCH_CHECK(h.has_value(), name, " is not registered (import ppo_kernels first: ", module,
              " registers the implementations)");
  return *h;
}

// The first n_args entries of the top of the stack (the op's arguments).
inline Stack arguments(const Stack& stack, size_t n_args) {
  return Stack(stack.end() - static_cast<std::ptrdiff_t>(n_args), stack.end());
}

inline std::optional<Tensor> opt_tensor(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  return v.toTensor();
}

// `<op>` on the CPU / CUDA keys (no gradient asked for): `<op>_grads`' value.
inline void value(const c10::OperatorHandle& grads_op, Stack* stack) {
  for (int k = 0; k < 3; ++k) stack->emplace_back(false);
  grads_op.callBoxed(stack);
  torch::jit::drop(*stack, 3);  // the (empty) gradients
}

// The autograd node of `<op>`: GradsOp returns `<op>_grads`; kOutputs: the op's outputs, the loss
// first (the only differentiable one).
template <const c10::OperatorHandle& (*GradsOp)(), int64_t kOutputs>
class LossFn : public torch::autograd::Function<LossFn<GradsOp, kOutputs>> {
 public:
  // args: every argument of the op (hidden, weight and bias are also the autograd inputs before
  // it); need_*: whether each gradient is asked for
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight,
                               const std::optional<Tensor>& bias, Stack args, bool need_h,
                               bool need_w, bool need_b) {
    {
      BelowAutograd guard;
      args.emplace_back(need_h);
      args.emplace_back(need_w);
      args.emplace_back(need_b);
      GradsOp().callBoxed(&args);
    }
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(args.size()) == kOutputs + 3);
    variable_list out;
    for (int64_t k = 0; k < kOutputs; ++k) out.push_back(args[k].toTensor());
    ctx->save_for_backward(
        {args[kOutputs].toTensor(), args[kOutputs + 1].toTensor(), args[kOutputs + 2].toTensor()});
    ctx->saved_data["need"] = std::vector<bool>{need_h, need_w, need_b};
    ctx->saved_data["dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->mark_non_differentiable(variable_list(out.begin() + 1, out.end()));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto need = ctx->saved_data["need"].toBoolList();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const Tensor& g = grads[0];
    variable_list out(7);
    if (!g.defined()) return out;
    // The gradients were formed for an upstream gradient of 1. When it is 1 (loss.backward()) and
    // the graph is not kept, they are handed over as they are: no second [V, H] weight gradient
    // at the peak (this node releases them before AccumulateGrad takes them over). Read only where
    // that costs no sync and traces nothing: a plain CPU tensor, no graph of the gradient.
    // Otherwise scaled out of place: a retained graph's second backward (gradcheck's, for one)
    // must find them unscaled and unshared. grad_hidden is in hidden's dtype, grad_weight /
    // grad_bias float32 sums until here.
    const bool unit = !torch::autograd::get_current_graph_task_keep_graph() &&
                      g.device().is_cpu() && g.numel() == 1 && !g.requires_grad() &&
                      !at::isTensorSubclassLike(g) && g.item<double>() == 1.0;
    const auto scaled = [&](const Tensor& t) { return unit ? t : t * g; };
    if (need[0]) out[0] = scaled(saved[0]);
    if (need[1]) out[1] = scaled(saved[1]).to(dtype);
    if (need[2]) out[2] = scaled(saved[2]).to(dtype);
    return out;
  }
};

// `<op>` on the Autograd key: the gradients of the inputs that require one, formed in the forward.
// n: the op's argument count; hidden_i, weight_i, bias_i: those arguments' positions.
template <const c10::OperatorHandle& (*GradsOp)(), int64_t kOutputs>
void autograd_call(Stack* stack, size_t n, size_t hidden_i, size_t weight_i, size_t bias_i) {
  Stack args = arguments(*stack, n);
  torch::jit::drop(*stack, n);
  const Tensor hidden = args[hidden_i].toTensor(), weight = args[weight_i].toTensor();
  const auto bias = opt_tensor(args[bias_i]);
  const bool grad = at::GradMode::is_enabled();
  const bool need_h = grad && hidden.requires_grad(), need_w = grad && weight.requires_grad();
  const bool need_b = grad && bias.has_value() && bias->requires_grad();
  variable_list out = LossFn<GradsOp, kOutputs>::apply(hidden, weight, bias, std::move(args),
                                                       need_h, need_w, need_b);
  for (auto& t : out) stack->emplace_back(std::move(t));
}

}  // namespace fused_loss
}  // namespace ppo_kernels
