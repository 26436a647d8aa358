// The Python module `ppo_kernels._C`. It exposes no Python functions: every kernel is a
// torch.library op in the `ppo_kernels_C` namespace, defined (TORCH_LIBRARY_FRAGMENT) next to its
// CPU kernel in csrc/cpu/<op>.cpp, with its CUDA kernel in csrc/cuda/<op>.cu. Importing the module
// registers them. The public ops (`torch.ops.ppo_kernels.*`) are defined in Python, which picks a
// backend (these kernels, Triton or eager) per call.
#include <Python.h>
#include <torch/library.h>

#include "common/alloc.h"
#include "common/modes.h"

namespace ppo_kernels {

bool& poison_outputs() {
  static bool flag = false;
  return flag;
}

bool set_poison(bool enabled) {
  const bool old = poison_outputs();
  poison_outputs() = enabled;
  return old;
}

bool& batch_invariant_mode() {
  static bool flag = false;
  return flag;
}

bool set_batch_invariant(bool enabled) {
  const bool old = batch_invariant_mode();
  batch_invariant_mode() = enabled;
  return old;
}

std::vector<std::string> mode_names(const std::string& table) {
  if (table == "agg") return agg_names();
  if (table == "kl_estimator") return kl_estimator_names();
  if (table == "group_advantage") return group_advantage_names();
  if (table == "clip_loss_type") return clip_loss_type_names();
  TORCH_CHECK_VALUE(false, "table: unknown mode table '", table, "'");
  return {};
}

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // Test hook: NaN-fill every output buffer the kernels allocate. Returns the previous setting.
  m.def("set_poison(bool enabled) -> bool", &set_poison);
  // ppo_kernels.batch_invariant() (Python keeps the stack; this is its top). Returns the previous
  // setting.
  m.def("set_batch_invariant(bool enabled) -> bool", &set_batch_invariant);
  // The name tables of csrc/common/modes.h ("agg", "kl_estimator", "group_advantage",
  // "clip_loss_type"), so a test
  // can check the Python tables against them.
  m.def("mode_names(str table) -> str[]", &mode_names);
}

}  // namespace ppo_kernels

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
