// token_logprobs_sampler: the host-side argument handling shared by the CPU and CUDA kernels
// (schemas in csrc/cpu/token_logprobs_sampler.cpp): the per-token parameter tensors and the
// outputs.
#pragma once
#include <string_view>

#include "common/alloc.h"
#include "common/tensor_checks.h"
#include "common/token_logprobs_host.h"

namespace ppo_kernels {

// A per-token parameter tensor as the raw kernels take it: `numel` contiguous values of `dtype`
// on `device`; nullptr when absent (the scalar holds for every row).
template <typename T>
const T* param_ptr(const std::optional<at::Tensor>& t, const char* name, const DeviceOf& on,
                   at::ScalarType dtype, int64_t numel) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check_arg(*t, name, on);
  TORCH_CHECK_TYPE(t->scalar_type() == dtype, name, ": expected dtype ", dtype_name(dtype),
                   ", got ", dtype_name(t->scalar_type()));
  TORCH_CHECK_VALUE(t->numel() == numel && t->is_contiguous(), name, ": expected ", numel,
                    " contiguous values (one per row), got shape ", shape_str(t->sizes()));
  return t->const_data_ptr<T>();
}

inline bool sampler_is_sglang(std::string_view sampler) {
  TORCH_CHECK_VALUE(sampler == "vllm" || sampler == "sglang",
                    "sampler: expected 'vllm' or 'sglang', got '", std::string(sampler), "'");
  return sampler == "sglang";
}

// The per-row parameters: pointers (or nullptr) and the scalars they replace.
struct SamplerParamPtrs {
  const double* inv_t;
  const int64_t* top_k;
  const double* top_p;
  const double* min_p;
  double inv_t0;
  int64_t top_k0;
  double top_p0, min_p0;
};

inline SamplerParamPtrs sampler_params(const DeviceOf& device, int64_t N, double inv_temperature,
                                       const std::optional<at::Tensor>& inv_temperatures,
                                       int64_t top_k, const std::optional<at::Tensor>& top_ks,
                                       double top_p, const std::optional<at::Tensor>& top_ps,
                                       double min_p, const std::optional<at::Tensor>& min_ps) {
  TORCH_CHECK_VALUE(inv_temperature > 0 && std::isfinite(static_cast<float>(inv_temperature)),
                    "inv_temperature: expected a positive value finite in float32, got ",
                    inv_temperature);
  TORCH_CHECK_VALUE(top_k >= 0, "top_k: expected >= 0, got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0 && top_p <= 1, "top_p: expected a value in (0, 1], got ", top_p);
  TORCH_CHECK_VALUE(min_p >= 0 && min_p <= 1, "min_p: expected a value in [0, 1], got ", min_p);
  return {param_ptr<double>(inv_temperatures, "inv_temperatures", device, at::kDouble, N),
          param_ptr<int64_t>(top_ks, "top_ks", device, at::kLong, N),
          param_ptr<double>(top_ps, "top_ps", device, at::kDouble, N),
          param_ptr<double>(min_ps, "min_ps", device, at::kDouble, N),
          inv_temperature,
          top_k,
          top_p,
          min_p};
}

struct SamplerCall {
  LogprobsCall base;  // logits, labels, rows, N, V, logprobs, entropy, lse
  at::Tensor cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
             at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  outputs() const {
    return {base.logprobs, base.entropy, base.lse, cut,    cut_index, outside,
            sum_p2,        full_lse,     top_ids,  top_lp, is_argmax};
  }
};

inline SamplerCall prepare_sampler_call(const at::Tensor& logits, const at::Tensor& labels,
                                        bool with_entropy, bool with_sum_p2, bool with_lse,
                                        int64_t stats_top_k, bool with_is_argmax) {
  LogprobsCall c = prepare_logprobs_call(logits, labels, with_entropy);
  TORCH_CHECK(stats_top_k >= 0 && stats_top_k <= 64, "stats_top_k: expected 0 to 64, got ",
              stats_top_k);
  TORCH_CHECK(stats_top_k <= c.V || c.N == 0, "stats_top_k: expected at most V = ", c.V, ", got ",
              stats_top_k);
  const at::IntArrayRef rows = c.labels.sizes();
  const auto f32 = c.labels.options().dtype(at::kFloat);
  const auto i64 = c.labels.options().dtype(at::kLong);
  const auto b8 = c.labels.options().dtype(at::kBool);
  const auto empty = [&](const at::TensorOptions& o) { return at::empty({0}, o); };
  std::vector<int64_t> top_shape(rows.begin(), rows.end());
  top_shape.push_back(stats_top_k);
  SamplerCall s{c,
                new_output(rows, f32),
                new_output(rows, i64),
                new_output(rows, b8),
                with_sum_p2 ? new_output(rows, f32) : empty(f32),
                with_lse ? new_output(rows, f32) : empty(f32),
                stats_top_k > 0 ? new_output(top_shape, i64) : empty(i64),
                stats_top_k > 0 ? new_output(top_shape, f32) : empty(f32),
                with_is_argmax ? new_output(rows, b8) : empty(b8)};
  return s;
}

}  // namespace ppo_kernels
