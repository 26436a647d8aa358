// gae: CPU kernel and the schema of the raw kernel (CUDA impl in csrc/cuda/gae.cu).
// Semantics: ppo_kernels/gae/reference.py; the scan algebra: csrc/common/gae_combine.h.
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

// No fused multiply-adds in the recursion: a row that runs as one task then gives bit for bit the
// numbers of verl's eager loop (separately rounded mul and add), which the tests check.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "common/gae_combine.h"

namespace ppo_kernels {
namespace {

struct Inputs {
  const void* rewards;
  const void* values;
  const uint8_t* mask;    // nullptr: every position is an action
  const uint8_t* dones;   // nullptr: no dones
  const float* gamma_t;   // nullptr: scalar gamma
  const float* lam_t;     // nullptr: scalar lam
  float gamma, lam, gl;   // scalars (gl = gamma * lam rounded once)
};

struct Task {
  int64_t row, lo, hi;  // positions [lo, hi) of row `row` (flat offsets)
  bool rightmost;       // the chunk at the row's right edge (its carry is the row's init)
};

// Tasks run in groups of kGroup: the recursion is a chain of dependent float ops (latency-bound,
// ~8 cycles a position), so a thread advances kGroup independent rows / chunks in lockstep.
constexpr int kGroup = 4;

template <typename scalar_t, bool kMask, bool kDones, bool kTokenGL>
struct Kernel {
  const scalar_t* r;
  const scalar_t* v;
  const uint8_t* mk;
  const uint8_t* dn;
  const float* gt;
  const float* lt;
  float gamma, lam, gl;

  explicit Kernel(const Inputs& in)
      : r(static_cast<const scalar_t*>(in.rewards)), v(static_cast<const scalar_t*>(in.values)),
        mk(in.mask), dn(in.dones), gt(in.gamma_t), lt(in.lam_t), gamma(in.gamma), lam(in.lam),
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

  // The recursion over each task of a group from its carry; writes adv and ret; leaves in s the
  // state at each task's left edge. Tasks of equal length run interleaved.
  template <int K>
  void run(const Task* ts, GaeState* s, float* adv, float* ret) const {
    const int64_t len = ts[0].hi - ts[0].lo;
    bool equal = true;
    for (int k = 1; k < K; ++k) equal &= (ts[k].hi - ts[k].lo) == len;
    if (!equal) {
      for (int k = 0; k < K; ++k) {
        for (int64_t t = ts[k].hi - 1; t >= ts[k].lo; --t) s[k] = step(t, s[k], adv, ret);
      }
      return;
    }
    int64_t hi[K];
    GaeState st[K];
    for (int k = 0; k < K; ++k) hi[k] = ts[k].hi, st[k] = s[k];
    for (int64_t i = 1; i <= len; ++i) {
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) st[k] = step(hi[k] - i, st[k], adv, ret);
    }
    for (int k = 0; k < K; ++k) s[k] = st[k];
  }

  // The composed map of each task of a group (pass 1): reads only.
  template <int K>
  void compose(const Task* ts, GaeMap* f) const {
    const int64_t len = ts[0].hi - ts[0].lo;
    bool equal = true;
    for (int k = 1; k < K; ++k) equal &= (ts[k].hi - ts[k].lo) == len;
    if (!equal) {
      for (int k = 0; k < K; ++k) {
        f[k] = gae_identity();
        for (int64_t t = ts[k].hi - 1; t >= ts[k].lo; --t) f[k] = gae_compose(f[k], element(t));
      }
      return;
    }
    int64_t hi[K];
    GaeMap acc[K];
    for (int k = 0; k < K; ++k) hi[k] = ts[k].hi, acc[k] = gae_identity();
    for (int64_t i = 1; i <= len; ++i) {
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) acc[k] = gae_compose(acc[k], element(hi[k] - i));
    }
    for (int k = 0; k < K; ++k) f[k] = acc[k];
  }
};

// Calls fn(first_task, count) for groups of up to kGroup consecutive tasks, in parallel.
template <typename F>
void for_groups(int64_t n_tasks, const F& fn) {
  const int64_t n_groups = (n_tasks + kGroup - 1) / kGroup;
  at::parallel_for(0, n_groups, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const int64_t first = g * kGroup;
      fn(first, std::min<int64_t>(kGroup, n_tasks - first));
    }
  });
}

template <typename scalar_t, bool kMask, bool kDones, bool kTokenGL>
void run_tasks(const Inputs& in, const std::vector<Task>& tasks, const std::vector<GaeState>& init,
               float* adv, float* ret, float* carry_v, float* carry_a) {
  const Kernel<scalar_t, kMask, kDones, kTokenGL> k(in);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  auto leftmost = [&](int64_t i) { return i == 0 || tasks[i - 1].row != tasks[i].row; };
  bool chunked = false;
  for (const Task& t : tasks) chunked |= !t.rightmost;
  std::vector<GaeState> carry(n_tasks);
  if (chunked) {
    // Pass 1: every chunk but a row's leftmost hands its map to the chunk on its left.
    std::vector<GaeMap> maps(n_tasks, gae_identity());
    for_groups(n_tasks, [&](int64_t first, int64_t n) {
      if (n == kGroup) return k.template compose<kGroup>(&tasks[first], &maps[first]);
      for (int64_t i = first; i < first + n; ++i) {
        if (!leftmost(i)) k.template compose<1>(&tasks[i], &maps[i]);
      }
    });
    // Pass 2: the carry entering each chunk, right to left within each row.
    for (int64_t i = n_tasks - 1; i >= 0; --i) {
      carry[i] = tasks[i].rightmost ? init[tasks[i].row] : gae_apply(maps[i + 1], carry[i + 1]);
    }
  } else {
    for (int64_t i = 0; i < n_tasks; ++i) carry[i] = init[tasks[i].row];
  }
  // Pass 3: the recursion from each chunk's carry; a row's leftmost chunk gives its carry out.
  for_groups(n_tasks, [&](int64_t first, int64_t n) {
    if (n == kGroup) {
      k.template run<kGroup>(&tasks[first], &carry[first], adv, ret);
    } else {
      for (int64_t i = first; i < first + n; ++i) k.template run<1>(&tasks[i], &carry[i], adv, ret);
    }
    for (int64_t i = first; i < first + n; ++i) {
      if (leftmost(i)) {
        carry_v[tasks[i].row] = carry[i].nv;
        carry_a[tasks[i].row] = carry[i].adv;
      }
    }
  });
}

// The kernel specialised on which optional inputs are present.
template <typename scalar_t>
void dispatch_flags(const Inputs& in, const std::vector<Task>& tasks,
                    const std::vector<GaeState>& init, float* a, float* rt, float* pv, float* pa) {
  const bool m = in.mask != nullptr, d = in.dones != nullptr, tg = in.gamma_t != nullptr;
#define PPO_GAE_CASE(M, D, G)                                    \
  if (m == M && d == D && tg == G) {                             \
    return run_tasks<scalar_t, M, D, G>(in, tasks, init, a, rt, pv, pa); \
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
  TORCH_CHECK(rewards.is_contiguous() && values.is_contiguous() && values.numel() == N &&
                  values.scalar_type() == rewards.scalar_type(),
              "gae_fwd: rewards and values must be contiguous, of one dtype and size");
  auto flat_u8 = [&](const std::optional<at::Tensor>& t, const char* name) -> const uint8_t* {
    if (!t.has_value() || !t->defined()) return nullptr;
    TORCH_CHECK(t->is_contiguous() && t->numel() == N &&
                    (t->scalar_type() == at::kBool || t->scalar_type() == at::kByte),
                "gae_fwd: ", name, " must be a contiguous bool tensor of ", N, " elements");
    return static_cast<const uint8_t*>(t->const_data_ptr());
  };
  auto flat_f32 = [&](const std::optional<at::Tensor>& t, int64_t n, const char* name) -> const float* {
    if (!t.has_value() || !t->defined()) return nullptr;
    TORCH_CHECK(t->is_contiguous() && t->numel() == n && t->scalar_type() == at::kFloat,
                "gae_fwd: ", name, " must be a contiguous float32 tensor of ", n, " elements");
    return t->const_data_ptr<float>();
  };
  Inputs in{rewards.const_data_ptr(), values.const_data_ptr(), flat_u8(mask, "mask"),
            flat_u8(dones, "dones"), flat_f32(gamma_t, N, "gamma"), flat_f32(lam_t, N, "lam"),
            static_cast<float>(gamma), static_cast<float>(lam), static_cast<float>(gamma * lam)};
  TORCH_CHECK((in.gamma_t == nullptr) == (in.lam_t == nullptr),
              "gae_fwd: per-token gamma and lam come together");
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
    TORCH_CHECK(n_rows * row_len == N, "gae_fwd: n_rows * row_len != numel");
    for (int64_t i = 0; i <= n_rows; ++i) starts[i] = i * row_len;
  }

  const auto f32 = rewards.options().dtype(at::kFloat);
  at::Tensor adv = new_output({N}, f32), ret = new_output({N}, f32);
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

  // Chunk long rows so that every thread has work: aim at 2 groups of tasks per thread, chunks of
  // at least 16K positions (the chunk maps cost one extra read of the inputs).
  const int64_t threads = at::get_num_threads();
  const int64_t want = 2 * kGroup * threads;
  const int64_t chunk = std::max<int64_t>(16384, (N + want - 1) / want);
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
    dispatch_flags<scalar_t>(in, tasks, init, a, rt, pv, pa);
  });
  return {adv, ret, cv, ca};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // Flat inputs: rewards/values [N] (f32/bf16/f16), mask/dones bool [N] or None, gamma_t/lam_t
  // float32 [N] or None (then the scalars), init_value/init_adv float32 [n_rows] or None (0).
  // Rows: cu_seqlens (int32/int64 [n_rows + 1]) or n_rows rows of row_len.
  // Returns advantages [N], returns [N] (float32) and the left-edge carry (value, adv) [n_rows].
  m.def("gae_fwd(Tensor rewards, Tensor values, Tensor? mask, Tensor? dones, Tensor? gamma_t, "
        "Tensor? lam_t, float gamma, float lam, Tensor? init_value, Tensor? init_adv, "
        "Tensor? cu_seqlens, int n_rows, int row_len) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) { m.impl("gae_fwd", &gae_fwd_cpu); }

}  // namespace ppo_kernels
