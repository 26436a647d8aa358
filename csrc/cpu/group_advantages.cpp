// GRPO / RLOO group advantages: the CPU kernel and the schema of the raw kernel. Semantics:
// ppo_kernels/group_advantages/naive.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/alloc.h"
#include "common/cpu_load.h"
#include "common/modes.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {
namespace {

using cpu::load_float;

// GRPO / RLOO advantages (kind: group_advantage_names()). Groups: group_index[i] in [0, B) or i /
// group_size. Statistics in double (so a group of equal scores has an exact mean and gives exactly
// 0).
at::Tensor group_advantages_cpu(const at::Tensor& scores_in,
                                const std::optional<at::Tensor>& group_index, int64_t group_size,
                                double eps, bool norm_by_std, const std::string& kind_name,
                                const std::optional<at::Tensor>& mask) {
  const int64_t kind = mode_index("kind", group_advantage_names(), kind_name);
  const DeviceOf dev = device_of(scores_in, "scores");
  check_arg(scores_in, "scores", dev, Kind::kFloating);
  const bool by_index = group_index.has_value() && group_index->defined();
  if (by_index) check_arg(*group_index, "group_index", dev, Kind::kIndex);
  if (mask.has_value() && mask->defined()) check_arg(*mask, "mask", dev);
  TORCH_CHECK_VALUE(scores_in.dim() == 1, "scores: expected 1 dimension (B,), got shape ",
                    shape_str(scores_in.sizes()));
  const int64_t B = scores_in.size(0);
  TORCH_CHECK_VALUE(by_index || group_size >= 1, "group_size: expected >= 1");
  std::vector<float> x(B);
  const at::Tensor scores = scores_in.contiguous();
  load_float(scores, 0, B, x.data());
  std::vector<int64_t> gid(B);
  if (by_index) {
    const at::Tensor gi = group_index->contiguous();
    TORCH_CHECK(gi.numel() == B, "group_index: expected ", B, " elements");
    AT_DISPATCH_INDEX_TYPES(gi.scalar_type(), "group_index", [&] {
      const index_t* p = gi.const_data_ptr<index_t>();
      for (int64_t i = 0; i < B; ++i) {
        TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < B, "group_index: value ", int64_t(p[i]),
                          " at position ", i, " is outside [0, B) = [0, ", B, ")");
        gid[i] = p[i];
      }
    });
  } else {
    for (int64_t i = 0; i < B; ++i) gid[i] = i / group_size;
  }
  std::vector<double> cnt(B, 0.0), sum(B, 0.0), ss(B, 0.0);
  for (int64_t i = 0; i < B; ++i) {
    cnt[gid[i]] += 1.0;
    sum[gid[i]] += x[i];
  }
  for (int64_t g = 0; g < B; ++g) sum[g] = cnt[g] > 0 ? sum[g] / cnt[g] : 0.0;  // now the mean
  for (int64_t i = 0; i < B; ++i) {
    const double c = x[i] - sum[gid[i]];
    ss[gid[i]] += c * c;
  }
  std::vector<float> adv(B);
  for (int64_t i = 0; i < B; ++i) {
    const double n = cnt[gid[i]], c = x[i] - sum[gid[i]];
    double a;
    if (kind == kGRPO) {
      if (n <= 1.0)
        a = norm_by_std ? x[i] / (1.0 + eps) : double(x[i]);  // verl: mean 0, std 1
      else if (!norm_by_std)
        a = c;
      else {  // eps = 0 on a group of equal scores: 0 (c is exactly 0 there), not 0 / 0
        const double den = std::sqrt(ss[gid[i]] / (n - 1.0)) + eps;
        a = den > 0 ? c / den : 0.0;
      }
    } else {
      a = n <= 1.0 ? double(x[i]) : c * n / (n - 1.0);  // verl's rloo: a singleton keeps its score
    }
    adv[i] = static_cast<float>(a);
  }
  const auto f32 = scores.options().dtype(at::kFloat);
  if (!(mask.has_value() && mask->defined())) {
    at::Tensor out = new_output({B}, f32);
    std::copy(adv.begin(), adv.end(), out.data_ptr<float>());
    return out;
  }
  const at::Tensor m = mask->contiguous();
  TORCH_CHECK(m.dim() == 2 && m.size(0) == B, "mask: expected [B, T]");
  const int64_t T = m.size(1);
  at::Tensor out = new_output({B, T}, f32);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      load_float(m, r * T, T, o + r * T);
      for (int64_t t = 0; t < T; ++t) o[r * T + t] *= adv[r];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "group_advantages(Tensor scores, Tensor? group_index, int group_size, float eps, bool "
      "norm_by_std, "
      "str kind, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) { m.impl("group_advantages", &group_advantages_cpu); }

}  // namespace ppo_kernels
