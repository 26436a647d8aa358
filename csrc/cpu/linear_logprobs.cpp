// linear_token_logprobs: CPU kernels for one vocabulary chunk of a float32 logits tile
// (tile = hidden_chunk @ weight_chunk^T [+ bias], computed by the caller with a BLAS matmul).
// The chunk loop (ppo_kernels/fused_linear/chunks.py) walks the tiles; these kernels only
// reduce them:
//   * linear_logprobs_tile_stats_: merge the tile's softmax stats (m, s, u) into a running per-row
//     state (csrc/common/softmax_stats.h) and pick out the label's logit when it lies in the tile;
//   * linear_logprobs_tile_bwd_: overwrite the tile with d(out)/d(logits) for that chunk, given the
//     final lse / entropy of each row (the gradient is elementwise once those are known).
// When the whole vocabulary fits in one tile the op uses token_logprobs_fwd/bwd instead.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common/cpu_softmax.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {
namespace {

using cpu::block_stats;
using cpu::kBlock;
using cpu::load_scaled;
using cpu::Vec;

void check_tile(const at::Tensor& tile, const at::Tensor& labels) {
  check_arg(tile, "tile", device_of(tile, "tile"), Kind::kFloat32);
  TORCH_CHECK_VALUE(tile.dim() == 2 && (tile.stride(1) == 1 || tile.size(1) <= 1),
                    "tile: expected a float32 (rows, vocab_chunk) tensor with stride(1) == 1, got "
                    "shape ",
                    shape_str(tile.sizes()));
  check_arg(labels, "labels", device_of(tile, "tile"), Kind::kIndex, tile.size(0), "tile.shape[0]");
}

// state: float32 [3, rows] = (m, s, u) of the scaled logits seen so far; zlabel: float32 [rows].
void tile_stats_cpu(const at::Tensor& tile, const at::Tensor& labels_in, int64_t v_start,
                    double inv_temperature, int64_t ignore_index, at::Tensor state,
                    at::Tensor zlabel) {
  check_tile(tile, labels_in);
  const int64_t R = tile.size(0), Vt = tile.size(1), ld = tile.stride(0);
  check_arg(state, "state", device_of(tile, "tile"), Kind::kFloat32, 3 * R, "3 per row");
  TORCH_CHECK_VALUE(state.is_contiguous() && state.dim() == 2 && state.size(0) == 3,
                    "state: expected a contiguous float32 (3, rows) tensor, got shape ",
                    shape_str(state.sizes()));
  check_arg(zlabel, "zlabel", device_of(tile, "tile"), Kind::kFloat32, R, "one per row");
  TORCH_CHECK_VALUE(zlabel.is_contiguous(), "zlabel: expected a contiguous tensor");
  if (R == 0 || Vt == 0) return;
  const at::Tensor labels = labels_in.contiguous();
  const float inv_t = static_cast<float>(inv_temperature);
  AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "linear_logprobs_tile_stats", [&] {
    const float* x = tile.const_data_ptr<float>();
    const index_t* lab = labels.const_data_ptr<index_t>();
    float* sm = state.data_ptr<float>();
    float* ss = sm + R;
    float* su = sm + 2 * R;
    float* zl = zlabel.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, 16384 / Vt);
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      float buf[kBlock];
      for (int64_t r = begin; r < end; ++r) {
        const int64_t label = lab[r];
        if (label == ignore_index) continue;
        const float* row = x + r * ld;
        SoftmaxStats st{sm[r], ss[r], su[r]};
        for (int64_t j = 0; j < Vt; j += kBlock) {
          const int64_t n = std::min(kBlock, Vt - j);
          const float m = load_scaled(row + j, n, inv_t, buf);
          st = stats_merge(st, block_stats(buf, n, m));
        }
        sm[r] = st.m;
        ss[r] = st.s;
        su[r] = st.u;
        const int64_t k = label - v_start;
        if (k >= 0 && k < Vt) zl[r] = row[k] * inv_t;
      }
    });
  });
}

// tile[r, j] <- inv_t * (glp * (onehot - p_j) - gent * p_j * (z_j - lse + H)), p_j = exp(z_j -
// lse), onehot at column label - v_start; rows with label == ignore_index become 0.
void tile_bwd_cpu(at::Tensor tile, const at::Tensor& labels_in, int64_t v_start,
                  const at::Tensor& lse_in, const std::optional<at::Tensor>& entropy,
                  const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                  double inv_temperature, int64_t ignore_index) {
  check_tile(tile, labels_in);
  const int64_t R = tile.size(0), Vt = tile.size(1), ld = tile.stride(0);
  const bool has_ent =
      grad_entropy.has_value() && grad_entropy->defined() && grad_entropy->numel() > 0;
  const DeviceOf dev = device_of(tile, "tile");
  check_arg(lse_in, "lse", dev, Kind::kFloating, R, "one per row");
  check_arg(grad_logprobs, "grad_logprobs", dev, Kind::kFloating, R, "one per row");
  if (has_ent) {
    TORCH_CHECK_VALUE(entropy.has_value() && entropy->defined(),
                      "entropy: grad_entropy needs the forward entropy");
    check_arg(*grad_entropy, "grad_entropy", dev, Kind::kFloating, R, "one per row");
    check_arg(*entropy, "entropy", dev, Kind::kFloating, R, "one per row");
  }
  if (R == 0 || Vt == 0) return;
  const at::Tensor labels = labels_in.contiguous();
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  const at::Tensor glp_t = grad_logprobs.to(at::kFloat).contiguous();
  const at::Tensor gent_t = has_ent ? grad_entropy->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor ent_t = has_ent ? entropy->to(at::kFloat).contiguous() : at::Tensor();
  const float inv_t = static_cast<float>(inv_temperature);
  AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "linear_logprobs_tile_bwd", [&] {
    float* x = tile.data_ptr<float>();
    const index_t* lab = labels.const_data_ptr<index_t>();
    const float* ls = lse.const_data_ptr<float>();
    const float* glp = glp_t.const_data_ptr<float>();
    const float* gent = has_ent ? gent_t.const_data_ptr<float>() : nullptr;
    const float* ent = has_ent ? ent_t.const_data_ptr<float>() : nullptr;
    const int64_t grain = std::max<int64_t>(1, 16384 / Vt);
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* row = x + r * ld;
        const int64_t label = lab[r];
        if (label == ignore_index) {
          std::fill(row, row + Vt, 0.f);
          continue;
        }
        const float l = ls[r];
        const float a = glp[r] * inv_t;
        const float b = gent ? gent[r] * inv_t : 0.f;
        const float c = gent ? ent[r] - l : -l;
        const int64_t k = label - v_start;
        const float zk = (k >= 0 && k < Vt) ? row[k] * inv_t : 0.f;
        const Vec vt(inv_t), vl(l), va(a), vb(b), vc(c), zero(0.f);
        int64_t i = 0;
        for (; i + Vec::size() <= Vt; i += Vec::size()) {
          const Vec z = Vec::loadu(row + i) * vt;
          const Vec p = (z - vl).exp_u20();
          (p * (zero - va - vb * (z + vc))).store(row + i);
        }
        for (; i < Vt; ++i) {
          const float z = row[i] * inv_t;
          const float p = std::exp(z - l);
          row[i] = p * (-a - b * (z + c));
        }
        if (k >= 0 && k < Vt) {
          const float p = std::exp(zk - l);
          row[k] = p * (-a - b * (zk + c)) + a;
        }
      }
    });
  });
}

// acc += x, acc float32, x bf16 / fp16 / float32 of the same shape (both contiguous): the input
// tiles' per-chunk gradient products added into the float32 sums. torch's `acc += x` converts x
// to a float32 temporary first (a pass more over both); here each block is converted as it is
// added. The same bits: float32(x) is exact, one rounding per addition.
void add_into_cpu(at::Tensor acc, const at::Tensor& x) {
  check_arg(acc, "acc", device_of(acc, "acc"), Kind::kFloat32);
  check_arg(x, "x", device_of(acc, "acc"), Kind::kFloating, acc.numel(), "like acc");
  TORCH_CHECK_VALUE(acc.is_contiguous() && x.is_contiguous() && acc.sizes() == x.sizes(),
                    "acc, x: expected contiguous tensors of one shape, got ",
                    shape_str(acc.sizes()), " and ", shape_str(x.sizes()));
  const int64_t n = acc.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_into_", [&] {
    float* a = acc.data_ptr<float>();
    const scalar_t* b = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, n, kBlock * 16, [&](int64_t begin, int64_t end) {
      float buf[kBlock];
      for (int64_t i = begin; i < end; i += kBlock) {
        const int64_t len = std::min(kBlock, end - i);
        cpu::to_float(b + i, buf, len);
        int64_t j = 0;
        for (; j + Vec::size() <= len; j += Vec::size())
          (Vec::loadu(a + i + j) + Vec::loadu(buf + j)).store(a + i + j);
        for (; j < len; ++j) a[i + j] += buf[j];
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // acc += x into a float32 accumulator (x: bf16 / fp16 / float32, converted as it is added)
  m.def("accumulate_(Tensor(a!) acc, Tensor x) -> ()");
  m.def(
      "linear_logprobs_tile_stats_(Tensor tile, Tensor labels, int v_start, float inv_temperature, "
      "int ignore_index, Tensor(a!) state, Tensor(b!) zlabel) -> ()");
  m.def(
      "linear_logprobs_tile_bwd_(Tensor(a!) tile, Tensor labels, int v_start, Tensor lse, "
      "Tensor? entropy, Tensor grad_logprobs, Tensor? grad_entropy, float inv_temperature, "
      "int ignore_index) -> ()");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("linear_logprobs_tile_stats_", &tile_stats_cpu);
  m.impl("linear_logprobs_tile_bwd_", &tile_bwd_cpu);
  m.impl("accumulate_", &add_into_cpu);
}

}  // namespace ppo_kernels
