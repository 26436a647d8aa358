// Registered op `ppo_kernels::group_advantages` (GRPO / RLOO): schema, argument checks, backend
// routing and autograd (none: the advantages are targets, backward raises). Kernels:
// csrc/cpu/losses.cpp (cpp), ppo_kernels/group_advantages/op.py (triton, eager); semantics:
// ppo_kernels/group_advantages/naive.py.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "common/modes.h"
#include "ops/checks.h"
#include "ops/refuse_grad.h"
#include "ops/route.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Sig = Tensor(const Tensor&, const OptTensor&, int64_t, double, bool, const std::string&,
                   const OptTensor&);

const OpRef kOp("group_advantages"), kKernel("group_advantages");

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// group ids in [0, B): read on the CPU only (on a GPU a host sync; the public API checks them
// there under strict_checks(), and the GPU kernels give NaN for such rows).
void check_group_ids(const Tensor& gi, int64_t B) {
  const Tensor g = gi.contiguous();
  AT_DISPATCH_INDEX_TYPES(g.scalar_type(), "group_index", [&] {
    const index_t* p = g.const_data_ptr<index_t>();
    for (int64_t i = 0; i < B; ++i)
      TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < B, "group_index: value ", int64_t(p[i]),
                        " at position ", i, " is outside [0, B) = [0, ", B,
                        "); pass e.g. torch.unique(ids, return_inverse=True)[1]");
  });
}

Tensor group_advantages(const Tensor& scores, const OptTensor& group_index, int64_t group_size,
                        double eps, bool norm_by_std, const std::string& kind,
                        const OptTensor& mask) {
  expect_float(scores, "scores");
  expect_dim(scores, "scores", 1);
  const int64_t B = scores.size(0);
  if (given(group_index)) {
    expect_index(*group_index, "group_index");
    expect_device(*group_index, "group_index", scores, "scores");
    expect_shape(*group_index, "group_index", {B}, "like scores");
  } else {
    TORCH_CHECK_VALUE(group_size >= 1, "group_size: expected an int >= 1, got ", group_size);
  }
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps: expected a non-negative number, got ",
                    eps);
  mode_index("kind", group_advantage_names(), kind);
  if (given(mask)) {
    expect_mask(*mask, "mask");
    expect_device(*mask, "mask", scores, "scores");
    TORCH_CHECK_VALUE(mask->dim() == 2 && mask->size(0) == B, "mask: expected shape (", B,
                      ", T) (one row per score), got ", shape_str(mask->sizes()));
  }
  const Backend b = backend_for("group_advantages", scores);
  if (b == Backend::kCpp)  // the kernel checks the group ids itself
    return kKernel.in<Sig>(Ns::kCppKernels)
        .call(scores, group_index, group_size, eps, norm_by_std, kind, mask);
  if (given(group_index) && scores.is_cpu()) check_group_ids(*group_index, B);
  return kOp.python<Sig>(b).call(scores, group_index, group_size, eps, norm_by_std, kind, mask);
}

Tensor group_advantages_autograd(const Tensor& scores, const OptTensor& group_index,
                                 int64_t group_size, double eps, bool norm_by_std,
                                 const std::string& kind, const OptTensor& mask) {
  Tensor out;
  {
    BelowAutograd guard;
    out = kOp.in<Sig>(Ns::kOps).call(scores, group_index, group_size, eps, norm_by_std, kind, mask);
  }
  refuse_grad(
      "ppo_kernels::group_advantages has no backward: advantages are targets; pass detached "
      "scores (the public grpo_advantages / rloo_advantages detach them)",
      {out}, scores, mask);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.group_advantages.op");  // the fake kernel
  // scores [B]; group_index [B] (values in [0, B)) or None and group_size >= 1 (contiguous
  // groups); kind: a name of _modes.GROUP_ADVANTAGES ("grpo", "rloo"); mask [B, T] or None (the
  // advantage broadcast over each row's tokens). float32 [B] or [B, T] (float64 for float64).
  m.def(
      "group_advantages(Tensor scores, Tensor? group_index, int group_size, float eps, "
      "bool norm_by_std, str kind, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("group_advantages", &group_advantages);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("group_advantages", &group_advantages_autograd);
}

}  // namespace ppo_kernels
