// Registered ops `ppo_kernels::ppo_policy_loss`, `ppo_kernels::ppo_value_loss` and
// `ppo_kernels::masked_aggregate`, `ppo_kernels::pairwise_logsigmoid_loss` (+ their backward ops):
// schemas, argument checks, backend routing and autograd. Each forward returns (loss [], stats [n],
// row_coef [B]) (masked_aggregate: no stats); row_coef (d loss / d (mask * token loss) per row) is
// saved for the backward op, which recomputes the per-token gradient from the inputs
// (masked_aggregate's from the mask alone). Kernels: csrc/cpu/losses.cpp (cpp),
// ppo_kernels/losses/op.py (triton, eager); semantics: ppo_kernels/losses/naive.py.
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>

#include "common/modes.h"
#include "ops/checks.h"
#include "ops/plain_node.h"
#include "ops/route.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using std::optional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Out3 = std::tuple<Tensor, Tensor, Tensor>;

using PolicySig = Out3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double,
                       optional<double>, double, const std::string&, double,
                       const optional<Tensor>&, optional<double>);
using PolicyBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, double, double, optional<double>, double);
using ValueSig = Out3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, optional<double>,
                      const std::string&, double, const optional<Tensor>&, optional<double>);
using ValueBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, optional<double>);

using Out2 = std::tuple<Tensor, Tensor>;
using AggSig = Out2(const Tensor&, const Tensor&, const std::string&, double,
                    const optional<Tensor>&, optional<double>);
using AggBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, at::ScalarType);

using PairSig = Out2(const Tensor&, const Tensor&, const optional<Tensor>&, const optional<Tensor>&,
                     double, const std::string&);
using PairBwdSig = Out2(const Tensor&, const Tensor&, double, at::ScalarType, at::ScalarType);

const OpRef kPair("pairwise_logsigmoid_loss"), kPairBwd("pairwise_logsigmoid_loss_backward"),
    kPairKernel("pairwise_logsigmoid_loss_fwd"), kPairBwdKernel("pairwise_logsigmoid_loss_bwd");
const OpRef kAgg("masked_aggregate"), kAggBwd("masked_aggregate_backward"),
    kAggKernel("masked_aggregate_fwd"), kAggBwdKernel("masked_aggregate_bwd");
const OpRef kPolicy("ppo_policy_loss"), kPolicyBwd("ppo_policy_loss_backward"),
    kValue("ppo_value_loss"), kValueBwd("ppo_value_loss_backward"),
    kPolicyKernel("ppo_policy_loss_fwd"), kPolicyBwdKernel("ppo_policy_loss_bwd"),
    kValueKernel("ppo_value_loss_fwd"), kValueBwdKernel("ppo_value_loss_bwd");

// The names of a loss's three [B, T] inputs, and "like <first>" for the shape messages.
struct Names {
  const char* x;
  const char* y;
  const char* z;
};
constexpr Names kPolicyNames{"logprobs", "old_logprobs", "advantages"};
constexpr Names kValueNames{"values", "old_values", "returns"};

// [B, T] float inputs of one shape on one device, and the mask like them.
void check_inputs(const Names& n, const Tensor& x, const Tensor& y, const Tensor& z,
                  const Tensor& mask) {
  expect_float(x, n.x);
  expect_dim(x, n.x, 2);
  expect_float(y, n.y);
  expect_like(y, n.y, x, n.x, /*same_dtype=*/false);
  expect_float(z, n.z);
  expect_like(z, n.z, x, n.x, /*same_dtype=*/false);
  expect_mask(mask, "mask");
  expect_like(mask, "mask", x, n.x, /*same_dtype=*/false);
}

void check_aggregation(const Names& n, const Tensor& x, const std::string& agg,
                       const optional<Tensor>& global_denom) {
  mode_index("agg", agg_names(), agg);
  if (global_denom) {
    expect_mask(*global_denom, "global_denom");  // a count: bool, integer or float
    expect_device(*global_denom, "global_denom", x, n.x);
    TORCH_CHECK_VALUE(global_denom->numel() == 1,
                      "global_denom: expected a single value, got shape ",
                      shape_str(global_denom->sizes()));
  }
}

void check_backward(const Names& n, const Tensor& grad_loss, const Tensor& x, const Tensor& y,
                    const Tensor& z, const Tensor& mask, const Tensor& row_coef) {
  check_inputs(n, x, y, z, mask);
  expect_float(grad_loss, "grad_loss");
  expect_device(grad_loss, "grad_loss", x, n.x);
  expect_shape(grad_loss, "grad_loss", {}, "the loss");
  TORCH_CHECK_VALUE(row_coef.defined(), "row_coef: expected a tensor");
  expect_dtype(row_coef, "row_coef", out_dtype(x), "the forward's output");
  expect_device(row_coef, "row_coef", x, n.x);
  expect_shape(row_coef, "row_coef", {x.size(0)}, "one per row");
}

// ------------------------------------------------------------------------------ routing
// The kernels take contiguous rows (a no-op for what the public API passes); an empty input
// needs no kernel (eager).
Out3 policy(const Tensor& lp, const Tensor& old, const Tensor& adv, const Tensor& mask,
            double clip_low, double clip_high, optional<double> dual_clip, double lr_clamp,
            const std::string& agg, double scale, const optional<Tensor>& gd,
            optional<double> gdv) {
  check_inputs(kPolicyNames, lp, old, adv, mask);
  check_aggregation(kPolicyNames, lp, agg, gd);
  const Backend b = backend_for("ppo_policy_loss", lp, /*eager_if_empty=*/true);
  const auto& h = b == Backend::kCpp ? kPolicyKernel.in<PolicySig>(Ns::kCppKernels)
                                     : kPolicy.python<PolicySig>(b);
  return h.call(lp.contiguous(), old.contiguous(), adv.contiguous(), mask.contiguous(), clip_low,
                clip_high, dual_clip, lr_clamp, agg, scale, gd, gdv);
}

Tensor policy_backward(const Tensor& grad, const Tensor& lp, const Tensor& old, const Tensor& adv,
                       const Tensor& mask, const Tensor& coef, double clip_low, double clip_high,
                       optional<double> dual_clip, double lr_clamp) {
  check_backward(kPolicyNames, grad, lp, old, adv, mask, coef);
  const Backend b = backend_for("ppo_policy_loss", lp, /*eager_if_empty=*/true);
  const auto& h = b == Backend::kCpp ? kPolicyBwdKernel.in<PolicyBwdSig>(Ns::kCppKernels)
                                     : kPolicyBwd.python<PolicyBwdSig>(b);
  return h.call(grad, lp.contiguous(), old.contiguous(), adv.contiguous(), mask.contiguous(),
                coef.contiguous(), clip_low, clip_high, dual_clip, lr_clamp);
}

Out3 value(const Tensor& v, const Tensor& vo, const Tensor& ret, const Tensor& mask,
           optional<double> clip, const std::string& agg, double scale, const optional<Tensor>& gd,
           optional<double> gdv) {
  check_inputs(kValueNames, v, vo, ret, mask);
  check_aggregation(kValueNames, v, agg, gd);
  const Backend b = backend_for("ppo_value_loss", v, /*eager_if_empty=*/true);
  const auto& h =
      b == Backend::kCpp ? kValueKernel.in<ValueSig>(Ns::kCppKernels) : kValue.python<ValueSig>(b);
  return h.call(v.contiguous(), vo.contiguous(), ret.contiguous(), mask.contiguous(), clip, agg,
                scale, gd, gdv);
}

Tensor value_backward(const Tensor& grad, const Tensor& v, const Tensor& vo, const Tensor& ret,
                      const Tensor& mask, const Tensor& coef, optional<double> clip) {
  check_backward(kValueNames, grad, v, vo, ret, mask, coef);
  const Backend b = backend_for("ppo_value_loss", v, /*eager_if_empty=*/true);
  const auto& h = b == Backend::kCpp ? kValueBwdKernel.in<ValueBwdSig>(Ns::kCppKernels)
                                     : kValueBwd.python<ValueBwdSig>(b);
  return h.call(grad, v.contiguous(), vo.contiguous(), ret.contiguous(), mask.contiguous(),
                coef.contiguous(), clip);
}

// masked_aggregate: loss_mat [B, T] (the API flattens leading dims), mask like it.
Out2 aggregate(const Tensor& x, const Tensor& mask, const std::string& agg, double scale,
               const optional<Tensor>& gd, optional<double> gdv) {
  expect_float(x, "loss_mat");
  expect_dim(x, "loss_mat", 2);
  expect_mask(mask, "mask");
  expect_like(mask, "mask", x, "loss_mat", /*same_dtype=*/false);
  check_aggregation(Names{"loss_mat", nullptr, nullptr}, x, agg, gd);
  const Backend b = backend_for("masked_aggregate", x, /*eager_if_empty=*/true);
  const auto& h =
      b == Backend::kCpp ? kAggKernel.in<AggSig>(Ns::kCppKernels) : kAgg.python<AggSig>(b);
  return h.call(x.contiguous(), mask.contiguous(), agg, scale, gd, gdv);
}

Tensor aggregate_backward(const Tensor& grad, const Tensor& mask, const Tensor& coef,
                          at::ScalarType dtype) {
  expect_mask(mask, "mask");
  expect_dim(mask, "mask", 2);
  expect_float(grad, "grad_loss");
  expect_device(grad, "grad_loss", mask, "mask");
  expect_shape(grad, "grad_loss", {}, "the loss");
  TORCH_CHECK_VALUE(coef.defined(), "row_coef: expected a tensor");
  expect_device(coef, "row_coef", mask, "mask");
  expect_shape(coef, "row_coef", {mask.size(0)}, "one per row");
  TORCH_CHECK_TYPE(at::isFloatingType(dtype), "dtype: expected a floating dtype, got ", dtype);
  // the forward's backend: float64 (and empty) ran eager, so its row_coef is float64
  const Backend b = coef.scalar_type() == at::kDouble
                        ? Backend::kEager
                        : backend_for("masked_aggregate", mask, /*eager_if_empty=*/true);
  const auto& h = b == Backend::kCpp ? kAggBwdKernel.in<AggBwdSig>(Ns::kCppKernels)
                                     : kAggBwd.python<AggBwdSig>(b);
  return h.call(grad, mask.contiguous(), coef.contiguous(), dtype);
}

// pairwise_logsigmoid_loss: the pairs of reward_model_loss / dpo_loss, any shape (one per pair).
Out2 pairwise(const Tensor& chosen, const Tensor& rejected, const optional<Tensor>& ref_chosen,
              const optional<Tensor>& ref_rejected, double beta, const std::string& reduction) {
  expect_float(chosen, "chosen");
  expect_float(rejected, "rejected");
  expect_like(rejected, "rejected", chosen, "chosen", /*same_dtype=*/false);
  TORCH_CHECK_VALUE(ref_chosen.has_value() == ref_rejected.has_value(),
                    "ref_chosen, ref_rejected: expected both or neither");
  if (ref_chosen) {
    expect_float(*ref_chosen, "ref_chosen");
    expect_like(*ref_chosen, "ref_chosen", chosen, "chosen", /*same_dtype=*/false);
    expect_float(*ref_rejected, "ref_rejected");
    expect_like(*ref_rejected, "ref_rejected", chosen, "chosen", /*same_dtype=*/false);
  }
  expect_positive("beta", beta);
  mode_index("reduction", reduction_names(), reduction);
  const Backend b = backend_for("pairwise_logsigmoid_loss", chosen);
  const auto& h =
      b == Backend::kCpp ? kPairKernel.in<PairSig>(Ns::kCppKernels) : kPair.python<PairSig>(b);
  return h.call(chosen, rejected, ref_chosen, ref_rejected, beta, reduction);
}

Out2 pairwise_backward(const Tensor& grad, const Tensor& coef, double beta,
                       at::ScalarType chosen_dtype, at::ScalarType rejected_dtype) {
  expect_float(grad, "grad_loss");
  TORCH_CHECK_VALUE(coef.defined(), "coef: expected a tensor");
  expect_device(grad, "grad_loss", coef, "coef");
  if (grad.dim() > 0) expect_shape(grad, "grad_loss", coef.sizes(), "one per pair");
  TORCH_CHECK_TYPE(at::isFloatingType(chosen_dtype) && at::isFloatingType(rejected_dtype),
                   "chosen_dtype, rejected_dtype: expected floating dtypes, got ", chosen_dtype,
                   ", ", rejected_dtype);
  // the forward's backend: float64 ran eager, so its coef is float64
  const Backend b = coef.scalar_type() == at::kDouble
                        ? Backend::kEager
                        : backend_for("pairwise_logsigmoid_loss", coef);
  const auto& h = b == Backend::kCpp ? kPairBwdKernel.in<PairBwdSig>(Ns::kCppKernels)
                                     : kPairBwd.python<PairBwdSig>(b);
  return h.call(grad, coef, beta, chosen_dtype, rejected_dtype);
}

// ------------------------------------------------------------------------------ autograd
// The gradient flows to the first input only (logprobs / values); stats and row_coef are not
// differentiable. An unused loss (grad undefined) gives no gradient.
variable_list loss_outputs(AutogradContext* ctx, const Out3& out, const Tensor& x, const Tensor& y,
                           const Tensor& z, const Tensor& mask) {
  const auto& [loss, stats, coef] = out;
  ctx->save_for_backward({x, y, z, mask, coef});
  ctx->mark_non_differentiable({stats, coef});
  return {loss, stats, coef};
}

template <size_t N>
variable_list first_grad(const Tensor& g) {
  variable_list out(N);
  out[0] = g;
  return out;
}

class PolicyFn : public torch::autograd::Function<PolicyFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& lp, const Tensor& old,
                               const Tensor& adv, const Tensor& mask, double clip_low,
                               double clip_high, optional<double> dual_clip, double lr_clamp,
                               const std::string& agg, double scale, const optional<Tensor>& gd,
                               optional<double> gdv) {
    Out3 out;
    {
      BelowAutograd guard;
      out = kPolicy.in<PolicySig>(Ns::kOps).call(lp, old, adv, mask, clip_low, clip_high, dual_clip,
                                                 lr_clamp, agg, scale, gd, gdv);
    }
    ctx->saved_data["clip"] = std::vector<double>{clip_low, clip_high, lr_clamp};
    ctx->saved_data["dual"] = dual_clip;
    return loss_outputs(ctx, out, lp, old, adv, mask);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return variable_list(12);
    const auto s = ctx->get_saved_variables();
    const auto c = ctx->saved_data["clip"].toDoubleVector();
    return first_grad<12>(kPolicyBwd.in<PolicyBwdSig>(Ns::kOps).call(
        grads[0], s[0], s[1], s[2], s[3], s[4], c[0], c[1],
        ctx->saved_data["dual"].toOptional<double>(), c[2]));
  }
};

class ValueFn : public torch::autograd::Function<ValueFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& v, const Tensor& vo,
                               const Tensor& ret, const Tensor& mask, optional<double> clip,
                               const std::string& agg, double scale, const optional<Tensor>& gd,
                               optional<double> gdv) {
    Out3 out;
    {
      BelowAutograd guard;
      out = kValue.in<ValueSig>(Ns::kOps).call(v, vo, ret, mask, clip, agg, scale, gd, gdv);
    }
    ctx->saved_data["clip"] = clip;
    return loss_outputs(ctx, out, v, vo, ret, mask);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return variable_list(9);
    const auto s = ctx->get_saved_variables();
    return first_grad<9>(kValueBwd.in<ValueBwdSig>(Ns::kOps).call(
        grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["clip"].toOptional<double>()));
  }
};

// The gradient flows to loss_mat only; the backward needs the mask and row_coef, not loss_mat.
class AggFn : public torch::autograd::Function<AggFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& mask,
                               const std::string& agg, double scale, const optional<Tensor>& gd,
                               optional<double> gdv) {
    Out2 out;
    {
      BelowAutograd guard;
      out = kAgg.in<AggSig>(Ns::kOps).call(x, mask, agg, scale, gd, gdv);
    }
    const auto& [loss, coef] = out;
    ctx->save_for_backward({mask, coef});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->mark_non_differentiable({coef});
    return {loss, coef};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return variable_list(6);
    const auto s = ctx->get_saved_variables();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return first_grad<6>(kAggBwd.in<AggBwdSig>(Ns::kOps).call(grads[0], s[0], s[1], dtype));
  }
};

// The same node built by hand for plain tensors (ops/plain_node.h). Gradient edge: loss_mat.
struct AggBackward final : torch::autograd::Node {
  torch::autograd::SavedVariable mask, coef;
  at::ScalarType dtype = at::kFloat;

  std::string name() const override { return "MaskedAggregateBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    mask.reset_data();
    coef.reset_data();
  }
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined() || !task_should_compute_output(0)) return variable_list(1);
    return {aggregate_backward(grads[0], mask.unpack(), coef.unpack(), dtype)};
  }
};

Out2 aggregate_plain(const Tensor& x, const Tensor& mask, const std::string& agg, double scale,
                     const optional<Tensor>& gd, optional<double> gdv) {
  check_functorch();
  Tensor loss, coef;
  {
    BelowAutograd guard;
    std::tie(loss, coef) = aggregate(x, mask, agg, scale, gd, gdv);
  }
  auto node = make_node<AggBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(loss, node);  // row_coef is not differentiable
  node->mask = torch::autograd::SavedVariable(mask, false);
  node->coef = torch::autograd::SavedVariable(coef, false);
  node->dtype = x.scalar_type();
  node_created(node);
  return {loss, coef};
}

Out2 aggregate_autograd(const Tensor& x, const Tensor& mask, const std::string& agg, double scale,
                        const optional<Tensor>& gd, optional<double> gdv) {
  if (!needs_graph(x)) {
    BelowAutograd guard;
    return kAgg.in<AggSig>(Ns::kOps).call(x, mask, agg, scale, gd, gdv);
  }
  if (all_plain(x, mask, gd)) return aggregate_plain(x, mask, agg, scale, gd, gdv);
  const variable_list out = AggFn::apply(x, mask, agg, scale, gd, gdv);
  return {out[0], out[1]};
}

// The pair loss's input gradients from (d / d chosen, d / d rejected): d / d ref_rejected =
// d / d chosen and d / d ref_chosen = d / d rejected, each in its input's dtype (dtypes: chosen,
// rejected, ref_chosen, ref_rejected); need(i): whether input i (an edge: the references are
// inputs 2 and 3 when given) wants its gradient.
template <class Need>
void pair_input_grads(variable_list& out, const Tensor& gc, const Tensor& gr, bool refs,
                      const std::array<at::ScalarType, 4>& dtypes, Need need) {
  if (need(0)) out[0] = gc;
  if (need(1)) out[1] = gr;
  if (refs && need(2)) out[2] = gr.to(dtypes[2]);
  if (refs && need(3)) out[3] = gc.to(dtypes[3]);
}

// One node for the whole loss (the composition has four): the backward reads coef only.
class PairFn : public torch::autograd::Function<PairFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& chosen, const Tensor& rejected,
                               const optional<Tensor>& ref_chosen,
                               const optional<Tensor>& ref_rejected, double beta,
                               const std::string& reduction) {
    Out2 out;
    {
      BelowAutograd guard;
      out = kPair.in<PairSig>(Ns::kOps).call(chosen, rejected, ref_chosen, ref_rejected, beta,
                                             reduction);
    }
    const auto& [loss, coef] = out;
    ctx->save_for_backward({coef});
    ctx->saved_data["beta"] = beta;
    ctx->saved_data["refs"] = ref_chosen.has_value();
    const auto dt = [](const optional<Tensor>& t) {
      return static_cast<int64_t>(t ? t->scalar_type() : at::kFloat);
    };
    ctx->saved_data["dtypes"] =
        std::vector<int64_t>{dt(chosen), dt(rejected), dt(ref_chosen), dt(ref_rejected)};
    ctx->mark_non_differentiable({coef});
    return {loss, coef};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(6);
    if (!grads[0].defined()) return out;
    const auto coef = ctx->get_saved_variables()[0];
    const auto dts = ctx->saved_data["dtypes"].toIntVector();
    std::array<at::ScalarType, 4> dtypes;
    for (size_t i = 0; i < dtypes.size(); ++i) dtypes[i] = static_cast<at::ScalarType>(dts[i]);
    const auto [gc, gr] = kPairBwd.in<PairBwdSig>(Ns::kOps).call(
        grads[0], coef, ctx->saved_data["beta"].toDouble(), dtypes[0], dtypes[1]);
    // needs_input_grad counts the tensor inputs given: the references are edges 2, 3 if given
    pair_input_grads(out, gc, gr, ctx->saved_data["refs"].toBool(), dtypes,
                     [&](int i) { return ctx->needs_input_grad(i); });
    return out;
  }
};

// The same node built by hand for plain tensors (ops/plain_node.h: PairFn's bookkeeping is most of
// a reward-model batch's per-call cost). Gradient edges: chosen, rejected (, ref_chosen,
// ref_rejected).
struct PairBackward final : torch::autograd::Node {
  torch::autograd::SavedVariable coef;
  double beta = 1.0;
  std::array<at::ScalarType, 4> dtypes{};
  bool refs = false;

  std::string name() const override { return "PairwiseLogsigmoidLossBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    coef.reset_data();
  }
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(refs ? 4 : 2);
    if (!grads[0].defined()) return out;
    const auto [gc, gr] = pairwise_backward(grads[0], coef.unpack(), beta, dtypes[0], dtypes[1]);
    pair_input_grads(out, gc, gr, refs, dtypes,
                     [&](int i) { return task_should_compute_output(i); });
    return out;
  }
};

Out2 pairwise_plain(const Tensor& chosen, const Tensor& rejected,
                    const optional<Tensor>& ref_chosen, const optional<Tensor>& ref_rejected,
                    double beta, const std::string& reduction) {
  check_functorch();
  const bool refs = ref_chosen.has_value() && ref_rejected.has_value();
  Tensor loss, coef;
  {
    BelowAutograd guard;
    std::tie(loss, coef) = pairwise(chosen, rejected, ref_chosen, ref_rejected, beta, reduction);
  }
  auto node = make_node<PairBackward>();
  node->set_next_edges(
      refs ? torch::autograd::collect_next_edges(chosen, rejected, *ref_chosen, *ref_rejected)
           : torch::autograd::collect_next_edges(chosen, rejected));
  torch::autograd::set_history(loss, node);  // coef is not differentiable
  node->coef = torch::autograd::SavedVariable(coef, false);
  node->beta = beta;
  node->refs = refs;
  node->dtypes = {chosen.scalar_type(), rejected.scalar_type(),
                  refs ? ref_chosen->scalar_type() : at::kFloat,
                  refs ? ref_rejected->scalar_type() : at::kFloat};
  node_created(node);
  return {loss, coef};
}

Out2 pairwise_autograd(const Tensor& chosen, const Tensor& rejected,
                       const optional<Tensor>& ref_chosen, const optional<Tensor>& ref_rejected,
                       double beta, const std::string& reduction) {
  if (!needs_graph(chosen, rejected, ref_chosen, ref_rejected)) {
    BelowAutograd guard;
    return kPair.in<PairSig>(Ns::kOps).call(chosen, rejected, ref_chosen, ref_rejected, beta,
                                            reduction);
  }
  if (all_plain(chosen, rejected, ref_chosen, ref_rejected))
    return pairwise_plain(chosen, rejected, ref_chosen, ref_rejected, beta, reduction);
  const variable_list out =
      PairFn::apply(chosen, rejected, ref_chosen, ref_rejected, beta, reduction);
  return {out[0], out[1]};
}

Out3 as_tuple(const variable_list& v) { return {v[0], v[1], v[2]}; }

Out3 policy_autograd(const Tensor& lp, const Tensor& old, const Tensor& adv, const Tensor& mask,
                     double clip_low, double clip_high, optional<double> dual_clip, double lr_clamp,
                     const std::string& agg, double scale, const optional<Tensor>& gd,
                     optional<double> gdv) {
  if (!needs_graph(lp, old, adv, mask, gd)) {
    BelowAutograd guard;
    return kPolicy.in<PolicySig>(Ns::kOps).call(lp, old, adv, mask, clip_low, clip_high, dual_clip,
                                                lr_clamp, agg, scale, gd, gdv);
  }
  return as_tuple(PolicyFn::apply(lp, old, adv, mask, clip_low, clip_high, dual_clip, lr_clamp, agg,
                                  scale, gd, gdv));
}

Out3 value_autograd(const Tensor& v, const Tensor& vo, const Tensor& ret, const Tensor& mask,
                    optional<double> clip, const std::string& agg, double scale,
                    const optional<Tensor>& gd, optional<double> gdv) {
  if (!needs_graph(v, vo, ret, mask, gd)) {
    BelowAutograd guard;
    return kValue.in<ValueSig>(Ns::kOps).call(v, vo, ret, mask, clip, agg, scale, gd, gdv);
  }
  return as_tuple(ValueFn::apply(v, vo, ret, mask, clip, agg, scale, gd, gdv));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.losses.op");  // the fake kernels
  // Returns (loss [], stats [n], row_coef [B]). [B, T] inputs; agg: a name of
  // ppo_kernels/_modes.AGG_MODES; dual_clip None: no dual clip; global_denom / global_denom_value:
  // the aggregation's denominator (none: the local one); scale multiplies the loss (dp_size, 1 /
  // loss_scale_factor).
  m.def(
      "ppo_policy_loss(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, "
      "float clip_low, float clip_high, float? dual_clip, float log_ratio_clamp, str agg, "
      "float scale, Tensor? global_denom, float? global_denom_value) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "ppo_policy_loss_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, "
      "Tensor advantages, Tensor mask, Tensor row_coef, float clip_low, float clip_high, "
      "float? dual_clip, float log_ratio_clamp) -> Tensor");
  // clip None: unclipped
  m.def(
      "ppo_value_loss(Tensor values, Tensor old_values, Tensor returns, Tensor mask, float? clip, "
      "str agg, float scale, Tensor? global_denom, float? global_denom_value) "
      "-> (Tensor, Tensor, Tensor)");
  // (loss [], row_coef [B]); loss_mat [B, T]; the gradient of loss_mat has its dtype
  m.def(
      "masked_aggregate(Tensor loss_mat, Tensor mask, str agg, float scale, Tensor? global_denom, "
      "float? global_denom_value) -> (Tensor, Tensor)");
  m.def(
      "masked_aggregate_backward(Tensor grad_loss, Tensor mask, Tensor row_coef, ScalarType dtype) "
      "-> Tensor");
  m.def(
      "ppo_value_loss_backward(Tensor grad_loss, Tensor values, Tensor old_values, "
      "Tensor returns, Tensor mask, Tensor row_coef, float? clip) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.losses.pairwise");  // the fake kernels
  // reward_model_loss / dpo_loss: (loss, coef = d loss / d z per pair), z = beta * ((chosen -
  // ref_chosen) - (rejected - ref_rejected)), the references both or neither; reduction: mean,
  // sum or none. The backward returns the gradients of chosen and rejected (their negations are
  // those of ref_rejected and ref_chosen).
  m.def(
      "pairwise_logsigmoid_loss(Tensor chosen, Tensor rejected, Tensor? ref_chosen, "
      "Tensor? ref_rejected, float beta, str reduction) -> (Tensor, Tensor)");
  m.def(
      "pairwise_logsigmoid_loss_backward(Tensor grad_loss, Tensor coef, float beta, "
      "ScalarType chosen_dtype, ScalarType rejected_dtype) -> (Tensor, Tensor)");
}

// One router for every device (route.h: cpu and cuda; others are refused, naming the device).
TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("ppo_policy_loss", &policy);
  m.impl("ppo_policy_loss_backward", &policy_backward);
  m.impl("ppo_value_loss", &value);
  m.impl("ppo_value_loss_backward", &value_backward);
  m.impl("masked_aggregate", &aggregate);
  m.impl("masked_aggregate_backward", &aggregate_backward);
  m.impl("pairwise_logsigmoid_loss", &pairwise);
  m.impl("pairwise_logsigmoid_loss_backward", &pairwise_backward);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("ppo_policy_loss", &policy_autograd);
  m.impl("ppo_value_loss", &value_autograd);
  m.impl("masked_aggregate", &aggregate_autograd);
  m.impl("pairwise_logsigmoid_loss", &pairwise_autograd);
}

}  // namespace ppo_kernels
