// Registered ops `ppo_kernels::masked_mean` and `ppo_kernels::masked_whiten` (+ their backward
// ops): schemas, argument checks, backend routing and autograd. Kernels: csrc/cpu/masked_stats.cpp
// (cpp, CPU), ppo_kernels/masked_stats/op.py (eager: CUDA, float64 and the reference).
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/checks.h"
#include "ops/route.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using MeanSig = Tensor(const Tensor&, const Tensor&, at::OptionalIntArrayRef, const std::string&);
using MeanBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, at::OptionalIntArrayRef,
                          const std::string&);
using WhitenSig = Tensor(const Tensor&, const Tensor&, bool, bool, double);
using WhitenBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, bool, bool, double);

const OpRef kMean("masked_mean"), kMeanBwd("masked_mean_backward"), kWhiten("masked_whiten"),
    kWhitenBwd("masked_whiten_backward"), kMeanFwdKernel("masked_mean_fwd"),
    kMeanBwdKernel("masked_mean_bwd"), kWhitenFwdKernel("masked_whiten_fwd"),
    kWhitenBwdKernel("masked_whiten_bwd");

void check_x_mask(const Tensor& x, const Tensor& mask) {
  expect_float(x, "x");
  expect_mask(mask, "mask");
  expect_device(mask, "mask", x, "x");
  expect_shape(mask, "mask", x.sizes(), "like x");
}

void check_mean_args(const Tensor& x, at::OptionalIntArrayRef dim, const std::string& empty) {
  TORCH_CHECK_VALUE(empty == "zero" || empty == "nan",
                    "empty: expected one of ('zero', 'nan'), got '", empty, "'");
  if (!dim.has_value()) return;
  const int64_t nd = std::max<int64_t>(x.dim(), 1);  // a 0-dim x takes dim 0 / -1, as torch.sum
  uint64_t seen = 0;
  for (const int64_t d : *dim) {
    TORCH_CHECK_INDEX(d >= -nd && d < nd, "dim: ", d, " is out of range for a tensor of ", x.dim(),
                      " dimensions");
    const int64_t w = d < 0 ? d + nd : d;
    TORCH_CHECK_VALUE(w >= 64 || !(seen >> w & 1), "dim: dimension ", w, " appears twice");
    if (w < 64) seen |= uint64_t{1} << w;
  }
}

void check_whiten_args(double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps: expected a non-negative number, got ",
                    eps);
}

Tensor mean(const Tensor& x, const Tensor& mask, at::OptionalIntArrayRef dim,
            const std::string& empty) {
  check_x_mask(x, mask);
  check_mean_args(x, dim, empty);
  const Backend b = backend_for("masked_mean", x);
  if (b == Backend::kCpp)
    return kMeanFwdKernel.in<MeanSig>(Ns::kCppKernels).call(x, mask, dim, empty);
  return kMean.python<MeanSig>(b).call(x, mask, dim, empty);
}

Tensor mean_backward(const Tensor& grad, const Tensor& x, const Tensor& mask,
                     at::OptionalIntArrayRef dim, const std::string& empty) {
  check_x_mask(x, mask);
  check_mean_args(x, dim, empty);
  expect_float(grad, "grad");
  expect_device(grad, "grad", x, "x");
  const Backend b = backend_for("masked_mean", x);
  if (b == Backend::kCpp)
    return kMeanBwdKernel.in<MeanBwdSig>(Ns::kCppKernels).call(grad, x, mask, dim, empty);
  return kMeanBwd.python<MeanBwdSig>(b).call(grad, x, mask, dim, empty);
}

Tensor whiten(const Tensor& x, const Tensor& mask, bool shift_mean, bool unbiased, double eps) {
  check_x_mask(x, mask);
  check_whiten_args(eps);
  const Backend b = backend_for("masked_whiten", x);
  if (b == Backend::kCpp)
    return kWhitenFwdKernel.in<WhitenSig>(Ns::kCppKernels).call(x, mask, shift_mean, unbiased, eps);
  return kWhiten.python<WhitenSig>(b).call(x, mask, shift_mean, unbiased, eps);
}

Tensor whiten_backward(const Tensor& grad, const Tensor& x, const Tensor& mask, bool shift_mean,
                       bool unbiased, double eps) {
  check_x_mask(x, mask);
  check_whiten_args(eps);
  expect_float(grad, "grad");
  expect_device(grad, "grad", x, "x");
  expect_shape(grad, "grad", x.sizes(), "like x");
  const Backend b = backend_for("masked_whiten", x);
  if (b == Backend::kCpp)
    return kWhitenBwdKernel.in<WhitenBwdSig>(Ns::kCppKernels)
        .call(grad, x, mask, shift_mean, unbiased, eps);
  return kWhitenBwd.python<WhitenBwdSig>(b).call(grad, x, mask, shift_mean, unbiased, eps);
}

// Only x is differentiable (the mask selects and weights; its gradient is not defined here), so
// only x decides whether the call builds a graph node.

class MeanFn : public torch::autograd::Function<MeanFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& mask,
                        at::OptionalIntArrayRef dim, const std::string& empty) {
    Tensor out;
    {
      BelowAutograd guard;
      out = kMean.in<MeanSig>(Ns::kOps).call(x, mask, dim, empty);
    }
    ctx->save_for_backward({x, mask});
    ctx->saved_data["dim"] = dim.has_value() ? c10::IValue(dim->vec()) : c10::IValue();
    ctx->saved_data["empty"] = empty;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const c10::IValue& d = ctx->saved_data["dim"];
    std::vector<int64_t> dims;
    at::OptionalIntArrayRef dim = std::nullopt;
    if (!d.isNone()) {
      dims = d.toIntVector();
      dim = dims;
    }
    Tensor gx = kMeanBwd.in<MeanBwdSig>(Ns::kOps).call(grads[0], saved[0], saved[1], dim,
                                                       ctx->saved_data["empty"].toStringRef());
    return {gx, Tensor(), Tensor(), Tensor()};
  }
};

Tensor mean_autograd(const Tensor& x, const Tensor& mask, at::OptionalIntArrayRef dim,
                     const std::string& empty) {
  if (!needs_graph(x)) {
    BelowAutograd guard;
    return kMean.in<MeanSig>(Ns::kOps).call(x, mask, dim, empty);
  }
  return MeanFn::apply(x, mask, dim, empty);
}

class WhitenFn : public torch::autograd::Function<WhitenFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& mask, bool shift_mean,
                        bool unbiased, double eps) {
    Tensor out;
    {
      BelowAutograd guard;
      out = kWhiten.in<WhitenSig>(Ns::kOps).call(x, mask, shift_mean, unbiased, eps);
    }
    ctx->save_for_backward({x, mask});
    ctx->saved_data["shift_mean"] = shift_mean;
    ctx->saved_data["unbiased"] = unbiased;
    ctx->saved_data["eps"] = eps;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    Tensor gx = kWhitenBwd.in<WhitenBwdSig>(Ns::kOps).call(
        grads[0], saved[0], saved[1], ctx->saved_data["shift_mean"].toBool(),
        ctx->saved_data["unbiased"].toBool(), ctx->saved_data["eps"].toDouble());
    return {gx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor whiten_autograd(const Tensor& x, const Tensor& mask, bool shift_mean, bool unbiased,
                       double eps) {
  if (!needs_graph(x)) {
    BelowAutograd guard;
    return kWhiten.in<WhitenSig>(Ns::kOps).call(x, mask, shift_mean, unbiased, eps);
  }
  return WhitenFn::apply(x, mask, shift_mean, unbiased, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.masked_stats.op");  // the fake kernels
  // mean of x over mask != 0 (a float mask weights) over `dim` (None: everything); empty: "zero"
  // or "nan" for a set of total weight 0. float32 (float64 for float64 x).
  m.def("masked_mean(Tensor x, Tensor mask, int[]? dim, str empty) -> Tensor");
  m.def(
      "masked_mean_backward(Tensor grad, Tensor x, Tensor mask, int[]? dim, str empty) -> Tensor");
  m.def(
      "masked_whiten(Tensor x, Tensor mask, bool shift_mean, bool unbiased, float eps) -> Tensor");
  m.def(
      "masked_whiten_backward(Tensor grad, Tensor x, Tensor mask, bool shift_mean, bool unbiased, "
      "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("masked_mean", &mean);
  m.impl("masked_mean_backward", &mean_backward);
  m.impl("masked_whiten", &whiten);
  m.impl("masked_whiten_backward", &whiten_backward);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("masked_mean", &mean_autograd);
  m.impl("masked_whiten", &whiten_autograd);
}

}  // namespace ppo_kernels
