// token_logprobs: the host-side argument handling shared by the CPU and CUDA forward kernels.
#pragma once
#include <ATen/Dispatch.h>

#include "common/alloc.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {

// Every label of a CPU tensor read on the host: an IndexError naming the first one outside
// [0, V) that is not ignore_index, by its flat position (the CPU kernels run it before any work).
inline void check_labels_on_host(const at::Tensor& labels, int64_t V, int64_t ignore_index) {
  AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "check_labels", [&] {
    const index_t* lab = labels.const_data_ptr<index_t>();
    for (int64_t i = 0; i < labels.numel(); ++i) {
      const int64_t l = lab[i];
      TORCH_CHECK_INDEX(l == ignore_index || (l >= 0 && l < V), "labels: value ", l,
                        " at flat position ", i, " is outside the vocabulary [0, ", V,
                        ") and is not ignore_index (", ignore_index, ")");
    }
  });
}

struct LogprobsCall {
  at::Tensor logits, labels;  // logits as read (strided rows), labels contiguous
  RowIndexer rows;
  int64_t N, V;
  at::Tensor logprobs, entropy, lse;  // outputs (entropy empty when not requested)
};

inline LogprobsCall prepare_logprobs_call(const at::Tensor& logits_in, const at::Tensor& labels_in,
                                          bool with_entropy) {
  const DeviceOf dev = device_of(logits_in, "logits");
  check_arg(logits_in, "logits", dev, Kind::kFloating);
  check_arg(labels_in, "labels", dev, Kind::kIndex);
  TORCH_CHECK_VALUE(logits_in.dim() >= 1, "logits: expected at least 1 dimension (..., V)");
  TORCH_CHECK_VALUE(logits_in.stride(-1) == 1 || logits_in.size(-1) <= 1,
                    "logits: the last (vocabulary) dimension must be contiguous");
  const int64_t V = logits_in.size(-1);
  const int64_t N = leading_numel(logits_in);
  check_arg(labels_in, "labels", dev, Kind::kIndex, N, "logits.shape[:-1]");
  at::Tensor labels = labels_in.contiguous();
  TORCH_CHECK_VALUE(V >= 1 || N == 0, "logits: the vocabulary dimension is empty but there are ", N,
                    " rows");
  auto [logits, rows] = rows_of(logits_in);
  const auto f32 = labels.options().dtype(at::kFloat);
  return {logits,
          labels,
          rows,
          N,
          V,
          new_output(labels.sizes(), f32),
          with_entropy ? new_output(labels.sizes(), f32) : at::empty({0}, f32),
          new_output(labels.sizes(), f32)};
}

struct LogprobsGradCall {
  at::Tensor labels, glp, gent, lse, ent;  // contiguous; gent / ent undefined without entropy grad
  RowIndexer rows, grad_rows;              // logits rows (read), grad_logits rows (written)
  int64_t N, V;
  // Pointers for the kernels (nullptr where there is no entropy gradient).
  const float* gent_ptr() const { return gent.defined() ? gent.const_data_ptr<float>() : nullptr; }
  const float* ent_ptr() const { return ent.defined() ? ent.const_data_ptr<float>() : nullptr; }
};

inline LogprobsGradCall prepare_logprobs_grad_call(const at::Tensor& grad_logprobs,
                                                   const std::optional<at::Tensor>& grad_entropy,
                                                   const at::Tensor& logits,
                                                   const at::Tensor& labels, const at::Tensor& lse,
                                                   const at::Tensor& entropy,
                                                   const at::Tensor& grad_logits) {
  const DeviceOf dev = device_of(logits, "logits");
  check_arg(logits, "logits", dev, Kind::kFloating);
  check_arg(grad_logits, "grad_logits", dev);
  check_arg(labels, "labels", dev, Kind::kIndex);
  check_arg(grad_logprobs, "grad_logprobs", dev, Kind::kFloating);
  check_arg(lse, "lse", dev, Kind::kFloat32);
  check_arg(entropy, "entropy", dev);  // read only with an entropy gradient; on the device anyway
  if (grad_entropy.has_value() && grad_entropy->defined())
    check_arg(*grad_entropy, "grad_entropy", dev);
  TORCH_CHECK_VALUE(logits.dim() >= 1, "logits: expected at least 1 dimension (..., V)");
  const int64_t N = leading_numel(logits), V = logits.size(-1);
  TORCH_CHECK_VALUE(grad_logits.sizes() == logits.sizes(), "grad_logits: expected shape ",
                    shape_str(logits.sizes()), " (like logits), got ",
                    shape_str(grad_logits.sizes()));
  TORCH_CHECK_TYPE(grad_logits.scalar_type() == logits.scalar_type(),
                   "grad_logits: expected dtype ", dtype_name(logits.scalar_type()),
                   " (like logits), got ", dtype_name(grad_logits.scalar_type()));
  TORCH_CHECK_VALUE((logits.stride(-1) == 1 && grad_logits.stride(-1) == 1) || V <= 1,
                    "logits, grad_logits: the last (vocabulary) dimension must be contiguous");
  check_arg(labels, "labels", dev, Kind::kIndex, N, "logits.shape[:-1]");
  check_arg(grad_logprobs, "grad_logprobs", dev, Kind::kFloating, N, "logits.shape[:-1]");
  check_arg(lse, "lse", dev, Kind::kFloat32, N, "logits.shape[:-1]");
  const bool has_ent =
      grad_entropy.has_value() && grad_entropy->defined() && grad_entropy->numel() > 0;
  if (has_ent) {
    check_arg(*grad_entropy, "grad_entropy", dev, Kind::kFloating, N, "logits.shape[:-1]");
    check_arg(entropy, "entropy", dev, Kind::kFloat32, N, "logits.shape[:-1]");
  }
  auto rin = make_row_indexer(logits);
  auto rout = make_row_indexer(grad_logits);
  TORCH_CHECK(rin && rout, "logits: more than ", kMaxRowDims,
              " leading dimensions that do not collapse; make logits contiguous");
  return {labels.contiguous(),
          grad_logprobs.to(at::kFloat).contiguous(),
          has_ent ? grad_entropy->to(at::kFloat).contiguous() : at::Tensor(),
          lse.contiguous(),
          has_ent ? entropy.contiguous() : at::Tensor(),
          *rin,
          *rout,
          N,
          V};
}

}  // namespace ppo_kernels
