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

// The optional row mask as a contiguous bool tensor (undefined when absent).
inline at::Tensor kl_bool_mask(const std::optional<at::Tensor>& mask_in, const at::Tensor& logits,
                               int64_t N) {
  if (!mask_in.has_value() || !mask_in->defined()) return at::Tensor();
  TORCH_CHECK(mask_in->device() == logits.device(), "mask: expected device ", logits.device());
  TORCH_CHECK(mask_in->numel() == N, "mask: expected ", N, " elements (logits.shape[:-1])");
  return mask_in->to(at::kBool).contiguous();
}

// Backward inputs: upstream gradient and the saved per-row results, contiguous float32.
struct KLGradInputs {
  at::Tensor g, kl, lz, lw, mask;
  bool need_ref;  // a ref_logits gradient buffer was passed
};

inline KLGradInputs prepare_kl_grad(const at::Tensor& grad_in, const KLRows& R,
                                    const std::optional<at::Tensor>& mask_in, const at::Tensor& kl,
                                    const at::Tensor& lz, const at::Tensor& lw, const at::Tensor& grad_logits,
                                    const std::optional<at::Tensor>& grad_ref, int64_t N) {
  const bool need_ref = grad_ref.has_value() && grad_ref->defined() && grad_ref->numel() > 0;
  TORCH_CHECK(grad_logits.is_contiguous() && (!need_ref || grad_ref->is_contiguous()),
              "full_kl backward: gradient buffers must be contiguous");
  return {grad_in.to(at::kFloat).contiguous(), kl.contiguous(), lz.contiguous(), lw.contiguous(),
          kl_bool_mask(mask_in, R.logits, N), need_ref};
}

}  // namespace ppo_kernels
