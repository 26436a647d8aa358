// gae: CPU kernel and the schema of the raw kernel (CUDA impl in csrc/cuda/gae.cu).
// Semantics: ppo_kernels/gae/naive.py; the scan algebra: csrc/common/gae_combine.h.
//
// Work is split into tasks = (row, chunk of that row). Short rows are one task each and run the
// sequential recursion directly. Long rows (few rows, e.g. B=1, T=10^6) are cut into chunks:
//   pass 1 (parallel): each chunk but a row's leftmost composes its positions into one GaeMap;
//   pass 2 (serial, one step per chunk): the carry entering each chunk, right to left;
//   pass 3 (parallel): every chunk runs the recursion from its carry and writes its outputs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/alloc.h"
#include "common/tensor_checks.h"

// No fused multiply-adds in the recursion: a row that runs as one task then gives bit for bit the
// numbers of verl's eager loop (separately rounded mul and add), which the tests check.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "common/gae_combine.h"
#if defined(__AVX2__)
#define PPO_GAE_AVX2 1
#include "cpu/gae_avx2.h"
#endif

namespace ppo_kernels {
namespace {

struct Inputs {
  const void* rewards;
  const void* values;
  const void* mask;      // uint8 (bool) or float32 (nonzero = action); nullptr: all actions
  const uint8_t* dones;  // nullptr: no dones
  const float* gamma_t;  // nullptr: scalar gamma
  const float* lam_t;    // nullptr: scalar lam
  float gamma, lam, gl;  // scalars (gl = gamma * lam rounded once)
};

struct Task {
  int64_t row, lo, hi;  // positions [lo, hi) of row `row` (flat offsets)
  bool rightmost;       // the chunk at the row's right edge (its carry is the row's init)
};

// Tasks run in groups of kGroup: the recursion is a chain of dependent float ops (latency-bound,
// ~8 cycles a position), so a thread advances kGroup independent rows / chunks in lockstep: with
// AVX2 as the 8 lanes of one vector (csrc/cpu/gae_avx2.h), otherwise interleaved scalar chains.
constexpr int kGroup = 8;
// Long rows are cut into chunks (tasks) of at least kMinChunk positions, and into enough of them
// for kGroupsPerThread groups per thread.
constexpr int64_t kMinChunk = 16384;
constexpr int64_t kGroupsPerThread = 2;

template <typename scalar_t, typename mask_t, bool kMask, bool kDones, bool kTokenGL>
struct Kernel {
  const scalar_t* r;
  const scalar_t* v;
  const mask_t* mk;
  const uint8_t* dn;
  const float* gt;
  const float* lt;
  float gamma, lam, gl;
#ifdef PPO_GAE_AVX2
  using Lanes = gae_avx2::Lanes<scalar_t, mask_t, kMask, kDones, kTokenGL>;
  static_assert(kGroup == gae_avx2::kLanes, "a group is one vector's lanes");
#endif

  explicit Kernel(const Inputs& in)
      : r(static_cast<const scalar_t*>(in.rewards)),
        v(static_cast<const scalar_t*>(in.values)),
        mk(static_cast<const mask_t*>(in.mask)),
        dn(in.dones),
        gt(in.gamma_t),
        lt(in.lam_t),
        gamma(in.gamma),
        lam(in.lam),
        gl(in.gl) {}

  // One position of the recursion; writes adv[t] and ret[t].
  inline GaeState step(int64_t t, GaeState s, float* adv, float* ret) const {
    const bool action = kMask ? mk[t] != 0 : true;
    const bool done = kDones ? dn[t] != 0 : false;
    const float g = kTokenGL ? gt[t] : gamma;
    const float glt = kTokenGL ? gt[t] * lt[t] : gl;
    const float vt = static_cast<float>(v[t]);
    s = gae_step(s, action, done, static_cast<float>(r[t]), vt, g, glt);
    adv[t] = s.adv;
    ret[t] = s.adv + vt;
    return s;
  }

  inline GaeMap element(int64_t t) const {
    const bool action = kMask ? mk[t] != 0 : true;
    const bool done = kDones ? dn[t] != 0 : false;
    const float g = kTokenGL ? gt[t] : gamma;
    const float l = kTokenGL ? lt[t] : lam;
    return gae_element(action, done, static_cast<float>(r[t]), static_cast<float>(v[t]), g, l);
  }

  // The recursion over the K tasks ts[0..K) from their carries s[k]; writes adv and ret; leaves in
  // s[k] the state at each task's left edge. Tasks of equal length run interleaved.
  template <int K>
  void run(const Task* const* ts, GaeState* s, float* adv, float* ret) const {
    const int64_t len = ts[0]->hi - ts[0]->lo;
    bool equal = true;
    for (int k = 1; k < K; ++k) equal &= (ts[k]->hi - ts[k]->lo) == len;
    if (!equal) {
      for (int k = 0; k < K; ++k) {
        for (int64_t t = ts[k]->hi - 1; t >= ts[k]->lo; --t) s[k] = step(t, s[k], adv, ret);
      }
      return;
    }
    int64_t hi[K];
    GaeState st[K];
    for (int k = 0; k < K; ++k) hi[k] = ts[k]->hi, st[k] = s[k];
    for (int64_t i = 1; i <= len; ++i) {
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) st[k] = step(hi[k] - i, st[k], adv, ret);
    }
    for (int k = 0; k < K; ++k) s[k] = st[k];
  }

  // The composed map of each task (pass 1): reads only.
  template <int K>
  void compose(const Task* const* ts, GaeMap* f) const {
    const int64_t len = ts[0]->hi - ts[0]->lo;
    bool equal = true;
    for (int k = 1; k < K; ++k) equal &= (ts[k]->hi - ts[k]->lo) == len;
    if (!equal) {
      for (int k = 0; k < K; ++k) {
        f[k] = gae_identity();
        for (int64_t t = ts[k]->hi - 1; t >= ts[k]->lo; --t) f[k] = gae_compose(f[k], element(t));
      }
      return;
    }
    int64_t hi[K];
    GaeMap acc[K];
    for (int k = 0; k < K; ++k) hi[k] = ts[k]->hi, acc[k] = gae_identity();
    for (int64_t i = 1; i <= len; ++i) {
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) acc[k] = gae_compose(acc[k], element(hi[k] - i));
    }
    for (int k = 0; k < K; ++k) f[k] = acc[k];
  }

  // A group of n <= kGroup tasks: ts[0..n), carries / maps s[0..n).
  void run_group(const Task* const* ts, int n, GaeState* s, float* adv, float* ret) const {
#ifdef PPO_GAE_AVX2
    // A partial group pads its lanes with copies of its first task (same writes, results dropped).
    int64_t lo[kGroup], hi[kGroup];
    GaeState s8[kGroup];
    for (int k = 0; k < kGroup; ++k) {
      const int src = k < n ? k : 0;
      lo[k] = ts[src]->lo, hi[k] = ts[src]->hi, s8[k] = s[src];
    }
    Lanes::run(*this, lo, hi, n, s8, adv, ret);
    for (int k = 0; k < n; ++k) s[k] = s8[k];
#else
    if (n == kGroup) return run<kGroup>(ts, s, adv, ret);
    for (int k = 0; k < n; ++k) run<1>(ts + k, s + k, adv, ret);
#endif
  }

  void compose_group(const Task* const* ts, int n, GaeMap* f) const {
#ifdef PPO_GAE_AVX2
    int64_t lo[kGroup], hi[kGroup];
    for (int k = 0; k < kGroup; ++k) lo[k] = ts[k < n ? k : 0]->lo, hi[k] = ts[k < n ? k : 0]->hi;
    Lanes::compose(*this, lo, hi, n, f);
#else
    if (n == kGroup) return compose<kGroup>(ts, f);
    for (int k = 0; k < n; ++k) compose<1>(ts + k, f + k);
#endif
  }
};

// Calls fn(first, count) for groups of up to kGroup consecutive entries of n, in parallel.
template <typename F>
void for_groups(int64_t n, const F& fn) {
  const int64_t n_groups = (n + kGroup - 1) / kGroup;
  at::parallel_for(0, n_groups, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const int64_t first = g * kGroup;
      fn(first, static_cast<int>(std::min<int64_t>(kGroup, n - first)));
    }
  });
}

template <typename scalar_t, typename mask_t, bool kMask, bool kDones, bool kTokenGL>
void run_tasks(const Inputs& in, const std::vector<Task>& tasks, const std::vector<GaeState>& init,
               float* adv, float* ret, float* carry_v, float* carry_a) {
  const Kernel<scalar_t, mask_t, kMask, kDones, kTokenGL> k(in);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  auto leftmost = [&](int64_t i) { return i == 0 || tasks[i - 1].row != tasks[i].row; };
  bool chunked = false;
  for (const Task& t : tasks) chunked |= !t.rightmost;
  // Groups take tasks longest first, so that the tasks of a group are of about one length (packed
  // rows): the vector code runs to the shortest and leaves the rest of the others to scalar code.
  std::vector<const Task*> order(n_tasks);
  for (int64_t i = 0; i < n_tasks; ++i) order[i] = &tasks[i];
  std::stable_sort(order.begin(), order.end(),
                   [](const Task* a, const Task* b) { return a->hi - a->lo > b->hi - b->lo; });
  auto index = [&](const Task* t) { return t - tasks.data(); };
  std::vector<GaeState> carry(n_tasks);
  if (chunked) {
    // Pass 1: every chunk's map (the leftmost of a row is not needed).
    std::vector<GaeMap> maps(n_tasks, gae_identity());
    for_groups(n_tasks, [&](int64_t first, int n) {
      GaeMap f[kGroup];
      k.compose_group(&order[first], n, f);
      for (int j = 0; j < n; ++j) maps[index(order[first + j])] = f[j];
    });
    // Pass 2: the carry entering each chunk, right to left within each row.
    for (int64_t i = n_tasks - 1; i >= 0; --i) {
      carry[i] = tasks[i].rightmost ? init[tasks[i].row] : gae_apply(maps[i + 1], carry[i + 1]);
    }
  } else {
    for (int64_t i = 0; i < n_tasks; ++i) carry[i] = init[tasks[i].row];
  }
  // Pass 3: the recursion from each chunk's carry; a row's leftmost chunk gives its carry out.
  for_groups(n_tasks, [&](int64_t first, int n) {
    GaeState s[kGroup];
    for (int j = 0; j < n; ++j) s[j] = carry[index(order[first + j])];
    k.run_group(&order[first], n, s, adv, ret);
    for (int j = 0; j < n; ++j) {
      const int64_t i = index(order[first + j]);
      if (leftmost(i)) {
        carry_v[tasks[i].row] = s[j].nv;
        carry_a[tasks[i].row] = s[j].adv;
      }
    }
  });
}

// The kernel specialised on which optional inputs are present.
template <typename scalar_t>
void dispatch_flags(const Inputs& in, bool float_mask, const std::vector<Task>& tasks,
                    const std::vector<GaeState>& init, float* a, float* rt, float* pv, float* pa) {
  const bool m = in.mask != nullptr, d = in.dones != nullptr, tg = in.gamma_t != nullptr;
#define PPO_GAE_CASE(M, D, G)                                                                     \
  if (m == M && d == D && tg == G) {                                                              \
    if constexpr (M) {                                                                            \
      if (float_mask) return run_tasks<scalar_t, float, M, D, G>(in, tasks, init, a, rt, pv, pa); \
    }                                                                                             \
    return run_tasks<scalar_t, uint8_t, M, D, G>(in, tasks, init, a, rt, pv, pa);                 \
  }
  PPO_GAE_CASE(true, false, false)
  PPO_GAE_CASE(true, true, false)
  PPO_GAE_CASE(true, false, true)
  PPO_GAE_CASE(true, true, true)
  PPO_GAE_CASE(false, false, false)
  PPO_GAE_CASE(false, true, false)
  PPO_GAE_CASE(false, false, true)
  PPO_GAE_CASE(false, true, true)
#undef PPO_GAE_CASE
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gae_fwd_cpu(
    const at::Tensor& rewards, const at::Tensor& values, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& dones, const std::optional<at::Tensor>& gamma_t,
    const std::optional<at::Tensor>& lam_t, double gamma, double lam,
    const std::optional<at::Tensor>& init_value, const std::optional<at::Tensor>& init_adv,
    const std::optional<at::Tensor>& cu_seqlens, int64_t n_rows, int64_t row_len) {
  const int64_t N = rewards.numel();
  const DeviceOf dev = device_of(rewards, "rewards");
  check_arg(rewards, "rewards", dev, Kind::kFloating);
  check_arg(values, "values", dev, Kind::kAny, N, "like rewards");
  TORCH_CHECK(rewards.is_contiguous() && values.is_contiguous() &&
                  values.scalar_type() == rewards.scalar_type(),
              "gae_fwd: rewards and values must be contiguous and of one dtype");
  TORCH_CHECK(n_rows >= 0, "n_rows: expected >= 0, got ", n_rows);
  for (const auto& [t, name] : {std::pair{&mask, "mask"},
                                {&dones, "dones"},
                                {&gamma_t, "gamma_t"},
                                {&lam_t, "lam_t"},
                                {&init_value, "init_value"},
                                {&init_adv, "init_adv"},
                                {&cu_seqlens, "cu_seqlens"}}) {
    if (t->has_value() && (*t)->defined()) check_arg(**t, name, dev);
  }
  auto present = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(present(gamma_t) == present(lam_t),
              "gamma_t, lam_t: per-token gamma and lam come "
              "together (pass both tensors, or neither)");
  auto flat_u8 = [&](const std::optional<at::Tensor>& t, const char* name) -> const uint8_t* {
    if (!t.has_value() || !t->defined()) return nullptr;
    TORCH_CHECK(t->is_contiguous() && t->numel() == N &&
                    (t->scalar_type() == at::kBool || t->scalar_type() == at::kByte),
                "gae_fwd: ", name, " must be a contiguous bool tensor of ", N, " elements");
    return static_cast<const uint8_t*>(t->const_data_ptr());
  };
  auto flat_f32 = [&](const std::optional<at::Tensor>& t, int64_t n,
                      const char* name) -> const float* {
    if (!t.has_value() || !t->defined()) return nullptr;
    TORCH_CHECK(t->is_contiguous() && t->numel() == n && t->scalar_type() == at::kFloat,
                "gae_fwd: ", name, " must be a contiguous float32 tensor of ", n, " elements");
    return t->const_data_ptr<float>();
  };
  // The mask may also be float32 (nonzero = action), read as it is: no conversion pass.
  const bool float_mask = mask.has_value() && mask->defined() && mask->scalar_type() == at::kFloat;
  const void* mask_ptr = nullptr;
  if (float_mask) {
    TORCH_CHECK(mask->is_contiguous() && mask->numel() == N,
                "gae_fwd: mask must be a contiguous tensor of ", N, " elements");
    mask_ptr = mask->const_data_ptr();
  } else {
    mask_ptr = flat_u8(mask, "mask");
  }
  Inputs in{
      rewards.const_data_ptr(),  values.const_data_ptr(),       mask_ptr,
      flat_u8(dones, "dones"),   flat_f32(gamma_t, N, "gamma"), flat_f32(lam_t, N, "lam"),
      static_cast<float>(gamma), static_cast<float>(lam),       static_cast<float>(gamma * lam)};
  const float* iv = flat_f32(init_value, n_rows, "init_value");
  const float* ia = flat_f32(init_adv, n_rows, "init_adv");

  // Row extents.
  std::vector<int64_t> starts(n_rows + 1);
  if (cu_seqlens.has_value() && cu_seqlens->defined()) {
    const at::Tensor cu = cu_seqlens->to(at::kLong).contiguous();
    TORCH_CHECK(cu.numel() == n_rows + 1, "cu_seqlens: expected ", n_rows + 1, " entries");
    const int64_t* c = cu.const_data_ptr<int64_t>();
    TORCH_CHECK(c[0] == 0 && c[n_rows] == N, "cu_seqlens: must start at 0 and end at ", N,
                " (the number of tokens), got ", c[0], " and ", c[n_rows]);
    for (int64_t i = 0; i <= n_rows; ++i) {
      TORCH_CHECK(i == 0 || c[i] >= c[i - 1], "cu_seqlens: must be non-decreasing (entry ", i, ")");
      starts[i] = c[i];
    }
  } else {
    TORCH_CHECK(row_len >= 0 && n_rows * row_len == N, "row_len: expected n_rows * row_len == ", N,
                " (rewards.numel()), got n_rows ", n_rows, ", row_len ", row_len);
    for (int64_t i = 0; i <= n_rows; ++i) starts[i] = i * row_len;
  }

  const auto f32 = rewards.options().dtype(at::kFloat);
  // shaped like rewards: the registered op passes [B, T] tensors as they are (no views)
  at::Tensor adv = new_output(rewards.sizes(), f32), ret = new_output(rewards.sizes(), f32);
  at::Tensor cv = new_output({n_rows}, f32), ca = new_output({n_rows}, f32);
  std::vector<GaeState> init(n_rows);
  for (int64_t i = 0; i < n_rows; ++i) init[i] = {iv ? iv[i] : 0.f, ia ? ia[i] : 0.f};
  // Empty rows pass their carry straight through.
  for (int64_t i = 0; i < n_rows; ++i) {
    if (starts[i + 1] == starts[i]) {
      cv.data_ptr<float>()[i] = init[i].nv;
      ca.data_ptr<float>()[i] = init[i].adv;
    }
  }

  // Chunk long rows so that every thread has work: aim at kGroupsPerThread groups of tasks per
  // thread, chunks of at least kMinChunk positions (the chunk maps cost one extra read of the
  // inputs).
  const int64_t threads = at::get_num_threads();
  const int64_t want = kGroupsPerThread * kGroup * threads;
  const int64_t chunk = std::max<int64_t>(kMinChunk, (N + want - 1) / want);
  std::vector<Task> tasks;
  tasks.reserve(n_rows + N / chunk + 1);
  for (int64_t row = 0; row < n_rows; ++row) {
    const int64_t lo = starts[row], hi = starts[row + 1];
    if (hi == lo) continue;
    const int64_t n_chunks = (hi - lo + chunk - 1) / chunk;
    for (int64_t c = 0; c < n_chunks; ++c) {
      tasks.push_back({row, lo + c * chunk, std::min(hi, lo + (c + 1) * chunk), c == n_chunks - 1});
    }
  }

  float* a = adv.data_ptr<float>();
  float* rt = ret.data_ptr<float>();
  float* pv = cv.data_ptr<float>();
  float* pa = ca.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "gae_fwd", [&] {
    dispatch_flags<scalar_t>(in, float_mask, tasks, init, a, rt, pv, pa);
  });
  return {adv, ret, cv, ca};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // Flat inputs: rewards/values [N] (f32/bf16/f16), mask bool or float32 [N] or None, dones bool
  // [N] or None, gamma_t/lam_t float32 [N] or None (then the scalars), init_value/init_adv
  // float32 [n_rows] or None (0).
  // Rows: cu_seqlens (int32/int64 [n_rows + 1]) or n_rows rows of row_len.
  // Any shape of N elements (contiguous) for the per-token tensors. Returns advantages and returns
  // (float32, shaped like rewards) and the left-edge carry (value, adv) [n_rows].
  m.def(
      "gae_fwd(Tensor rewards, Tensor values, Tensor? mask, Tensor? dones, Tensor? gamma_t, "
      "Tensor? lam_t, float gamma, float lam, Tensor? init_value, Tensor? init_adv, "
      "Tensor? cu_seqlens, int n_rows, int row_len) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) { m.impl("gae_fwd", &gae_fwd_cpu); }

}  // namespace ppo_kernels
