// full_kl: the host-side argument handling shared by the CPU and CUDA kernels.
#pragma once
#include "common/tensor_checks.h"

namespace ppo_kernels {

struct KLRows {
  at::Tensor logits, ref;  // as read (strided rows; a contiguous copy only when they do not collapse)
  RowIndexer rz, rw;       // rows of logits, of ref_logits
};

inline KLRows prepare_kl_rows(const at::Tensor& logits_in, const at::Tensor& ref_in) {
  TORCH_CHECK(logits_in.dim() >= 1 && logits_in.stride(-1) == 1 && ref_in.stride(-1) == 1,
              "logits, ref_logits: the last (vocabulary) dimension must be contiguous");
  TORCH_CHECK(logits_in.sizes() == ref_in.sizes(), "ref_logits: expected shape ", logits_in.sizes());
  TORCH_CHECK(logits_in.scalar_type() == ref_in.scalar_type(), "ref_logits: expected dtype ",
              logits_in.scalar_type());
  auto [z, rz] = rows_of(logits_in);
  auto [w, rw] = rows_of(ref_in);
  return {z, w, rz, rw};
}

}  // namespace ppo_kernels
