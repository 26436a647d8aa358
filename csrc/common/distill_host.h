// distill: the host-side argument handling of the distillation tile kernels (checks naming the
// argument, the mode by name, the outputs), so the kernels only compute.
#pragma once
#include <string>
#include <vector>

#include "common/alloc.h"
#include "common/distill_math.h"
#include "common/modes.h"
#include "common/tensor_checks.h"
#include "common/token_logprobs_host.h"

namespace ppo_kernels {

inline const std::vector<std::string>& distill_divergence_names() {
  static const std::vector<std::string> names = {"forward_kl", "reverse_kl", "jsd", "tv"};
  return names;
}

// The tiles: student and teacher [N, V], one float dtype, rows of any stride, the vocabulary
// contiguous; labels [N] (optional), mask [N] (optional); the mode and its beta.
struct DistillCall {
  at::Tensor s, t, labels, mask;  // labels int64 contiguous, mask bool contiguous (or undefined)
  int64_t N, V, ss, ts;           // rows, vocabulary, row strides
  int mode;
  float beta, inv_t;
};

// One tile or per-row tensor argument: TypeError for its dtype, ValueError for its device.
inline void check_distill_arg(const at::Tensor& t, const char* name, const at::Device& device,
                              bool floating) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  const at::ScalarType st = t.scalar_type();
  if (floating) {
    TORCH_CHECK_TYPE(
        st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble, name,
        ": expected a float dtype (float32, bfloat16, float16, float64), got ", st);
  }
  check_device(t, name, device, "student");
}

inline DistillCall prepare_distill(const at::Tensor& student, const at::Tensor& teacher,
                                   const std::optional<at::Tensor>& labels_in,
                                   const std::optional<at::Tensor>& mask_in, double inv_temperature,
                                   const std::string& divergence, double beta,
                                   int64_t ignore_index) {
  check_distill_arg(student, "student", student.device(), true);
  check_distill_arg(teacher, "teacher", student.device(), true);
  TORCH_CHECK_VALUE(student.dim() == 2, "student: expected a [N, V] tile, got shape ",
                    shape_str(student.sizes()));
  TORCH_CHECK_VALUE(teacher.sizes() == student.sizes(), "teacher: expected shape ",
                    shape_str(student.sizes()), " (like student), got ",
                    shape_str(teacher.sizes()));
  TORCH_CHECK_TYPE(teacher.scalar_type() == student.scalar_type(), "teacher: expected dtype ",
                   student.scalar_type(), " (like student), got ", teacher.scalar_type());
  const int64_t N = student.size(0), V = student.size(1);
  TORCH_CHECK_VALUE((student.stride(1) == 1 && teacher.stride(1) == 1) || V <= 1,
                    "student, teacher: the vocabulary (last) dimension must be contiguous");
  TORCH_CHECK_VALUE(V >= 1 || N == 0, "student: the vocabulary dimension is empty but there are ",
                    N, " rows");
  TORCH_CHECK_VALUE(inv_temperature > 0 && std::isfinite(static_cast<float>(inv_temperature)),
                    "inv_temperature: expected a positive value finite in float32, got ",
                    inv_temperature);
  const int mode =
      static_cast<int>(mode_index("divergence", distill_divergence_names(), divergence));
  if (mode == kJSD) {
    TORCH_CHECK_VALUE(beta > 0 && beta < 1, "beta: jsd needs 0 < beta < 1 (beta 0 is forward_kl, ",
                      "1 is reverse_kl), got ", beta);
  }
  at::Tensor labels, mask;
  if (labels_in.has_value() && labels_in->defined()) {
    const at::Tensor& l = *labels_in;
    check_distill_arg(l, "labels", student.device(), false);
    TORCH_CHECK_TYPE(l.scalar_type() == at::kLong || l.scalar_type() == at::kInt,
                     "labels: expected dtype int64 or int32, got ", l.scalar_type());
    TORCH_CHECK_VALUE(l.numel() == N, "labels: expected ", N,
                      " elements (student.shape[0]), got shape ", shape_str(l.sizes()));
    labels = labels_in->to(at::kLong).contiguous();
    if (labels.is_cpu()) check_labels_on_host(labels, V, ignore_index);
  }
  if (mask_in.has_value() && mask_in->defined()) {
    check_distill_arg(*mask_in, "mask", student.device(), false);
    TORCH_CHECK_VALUE(mask_in->numel() == N, "mask: expected ", N,
                      " elements (student.shape[0]), got shape ", shape_str(mask_in->sizes()));
    mask = mask_in->to(at::kBool).contiguous();
  }
  return {student,
          teacher,
          labels,
          mask,
          N,
          V,
          student.stride(0),
          teacher.stride(0),
          mode,
          static_cast<float>(beta),
          static_cast<float>(inv_temperature)};
}

// A saved per-row float32 tensor of the backward (lse_s, lse_t, aux, lse_hard, grad, grad_hard).
inline at::Tensor distill_row_arg(const at::Tensor& t, const char* name, const DistillCall& c) {
  check_distill_arg(t, name, c.s.device(), true);
  TORCH_CHECK_VALUE(t.numel() == c.N, name, ": expected ", c.N,
                    " elements (student.shape[0]), got shape ", shape_str(t.sizes()));
  return t.to(at::kFloat).contiguous();
}

}  // namespace ppo_kernels
