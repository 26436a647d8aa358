// gae: the CUDA kernels and their host launcher (schema in csrc/cpu/gae.cpp; semantics in
// ppo_kernels/gae/naive.py), compiled by nvcc for the GPU (gae.cu) and by g++ for the SIMT
// emulator (csrc/testing/).
//
// The flat token sequence is cut into chunks, one block per chunk. A block walks its chunk right
// to left in tiles of kThreads * kItems tokens: each thread composes its kItems consecutive
// positions (right to left) into one GaeMap (csrc/common/gae_combine.h), a cub BlockScan composes
// the threads' maps (thread 0 holds the rightmost positions), and each thread replays its
// positions from the state entering it. Row edges are constant maps injecting the row's carry, so
// a chunk may span many rows and rows may span many chunks:
//   aligned (dense rows and every chunk ends at a row end): one pass;
//   otherwise: (1) each chunk's composed map, (2) one block scans the chunk maps right to left
//   into the carry entering each chunk, (3) every chunk reruns from its carry and writes.
// No host synchronisation; all offsets are 64-bit; packed rows find their row by binary search.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>

#include "common/alloc.h"
#include "common/gae_combine.h"
#include "common/tensor_checks.h"
#include "cuda/device.cuh"

namespace ppo_kernels {
namespace gae_cuda {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int64_t kTile = kThreads * kItems;

struct ComposeOp {
  __device__ __forceinline__ GaeMap operator()(const GaeMap& first, const GaeMap& then) const {
    return gae_compose(first, then);
  }
};

struct Params {
  const void* r;
  const void* v;
  const uint8_t* mask;
  const uint8_t* dones;
  const float* gamma_t;
  const float* lam_t;
  const float* init_value;
  const float* init_adv;
  const int32_t* cu;  // packed rows, else nullptr
  float* adv;
  float* ret;
  float* carry_v;
  float* carry_a;
  GaeMap* maps;     // [n_chunks] (passes 1 and 2)
  GaeState* carry;  // [n_chunks] (passes 2 and 3)
  int64_t N, chunk, row_len, n_rows;
  float gamma, lam;
};

// The row holding position pos, walked leftwards one position at a time.
struct RowWalker {
  int64_t row, start, end;
  __device__ void init(const Params& P, int64_t pos) {
    if (P.cu) {
      int64_t lo = 0, hi = P.n_rows - 1;  // largest row with cu[row] <= pos
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (static_cast<int64_t>(P.cu[mid]) <= pos)
          lo = mid;
        else
          hi = mid - 1;
      }
      row = lo;
      start = P.cu[row];
      end = P.cu[row + 1];
    } else {
      row = pos / P.row_len;
      start = row * P.row_len;
      end = start + P.row_len;
    }
  }
  __device__ void seek(const Params& P, int64_t pos) {  // pos only ever decreases
    while (pos < start && row > 0) {
      --row;
      end = start;
      start = P.cu ? static_cast<int64_t>(P.cu[row]) : start - P.row_len;
    }
  }
};

template <typename scalar_t>
__device__ __forceinline__ GaeMap element_map(const Params& P, int64_t pos, const RowWalker& w,
                                              float& v_out) {
  const float r = static_cast<float>(static_cast<const scalar_t*>(P.r)[pos]);
  const float v = static_cast<float>(static_cast<const scalar_t*>(P.v)[pos]);
  v_out = v;
  const bool act = P.mask ? P.mask[pos] != 0 : true;
  const bool done = P.dones ? P.dones[pos] != 0 : false;
  const float g = P.gamma_t ? P.gamma_t[pos] : P.gamma;
  const float l = P.lam_t ? P.lam_t[pos] : P.lam;
  GaeMap f = gae_element(act, done, r, v, g, l);
  if (pos == w.end - 1) {  // the row's last position first takes the row's carry
    const GaeState init{P.init_value ? P.init_value[w.row] : 0.f,
                        P.init_adv ? P.init_adv[w.row] : 0.f};
    f = gae_compose(gae_constant(init), f);
  }
  return f;
}

// mode 0: aligned single pass; 1: the chunk's composed map only; 2: final pass from P.carry.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) gae_chunk_kernel(Params P, int mode) {
  using Scan = cub::BlockScan<GaeMap, kThreads>;
  PPO_SHARED(typename Scan::TempStorage, tmp);
  const int64_t chunk_id = blockIdx.x;
  const int64_t lo = chunk_id * P.chunk;
  const int64_t hi = lo + P.chunk < P.N ? lo + P.chunk : P.N;
  GaeState s = mode == 2 ? P.carry[chunk_id] : GaeState{0.f, 0.f};
  GaeMap total = gae_identity();
  for (int64_t tile_hi = hi; tile_hi > lo; tile_hi -= kTile) {
    const int64_t first = tile_hi - 1 - static_cast<int64_t>(threadIdx.x) * kItems;  // rightmost
    GaeMap maps[kItems];
    float vals[kItems];
    GaeMap mine = gae_identity();
    RowWalker w{0, 0, 0};
    if (first >= lo) w.init(P, first);
    const RowWalker w0 = w;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t pos = first - k;
      if (pos >= lo) {
        w.seek(P, pos);
        maps[k] = element_map<scalar_t>(P, pos, w, vals[k]);
      } else {
        maps[k] = gae_identity();
        vals[k] = 0.f;
      }
      mine = gae_compose(mine, maps[k]);
    }
    GaeMap excl, agg;
    Scan(tmp).ExclusiveScan(mine, excl, gae_identity(), ComposeOp(), agg);
    __syncthreads();  // tmp is reused by the next tile
    if (mode == 1) {
      total = gae_compose(total, agg);
      continue;
    }
    GaeState st = gae_apply(excl, s);
    w = w0;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t pos = first - k;
      if (pos >= lo) {
        w.seek(P, pos);
        st = gae_apply(maps[k], st);
        P.adv[pos] = st.adv;
        P.ret[pos] = st.adv + vals[k];
        if (pos == w.start) {
          P.carry_v[w.row] = st.nv;
          P.carry_a[w.row] = st.adv;
        }
      }
    }
    s = gae_apply(agg, s);
  }
  if (mode == 1 && threadIdx.x == 0) P.maps[chunk_id] = total;
}

// One block: the carry entering each chunk, scanning the chunk maps right to left.
__global__ void __launch_bounds__(kThreads)
    gae_carry_kernel(const GaeMap* maps, GaeState* carry, int64_t n_chunks) {
  using Scan = cub::BlockScan<GaeMap, kThreads>;
  PPO_SHARED(typename Scan::TempStorage, tmp);
  GaeState s{0.f, 0.f};  // the last chunk ends at the last row's end: its carry is unused
  for (int64_t hi = n_chunks; hi > 0; hi -= kThreads) {
    const int64_t idx = hi - 1 - threadIdx.x;
    const GaeMap f = idx >= 0 ? maps[idx] : gae_identity();
    GaeMap excl, agg;
    Scan(tmp).ExclusiveScan(f, excl, gae_identity(), ComposeOp(), agg);
    __syncthreads();
    if (idx >= 0) carry[idx] = gae_apply(excl, s);
    s = gae_apply(agg, s);
  }
}

inline const void* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->const_data_ptr() : nullptr;
}

// Chunking: whole rows per block when there are enough rows (one pass), else ~4 blocks per SM.
struct ChunkPlan {
  bool aligned;
  int64_t chunk, n_chunks;
};

inline ChunkPlan plan_chunks(int64_t N, int64_t n_rows, int64_t row_len, bool packed,
                             int sm_count) {
  const int64_t target = 4 * static_cast<int64_t>(sm_count);
  if (!packed) {
    const int64_t rows_per = std::max<int64_t>(1, kTile / row_len);
    if ((n_rows + rows_per - 1) / rows_per >= std::max<int64_t>(1, target / 2)) {
      const int64_t chunk = rows_per * row_len;
      return {true, chunk, (N + chunk - 1) / chunk};
    }
  }
  const int64_t per = (N + target - 1) / target;
  const int64_t chunk = std::max<int64_t>(kTile, (per + kTile - 1) / kTile * kTile);
  return {false, chunk, (N + chunk - 1) / chunk};
}

template <class Dev>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd(
    const at::Tensor& rewards, const at::Tensor& values, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& dones, const std::optional<at::Tensor>& gamma_t,
    const std::optional<at::Tensor>& lam_t, double gamma, double lam,
    const std::optional<at::Tensor>& init_value, const std::optional<at::Tensor>& init_adv,
    const std::optional<at::Tensor>& cu_seqlens, int64_t n_rows, int64_t row_len) {
  // every tensor on rewards' device (a named ValueError), then that device is this build's
  const DeviceOf on = device_of(rewards, "rewards");
  check_arg(values, "values", on);
  for (const auto& [t, name] : {std::pair{&mask, "mask"},
                                {&dones, "dones"},
                                {&gamma_t, "gamma_t"},
                                {&lam_t, "lam_t"},
                                {&init_value, "init_value"},
                                {&init_adv, "init_adv"},
                                {&cu_seqlens, "cu_seqlens"}}) {
    if (t->has_value() && (*t)->defined()) check_arg(**t, name, on);
  }
  TORCH_CHECK(Dev::accepts(rewards) && Dev::accepts(values), "gae_fwd: rewards and values must be ",
              Dev::kTensorKind, " tensors");
  Dev device(rewards);
  const int64_t N = rewards.numel();
  TORCH_CHECK(rewards.is_contiguous() && values.is_contiguous() && values.numel() == N &&
                  values.scalar_type() == rewards.scalar_type(),
              "gae_fwd: rewards and values must be contiguous, of one dtype and size");
  auto check = [&](const std::optional<at::Tensor>& t, int64_t n, bool is_float, const char* name) {
    if (!t.has_value() || !t->defined()) return;
    TORCH_CHECK(Dev::accepts(*t) && t->is_contiguous() && t->numel() == n &&
                    (is_float ? t->scalar_type() == at::kFloat
                              : (t->scalar_type() == at::kBool || t->scalar_type() == at::kByte)),
                "gae_fwd: bad ", name);
  };
  check(mask, N, false, "mask");
  check(dones, N, false, "dones");
  check(gamma_t, N, true, "gamma_t");
  check(lam_t, N, true, "lam_t");
  check(init_value, n_rows, true, "init_value");
  check(init_adv, n_rows, true, "init_adv");
  const bool packed = cu_seqlens.has_value() && cu_seqlens->defined();
  if (packed) {
    TORCH_CHECK(cu_seqlens->scalar_type() == at::kInt && cu_seqlens->is_contiguous() &&
                    cu_seqlens->numel() == n_rows + 1,
                "gae_fwd: cu_seqlens must be contiguous int32 with n_rows + 1 entries");
    TORCH_CHECK(N < (int64_t{1} << 31), "gae_fwd: packed inputs are limited to 2^31 - 1 tokens");
  } else {
    TORCH_CHECK(n_rows * row_len == N, "gae_fwd: n_rows * row_len != numel");
  }
  const auto f32 = rewards.options().dtype(at::kFloat);
  // shaped like rewards: the registered op passes [B, T] tensors as they are (no views)
  at::Tensor adv = new_output(rewards.sizes(), f32), ret = new_output(rewards.sizes(), f32);
  at::Tensor cv, ca;
  if (packed || N == 0) {  // empty rows are never visited: they keep the carry they came with
    cv = init_value.has_value() && init_value->defined() ? init_value->clone()
                                                         : at::zeros({n_rows}, f32);
    ca = init_adv.has_value() && init_adv->defined() ? init_adv->clone() : at::zeros({n_rows}, f32);
  } else {
    cv = new_output({n_rows}, f32);
    ca = new_output({n_rows}, f32);
  }
  if (N == 0) return {adv, ret, cv, ca};

  Params P{};
  P.r = rewards.const_data_ptr();
  P.v = values.const_data_ptr();
  P.mask = static_cast<const uint8_t*>(opt_ptr(mask));
  P.dones = static_cast<const uint8_t*>(opt_ptr(dones));
  P.gamma_t = static_cast<const float*>(opt_ptr(gamma_t));
  P.lam_t = static_cast<const float*>(opt_ptr(lam_t));
  TORCH_CHECK((P.gamma_t == nullptr) == (P.lam_t == nullptr),
              "gae_fwd: gamma_t and lam_t come together");
  P.init_value = static_cast<const float*>(opt_ptr(init_value));
  P.init_adv = static_cast<const float*>(opt_ptr(init_adv));
  P.cu = packed ? cu_seqlens->const_data_ptr<int32_t>() : nullptr;
  P.adv = adv.data_ptr<float>();
  P.ret = ret.data_ptr<float>();
  P.carry_v = cv.data_ptr<float>();
  P.carry_a = ca.data_ptr<float>();
  P.N = N;
  P.row_len = packed ? 1 : row_len;
  P.n_rows = n_rows;
  P.gamma = static_cast<float>(gamma);
  P.lam = static_cast<float>(lam);

  const ChunkPlan plan = plan_chunks(N, n_rows, row_len, packed, Dev::sm_count());
  const bool aligned = plan.aligned;
  const int64_t chunk = plan.chunk, n_chunks = plan.n_chunks;
  TORCH_CHECK(n_chunks < (int64_t{1} << 31), "gae_fwd: too many chunks");
  P.chunk = chunk;
  at::Tensor maps, carry;
  if (!aligned) {
    maps = at::empty({n_chunks * static_cast<int64_t>(sizeof(GaeMap))},
                     rewards.options().dtype(at::kByte));
    carry = at::empty({n_chunks * static_cast<int64_t>(sizeof(GaeState))},
                      rewards.options().dtype(at::kByte));
    P.maps = reinterpret_cast<GaeMap*>(maps.data_ptr());
    P.carry = reinterpret_cast<GaeState*>(carry.data_ptr());
  }
  const dim3 grid(static_cast<unsigned>(n_chunks));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, rewards.scalar_type(), "gae_fwd_cuda", [&] {
        if (aligned) {
          device.launch("gae_chunk_kernel (single pass)", &gae_chunk_kernel<scalar_t>, grid,
                        kThreads, 0, P, 0);
        } else {
          device.launch("gae_chunk_kernel (chunk maps)", &gae_chunk_kernel<scalar_t>, grid,
                        kThreads, 0, P, 1);
          device.launch("gae_carry_kernel", &gae_carry_kernel, 1, kThreads, 0, P.maps, P.carry,
                        n_chunks);
          device.launch("gae_chunk_kernel (final)", &gae_chunk_kernel<scalar_t>, grid, kThreads, 0,
                        P, 2);
        }
      });
  return {adv, ret, cv, ca};
}

}  // namespace gae_cuda
}  // namespace ppo_kernels
