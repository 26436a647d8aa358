// SIMT emulator: runs the CUDA kernels of csrc/cuda/*.cuh as host C++ on the CPU (test tooling,
// built into ppo_kernels._simt only with PPO_KERNELS_BUILD_SIMT=1). See csrc/testing/README.md.
//
// A launch runs its blocks one after another in a shuffled order. Every CUDA thread of a block is
// a stackful fiber (its own switch on x86-64, else ucontext); a fiber runs until it reaches
// __syncthreads, a warp shuffle / vote, or its end, and the scheduler then picks the next fiber at
// random (seeded): between two synchronisation points the threads of a block run in a random order
// (per block, either any ready thread at random, or warps by random priority so that one warp runs
// far ahead of the others), so a missing barrier or a shared-memory race changes the result. Checks
// that raise simt::Error (category in brackets):
//   [barrier]  a thread exits, or waits at another __syncthreads, while others wait at one;
//   [shuffle]  a lane named in a shuffle's mask never arrives (exited, at a barrier, at another
//              shuffle), the calling lane is not in its mask, or a lane reads a lane outside it;
//   [memory]   an access outside a global buffer (guard pages, see simt.cpp), a fiber stack
//              overflow, any other fault inside a kernel;
//   [shared]   more than 48 KiB of static shared memory;
//   [launch]   bad launch geometry (block > 1024 threads, empty grid, dynamic shared memory).
// Shared memory (PPO_SHARED) is filled with 0xff bytes (NaN for float / bf16 / half, -1 for ints)
// at the start of every block, so a read of a never-written element shows up as NaN.
//
// This header is the host side of csrc/cuda/device.cuh: it defines what nvcc provides
// (__global__, threadIdx, __syncthreads, shuffles, __expf, ...) for g++.
#pragma once
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Per fiber: the scheduler sets them each time it switches to a fiber.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

namespace simt {

enum class Check { kBarrier, kShuffle, kMemory, kShared, kLaunch, kKernel };
const char* check_name(Check c);

struct Error : std::runtime_error {
  Check check;
  Error(Check c, const std::string& what);
};

// ---- synchronisation (implemented in simt.cpp) --------------------------------------------------
void syncthreads(const char* file, int line);

enum class ShflKind { kIdx, kUp, kDown, kXor, kBallot, kSyncWarp };
// Exchanges one 64-bit payload per lane among the lanes of `mask`; returns what this lane gets.
uint64_t warp_exchange(ShflKind kind, unsigned mask, uint64_t value, int arg, int width,
                       const char* file, int line);

// Registers static shared storage at first use in the current block (and 0xff-fills it then).
void shared_region(void* p, size_t bytes);

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a large type");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

template <typename T>
T shfl(ShflKind k, unsigned mask, T v, int arg, int width, const char* file, int line) {
  return from_bits<T>(warp_exchange(k, mask, to_bits(v), arg, width, file, line));
}
// The intrinsics, with the call site first (for the messages) and CUDA's default width.
template <typename T>
T shfl_idx(const char* f, int l, unsigned mask, T v, int src, int width = 32) {
  return shfl(ShflKind::kIdx, mask, v, src, width, f, l);
}
template <typename T>
T shfl_up(const char* f, int l, unsigned mask, T v, unsigned d, int width = 32) {
  return shfl(ShflKind::kUp, mask, v, static_cast<int>(d), width, f, l);
}
template <typename T>
T shfl_down(const char* f, int l, unsigned mask, T v, unsigned d, int width = 32) {
  return shfl(ShflKind::kDown, mask, v, static_cast<int>(d), width, f, l);
}
template <typename T>
T shfl_xor(const char* f, int l, unsigned mask, T v, int m, int width = 32) {
  return shfl(ShflKind::kXor, mask, v, m, width, f, l);
}
inline unsigned ballot(const char* f, int l, unsigned mask, bool pred) {
  return static_cast<unsigned>(warp_exchange(ShflKind::kBallot, mask, pred ? 1 : 0, 0, 32, f, l));
}
inline void syncwarp(const char* f, int l, unsigned mask = 0xffffffffu) {
  warp_exchange(ShflKind::kSyncWarp, mask, 0, 0, 32, f, l);
}

// ---- launches
// ------------------------------------------------------------------------------------ Runs body()
// as every thread of every block of the grid. `name` appears in error messages.
void run(const char* name, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);

template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A&&... a) {
  // Arguments converted to the kernel's parameter types once, as a CUDA launch copies them.
  std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
  run(name, grid, block, smem, [&] { std::apply(kernel, args); });
}

// "kernel grid=G block=B" of every launch since the last call (tests check which path ran).
std::vector<std::string> take_launch_log();

// Seed of the fiber order, the block order and the guard-page placement (per launch, from a
// sequence started by set_seed).
void set_seed(uint64_t seed);
uint64_t next_random();

// ---- global memory guards (simt.cpp)
// -------------------------------------------------------------- While a GuardScope is alive on
// this thread, CPU tensor allocations go to guarded mappings: the buffer's end (or, at random one
// time in four, its start) abuts a PROT_NONE page, and the slack on the other side holds a canary
// checked after every launch.
struct GuardScope {
  GuardScope();
  ~GuardScope();
  bool prev;
};

}  // namespace simt

#define __syncthreads() ::simt::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::simt::syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_sync(...) ::simt::shfl_idx(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::simt::shfl_up(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::simt::shfl_down(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::simt::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(mask, pred) ::simt::ballot(__FILE__, __LINE__, mask, pred)
#define __any_sync(mask, pred) (__ballot_sync(mask, pred) != 0u)
#define __all_sync(mask, pred) (__ballot_sync(mask, pred) == (mask))

// Static shared memory: `PPO_SHARED(type, name, dims)` declares `__shared__ type name dims`.
#define PPO_SHARED(T, name, ...) \
  static T name __VA_ARGS__;     \
  ::simt::shared_region(&name, sizeof(name))
// Plain __shared__ would be one static buffer the emulator cannot poison: refuse it.
#define __shared__ static_assert(false, "declare shared memory with PPO_SHARED(type, name, dims)");

// Math intrinsics: host equivalents (the fast-math approximations are more accurate here).
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float a, float b) { return a / b; }
// Never contracted into an FMA with what follows (noinline: whatever -ffp-contract says).
[[gnu::noinline]] inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

namespace simt {

// The emulator's side of csrc/cuda/device.cuh: the shared launchers call dev.launch(...).
struct Device {
  static constexpr const char* kTensorKind = "CPU (SIMT emulator)";
  static bool accepts(const at::Tensor& t) { return t.device().is_cpu(); }
  explicit Device(const at::Tensor&) {}
  // Set by the tests (set_geometry) to reach every launch plan with small inputs.
  static int sm_count();
  static int64_t max_row_blocks();
  template <typename... P, typename... A>
  void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
              A&&... a) {
    ::simt::launch(name, kernel, grid, block, smem, std::forward<A>(a)...);
  }
};
void set_geometry(int sm_count, int64_t max_row_blocks);

}  // namespace simt
