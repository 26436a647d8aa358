// masked_mean / masked_whiten: CPU kernels (forward and backward) and the schemas of the raw
// kernels. Semantics: ppo_kernels/masked_stats/op.py (the eager implementations, and the float64
// reference: float64 inputs never reach these kernels).
//
// Accumulation is in double. For float32 / bfloat16 / float16 inputs (|x| < 2^128, weights the
// float mask's values rounded to float32) no sum, sum of squares or product of them can overflow
// (2^128 * 2^258 * 2^63 elements < 2^1023), so unlike the eager float32 code no power-of-two
// scaling pass is needed, and the two passes (mean, then squared deviations, corrected by the
// rounding of the mean: Chan, Golub & LeVeque) are exact to the float32 output. Elements are cut
// into fixed chunks summed in chunk order: the same result for any thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "common/alloc.h"
#include "common/tensor_checks.h"

namespace ppo_kernels {
namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per parallel work item
constexpr int64_t kBlock = 512;      // elements staged as float32 (in L1) at a time

// A mask element: selected when != 0; its weight is its value (in float32, as the eager code's
// mask.to(float32)) for a float mask, 1 otherwise. (bool masks are read as uint8.)
template <typename mask_t>
inline bool selected(mask_t v) {
  return v != mask_t(0);
}
template <typename mask_t>
inline float weight(mask_t v) {
  if constexpr (std::is_floating_point_v<mask_t> || std::is_same_v<mask_t, at::BFloat16> ||
                std::is_same_v<mask_t, at::Half>)
    return static_cast<float>(v);
  else
    return 1.f;
}

// v where keep is all ones, +0 where it is 0: a select without a branch or a masked load (both
// operands are always read), which the compiler vectorises.
inline float keep_if(float v, uint32_t keep) {
  return c10::bit_cast<float>(c10::bit_cast<uint32_t>(v) & keep);
}
template <typename mask_t>
inline uint32_t keep_bits(mask_t v) {
  return 0u - static_cast<uint32_t>(selected(v));
}

// Stages n elements as float32: xs = x and ws = the weight where selected, both 0 elsewhere (so
// a masked-out NaN never reaches a sum, and the loops that follow need no mask).
template <typename x_t, typename mask_t>
inline void stage(const x_t* x, const mask_t* mk, int64_t n, float* xs, float* ws) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t keep = keep_bits(mk[i]);
    xs[i] = keep_if(static_cast<float>(x[i]), keep);
    ws[i] = keep_if(weight(mk[i]), keep);
  }
}

template <typename x_t>
inline const float* as_float(const x_t* x, int64_t n, float* buf) {
  if constexpr (std::is_same_v<x_t, float>) {
    return x;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(x[i]);
    return buf;
  }
}

// Weighted moments of a set about a centre k: n = sum w, l = sum w (x - k), q = sum w (x - k)^2.
struct Moments {
  double n = 0, k = 0, l = 0, q = 0;
  double mean() const { return n != 0 ? k + l / n : k; }
  // the same set about a new centre (exact in real arithmetic)
  Moments about(double k2) const {
    const double d = k - k2;
    return {n, k2, l + d * n, q + 2 * d * l + d * d * n};
  }
  // Adds set o, both about their combined mean (Chan et al.'s update: with each set about its
  // own mean, l ~ 0, every term added is >= 0 for non-negative weights: nothing cancels).
  void merge(const Moments& o) {
    const double tot = n + o.n;
    const double k2 = tot != 0 ? (n * mean() + o.n * o.mean()) / tot : k;
    const Moments a = about(k2), b = o.about(k2);
    *this = {tot, k2, a.l + b.l, a.q + b.q};
  }
};

// (sum w, sum w x) of a staged block
inline void add_w_wx(const float* xs, const float* ws, int64_t n, double* acc) {
  double a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
  for (int64_t i = 0; i < n; ++i) {
    const double w = ws[i];
    a += w;
    b += w * xs[i];
  }
  acc[0] += a, acc[1] += b;
}

// (sum w, sum w x) of [0, n) read in place: a float32 x with a float32 mask (no staging pass)
inline void add_w_wx(const float* x, const float* mk, int64_t n, double* acc, std::true_type) {
  double a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t keep = keep_bits(mk[i]);
    const double w = keep_if(mk[i], keep);
    a += w;
    b += w * keep_if(x[i], keep);
  }
  acc[0] += a, acc[1] += b;
}

// The moments of a staged block about its own mean: two passes over L1.
inline Moments block_moments(const float* xs, const float* ws, int64_t n) {
  double s[2] = {0, 0};
  add_w_wx(xs, ws, n, s);
  Moments m;
  m.n = s[0];
  m.k = s[0] != 0 ? s[1] / s[0] : 0.0;
  const double k = m.k;
  double l = 0, q = 0;
#pragma omp simd reduction(+ : l, q)
  for (int64_t i = 0; i < n; ++i) {  // w = 0 (and xs = 0) off the selection: adds 0
    const double w = ws[i], d = xs[i] - k;
    l += w * d;
    q += w * d * d;
  }
  m.l = l, m.q = q;
  return m;
}

// f(lo, hi, chunk) over fixed chunks of [0, N) in parallel (a chunk's index: results can be
// combined in chunk order, the same for any thread count).
template <typename F>
void for_chunks(int64_t N, F f) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) f(c * kChunk, std::min(N, (c + 1) * kChunk), c);
  });
}

// (sum w, sum w x) over the selected elements of [lo, hi)
template <typename x_t, typename mask_t>
std::array<double, 2> first_moment(const x_t* x, const mask_t* mk, int64_t lo, int64_t hi) {
  double acc[2] = {0, 0};
  if constexpr (std::is_same_v<x_t, float> && std::is_same_v<mask_t, float>) {
    add_w_wx(x + lo, mk + lo, hi - lo, acc, std::true_type());
  } else {
    for (int64_t i = lo; i < hi; i += kBlock) {
      const int64_t n = std::min(kBlock, hi - i);
      float xs[kBlock], ws[kBlock];
      stage(x + i, mk + i, n, xs, ws);
      add_w_wx(xs, ws, n, acc);
    }
  }
  return {acc[0], acc[1]};
}

// The statistics of masked_whiten (see ppo_kernels/masked_stats/op.py): n the total weight,
// den = n (1 when n = 0), mean = sum w x / den, var = sum w (x - mean)^2 / den (times the Bessel
// factor n / (n - 1) when unbiased: NaN for n = 0 or 1), d_sum = sum w (x - mean). One pass over
// memory: per block of kBlock elements the two-pass moments about the block's mean (in L1),
// merged in block and chunk order.
struct WhitenStats {
  double n, den, mean, var, d_sum, bessel;
};

template <typename x_t, typename mask_t>
WhitenStats whiten_stats(const x_t* x, const mask_t* mk, int64_t N, bool unbiased) {
  std::vector<Moments> part(std::max<int64_t>(1, (N + kChunk - 1) / kChunk));
  for_chunks(N, [&](int64_t lo, int64_t hi, int64_t c) {
    Moments acc;
    for (int64_t i = lo; i < hi; i += kBlock) {
      const int64_t n = std::min(kBlock, hi - i);
      float xs[kBlock], ws[kBlock];
      stage(x + i, mk + i, n, xs, ws);
      acc.merge(block_moments(xs, ws, n));
    }
    part[c] = acc;
  });
  Moments tot;
  for (const Moments& m : part) tot.merge(m);
  WhitenStats st{};
  st.n = tot.n;
  st.den = st.n != 0 ? st.n : 1.0;
  st.mean = tot.n != 0 ? tot.mean() : tot.l + tot.k * tot.n;  // n = 0: sum w x (over den = 1)
  const Moments c = tot.about(st.mean);
  st.d_sum = c.l;  // 0 in real arithmetic when n != 0
  st.bessel = !unbiased                  ? 1.0
              : (st.n != 0 && st.n != 1) ? st.n / (st.n - 1)
                                         : std::numeric_limits<double>::quiet_NaN();
  st.var = c.q / st.den * st.bessel;
  return st;
}

template <typename F>
void dispatch_x(const at::Tensor& x, const char* name, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return f(float());
    case at::kBFloat16:
      return f(at::BFloat16());
    case at::kHalf:
      return f(at::Half());
    default:
      TORCH_CHECK_TYPE(false, name, ": dtype ", x.scalar_type(),
                       " is not supported by the cpp kernel (float32, bfloat16, float16; float64 "
                       "runs the eager implementation)");
  }
}

template <typename F>
void dispatch_mask(const at::Tensor& m, F&& f) {
  switch (m.scalar_type()) {
    case at::kBool:  // read as bytes (0 / 1): the vectoriser has no bool lanes
      return f(uint8_t());
    case at::kByte:
      return f(uint8_t());
    case at::kChar:
      return f(int8_t());
    case at::kShort:
      return f(int16_t());
    case at::kInt:
      return f(int32_t());
    case at::kLong:
      return f(int64_t());
    case at::kFloat:
      return f(float());
    case at::kDouble:
      return f(double());
    case at::kBFloat16:
      return f(at::BFloat16());
    case at::kHalf:
      return f(at::Half());
    default:
      TORCH_CHECK_TYPE(false, "mask: dtype ", m.scalar_type(),
                       " is not supported (expected bool, an integer or a float dtype)");
  }
}

// x and mask (and the backward's grad) on one device, the CPU (this kernel's).
void check_x_mask(const at::Tensor& x, const at::Tensor& mask, const at::Tensor* grad = nullptr) {
  const DeviceOf dev = device_of(x, "x");
  check_arg(x, "x", dev);
  check_arg(mask, "mask", dev);
  if (grad) check_arg(*grad, "grad", dev, Kind::kFloating);
  TORCH_CHECK_VALUE(x.is_cpu(), "x: the cpp kernel runs CPU tensors, got ", x.device());
  TORCH_CHECK_VALUE(mask.sizes() == x.sizes(), "mask: expected shape ", shape_str(x.sizes()),
                    " (like x), got ", shape_str(mask.sizes()));
}

bool empty_is_nan(const std::string& empty) {
  TORCH_CHECK_VALUE(empty == "zero" || empty == "nan", "empty: expected 'zero' or 'nan', got '",
                    empty, "'");
  return empty == "nan";
}

// The reduction of masked_mean as rows: x viewed as [R, L] with the reduced dims last
// (permuted there and made contiguous when they are not), and the output's shape.
struct Rows {
  at::Tensor x, mask;
  int64_t R, L;
  std::vector<int64_t> out_shape;
  std::vector<int64_t> perm;  // empty: no permutation
};

Rows as_rows(const at::Tensor& x, const at::Tensor& mask, at::OptionalIntArrayRef dim) {
  const int64_t nd = x.dim();
  std::vector<bool> reduced(nd, false);
  // as torch's sum: an empty list reduces everything, and a 0-dim x takes dim 0 / -1
  if (!dim.has_value() || dim->empty() || nd == 0) {
    reduced.assign(nd, true);
  } else {
    for (const int64_t d : *dim) {
      TORCH_CHECK_INDEX(d >= -nd && d < nd, "dim: ", d, " is out of range for a tensor of ", nd,
                        " dimensions");
      const int64_t w = d < 0 ? d + nd : d;
      TORCH_CHECK_VALUE(!reduced[w], "dim: dimension ", w, " appears twice");
      reduced[w] = true;
    }
  }
  Rows r;
  std::vector<int64_t> kept, red;
  for (int64_t d = 0; d < nd; ++d) (reduced[d] ? red : kept).push_back(d);
  r.R = 1;
  r.L = 1;
  for (int64_t d : kept) r.out_shape.push_back(x.size(d)), r.R *= x.size(d);
  for (int64_t d : red) r.L *= x.size(d);
  bool suffix = true;
  for (size_t k = 0; k < kept.size(); ++k) suffix &= kept[k] == static_cast<int64_t>(k);
  if (suffix) {
    r.x = x.contiguous();
    r.mask = mask.contiguous();
  } else {
    r.perm = kept;
    r.perm.insert(r.perm.end(), red.begin(), red.end());
    r.x = x.permute(r.perm).contiguous();
    r.mask = mask.permute(r.perm).contiguous();
  }
  return r;
}

// f(row, lo, hi) over pieces [lo, hi) of the rows' elements, in parallel.
template <typename F>
void for_rows(const Rows& r, F f) {
  if (r.R == 1) {
    at::parallel_for(0, r.L, kChunk, [&](int64_t lo, int64_t hi) { f(0, lo, hi); });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kChunk / std::max<int64_t>(1, r.L));
  at::parallel_for(0, r.R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) f(row, row * r.L, (row + 1) * r.L);
  });
}

// Per row: (n, sum w x) -- one row in chunks across threads, many rows a row per work item.
template <typename x_t, typename mask_t>
void row_sums(const Rows& r, std::vector<double>& n, std::vector<double>& s) {
  const x_t* x = r.x.const_data_ptr<x_t>();
  const mask_t* mk = static_cast<const mask_t*>(r.mask.const_data_ptr());
  n.assign(r.R, 0.0);
  s.assign(r.R, 0.0);
  if (r.R == 1) {  // chunks across threads, added in chunk order
    std::vector<std::array<double, 2>> part(std::max<int64_t>(1, (r.L + kChunk - 1) / kChunk));
    for_chunks(r.L,
               [&](int64_t lo, int64_t hi, int64_t c) { part[c] = first_moment(x, mk, lo, hi); });
    for (const auto& p : part) n[0] += p[0], s[0] += p[1];
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kChunk / std::max<int64_t>(1, r.L));
  at::parallel_for(0, r.R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const auto t = first_moment(x, mk, row * r.L, (row + 1) * r.L);
      n[row] = t[0], s[row] = t[1];
    }
  });
}

at::Tensor masked_mean_fwd_cpu(const at::Tensor& x_in, const at::Tensor& mask_in,
                               at::OptionalIntArrayRef dim, const std::string& empty) {
  check_x_mask(x_in, mask_in);
  const bool nan_empty = empty_is_nan(empty);
  const Rows r = as_rows(x_in, mask_in, dim);
  at::Tensor out = new_output(r.out_shape, x_in.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  dispatch_x(x_in, "x", [&](auto xv) {
    using x_t = decltype(xv);
    dispatch_mask(r.mask, [&](auto mv) {
      using mask_t = decltype(mv);
      std::vector<double> n, s;
      row_sums<x_t, mask_t>(r, n, s);
      for (int64_t i = 0; i < r.R; ++i)
        o[i] = static_cast<float>(n[i] != 0 || nan_empty ? s[i] / n[i] : 0.0);
    });
  });
  return out;
}

// d mean / d x: w / n on the selected elements (0 elsewhere, and everywhere in a row of total
// weight 0 when empty = "zero"; w / 0 there with "nan", as the eager s / n).
at::Tensor masked_mean_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& x_in,
                               const at::Tensor& mask_in, at::OptionalIntArrayRef dim,
                               const std::string& empty) {
  check_x_mask(x_in, mask_in, &grad_in);
  const bool nan_empty = empty_is_nan(empty);
  const Rows r = as_rows(x_in, mask_in, dim);
  check_arg(grad_in, "grad", device_of(x_in, "x"), Kind::kFloating, r.R, "one per output element");
  const at::Tensor g = grad_in.to(at::kDouble).contiguous();
  const double* gp = g.const_data_ptr<double>();
  at::Tensor grad = new_output(r.x.sizes(), x_in.options());
  dispatch_x(x_in, "x", [&](auto xv) {
    using x_t = decltype(xv);
    dispatch_mask(r.mask, [&](auto mv) {
      using mask_t = decltype(mv);
      std::vector<double> n, s;
      row_sums<x_t, mask_t>(r, n, s);
      std::vector<double> coef(r.R);
      for (int64_t i = 0; i < r.R; ++i) coef[i] = n[i] != 0 || nan_empty ? gp[i] / n[i] : 0.0;
      const mask_t* mk = static_cast<const mask_t*>(r.mask.const_data_ptr());
      x_t* gx = grad.data_ptr<x_t>();
      for_rows(r, [&](int64_t row, int64_t lo, int64_t hi) {
        const double c = coef[row];
        for (int64_t i = lo; i < hi; ++i)
          gx[i] = static_cast<x_t>(selected(mk[i]) ? c * weight(mk[i]) : 0.f);
      });
    });
  });
  if (r.perm.empty()) return grad.view(x_in.sizes());
  std::vector<int64_t> inv(r.perm.size());
  for (size_t k = 0; k < r.perm.size(); ++k) inv[r.perm[k]] = static_cast<int64_t>(k);
  return grad.permute(inv).contiguous();
}

at::Tensor masked_whiten_fwd_cpu(const at::Tensor& x_in, const at::Tensor& mask_in, bool shift_mean,
                                 bool unbiased, double eps) {
  check_x_mask(x_in, mask_in);
  TORCH_CHECK_VALUE(eps >= 0, "eps: expected a non-negative number, got ", eps);
  const at::Tensor x = x_in.contiguous(), mask = mask_in.contiguous();
  const int64_t N = x.numel();
  at::Tensor out = new_output(x.sizes(), x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  dispatch_x(x, "x", [&](auto xv) {
    using x_t = decltype(xv);
    dispatch_mask(mask, [&](auto mv) {
      using mask_t = decltype(mv);
      const x_t* xp = x.const_data_ptr<x_t>();
      const WhitenStats st =
          whiten_stats(xp, static_cast<const mask_t*>(mask.const_data_ptr()), N, unbiased);
      const double inv = 1.0 / std::sqrt(st.var + eps), mean = st.mean;
      const double add = shift_mean ? 0.0 : mean;
      at::parallel_for(0, N, kChunk, [&](int64_t lo, int64_t hi) {
        float buf[kBlock];
        for (int64_t b = lo; b < hi; b += kBlock) {
          const int64_t n = std::min(kBlock, hi - b);
          const float* xf = as_float(xp + b, n, buf);
          float* ob = o + b;
#pragma omp simd
          for (int64_t i = 0; i < n; ++i)
            ob[i] = static_cast<float>((static_cast<double>(xf[i]) - mean) * inv + add);
        }
      });
    });
  });
  return out;
}

// out = d / sigma (+ mean), d = x - mean, sigma = sqrt(var + eps): with G = sum g, H = sum g d
// (every element: all are whitened) and D = sum w d over the selection,
//   dx_j = g_j / sigma + w_j / den * (-G / sigma + [!shift_mean] G
//                                      - bessel * H / sigma^3 * (d_j - D / den)).
at::Tensor masked_whiten_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& x_in,
                                 const at::Tensor& mask_in, bool shift_mean, bool unbiased,
                                 double eps) {
  check_x_mask(x_in, mask_in, &grad_in);
  check_arg(grad_in, "grad", device_of(x_in, "x"), Kind::kFloating, x_in.numel(), "like x");
  TORCH_CHECK_VALUE(eps >= 0, "eps: expected a non-negative number, got ", eps);
  const at::Tensor x = x_in.contiguous(), mask = mask_in.contiguous();
  const at::Tensor g = grad_in.to(at::kFloat).contiguous();
  const int64_t N = x.numel();
  at::Tensor grad = new_output(x.sizes(), x.options());
  const float* gp = g.const_data_ptr<float>();
  dispatch_x(x, "x", [&](auto xv) {
    using x_t = decltype(xv);
    dispatch_mask(mask, [&](auto mv) {
      using mask_t = decltype(mv);
      const x_t* xp = x.const_data_ptr<x_t>();
      const mask_t* mk = static_cast<const mask_t*>(mask.const_data_ptr());
      const WhitenStats st = whiten_stats(xp, mk, N, unbiased);
      const double mean = st.mean;
      // G = sum g, H = sum g (x - mean) over every element, in chunk order
      std::vector<std::array<double, 2>> gh_part(std::max<int64_t>(1, (N + kChunk - 1) / kChunk));
      for_chunks(N, [&](int64_t lo, int64_t hi, int64_t c) {
        double a = 0, b = 0;
        for (int64_t i = lo; i < hi; i += kBlock) {
          const int64_t n = std::min(kBlock, hi - i);
          float buf[kBlock];
          const float* xf = as_float(xp + i, n, buf);
          const float* g = gp + i;
          double ab = 0, bb = 0;
#pragma omp simd reduction(+ : ab, bb)
          for (int64_t k = 0; k < n; ++k) {
            const double gk = g[k];
            ab += gk;
            bb += gk * (xf[k] - mean);
          }
          a += ab, b += bb;
        }
        gh_part[c] = {a, b};
      });
      double gh[2] = {0, 0};
      for (const auto& p : gh_part) gh[0] += p[0], gh[1] += p[1];
      const double sigma = std::sqrt(st.var + eps), inv = 1.0 / sigma;
      // per selected element, times w_j / den: a - b (d_j - D / den)
      const double a = (shift_mean ? 0.0 : gh[0]) - gh[0] * inv;
      const double b = st.bessel * gh[1] * inv * inv * inv;
      const double c = mean + st.d_sum / st.den, inv_den = 1.0 / st.den;
      x_t* gx = grad.data_ptr<x_t>();
      at::parallel_for(0, N, kChunk, [&](int64_t lo, int64_t hi) {
        float xs[kBlock], ws[kBlock], out[kBlock];
        for (int64_t i = lo; i < hi; i += kBlock) {
          const int64_t n = std::min(kBlock, hi - i);
          stage(xp + i, mk + i, n, xs, ws);
          const float* g = gp + i;
#pragma omp simd
          for (int64_t k = 0; k < n; ++k)  // ws = 0 off the selection
            out[k] = static_cast<float>(g[k] * inv + ws[k] * inv_den * (a - b * (xs[k] - c)));
          for (int64_t k = 0; k < n; ++k) gx[i + k] = static_cast<x_t>(out[k]);
        }
      });
    });
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ppo_kernels_C, m) {
  // x float32 / bfloat16 / float16 (CPU), mask like x (bool, integer or float: a float mask
  // weights), dim None / [] = everything; empty "zero" or "nan". Returns float32.
  m.def("masked_mean_fwd(Tensor x, Tensor mask, int[]? dim, str empty) -> Tensor");
  // d x (x's dtype) from the gradient of the output
  m.def(
      "masked_mean_bwd(Tensor grad, Tensor x, Tensor mask, int[]? dim, str empty) -> "
      "Tensor");
  m.def(
      "masked_whiten_fwd(Tensor x, Tensor mask, bool shift_mean, bool unbiased, float eps) -> "
      "Tensor");
  m.def(
      "masked_whiten_bwd(Tensor grad, Tensor x, Tensor mask, bool shift_mean, bool unbiased, "
      "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(ppo_kernels_C, CPU, m) {
  m.impl("masked_mean_fwd", &masked_mean_fwd_cpu);
  m.impl("masked_mean_bwd", &masked_mean_bwd_cpu);
  m.impl("masked_whiten_fwd", &masked_whiten_fwd_cpu);
  m.impl("masked_whiten_bwd", &masked_whiten_bwd_cpu);
}

}  // namespace ppo_kernels
