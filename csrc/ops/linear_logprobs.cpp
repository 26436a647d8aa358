// Registered ops `ppo_kernels::linear_token_logprobs` (+ its backward): schemas, argument checks,
// backend routing and autograd. Every backend runs the same Python chunk loop
// (ppo_kernels/fused_linear/chunks.py: plan the chunks, BLAS / cuBLAS matmuls into a reused
// tile, then that backend's tile kernels), registered by ppo_kernels/linear_logprobs/op.py as
// `ppo_kernels_cpp::` (the compiled token_logprobs and tile kernels: csrc/cpu/linear_logprobs.cpp,
// csrc/cpu/token_logprobs.cpp, csrc/cuda/token_logprobs.cu), `ppo_kernels_triton::` and
// `ppo_kernels_eager::` -- except a small call on the cpp backend, whose logits fit one tile: it
// runs here, in C++ (see "One tile" below). Semantics: ppo_kernels/linear_logprobs/naive.py.
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <atomic>

#include "common/alloc.h"
#include "common/token_logprobs_host.h"
#include "ops/checks.h"
#include "ops/plain_node.h"
#include "ops/route.h"
#include "ops/sampler_checks.h"

namespace ppo_kernels {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;
using Out3 = std::tuple<Tensor, Tensor, Tensor>;

using FwdSig = Out3(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, double, int64_t,
                    bool, int64_t, const std::string&, std::optional<double>);
using BwdSig = Out3(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                    const OptTensor&, const Tensor&, const Tensor&, double, int64_t, int64_t, bool,
                    bool, bool, const std::string&, std::optional<double>);

const OpRef kFwd("linear_token_logprobs"), kBwd("linear_token_logprobs_backward");
constexpr const char* kKey = "linear_token_logprobs";  // the backend key (use_backend)

// A positive finite temperature whose inverse is finite in float32 (the kernels' 1 / T).
void check_temperature(double t) {
  expect_positive("temperature", t);
  constexpr double kFloat32Max = 3.4028234663852886e38;
  TORCH_CHECK_VALUE(1.0 / t <= kFloat32Max, "temperature: ", t,
                    " is too small (1 / temperature overflows float32; the smallest accepted is ",
                    1.0 / kFloat32Max, ")");
}

// Every label in [0, V) or ignore_index, else an IndexError naming the first one outside. CPU
// labels only (reading GPU labels is a host sync: op.py checks them under strict_checks()).
void check_labels_in_range(const Tensor& labels, int64_t V, int64_t ignore_index) {
  if (!labels.is_cpu() || labels.numel() == 0) return;
  check_labels_on_host(labels.contiguous(), V, ignore_index);
}

// hidden [N, H], weight [V, H], labels [N], bias [V] or none; the scalars (metadata, and the
// labels on the CPU).
void check_forward(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                   const OptTensor& bias, double temperature, int64_t ignore_index,
                   int64_t max_chunk_bytes, const std::string& logits_dtype,
                   std::optional<double> softcap) {
  expect_float(hidden, "hidden");
  expect_dim(hidden, "hidden", 2);
  const int64_t N = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK_VALUE(weight.defined(), "weight: expected a tensor");
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), "weight: expected dtype ",
                   dtype_name(hidden.scalar_type()), " (like hidden), got ",
                   dtype_name(weight.scalar_type()));
  expect_device(weight, "weight", hidden, "hidden");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == H, "weight: expected shape (V, ", H,
                    ") (H = hidden.shape[-1]), got ", shape_str(weight.sizes()));
  const int64_t V = weight.size(0);
  expect_index(labels, "labels");
  expect_device(labels, "labels", hidden, "hidden");
  expect_shape(labels, "labels", {N}, "hidden.shape[:-1]");
  if (bias) {
    TORCH_CHECK_VALUE(bias->defined(), "bias: expected a tensor");
    TORCH_CHECK_TYPE(bias->scalar_type() == hidden.scalar_type(), "bias: expected dtype ",
                     dtype_name(hidden.scalar_type()), " (like hidden), got ",
                     dtype_name(bias->scalar_type()));
    expect_device(*bias, "bias", hidden, "hidden");
    expect_shape(*bias, "bias", {V}, "weight.shape[0]");
  }
  TORCH_CHECK_VALUE(V > 0 || N == 0, "weight: the vocabulary dimension (first) is empty");
  check_temperature(temperature);
  TORCH_CHECK_VALUE(max_chunk_bytes >= 0, "max_chunk_bytes: expected an int >= 0, got ",
                    max_chunk_bytes);
  TORCH_CHECK_VALUE(logits_dtype == "float32" || logits_dtype == "input",
                    "logits_dtype: expected one of ('float32', 'input'), got '", logits_dtype, "'");
  if (softcap) expect_positive("softcap", *softcap);
  check_labels_in_range(labels, V, ignore_index);
}

// ---- One tile: a small call on the cpp backend runs here, in C++. The chunk loop is Python and
// costs several times the eager composition's time on a small call (bench/bench_overhead.py,
// bench/results/cpu_overhead*.md); here the logits are one tile, computed by one matmul and reduced
// by token_logprobs' kernels (at most 256 KiB: kept for the backward by the graph node below,
// recomputed by the backward op). The roundings are the chunk loop's: float32 tiles upcast bf16 /
// fp16 inputs (the float32 copy of the head is at most 4 MiB), "input" tiles keep the input dtype
// and add the bias after the matmul, as `h @ W.T + b` materialised does.
constexpr int64_t kOneTileLogits = int64_t{1} << 16;  // N * V
constexpr int64_t kOneTileWeight = int64_t{1} << 20;  // V * H

const OpRef kTLFwdKernel("token_logprobs_fwd"), kTLBwdKernel("token_logprobs_bwd");
using TLFwdSig = Out3(const Tensor&, const Tensor&, double, int64_t, bool);
using TLBwdSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, double, int64_t, Tensor);

std::atomic<int64_t> g_one_tile_calls{0};  // forward and backward calls taken here (tests)

bool one_tile(const Tensor& hidden, const Tensor& weight, int64_t max_chunk_bytes,
              const std::optional<double>& softcap, Backend b) {
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  // a budget or a softcap asks for the loop's tiles; batch-invariant mode for its fixed row chunks
  return b == Backend::kCpp && N > 0 && N * V <= kOneTileLogits && V * H <= kOneTileWeight &&
         max_chunk_bytes == 0 && !softcap && !batch_invariant_mode() &&
         hidden.scalar_type() != at::kDouble;
}

bool input_tiles(const Tensor& hidden, const std::string& logits_dtype) {
  const auto st = hidden.scalar_type();
  return logits_dtype == "input" && (st == at::kBFloat16 || st == at::kHalf);
}

// The matmul operands of the tile: the inputs, or their float32 copies.
struct TileOperands {
  Tensor h, w;
  OptTensor b;
};

TileOperands tile_operands(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                           bool input) {
  if (input || hidden.scalar_type() == at::kFloat) return {hidden, weight, bias};
  return {hidden.to(at::kFloat), weight.to(at::kFloat),
          bias ? OptTensor(bias->to(at::kFloat)) : OptTensor()};
}

Tensor tile_logits(const TileOperands& t, bool input) {
  if (!t.b) return at::mm(t.h, t.w.t());
  if (input) return at::add(at::mm(t.h, t.w.t()), *t.b);  // rounded twice, as materialised
  return at::addmm(*t.b, t.h, t.w.t());
}

// keep_logits: where to leave the tile for the backward (the Autograd kernel's plain-tensor path)
Out3 one_tile_forward(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                      const OptTensor& bias, double temperature, int64_t ignore_index,
                      bool with_entropy, const std::string& logits_dtype,
                      Tensor* keep_logits = nullptr) {
  g_one_tile_calls.fetch_add(1, std::memory_order_relaxed);
  const bool input = input_tiles(hidden, logits_dtype);
  const Tensor logits = tile_logits(tile_operands(hidden, weight, bias, input), input);
  if (keep_logits) *keep_logits = logits;
  return kTLFwdKernel.in<TLFwdSig>(Ns::kCppKernels)
      .call(logits, labels, 1.0 / temperature, ignore_index, with_entropy);
}

// logits: the forward's tile when it was kept (the gradient then goes to a new buffer: a graph
// retained for a second backward still needs it), else undefined: recomputed and overwritten.
Out3 one_tile_backward(const Tensor& grad_logprobs, const OptTensor& grad_entropy,
                       const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                       const OptTensor& bias, const Tensor& lse, const Tensor& entropy,
                       double temperature, int64_t ignore_index, bool need_hidden, bool need_weight,
                       bool need_bias, const std::string& logits_dtype,
                       const Tensor& logits = Tensor()) {
  g_one_tile_calls.fetch_add(1, std::memory_order_relaxed);
  const bool input = input_tiles(hidden, logits_dtype);
  const TileOperands t = tile_operands(hidden, weight, bias, input);
  const Tensor z = logits.defined() ? logits : tile_logits(t, input);
  const Tensor g = logits.defined() ? at::empty_like(z) : z;  // d(out)/d(logits)
  kTLBwdKernel.in<TLBwdSig>(Ns::kCppKernels)
      .call(grad_logprobs, grad_entropy, z, labels, lse, entropy, 1.0 / temperature, ignore_index,
            g);
  const auto f32 = hidden.options().dtype(at::kFloat);
  const auto none = [&](const at::TensorOptions& o) { return at::empty({0}, o); };
  return {need_hidden ? at::mm(g, t.w).to(hidden.scalar_type()) : none(hidden.options()),
          need_weight ? at::mm(g.t(), t.h).to(at::kFloat) : none(f32),
          need_bias && bias ? g.sum(0, false, at::kFloat) : none(f32)};
}

int64_t one_tile_calls() { return g_one_tile_calls.load(std::memory_order_relaxed); }

Out3 forward(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
             const OptTensor& bias, double temperature, int64_t ignore_index, bool with_entropy,
             int64_t max_chunk_bytes, const std::string& logits_dtype,
             std::optional<double> softcap) {
  check_forward(hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes,
                logits_dtype, softcap);
  const Backend b = backend_for(kKey, hidden);
  if (one_tile(hidden, weight, max_chunk_bytes, softcap, b))
    return one_tile_forward(hidden, weight, labels, bias, temperature, ignore_index, with_entropy,
                            logits_dtype);
  return kFwd.python<FwdSig>(b).call(hidden, weight, labels, bias, temperature, ignore_index,
                                     with_entropy, max_chunk_bytes, logits_dtype, softcap);
}

// The backward's upstream gradients and the forward's saved statistics (lse, entropy) [N].
void check_saved_stats(const Tensor& grad_logprobs, const OptTensor& grad_entropy,
                       const Tensor& hidden, const Tensor& labels, const Tensor& lse,
                       const Tensor& entropy) {
  const auto rows = labels.sizes();
  const auto acc = out_dtype(hidden);
  expect_float(grad_logprobs, "grad_logprobs");
  expect_device(grad_logprobs, "grad_logprobs", hidden, "hidden");
  expect_shape(grad_logprobs, "grad_logprobs", rows, "hidden.shape[:-1]");
  TORCH_CHECK_VALUE(lse.defined(), "lse: expected a tensor");
  expect_dtype(lse, "lse", acc, "the forward's lse");
  expect_device(lse, "lse", hidden, "hidden");
  expect_shape(lse, "lse", rows, "hidden.shape[:-1]");
  // on hidden's device even where not read (no entropy gradient: empty tensors)
  if (entropy.defined()) expect_device(entropy, "entropy", hidden, "hidden");
  if (grad_entropy && grad_entropy->defined())
    expect_device(*grad_entropy, "grad_entropy", hidden, "hidden");
  if (grad_entropy && grad_entropy->defined() && grad_entropy->numel() > 0) {
    expect_float(*grad_entropy, "grad_entropy");
    expect_device(*grad_entropy, "grad_entropy", hidden, "hidden");
    expect_shape(*grad_entropy, "grad_entropy", rows, "hidden.shape[:-1]");
    TORCH_CHECK_VALUE(entropy.defined(), "entropy: expected a tensor");
    expect_dtype(entropy, "entropy", acc, "the forward's entropy");
    expect_device(entropy, "entropy", hidden, "hidden");
    expect_shape(entropy, "entropy", rows, "hidden.shape[:-1]");
  }
}

// (grad_hidden in hidden's dtype, grad_weight float32, grad_bias float32), an empty tensor where
// not needed (float64 for float64 inputs).
Out3 backward(const Tensor& grad_logprobs, const OptTensor& grad_entropy, const Tensor& hidden,
              const Tensor& weight, const Tensor& labels, const OptTensor& bias, const Tensor& lse,
              const Tensor& entropy, double temperature, int64_t ignore_index,
              int64_t max_chunk_bytes, bool need_hidden, bool need_weight, bool need_bias,
              const std::string& logits_dtype, std::optional<double> softcap) {
  check_forward(hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes,
                logits_dtype, softcap);
  check_saved_stats(grad_logprobs, grad_entropy, hidden, labels, lse, entropy);
  const Backend b = backend_for(kKey, hidden);
  if (one_tile(hidden, weight, max_chunk_bytes, softcap, b))
    return one_tile_backward(grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse,
                             entropy, temperature, ignore_index, need_hidden, need_weight,
                             need_bias, logits_dtype);
  return kBwd.python<BwdSig>(b).call(grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse,
                                     entropy, temperature, ignore_index, max_chunk_bytes,
                                     need_hidden, need_weight, need_bias, logits_dtype, softcap);
}

// The head's gradients at the op's argument slots (hidden 0, weight 1, bias 3); weight's and
// bias's back in their dtype (the kernels accumulate them in float32).
void place_head_grads(variable_list& out, const Tensor& gh, const Tensor& gW, const Tensor& gb,
                      bool need_h, bool need_w, bool need_b, const Tensor& weight,
                      const Tensor& bias) {
  if (need_h) out[0] = gh;
  if (need_w) out[1] = gW.to(weight.scalar_type());
  if (need_b) out[3] = gb.to(bias.scalar_type());
}

class LinearFn : public torch::autograd::Function<LinearFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight,
                               const Tensor& labels, const OptTensor& bias, double temperature,
                               int64_t ignore_index, bool with_entropy, int64_t max_chunk_bytes,
                               const std::string& logits_dtype, std::optional<double> softcap) {
    Tensor lp, ent, lse;
    {
      BelowAutograd guard;
      std::tie(lp, ent, lse) =
          kFwd.in<FwdSig>(Ns::kOps).call(hidden, weight, labels, bias, temperature, ignore_index,
                                         with_entropy, max_chunk_bytes, logits_dtype, softcap);
    }
    ctx->save_for_backward({hidden, weight, labels, bias.value_or(Tensor()), lse, ent});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["max_chunk_bytes"] = max_chunk_bytes;
    ctx->saved_data["logits_dtype"] = logits_dtype;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["with_entropy"] = with_entropy;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined (no zeros)
    return {lp, ent, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &hidden = saved[0], &weight = saved[1], &labels = saved[2], &bias = saved[3];
    const Tensor &lse = saved[4], &entropy = saved[5];
    // the input edges are the tensor arguments given: hidden, weight, labels (, bias)
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = bias.defined() && ctx->needs_input_grad(3);
    variable_list out(10);  // one per argument of the op
    if (!(need_h || need_w || need_b)) return out;
    const Tensor& grad_lp = grads[0].defined() ? grads[0] : at::zeros_like(lse);
    OptTensor grad_ent;  // (from the flag: the sizes may be symbolic under torch.compile)
    if (ctx->saved_data["with_entropy"].toBool() && grads[1].defined()) grad_ent = grads[1];
    const auto softcap = ctx->saved_data["softcap"];
    auto [gh, gW, gb] = kBwd.in<BwdSig>(Ns::kOps).call(
        grad_lp, grad_ent, hidden, weight, labels, bias.defined() ? OptTensor(bias) : OptTensor(),
        lse, entropy, ctx->saved_data["temperature"].toDouble(),
        ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["max_chunk_bytes"].toInt(), need_h,
        need_w, need_b, ctx->saved_data["logits_dtype"].toStringRef(),
        softcap.isNone() ? std::optional<double>() : softcap.toDouble());
    place_head_grads(out, gh, gW, gb, need_h, need_w, need_b, weight, bias);
    return out;
  }
};

// ---- The one-tile call's graph node, for plain tensors (ops/plain_node.h): the logits tile is
// kept (at most 256 KiB) instead of recomputed, and the backward op's second round of checks is
// skipped. Gradient edges: hidden, weight (, bias).
struct OneTileBackward final : torch::autograd::Node {
  using SavedVariable = torch::autograd::SavedVariable;
  SavedVariable hidden, weight, labels, bias, lse, entropy, logits;
  double temperature = 1.0;
  int64_t ignore_index = -100;
  bool with_entropy = false, has_bias = false;
  std::string logits_dtype;

  std::string name() const override { return "LinearTokenLogprobsBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&hidden, &weight, &labels, &bias, &lse, &entropy, &logits})
      v->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool need_h = task_should_compute_output(0), need_w = task_should_compute_output(1);
    const bool need_b = has_bias && task_should_compute_output(2);
    variable_list out(has_bias ? 3 : 2);
    if (!(need_h || need_w || need_b) || !(grads[0].defined() || grads[1].defined())) return out;
    const Tensor h = hidden.unpack(), w = weight.unpack(), ls = lse.unpack();
    const Tensor b = has_bias ? bias.unpack() : Tensor();
    const Tensor glp = grads[0].defined() ? grads[0] : at::zeros_like(ls);
    const OptTensor gent = with_entropy && grads[1].defined() ? OptTensor(grads[1]) : OptTensor();
    auto [gh, gW, gb] =
        one_tile_backward(glp, gent, h, w, labels.unpack(), has_bias ? OptTensor(b) : OptTensor(),
                          ls, entropy.unpack(getptr()), temperature, ignore_index, need_h, need_w,
                          need_b, logits_dtype, logits.unpack());
    if (need_h) out[0] = std::move(gh);
    if (need_w) out[1] = gW.to(w.scalar_type());  // (float32 from one_tile_backward)
    if (need_b) out[2] = gb.to(b.scalar_type());
    return out;
  }
};

// Whether a call takes OneTileBackward: one tile (see one_tile) of plain tensors.
bool one_tile_plain(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                    const OptTensor& bias, int64_t max_chunk_bytes,
                    const std::optional<double>& softcap) {
  return hidden.dim() == 2 && weight.dim() == 2 && all_plain(hidden, weight, labels, bias) &&
         one_tile(hidden, weight, max_chunk_bytes, softcap, backend_for(kKey, hidden));
}

Out3 one_tile_autograd(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                       const OptTensor& bias, double temperature, int64_t ignore_index,
                       bool with_entropy, int64_t max_chunk_bytes, const std::string& logits_dtype,
                       std::optional<double> softcap) {
  check_forward(hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes,
                logits_dtype, softcap);
  check_functorch();
  const bool has_bias = bias && bias->defined();
  auto node = make_node<OneTileBackward>();
  node->set_next_edges(has_bias ? torch::autograd::collect_next_edges(hidden, weight, *bias)
                                : torch::autograd::collect_next_edges(hidden, weight));
  Tensor lp, ent, lse, logits;
  {
    BelowAutograd guard;
    std::tie(lp, ent, lse) = one_tile_forward(hidden, weight, labels, bias, temperature,
                                              ignore_index, with_entropy, logits_dtype, &logits);
  }
  torch::autograd::set_history(lp, node);  // outputs 0 and 1; lse is not differentiable
  torch::autograd::set_history(ent, node);
  using torch::autograd::SavedVariable;
  node->hidden = SavedVariable(hidden, false);
  node->weight = SavedVariable(weight, false);
  node->labels = SavedVariable(labels, false);
  if (has_bias) node->bias = SavedVariable(*bias, false);
  node->lse = SavedVariable(lse, false);
  node->entropy = SavedVariable(ent, true);
  node->logits = SavedVariable(logits, false);
  node->temperature = temperature;
  node->ignore_index = ignore_index;
  node->with_entropy = with_entropy;
  node->has_bias = has_bias;
  node->logits_dtype = logits_dtype;
  node_created(node);
  return {lp, ent, lse};
}

Out3 forward_autograd(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                      const OptTensor& bias, double temperature, int64_t ignore_index,
                      bool with_entropy, int64_t max_chunk_bytes, const std::string& logits_dtype,
                      std::optional<double> softcap) {
  if (!needs_graph(hidden, weight, labels, bias)) {
    BelowAutograd guard;
    return kFwd.in<FwdSig>(Ns::kOps).call(hidden, weight, labels, bias, temperature, ignore_index,
                                          with_entropy, max_chunk_bytes, logits_dtype, softcap);
  }
  if (one_tile_plain(hidden, weight, labels, bias, max_chunk_bytes, softcap))
    return one_tile_autograd(hidden, weight, labels, bias, temperature, ignore_index, with_entropy,
                             max_chunk_bytes, logits_dtype, softcap);
  auto out = LinearFn::apply(hidden, weight, labels, bias, temperature, ignore_index, with_entropy,
                             max_chunk_bytes, logits_dtype, softcap);
  return {out[0], out[1], out[2]};
}

// ---- The sampler's distribution: ppo_kernels::linear_token_logprobs_sampler (+ backward) --------
// token_logprobs_sampler of hidden @ weight.T + bias (temperature, min-p, top-k, top-p; the head's
// statistics on request). Its own op, so the plain call's path stays as it was. Every backend runs
// the Python chunk loop with whole-vocabulary tiles (a top-k / top-p selection needs the whole
// row), each reduced by that backend's sampler kernels (ppo_kernels/linear_logprobs/op.py).
using SamplerOuts = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor, Tensor, Tensor>;
using SamplerFwdSig = SamplerOuts(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                  double, const OptTensor&, int64_t, const OptTensor&, double,
                                  const OptTensor&, double, const OptTensor&, c10::string_view,
                                  int64_t, bool, bool, bool, int64_t, bool, int64_t,
                                  const std::string&, std::optional<double>);
using SamplerBwdSig = Out3(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                           const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, double, const OptTensor&, int64_t, int64_t,
                           bool, bool, bool, const std::string&, std::optional<double>);
const OpRef kSamplerFwd("linear_token_logprobs_sampler"),
    kSamplerBwd("linear_token_logprobs_sampler_backward");

SamplerOuts sampler_forward(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                            const OptTensor& bias, double temperature,
                            const OptTensor& temperatures, int64_t top_k, const OptTensor& top_ks,
                            double top_p, const OptTensor& top_ps, double min_p,
                            const OptTensor& min_ps, c10::string_view sampler, int64_t ignore_index,
                            bool with_entropy, bool with_sum_p2, bool with_lse, int64_t stats_top_k,
                            bool with_is_argmax, int64_t max_chunk_bytes,
                            const std::string& logits_dtype, std::optional<double> softcap) {
  check_forward(hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes,
                logits_dtype, softcap);
  check_sampler_options(hidden, "hidden", weight.size(0), labels, temperatures, top_k, top_ks,
                        top_p, top_ps, min_p, min_ps, sampler, stats_top_k);
  return kSamplerFwd.python<SamplerFwdSig>(backend_for(kKey, hidden))
      .call(hidden, weight, labels, bias, temperature, temperatures, top_k, top_ks, top_p, top_ps,
            min_p, min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
            with_is_argmax, max_chunk_bytes, logits_dtype, softcap);
}

Out3 sampler_backward(const Tensor& grad_logprobs, const OptTensor& grad_entropy,
                      const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                      const OptTensor& bias, const Tensor& lse, const Tensor& entropy,
                      const Tensor& cut, const Tensor& cut_index, double temperature,
                      const OptTensor& temperatures, int64_t ignore_index, int64_t max_chunk_bytes,
                      bool need_hidden, bool need_weight, bool need_bias,
                      const std::string& logits_dtype, std::optional<double> softcap) {
  check_forward(hidden, weight, labels, bias, temperature, ignore_index, max_chunk_bytes,
                logits_dtype, softcap);
  check_sampler_temperatures(temperatures, hidden, "hidden", labels);
  check_saved_stats(grad_logprobs, grad_entropy, hidden, labels, lse, entropy);
  const auto rows = labels.sizes();
  check_kept_set(cut, cut_index, hidden, "hidden", rows, "hidden.shape[:-1]");
  return kSamplerBwd.python<SamplerBwdSig>(backend_for(kKey, hidden))
      .call(grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse, entropy, cut, cut_index,
            temperature, temperatures, ignore_index, max_chunk_bytes, need_hidden, need_weight,
            need_bias, logits_dtype, softcap);
}

class LinearSamplerFn : public torch::autograd::Function<LinearSamplerFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight,
                               const Tensor& labels, const OptTensor& bias, double temperature,
                               const OptTensor& temperatures, int64_t top_k,
                               const OptTensor& top_ks, double top_p, const OptTensor& top_ps,
                               double min_p, const OptTensor& min_ps, c10::string_view sampler,
                               int64_t ignore_index, bool with_entropy, bool with_sum_p2,
                               bool with_lse, int64_t stats_top_k, bool with_is_argmax,
                               int64_t max_chunk_bytes, const std::string& logits_dtype,
                               std::optional<double> softcap) {
    SamplerOuts o;
    {
      BelowAutograd guard;
      o = kSamplerFwd.in<SamplerFwdSig>(Ns::kOps).call(
          hidden, weight, labels, bias, temperature, temperatures, top_k, top_ks, top_p, top_ps,
          min_p, min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
          with_is_argmax, max_chunk_bytes, logits_dtype, softcap);
    }
    auto& [lp, ent, lse, cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax] = o;
    ctx->save_for_backward({hidden, weight, labels, bias.value_or(Tensor()), lse, ent, cut,
                            cut_index, temperatures.value_or(Tensor())});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["max_chunk_bytes"] = max_chunk_bytes;
    ctx->saved_data["logits_dtype"] = logits_dtype;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["with_entropy"] = with_entropy;
    ctx->mark_non_differentiable(
        {lse, cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax});
    ctx->set_materialize_grads(false);
    return {lp, ent, lse, cut, cut_index, outside, sum_p2, full_lse, top_ids, top_lp, is_argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &hidden = saved[0], &weight = saved[1], &labels = saved[2], &bias = saved[3];
    const Tensor &lse = saved[4], &entropy = saved[5], &cut = saved[6], &cut_index = saved[7];
    const OptTensor temperatures = saved[8].defined() ? OptTensor(saved[8]) : std::nullopt;
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = bias.defined() && ctx->needs_input_grad(3);
    variable_list out(22);  // one per argument of the op
    if (!(need_h || need_w || need_b)) return out;
    const Tensor& grad_lp = grads[0].defined() ? grads[0] : at::zeros_like(lse);
    OptTensor grad_ent;
    if (ctx->saved_data["with_entropy"].toBool() && grads[1].defined()) grad_ent = grads[1];
    const auto softcap = ctx->saved_data["softcap"];
    auto [gh, gW, gb] = kSamplerBwd.in<SamplerBwdSig>(Ns::kOps).call(
        grad_lp, grad_ent, hidden, weight, labels, bias.defined() ? OptTensor(bias) : OptTensor(),
        lse, entropy, cut, cut_index, ctx->saved_data["temperature"].toDouble(), temperatures,
        ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["max_chunk_bytes"].toInt(), need_h,
        need_w, need_b, ctx->saved_data["logits_dtype"].toStringRef(),
        softcap.isNone() ? std::optional<double>() : softcap.toDouble());
    place_head_grads(out, gh, gW, gb, need_h, need_w, need_b, weight, bias);
    return out;
  }
};

SamplerOuts sampler_forward_autograd(
    const Tensor& hidden, const Tensor& weight, const Tensor& labels, const OptTensor& bias,
    double temperature, const OptTensor& temperatures, int64_t top_k, const OptTensor& top_ks,
    double top_p, const OptTensor& top_ps, double min_p, const OptTensor& min_ps,
    c10::string_view sampler, int64_t ignore_index, bool with_entropy, bool with_sum_p2,
    bool with_lse, int64_t stats_top_k, bool with_is_argmax, int64_t max_chunk_bytes,
    const std::string& logits_dtype, std::optional<double> softcap) {
  if (!needs_graph(hidden, weight, labels, bias)) {
    BelowAutograd guard;
    return kSamplerFwd.in<SamplerFwdSig>(Ns::kOps).call(
        hidden, weight, labels, bias, temperature, temperatures, top_k, top_ks, top_p, top_ps,
        min_p, min_ps, sampler, ignore_index, with_entropy, with_sum_p2, with_lse, stats_top_k,
        with_is_argmax, max_chunk_bytes, logits_dtype, softcap);
  }
  auto o = LinearSamplerFn::apply(hidden, weight, labels, bias, temperature, temperatures, top_k,
                                  top_ks, top_p, top_ps, min_p, min_ps, sampler, ignore_index,
                                  with_entropy, with_sum_p2, with_lse, stats_top_k, with_is_argmax,
                                  max_chunk_bytes, logits_dtype, softcap);
  return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.set_python_module("ppo_kernels.linear_logprobs.op");  // the fake kernels
  // hidden [N, H], weight [V, H], labels [N], bias [V]. Returns (logprobs, entropy or an empty
  // tensor, lse) [N], float32 (float64 for float64 input); lse is saved for the backward.
  // max_chunk_bytes 0: the device's default; logits_dtype "float32" or "input"; softcap: Gemma-2
  // style soft-capping of the logits (see ppo_kernels.linear_token_logprobs).
  m.def(
      "linear_token_logprobs(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, "
      "float temperature, int ignore_index, bool with_entropy, int max_chunk_bytes, "
      "str logits_dtype=\"float32\", float? softcap=None) -> (Tensor, Tensor, Tensor)");
  // (grad_hidden, grad_weight float32, grad_bias float32), each an empty tensor when not needed
  m.def(
      "linear_token_logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor hidden, "
      "Tensor weight, Tensor labels, Tensor? bias, Tensor lse, Tensor entropy, float temperature, "
      "int ignore_index, int max_chunk_bytes, bool need_hidden, bool need_weight, bool need_bias, "
      "str logits_dtype=\"float32\", float? softcap=None) -> (Tensor, Tensor, Tensor)");
  // token_logprobs_sampler of hidden @ weight.T + bias: its outputs ((logprobs, entropy or empty,
  // lse of the kept set, cut, cut_index, outside, then the statistics asked for) [N]); a
  // parameter tensor holds per-row values ([N], or 0-dim) and replaces the scalar.
  m.def(
      "linear_token_logprobs_sampler(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, "
      "float temperature, Tensor? temperatures, int top_k, Tensor? top_ks, float top_p, "
      "Tensor? top_ps, float min_p, Tensor? min_ps, str sampler, int ignore_index, "
      "bool with_entropy, bool with_sum_p2, bool with_lse, int stats_top_k, bool with_is_argmax, "
      "int max_chunk_bytes, str logits_dtype, float? softcap) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // gradients through the kept set (cut, cut_index) only
  m.def(
      "linear_token_logprobs_sampler_backward(Tensor grad_logprobs, Tensor? grad_entropy, "
      "Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, Tensor lse, Tensor entropy, "
      "Tensor cut, Tensor cut_index, float temperature, Tensor? temperatures, int ignore_index, "
      "int max_chunk_bytes, bool need_hidden, bool need_weight, bool need_bias, "
      "str logits_dtype, float? softcap) -> (Tensor, Tensor, Tensor)");
}

// One router for every device (route.h: cpu and cuda; others are refused, naming the device).
TORCH_LIBRARY_IMPL(ppo_kernels, CompositeExplicitAutograd, m) {
  m.impl("linear_token_logprobs", &forward);
  m.impl("linear_token_logprobs_backward", &backward);
  m.impl("linear_token_logprobs_sampler", &sampler_forward);
  m.impl("linear_token_logprobs_sampler_backward", &sampler_backward);
}

TORCH_LIBRARY_IMPL(ppo_kernels, Autograd, m) {
  m.impl("linear_token_logprobs", &forward_autograd);
  m.impl("linear_token_logprobs_sampler", &sampler_forward_autograd);
}

// How many forward / backward calls took the one-tile path (tests read it).
TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  m.def("linear_token_logprobs_one_tile_calls() -> int", &one_tile_calls);
}

}  // namespace ppo_kernels
