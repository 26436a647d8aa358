// token_logprobs: CPU kernels and the schemas of the raw kernels (CUDA impls in
// csrc/cuda/token_logprobs.cu). Semantics: ppo_kernels/token_logprobs/naive.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16-math.h>
#include <torch/library.h>

#include "common/alloc.h"
#include "common/cpu_rows.h"
#include "common/tensor_checks.h"
#include "common/token_logprobs_host.h"

namespace ppo_kernels {
namespace {

using cpu::grad_row;
using cpu::grad_row64;
using cpu::kBlock;
using cpu::row_logprob;
using cpu::row_stats64;
using cpu::RowResult;

void check_inv_temperature(double inv_temperature) {
  TORCH_CHECK(inv_temperature > 0 && std::isfinite(static_cast<float>(inv_temperature)),
              "inv_temperature: expected a positive value finite in float32, got ",
              inv_temperature);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd_cpu(const at::Tensor& logits_in,
                                                                      const at::Tensor& labels_in,
                                                                      double inv_temperature,
                                                                      int64_t ignore_index,
                                                                      bool with_entropy) {
  LogprobsCall c = prepare_logprobs_call(logits_in, labels_in, with_entropy);
  const at::Tensor &logits = c.logits, &labels = c.labels;
  at::Tensor &logprobs = c.logprobs, &entropy = c.entropy, &lse = c.lse;
  const RowIndexer rows = c.rows;
  const int64_t N = c.N, V = c.V;
  check_inv_temperature(inv_temperature);
  if (N == 0) return {logprobs, entropy, lse};
  check_labels_on_host(labels, V, ignore_index);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_fwd", [&] {
        AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "token_logprobs_fwd", [&] {
          const scalar_t* x = logits.const_data_ptr<scalar_t>();
          const index_t* lab = labels.const_data_ptr<index_t>();
          float* lp = logprobs.data_ptr<float>();
          float* ent = with_entropy ? entropy.data_ptr<float>() : nullptr;
          float* ls = lse.data_ptr<float>();
          const int64_t grain = std::max<int64_t>(1, 16384 / V);
          at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            float buf[kBlock];
            for (int64_t r = begin; r < end; ++r) {
              const int64_t label = lab[r];
              if (label == ignore_index) {
                lp[r] = 0.f;
                if (ent) ent[r] = 0.f;
                ls[r] = 0.f;
                continue;
              }
              const RowResult rr =
                  row_logprob<false>(x + rows(r), V, label, inv_temperature, buf, nullptr);
              ls[r] = rr.lse;
              lp[r] = rr.lp;
              if (ent) ent[r] = rr.ent;
            }
          });
        });
      });
  return {logprobs, entropy, lse};
}

// grad_logits[r, j] = inv_t * (glp * (onehot_j - p_j) - gent * p_j * (z_j - lse + H)),
// written into grad_logits (which may be the logits buffer itself: each element is read before
// it is overwritten, by the same thread).
void token_logprobs_bwd_cpu(const at::Tensor& grad_logprobs,
                            const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                            const at::Tensor& labels_in, const at::Tensor& lse,
                            const at::Tensor& entropy, double inv_temperature, int64_t ignore_index,
                            at::Tensor grad_logits) {
  const LogprobsGradCall c = prepare_logprobs_grad_call(grad_logprobs, grad_entropy, logits,
                                                        labels_in, lse, entropy, grad_logits);
  const at::Tensor& labels = c.labels;
  const int64_t N = c.N, V = c.V;
  check_inv_temperature(inv_temperature);
  if (N == 0) return;
  check_labels_on_host(labels, V, ignore_index);
  const RowIndexer rin = c.rows, rout = c.grad_rows;
  const float inv_t = static_cast<float>(inv_temperature);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_bwd", [&] {
        AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "token_logprobs_bwd", [&] {
          const scalar_t* x = logits.const_data_ptr<scalar_t>();
          scalar_t* gx = grad_logits.data_ptr<scalar_t>();
          const index_t* lab = labels.const_data_ptr<index_t>();
          const float* glp = c.glp.const_data_ptr<float>();
          const float* gent = c.gent_ptr();
          const float* ls = c.lse.const_data_ptr<float>();
          const float* ent = c.ent_ptr();
          const int64_t grain = std::max<int64_t>(1, 16384 / V);
          at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
              const int64_t label = lab[r];
              const scalar_t* row = x + rin(r);
              scalar_t* grow = gx + rout(r);
              if (label == ignore_index) {
                std::fill(grow, grow + V, scalar_t(0));
                continue;
              }
              const float l = ls[r];
              if (!std::isfinite(l)) {  // scaled logits overflow float32 (see row_stats64)
                const double a = glp[r] * inv_temperature,
                             b = gent ? gent[r] * inv_temperature : 0.0;
                grad_row64(row, grow, V, label, inv_temperature,
                           row_stats64(row, V, inv_temperature), a, b);
                continue;
              }
              const float a = glp[r] * inv_t;                // weight of onehot - p
              const float b = gent ? gent[r] * inv_t : 0.f;  // weight of -p * (log p + H)
              const float c = gent ? ent[r] - l : -l;        // log p + H = z - lse + H
              grad_row(row, grow, V, label, inv_t, l, a, b, c);
            }
          });
        });
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def(
      "token_logprobs_fwd(Tensor logits, Tensor labels, float inv_temperature, int ignore_index, "
      "bool with_entropy) -> (Tensor logprobs, Tensor entropy, Tensor lse)");
  m.def(
      "token_logprobs_bwd(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor "
      "labels, "
      "Tensor lse, Tensor entropy, float inv_temperature, int ignore_index, Tensor(a!) "
      "grad_logits) -> ()");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("token_logprobs_fwd", &token_logprobs_fwd_cpu);
  m.impl("token_logprobs_bwd", &token_logprobs_bwd_cpu);
}

}  // namespace ppo_kernels
