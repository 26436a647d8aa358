// The registered ops' backend routing (layer 4 of the layout: shared math -> kernels -> registered
// ops -> public API). Every `ppo_kernels::<op>` is defined in C++ (csrc/ops/<op>.cpp: schema,
// argument checks, an Autograd-key kernel calling the backward op, and one CPU / CUDA kernel that
// routes). A call runs one of three backends:
//   cpp     the compiled kernels (`ppo_kernels_C::*`, csrc/cpu and csrc/cuda), called through the
//           dispatcher in the namespace `set_cpp_namespace` names (the SIMT emulator's in tests);
//   triton  Python: `ppo_kernels_triton::<op>`, the op's schema, registered by its op.py;
//   eager   Python: `ppo_kernels_eager::<op>`, likewise (float64 inputs always run there).
// An op whose cpp backend is itself a Python loop around compiled kernels (linear_token_logprobs'
// chunk loop: BLAS matmuls, then the compiled tile kernels) registers it as
// `ppo_kernels_cpp::<op>` and routes there with `OpRef::python(Backend::kCpp)`.
// The choice per (op, device type) is resolved in Python (ppo_kernels/_backend.py: use_backend,
// PPO_KERNELS_BACKEND, the benchmarked defaults) and cached here, so a call costs a table read. A
// change of PPO_KERNELS_BACKEND is seen at the next call (the cached value is compared with the
// environment) and re-resolved through the Python op `ppo_kernels_py::refresh_backends`.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/types.h>

#include <array>
#include <atomic>
#include <mutex>
#include <optional>
#include <string>

namespace ppo_kernels {

enum class Backend : uint8_t { kCpp = 0, kTriton = 1, kEager = 2 };

// The backend the registered op `op` runs on for `like` (its first tensor argument): float64
// always takes the eager float64 reference, and so does an empty `like` when `eager_if_empty`
// (no kernel is needed). A backend requested by name that is unavailable raises here, naming it.
Backend backend_for(const char* op, const at::Tensor& like, bool eager_if_empty = false);

// Namespaces an op name is looked up in. kCppKernels is the one the cpp backend calls now:
// "ppo_kernels_C", or the emulator's while a test routes there (set_cpp_namespace). kCppPython:
// the Python implementations of the cpp backend ("ppo_kernels_cpp", see above).
enum class Ns : uint8_t { kOps = 0, kTriton = 1, kEager = 2, kCppPython = 3, kCppKernels = 4 };

// An op name with its dispatcher handles, looked up once per namespace (a static per call site).
class OpRef {
 public:
  explicit constexpr OpRef(const char* name) : name_(name) {}
  template <class Sig>
  c10::TypedOperatorHandle<Sig> in(Ns ns) const {
    return handle(ns).typed<Sig>();
  }
  // the Python implementation of a registered op on backend b (triton, eager, or a cpp backend
  // that is a Python loop around compiled kernels)
  template <class Sig>
  c10::TypedOperatorHandle<Sig> python(Backend b) const {
    return in<Sig>(b == Backend::kTriton ? Ns::kTriton
                   : b == Backend::kCpp  ? Ns::kCppPython
                                         : Ns::kEager);
  }
  const char* name() const { return name_; }

 private:
  static constexpr int kSlots = 8;  // 4 fixed namespaces + the cpp kernel namespaces seen
  const c10::OperatorHandle& handle(Ns ns) const;
  const char* name_;
  mutable std::array<std::optional<c10::OperatorHandle>, kSlots> handles_{};
  mutable std::array<std::atomic<bool>, kSlots> ready_{};
  mutable std::mutex mu_;
};

// Run `call` with the registered op redispatched below autograd (an Autograd-key kernel's
// forward): the op's CPU / CUDA kernel, or its fake kernel while tracing.
using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;

// Whether an Autograd-key kernel must build a graph node: grad mode on and a tensor argument
// requiring grad. When not (rollout scoring, no_grad, plain inputs) the kernel calls the op below
// autograd directly: Function::apply would still allocate a node and its context and save the
// inputs (a visible share of a small call).
template <typename... Tensors>
bool needs_graph(const Tensors&... tensors) {
  return torch::autograd::compute_requires_grad(tensors...);
}

// Whether ppo_kernels.strict_checks() is on (mirrored from Python): data-dependent checks that
// cost a host sync on the GPU (label ranges) run there too.
bool strict_checks();

// Whether the cpp backend calls the compiled kernels (ppo_kernels_C), not a test's namespace
// (set_cpp_namespace: the SIMT emulator's CUDA kernels).
bool cpp_kernels_compiled();

}  // namespace ppo_kernels
