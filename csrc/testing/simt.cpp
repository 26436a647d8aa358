// SIMT emulator runtime: fibers, the block scheduler, barriers, warp exchanges, shared-memory
// poisoning, guarded global memory and the fault handler. See simt.h for what it checks.
#include "testing/simt.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)  // PPO_KERNELS_SANITIZE=1 (scripts/sanitize.sh)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

thread_local uint3 threadIdx{0, 0, 0};
thread_local uint3 blockIdx{0, 0, 0};
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace simt {

const char* check_name(Check c) {
  switch (c) {
    case Check::kBarrier:
      return "barrier";
    case Check::kShuffle:
      return "shuffle";
    case Check::kMemory:
      return "memory";
    case Check::kShared:
      return "shared";
    case Check::kLaunch:
      return "launch";
    case Check::kKernel:
      return "kernel";
  }
  return "?";
}

Error::Error(Check c, const std::string& what)
    : std::runtime_error(std::string("SIMT[") + check_name(c) + "] " + what), check(c) {}

namespace {

constexpr size_t kStackBytes = 64 << 10;  // per fiber; a block of 1024 threads takes 64 MiB
constexpr int kMaxThreads = 1024;
constexpr size_t kSharedLimit = 48 << 10;  // static shared memory per block

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// ---- random sequence (splitmix64)
// ----------------------------------------------------------------
std::mutex g_rng_mu;
uint64_t g_rng = 0x853c49e6748fea9bull;

uint64_t mix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ---- fiber stacks: mmap'd once, PROT_NONE page below each, reused by every launch
// -----------------
struct Stacks {
  std::vector<char*> base;  // usable [base, base + kStackBytes); guard page at base - page
  char* get(size_t i) {
    while (base.size() <= i) {
      const size_t P = page_size();
      void* m = mmap(nullptr, kStackBytes + P, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
      TORCH_CHECK(m != MAP_FAILED, "simt: cannot map a fiber stack");
      mprotect(m, P, PROT_NONE);
      base.push_back(static_cast<char*>(m) + P);
    }
    return base[i];
  }
};
std::mutex g_stacks_mu;
std::vector<std::pair<uintptr_t, uintptr_t>> g_stack_guards;  // [lo, hi) of every guard page

// ---- one block being run on this thread
// ------------------------------------------------------------
enum class St { kReady, kBarrier, kShuffle, kDone };

// ---- fiber contexts
// ----------------------------------------------------------------------------------
// On x86-64 a switch pushes the callee-saved registers, swaps stack pointers and pops the other
// fiber's: glibc's swapcontext also saves and restores the signal mask (a system call) and the
// floating-point environment at every switch, which took most of the emulator's time, and nothing
// changes either while a block runs. Other targets (or -DSIMT_UCONTEXT) keep ucontext.
#if defined(__x86_64__) && !defined(SIMT_UCONTEXT)
extern "C" void ppo_simt_switch(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .p2align 4
  .globl ppo_simt_switch
  .hidden ppo_simt_switch
  .type ppo_simt_switch, @function
ppo_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ppo_simt_switch, .-ppo_simt_switch
  .popsection
)");

struct Context {
  void* sp = nullptr;
};

// The first switch into `c` pops six zero registers and returns into fn, whose own return
// address is null (fn never returns; backtraces end there). fn starts as if called: rsp + 8 is
// 16-byte aligned.
void start_context(Context& c, char* stack, size_t size, void (*fn)()) {
  void** top = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15));
  top[-1] = nullptr;
  top[-2] = reinterpret_cast<void*>(fn);
  for (int i = 3; i <= 8; ++i) top[-i] = nullptr;
  c.sp = top - 8;
}

inline void switch_context(Context& from, Context& to) { ppo_simt_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};

void start_context(Context& c, char* stack, size_t size, void (*fn)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, fn, 0);
#if defined(__SANITIZE_ADDRESS__)
  // ASan's swapcontext clears the shadow of the stack a context names at every switch into it,
  // which would wipe the redzones of a resumed fiber's live frames (run_block clears it once).
  c.uc.uc_stack = stack_t{};
#endif
}

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

struct Fiber {
  Context ctx;
  uint3 idx;
  int tid = 0;
  St st = St::kReady;
  const char* file = "";
  int line = 0;
};

struct WarpSlot {
  unsigned mask = 0, arrived = 0;
  ShflKind kind = ShflKind::kIdx;
  int width = 32;
  const char* file = "";
  int line = 0;
  uint64_t val[32];
  int arg[32];
  uint64_t out[32];
};

struct Block {
  const char* kernel = "";
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  int n = 0, done = 0, at_barrier = 0;
  const char* bar_file = "";
  int bar_line = 0;
  std::vector<int> ready;
  std::vector<WarpSlot> warps;
  std::vector<std::pair<void*, size_t>> shared;
  size_t shared_bytes = 0;
  Fiber* cur = nullptr;
  Context sched;
  std::exception_ptr error;
  uint64_t rng = 0;
  std::vector<uint64_t> prio;  // per warp (the by-warp order)
  uint64_t barriers = 0;       // barriers released in this block
};

thread_local Block* tb = nullptr;
thread_local Stacks t_stacks;

// ---- fiber switches, told to AddressSanitizer (a no-op in other builds): with the stack each
// fiber runs on, ASan unpoisons the right one when an exception leaves frames behind; fake stacks
// (detect_stack_use_after_return) are not followed.
thread_local const void* t_sched_bottom = nullptr;  // the launching thread's stack, as ASan has it
thread_local size_t t_sched_size = 0;
thread_local char* t_sched_low = nullptr;  // below the scheduler's frames (fault path)

inline void switch_to(const void* bottom, size_t size) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(nullptr, bottom, size);
#else
  (void)bottom, (void)size;
#endif
}
inline void switched(const void** old_bottom = nullptr, size_t* old_size = nullptr) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, old_bottom, old_size);
#else
  (void)old_bottom, (void)old_size;
#endif
}
// A frame below the caller's (the address of this call's own frame).
[[gnu::noinline]] char* frame_below() { return static_cast<char*>(__builtin_frame_address(0)); }

// After the fault handler's jump from a fiber back to the launch: the thread's own stack again,
// and the scheduler's abandoned frames below the launch unpoisoned (their redzones would read as
// errors to the next uninstrumented code that uses that stack, e.g. an intercepted memcpy).
void back_from_fault() {
#if defined(__SANITIZE_ADDRESS__)
  if (t_sched_bottom != nullptr) {
    switch_to(t_sched_bottom, t_sched_size);
    switched();
  }
  char* hi = frame_below();
  if (t_sched_low != nullptr && t_sched_low < hi)
    __asan_unpoison_memory_region(t_sched_low, hi - t_sched_low);
#endif
}

const char* kind_name(ShflKind k) {
  switch (k) {
    case ShflKind::kIdx:
      return "__shfl_sync";
    case ShflKind::kUp:
      return "__shfl_up_sync";
    case ShflKind::kDown:
      return "__shfl_down_sync";
    case ShflKind::kXor:
      return "__shfl_xor_sync";
    case ShflKind::kBallot:
      return "__ballot_sync";
    case ShflKind::kSyncWarp:
      return "__syncwarp";
  }
  return "?";
}

std::string where(const Block& B, int tid) {
  const uint3 t = B.fibers[tid].idx;
  return fmt("kernel %s, block (%u,%u,%u), thread (%u,%u,%u)", B.kernel, blockIdx.x, blockIdx.y,
             blockIdx.z, t.x, t.y, t.z);
}

std::string state_of(const Block& B, int tid) {
  const Fiber& f = B.fibers[tid];
  switch (f.st) {
    case St::kDone:
      return "has exited";
    case St::kBarrier:
      return fmt("waits at __syncthreads (%s:%d)", f.file, f.line);
    case St::kShuffle:
      return fmt("waits at %s (%s:%d)", kind_name(B.warps[tid >> 5].kind), f.file, f.line);
    case St::kReady:
      return "is running";
  }
  return "?";
}

void make_ready(Block& B, int tid) {
  B.fibers[tid].st = St::kReady;
  B.ready.push_back(tid);
}

void yield(Block& B, Fiber& f) {
  switch_to(t_sched_bottom, t_sched_size);
  switch_context(f.ctx, B.sched);
  switched();
}

// A thread that ends while others wait on it at a barrier or in a shuffle of its warp.
void check_exit(Block& B, Fiber& f) {
  const WarpSlot& S = B.warps[f.tid >> 5];
  const int lane = f.tid & 31;
  if (S.arrived != 0 && ((S.mask >> lane) & 1u)) {
    throw Error(Check::kShuffle,
                fmt("%s (%s:%d, mask 0x%08x): lane %d exited without arriving; %s",
                    kind_name(S.kind), S.file, S.line, S.mask, lane, where(B, f.tid).c_str()));
  }
  if (B.at_barrier > 0) {
    throw Error(Check::kBarrier,
                fmt("thread exited while %d of %d threads wait at __syncthreads (%s:%d); %s",
                    B.at_barrier, B.n, B.bar_file, B.bar_line, where(B, f.tid).c_str()));
  }
}

void fiber_main() {
  switched(&t_sched_bottom, &t_sched_size);
  Block& B = *tb;
  Fiber& f = *B.cur;
  try {
    (*B.body)();
    f.st = St::kDone;
    ++B.done;
    check_exit(B, f);
  } catch (...) {
    if (!B.error) B.error = std::current_exception();
  }
  f.st = St::kDone;
  switch_to(t_sched_bottom, t_sched_size);
  switch_context(f.ctx, B.sched);  // never resumed
}

[[noreturn]] void diagnose_deadlock(Block& B) {
  for (size_t w = 0; w < B.warps.size(); ++w) {
    const WarpSlot& S = B.warps[w];
    if (S.arrived == 0) continue;
    const unsigned missing = S.mask & ~S.arrived;
    const int lane = __builtin_ctz(missing);
    const int tid = static_cast<int>(w) * 32 + lane;
    throw Error(Check::kShuffle,
                fmt("%s (%s:%d, mask 0x%08x) in warp %zu waits for lane %d, which %s; %s",
                    kind_name(S.kind), S.file, S.line, S.mask, w, lane, state_of(B, tid).c_str(),
                    where(B, tid).c_str()));
  }
  if (B.at_barrier > 0) {
    for (int t = 0; t < B.n; ++t) {
      if (B.fibers[t].st != St::kBarrier) {
        throw Error(
            Check::kBarrier,
            fmt("%d of %d threads wait at __syncthreads (%s:%d); thread %d %s; %s", B.at_barrier,
                B.n, B.bar_file, B.bar_line, t, state_of(B, t).c_str(), where(B, t).c_str()));
      }
    }
  }
  throw Error(Check::kLaunch, "internal: no runnable thread");
}

void run_block(Block& B, Stacks& stacks) {
  B.done = B.at_barrier = 0;
  B.ready.clear();
  for (auto& w : B.warps) w.arrived = 0;
  B.shared.clear();
  B.shared_bytes = 0;
  for (int t = 0; t < B.n; ++t) {
    Fiber& f = B.fibers[t];
    start_context(f.ctx, stacks.get(t), kStackBytes, fiber_main);
#if defined(__SANITIZE_ADDRESS__)
    // the frames an earlier launch left on this stack: their redzones would read as errors
    __asan_unpoison_memory_region(stacks.get(t), kStackBytes);
#endif
    f.st = St::kReady;
    B.ready.push_back(t);
  }
  // Two orders, drawn per block: any ready thread at random, or warps by random priority (a warp
  // runs ahead of the others as far as it can: races between warps show even when they need many
  // of its steps in a row).
  // Priorities are redrawn whenever a barrier releases.
  t_sched_low = frame_below();
  const bool by_warp = (mix(B.rng) & 1) != 0;
  std::vector<uint64_t>& prio = B.prio;
  prio.resize(B.warps.size());
  B.barriers = 0;
  uint64_t drawn = ~uint64_t(0);
  while (B.done < B.n) {
    if (B.ready.empty()) diagnose_deadlock(B);
    if (by_warp && drawn != B.barriers) {
      for (auto& p : prio) p = mix(B.rng);
      drawn = B.barriers;
    }
    size_t k = mix(B.rng) % B.ready.size();
    if (by_warp) {  // the first ready thread of the highest-priority warp, cyclically from k
      const size_t start = k;
      uint64_t best = prio[B.ready[k] >> 5];
      const auto better = [&](size_t j) {
        if (prio[B.ready[j] >> 5] > best) best = prio[B.ready[j] >> 5], k = j;
      };
      for (size_t j = start + 1; j < B.ready.size(); ++j) better(j);  // (no division a step)
      for (size_t j = 0; j < start; ++j) better(j);
    }
    const int t = B.ready[k];
    B.ready[k] = B.ready.back();
    B.ready.pop_back();
    Fiber& f = B.fibers[t];
    B.cur = &f;
    threadIdx = f.idx;
    switch_to(stacks.get(t), kStackBytes);
    switch_context(B.sched, f.ctx);
    switched();
    if (B.error) std::rethrow_exception(B.error);
  }
}

// ---- faults inside a kernel ---------------------------------------------------------------------
struct Region {
  char* map;
  size_t map_len;
  char* data;
  size_t n;
  char* body;  // [body, body + body_len) between the two guard pages
  size_t body_len;
};
std::mutex g_regions_mu;
std::map<uintptr_t, Region> g_regions;  // by data pointer
constexpr unsigned char kCanary = 0xa5;

thread_local sigjmp_buf t_fault_jb;
thread_local char t_fault_msg[1024];

std::string describe_address(uintptr_t a, bool write) {
  const size_t P = page_size();
  const char* rw = write ? "write" : "read";
  for (const auto& [k, r] : g_regions) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(r.body), hi = lo + r.body_len;
    const uintptr_t d = reinterpret_cast<uintptr_t>(r.data);
    if (a >= hi && a < hi + P) {
      return fmt("out-of-bounds %s at byte %zu past the end of a %zu-byte global buffer", rw,
                 static_cast<size_t>(a - (d + r.n)), r.n);
    }
    if (a + P >= lo && a < lo) {
      return fmt("out-of-bounds %s at byte %zu before the start of a %zu-byte global buffer", rw,
                 static_cast<size_t>(d - a), r.n);
    }
  }
  for (const auto& [lo, hi] : g_stack_guards) {
    if (a >= lo && a < hi) return "fiber stack overflow (64 KiB per thread)";
  }
  return fmt(
      "invalid %s of address %p (outside every guarded buffer, or a misaligned vector access)", rw,
      reinterpret_cast<void*>(a));
}

void on_fault(int sig, siginfo_t* si, void* ctx) {
  bool write = false;
#if defined(__x86_64__)
  write = (static_cast<ucontext_t*>(ctx)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
  (void)ctx;
#endif
  // A general-protection fault has no address: in kernel code, an aligned 16-byte access (a Pack)
  // at a misaligned address (the GPU's "misaligned address" error).
  std::string m =
      si->si_code == SI_KERNEL
          ? std::string(
                "general protection fault: a 16-byte vector access at a misaligned address?")
          : describe_address(reinterpret_cast<uintptr_t>(si->si_addr), write);
  if (tb != nullptr && tb->cur != nullptr) m += "; " + where(*tb, tb->cur->tid);
  snprintf(t_fault_msg, sizeof t_fault_msg, "%s (signal %d)", m.c_str(), sig);
  siglongjmp(t_fault_jb, 1);
}

// Installs the fault handler (on an alternate stack: a fiber may have overflowed its own) for the
// duration of a launch, and restores the previous one.
struct FaultHandler {
  struct sigaction old_segv, old_bus;
  stack_t old_stack;
  std::vector<char> alt;
  FaultHandler() : alt(1 << 16) {
    stack_t ss{};
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    sigaltstack(&ss, &old_stack);
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
  }
  ~FaultHandler() {
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    sigaltstack(&old_stack, nullptr);
  }
};

// Out-of-bounds writes that landed in a guarded buffer's slack (the bytes between the data and the
// guard page on the side without one).
void check_canaries(const char* kernel) {
  std::lock_guard<std::mutex> lk(g_regions_mu);
  for (const auto& [k, r] : g_regions) {
    for (char* p = r.body; p < r.body + r.body_len; ++p) {
      if (p == r.data) p += r.n;
      if (p >= r.body + r.body_len) break;
      if (static_cast<unsigned char>(*p) != kCanary) {
        const bool after = p >= r.data + r.n;
        throw Error(
            Check::kMemory,
            fmt("kernel %s: out-of-bounds write %zu bytes %s a %zu-byte global buffer", kernel,
                after ? static_cast<size_t>(p - (r.data + r.n)) : static_cast<size_t>(r.data - p),
                after ? "past the end of" : "before the start of", r.n));
      }
    }
  }
}

void run_launch(Block& B, dim3 grid, dim3 block) {
  const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> order(nblocks);
  for (uint64_t i = 0; i < nblocks; ++i) order[i] = i;
  for (uint64_t i = nblocks; i > 1; --i) std::swap(order[i - 1], order[mix(B.rng) % i]);
  for (const uint64_t b : order) {
    blockIdx = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                static_cast<unsigned>(b / (uint64_t(grid.x) * grid.y))};
    run_block(B, t_stacks);
  }
}

}  // namespace

namespace {
std::atomic<int> g_sm_count{4};
std::atomic<int64_t> g_max_row_blocks{int64_t(1) << 20};
}  // namespace
int Device::sm_count() { return g_sm_count.load(); }
int64_t Device::max_row_blocks() { return g_max_row_blocks.load(); }
void set_geometry(int sm_count, int64_t max_row_blocks) {
  g_sm_count.store(sm_count);
  g_max_row_blocks.store(max_row_blocks);
}

void set_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lk(g_rng_mu);
  g_rng = seed * 0x2545f4914f6cdd1dull + 1;
}

uint64_t next_random() {
  std::lock_guard<std::mutex> lk(g_rng_mu);
  return mix(g_rng);
}

void syncthreads(const char* file, int line) {
  Block* Bp = tb;
  if (Bp == nullptr) throw Error(Check::kLaunch, "__syncthreads outside a kernel");
  Block& B = *Bp;
  Fiber& f = *B.cur;
  if (B.at_barrier == 0) {
    B.bar_file = file;
    B.bar_line = line;
  } else if (line != B.bar_line || std::strcmp(file, B.bar_file) != 0) {
    throw Error(Check::kBarrier,
                fmt("thread reached __syncthreads at %s:%d while %d threads wait at the "
                    "one at %s:%d; %s",
                    file, line, B.at_barrier, B.bar_file, B.bar_line, where(B, f.tid).c_str()));
  }
  if (B.done > 0) {
    for (int t = 0; t < B.n; ++t) {
      if (B.fibers[t].st == St::kDone) {
        throw Error(Check::kBarrier,
                    fmt("__syncthreads (%s:%d) can never complete: thread %d has exited; %s", file,
                        line, t, where(B, f.tid).c_str()));
      }
    }
  }
  f.st = St::kBarrier;
  f.file = file;
  f.line = line;
  if (++B.at_barrier == B.n) {
    B.at_barrier = 0;
    ++B.barriers;
    for (int t = 0; t < B.n; ++t) make_ready(B, t);
  }
  yield(B, f);
}

uint64_t warp_exchange(ShflKind kind, unsigned mask, uint64_t value, int arg, int width,
                       const char* file, int line) {
  Block* Bp = tb;
  if (Bp == nullptr) throw Error(Check::kLaunch, "warp intrinsic outside a kernel");
  Block& B = *Bp;
  Fiber& f = *B.cur;
  const int lane = f.tid & 31, w = f.tid >> 5;
  const char* name = kind_name(kind);
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    throw Error(Check::kShuffle, fmt("%s (%s:%d): width %d is not a power of 2 <= 32; %s", name,
                                     file, line, width, where(B, f.tid).c_str()));
  }
  if (((mask >> lane) & 1u) == 0) {
    throw Error(Check::kShuffle,
                fmt("%s (%s:%d): the calling lane %d is not in its mask 0x%08x; %s", name, file,
                    line, lane, mask, where(B, f.tid).c_str()));
  }
  WarpSlot& S = B.warps[w];
  if (S.arrived == 0) {
    S.mask = mask;
    S.kind = kind;
    S.width = width;
    S.file = file;
    S.line = line;
  } else if (S.mask != mask || S.kind != kind || S.width != width || S.line != line ||
             std::strcmp(S.file, file) != 0) {
    throw Error(Check::kShuffle,
                fmt("warp %d diverges: lane %d at %s (%s:%d, mask 0x%08x) while lanes "
                    "0x%08x wait at %s (%s:%d, mask 0x%08x); %s",
                    w, lane, name, file, line, mask, S.arrived, kind_name(S.kind), S.file, S.line,
                    S.mask, where(B, f.tid).c_str()));
  }
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const int l = __builtin_ctz(m), t = w * 32 + l;
    if (t >= B.n) {
      throw Error(Check::kShuffle,
                  fmt("%s (%s:%d): mask 0x%08x names lane %d, which does not exist "
                      "(%d threads); %s",
                      name, file, line, mask, l, B.n, where(B, f.tid).c_str()));
    }
    if (B.fibers[t].st == St::kDone) {
      throw Error(Check::kShuffle, fmt("%s (%s:%d, mask 0x%08x): lane %d has exited and will never "
                                       "arrive; %s",
                                       name, file, line, mask, l, where(B, f.tid).c_str()));
    }
  }
  S.val[lane] = value;
  S.arg[lane] = arg;
  S.arrived |= 1u << lane;
  f.st = St::kShuffle;
  f.file = file;
  f.line = line;
  if (S.arrived == mask) {
    const int seg_mask = ~(width - 1);
    unsigned ballot = 0;
    for (unsigned m = mask; m != 0; m &= m - 1)
      ballot |= (S.val[__builtin_ctz(m)] != 0 ? 1u : 0u) << __builtin_ctz(m);
    for (unsigned m = mask; m != 0; m &= m - 1) {
      const int l = __builtin_ctz(m), seg = l & seg_mask, a = S.arg[l];
      int src = l;
      switch (kind) {
        case ShflKind::kIdx:
          src = seg + (a & (width - 1));
          break;
        case ShflKind::kUp:
          src = (l - seg) >= a ? l - a : l;
          break;
        case ShflKind::kDown:
          src = (l - seg) + a < width ? l + a : l;
          break;
        case ShflKind::kXor:
          src = ((l ^ a) & seg_mask) <= seg ? (l ^ a) & 31 : l;
          break;
        default:
          break;
      }
      if (kind == ShflKind::kBallot) {
        S.out[l] = ballot;
      } else if (kind == ShflKind::kSyncWarp) {
        S.out[l] = 0;
      } else {
        if (((mask >> src) & 1u) == 0) {
          throw Error(Check::kShuffle,
                      fmt("%s (%s:%d, mask 0x%08x): lane %d reads lane %d, which is not "
                          "in the mask; %s",
                          name, file, line, mask, l, src, where(B, w * 32 + l).c_str()));
        }
        S.out[l] = S.val[src];
      }
    }
    S.arrived = 0;
    for (unsigned m = mask; m != 0; m &= m - 1) make_ready(B, w * 32 + __builtin_ctz(m));
  }
  yield(B, f);
  return S.out[lane];
}

void shared_region(void* p, size_t bytes) {
  Block* Bp = tb;
  if (Bp == nullptr) throw Error(Check::kLaunch, "shared memory outside a kernel");
  Block& B = *Bp;
  for (const auto& r : B.shared) {
    if (r.first == p) return;
  }
  B.shared.push_back({p, bytes});
  B.shared_bytes += bytes;
  if (B.shared_bytes > kSharedLimit) {
    throw Error(Check::kShared, fmt("kernel %s uses %zu bytes of static shared memory (limit %zu)",
                                    B.kernel, B.shared_bytes, kSharedLimit));
  }
  std::memset(p, 0xff, bytes);
}

namespace {
std::mutex g_log_mu;
std::vector<std::string> g_log;
}  // namespace

std::vector<std::string> take_launch_log() {
  std::lock_guard<std::mutex> lk(g_log_mu);
  return std::exchange(g_log, {});
}

void run(const char* name, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  {
    std::lock_guard<std::mutex> lk(g_log_mu);
    g_log.push_back(fmt("%s grid=%u block=%u", name, grid.x, block.x));
  }
  const uint64_t n = uint64_t(block.x) * block.y * block.z;
  if (n == 0 || n > kMaxThreads || block.z > 64) {
    throw Error(Check::kLaunch, fmt("kernel %s: block (%u,%u,%u) is not 1..1024 threads", name,
                                    block.x, block.y, block.z));
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    throw Error(Check::kLaunch,
                fmt("kernel %s: invalid grid (%u,%u,%u)", name, grid.x, grid.y, grid.z));
  }
  if (smem != 0)
    throw Error(Check::kLaunch, fmt("kernel %s: dynamic shared memory is not emulated", name));
  if (tb != nullptr) throw Error(Check::kLaunch, "nested launch");
  {
    std::lock_guard<std::mutex> lk(g_stacks_mu);
    const size_t before = t_stacks.base.size();
    t_stacks.get(n - 1);
    const size_t P = page_size();
    for (size_t i = before; i < t_stacks.base.size(); ++i) {
      const uintptr_t b = reinterpret_cast<uintptr_t>(t_stacks.base[i]);
      g_stack_guards.push_back({b - P, b});
    }
  }
  static thread_local Block B;
  B.kernel = name;
  B.body = &body;
  B.n = static_cast<int>(n);
  B.fibers.assign(n, Fiber{});
  for (int t = 0; t < B.n; ++t) {
    B.fibers[t].tid = t;
    B.fibers[t].idx = {static_cast<unsigned>(t % block.x),
                       static_cast<unsigned>((t / block.x) % block.y),
                       static_cast<unsigned>(t / (block.x * block.y))};
  }
  B.warps.assign((n + 31) / 32, WarpSlot{});
  B.error = nullptr;
  B.rng = next_random();
  blockDim = block;
  gridDim = grid;
  FaultHandler handler;
  tb = &B;
  if (sigsetjmp(t_fault_jb, 1) != 0) {
    tb = nullptr;
    back_from_fault();
    throw Error(Check::kMemory, t_fault_msg);
  }
  try {
    run_launch(B, grid, block);
  } catch (...) {
    tb = nullptr;
    throw;
  }
  tb = nullptr;
  check_canaries(name);
}

// ---- guarded CPU allocations --------------------------------------------------------------------
namespace {

thread_local bool t_guard = false;

void* guarded_alloc(size_t n) {
  const size_t P = page_size();
  const size_t body = std::max<size_t>((n + P - 1) / P * P, P);
  const size_t len = body + 2 * P;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(m != MAP_FAILED, "simt: cannot map a guarded buffer of ", n, " bytes");
  char* map = static_cast<char*>(m);
  mprotect(map, P, PROT_NONE);
  mprotect(map + P + body, P, PROT_NONE);
  // The data abut the guard page after them (3 times in 4: reads past the end are the common
  // bug), else the one before them; the other side's slack holds the canary.
  const bool tail = (next_random() & 3) != 0;
  char* data = tail ? map + P + body - n : map + P;
  std::memset(map + P, kCanary, body);
  std::memset(data, 0xff, n);  // uninitialised memory reads as NaN
  std::lock_guard<std::mutex> lk(g_regions_mu);
  g_regions[reinterpret_cast<uintptr_t>(data)] = Region{map, len, data, n, map + P, body};
  return data;
}

c10::Allocator* g_base = nullptr;

void guarded_or_base_free(void* p) {
  {
    std::lock_guard<std::mutex> lk(g_regions_mu);
    auto it = g_regions.find(reinterpret_cast<uintptr_t>(p));
    if (it != g_regions.end()) {
      munmap(it->second.map, it->second.map_len);
      g_regions.erase(it);
      return;
    }
  }
  g_base->raw_deleter()(p);
}

struct GuardedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (!t_guard) return g_base->allocate(n);
    void* p = guarded_alloc(n);
    return {p, p, &guarded_or_base_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &guarded_or_base_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

void install_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_base = c10::GetCPUAllocator();
    static GuardedAllocator a;
    c10::SetCPUAllocator(&a, /*priority=*/200);
  });
}

}  // namespace

GuardScope::GuardScope() : prev(t_guard) {
  install_allocator();
  t_guard = true;
}
GuardScope::~GuardScope() { t_guard = prev; }

}  // namespace simt
