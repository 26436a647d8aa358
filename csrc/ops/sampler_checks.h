// The checks of the sampler's parameters (temperature tensor, top-k, top-p, min-p, the sampler's
// name, stats_top_k), shared by the registered ops that take them: token_logprobs_sampler and
// linear_token_logprobs_sampler, full_kl_sampler, the fused losses' `<op>_sampler` ops
// (csrc/ops/token_logprobs.cpp defines them).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/stack.h>
#include <c10/util/string_view.h>

#include <optional>

namespace ppo_kernels {

// `like` / `like_name`: the tensor whose device the parameter tensors must be on (and its name in
// the messages); V: the vocabulary size (stats_top_k's bound). A parameter tensor's shape is a
// leading part of labels.shape; its values are read on the CPU (and on the GPU under
// strict_checks()).
void check_sampler_options(const at::Tensor& like, const char* like_name, int64_t V,
                           const at::Tensor& labels, const std::optional<at::Tensor>& temperatures,
                           int64_t top_k, const std::optional<at::Tensor>& top_ks, double top_p,
                           const std::optional<at::Tensor>& top_ps, double min_p,
                           const std::optional<at::Tensor>& min_ps, c10::string_view sampler,
                           int64_t stats_top_k);

// A temperature tensor alone (the backward ops).
void check_sampler_temperatures(const std::optional<at::Tensor>& t, const at::Tensor& like,
                                const char* like_name, const at::Tensor& labels);

// The kept set a sampler forward returned, handed back to its backward: cut (the forward's
// output dtype for `like`) and cut_index (int64), each of shape `rows` (`rows_what` in the
// messages), on like's device.
void check_kept_set(const at::Tensor& cut, const at::Tensor& cut_index, const at::Tensor& like,
                    const char* like_name, at::IntArrayRef rows, const char* rows_what);

// The sampler's argument positions in a fused loss's boxed `<op>_sampler` schema (the sampler's
// arguments after the plain op's); n: the schema's argument count.
struct SamplerArgs {
  size_t n, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps, sampler;
};
SamplerArgs sampler_args(const c10::FunctionSchema& schema);

// check_sampler_options of those arguments on a boxed stack `a` (no stats_top_k).
void check_sampler_args(const torch::jit::Stack& a, const SamplerArgs& s, const at::Tensor& like,
                        const char* like_name, int64_t V, const at::Tensor& labels);

}  // namespace ppo_kernels
