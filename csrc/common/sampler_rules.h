// The sampler's rules (docs/ppo-math.md, "The distribution the rollout sampled from"), shared by
// the CPU and CUDA kernels (host and device). Every decision on a token is one of these
// comparisons, made in float32 on the same values everywhere: z_j = x_j * inv_t rounded to
// float32, nd_j = z_j - max z (<= 0), masses exp(nd_j) relative to the row's maximum.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "common/macros.h"

namespace ppo_kernels {

// top_k off: 0, or at least the vocabulary size.
PPO_HD bool top_k_on(int64_t k, int64_t V) { return k > 0 && k < V; }
// top_p off: 1.
PPO_HD bool top_p_on(float p) { return p < 1.f; }
// min_p off: 0.
PPO_HD bool min_p_on(float mp) { return mp > 0.f; }

// min-p keeps p_j >= min_p * p_max, i.e. nd_j >= log(min_p); -inf when off (keeps every token).
PPO_HD float min_p_bound(float mp) { return mp > 0.f ? logf(mp) : -INFINITY; }

// top-p keeps a token whose preceding mass is below the target tau = top_p * (reference mass):
// under vLLM the mass strictly above its value (renormalised on what min-p and top-k kept), kept
// when below tau; under SGLang the mass of the tokens before it in rank order (of the whole
// distribution), kept when at most tau.
PPO_HD bool top_p_keeps(bool sglang, float preceding, float tau) {
  return sglang ? preceding <= tau : preceding < tau;
}

// The kept set as the forward leaves it for the backward: logits above `cut`, and those equal to
// it up to index cut_index (V - 1 unless the kept set splits that tie group, SGLang only).
PPO_HD bool in_kept_set(float x, int64_t j, float cut, int64_t cut_index) {
  return x > cut || (x == cut && j <= cut_index);
}

}  // namespace ppo_kernels
