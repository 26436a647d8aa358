// The backend table of the registered ops (see route.h) and the ops Python fills it with.
#include "ops/route.h"

#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace ppo_kernels {
namespace {

constexpr uint8_t kUnresolved = 0xFF;
constexpr uint8_t kError = 0xFE;

// One entry per backend key; written by Python (set_backend), read by every call.
struct Entry {
  std::atomic<uint8_t> device[2] = {kUnresolved, kUnresolved};  // cpu, cuda
};

struct Table {
  std::mutex mu;  // guards entries' creation, the errors and the environment string
  std::unordered_map<std::string, std::unique_ptr<Entry>> entries;
  std::unordered_map<std::string, std::string> errors;  // "op/device" -> message
  std::string env;                                      // PPO_KERNELS_BACKEND when resolved
  std::atomic<uint64_t> env_hash{0};
};

Table& table() {
  static Table t;
  return t;
}

uint64_t hash_str(const char* s) {  // FNV-1a: the environment string is compared per call
  uint64_t h = 1469598103934665603ull;
  for (; *s; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 1099511628211ull;
  return h;
}

const char* env_backend() {
  const char* s = std::getenv("PPO_KERNELS_BACKEND");
  return s ? s : "";
}

Entry& entry(const std::string& op) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  auto& e = t.entries[op];
  if (!e) e = std::make_unique<Entry>();
  return *e;
}

// Per call: find the op's entry (created on first use, then stable).
Entry& entry_cached(const char* op) {
  // call sites pass string literals; a small cache keyed by pointer avoids hashing the name
  thread_local std::unordered_map<const char*, Entry*> cache;
  auto it = cache.find(op);
  if (it != cache.end()) return *it->second;
  Entry& e = entry(op);
  cache.emplace(op, &e);
  return e;
}

void refresh() {
  static const c10::OperatorHandle h =
      c10::Dispatcher::singleton().findSchemaOrThrow("ppo_kernels_py::refresh_backends", "");
  h.typed<void()>().call();
}

std::vector<std::string>& namespaces() {  // slot -> namespace of the cpp kernels seen
  static std::vector<std::string> ns = {"ppo_kernels", "ppo_kernels_triton", "ppo_kernels_eager",
                                        "ppo_kernels_cpp", "ppo_kernels_C"};
  return ns;
}
std::atomic<int> cpp_slot{static_cast<int>(Ns::kCppKernels)};

const char* kDeviceNames[2] = {"cpu", "cuda"};

int device_index(const std::string& d) {
  TORCH_CHECK_VALUE(d == "cpu" || d == "cuda", "device: expected 'cpu' or 'cuda', got '", d, "'");
  return d == "cpu" ? 0 : 1;
}

uint8_t backend_code(const std::string& b) {
  if (b == "cpp") return static_cast<uint8_t>(Backend::kCpp);
  if (b == "triton") return static_cast<uint8_t>(Backend::kTriton);
  if (b == "eager") return static_cast<uint8_t>(Backend::kEager);
  TORCH_CHECK_VALUE(false, "backend: expected 'cpp', 'triton' or 'eager', got '", b, "'");
}

// set_backend(op, device, backend, error): what `op` runs on for tensors of `device` ("cpu" or
// "cuda"); a non-empty error is raised by the op's calls instead (an unavailable backend that was
// requested by name).
void set_backend(const std::string& op, const std::string& device, const std::string& backend,
                 const std::string& error) {
  const int d = device_index(device);
  Entry& e = entry(op);
  Table& t = table();
  if (!error.empty()) {
    {
      std::lock_guard<std::mutex> g(t.mu);
      t.errors[op + "/" + device] = error;
    }
    e.device[d].store(kError);
  } else {
    e.device[d].store(backend_code(backend));
  }
}

// Mark the table resolved for the current PPO_KERNELS_BACKEND (Python calls this after a full
// set of set_backend calls), or unresolved (every entry re-resolves at its next call).
void set_resolved(bool resolved) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  if (resolved) {
    t.env = env_backend();
    t.env_hash.store(hash_str(t.env.c_str()));
  } else {
    for (auto& kv : t.entries)
      for (auto& d : kv.second->device) d.store(kUnresolved);
  }
}

std::string get_backend(const std::string& op, const std::string& device) {
  const uint8_t v = entry(op).device[device_index(device)].load();
  if (v == kUnresolved) return "";
  if (v == kError) return "error";
  return v == 0 ? "cpp" : v == 1 ? "triton" : "eager";
}

void set_cpp_namespace(const std::string& ns) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  auto& v = namespaces();
  for (size_t i = static_cast<size_t>(Ns::kCppKernels); i < v.size(); ++i)
    if (v[i] == ns) {
      cpp_slot.store(static_cast<int>(i));
      return;
    }
  TORCH_CHECK_VALUE(v.size() < 8, "set_cpp_namespace: too many namespaces");
  v.push_back(ns);
  cpp_slot.store(static_cast<int>(v.size() - 1));
}

std::string get_cpp_namespace() { return namespaces()[cpp_slot.load()]; }

std::atomic<bool> strict_flag{false};

bool set_strict(bool enabled) { return strict_flag.exchange(enabled); }

}  // namespace

bool strict_checks() { return strict_flag.load(std::memory_order_relaxed); }

bool cpp_kernels_compiled() { return cpp_slot.load() == static_cast<int>(Ns::kCppKernels); }

Backend backend_for(const char* op, const at::Tensor& like, bool eager_if_empty) {
  if (like.scalar_type() == at::kDouble) return Backend::kEager;
  if (eager_if_empty && like.numel() == 0) return Backend::kEager;
  const int d = like.is_cuda() ? 1 : 0;
  TORCH_CHECK(like.is_cuda() || like.is_cpu(), op, ": tensors on ", like.device(),
              " are not supported (cpu or cuda)");
  Table& t = table();
  if (t.env_hash.load(std::memory_order_relaxed) != hash_str(env_backend())) refresh();
  Entry& e = entry_cached(op);
  uint8_t v = e.device[d].load(std::memory_order_relaxed);
  if (v == kUnresolved) {
    refresh();
    v = e.device[d].load();
  }
  if (v == kError) {
    std::string msg;
    {
      std::lock_guard<std::mutex> g(t.mu);
      msg = t.errors[std::string(op) + "/" + kDeviceNames[d]];
    }
    TORCH_CHECK(false, msg);
  }
  TORCH_CHECK(v <= 2, op, ": no backend was resolved for ", kDeviceNames[d],
              " tensors (ppo_kernels._backend did not fill the table)");
  return static_cast<Backend>(v);
}

const c10::OperatorHandle& OpRef::handle(Ns ns) const {
  int slot = static_cast<int>(ns);
  if (ns == Ns::kCppKernels) slot = cpp_slot.load(std::memory_order_relaxed);
  if (!ready_[slot].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(mu_);
    if (!ready_[slot].load()) {
      std::string ns_name;
      {
        std::lock_guard<std::mutex> tg(table().mu);
        ns_name = namespaces()[slot];
      }
      auto h = c10::Dispatcher::singleton().findOp({ns_name + "::" + name_, ""});
      TORCH_CHECK(h.has_value(), ns_name, "::", name_,
                  " is not registered (for the triton / eager backends, import ppo_kernels "
                  "first; for the cpp backend, the extension lacks this kernel)");
      handles_[slot] = *h;
      ready_[slot].store(true, std::memory_order_release);
    }
  }
  return *handles_[slot];
}

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // The backend table (ppo_kernels/_backend.py fills it; see csrc/ops/route.h).
  m.def("set_backend(str op, str device, str backend, str error) -> ()", &set_backend);
  m.def("set_resolved(bool resolved) -> ()", &set_resolved);
  m.def("get_backend(str op, str device) -> str", &get_backend);
  // Where the cpp backend's raw kernels are called: "ppo_kernels_C", or e.g. the SIMT emulator's
  // namespace in tests (same schemas).
  m.def("set_cpp_namespace(str ns) -> ()", &set_cpp_namespace);
  m.def("get_cpp_namespace() -> str", &get_cpp_namespace);
  // ppo_kernels.strict_checks() as the registered ops see it (route.h); returns the old value.
  m.def("set_strict(bool enabled) -> bool", &set_strict);
}

}  // namespace ppo_kernels
