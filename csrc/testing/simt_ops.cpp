// The Python module `ppo_kernels._simt` (test-only, PPO_KERNELS_BUILD_SIMT=1): the CUDA kernels of
// csrc/cuda/*.cuh, compiled by g++ with PPO_SIMT and run by the SIMT emulator on CPU tensors, as
// torch.ops.ppo_kernels_simt.* with the schemas of their ppo_kernels_C counterparts (copied from
// the dispatcher at import, so they cannot drift). Tests route the public ops here with
// ppo_kernels._backend.use_cpp_namespace("ppo_kernels_simt").
//
// Every tensor argument is first copied into guarded memory (simt::GuardScope: its end, or at
// random its start, abuts a PROT_NONE page) and every buffer the launcher allocates is guarded
// too, so an out-of-bounds global access faults and is reported with the kernel, block and
// thread. Arguments the kernel writes are copied back afterwards.
#include <Python.h>
#include <torch/library.h>

#include <map>
#include <sstream>

#include "cuda/full_kl.cuh"
#include "cuda/gae.cuh"
#include "cuda/token_logprobs.cuh"
#include "cuda/token_logprobs_sampler.cuh"
#include "testing/simt.h"

namespace ppo_kernels {

void register_simt_selftests(torch::Library& m);  // simt_selftest.cpp

namespace {

using simt::Device;

// Guarded copies of a call's tensor arguments: one guarded buffer per storage, holding the span of
// that storage the arguments view (arguments that alias keep aliasing).
class Guarded {
 public:
  template <typename... T>
  explicit Guarded(const T&... args) {
    (span(args), ...);
    for (auto& [key, s] : spans_) {
      s.copy = at::empty({(s.hi - s.lo) / s.itemsize}, at::TensorOptions().dtype(s.dtype));
      std::memcpy(s.copy.data_ptr(), static_cast<const char*>(key) + s.lo, s.hi - s.lo);
    }
  }
  at::Tensor operator()(const at::Tensor& t) const {
    if (!t.defined() || t.numel() == 0) return t;
    const Span& s = spans_.at(t.storage().data());
    const int64_t off = (t.storage_offset() * s.itemsize - s.lo) / s.itemsize;
    return s.copy.as_strided(t.sizes(), t.strides(), off);
  }
  std::optional<at::Tensor> operator()(const std::optional<at::Tensor>& t) const {
    if (!t.has_value()) return t;
    return (*this)(*t);
  }
  // Copies a written argument back from its guarded copy.
  void write_back(const at::Tensor& orig, const at::Tensor& copy) const {
    if (orig.defined() && orig.numel() > 0) orig.copy_(copy);
  }

 private:
  struct Span {
    int64_t lo, hi, itemsize;
    at::ScalarType dtype;
    at::Tensor copy;
  };
  void span(const at::Tensor& t) {
    if (!t.defined() || t.numel() == 0) return;
    TORCH_CHECK(t.device().is_cpu(), "SIMT emulator: expected CPU tensors");
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      TORCH_CHECK(t.stride(d) >= 0, "SIMT emulator: negative strides are not supported");
      last += (t.size(d) - 1) * t.stride(d);
    }
    const int64_t isz = t.element_size();
    const int64_t lo = t.storage_offset() * isz, hi = (t.storage_offset() + last + 1) * isz;
    auto [it, fresh] =
        spans_.try_emplace(t.storage().data(), Span{lo, hi, isz, t.scalar_type(), {}});
    if (!fresh) {
      TORCH_CHECK(it->second.itemsize == isz && it->second.dtype == t.scalar_type(),
                  "SIMT emulator: arguments view one storage with different dtypes");
      it->second.lo = std::min(it->second.lo, lo);
      it->second.hi = std::max(it->second.hi, hi);
    }
  }
  void span(const std::optional<at::Tensor>& t) {
    if (t.has_value()) span(*t);
  }
  template <typename T>
  void span(const T&) {}
  simt::GuardScope scope_;  // declared first: the copies are guarded too
  std::map<const void*, Span> spans_;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd(const at::Tensor& logits,
                                                                  const at::Tensor& labels,
                                                                  double inv_t,
                                                                  int64_t ignore_index,
                                                                  bool with_entropy) {
  const Guarded g(logits, labels);
  return token_logprobs_cuda::fwd<Device>(g(logits), g(labels), inv_t, ignore_index, with_entropy);
}

void token_logprobs_bwd(const at::Tensor& glp, const std::optional<at::Tensor>& gent,
                        const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                        const at::Tensor& entropy, double inv_t, int64_t ignore_index,
                        at::Tensor grad_logits) {
  const Guarded g(glp, gent, logits, labels, lse, entropy, grad_logits);
  const at::Tensor out = g(grad_logits);
  token_logprobs_cuda::bwd<Device>(g(glp), g(gent), g(logits), g(labels), g(lse), g(entropy), inv_t,
                                   ignore_index, out);
  g.write_back(grad_logits, out);
}

using SamplerOuts =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

SamplerOuts token_logprobs_sampler_fwd(const at::Tensor& logits, const at::Tensor& labels,
                                       double inv_t, const std::optional<at::Tensor>& inv_ts,
                                       int64_t top_k, const std::optional<at::Tensor>& top_ks,
                                       double top_p, const std::optional<at::Tensor>& top_ps,
                                       double min_p, const std::optional<at::Tensor>& min_ps,
                                       c10::string_view sampler, int64_t ignore_index,
                                       bool with_entropy, bool with_sum_p2, bool with_lse,
                                       int64_t stats_top_k, bool with_is_argmax) {
  const Guarded g(logits, labels, inv_ts, top_ks, top_ps, min_ps);
  return token_logprobs_sampler_cuda::fwd<Device>(
      g(logits), g(labels), inv_t, g(inv_ts), top_k, g(top_ks), top_p, g(top_ps), min_p, g(min_ps),
      sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k, with_is_argmax);
}

void token_logprobs_sampler_bwd(const at::Tensor& glp, const std::optional<at::Tensor>& gent,
                                const at::Tensor& logits, const at::Tensor& labels,
                                const at::Tensor& lse, const at::Tensor& entropy,
                                const at::Tensor& cut, const at::Tensor& cut_index, double inv_t,
                                const std::optional<at::Tensor>& inv_ts, int64_t ignore_index,
                                at::Tensor grad_logits) {
  const Guarded g(glp, gent, logits, labels, lse, entropy, cut, cut_index, inv_ts, grad_logits);
  const at::Tensor out = g(grad_logits);
  token_logprobs_sampler_cuda::bwd<Device>(g(glp), g(gent), g(logits), g(labels), g(lse),
                                           g(entropy), g(cut), g(cut_index), inv_t, g(inv_ts),
                                           ignore_index, out);
  g.write_back(grad_logits, out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> full_kl_fwd(
    const at::Tensor& logits, const at::Tensor& ref, const std::optional<at::Tensor>& mask,
    double inv_t, const std::optional<at::Tensor>& inv_ts) {
  const Guarded g(logits, ref, mask, inv_ts);
  return full_kl_cuda::fwd<Device>(g(logits), g(ref), g(mask), inv_t, g(inv_ts));
}

void full_kl_bwd(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ref,
                 const std::optional<at::Tensor>& mask, const at::Tensor& kl, const at::Tensor& lz,
                 const at::Tensor& lw, double inv_t, at::Tensor grad_logits,
                 std::optional<at::Tensor> grad_ref, const std::optional<at::Tensor>& inv_ts) {
  const Guarded g(grad, logits, ref, mask, kl, lz, lw, grad_logits, grad_ref, inv_ts);
  const at::Tensor gx = g(grad_logits);
  const std::optional<at::Tensor> gy = g(grad_ref);
  full_kl_cuda::bwd<Device>(g(grad), g(logits), g(ref), g(mask), g(kl), g(lz), g(lw), inv_t, gx, gy,
                            g(inv_ts));
  g.write_back(grad_logits, gx);
  if (grad_ref.has_value()) g.write_back(*grad_ref, *gy);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gae_fwd(
    const at::Tensor& rewards, const at::Tensor& values, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& dones, const std::optional<at::Tensor>& gamma_t,
    const std::optional<at::Tensor>& lam_t, double gamma, double lam,
    const std::optional<at::Tensor>& init_value, const std::optional<at::Tensor>& init_adv,
    const std::optional<at::Tensor>& cu_seqlens, int64_t n_rows, int64_t row_len) {
  const Guarded g(rewards, values, mask, dones, gamma_t, lam_t, init_value, init_adv, cu_seqlens);
  return gae_cuda::fwd<Device>(g(rewards), g(values), g(mask), g(dones), g(gamma_t), g(lam_t),
                               gamma, lam, g(init_value), g(init_adv), g(cu_seqlens), n_rows,
                               row_len);
}

void set_seed(int64_t seed) { simt::set_seed(static_cast<uint64_t>(seed)); }
void set_geometry(int64_t sm_count, int64_t max_row_blocks) {
  TORCH_CHECK(sm_count >= 1 && max_row_blocks >= 1, "set_geometry: expected positive values");
  simt::set_geometry(static_cast<int>(sm_count), max_row_blocks);
}

// The schema of ppo_kernels_C::<name> without its namespace.
std::string schema_of(const char* name) {
  auto op = c10::Dispatcher::singleton().findSchema({std::string("ppo_kernels_C::") + name, ""});
  TORCH_CHECK(op.has_value(), "ppo_kernels._simt: ppo_kernels_C::", name, " is not registered");
  std::ostringstream s;
  s << op->schema();
  const std::string full = s.str();
  return full.substr(full.find("::") + 2);
}

void register_ops() {
  static torch::Library defs(torch::Library::DEF, "ppo_kernels_simt", std::nullopt, __FILE__,
                             __LINE__);
  static torch::Library impls(torch::Library::IMPL, "ppo_kernels_simt", c10::DispatchKey::CPU,
                              __FILE__, __LINE__);
  for (const char* k : {"token_logprobs_fwd", "token_logprobs_bwd", "token_logprobs_sampler_fwd",
                        "token_logprobs_sampler_bwd", "full_kl_fwd", "full_kl_bwd", "gae_fwd"}) {
    defs.def(schema_of(k).c_str());
  }
  impls.impl("token_logprobs_fwd", &token_logprobs_fwd);
  impls.impl("token_logprobs_bwd", &token_logprobs_bwd);
  impls.impl("token_logprobs_sampler_fwd", &token_logprobs_sampler_fwd);
  impls.impl("token_logprobs_sampler_bwd", &token_logprobs_sampler_bwd);
  impls.impl("full_kl_fwd", &full_kl_fwd);
  impls.impl("full_kl_bwd", &full_kl_bwd);
  impls.impl("gae_fwd", &gae_fwd);
  // Emulator controls (no tensors: CompositeImplicit through the DEF library).
  defs.def("set_seed(int seed) -> ()", &set_seed);
  // Multiprocessor count (GAE's chunk plan) and the row kernels' grid-stride threshold.
  defs.def("set_geometry(int sm_count=4, int max_row_blocks=1048576) -> ()", &set_geometry);
  defs.def("launches() -> str[]", &simt::take_launch_log);
  register_simt_selftests(defs);
}

}  // namespace
}  // namespace ppo_kernels

extern "C" {
PyObject* PyInit__simt(void) {
  // The schemas come from ppo_kernels_C: load it first.
  PyObject* c = PyImport_ImportModule("ppo_kernels._C");
  if (c == nullptr) return nullptr;
  Py_DECREF(c);
  try {
    ppo_kernels::register_ops();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return nullptr;
  }
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_simt", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace ppo_kernels {
// Output poisoning (common/alloc.h) follows the flag of ppo_kernels._C, which the tests set through
// ppo_kernels_C::set_poison (this module is a separate library and cannot link to its definition).
bool& poison_outputs() {
  static thread_local bool flag = false;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ppo_kernels_C::set_poison", "")
                             .typed<bool(bool)>();
  flag = op.call(true);
  op.call(flag);
  return flag;
}

// Batch-invariant mode follows ppo_kernels._C's flag the same way.
bool& batch_invariant_mode() {
  static thread_local bool flag = false;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ppo_kernels_C::set_batch_invariant", "")
                             .typed<bool(bool)>();
  flag = op.call(true);
  op.call(flag);
  return flag;
}
}  // namespace ppo_kernels
