// The emulator's own test kernels (tests/test_simt_emulator.py): small correct kernels that use
// each emulated feature, and deliberately broken ones, each of which one check must catch.
#include <ATen/ops/full.h>
#include <torch/library.h>

#include "cuda/device.cuh"
#include "testing/simt.h"

namespace ppo_kernels {
namespace {

constexpr int kBlock = 128;

// Correct: per-block sum by warp shuffles (down) and one shared partial per warp.
__global__ void warp_sum(const float* x, float* out, int64_t n) {
  PPO_SHARED(float, partial, [kBlock / 32]);
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  float v = i < n ? x[i] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < kBlock / 32; ++w) s += partial[w];
    out[blockIdx.x] = s;
  }
}

// Correct: exclusive prefix sum of each block's items through cub::BlockScan, plus the aggregate
// in the block's last output; lanes also exchange through __shfl_sync and __ballot_sync.
__global__ void block_scan(const float* x, float* out, int64_t n) {
  using Scan = cub::BlockScan<float, kBlock>;
  PPO_SHARED(typename Scan::TempStorage, tmp);
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const float v = i < n ? x[i] : 0.f;
  float excl, agg;
  Scan(tmp).ExclusiveScan(v, excl, 0.f, [](float a, float b) { return a + b; }, agg);
  const unsigned lane = threadIdx.x & 31;
  const float from0 = __shfl_sync(0xffffffffu, v, 0);        // lane 0's item
  const unsigned pos = __ballot_sync(0xffffffffu, v > 0.f);  // lanes with a positive item
  if (i < n) out[i] = excl + 0.f * from0 + 0.f * float(pos >> lane & 1u);
  if (threadIdx.x == 0) out[n + blockIdx.x] = agg + from0 - from0;
}

// Broken: the shared buffer is refilled for the second round without a barrier after the first
// round's reads (caught by the random fiber order: a neighbour's value of the wrong round).
template <bool kSync>
__global__ void reuse_race(const float* x, float* out, int64_t n) {
  PPO_SHARED(float, buf, [kBlock]);
  const int t = threadIdx.x;
  float total = 0.f;
  for (int round = 0; round < 2; ++round) {
    buf[t] = x[(round * kBlock + t) % n];
    __syncthreads();
    total += buf[(t + 1) % kBlock] * (round + 1);
    if (kSync) __syncthreads();
  }
  out[t] = total;
}

// Broken: half of the shared buffer is never written before it is read (caught by the 0xff fill:
// NaN).
__global__ void read_unwritten(const float* x, float* out, int64_t n) {
  PPO_SHARED(float, buf, [kBlock]);
  const int t = threadIdx.x;
  if (t < kBlock / 2) buf[t] = x[t % n];
  __syncthreads();
  out[t] = buf[kBlock - 1 - t];
}

// Broken: thread t reads x[t + 1], one past the end for the last thread (caught by the guard page
// or, for writes, the canary).
__global__ void off_by_one_read(const float* x, float* out, int64_t n) {
  const int64_t t = threadIdx.x;
  if (t < n) out[t] = x[t + 1];
}
__global__ void off_by_one_write(const float* x, float* out, int64_t n) {
  const int64_t t = threadIdx.x;
  if (t < n) out[t + 1] = x[t];
}

// Broken: lane 31 leaves before a full-mask shuffle.
__global__ void shuffle_lane_missing(const float* x, float* out, int64_t n) {
  const int t = threadIdx.x;
  if ((t & 31) == 31) return;
  float v = x[t % n];
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[t] = v;
}

// Broken: only the first warp reaches the barrier.
__global__ void divergent_barrier(const float* x, float* out, int64_t n) {
  const int t = threadIdx.x;
  if (t < 32) __syncthreads();
  out[t] = x[t % n];
}

// Broken: the two halves of the block wait at different barriers.
__global__ void split_barrier(const float* x, float* out, int64_t n) {
  const int t = threadIdx.x;
  if (t < 64) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[t] = x[t % n];
}

// Broken: 52 KB of static shared memory (the limit is 48 KiB).
__global__ void too_much_shared(const float* x, float* out, int64_t n) {
  PPO_SHARED(float, big, [13000]);
  big[threadIdx.x] = x[threadIdx.x % n];
  __syncthreads();
  out[threadIdx.x] = big[(threadIdx.x + 1) % blockDim.x];
}

// Broken, caught only by the sanitizers (scripts/sanitize.sh,
// tests/simt/test_sanitizer_findings.py): the last thread reads the shared element one past the
// array (a template, as the real kernels are) ...
template <int kN>
__global__ void shared_off_by_one(const float* x, float* out, int64_t n) {
  PPO_SHARED(float, buf, [kN]);
  const int t = threadIdx.x;
  buf[t] = x[t % n];
  __syncthreads();
  out[t] = buf[t + 1];
}
// ... and one past a local array, through a pointer the compiler cannot follow (UBSan's bounds
// checks cannot see it: ASan's stack redzones must, after the fiber was switched out at the
// barrier and back in).
__global__ void local_off_by_one(const float* x, float* out, int64_t n) {
  float loc[4];
  const int t = threadIdx.x;
  for (int k = 0; k < 4; ++k) loc[k] = x[(t + k) % n];
  float* p = loc;
  asm volatile("" : "+r"(p));
  __syncthreads();
  out[t] = p[t == kBlock - 1 ? 4 : t % 4];
}

at::Tensor selftest(const std::string& name, const at::Tensor& x_in, int64_t blocks) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 1 && x_in.numel() > 0,
              "selftest: x");
  simt::GuardScope guard;
  const at::Tensor x = x_in.clone();  // guarded
  const int64_t n = x.numel();
  const float* xp = x.const_data_ptr<float>();
  at::Tensor out;
  simt::Device dev(x);
  auto run = [&](auto kernel, int64_t out_n, int64_t grid) {
    out = at::full({out_n}, NAN, x.options());
    dev.launch(name.c_str(), kernel, grid, kBlock, 0, xp, out.data_ptr<float>(), n);
  };
  if (name == "warp_sum")
    run(&warp_sum, blocks, blocks);
  else if (name == "block_scan")
    run(&block_scan, n + blocks, blocks);
  else if (name == "reuse_race_ok")
    run(&reuse_race<true>, kBlock, 1);
  else if (name == "reuse_race")
    run(&reuse_race<false>, kBlock, 1);
  else if (name == "read_unwritten")
    run(&read_unwritten, kBlock, 1);
  else if (name == "off_by_one_read")
    run(&off_by_one_read, n, 1);
  else if (name == "off_by_one_write")
    run(&off_by_one_write, n, 1);
  else if (name == "shuffle_lane_missing")
    run(&shuffle_lane_missing, kBlock, 1);
  else if (name == "divergent_barrier")
    run(&divergent_barrier, kBlock, 1);
  else if (name == "split_barrier")
    run(&split_barrier, kBlock, 1);
  else if (name == "too_much_shared")
    run(&too_much_shared, kBlock, 1);
  else if (name == "shared_off_by_one")
    run(&shared_off_by_one<kBlock>, kBlock, 1);
  else if (name == "local_off_by_one")
    run(&local_off_by_one, kBlock, 1);
  else if (name == "block_too_large") {
    out = at::full({n}, NAN, x.options());
    dev.launch(name.c_str(), &warp_sum, 1, 2048, 0, xp, out.data_ptr<float>(), n);
  } else
    TORCH_CHECK(false, "selftest: unknown kernel ", name);
  return out;
}

}  // namespace

void register_simt_selftests(torch::Library& m) {
  m.def("selftest(str name, Tensor x, int blocks=1) -> Tensor", &selftest);
}

}  // namespace ppo_kernels
