// Registered op `ppo_kernels::gae`: schema, argument checks, backend routing and autograd (it has
// no derivative: backward raises). Kernels: csrc/cpu/gae.cpp, csrc/cuda/gae.cu (cpp),
// ppo_kernels/gae/op.py (triton, eager); semantics: ppo_kernels/gae/naive.py.
#include <torch/library.h>

#include <string>

#include "ops/checks.h"
#include "ops/refuse_grad.h"
#include "ops/route.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Outs = std::tuple<Tensor, Tensor, Tensor, Tensor>;

using GaeSig = Outs(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                    const OptTensor&, const OptTensor&, double, double, const OptTensor&,
                    const OptTensor&, const OptTensor&);
using KernelSig = Outs(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                       const OptTensor&, const OptTensor&, double, double, const OptTensor&,
                       const OptTensor&, const OptTensor&, int64_t, int64_t);

const OpRef kGae("gae"), kGaeKernel("gae_fwd");

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// A per-token tensor argument: rewards' device and shape.
void check_per_token(const OptTensor& t, const char* name, const Tensor& rewards, bool is_float) {
  if (!given(t)) return;
  if (is_float)
    expect_float(*t, name);
  else
    expect_mask(*t, name);
  expect_device(*t, name, rewards, "rewards");
  expect_shape(*t, name, rewards.sizes(), "like rewards");
}

void check_per_row(const OptTensor& t, const char* name, const Tensor& rewards, int64_t n_rows) {
  if (!given(t)) return;
  expect_float(*t, name);
  expect_device(*t, name, rewards, "rewards");
  expect_shape(*t, name, {n_rows}, "one per row");
}

// Non-decreasing offsets from 0 to total: read on the CPU only (on a GPU a host sync; the public
// API checks them there under strict_checks()).
void check_offsets(const Tensor& cu, int64_t total) {
  const Tensor c = cu.to(at::kLong).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  const int64_t n = c.numel();
  bool ok = p[0] == 0 && p[n - 1] == total;
  for (int64_t i = 1; ok && i < n; ++i) ok = p[i] >= p[i - 1];
  if (ok) return;
  std::string got = "a violating tensor of " + std::to_string(n) + " offsets";
  if (n <= 16) {
    got = "[";
    for (int64_t i = 0; i < n; ++i) got += (i ? ", " : "") + std::to_string(p[i]);
    got += "]";
  }
  TORCH_CHECK_VALUE(false, "cu_seqlens: must be non-decreasing offsets from 0 to ", total,
                    " (the number of tokens); got ", got);
}

Outs gae(const Tensor& rewards, const Tensor& values, const OptTensor& mask_in,
         const OptTensor& dones_in, const OptTensor& gamma_t_in, const OptTensor& lam_t_in,
         double gamma, double lam, const OptTensor& init_value_in, const OptTensor& init_adv_in,
         const OptTensor& cu_seqlens_in) {
  const bool packed = given(cu_seqlens_in);
  expect_float(rewards, "rewards");
  expect_dim(rewards, "rewards", packed ? 1 : 2);
  expect_like(values, "values", rewards, "rewards", /*same_dtype=*/true);
  check_per_token(mask_in, "mask", rewards, false);
  check_per_token(dones_in, "dones", rewards, false);
  check_per_token(gamma_t_in, "gamma_t", rewards, true);
  check_per_token(lam_t_in, "lam_t", rewards, true);
  TORCH_CHECK_VALUE(given(gamma_t_in) == given(lam_t_in),
                    "gamma_t, lam_t: per-token gamma and lam come together (both or neither)");
  expect_finite("gamma", gamma);
  expect_finite("lam", lam);
  int64_t n_rows = packed ? 0 : rewards.size(0);
  if (packed) {
    const Tensor& cu = *cu_seqlens_in;
    expect_index(cu, "cu_seqlens");
    expect_device(cu, "cu_seqlens", rewards, "rewards");
    TORCH_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 1,
                      "cu_seqlens: expected (n + 1,) offsets, got shape ", shape_str(cu.sizes()));
    TORCH_CHECK_VALUE(rewards.numel() < (int64_t{1} << 31),
                      "rewards: packed inputs are limited to 2^31 - 1 tokens (int32 offsets)");
    n_rows = cu.numel() - 1;
  }
  check_per_row(init_value_in, "init_value", rewards, n_rows);
  check_per_row(init_adv_in, "init_adv", rewards, n_rows);

  const Backend b = backend_for("gae", rewards);
  if (packed && rewards.is_cpu()) check_offsets(*cu_seqlens_in, rewards.numel());
  // What every backend is given: bool masks (the cpp kernel also reads a float32 CPU mask as it
  // is: no conversion pass), float32 per-token gamma / lam and per-row carries (float64 with
  // float64 rewards, which run the eager implementation), int32 offsets.
  const bool f64 = rewards.scalar_type() == at::kDouble;
  const auto acc = f64 ? at::kDouble : at::kFloat;
  auto as_bool = [](const OptTensor& t, bool keep_float32) -> OptTensor {
    if (!given(t) || t->scalar_type() == at::kBool) return t;
    if (keep_float32 && t->scalar_type() == at::kFloat) return t;
    return t->ne(0);
  };
  auto as_acc = [&](const OptTensor& t) -> OptTensor {
    return given(t) && t->scalar_type() != acc ? OptTensor(t->to(acc)) : t;
  };
  const OptTensor mask = as_bool(mask_in, b == Backend::kCpp && rewards.is_cpu());
  const OptTensor dones = as_bool(dones_in, false);
  const OptTensor gamma_t = as_acc(gamma_t_in), lam_t = as_acc(lam_t_in);
  const OptTensor init_value = as_acc(init_value_in), init_adv = as_acc(init_adv_in);
  OptTensor cu = cu_seqlens_in;
  if (packed && cu->scalar_type() != at::kInt) cu = cu->to(at::kInt);
  if (b != Backend::kCpp)
    return kGae.python<GaeSig>(b).call(rewards, values, mask, dones, gamma_t, lam_t, gamma, lam,
                                       init_value, init_adv, cu);
  // The kernel reads any contiguous shape (N elements) and returns outputs shaped like rewards.
  auto dense = [](const OptTensor& t) -> OptTensor {
    return given(t) ? OptTensor(t->contiguous()) : t;
  };
  return kGaeKernel.in<KernelSig>(Ns::kCppKernels)
      .call(rewards.contiguous(), values.contiguous(), dense(mask), dense(dones), dense(gamma_t),
            dense(lam_t), gamma, lam, dense(init_value), dense(init_adv), cu, n_rows,
            packed ? -1 : rewards.size(-1));
}

Outs gae_autograd(const Tensor& rewards, const Tensor& values, const OptTensor& mask,
                  const OptTensor& dones, const OptTensor& gamma_t, const OptTensor& lam_t,
                  double gamma, double lam, const OptTensor& init_value, const OptTensor& init_adv,
                  const OptTensor& cu_seqlens) {
  Outs out;
  {
    BelowAutograd guard;
    out = kGae.in<GaeSig>(Ns::kOps).call(rewards, values, mask, dones, gamma_t, lam_t, gamma, lam,
                                         init_value, init_adv, cu_seqlens);
  }
  refuse_grad(
      "ppo_kernels.gae has no backward: advantages and returns are targets, not functions to "
      "differentiate. Call it under torch.no_grad() or pass detached rewards/values.",
      {std::get<0>(out), std::get<1>(out), std::get<2>(out), std::get<3>(out)}, rewards, values,
      gamma_t, lam_t, init_value, init_adv);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.gae.op");  // the fake kernel
  // rewards / values [B, T] (one float dtype), or flat [N] with cu_seqlens (int32 / int64 [n + 1]
  // row offsets); mask / dones like rewards (nonzero = action / episode end) or None; gamma_t /
  // lam_t per-token float tensors (both or neither; then gamma, lam); init_value / init_adv [rows]
  // the carry from the right edge, or None (0). Returns (advantages, returns) like rewards and the
  // carry at the left edge (value, advantage) [rows]: float32 (float64 for float64 rewards).
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor? mask, Tensor? dones, Tensor? gamma_t, "
      "Tensor? lam_t, float gamma, float lam, Tensor? init_value, Tensor? init_adv, "
      "Tensor? cu_seqlens) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) { m.impl("gae", &gae); }

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) { m.impl("gae", &gae_autograd); }

}  // namespace ppo_kernels
