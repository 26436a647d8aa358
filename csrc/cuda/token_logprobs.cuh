// token_logprobs: the CUDA kernels and their host launchers (schemas in
// csrc/cpu/token_logprobs.cpp), compiled by nvcc for the GPU (token_logprobs.cu) and by g++ for the
// SIMT emulator (csrc/testing/). One block per row (grid-stride over rows), 16-byte vector loads,
// one pass over the vocabulary with the online softmax state of csrc/common/softmax_stats.h,
// warp-shuffle + shared-memory block reduction. Out-of-range labels never index memory: their rows
// give NaN.
#pragma once
#include <ATen/Dispatch.h>

#include <cfloat>
#include <cstdint>

#include "common/alloc.h"
#include "common/softmax_stats.h"
#include "common/tensor_checks.h"
#include "common/token_logprobs_host.h"
#include "cuda/cuda_utils.cuh"
#include "cuda/device.cuh"

namespace ppo_kernels {
namespace token_logprobs_cuda {

using dev::head_len;
using dev::Pack;

__device__ __forceinline__ SoftmaxStats block_reduce(SoftmaxStats st) {
  return dev::block_reduce(st, stats_empty(), [](const SoftmaxStats& a, const SoftmaxStats& b) {
    return stats_merge(a, b);
  });
}

// x * inv_t, never fused with a subtraction that follows: an FMA would keep the product's
// rounding error (~1e31 for logits near 1e38) in z_label - max (as scaled() on the CPU).
__device__ __forceinline__ float scale(float x, float inv_t) { return __fmul_rn(x, inv_t); }

// lse not finite: NaN or +inf logits, an all -inf row, or finite logits whose scaled value
// overflows float32 (x = 3e38 at temperature 0.5). NaN also counts.
__device__ __forceinline__ bool not_finite(float v) { return !(fabsf(v) <= FLT_MAX); }

// The rare slow path of such a row, as row_stats64 of csrc/cpu/token_logprobs.cpp: float64
// statistics relative to the unscaled max. m, log_s, entropy are NaN for rows with NaN / +inf
// logits or all -inf. Every thread of the block calls it; every thread gets the result.
struct RowStats64 {
  double m, log_s, entropy;  // max x, log sum exp((x - m) * inv_t), entropy
};
struct Sums64 {
  double s, u;  // sum exp(d), sum exp(d) * d over the d = (x - m) * inv_t with exp(d) > 0
};

template <typename scalar_t>
__device__ RowStats64 row_stats64(const scalar_t* p, int64_t V, double inv_t) {
  PPO_SHARED(RowStats64, row, [1]);
  double m = -INFINITY;  // NaN-propagating: NaN or +inf logits make it NaN
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const double x = static_cast<double>(p[j]);
    m = (x != x || x == INFINITY || m != m) ? NAN : fmax(m, x);
  }
  const auto max64 = [](double a, double b) { return (a != a || b != b) ? NAN : fmax(a, b); };
  m = dev::block_reduce(m, static_cast<double>(-INFINITY), max64);
  if (threadIdx.x == 0) row[0].m = m == -INFINITY ? NAN : m;
  __syncthreads();
  m = row[0].m;
  Sums64 t = {0.0, 0.0};
  if (m == m) {  // uniform across the block
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const double d = (static_cast<double>(p[j]) - m) * inv_t;
      const double e = exp(d);
      t.s += e;
      if (e > 0) t.u += e * d;
    }
  }
  t = dev::block_reduce(t, Sums64{0.0, 0.0}, [](const Sums64& a, const Sums64& b) {
    return Sums64{a.s + b.s, a.u + b.u};
  });
  if (threadIdx.x == 0 && m == m) {
    row[0].log_s = log(t.s);
    row[0].entropy = log(t.s) - t.u / t.s;
  } else if (threadIdx.x == 0) {
    row[0].log_s = row[0].entropy = NAN;
  }
  __syncthreads();
  const RowStats64 out = row[0];
  __syncthreads();  // `row` is reused by the next row
  return out;
}

template <typename scalar_t, typename index_t>
__global__ void fwd_kernel(const scalar_t* __restrict__ x, const index_t* __restrict__ labels,
                           float* __restrict__ lp, float* __restrict__ ent, float* __restrict__ lse,
                           int64_t N, int64_t V, RowIndexer rows, float inv_t, int64_t ignore_index,
                           bool uniform) {
  using P = Pack<scalar_t>;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int64_t label = labels[r];
    if (label == ignore_index) {  // uniform across the block: no partial reduction
      if (threadIdx.x == 0) {
        lp[r] = 0.f;
        lse[r] = 0.f;
        if (ent) ent[r] = 0.f;
      }
      continue;
    }
    const scalar_t* p = x + rows(r);
    // The elements a thread adds, and their order, follow the row's 16-byte alignment (the
    // scalar head), which depends on the row's place in the batch when V * sizeof(scalar_t) is
    // not a multiple of 16. `uniform` (batch-invariant mode): packs from the row's first element
    // for every row, loaded element by element where the row is not aligned.
    const int64_t head = uniform ? 0 : head_len(p, V);
    const bool packed = !uniform || dev::is_aligned(p);
    const int64_t nvec = (V - head) / P::kN;
    const int64_t tail = head + nvec * P::kN;
    SoftmaxStats st = stats_empty();
    for (int64_t j = threadIdx.x; j < head; j += blockDim.x)
      stats_add(st, scale(static_cast<float>(p[j]), inv_t));
    const P* pv = reinterpret_cast<const P*>(p + head);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      if (packed) {
        const P pk = pv[i];
#pragma unroll
        for (int k = 0; k < P::kN; ++k) stats_add(st, scale(static_cast<float>(pk.v[k]), inv_t));
      } else {
#pragma unroll
        for (int k = 0; k < P::kN; ++k)
          stats_add(st, scale(static_cast<float>(p[i * P::kN + k]), inv_t));
      }
    }
    for (int64_t j = tail + threadIdx.x; j < V; j += blockDim.x)
      stats_add(st, scale(static_cast<float>(p[j]), inv_t));
    st = block_reduce(st);
    PPO_SHARED(int, slow, [1]);  // thread 0's verdict, for the whole block
    const bool valid = label >= 0 && label < V;
    if (threadIdx.x == 0) {
      const float l = stats_lse(st);
      slow[0] = not_finite(l);
      if (!slow[0]) {
        lse[r] = l;
        // (z_label - max) - log s: exact where z_label is close to the max, even when |z| is
        // so large that lse = max + log s rounds log s away
        lp[r] = valid ? (scale(static_cast<float>(p[label]), inv_t) - st.m) - logf(st.s) : NAN;
        if (ent) ent[r] = valid ? stats_entropy(st) : NAN;
      }
    }
    __syncthreads();
    const bool recompute = slow[0];
    __syncthreads();  // `slow` is rewritten for the next row
    if (recompute) {  // uniform across the block
      const double inv_t64 = inv_t;
      const RowStats64 s = row_stats64(p, V, inv_t64);
      if (threadIdx.x == 0) {
        lse[r] = static_cast<float>(s.m * inv_t64 + s.log_s);
        lp[r] = valid
                    ? static_cast<float>((static_cast<double>(p[label]) - s.m) * inv_t64 - s.log_s)
                    : NAN;
        if (ent) ent[r] = valid ? static_cast<float>(s.entropy) : NAN;
      }
    }
  }
}

template <typename scalar_t, typename index_t>
__global__ void bwd_kernel(const scalar_t* __restrict__ x, scalar_t* g,
                           const index_t* __restrict__ labels, const float* __restrict__ glp,
                           const float* __restrict__ gent, const float* __restrict__ lse,
                           const float* __restrict__ ent, int64_t N, int64_t V, RowIndexer rows,
                           RowIndexer grows, float inv_t, int64_t ignore_index) {
  using P = Pack<scalar_t>;
  // g may alias x (inplace_backward): every element is read, then written, by the same thread.
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int64_t label = labels[r];
    const scalar_t* p = x + rows(r);
    scalar_t* q = g + grows(r);
    const bool ignored = label == ignore_index;
    const bool valid = !ignored && label >= 0 && label < V;
    const float l = lse[r];
    if (!ignored && not_finite(l)) {  // scaled logits overflow float32 (see row_stats64)
      const double inv_t64 = inv_t;
      const RowStats64 s = row_stats64(p, V, inv_t64);
      const double a = glp[r] * inv_t64, b = gent ? gent[r] * inv_t64 : 0.0;
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const double logp = (static_cast<double>(p[j]) - s.m) * inv_t64 - s.log_s;
        const double pj = exp(logp);
        const double w = pj > 0 ? pj * (logp + s.entropy) : 0.0;
        q[j] = static_cast<scalar_t>(valid ? a * ((j == label ? 1.0 : 0.0) - pj) - b * w : NAN);
      }
      continue;
    }
    const float a = ignored ? 0.f : glp[r] * inv_t;              // weight of (onehot - p)
    const float b = (gent && !ignored) ? gent[r] * inv_t : 0.f;  // weight of -p (log p + H)
    const float c = gent ? ent[r] - l : -l;                      // log p + H = z + c
    auto grad = [&](float xv, int64_t j) -> float {
      if (ignored) return 0.f;
      if (!valid) return NAN;
      const float z = scale(xv, inv_t);
      const float pj = __expf(z - l);
      return -a * pj - b * weighted_offset(pj, z + c) + (j == label ? a : 0.f);
    };
    const int64_t head = head_len(p, V);
    const bool vec_ok = head == head_len(q, V);  // same alignment: vectorise both sides
    const int64_t nvec = vec_ok ? (V - head) / P::kN : 0;
    const int64_t tail = vec_ok ? head + nvec * P::kN : 0;
    if (vec_ok) {
      for (int64_t j = threadIdx.x; j < head; j += blockDim.x)
        q[j] = static_cast<scalar_t>(grad(static_cast<float>(p[j]), j));
      const P* pv = reinterpret_cast<const P*>(p + head);
      P* qv = reinterpret_cast<P*>(q + head);
      for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        const P pk = pv[i];
        P out;
#pragma unroll
        for (int k = 0; k < P::kN; ++k)
          out.v[k] = static_cast<scalar_t>(grad(static_cast<float>(pk.v[k]), head + i * P::kN + k));
        qv[i] = out;
      }
    }
    for (int64_t j = tail + threadIdx.x; j < V; j += blockDim.x)
      q[j] = static_cast<scalar_t>(grad(static_cast<float>(p[j]), j));
  }
}

template <class Dev>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(const at::Tensor& logits_in,
                                                   const at::Tensor& labels_in,
                                                   double inv_temperature, int64_t ignore_index,
                                                   bool with_entropy) {
  // labels on logits' device (a ValueError naming it), then that device is this build's
  check_arg(labels_in, "labels", device_of(logits_in, "logits"));
  TORCH_CHECK(Dev::accepts(logits_in) && Dev::accepts(labels_in), "logits and labels must be ",
              Dev::kTensorKind, " tensors");
  Dev device(logits_in);
  LogprobsCall c = prepare_logprobs_call(logits_in, labels_in, with_entropy);
  const at::Tensor &logits = c.logits, &labels = c.labels;
  at::Tensor &logprobs = c.logprobs, &entropy = c.entropy, &lse = c.lse;
  const RowIndexer rows = c.rows;
  const int64_t N = c.N, V = c.V;
  if (N == 0) return {logprobs, entropy, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_fwd_cuda", [&] {
        AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "token_logprobs_fwd_cuda", [&] {
          device.launch(
              "token_logprobs fwd_kernel", &fwd_kernel<scalar_t, index_t>,
              dev::grid_for_rows(N, Dev::max_row_blocks()),
              dev::threads_for_row(V, Pack<scalar_t>::kN), 0, logits.const_data_ptr<scalar_t>(),
              labels.const_data_ptr<index_t>(), logprobs.data_ptr<float>(),
              with_entropy ? entropy.data_ptr<float>() : nullptr, lse.data_ptr<float>(), N, V, rows,
              static_cast<float>(inv_temperature), ignore_index, batch_invariant_mode());
        });
      });
  return {logprobs, entropy, lse};
}

template <class Dev>
void bwd(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
         const at::Tensor& logits, const at::Tensor& labels_in, const at::Tensor& lse,
         const at::Tensor& entropy, double inv_temperature, int64_t ignore_index,
         at::Tensor grad_logits) {
  // every tensor on logits' device (a ValueError naming it), then that device is this build's
  const DeviceOf on = device_of(logits, "logits");
  for (const auto& [t, name] : {std::pair{&grad_logprobs, "grad_logprobs"},
                                {&labels_in, "labels"},
                                {&lse, "lse"},
                                {&entropy, "entropy"},
                                {&grad_logits, "grad_logits"}})
    check_arg(*t, name, on);
  if (grad_entropy.has_value() && grad_entropy->defined())
    check_arg(*grad_entropy, "grad_entropy", on);
  TORCH_CHECK(Dev::accepts(logits) && Dev::accepts(grad_logits), "logits and grad_logits must be ",
              Dev::kTensorKind, " tensors");
  Dev device(logits);
  const LogprobsGradCall c = prepare_logprobs_grad_call(grad_logprobs, grad_entropy, logits,
                                                        labels_in, lse, entropy, grad_logits);
  if (c.N == 0) return;
  const at::Tensor& labels = c.labels;
  const int64_t N = c.N, V = c.V;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_bwd_cuda", [&] {
        AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "token_logprobs_bwd_cuda", [&] {
          device.launch("token_logprobs bwd_kernel", &bwd_kernel<scalar_t, index_t>,
                        dev::grid_for_rows(N, Dev::max_row_blocks()),
                        dev::threads_for_row(V, Pack<scalar_t>::kN), 0,
                        logits.const_data_ptr<scalar_t>(), grad_logits.data_ptr<scalar_t>(),
                        labels.const_data_ptr<index_t>(), c.glp.const_data_ptr<float>(),
                        c.gent_ptr(), c.lse.const_data_ptr<float>(), c.ent_ptr(), N, V, c.rows,
                        c.grad_rows, static_cast<float>(inv_temperature), ignore_index);
        });
      });
}

}  // namespace token_logprobs_cuda
}  // namespace ppo_kernels
