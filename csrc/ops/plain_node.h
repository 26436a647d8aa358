// Hand-built graph nodes for calls on plain tensors (layer 4). torch::autograd::Function's generic
// bookkeeping -- the context's saved_data map, per-input and per-output records, the output
// wrapping -- costs a small call more than its arithmetic: bench/bench_overhead.py's small calls
// of the ops that build one show it, no trainer step does (bench/results/cpu_overhead_tricks.md).
// An op whose per-call cost matters builds its node the way PyTorch's generated autograd code does:
// a `torch::autograd::Node` with SavedVariable members, its next edges, and its outputs' history.
// Only for plain tensors: fake, functional, batched (functorch), meta or subclass tensors, a
// dispatch mode or forward-mode AD take the op's torch::autograd::Function, which they trace or
// wrap (and whose backward is the registered backward op).
#pragma once
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/version.h>

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#ifndef TORCH_VERSION_MINOR
#error "torch/version.h: TORCH_VERSION_MINOR is not defined"
#endif

namespace ppo_kernels {

inline bool plain(const at::Tensor& t) {
  return !t.defined() || (!at::isTensorSubclassLike(t) && !t._fw_grad(/*level=*/0).defined());
}
inline bool plain(const std::optional<at::Tensor>& t) { return !t || plain(*t); }

// Whether a call may take a hand-built node: every tensor argument plain, no dispatch mode
// (isTensorSubclassLike checks it).
template <typename... Tensors>
bool all_plain(const Tensors&... tensors) {
  return (plain(tensors) && ...);
}

// Before the forward of a hand-built node: refuse functorch transforms as Function::apply does.
inline void check_functorch() {
  if (const auto& tls = at::functorch::functorchTLSAccessor())
    tls->checkSupportsCppAutogradFunction();
}

// A new graph node in the pointer type set_history takes: intrusive_ptr in recent torch,
// shared_ptr in older releases (2.11, the first GPU image's torch).
template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>)
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  else
    return std::make_shared<T>(std::forward<Args>(args)...);
}

// After the node's outputs have their history (torch::autograd::set_history, in output order)
// and its saved variables are stored: the node-creation hooks Function::apply fires since 2.14.
template <typename NodePtr>
void node_created(const NodePtr& node) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
  torch::autograd::fire_node_creation_hooks(node);
#else
  (void)node;
#endif
}

}  // namespace ppo_kernels
