// The Python module `ppo_kernels._C`. It exposes no Python functions: every kernel is a
// torch.library op in the `ppo_kernels_C` namespace, defined (TORCH_LIBRARY_FRAGMENT) next to its
// CPU kernel in csrc/cpu/<op>.cpp, with its CUDA kernel in csrc/cuda/<op>.cu. Importing the module
// registers them. The public ops (`torch.ops.ppo_kernels.*`) are defined in Python, which picks a
// backend (these kernels, Triton or eager) per call.
#include <Python.h>
#include <torch/library.h>

#include "common/alloc.h"

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

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // Test hook: NaN-fill every output buffer the kernels allocate. Returns the previous setting.
  m.def("set_poison(bool enabled) -> bool", &set_poison);
}

}  // namespace ppo_kernels

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
