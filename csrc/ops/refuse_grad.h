// The Autograd-key side of registered ops with no derivative (their outputs are targets, not
// functions to differentiate: gae, the group advantages). When an input requires grad, the outputs
// get a graph node whose backward raises `msg`, instead of autograd's fallback for ops without an
// Autograd kernel (a warning and no gradient). No input requiring grad: no node, no cost.
#pragma once
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <initializer_list>

#include "ops/plain_node.h"

namespace ppo_kernels {

template <typename... Inputs>
void refuse_grad(const char* msg, std::initializer_list<at::Tensor> outputs,
                 const Inputs&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return;
  auto node =
      make_node<torch::autograd::Error>(msg, torch::autograd::collect_next_edges(inputs...));
  for (const at::Tensor& t : outputs)
    if (t.defined() && t.is_floating_point()) torch::autograd::set_history(t, node);
}

}  // namespace ppo_kernels
