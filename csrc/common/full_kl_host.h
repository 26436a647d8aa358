// full_kl: all the host-side argument handling of the CPU and CUDA kernels (checks naming the
// argument, strided rows, output allocation), so both launchers only launch.
#pragma once
#include "common/alloc.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {

struct KLRows {
  at::Tensor logits,
      ref;            // as read (strided rows; a contiguous copy only when they do not collapse)
  RowIndexer rz, rw;  // rows of logits, of ref_logits
  int64_t N, V;
};

inline void check_kl_inv_temperature(double inv_temperature) {
  TORCH_CHECK(inv_temperature > 0 && std::isfinite(static_cast<float>(inv_temperature)),
              "inv_temperature: expected a positive value finite in float32, got ",
              inv_temperature);
}

// Per-row inverse temperatures (float64, one per row, contiguous), or nullptr: the scalar for every
// row. Their values are read on the host for CPU tensors (positive, finite in float32).
inline const double* kl_inv_temperatures(const std::optional<at::Tensor>& t, const DeviceOf& on,
                                         int64_t N) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check_arg(*t, "inv_temperatures", on);
  TORCH_CHECK_TYPE(t->scalar_type() == at::kDouble,
                   "inv_temperatures: expected dtype float64, got ", dtype_name(t->scalar_type()));
  TORCH_CHECK_VALUE(t->numel() == N && t->is_contiguous(), "inv_temperatures: expected ", N,
                    " contiguous values (one per row), got shape ", shape_str(t->sizes()));
  const double* p = t->const_data_ptr<double>();
  if (t->is_cpu()) {
    for (int64_t r = 0; r < N; ++r) check_kl_inv_temperature(p[r]);
  }
  return p;
}

inline KLRows prepare_kl_rows(const at::Tensor& logits_in, const at::Tensor& ref_in) {
  const DeviceOf dev = device_of(logits_in, "logits");
  check_arg(logits_in, "logits", dev, Kind::kFloating);
  check_arg(ref_in, "ref_logits", dev);
  TORCH_CHECK_VALUE(logits_in.dim() >= 1, "logits: expected at least 1 dimension (..., V)");
  TORCH_CHECK_VALUE(logits_in.sizes() == ref_in.sizes(), "ref_logits: expected shape ",
                    shape_str(logits_in.sizes()), " (like logits), got ",
                    shape_str(ref_in.sizes()));
  TORCH_CHECK_TYPE(logits_in.scalar_type() == ref_in.scalar_type(), "ref_logits: expected dtype ",
                   dtype_name(logits_in.scalar_type()), " (like logits), got ",
                   dtype_name(ref_in.scalar_type()));
  const int64_t V = logits_in.size(-1);
  TORCH_CHECK((logits_in.stride(-1) == 1 && ref_in.stride(-1) == 1) || V <= 1,
              "logits, ref_logits: the last (vocabulary) dimension must be contiguous");
  auto [z, rz] = rows_of(logits_in);
  auto [w, rw] = rows_of(ref_in);
  return {z, w, rz, rw, leading_numel(logits_in), V};
}

// The optional row mask as a contiguous bool tensor (undefined when absent).
inline at::Tensor kl_bool_mask(const std::optional<at::Tensor>& mask_in, const at::Tensor& logits,
                               int64_t N) {
  if (!mask_in.has_value() || !mask_in->defined()) return at::Tensor();
  check_arg(*mask_in, "mask", device_of(logits, "logits"), Kind::kAny, N, "logits.shape[:-1]");
  return mask_in->to(at::kBool).contiguous();
}

// Forward: the rows, the mask and the outputs (kl, lse_z, lse_w: float32 logits.shape[:-1]).
struct KLFwdCall {
  KLRows R;
  at::Tensor mask, kl, lz, lw;
};

inline KLFwdCall prepare_kl_fwd(const at::Tensor& logits_in, const at::Tensor& ref_in,
                                const std::optional<at::Tensor>& mask_in, double inv_temperature) {
  KLRows R = prepare_kl_rows(logits_in, ref_in);
  check_kl_inv_temperature(inv_temperature);
  TORCH_CHECK(R.V >= 1 || R.N == 0, "logits: the vocabulary dimension is empty but there are ", R.N,
              " rows");
  std::vector<int64_t> shape(logits_in.sizes().begin(), logits_in.sizes().end() - 1);
  const auto f32 = logits_in.options().dtype(at::kFloat);
  at::Tensor mask = kl_bool_mask(mask_in, logits_in, R.N);
  return {R, mask, new_output(shape, f32), new_output(shape, f32), new_output(shape, f32)};
}

// Backward: the rows, upstream gradient and saved per-row results (contiguous float32), the mask,
// and the checked gradient buffers.
struct KLGradCall {
  KLRows R;
  at::Tensor g, kl, lz, lw, mask;
  bool need_ref;  // a ref_logits gradient buffer was passed
};

inline KLGradCall prepare_kl_bwd(const at::Tensor& grad_in, const at::Tensor& logits_in,
                                 const at::Tensor& ref_in, const std::optional<at::Tensor>& mask_in,
                                 const at::Tensor& kl, const at::Tensor& lz, const at::Tensor& lw,
                                 double inv_temperature, const at::Tensor& grad_logits,
                                 const std::optional<at::Tensor>& grad_ref) {
  const DeviceOf dev = device_of(logits_in, "logits");
  for (const auto& [t, name] : {std::pair{&grad_in, "grad"},
                                {&kl, "kl"},
                                {&lz, "lse_z"},
                                {&lw, "lse_w"},
                                {&grad_logits, "grad_logits"}})
    check_arg(*t, name, dev);
  if (mask_in.has_value() && mask_in->defined()) check_arg(*mask_in, "mask", dev);
  if (grad_ref.has_value() && grad_ref->defined()) check_arg(*grad_ref, "grad_ref_logits", dev);
  KLRows R = prepare_kl_rows(logits_in, ref_in);
  check_kl_inv_temperature(inv_temperature);
  const int64_t N = R.N;
  check_arg(grad_in, "grad", dev, Kind::kFloating, N, "logits.shape[:-1]");
  check_arg(kl, "kl", dev, Kind::kFloat32, N, "logits.shape[:-1]");
  check_arg(lz, "lse_z", dev, Kind::kFloat32, N, "logits.shape[:-1]");
  check_arg(lw, "lse_w", dev, Kind::kFloat32, N, "logits.shape[:-1]");
  const bool need_ref = grad_ref.has_value() && grad_ref->defined() && grad_ref->numel() > 0;
  check_arg(grad_logits, "grad_logits", dev);
  TORCH_CHECK_VALUE(
      grad_logits.sizes() == logits_in.sizes() &&
          grad_logits.scalar_type() == logits_in.scalar_type() && grad_logits.is_contiguous(),
      "grad_logits: expected a contiguous tensor of shape ", shape_str(logits_in.sizes()),
      " and dtype ", dtype_name(logits_in.scalar_type()), " (like logits)");
  if (need_ref) {
    check_arg(*grad_ref, "grad_ref_logits", dev);
    TORCH_CHECK_VALUE(
        grad_ref->sizes() == logits_in.sizes() &&
            grad_ref->scalar_type() == logits_in.scalar_type() && grad_ref->is_contiguous(),
        "grad_ref_logits: expected a contiguous tensor of shape ", shape_str(logits_in.sizes()),
        " and dtype ", dtype_name(logits_in.scalar_type()), " (like logits)");
  }
  return {R,
          grad_in.to(at::kFloat).contiguous(),
          kl.contiguous(),
          lz.contiguous(),
          lw.contiguous(),
          kl_bool_mask(mask_in, logits_in, N),
          need_ref};
}

}  // namespace ppo_kernels
