// token_logprobs under the sampler's distribution, and the head's statistics: the CUDA kernels
// and their host launchers (schemas in csrc/cpu/token_logprobs_sampler.cpp), compiled by nvcc
// (token_logprobs_sampler.cu) and by g++ for the SIMT emulator (csrc/testing/). Semantics:
// docs/ppo-math.md; the rules: csrc/common/sampler_rules.h.
//
// One block per row (grid-stride over rows), kThreads threads. The kept set is found by a search
// that ends exact (as the Triton kernels): on the order-preserving key of each logit, every pass
// over the row counts the tokens above kPivots pivots at once and sums their masses (per-thread
// partials, one block reduction), narrowing the key range kPivots + 1 times; 2^32 keys close in
// at most 8 passes. No atomics, no dynamic shared memory: the emulator runs the same text. Masses
// are exp((x - max x) * inv_t), relative to the unscaled max, so no finite logit overflows.
#pragma once
#include <ATen/Dispatch.h>

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "common/sampler_host.h"
#include "common/sampler_rules.h"
#include "common/softmax_stats.h"
#include "cuda/cuda_utils.cuh"
#include "cuda/device.cuh"

namespace ppo_kernels {
namespace token_logprobs_sampler_cuda {

constexpr int kThreads = 256;
constexpr int kPivots = 15;
constexpr int kMaxTop = 64;  // stats_top_k at most

// int64 key whose order is the float order (-0.0 taken as +0.0).
__device__ __forceinline__ int64_t order_key(float x) {
  x = x + 0.f;
  int32_t b;
  memcpy(&b, &x, 4);
  return static_cast<int64_t>(b ^ ((b >> 31) & 0x7FFFFFFF));
}

__device__ __forceinline__ float key_value(int64_t k) {
  int32_t b = static_cast<int32_t>(k);
  b ^= (b >> 31) & 0x7FFFFFFF;
  float x;
  memcpy(&x, &b, 4);
  return x;
}

// A block reduction whose result every thread gets.
template <typename S, typename Merge>
__device__ S block_all(S st, S empty, Merge merge) {
  PPO_SHARED(S, out, [1]);
  st = dev::block_reduce(st, empty, merge);
  if (threadIdx.x == 0) out[0] = st;
  __syncthreads();
  const S r = out[0];
  __syncthreads();  // `out` is reused
  return r;
}

struct RowRange {
  float xmax, xmin, bad;  // bad: NaN / +inf logits seen
};
struct Sums4 {
  float a, b, c, d;
};
struct PivotSums {
  float cnt[kPivots], mass[kPivots];
};

struct PlusInt {
  __device__ __forceinline__ int operator()(int a, int b) const { return a + b; }
};

__device__ __forceinline__ Sums4 add4(const Sums4& x, const Sums4& y) {
  return {x.a + y.a, x.b + y.b, x.c + y.c, x.d + y.d};
}

template <typename scalar_t>
__device__ __forceinline__ float load_at(const scalar_t* p, int64_t j) {
  return static_cast<float>(p[j]);
}

// (count, mass) of the tokens whose key exceeds t, and (count, mass) of those equal to it.
template <typename scalar_t>
__device__ Sums4 above(const scalar_t* p, int64_t V, int64_t t, float xmax, float inv_t) {
  Sums4 s = {0.f, 0.f, 0.f, 0.f};
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float x = load_at(p, j);
    const int64_t k = order_key(x);
    const float e = __expf((x - xmax) * inv_t);
    if (k > t) s.a += 1.f, s.b += e;
    if (k == t) s.c += 1.f, s.d += e;
  }
  return block_all(s, Sums4{0.f, 0.f, 0.f, 0.f}, add4);
}

// The smallest key t in [lo, hi] where pred(t) holds (false then true along t; true at hi):
// mode 0: count(key > t) < target; 1: mass(key > t) < target; 2: mass(key > t) <= target.
template <typename scalar_t>
__device__ int64_t search(const scalar_t* p, int64_t V, int64_t lo, int64_t hi, float xmax,
                          float inv_t, float target, int mode) {
  while (lo < hi) {  // uniform across the block
    int64_t piv[kPivots];
    for (int i = 0; i < kPivots; ++i) piv[i] = lo + ((hi - lo) * (i + 1)) / (kPivots + 1);
    PivotSums s;
    for (int i = 0; i < kPivots; ++i) s.cnt[i] = s.mass[i] = 0.f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float x = load_at(p, j);
      const int64_t k = order_key(x);
      const float e = __expf((x - xmax) * inv_t);
      for (int i = 0; i < kPivots; ++i) {
        if (k > piv[i]) s.cnt[i] += 1.f, s.mass[i] += e;
      }
    }
    PivotSums empty;
    for (int i = 0; i < kPivots; ++i) empty.cnt[i] = empty.mass[i] = 0.f;
    s = block_all(s, empty, [](const PivotSums& a, const PivotSums& b) {
      PivotSums o;
      for (int i = 0; i < kPivots; ++i)
        o.cnt[i] = a.cnt[i] + b.cnt[i], o.mass[i] = a.mass[i] + b.mass[i];
      return o;
    });
    int64_t new_lo = lo, new_hi = hi;
    for (int i = 0; i < kPivots; ++i) {
      const bool ok = mode == 0   ? s.cnt[i] < target
                      : mode == 1 ? s.mass[i] < target
                                  : s.mass[i] <= target;
      if (ok) {
        new_hi = piv[i] < new_hi ? piv[i] : new_hi;
      } else {
        new_lo = piv[i] + 1 > new_lo ? piv[i] + 1 : new_lo;
      }
    }
    lo = new_lo;
    hi = new_hi;
  }
  return hi;
}

// The index of the m-th (1-based) token equal to v in index order (thread 0 scans: only a tie
// group that SGLang's rules split at the cut needs it).
template <typename scalar_t>
__device__ int64_t nth_tie(const scalar_t* p, int64_t V, float v, int64_t m) {
  PPO_SHARED(int64_t, res, [1]);
  if (threadIdx.x == 0) {
    int64_t seen = 0, idx = V - 1;
    for (int64_t j = 0; j < V; ++j) {
      if (load_at(p, j) == v && ++seen == m) {
        idx = j;
        break;
      }
    }
    res[0] = idx;
  }
  __syncthreads();
  const int64_t r = res[0];
  __syncthreads();
  return r;
}

struct RowOut {
  float* lp;
  float* ent;
  float* lse;
  float* cut;
  int64_t* cut_index;
  bool* outside;
  float* sum_p2;
  float* full_lse;
  int64_t* top_ids;
  float* top_lp;
  bool* is_argmax;
  int64_t stats_k;
};

__device__ inline void fill_row(const RowOut& o, int64_t r, int64_t V, float value) {
  if (threadIdx.x != 0) return;
  o.lp[r] = value;
  o.lse[r] = value;
  o.cut[r] = -INFINITY;
  o.cut_index[r] = V - 1;
  o.outside[r] = false;
  if (o.ent) o.ent[r] = value;
  if (o.sum_p2) o.sum_p2[r] = value;
  if (o.full_lse) o.full_lse[r] = value;
  if (o.is_argmax) o.is_argmax[r] = false;
  for (int64_t i = 0; i < o.stats_k; ++i) {
    o.top_ids[r * o.stats_k + i] = -1;
    o.top_lp[r * o.stats_k + i] = value;
  }
}

template <typename scalar_t, typename index_t>
__global__ void sampler_fwd_kernel(const scalar_t* __restrict__ x,
                                   const index_t* __restrict__ labels, RowOut o, int64_t N,
                                   int64_t V, RowIndexer rows, SamplerParamPtrs params, bool sglang,
                                   int64_t ignore_index) {
  using Scan = cub::BlockScan<int, kThreads>;
  PPO_SHARED(typename Scan::TempStorage, scan_tmp);
  PPO_SHARED(int64_t, top, [kMaxTop]);
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int64_t label = labels[r];
    if (label == ignore_index) {  // uniform across the block
      fill_row(o, r, V, 0.f);
      continue;
    }
    const scalar_t* p = x + rows(r);
    const float inv_t = static_cast<float>(params.inv_t ? params.inv_t[r] : params.inv_t0);
    const int64_t k = params.top_k ? params.top_k[r] : params.top_k0;
    const float tp = static_cast<float>(params.top_p ? params.top_p[r] : params.top_p0);
    const float mp = static_cast<float>(params.min_p ? params.min_p[r] : params.min_p0);
    const bool k_on = top_k_on(k, V), p_on = top_p_on(tp), mp_on = min_p_on(mp);
    RowRange rr = {-INFINITY, INFINITY, 0.f};
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = load_at(p, j);
      if (v != v || v == INFINITY) rr.bad = 1.f;
      rr.xmax = fmaxf(rr.xmax, v);
      rr.xmin = fminf(rr.xmin, v);
    }
    rr =
        block_all(rr, RowRange{-INFINITY, INFINITY, 0.f}, [](const RowRange& a, const RowRange& b) {
          return RowRange{fmaxf(a.xmax, b.xmax), fminf(a.xmin, b.xmin), fmaxf(a.bad, b.bad)};
        });
    if (rr.bad > 0.f || rr.xmax == -INFINITY) {  // undefined row
      fill_row(o, r, V, NAN);
      continue;
    }
    const float xmax = rr.xmax, xmin = rr.xmin;
    const bool valid = label >= 0 && label < V;
    const float xl = load_at(p, valid ? label : 0);
    Sums4 sa = {0.f, 0.f, 0.f, 0.f};
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
      sa.a += __expf((load_at(p, j) - xmax) * inv_t);
    const float s_all = block_all(sa, Sums4{0.f, 0.f, 0.f, 0.f}, add4).a;
    const int64_t hi = order_key(xmax);
    int64_t lo = order_key(xmin);
    float cut = -INFINITY;
    int64_t cut_i = V - 1;
    if (mp_on) {  // min-p: the smallest logit with nd >= log(min_p)
      const float lmp = min_p_bound(mp);
      Sums4 m4 = {INFINITY, 0.f, 0.f, 0.f};
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = load_at(p, j);
        if ((v - xmax) * inv_t >= lmp) m4.a = fminf(m4.a, v);
      }
      cut = block_all(m4, Sums4{INFINITY, 0.f, 0.f, 0.f}, [](const Sums4& a, const Sums4& b) {
              return Sums4{fminf(a.a, b.a), 0.f, 0.f, 0.f};
            }).a;
      lo = order_key(cut);
    }
    if (sglang) {
      // positions as (value, tie number): each filter's last kept token; the earliest wins
      float best_v = cut;
      int64_t best_m = INT64_MAX;  // min-p keeps whole tie groups
      if (k_on) {
        const int64_t t = search(p, V, order_key(xmin), hi, xmax, inv_t, float(k), 0);
        const Sums4 a = above(p, V, t, xmax, inv_t);
        const float vk = key_value(t);
        const int64_t mk = k - static_cast<int64_t>(a.a);
        if (vk > best_v || (vk == best_v && mk < best_m)) best_v = vk, best_m = mk;
      }
      if (p_on) {
        const float tau = tp * s_all;
        const int64_t t = search(p, V, order_key(xmin), hi, xmax, inv_t, tau, 2);
        const Sums4 a = above(p, V, t, xmax, inv_t);
        const float vp = key_value(t);
        const float e1 = a.c > 0.f ? a.d / a.c : 0.f;
        // the tie that crosses tau: the first m with mass_above + m * e1 > tau
        const float rr2 = e1 > 0.f ? fminf((tau - a.b) / e1, a.c) : a.c;
        int64_t m_p = static_cast<int64_t>(floorf(rr2)) + 1;
        if (m_p > static_cast<int64_t>(a.c)) m_p = INT64_MAX;
        if (vp > best_v || (vp == best_v && m_p < best_m)) best_v = vp, best_m = m_p;
      }
      cut = best_v;
      if (k_on || p_on) {
        const Sums4 a = above(p, V, order_key(best_v), xmax, inv_t);
        if (best_m < static_cast<int64_t>(a.c)) cut_i = nth_tie(p, V, best_v, best_m);
      }
    } else {
      if (k_on) {  // every tie of the k-th value (among what min-p keeps) stays
        cut = key_value(search(p, V, lo, hi, xmax, inv_t, float(k), 0));
      }
      if (p_on) {  // on what min-p and top-k keep, renormalised
        const float c0 = fmaxf(cut, xmin);
        const Sums4 a = above(p, V, order_key(c0), xmax, inv_t);
        const int64_t t = search(p, V, order_key(c0), hi, xmax, inv_t, tp * (a.b + a.d), 1);
        cut = fmaxf(cut, key_value(t));
      }
    }
    if (!(k_on || p_on || mp_on)) cut = -INFINITY;
    // sums over the kept set: mass, mass * nd (entropy), mass^2
    Sums4 ks = {0.f, 0.f, 0.f, 0.f};
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = load_at(p, j);
      if (!in_kept_set(v, j, cut, cut_i)) continue;
      const float nd = (v - xmax) * inv_t;
      const float e = __expf(nd);
      ks.a += e;
      ks.b += e * fmaxf(nd, -FLT_MAX);
      ks.c += e * e;
    }
    ks = block_all(ks, Sums4{0.f, 0.f, 0.f, 0.f}, add4);
    const float log_sk = __logf(ks.a);
    const bool in_set = in_kept_set(xl, label, cut, cut_i);
    if (threadIdx.x == 0) {
      o.lp[r] = !valid ? NAN : in_set ? (xl - xmax) * inv_t - log_sk : -INFINITY;
      o.lse[r] = xmax * inv_t + log_sk;
      o.cut[r] = cut;
      o.cut_index[r] = cut_i;
      o.outside[r] = valid && !in_set;
      if (o.ent) o.ent[r] = valid ? log_sk - ks.b / ks.a : NAN;
      if (o.sum_p2) o.sum_p2[r] = valid ? ks.c / (ks.a * ks.a) : NAN;
      if (o.full_lse) o.full_lse[r] = xmax * inv_t + __logf(s_all);
      if (o.is_argmax) o.is_argmax[r] = valid && xl == xmax;
    }
    if (o.stats_k > 0) {
      // the stats_k-th value; every token above it and its first ties, collected in index order
      // (block scans give each its slot), then sorted by thread 0
      const int64_t t = search(p, V, order_key(xmin), hi, xmax, inv_t, float(o.stats_k), 0);
      const Sums4 a = above(p, V, t, xmax, inv_t);
      const int ties = static_cast<int>(o.stats_k - static_cast<int64_t>(a.a));
      int written = 0, tie_seen = 0;
      for (int64_t j0 = 0; j0 < V; j0 += blockDim.x) {
        const int64_t j = j0 + threadIdx.x;
        const float v = j < V ? load_at(p, j) : -INFINITY;
        const int64_t kv = order_key(v);
        const int eq = j < V && kv == t ? 1 : 0;
        int tie_rank, agg;
        Scan(scan_tmp).InclusiveScan(eq, tie_rank, PlusInt(), agg);
        __syncthreads();
        tie_rank += tie_seen;
        tie_seen += agg;
        const int take = j < V && (kv > t || (eq && tie_rank <= ties)) ? 1 : 0;
        int pos, tagg;
        Scan(scan_tmp).ExclusiveScan(take, pos, 0, PlusInt(), tagg);
        __syncthreads();
        if (take) top[written + pos] = j;
        written += tagg;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        const int n = static_cast<int>(o.stats_k);
        for (int i = 1; i < n; ++i) {  // insertion sort in rank order
          const int64_t jj = top[i];
          const float vv = load_at(p, jj);
          int q = i - 1;
          while (q >= 0 && (load_at(p, top[q]) < vv || (load_at(p, top[q]) == vv && top[q] > jj))) {
            top[q + 1] = top[q];
            --q;
          }
          top[q + 1] = jj;
        }
        for (int i = 0; i < n; ++i) {
          const int64_t jj = top[i];
          const float vv = load_at(p, jj);
          o.top_ids[r * n + i] = jj;
          o.top_lp[r * n + i] =
              in_kept_set(vv, jj, cut, cut_i) ? (vv - xmax) * inv_t - log_sk : -INFINITY;
        }
      }
      __syncthreads();  // `top` is reused by the next row
    }
  }
}

// grad_j = inv_t (a (onehot_j - q_j) - b q_j (log q_j + H)) on the kept set, 0 outside; a = 0 when
// the label is outside. q from the kept set's sums relative to the row max (recomputed: the saved
// lse may have overflowed). g may alias x: each element is read, then written, by one thread.
template <typename scalar_t, typename index_t>
__global__ void sampler_bwd_kernel(const scalar_t* __restrict__ x, scalar_t* g,
                                   const index_t* __restrict__ labels,
                                   const float* __restrict__ glp, const float* __restrict__ gent,
                                   const float* __restrict__ cuts, const int64_t* __restrict__ cidx,
                                   int64_t N, int64_t V, RowIndexer rows, RowIndexer grows,
                                   SamplerParamPtrs params, int64_t ignore_index) {
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int64_t label = labels[r];
    const scalar_t* p = x + rows(r);
    scalar_t* q = g + grows(r);
    if (label == ignore_index) {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) q[j] = scalar_t(0);
      continue;
    }
    const bool valid = label >= 0 && label < V;
    const float inv_t = static_cast<float>(params.inv_t ? params.inv_t[r] : params.inv_t0);
    const float cut = cuts[r];
    const int64_t ci = cidx[r];
    Sums4 m4 = {-INFINITY, 0.f, 0.f, 0.f};
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = load_at(p, j);
      m4.a = (v != v || m4.a != m4.a) ? NAN : fmaxf(m4.a, v);
    }
    const float xmax =
        block_all(m4, Sums4{-INFINITY, 0.f, 0.f, 0.f}, [](const Sums4& a, const Sums4& b) {
          return Sums4{(a.a != a.a || b.a != b.a) ? NAN : fmaxf(a.a, b.a), 0.f, 0.f, 0.f};
        }).a;
    Sums4 ks = {0.f, 0.f, 0.f, 0.f};
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = load_at(p, j);
      if (!in_kept_set(v, j, cut, ci)) continue;
      const float nd = (v - xmax) * inv_t;
      const float e = __expf(nd);
      ks.a += e;
      ks.b += e * fmaxf(nd, -FLT_MAX);
    }
    ks = block_all(ks, Sums4{0.f, 0.f, 0.f, 0.f}, add4);
    const float log_sk = __logf(ks.a), h = log_sk - ks.b / ks.a;
    const bool undefined = !(xmax == xmax) || xmax == INFINITY || xmax == -INFINITY;
    const float xl = load_at(p, valid ? label : 0);
    const bool in_set = in_kept_set(xl, label, cut, ci);
    const float a = in_set ? glp[r] * inv_t : 0.f;
    const float b = gent ? gent[r] * inv_t : 0.f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = load_at(p, j);
      float gj;
      if (!valid || undefined) {
        gj = NAN;
      } else if (in_kept_set(v, j, cut, ci)) {
        const float logq = (v - xmax) * inv_t - log_sk;
        const float qq = __expf(logq);
        gj = -a * qq - b * weighted_offset(qq, logq + h) + (j == label ? a : 0.f);
      } else {
        gj = 0.f;
      }
      q[j] = static_cast<scalar_t>(gj);
    }
  }
}

template <class Dev>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fwd(const at::Tensor& logits, const at::Tensor& labels, double inv_temperature,
    const std::optional<at::Tensor>& inv_temperatures, int64_t top_k,
    const std::optional<at::Tensor>& top_ks, double top_p, const std::optional<at::Tensor>& top_ps,
    double min_p, const std::optional<at::Tensor>& min_ps, c10::string_view sampler,
    int64_t ignore_index, bool with_entropy, bool with_sum_p2, bool with_lse, int64_t stats_top_k,
    bool with_is_argmax) {
  // every tensor on logits' device (a ValueError naming it), then that device is this build's
  const DeviceOf on = device_of(logits, "logits");
  check_arg(labels, "labels", on);
  for (const auto& [t, name] : {std::pair{&inv_temperatures, "inv_temperatures"},
                                {&top_ks, "top_ks"},
                                {&top_ps, "top_ps"},
                                {&min_ps, "min_ps"}})
    if (t->has_value() && (*t)->defined()) check_arg(**t, name, on);
  TORCH_CHECK(Dev::accepts(logits) && Dev::accepts(labels), "logits and labels must be ",
              Dev::kTensorKind, " tensors");
  Dev device(logits);
  SamplerCall c = prepare_sampler_call(logits, labels, with_entropy, with_sum_p2, with_lse,
                                       stats_top_k, with_is_argmax);
  const int64_t N = c.base.N, V = c.base.V;
  const bool sglang = sampler_is_sglang(sampler);
  const SamplerParamPtrs params = sampler_params(on, N, inv_temperature, inv_temperatures, top_k,
                                                 top_ks, top_p, top_ps, min_p, min_ps);
  if (N == 0) return c.outputs();
  const RowOut o{c.base.logprobs.data_ptr<float>(),
                 with_entropy ? c.base.entropy.data_ptr<float>() : nullptr,
                 c.base.lse.data_ptr<float>(),
                 c.cut.data_ptr<float>(),
                 c.cut_index.data_ptr<int64_t>(),
                 c.outside.data_ptr<bool>(),
                 with_sum_p2 ? c.sum_p2.data_ptr<float>() : nullptr,
                 with_lse ? c.full_lse.data_ptr<float>() : nullptr,
                 stats_top_k > 0 ? c.top_ids.data_ptr<int64_t>() : nullptr,
                 stats_top_k > 0 ? c.top_lp.data_ptr<float>() : nullptr,
                 with_is_argmax ? c.is_argmax.data_ptr<bool>() : nullptr,
                 stats_top_k};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, c.base.logits.scalar_type(), "token_logprobs_sampler_fwd_cuda",
      [&] {
        AT_DISPATCH_INDEX_TYPES(
            c.base.labels.scalar_type(), "token_logprobs_sampler_fwd_cuda", [&] {
              device.launch(
                  "token_logprobs_sampler fwd_kernel", &sampler_fwd_kernel<scalar_t, index_t>,
                  dev::grid_for_rows(N, Dev::max_row_blocks()), kThreads, 0,
                  c.base.logits.const_data_ptr<scalar_t>(), c.base.labels.const_data_ptr<index_t>(),
                  o, N, V, c.base.rows, params, sglang, ignore_index);
            });
      });
  return c.outputs();
}

template <class Dev>
void bwd(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
         const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
         const at::Tensor& entropy, const at::Tensor& cut_in, const at::Tensor& cut_index_in,
         double inv_temperature, const std::optional<at::Tensor>& inv_temperatures,
         int64_t ignore_index, at::Tensor grad_logits) {
  // every tensor on logits' device (a ValueError naming it), then that device is this build's
  const DeviceOf on = device_of(logits, "logits");
  for (const auto& [t, name] : {std::pair{&grad_logprobs, "grad_logprobs"},
                                {&labels, "labels"},
                                {&lse, "lse"},
                                {&entropy, "entropy"},
                                {&cut_in, "cut"},
                                {&cut_index_in, "cut_index"},
                                {&grad_logits, "grad_logits"}})
    check_arg(*t, name, on);
  if (grad_entropy.has_value() && grad_entropy->defined())
    check_arg(*grad_entropy, "grad_entropy", on);
  if (inv_temperatures.has_value() && inv_temperatures->defined())
    check_arg(*inv_temperatures, "inv_temperatures", on);
  TORCH_CHECK(Dev::accepts(logits) && Dev::accepts(grad_logits), "logits and grad_logits must be ",
              Dev::kTensorKind, " tensors");
  Dev device(logits);
  const LogprobsGradCall c = prepare_logprobs_grad_call(grad_logprobs, grad_entropy, logits, labels,
                                                        lse, entropy, grad_logits);
  const int64_t N = c.N, V = c.V;
  check_arg(cut_in, "cut", on, Kind::kFloat32, N, "logits.shape[:-1]");
  check_arg(cut_index_in, "cut_index", on, Kind::kAny, N, "logits.shape[:-1]");
  TORCH_CHECK_TYPE(cut_index_in.scalar_type() == at::kLong, "cut_index: expected dtype int64, got ",
                   dtype_name(cut_index_in.scalar_type()));
  const SamplerParamPtrs params =
      sampler_params(on, N, inv_temperature, inv_temperatures, 0, std::nullopt, 1.0, std::nullopt,
                     0.0, std::nullopt);
  if (N == 0) return;
  const at::Tensor cut = cut_in.contiguous(), cut_index = cut_index_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_sampler_bwd_cuda", [&] {
        AT_DISPATCH_INDEX_TYPES(c.labels.scalar_type(), "token_logprobs_sampler_bwd_cuda", [&] {
          device.launch("token_logprobs_sampler bwd_kernel", &sampler_bwd_kernel<scalar_t, index_t>,
                        dev::grid_for_rows(N, Dev::max_row_blocks()), kThreads, 0,
                        logits.const_data_ptr<scalar_t>(), grad_logits.data_ptr<scalar_t>(),
                        c.labels.const_data_ptr<index_t>(), c.glp.const_data_ptr<float>(),
                        c.gent_ptr(), cut.const_data_ptr<float>(),
                        cut_index.const_data_ptr<int64_t>(), N, V, c.rows, c.grad_rows, params,
                        ignore_index);
        });
      });
}

}  // namespace token_logprobs_sampler_cuda
}  // namespace ppo_kernels
