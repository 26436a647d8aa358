// Output allocation for every kernel. Tests switch on poisoning (ppo_kernels_C::set_poison), so
// any output element a kernel fails to write reads back as NaN (or -1 for integers) instead of
// whatever the allocator left there.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace ppo_kernels {

bool& poison_outputs();  // defined in csrc/ext.cpp
// Batch-invariant mode (ppo_kernels.batch_invariant(), set through
// ppo_kernels_C::set_batch_invariant): the CUDA launchers pass it to the kernels whose reduction
// order would otherwise follow a row's memory alignment. Defined in csrc/ext.cpp.
bool& batch_invariant_mode();

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison_outputs()) {
    if (at::isFloatingType(t.scalar_type()))
      t.fill_(NAN);
    else
      t.fill_(-1);
  }
  return t;
}

}  // namespace ppo_kernels
