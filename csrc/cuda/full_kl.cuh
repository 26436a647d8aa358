// full_kl: the CUDA kernels and their host launchers (schemas in csrc/cpu/full_kl.cpp), compiled by
// nvcc for the GPU (full_kl.cu) and by g++ for the SIMT emulator (csrc/testing/).
// One block per row (grid-stride over rows), 16-byte vector loads of both logits rows in lockstep,
// one pass with the online KL state of csrc/common/kl_stats.h (rescaled once per pack, not per
// element), warp-shuffle + shared-memory block reduction. Backward: one pass, vector stores.
#pragma once
#include <ATen/Dispatch.h>

#include <cstdint>

#include "common/alloc.h"
#include "common/full_kl_host.h"
#include "common/kl_stats.h"
#include "common/tensor_checks.h"
#include "cuda/cuda_utils.cuh"
#include "cuda/device.cuh"

namespace ppo_kernels {
namespace full_kl_cuda {

using dev::head_len;
using dev::Pack;

__device__ __forceinline__ KLStats block_reduce(KLStats st) {
  return dev::block_reduce(st, kl_stats_empty(),
                           [](const KLStats& a, const KLStats& b) { return kl_stats_merge(a, b); });
}

// Add K pairs: one rescale to the pack's maxes, then the terms of kl_stats_add without per-element
// max checks.
template <int K>
__device__ __forceinline__ void add_pack(KLStats& st, const float* z, const float* w) {
  float mz = st.mz, mw = st.mw;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    mz = (z[k] <= mz) ? mz : z[k];  // larger or NaN
    mw = (w[k] <= mw) ? mw : w[k];
  }
  if (mz != st.mz || mw != st.mw) st = kl_stats_rescale(st, mz, mw);
  const bool w_empty = st.mw == -INFINITY, z_empty = st.mz == -INFINITY;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float a = z_empty ? -INFINITY : z[k] - st.mz;
    const float b = w_empty ? -INFINITY : w[k] - st.mw;
    const float e = __expf(a), eb = __expf(b);
    st.sz += e;
    st.v += kl_v_term(e, eb, a, b);
    st.u += kl_term(e, a, b);
  }
}

template <typename scalar_t>
__global__ void fwd_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ y,
                           const bool* __restrict__ mask, float* __restrict__ kl,
                           float* __restrict__ lz, float* __restrict__ lw, int64_t N, int64_t V,
                           RowIndexer rx, RowIndexer ry, float inv_t0,
                           const double* __restrict__ inv_ts, bool uniform) {
  using P = Pack<scalar_t>;
  constexpr int kN = P::kN;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    if (mask != nullptr && !mask[r]) {  // uniform across the block: no partial reduction
      if (threadIdx.x == 0) kl[r] = lz[r] = lw[r] = 0.f;
      continue;
    }
    const float inv_t = inv_ts != nullptr ? static_cast<float>(inv_ts[r]) : inv_t0;  // per row
    const scalar_t* p = x + rx(r);
    const scalar_t* q = y + ry(r);
    // The elements a thread adds follow the rows' 16-byte alignment (scalar head, or no packs when
    // the two rows are aligned differently), which depends on the rows' place in the batch when
    // V * sizeof(scalar_t) is not a multiple of 16. `uniform` (batch-invariant mode): packs from
    // the first element for every row, loaded element by element where a row is not aligned.
    const int64_t head = uniform ? 0 : head_len(p, V);
    const bool vec_ok = uniform || head == head_len(q, V);  // same alignment: lockstep packs
    const bool packed = !uniform || (dev::is_aligned(p) && dev::is_aligned(q));
    const int64_t nvec = vec_ok ? (V - head) / kN : 0;
    const int64_t tail = vec_ok ? head + nvec * kN : 0;
    KLStats st = kl_stats_empty();
    if (vec_ok) {
      for (int64_t j = threadIdx.x; j < head; j += blockDim.x) {
        kl_stats_add(st, static_cast<float>(p[j]) * inv_t, static_cast<float>(q[j]) * inv_t);
      }
      int64_t i = threadIdx.x;
      // two packs of each row in flight per thread
      for (; i + blockDim.x < nvec; i += 2 * blockDim.x) {
        float z[2 * kN], w[2 * kN];
        dev::load_pack(p + head, i, packed, inv_t, z);
        dev::load_pack(q + head, i, packed, inv_t, w);
        dev::load_pack(p + head, i + blockDim.x, packed, inv_t, z + kN);
        dev::load_pack(q + head, i + blockDim.x, packed, inv_t, w + kN);
        add_pack<2 * kN>(st, z, w);
      }
      if (i < nvec) {
        float z[kN], w[kN];
        dev::load_pack(p + head, i, packed, inv_t, z);
        dev::load_pack(q + head, i, packed, inv_t, w);
        add_pack<kN>(st, z, w);
      }
    }
    for (int64_t j = tail + threadIdx.x; j < V; j += blockDim.x) {
      kl_stats_add(st, static_cast<float>(p[j]) * inv_t, static_cast<float>(q[j]) * inv_t);
    }
    st = block_reduce(st);
    if (threadIdx.x == 0) {
      kl[r] = kl_stats_value(st);
      lz[r] = kl_stats_lse_z(st);
      lw[r] = kl_stats_lse_w(st);
    }
  }
}

// gx = g/T * p (z - w - c), gy = g/T * (q - p); gx, gy are contiguous [N, V] (gy may be null).
template <typename scalar_t>
__global__ void bwd_kernel(const float* __restrict__ grad, const scalar_t* __restrict__ x,
                           const scalar_t* __restrict__ y, const bool* __restrict__ mask,
                           const float* __restrict__ kl, const float* __restrict__ lzs,
                           const float* __restrict__ lws, scalar_t* __restrict__ gx,
                           scalar_t* __restrict__ gy, int64_t N, int64_t V, RowIndexer rx,
                           RowIndexer ry, float inv_t0, const double* __restrict__ inv_ts) {
  using P = Pack<scalar_t>;
  constexpr int kN = P::kN;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const bool keep = mask == nullptr || mask[r];
    const float inv_t = inv_ts != nullptr ? static_cast<float>(inv_ts[r]) : inv_t0;  // per row
    const scalar_t* p = x + rx(r);
    const scalar_t* q = y + ry(r);
    scalar_t* op = gx + r * V;
    scalar_t* oq = gy != nullptr ? gy + r * V : nullptr;
    const float a = keep ? grad[r] * inv_t : 0.f;
    const float lz = keep ? lzs[r] : 0.f, lw = keep ? lws[r] : 0.f;
    const float c = keep ? lz - lw + kl[r] : 0.f;
    // Masked rows: zeros, without reading the logits.
    auto gz = [&](float zr, float wr) -> float {
      if (!keep) return 0.f;
      const float z = zr * inv_t, w = wr * inv_t;
      return a * full_kl_grad_z(__expf(z - lz), z, w, c);
    };
    auto gw = [&](float zr, float wr) -> float {
      if (!keep) return 0.f;
      return a * (__expf(wr * inv_t - lw) - __expf(zr * inv_t - lz));
    };
    const int64_t head = head_len(p, V);
    const bool vec_ok = head == head_len(q, V) && head == head_len(op, V) &&
                        (oq == nullptr || head == head_len(oq, V));
    const int64_t nvec = vec_ok ? (V - head) / kN : 0;
    const int64_t tail = vec_ok ? head + nvec * kN : 0;
    if (vec_ok) {
      for (int64_t j = threadIdx.x; j < head; j += blockDim.x) {
        const float zr = keep ? static_cast<float>(p[j]) : 0.f,
                    wr = keep ? static_cast<float>(q[j]) : 0.f;
        op[j] = static_cast<scalar_t>(gz(zr, wr));
        if (oq) oq[j] = static_cast<scalar_t>(gw(zr, wr));
      }
      const P* pv = reinterpret_cast<const P*>(p + head);
      const P* qv = reinterpret_cast<const P*>(q + head);
      P* opv = reinterpret_cast<P*>(op + head);
      P* oqv = oq ? reinterpret_cast<P*>(oq + head) : nullptr;
      for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        P zp, wp, o1, o2;
        if (keep) {
          zp = pv[i];
          wp = qv[i];
        }
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          const float zr = keep ? static_cast<float>(zp.v[k]) : 0.f;
          const float wr = keep ? static_cast<float>(wp.v[k]) : 0.f;
          o1.v[k] = static_cast<scalar_t>(gz(zr, wr));
          if (oqv) o2.v[k] = static_cast<scalar_t>(gw(zr, wr));
        }
        opv[i] = o1;
        if (oqv) oqv[i] = o2;
      }
    }
    for (int64_t j = tail + threadIdx.x; j < V; j += blockDim.x) {
      const float zr = keep ? static_cast<float>(p[j]) : 0.f,
                  wr = keep ? static_cast<float>(q[j]) : 0.f;
      op[j] = static_cast<scalar_t>(gz(zr, wr));
      if (oq) oq[j] = static_cast<scalar_t>(gw(zr, wr));
    }
  }
}

template <class Dev>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(const at::Tensor& logits_in,
                                                   const at::Tensor& ref_in,
                                                   const std::optional<at::Tensor>& mask_in,
                                                   double inv_temperature,
                                                   const std::optional<at::Tensor>& inv_ts_in) {
  // every tensor on logits' device (a ValueError naming it), then that device is this build's
  const DeviceOf on = device_of(logits_in, "logits");
  check_arg(ref_in, "ref_logits", on);
  if (mask_in.has_value() && mask_in->defined()) check_arg(*mask_in, "mask", on);
  TORCH_CHECK(Dev::accepts(logits_in) && Dev::accepts(ref_in), "logits and ref_logits must be ",
              Dev::kTensorKind, " tensors");
  Dev device(logits_in);
  const KLFwdCall c = prepare_kl_fwd(logits_in, ref_in, mask_in, inv_temperature);
  const KLRows& R = c.R;
  const at::Tensor &kl = c.kl, &lz = c.lz, &lw = c.lw, &mask = c.mask;
  const int64_t N = R.N, V = R.V;
  const double* inv_ts = kl_inv_temperatures(inv_ts_in, device_of(logits_in, "logits"), N);
  if (N == 0) return {kl, lz, lw};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, R.logits.scalar_type(), "full_kl_fwd_cuda", [&] {
        device.launch("full_kl fwd_kernel", &fwd_kernel<scalar_t>,
                      dev::grid_for_rows(N, Dev::max_row_blocks()),
                      dev::threads_for_row(V, Pack<scalar_t>::kN), 0,
                      R.logits.const_data_ptr<scalar_t>(), R.ref.const_data_ptr<scalar_t>(),
                      mask.defined() ? mask.const_data_ptr<bool>() : nullptr, kl.data_ptr<float>(),
                      lz.data_ptr<float>(), lw.data_ptr<float>(), N, V, R.rz, R.rw,
                      static_cast<float>(inv_temperature), inv_ts, batch_invariant_mode());
      });
  return {kl, lz, lw};
}

template <class Dev>
void bwd(const at::Tensor& grad_in, const at::Tensor& logits_in, const at::Tensor& ref_in,
         const std::optional<at::Tensor>& mask_in, const at::Tensor& kl_in, const at::Tensor& lz_in,
         const at::Tensor& lw_in, double inv_temperature, at::Tensor grad_logits,
         std::optional<at::Tensor> grad_ref, const std::optional<at::Tensor>& inv_ts_in) {
  // every tensor on logits' device (a ValueError naming it), then that device is this build's
  const DeviceOf on = device_of(logits_in, "logits");
  for (const auto& [t, name] : {std::pair{&grad_in, "grad"},
                                {&ref_in, "ref_logits"},
                                {&kl_in, "kl"},
                                {&lz_in, "lse_z"},
                                {&lw_in, "lse_w"},
                                {&grad_logits, "grad_logits"}})
    check_arg(*t, name, on);
  if (mask_in.has_value() && mask_in->defined()) check_arg(*mask_in, "mask", on);
  if (grad_ref.has_value() && grad_ref->defined()) check_arg(*grad_ref, "grad_ref_logits", on);
  TORCH_CHECK(Dev::accepts(logits_in) && Dev::accepts(ref_in), "logits and ref_logits must be ",
              Dev::kTensorKind, " tensors");
  Dev device(logits_in);
  const KLGradCall in = prepare_kl_bwd(grad_in, logits_in, ref_in, mask_in, kl_in, lz_in, lw_in,
                                       inv_temperature, grad_logits, grad_ref);
  const KLRows& R = in.R;
  const int64_t N = R.N, V = R.V;
  const double* inv_ts = kl_inv_temperatures(inv_ts_in, device_of(logits_in, "logits"), N);
  if (N == 0 || V == 0) return;
  const bool need_ref = in.need_ref;
  const at::Tensor &g = in.g, &klc = in.kl, &lzc = in.lz, &lwc = in.lw, &mask = in.mask;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, R.logits.scalar_type(), "full_kl_bwd_cuda", [&] {
        device.launch("full_kl bwd_kernel", &bwd_kernel<scalar_t>,
                      dev::grid_for_rows(N, Dev::max_row_blocks()),
                      dev::threads_for_row(V, Pack<scalar_t>::kN), 0, g.const_data_ptr<float>(),
                      R.logits.const_data_ptr<scalar_t>(), R.ref.const_data_ptr<scalar_t>(),
                      mask.defined() ? mask.const_data_ptr<bool>() : nullptr,
                      klc.const_data_ptr<float>(), lzc.const_data_ptr<float>(),
                      lwc.const_data_ptr<float>(), grad_logits.data_ptr<scalar_t>(),
                      need_ref ? grad_ref->data_ptr<scalar_t>() : nullptr, N, V, R.rz, R.rw,
                      static_cast<float>(inv_temperature), inv_ts);
      });
}

}  // namespace full_kl_cuda
}  // namespace ppo_kernels
