// One row of token_logprobs under the sampler's distribution on the CPU (rules:
// common/sampler_rules.h; semantics: docs/ppo-math.md), and the head's statistics: the per-row
// kernels csrc/cpu/token_logprobs_sampler.cpp loops over, written for any row of a [rows, V] tile
// (the fused-linear engine's whole-vocabulary tiles too).
//
// The kept set is found by selection, not by sorting the row:
//   1. the softmax statistics pass (as the plain kernel's, memory-bound);
//   2. a sample of 1024 tokens gives bounds around each boundary (the k-th token, the top-p mass
//      crossing): theta_lo below the final cut, theta_hi above it, in nd = z - max z;
//   3. one vectorised pass over the (now cache-resident) row: tokens above theta_hi are summed
//      (count, mass, mass * nd, mass^2), tokens in [theta_lo, theta_hi] are collected into the
//      band, the rest (below every cut) skipped;
//   4. the band is bucketed by nd (a counting sort), and only the buckets a boundary falls in are
//      sorted; the rules walk the band in rank order from the sums above it.
// The bounds are estimates, each checked exactly in step 4 (the k-th token and the mass crossing
// must lie in the band); when one does not hold, step 3 runs again with the bounds that always
// hold (theta_hi = +inf, theta_lo = the min-p bound or -inf). The result is exact either way.
// Top-k up to kCollectTopK (with or without the other truncations) and the top ids skip steps 2, 3:
// every token they keep lies among the k largest, which the statistics pass collects (the tokens
// at or above a sure bound on the k-th largest, raised as it reads the row: TopCollector), and the
// walk of step 4 runs over them.
// Top-p without top-k or the top ids (the costly case: its cut may keep a large part of a flat row)
// takes a histogram path instead: the statistics pass keeps each token's mass (and a sample of the
// row); without the entropy or min-p, top_p_masses reads those masses alone (not the row): the
// ones above a band around the sample's estimate of the cut are summed, the band's bucketed;
// else (or when the estimate missed) top_p_hist buckets the masses of every candidate by nd. Only
// the bucket where the mass crosses top-p's target is sorted (steps 2-4 are their fallback).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/cpu_rows.h"
#include "common/cpu_softmax.h"
#include "common/sampler_rules.h"

namespace ppo_kernels {
namespace cpu {

// One row's parameters and what it asks for.
struct SamplerRowArgs {
  float inv_t;
  int64_t top_k;  // 0 / >= V: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  bool sglang;
  bool with_sum_p2;
  bool with_is_argmax;
  int64_t stats_top_k;  // top ids wanted (0: none)
  bool with_entropy = true;
};

struct SamplerRowOut {
  float lp, ent, lse;  // lse of the kept set
  float cut;
  int64_t cut_index;
  bool outside;
  float sum_p2, full_lse;
  bool is_argmax;
};

// A token of the band: its logit, nd = z - max z and exp(nd) (in T), its index.
template <typename T>
struct BandItem {
  float x;
  T nd, e;
  int32_t j;
};

// The rank order: larger logit first, ties by smaller index.
template <typename T>
inline bool rank_before(const BandItem<T>& a, const BandItem<T>& b) {
  return a.x > b.x || (a.x == b.x && a.j < b.j);
}

// Sums over a set of tokens: count, mass, mass * nd (entropy), mass^2 (sum_p2), smallest logit.
template <typename T>
struct MassSums {
  int64_t n = 0;
  T s = 0, u = 0, e2 = 0;
  float xmin = INFINITY;
  void add(T e, T nd, float x) {
    ++n;
    s += e;
    u += e > 0 ? e * nd : T(0);
    e2 += e * e;
    xmin = std::min(xmin, x);
  }
};

// The band in rank order: bucketed by nd (a counting sort), each bucket sorted on first use.
template <typename T>
class RankedBand {
 public:
  void build(const std::vector<BandItem<T>>& in) {
    const int64_t n = static_cast<int64_t>(in.size());
    items_.resize(n);
    nb_ = std::max<int64_t>(1, std::min<int64_t>(8192, n / 2));
    T hi = -INFINITY, lo = INFINITY;
    for (const auto& it : in) {
      hi = std::max(hi, it.nd);
      if (it.nd > -INFINITY) lo = std::min(lo, it.nd);
    }
    hi_ = hi;
    scale_ = (n > 0 && hi > lo) ? T(nb_ - 1) / (hi - lo) : T(0);
    start_.assign(nb_ + 1, 0);
    mass_.assign(nb_ + 1, T(0));  // mass_[b]: the mass of buckets < b (after the prefix sum)
    sorted_.assign(nb_, 0);
    for (const auto& it : in) ++start_[bucket(it.nd) + 1];
    for (int64_t b = 0; b < nb_; ++b) start_[b + 1] += start_[b];
    std::vector<int64_t> fill(start_.begin(), start_.end() - 1);
    for (const auto& it : in) {
      const int64_t b = bucket(it.nd);
      items_[fill[b]++] = it;
      mass_[b + 1] += it.e;
    }
    for (int64_t b = 0; b < nb_; ++b) mass_[b + 1] += mass_[b];
  }
  int64_t size() const { return static_cast<int64_t>(items_.size()); }
  // The item at position pos, its bucket not sorted (for sums over whole buckets).
  const BandItem<T>& raw(int64_t pos) const { return items_[pos]; }
  // The item at rank position pos (its bucket sorted first).
  const BandItem<T>& at(int64_t pos) {
    sort_bucket(bucket_of(pos));
    return items_[pos];
  }
  // The bucket holding rank position pos.
  int64_t bucket_of(int64_t pos) const {
    return std::upper_bound(start_.begin(), start_.end(), pos) - start_.begin() - 1;
  }
  int64_t begin_of(int64_t b) const { return start_[b]; }
  T mass_before(int64_t b) const { return mass_[b]; }
  int64_t buckets() const { return nb_; }
  // The number of leading items with nd >= bound (a prefix: nd falls along the rank order).
  int64_t count_at_least(T bound) {
    int64_t lo = 0, hi = size();
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (at(mid).nd >= bound) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  }
  // The first bucket whose end mass (mass of buckets <= b) is at least / more than `target`
  // (strict), or nb_ when none.
  int64_t first_bucket_reaching(T target, bool strict) const {
    for (int64_t b = 0; b < nb_; ++b) {
      const T m = mass_[b + 1];
      if (strict ? m > target : m >= target) return b;
    }
    return nb_;
  }

 private:
  int64_t bucket(T nd) const {
    const T f = std::min<T>((hi_ - nd) * scale_, T(nb_ - 1));
    return f > 0 ? static_cast<int64_t>(f) : 0;
  }
  void sort_bucket(int64_t b) {
    if (sorted_[b]) return;
    std::sort(items_.begin() + start_[b], items_.begin() + start_[b + 1], rank_before<T>);
    sorted_[b] = 1;
  }
  std::vector<BandItem<T>> items_;
  std::vector<int64_t> start_;
  std::vector<T> mass_;
  std::vector<uint8_t> sorted_;
  int64_t nb_ = 1;
  T hi_ = 0, scale_ = 0;
};

// Per-thread buffers, reused across rows.
constexpr int64_t kChunk = 1024;  // top_p_hist's candidates added to their buckets at a time

struct SamplerWorkspace {
  std::vector<BandItem<float>> band;
  std::vector<BandItem<double>> band64;
  RankedBand<float> ranked;
  RankedBand<double> ranked64;
  std::vector<float> sample_nd, sample_e;
  std::vector<int32_t> sample_j;
  std::vector<double> hs, hu, he2;      // the top-p histograms' buckets: mass, mass * nd, mass^2
  std::vector<float> mass;              // top_p_hist's masses of the row (V floats: 4 B x V)
  std::vector<float> mass_mb, mass_cb;  // its block maxima, exp(m_b - m) (V / kBlock floats)
  std::vector<int32_t> band_j, band_b;  // top_p_masses' band: indices, buckets, masses
  std::vector<float> band_e;
  alignas(32) int32_t chunk_b[kChunk + 16];  // its candidates' buckets and masses (+ a vector)
  alignas(32) float chunk_e[kChunk + 16];
  alignas(32) float chunk_nd[kChunk + 16];
  float buf[kBlock];
};

// a & ~b on comparison masks.
inline Vec andnot(Vec a, Vec b) {
#if defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_andnot_ps(__m256(b), __m256(a)));
#else
  return a & ~b;
#endif
}

// max(a, b) in one instruction, where NaN need not propagate.
inline Vec fast_max(Vec a, Vec b) {
#if defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_max_ps(__m256(a), __m256(b)));
#else
  return at::vec::maximum(a, b);
#endif
}

// The lanes of a comparison mask as bits.
inline int mask_bits(Vec m) {
#if defined(CPU_CAPABILITY_AVX2)
  return _mm256_movemask_ps(__m256(m));
#else
  float t[Vec::size()];
  m.store(t);
  int bits = 0;
  for (int i = 0; i < Vec::size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &t[i], 4);
    bits |= (u >> 31) << i;
  }
  return bits;
#endif
}

// The statistics pass: softmax stats of z = x * inv_t (as row_logprob's) and, when asked, the
// sum of exp(2 nd) (relative to the final max), in the same loop over each L1-resident block.
struct RowStatsExt {
  SoftmaxStats st;
  float e2;  // sum exp(2 (z_j - st.m))
};

// block_stats with sum exp(2 (z - m)) too (one exp per value).
inline SoftmaxStats block_stats_e2(const float* z, int64_t n, float m, float& e2) {
  e2 = 0.f;
  if (m == -INFINITY) return stats_empty();
  if (m == INFINITY || m != m) return {m, NAN, NAN};
  const Vec vm(m), floor_(-FLT_MAX);
  Vec vs(0.f), vu(0.f), v2(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec d = Vec::loadu(z + i) - vm;
    const Vec e = d.exp_u20();
    vs = vs + e;
    vu = at::vec::fmadd(e, at::vec::clamp_min(d, floor_), vu);
    v2 = at::vec::fmadd(e, e, v2);
  }
  const auto sum = [](Vec v) {
    return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v);
  };
  float s = sum(vs), u = sum(vu);
  e2 = sum(v2);
  for (; i < n; ++i) {
    const float d = z[i] - m;
    const float e = std::exp(d);
    s += e;
    u += weighted_offset(e, d);
    e2 += e * e;
  }
  return {m, s, u};
}

// The top ids' candidates, collected in the statistics pass: every token whose scaled logit z is
// at least zb, a sure bound on the k-th largest (at least k tokens of the row are at or above it),
// raised as the pass goes: once the band holds more than `limit` tokens, the k-th largest logit
// among them becomes the bound and the tokens below it are dropped (ties kept). A row in random
// order then collects about k ln(V / k) tokens. The first bound comes from the first block (any
// part of the row gives a sure bound), in L1: split into k runs, the smallest of their maxima (at
// least k tokens, one a run, are at or above it); with runs of fewer than 64 tokens (large k),
// the k-th largest of its first 256 tokens.
struct TopCollector {
  std::vector<BandItem<float>>& band;
  std::vector<float>& tmp;  // the selections' scratch
  float inv_t;
  int64_t k;
  size_t limit;
  float zb = -INFINITY;  // (-inf until the first block sets it)
  bool bound_set = false;

  // A block of the row loaded into buf (load_scaled's values and max, returned) and its tokens
  // with z >= zb collected, with their logit and index (nd and mass are filled in once the row's
  // max is known). The first block sets the bound and is then scanned in buf. Later blocks'
  // tokens are checked while each group of four vectors is still in registers, behind one
  // comparison of their max (most groups hold none once the bound rose): load_scaled's loop with
  // that check inside, as a hook called per vector measured slower (bf16 most). (A row holding a
  // NaN takes the float64 path, which never reads the band.)
  template <typename scalar_t>
  float load_and_add(const scalar_t* x, int64_t n, float inv_t, float* buf, int64_t j0) {
    const auto push = [&](int64_t t) {
      band.push_back({static_cast<float>(x[t]), 0.f, 0.f, static_cast<int32_t>(j0 + t)});
    };
    if (!bound_set) {
      const float m = load_scaled(x, n, inv_t, buf);
      zb = first_bound(buf, n);
      bound_set = true;
      const Vec vb(zb);
      int64_t i = 0;
      for (; i + Vec::size() <= n; i += Vec::size()) take(Vec::loadu(buf + i), vb, i, push);
      for (; i < n; ++i)
        if (buf[i] >= zb) push(i);
      if (band.size() > limit) raise();
      return m;
    }
    const Vec vt(inv_t), vb(zb);
    Vec vmax(-INFINITY);
    constexpr int64_t W = 4 * Vec::size();
    int64_t i = 0;
    if constexpr (std::is_same_v<scalar_t, float> || c10::is_reduced_floating_point_v<scalar_t>) {
      for (; i + W <= n; i += W) {
        Vec z[4];
        if constexpr (std::is_same_v<scalar_t, float>) {
          for (int q = 0; q < 4; ++q) z[q] = Vec::loadu(x + i + q * Vec::size());
        } else {
          using bVec = at::vec::Vectorized<scalar_t>;
          static_assert(bVec::size() == 2 * Vec::size());
          std::tie(z[0], z[1]) = at::vec::convert_to_float<scalar_t>(bVec::loadu(x + i));
          std::tie(z[2], z[3]) =
              at::vec::convert_to_float<scalar_t>(bVec::loadu(x + i + bVec::size()));
        }
        for (int q = 0; q < 4; ++q) {
          z[q] = z[q] * vt;
          z[q].store(buf + i + q * Vec::size());
          vmax = at::vec::maximum(vmax, z[q]);  // propagates NaN
        }
        // (a plain max, which need not propagate NaN)
        const Vec hi = fast_max(fast_max(z[0], z[1]), fast_max(z[2], z[3]));
        if (mask_bits(hi >= vb) == 0) continue;
        for (int q = 0; q < 4; ++q) take(z[q], vb, i + q * Vec::size(), push);
      }
    }
    float m = -INFINITY;
    for (; i < n; ++i) {
      buf[i] = static_cast<float>(x[i]) * inv_t;
      m = nan_max(m, buf[i]);
      if (buf[i] >= zb) push(i);
    }
    float lanes[Vec::size()];
    vmax.store(lanes);
    for (float v : lanes) m = nan_max(m, v);
    if (band.size() > limit) raise();
    return m;
  }
  // After the pass: the band cut down to the k largest and their ties.
  void trim() {
    if (static_cast<int64_t>(band.size()) > k) raise();
  }

 private:
  float first_bound(const float* z, int64_t n) {
    const int64_t run = n / k;
    if (run >= 64) {  // (a NaN max is as good as any: a row holding one takes the float64 path)
      float lowest = INFINITY;
      for (int64_t r = 0; r < k; ++r) {
        const float* s = z + r * run;
        Vec vm(-INFINITY);
        int64_t i = 0;
        for (; i + Vec::size() <= run; i += Vec::size()) vm = fast_max(vm, Vec::loadu(s + i));
        float mx = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return fast_max(a, b); }, vm);
        for (; i < run; ++i) mx = std::max(mx, s[i]);
        lowest = std::min(lowest, mx);
      }
      return lowest;
    }
    const int64_t m = std::min<int64_t>(n, 256);
    tmp.resize(m);
    for (int64_t i = 0; i < m; ++i) tmp[i] = z[i] == z[i] ? z[i] : -INFINITY;
    return kth_largest(m);
  }
  // push(i0 + lane) for each lane of z at or above vb, in lane order.
  template <typename Push>
  static void take(Vec z, Vec vb, int64_t i0, const Push& push) {
    for (int bits = mask_bits(z >= vb); bits; bits &= bits - 1) push(i0 + __builtin_ctz(bits));
  }
  // The k-th largest of tmp's first m values (-inf when m < k).
  float kth_largest(int64_t m) {
    if (m < k) return -INFINITY;
    std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.begin() + m, std::greater<float>());
    return tmp[k - 1];
  }
  void raise() {
    // selected among the logits alone (4 bytes moved per swap, not a band item's 16)
    tmp.resize(band.size());
    for (size_t i = 0; i < band.size(); ++i) tmp[i] = band[i].x;
    const float xk = kth_largest(static_cast<int64_t>(band.size()));
    band.erase(std::remove_if(band.begin(), band.end(),
                              [xk](const BandItem<float>& it) { return !(it.x >= xk); }),
               band.end());
    zb = std::max(zb, scaled(xk, inv_t));  // z is non-decreasing in x
    limit = std::max(limit, 2 * band.size());
  }
};

// The largest top-k whose kept set the collector finds (for k > 32 its first bound is a selection
// among the first block's first 256 tokens; a larger k takes the sample's band pass).
constexpr int64_t kCollectTopK = 256;

// A sample of the row taken by the statistics pass: tokens (i V) / n for i < n = min(V, 1024),
// their index, scaled logit z and exp(z - m_b) (m_b: their block's max).
struct PassSample {
  std::vector<int32_t>& j;
  std::vector<float>&z, &e;
};
constexpr int64_t kPassSample = 1024;

// keep (V floats, when given): left holding exp(z_j - m_b) for each block b, whose max m_b goes to
// mb[b] (as row_logprob<true>'s), for top_p_hist / top_p_masses, with a sample of the row in
// `smp` (read while each block is in L1, not scattered over the row after the pass). top (when
// given): the top ids' candidates, read from each block while it is in L1.
template <typename scalar_t>
RowStatsExt row_stats_ext(const scalar_t* row, int64_t V, float inv_t, float* buf, bool with_e2,
                          float* keep = nullptr, float* mb = nullptr, TopCollector* top = nullptr,
                          PassSample* smp = nullptr) {
  SoftmaxStats st = stats_empty();
  float e2 = 0.f;
  const int64_t ns = std::max<int64_t>(std::min(V, kPassSample), 1), q = V / ns, r = V % ns;
  int64_t si = 0, sj = 0, rem = 0;  // the next sampled token: i, its index (i V) / ns
  if (smp) {
    smp->j.resize(ns);
    smp->z.resize(ns);
    smp->e.resize(ns);
  }
  for (int64_t j = 0, blk = 0; j < V; j += kBlock, ++blk) {
    const int64_t n = std::min(kBlock, V - j);
    if (keep) {
      mb[blk] = load_scaled(row + j, n, inv_t, keep + j);
      const int64_t s0 = si;
      for (; smp && si < ns && sj < j + n; ++si) {  // (the index stepped without a division)
        smp->j[si] = static_cast<int32_t>(sj);
        smp->z[si] = keep[sj];
        sj += q;
        rem += r;
        if (rem >= ns) ++sj, rem -= ns;
      }
      st = stats_merge(st, block_stats_impl<true>(keep + j, n, mb[blk]));
      for (int64_t i = s0; i < si; ++i) smp->e[i] = keep[smp->j[i]];
      continue;
    }
    const float m =
        top ? top->load_and_add(row + j, n, inv_t, buf, j) : load_scaled(row + j, n, inv_t, buf);
    if (!with_e2) {
      st = stats_merge(st, block_stats(buf, n, m));
      continue;
    }
    float b2;
    const SoftmaxStats b = block_stats_e2(buf, n, m, b2);
    const float m_new = nan_max(st.m, m);
    // e2 relative to the new max: times exp(2 (m_old - m_new)) (0 for an empty state)
    const float fa = st.s == 0.f ? 0.f : std::exp(2.f * (st.m - m_new));
    const float fb = b.s == 0.f ? 0.f : std::exp(2.f * (m - m_new));
    e2 = e2 * fa + b2 * fb;
    st = stats_merge(st, b);
  }
  return {st, e2};
}

// Whether x_label is the row's largest logit: its scaled value is the max z, and (when scaling
// could have rounded two logits to one value) no logit exceeds it.
template <typename scalar_t>
bool label_is_argmax(const scalar_t* row, int64_t V, float xl, float inv_t, float m) {
  const float zl = inv_t != 1.f ? scaled(xl, inv_t) : xl;
  if (!(zl == m)) return false;
  if (inv_t == 1.f) return true;
  for (int64_t j = 0; j < V; ++j)
    if (static_cast<float>(row[j]) > xl) return false;
  return true;
}

// nd = x * inv_t - m for a vector of float logits, rounded as load_scaled rounds the product.
inline Vec nd_of(Vec x, Vec vt, Vec vm, bool scale) { return (scale ? rounded(x * vt) : x) - vm; }
inline bool inv_t_scales(float inv_t) { return inv_t != 1.f; }
inline float nd_of(float x, float inv_t, float m, bool scale) {
  return (scale ? scaled(x, inv_t) : x) - m;
}

// The smallest float logit x whose nd (as nd_of computes it) is at least `bound` (more than it when
// strict): nd is non-decreasing in x, so a decision on nd is a comparison of x with this, exact
// (a binary search over the floats' order-preserving keys, on the same nd_of).
inline float x_threshold(float bound, bool strict, float inv_t, float m) {
  const bool scale = inv_t != 1.f;
  const auto pass = [&](float x) {
    const float nd = nd_of(x, inv_t, m, scale);
    return strict ? nd > bound : nd >= bound;
  };
  const auto key_of = [](float x) {
    int32_t b;
    std::memcpy(&b, &x, 4);
    return b ^ ((b >> 31) & 0x7FFFFFFF);
  };
  const auto value_of = [](int32_t k) {
    const int32_t b = k ^ ((k >> 31) & 0x7FFFFFFF);
    float x;
    std::memcpy(&x, &b, 4);
    return x;
  };
  int64_t lo = key_of(-INFINITY), hi = key_of(INFINITY);
  if (pass(-INFINITY)) return -INFINITY;
  if (!pass(INFINITY)) return INFINITY;  // (nothing finite passes)
  while (hi - lo > 1) {                  // pass(value_of(hi)) holds, pass(value_of(lo)) does not
    const int64_t mid = lo + (hi - lo) / 2;
    if (pass(value_of(static_cast<int32_t>(mid)))) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return value_of(static_cast<int32_t>(hi));
}

// Step 3: tokens with nd > theta_hi summed into `above`, those with theta_lo <= nd <= theta_hi
// collected into `band` (in index order), those with floor <= nd < theta_lo summed into `mid`
// (count and mass; floor = +inf: none). The bounds are turned into logit thresholds first, so a
// vector of the row is one comparison away from being skipped.
template <typename scalar_t>
void band_pass(const scalar_t* row, int64_t V, float inv_t, float m, float theta_lo, float theta_hi,
               float floor, MassSums<float>& above, MassSums<float>& mid,
               std::vector<BandItem<float>>& band) {
  const bool scale = inv_t != 1.f;
  const float xa = x_threshold(theta_hi, true, inv_t, m);   // above: x >= xa
  const float xb = x_threshold(theta_lo, false, inv_t, m);  // band: xb <= x < xa
  const float xf = floor == INFINITY ? INFINITY : x_threshold(floor, false, inv_t, m);
  const Vec vt(inv_t), vm(m), vxa(xa), vxb(xb), vxf(xf), vany(std::min(xb, xf)), vinf(INFINITY);
  Vec sa(0.f), ua(0.f), e2a(0.f), xma(INFINITY), sm(0.f);
  int64_t na = 0, nm = 0;
  band.clear();
  alignas(32) float xs[Vec::size()], nds[Vec::size()], es[Vec::size()];
  const auto vec8 = [&](Vec x, int64_t j0) {
    if (mask_bits(x >= vany) == 0) return;  // every lane below the band and mid
    const Vec up = x >= vxa;
    const Vec in = (x >= vxb) & (x < vxa);
    const Vec lowish = (x >= vxf) & (x < vxb);
    const int ma = mask_bits(up), mb = mask_bits(in), mm = mask_bits(lowish);
    const Vec nd = nd_of(x, vt, vm, scale);
    const Vec e = nd.exp_u20();
    if (ma) {
      sa = sa + (e & up);
      ua = ua + ((e * nd) & up);
      e2a = e2a + ((e * e) & up);
      xma = at::vec::minimum(xma, Vec::blendv(vinf, x, up));
      na += __builtin_popcount(ma);
    }
    if (mm) {
      sm = sm + (e & lowish);
      nm += __builtin_popcount(mm);
    }
    if (mb) {
      x.store(xs);
      nd.store(nds);
      e.store(es);
      for (int bits = mb; bits; bits &= bits - 1) {
        const int i = __builtin_ctz(bits);
        band.push_back({xs[i], nds[i], es[i], static_cast<int32_t>(j0 + i)});
      }
    }
  };
  int64_t j = 0;
  if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    using bVec = at::vec::Vectorized<scalar_t>;
    for (; j + bVec::size() <= V; j += bVec::size()) {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(bVec::loadu(row + j));
      vec8(a, j);
      vec8(b, j + Vec::size());
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    for (; j + Vec::size() <= V; j += Vec::size()) vec8(Vec::loadu(row + j), j);
  }
  const auto sum = [](Vec v) {
    return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v);
  };
  above.s = sum(sa);
  above.u = sum(ua);
  above.e2 = sum(e2a);
  above.xmin =
      at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::minimum(a, b); }, xma);
  above.n = na;
  mid.s = sum(sm);
  mid.n = nm;
  for (; j < V; ++j) {
    const float x = static_cast<float>(row[j]);
    if (!(x >= std::min(xb, xf))) continue;
    const float nd = nd_of(x, inv_t, m, scale);
    if (x >= xa) {
      above.add(std::exp(nd), nd, x);
    } else if (x >= xb) {
      band.push_back({x, nd, std::exp(nd), static_cast<int32_t>(j)});
    } else {
      mid.s += std::exp(nd);
      ++mid.n;
    }
  }
}

// The bounds of step 2 from a sample of the row: for each boundary, theta_lo (at or below it)
// and theta_hi (above it), in nd. "Sure" bounds hold by construction; the others are estimates
// the walk checks.
struct SampleBounds {
  float lo, hi;
};

class RowSample {
 public:
  static constexpr int64_t kSize = 1024;
  // nd of evenly spaced tokens (the whole row when V <= kSize); ordered only on demand.
  template <typename scalar_t>
  void take(const scalar_t* row, int64_t V, float inv_t, float m, std::vector<float>& nd,
            std::vector<float>& e) {
    const bool scale = inv_t != 1.f;
    const int64_t n = std::min(V, kSize);
    nd.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = n == V ? i : (i * V) / n;
      nd[i] = nd_of(static_cast<float>(row[j]), inv_t, m, scale);
    }
    nd_ = nd.data();
    ev_ = &e;
    n_ = n;
    V_ = V;
    sorted_ = false;
  }
  // The i-th largest sampled nd (1-based; a partial selection, no sort).
  float largest(int64_t i) {
    if (sorted_) return nd_[i - 1];
    std::nth_element(nd_, nd_ + (i - 1), nd_ + n_, [](float a, float b) { return a > b; });
    return nd_[i - 1];
  }
  // The lowest sampled nd below which the row's estimated mass (the sampled masses times V / n)
  // stays within `budget` (relative to the max token, as the masses): a lower bound on top-p's
  // cut when the budget is a part of (1 - p) of the reference mass. The bulk of a row is what
  // a uniform sample estimates well.
  float mass_below_bound(double budget) {
    mass_fraction(0.5, -INFINITY);  // (orders the sample and computes its masses)
    double acc = 0;
    const double w = static_cast<double>(V_) / n_;
    for (int64_t i = n_ - 1; i >= 0; --i) {
      acc += e_[i] * w;
      if (acc > budget) return i + 1 < n_ ? nd_[i + 1] : nd_[i];
    }
    return -INFINITY;
  }
  // Bounds on the nd of the k-th token (1-based) in rank order; lo is sure when `sure` asks it
  // and the sample has k tokens (k of them lie at or above it).
  SampleBounds kth(int64_t k, bool sure) {
    const double r = static_cast<double>(k) * n_ / V_;
    const double margin = 4.0 * std::sqrt(r) + 4.0;
    int64_t i_lo = sure ? k : static_cast<int64_t>(std::ceil(r + margin));
    const int64_t i_hi = static_cast<int64_t>(std::floor(r - margin));
    if (n_ == V_) i_lo = k;  // the whole row: exact
    SampleBounds b{-INFINITY, INFINITY};
    if (i_lo >= 1 && i_lo <= n_) b.lo = largest(i_lo);
    if (n_ == V_ && k >= 2 && k <= n_) b.hi = largest(k - 1);
    if (n_ < V_ && i_hi >= 1) b.hi = largest(i_hi);  // at most ~i_hi * V / n tokens above
    if (b.hi < b.lo) b.hi = b.lo;
    return b;
  }
  // Bounds on where the mass above reaches a fraction f of the mass of the tokens with
  // nd >= floor (the sample's estimate).
  SampleBounds mass_fraction(double f, float floor) {
    if (!sorted_) {
      std::sort(nd_, nd_ + n_, [](float a, float b) { return a > b; });
      ev_->resize(n_);
      for (int64_t i = 0; i < n_; ++i) (*ev_)[i] = std::exp(nd_[i]);
      e_ = ev_->data();
      sorted_ = true;
    }
    double total = 0, sq = 0;
    int64_t n = 0;
    for (; n < n_ && nd_[n] >= floor; ++n) {
      total += e_[n];
      sq += static_cast<double>(e_[n]) * e_[n];
    }
    SampleBounds b{-INFINITY, INFINITY};
    if (n == 0 || total <= 0) return b;
    const double n_eff = total * total / sq;
    const double d = 4.0 * std::sqrt(std::max(f * (1 - f), 1.0 / n_eff) / n_eff) + 2.0 / n_eff;
    double acc = 0;
    bool hi_set = false;
    for (int64_t i = 0; i < n; ++i) {
      acc += e_[i];
      if (!hi_set && acc > (f - d) * total) {
        b.hi = i >= 1 ? nd_[i - 1] : INFINITY;
        hi_set = true;
      }
      if (acc >= (f + d) * total) {
        b.lo = nd_[i];
        break;
      }
    }
    if (b.hi < b.lo) b.hi = b.lo;
    return b;
  }

 private:
  float* nd_ = nullptr;
  const float* e_ = nullptr;
  std::vector<float>* ev_ = nullptr;
  int64_t n_ = 0, V_ = 1;
  bool sorted_ = false;
};

// Step 4: the walk over the band, in rank order after the tokens `above` it. Returns false when
// a bound did not hold (a boundary lies above or below the band; the caller widens them).
// theta_lo / min_p_floor: the band's lower bound and the min-p bound (the band and `above` hold
// every token min-p keeps when theta_lo <= min_p_floor); `mid`: the tokens between the min-p bound
// and the band when the pass summed them (mid_valid). On success: the kept set as (cut,
// cut_index) and the sums over it.
template <typename T>
struct WalkResult {
  float cut;
  int64_t cut_index;
  MassSums<T> kept;
};

template <typename T>
bool walk_band(RankedBand<T>& band, const MassSums<T>& above, const MassSums<T>& mid,
               bool mid_valid, T full_mass, int64_t V, const SamplerRowArgs& a, T theta_lo,
               WalkResult<T>& res) {
  const int64_t n = band.size();
  const bool k_on = top_k_on(a.top_k, V), p_on = top_p_on(a.top_p);
  const T minp = static_cast<T>(min_p_bound(a.min_p));
  const bool complete = theta_lo <= minp;  // above + band hold every token min-p keeps
  // the band's tokens min-p keeps: a prefix (nd falls along the rank order)
  const int64_t endA = theta_lo >= minp ? n : band.count_at_least(minp);
  if (endA == 0 && above.n == 0) return false;  // (never: the top token has nd = 0)
  int64_t last = endA - 1;                      // the last kept position so far
  bool bound = complete || endA < n;            // the kept set ends inside the band (or at its end)
  if (a.sglang) {
    if (k_on) {
      if (above.n >= a.top_k) return false;  // the k-th token lies above the band
      const int64_t r = a.top_k - above.n - 1;
      if (r < endA) {
        last = std::min(last, r);
        bound = true;
      }
    }
    if (p_on) {
      const T tau = static_cast<T>(a.top_p) * full_mass;
      if (!top_p_keeps(true, above.s, tau)) return false;
      // the last kept token: the first whose mass up to and including it exceeds tau
      const int64_t b0 = band.first_bucket_reaching(tau - above.s, true);
      int64_t pos = b0 < band.buckets() ? band.begin_of(b0) : n;
      T acc = above.s + (pos < n ? band.mass_before(b0) : T(0));
      const int64_t end = last + 1;
      for (; pos < end; ++pos) {
        acc += band.at(pos).e;
        if (acc > tau) break;
      }
      if (pos < end) {
        last = pos;
        bound = true;
      }
    }
  } else {
    int64_t endB = endA;  // what min-p and top-k keep: a prefix of the band
    bool k_found = false;
    if (k_on) {
      if (above.n >= a.top_k) return false;
      const int64_t r = a.top_k - above.n - 1;
      if (r < endA) {
        const float v = band.at(r).x;
        int64_t e = r + 1;
        while (e < endA && band.at(e).x == v) ++e;  // every tie of the k-th value stays
        endB = e;
        k_found = true;
        bound = true;
      } else {
        // top-k does not cut only if min-p keeps at most k tokens
        if (!complete && !mid_valid) return false;
        const int64_t nA = above.n + endA + (complete ? 0 : mid.n);
        if (nA > a.top_k) return false;  // the k-th token lies below the band
      }
    }
    T massB = full_mass;  // the whole row's when neither min-p nor top-k is on
    if (k_on || min_p_on(a.min_p)) {
      if (!k_found && !complete && !mid_valid) return false;
      massB = above.s + (k_found || complete ? T(0) : mid.s);
      const int64_t bB = endB > 0 ? band.bucket_of(endB - 1) : 0;
      massB += endB > 0 ? band.mass_before(bB) : T(0);
      for (int64_t pos = endB > 0 ? band.begin_of(bB) : 0; pos < endB; ++pos)
        massB += band.raw(pos).e;
    }
    last = endB - 1;
    if (p_on) {
      const T tau = static_cast<T>(a.top_p) * massB;
      if (!top_p_keeps(false, above.s, tau)) return false;
      // the last kept group: the last whose mass strictly above is below tau
      const int64_t b0 = band.first_bucket_reaching(tau - above.s, false);
      int64_t pos = b0 < band.buckets() ? std::min(band.begin_of(b0), endB) : endB;
      T acc = above.s + (pos < n ? band.mass_before(band.bucket_of(pos)) : T(0));
      int64_t kept_end = pos;  // the tokens before pos are kept
      while (pos < endB && top_p_keeps(false, acc, tau)) {
        const float v = band.at(pos).x;
        while (pos < endB && band.at(pos).x == v) acc += band.at(pos++).e;
        kept_end = pos;
      }
      if (kept_end < endB) {
        last = kept_end - 1;
        bound = true;
      } else if (!k_found && !complete) {
        return false;  // B reaches below the band: so may top-p's boundary
      }
    }
  }
  if (!bound) return false;  // every boundary may lie below the band
  MassSums<T> k = above;
  if (last < 0) {  // min-p's boundary is the last token above the band
    res.cut = above.xmin;
    res.cut_index = V - 1;
    res.kept = k;
    return true;
  }
  const BandItem<T>& c = band.at(last);
  res.cut = c.x;
  res.cut_index = V - 1;
  if (a.sglang && last + 1 < n && band.at(last + 1).x == c.x) res.cut_index = c.j;
  const int64_t bl = band.bucket_of(last);
  for (int64_t pos = 0; pos < band.begin_of(bl); ++pos) {
    const BandItem<T>& it = band.raw(pos);
    k.add(it.e, it.nd, it.x);
  }
  for (int64_t pos = band.begin_of(bl); pos <= last; ++pos) {
    const BandItem<T>& it = band.at(pos);
    k.add(it.e, it.nd, it.x);
  }
  res.kept = k;
  return true;
}

// The bounds of step 2 for one row (nd units): the band [lo, hi], the floor of `mid` (+inf: not
// summed).
struct BandBounds {
  float lo, hi, floor;
  float lo_sure = -INFINITY;  // a lower bound that always holds (top-p without top-k)
};

inline BandBounds band_bounds(RowSample& smp, const SamplerRowArgs& a, int64_t V, float full_mass) {
  const bool k_on = top_k_on(a.top_k, V), p_on = top_p_on(a.top_p);
  const float minp = min_p_bound(a.min_p);
  // a sure lower bound on top-p's cut when the reference mass is at least `ref`: the tokens below
  // it hold less than (1 - p) of it (the sample's estimate of the cut is poor where a few tokens
  // carry most of the mass)
  const auto sure_p = [&](float ref) {
    return std::log(0.99f * (1.f - a.top_p) * ref / static_cast<float>(V));
  };
  // small k: the sure bound (k sampled tokens at or above it); larger: an estimate
  const bool sure_k = a.top_k <= 32;
  BandBounds b{minp, minp, INFINITY};
  if (a.sglang) {
    // the final cut is the highest of the filters' cuts: the band may start at the highest
    // lower bound; tokens above it must pass every filter: above the highest upper bound
    if (k_on) {
      const SampleBounds k = smp.kth(a.top_k, sure_k);
      b.lo = std::max(b.lo, k.lo);
      b.hi = std::max(b.hi, k.hi);
    }
    if (p_on) {
      const SampleBounds q = smp.mass_fraction(a.top_p, -INFINITY);
      b.lo_sure = std::max(b.lo, sure_p(full_mass));
      const float est = smp.mass_below_bound(0.5 * (1.0 - a.top_p) * full_mass);
      b.lo = std::max({b.lo, q.lo, b.lo_sure, k_on ? -INFINITY : est});
      b.hi = std::max(b.hi, q.hi);
    }
  } else if (k_on) {
    // top-p's mass is that of B (down to the k-th value): the band reaches below top-k's cut
    const SampleBounds k = smp.kth(a.top_k, sure_k);
    b.lo = std::max(minp, k.lo);
    b.hi = std::max(b.hi, k.hi);
    if (p_on && b.hi < INFINITY) b.hi = std::max(b.hi, smp.mass_fraction(a.top_p, k.lo).hi);
  } else if (p_on) {
    const SampleBounds q = smp.mass_fraction(a.top_p, minp);
    // (min-p on: its set's mass is at least the top token's, 1)
    const float ref = min_p_on(a.min_p) ? 1.f : full_mass;
    b.lo_sure = std::max(minp, sure_p(ref));
    const float est = smp.mass_below_bound(0.5 * (1.0 - a.top_p) * ref);
    b.lo = std::max({minp, q.lo, b.lo_sure, est});
    b.hi = std::max(b.hi, q.hi);
    if (min_p_on(a.min_p)) b.floor = minp;  // min-p's mass below the band, for top-p's target
  }
  if (a.stats_top_k > 0) {  // the top ids: every one of them collected
    b.hi = INFINITY;
    b.lo = std::min(b.lo, smp.kth(a.stats_top_k, true).lo);
  }
  b.hi = std::max(b.hi, b.lo);
  return b;
}

// Top-p without top-k or the top ids (min-p only under vLLM's rules), from a mass histogram:
//   A. the statistics pass leaves exp(z - m_b) of each block b in ws.mass (V floats, the
//      L2-resident scratch of this path) and m_b in ws.mass_mb;
//   B. one pass over the row: every token with nd >= lo (a lower bound on top-p's cut: a sample's
//      estimate, else a sure one) gets its mass relative to the row's max (exp(z - m_b) times
//      exp(m_b - m): a product, not another exp) and adds it to its bucket, linear in nd over
//      [lo, 0] (kHistBuckets; also mass * nd and mass^2 when the entropy / sum_p2 are asked);
//      vectors with no such token are skipped;
//   C. the bucket where the cumulative mass (in rank order, from the top) crosses tau holds the
//      cut: the buckets above it give the kept set's sums, and one more pass (skipping every
//      vector without one) collects that bucket's tokens, which are sorted and walked as the
//      rules say (tie groups share a bucket: the bucket is monotone in x).
// Returns false when the crossing does not lie above lo (an estimate that missed): the caller
// tries the sure bound, then the band pass.
constexpr int64_t kHistBuckets = 4096;

// The lanes of `mask` of (bucket as a float, mass, nd) stored at the front of bo / eo / ndo
// (Vec::size() slots each); returns how many.
struct CompressLut {
  alignas(32) int32_t idx[256][8];
  CompressLut() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int i = 0; i < 8; ++i)
        if (m >> i & 1) idx[m][k++] = i;
      for (; k < 8; ++k) idx[m][k] = 0;
    }
  }
};
inline const CompressLut& compress_lut() {
  static const CompressLut lut;
  return lut;
}
inline int compress_store(Vec b, Vec e, Vec nd, int mask, int32_t* bo, float* eo, float* ndo) {
#if defined(CPU_CAPABILITY_AVX2)
  static const CompressLut& lut = compress_lut();
  const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(lut.idx[mask]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bo),
                      _mm256_permutevar8x32_epi32(_mm256_cvttps_epi32(__m256(b)), perm));
  _mm256_storeu_ps(eo, _mm256_permutevar8x32_ps(__m256(e), perm));
  _mm256_storeu_ps(ndo, _mm256_permutevar8x32_ps(__m256(nd), perm));
  return __builtin_popcount(mask);
#else
  alignas(64) float bl[Vec::size()], el[Vec::size()], nl[Vec::size()];
  b.store(bl);
  e.store(el);
  nd.store(nl);
  int k = 0;
  for (int bits = mask; bits; bits &= bits - 1) {
    const int i = __builtin_ctz(bits);
    bo[k] = static_cast<int32_t>(bl[i]);
    ndo[k] = nl[i];
    eo[k++] = el[i];
  }
  return k;
#endif
}

// f(x, j) on each float32 vector of the row (from its dtype); returns where the scalar tail starts.
template <typename scalar_t, typename F>
inline int64_t for_each_vec(const scalar_t* row, int64_t V, F&& f) {
  int64_t j = 0;
  if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    using bVec = at::vec::Vectorized<scalar_t>;
    for (; j + bVec::size() <= V; j += bVec::size()) {
      auto [p0, p1] = at::vec::convert_to_float<scalar_t>(bVec::loadu(row + j));
      f(p0, j);
      f(p1, j + Vec::size());
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    for (; j + Vec::size() <= V; j += Vec::size()) f(Vec::loadu(row + j), j);
  }
  return j;
}

// Each sampled token's step on a grid over [lo, 0] (steps of 1 / inv_w from the max down; `steps`
// for those below lo) and its mass relative to the max token times wt, into bo / yo. Written as
// two loops so the first has no branch (the compiler vectorises it): which samples lie below lo
// is random, and a mispredicted branch per sample cost more than the rest of the work.
inline void sample_steps(const PassSample& smp, const float* cb, float m, float inv_w,
                         int64_t steps, float wt, int32_t* bo, float* yo) {
  const int64_t n = static_cast<int64_t>(smp.j.size());
  const float top = static_cast<float>(steps);
  for (int64_t i = 0; i < n; ++i) {
    // (z <= m: f >= 0; a -inf logit gives +inf, clamped to `steps`)
    bo[i] = static_cast<int32_t>(std::min((m - smp.z[i]) * inv_w, top));
    yo[i] = smp.e[i] * cb[static_cast<uint32_t>(smp.j[i]) / kBlock] * wt;
  }
}

// The highest nd (at least lo) below which the statistics pass's sample of the row puts less
// than `budget` of mass (relative to the max token: e x cb, times V / n), on a grid of 256 steps
// over [lo, 0]: an estimate, which top_p_hist checks.
inline float sampled_mass_bound(const PassSample& smp, const float* cb, int64_t V, float m,
                                float lo, float budget) {
  constexpr int64_t kSteps = 256;
  const int64_t n = static_cast<int64_t>(smp.j.size());
  if (!(lo > -INFINITY) || !(lo < 0.f) || n == 0) return lo;
  const float w = -lo / kSteps, wt = static_cast<float>(V) / static_cast<float>(n);
  int32_t bi[kPassSample];
  float yi[kPassSample];
  sample_steps(smp, cb, m, kSteps / -lo, kSteps, wt, bi, yi);
  float h[kSteps + 1] = {};  // h[kSteps]: below lo
  for (int64_t i = 0; i < n; ++i) h[bi[i]] += yi[i];
  float acc = h[kSteps];
  for (int64_t b = kSteps - 1; b >= 0; --b) {
    acc += h[b];
    if (acc > budget) return std::max(lo, -static_cast<float>(b + 1) * w);
  }
  return 0.f;
}

// ws.mass_cb = exp(m_b - m) per block: a block's masses ws.mass (relative to its max m_b) times
// it are relative to the row's max m.
inline void mass_factors(SamplerWorkspace& ws, int64_t V, float m) {
  const int64_t nblk = (V + kBlock - 1) / kBlock;
  ws.mass_cb.resize(nblk);
  for (int64_t b = 0; b < nblk; ++b) ws.mass_cb[b] = std::exp(ws.mass_mb[b] - m);
}

// Bounds (lo, hi) on top-p's cut from the statistics pass's sample of the row (masses relative to
// the max token, e x cb, times V / n): the estimated mass below a point and its standard error on
// a grid of 1024 steps over [lo, 0]; lo = the highest point whose estimate stays 4 standard errors
// below `target` (the mass the cut leaves below it), hi = one step above the lowest point whose
// estimate exceeds it by 4. Estimates: top_p_masses checks them.
inline std::pair<float, float> sampled_cut_bounds(const PassSample& smp, const float* cb, int64_t V,
                                                  float m, float lo, float target) {
  constexpr int64_t kSteps = 1024;
  const int64_t n = static_cast<int64_t>(smp.j.size());
  if (!(lo > -INFINITY) || !(lo < 0.f) || n == 0) return {lo, 0.f};
  const float inv_w = kSteps / -lo, wt = static_cast<float>(V) / static_cast<float>(n);
  int32_t bi[kPassSample];
  float yi[kPassSample];
  sample_steps(smp, cb, m, inv_w, kSteps, wt, bi, yi);
  float h1[kSteps + 1] = {}, h2[kSteps + 1] = {};  // [kSteps]: below lo
  for (int64_t i = 0; i < n; ++i) {
    h1[bi[i]] += yi[i];
    h2[bi[i]] += yi[i] * yi[i];
  }
  const float w = -lo / kSteps, inv_n = 1.f / static_cast<float>(n);
  constexpr float z2 = 16.f;  // 4 standard errors, squared
  // z se < d, written without the square root: d > 0 and z^2 var < d^2
  const auto within = [&](float a1, float a2, float d) {
    return d > 0.f && z2 * std::max(a2 - a1 * a1 * inv_n, 0.f) < d * d;
  };
  float a1 = h1[kSteps], a2 = h2[kSteps], blo = lo, bhi = 0.f;
  int64_t b = kSteps - 1;
  // a1, a2: the sums over the sampled tokens below -(b + 1) w, the lower edge of step b
  for (; b >= 0 && within(a1, a2, target - a1); --b) {  // a1 + z se < target
    blo = -static_cast<float>(b + 1) * w;
    a1 += h1[b];
    a2 += h2[b];
  }
  for (; b >= 0; --b) {
    if (within(a1, a2, a1 - target)) {  // a1 - z se > target
      bhi = std::min(0.f, -static_cast<float>(b) * w);
      break;
    }
    a1 += h1[b];
    a2 += h2[b];
  }
  return {std::max(lo, blo), bhi};
}

// The first bucket (in rank order) where top-p's boundary falls, from `acc`, the mass above the
// buckets: vLLM keeps a token while the mass strictly above its value is below tau (the bucket
// where the mass reaches tau), SGLang while the mass before it is at most tau (where it exceeds
// tau). -1 when it lies below them; acc ends holding the mass above the bucket, acc_before (when
// given) the mass above the bucket before it (acc's start for the first). The masses are summed in
// float64: a bucket can hold a tie group of thousands of equal masses, whose float32 sum rounds
// the same way at each step (a bias of about n ulp, 1e-4 of the mass at n = 2000).
inline int64_t crossing_bucket(const double* hs, int64_t nb, double& acc, float tau, bool sglang,
                               double* acc_before = nullptr) {
  double before = acc;
  for (int64_t b = 0; b < nb; ++b) {
    if (sglang ? acc + hs[b] > tau : !(acc + hs[b] < tau)) {
      if (acc_before) *acc_before = before;
      return b;
    }
    before = acc;
    acc += hs[b];
  }
  return -1;
}

// The tokens of the bucket where top-p's mass crosses tau, walked in rank order (sorted here) from
// `acc`, the mass above them, as each engine's rule says (vLLM: whole tie groups while the mass
// strictly above is below tau; SGLang: up to the first token whose mass up to it exceeds tau).
// Returns the last kept position (-1: none) with the cut in w; acc ends past the kept tokens
// (float64, as crossing_bucket's).
inline int64_t walk_crossing_bucket(std::vector<BandItem<float>>& items, double& acc, float tau,
                                    bool sglang, int64_t V, WalkResult<float>& w) {
  std::sort(items.begin(), items.end(), rank_before<float>);
  const int64_t n = static_cast<int64_t>(items.size());
  int64_t last = -1;
  if (sglang) {
    for (int64_t i = 0; i < n; ++i) {
      acc += items[i].e;
      if (acc > tau) {
        last = i;
        break;
      }
    }
    if (last < 0) last = n - 1;
  } else {
    for (int64_t i = 0; i < n;) {
      if (!top_p_keeps(false, static_cast<float>(acc), tau)) break;
      int64_t e = i;
      while (e < n && items[e].x == items[i].x) acc += items[e++].e;
      last = e - 1;
      i = e;
    }
  }
  if (last < 0) return -1;
  w.cut = items[last].x;
  w.cut_index = V - 1;
  if (sglang && last + 1 < n && items[last + 1].x == w.cut) w.cut_index = items[last].j;
  return last;
}

template <typename scalar_t>
bool top_p_hist(const scalar_t* row, int64_t V, const SamplerRowArgs& a, float m, float full_mass,
                float lo, SamplerWorkspace& ws, WalkResult<float>& w) {
  const bool scale = inv_t_scales(a.inv_t);
  const float inv_t = a.inv_t;
  const bool minp_ref = !a.sglang && min_p_on(a.min_p);  // tau from what min-p keeps
  const float minp = min_p_bound(a.min_p);
  if (!(lo > -INFINITY) || (minp_ref && lo < minp)) return false;
  const int64_t NB = kHistBuckets;
  // bucket = trunc(clamp(-nd * bscale, 0, NB - 1)): non-increasing in nd, hence in x
  const float bscale = lo < 0.f ? static_cast<float>(NB - 1) / -lo : 0.f;
  const auto bucket_of = [&](float nd) {
    return static_cast<int64_t>(
        std::max(std::min((0.f - nd) * bscale, static_cast<float>(NB - 1)), 0.f));
  };
  const Vec vt(inv_t), vm(m), vbs(bscale), vtop(static_cast<float>(NB - 1)), vzero(0.f);
  // (a candidate's value is never NaN: plain min / max, which the scalar std::min / max match)
  const auto vbucket = [&](Vec nd) {
#if defined(CPU_CAPABILITY_AVX2)
    return Vec(_mm256_max_ps(_mm256_min_ps((vzero - nd) * vbs, vtop), vzero));
#else
    return at::vec::maximum(at::vec::minimum((vzero - nd) * vbs, vtop), vzero);
#endif
  };
  const float xlo = x_threshold(lo, false, inv_t, m);  // candidates: x >= xlo
  const float xf = minp_ref ? x_threshold(minp, false, inv_t, m) : INFINITY;
  const float xany = std::min(xlo, xf);
  const float* E = ws.mass.data();
  const float* cb = ws.mass_cb.data();  // (the caller's mass_factors)
  // the entropy's and sum_p2's sums per bucket too, when asked
  const bool need_u = a.with_entropy, need_e2 = a.with_sum_p2;
  ws.hs.assign(NB, 0.0);
  ws.hu.assign(need_u ? NB : 0, 0.0);
  ws.he2.assign(need_e2 ? NB : 0, 0.0);
  double *hs = ws.hs.data(), *hu = ws.hu.data(), *he2 = ws.he2.data();
  const Vec vxlo(xlo), vxf(xf);
  Vec sref(0.f);  // the mass min-p keeps (minp_ref)
  // the candidates' (bucket, mass, nd), compacted vector by vector without a branch on how many
  // of its lanes are candidates (data-dependent: a mispredicted branch costs more than the
  // vector's work), then added to their buckets chunk by chunk
  int32_t* cbk = ws.chunk_b;
  float *cev = ws.chunk_e, *cnd = ws.chunk_nd;
  int64_t nc = 0;
  const auto flush = [&] {
    for (int64_t i = 0; i < nc; ++i) hs[cbk[i]] += cev[i];
    if (need_u)
      for (int64_t i = 0; i < nc; ++i) hu[cbk[i]] += cev[i] * cnd[i];
    if (need_e2)
      for (int64_t i = 0; i < nc; ++i) he2[cbk[i]] += cev[i] * cev[i];
    nc = 0;
  };
  const Vec vany(xany);
  const int64_t jv = for_each_vec(row, V, [&](Vec x, int64_t j0) {
    if (mask_bits(x >= vany) == 0) return;
    const Vec nd = nd_of(x, vt, vm, scale);
    const Vec e = Vec::loadu(E + j0) * Vec(cb[j0 / kBlock]);
    if (minp_ref) sref = sref + (e & (x >= vxf));
    nc += compress_store(vbucket(nd), e, nd, mask_bits(x >= vxlo), cbk + nc, cev + nc, cnd + nc);
    if (nc >= kChunk) flush();
  });
  flush();
  float ref = minp_ref ? at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, sref)
                       : full_mass;
  for (int64_t j = jv; j < V; ++j) {
    const float x = static_cast<float>(row[j]);
    if (!(x >= xany)) continue;
    const float nd = nd_of(x, inv_t, m, scale);
    const float e = E[j] * cb[j / kBlock];
    if (minp_ref && x >= xf) ref += e;
    if (x >= xlo) {
      const int64_t b = bucket_of(nd);
      hs[b] += e;
      if (need_u) hu[b] += e * nd;
      if (need_e2) he2[b] += e * e;
    }
  }
  // the bucket where top-p's boundary falls (crossing_bucket)
  const float tau = a.top_p * ref;
  if (!(tau > 0.f)) return false;
  double acc = 0.0;
  const int64_t bstar = crossing_bucket(hs, NB, acc, tau, a.sglang);
  if (bstar < 0) return false;  // the boundary lies below lo
  // C: bstar's tokens collected, those of the buckets above it summed from the buckets. bstar's
  // logits are [xc, xa): the bucket is monotone in x, so each bound is a binary search over the
  // floats' keys (as x_threshold's) on the same expression
  const auto smallest_with_bucket_at_most = [&](int64_t bmax) {
    const auto pass = [&](float x) {
      return x >= xlo && bucket_of(nd_of(x, inv_t, m, scale)) <= bmax;
    };
    if (bmax < 0) return INFINITY;
    const auto key_of = [](float x) {
      int32_t b;
      std::memcpy(&b, &x, 4);
      return b ^ ((b >> 31) & 0x7FFFFFFF);
    };
    const auto value_of = [](int64_t k) {
      const int32_t k32 = static_cast<int32_t>(k);
      const int32_t b = k32 ^ ((k32 >> 31) & 0x7FFFFFFF);
      float x;
      std::memcpy(&x, &b, 4);
      return x;
    };
    if (pass(xlo)) return xlo;
    int64_t klo = key_of(xlo), khi = key_of(INFINITY);  // pass(khi), !pass(klo)
    while (khi - klo > 1) {
      const int64_t mid = klo + (khi - klo) / 2;
      if (pass(value_of(mid))) {
        khi = mid;
      } else {
        klo = mid;
      }
    }
    return value_of(khi);
  };
  const float xc = smallest_with_bucket_at_most(bstar);
  const float xa = smallest_with_bucket_at_most(bstar - 1);
  std::vector<BandItem<float>>& items = ws.band;
  items.clear();
  const Vec vxc(xc), vxa(xa);
  alignas(32) float xs[Vec::size()], nds[Vec::size()];
  for_each_vec(row, V, [&](Vec x, int64_t j0) {
    const int mb = mask_bits((x >= vxc) & (x < vxa));
    if (mb == 0) return;
    const Vec nd = nd_of(x, vt, vm, scale);
    x.store(xs);
    nd.store(nds);
    for (int bits = mb; bits; bits &= bits - 1) {
      const int i = __builtin_ctz(bits);
      const int64_t j = j0 + i;
      items.push_back({xs[i], nds[i], E[j] * cb[j / kBlock], static_cast<int32_t>(j)});
    }
  });
  for (int64_t j = jv; j < V; ++j) {
    const float x = static_cast<float>(row[j]);
    if (x >= xc && x < xa)
      items.push_back(
          {x, nd_of(x, inv_t, m, scale), E[j] * cb[j / kBlock], static_cast<int32_t>(j)});
  }
  // the kept set's sums in float64 (crossing_bucket's reason): the buckets above bstar, then the
  // kept items; the mass is the walk's acc
  MassSums<double> d;
  for (int64_t b = 0; b < bstar; ++b) {
    if (need_u) d.u += hu[b];
    if (need_e2) d.e2 += he2[b];
  }
  const int64_t last = walk_crossing_bucket(items, acc, tau, a.sglang, V, w);
  if (last < 0) return false;
  for (int64_t i = 0; i <= last; ++i) d.add(items[i].e, items[i].nd, items[i].x);
  w.kept = {d.n, static_cast<float>(acc), static_cast<float>(d.u), static_cast<float>(d.e2),
            d.xmin};
  return true;
}

// Top-p alone (no min-p, top-k, top ids or entropy) from the masses alone: one pass over ws.mass
// (exp(z - m_b) of each block b, as top_p_hist's A leaves it) and not over the row, which with
// the masses would not fit in L2. Every token whose mass (relative to the row's max) is above
// exp(hi) is summed as a vector; those in [exp(lo), exp(hi)] (the band: a sample's estimate of
// where the cut lies, a few percent of a flat row) are compressed as (index, mass) and bucketed by
// mass; only the bucket where the mass crosses tau and its two neighbours (a tie group's masses
// can straddle two buckets) have their logits read, sorted and walked, as in top_p_hist. The
// masses are within a few ulp of monotone in the logit (exp_u20, one product), so the result is
// exact when the cut lies inside the band by a margin far above that: else (an estimate that
// missed) returns false and the caller runs top_p_hist.
constexpr float kMassMargin = 1e-4f;  // nd units: the masses' ~3e-6 relative error, 30 times

// The lanes of `mask` of (index, mass) stored at the front of jo / eo; returns how many. j0: the
// first lane's index (the compressed indices are j0 plus the lookup table's row: no shuffle).
inline int compress_index_mass(const CompressLut& lut, int32_t j0, Vec e, int mask, int32_t* jo,
                               float* eo) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(lut.idx[mask]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(jo),
                      _mm256_add_epi32(perm, _mm256_set1_epi32(j0)));
  _mm256_storeu_ps(eo, _mm256_permutevar8x32_ps(__m256(e), perm));
  return __builtin_popcount(mask);
#else
  (void)lut;
  alignas(64) float el[Vec::size()];
  e.store(el);
  int k = 0;
  for (int bits = mask; bits; bits &= bits - 1) {
    const int i = __builtin_ctz(bits);
    jo[k] = j0 + i;
    eo[k++] = el[i];
  }
  return k;
#endif
}

template <typename scalar_t>
bool top_p_masses(const scalar_t* row, int64_t V, const SamplerRowArgs& a, float m, float full_mass,
                  float lo, float hi, SamplerWorkspace& ws, WalkResult<float>& w) {
  hi = std::min(hi, 0.f);  // 0: no upper bound (the top token has nd = 0)
  if (!(lo > -INFINITY) || !(hi > lo + 2 * kMassMargin) || V >= (int64_t{1} << 24)) return false;
  const bool scale = inv_t_scales(a.inv_t);
  const float inv_t = a.inv_t;
  const float tau = a.top_p * full_mass;
  if (!(tau > 0.f)) return false;
  const float* E = ws.mass.data();
  const int64_t nblk = (V + kBlock - 1) / kBlock;
  const float* cb = ws.mass_cb.data();  // (mass_factors)
  // the pass: the masses above exp(hi) summed, the band's compressed
  ws.band_j.resize(V + Vec::size());
  ws.band_e.resize(V + Vec::size());
  int32_t* bj = ws.band_j.data();
  float* be = ws.band_e.data();
  // each block's masses compared with the thresholds over its factor (no product per token), its
  // sums above them taken times the factor once
  const float ehi = hi < 0.f ? std::exp(hi) : INFINITY, elo = std::exp(lo);
  float s_tail = 0.f, e2_tail = 0.f;  // the scalar tail's
  float s_blk = 0.f, e2_blk = 0.f;    // the sums above, over the blocks
  int64_t nb = 0;
  const CompressLut& lut = compress_lut();
  const bool with_e2 = a.with_sum_p2;
  for (int64_t b = 0; b < nblk; ++b) {
    const float f = cb[b];
    int64_t j = b * kBlock;
    const int64_t end = std::min(V, j + kBlock);
    const int64_t nb0 = nb;
    // the block's thresholds: E f > ehi and elo <= E f <= ehi, as comparisons of E (a block with
    // f = 0 holds no mass above or in the band)
    const float thi = f > 0.f ? ehi / f : INFINITY, tlo = f > 0.f ? elo / f : INFINITY;
    const Vec vthi(thi), vtlo(tlo);
    Vec vs(0.f), ve2(0.f);
    for (; j + Vec::size() <= end; j += Vec::size()) {
      const Vec e = Vec::loadu(E + j);
      const Vec above = e > vthi;
      vs = vs + (e & above);
      if (with_e2) ve2 = at::vec::fmadd(e, e & above, ve2);
      // stored whether or not the vector holds a band token: a branch on it mispredicts
      const int mb = mask_bits(andnot(e >= vtlo, above));  // (no NaN: the row is finite)
      nb += compress_index_mass(lut, static_cast<int32_t>(j), e, mb, bj + nb, be + nb);
    }
    for (; j < end; ++j) {
      const float e = E[j];
      if (e > thi) {
        s_tail += e * f;
        e2_tail += (e * f) * (e * f);
      } else if (e >= tlo) {
        bj[nb] = static_cast<int32_t>(j);
        be[nb++] = e;
      }
    }
    const auto red = [](Vec v) {
      return at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, v);
    };
    s_blk += red(vs) * f;
    if (with_e2) e2_blk += red(ve2) * (f * f);
    for (int64_t i = nb0; i < nb; ++i) be[i] *= f;  // the band's masses relative to the max
  }
  const float s_above = s_blk + s_tail;
  // vLLM keeps the first band group while the mass above it is below tau; SGLang while the mass
  // before it is at most tau
  if (!top_p_keeps(a.sglang, s_above, tau)) return false;  // the cut lies above the band
  // the band bucketed by its masses' bits (a positive float's bits are monotone in it: a bucket is
  // a range of masses, about log-uniform, read without the logits): bucket = clamp((kt - key(e))
  // >> shift, 0, NB - 1), kt the key of the band's top mass. Equal logits can differ in mass (their
  // blocks' factors round differently; by far less than kMassMargin, as above), so a bucket is at
  // least 2^11 ulp wide (more than kMassMargin): a tie group then lies in one bucket or two
  // adjacent ones, and the walk below takes the crossing bucket's neighbours too.
  const int64_t NB = kHistBuckets;
  const auto key = [](float e) {
    int32_t k;
    std::memcpy(&k, &e, 4);
    return k;
  };
  const int32_t kt = key(hi < 0.f ? ehi : 2.f);  // (a mass is at most 1 up to rounding)
  int shift = 11;
  while ((static_cast<int64_t>(kt) - key(elo)) >> shift >= NB - 1) ++shift;
  const auto bucket_of = [&](float e) {
    return static_cast<int32_t>(
        std::min<int64_t>(std::max<int64_t>((kt - key(e)) >> shift, 0), NB - 1));
  };
  ws.hs.assign(NB, 0.0);
  ws.he2.assign(with_e2 ? NB : 0, 0.0);
  double *hs = ws.hs.data(), *he2 = ws.he2.data();
  // each band token's bucket, kept for the collection below
  ws.band_b.resize(nb + Vec::size());
  int32_t* bk = ws.band_b.data();
  int64_t i0 = 0;
#if defined(CPU_CAPABILITY_AVX2)
  {
    const __m256i vkt = _mm256_set1_epi32(kt),
                  vtop = _mm256_set1_epi32(static_cast<int32_t>(NB - 1)),
                  v0 = _mm256_setzero_si256();
    const __m128i vsh = _mm_cvtsi32_si128(shift);
    for (; i0 + Vec::size() <= nb; i0 += Vec::size()) {
      const __m256i k = _mm256_castps_si256(_mm256_loadu_ps(be + i0));
      const __m256i d = _mm256_sra_epi32(_mm256_sub_epi32(vkt, k), vsh);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bk + i0),
                          _mm256_min_epi32(_mm256_max_epi32(d, v0), vtop));
    }
  }
#endif
  for (int64_t i = i0; i < nb; ++i) bk[i] = bucket_of(be[i]);
  for (int64_t i = 0; i < nb; ++i) hs[bk[i]] += be[i];
  if (with_e2)
    for (int64_t i = 0; i < nb; ++i) he2[bk[i]] += be[i] * be[i];
  // the crossing bucket bstar (crossing_bucket's rule); the walk starts at bstar - 1 from acc, the
  // mass above it
  double acc = s_above, acc_prev;
  const int64_t bstar = crossing_bucket(hs, NB, acc, tau, a.sglang, &acc_prev);
  if (bstar < 0) return false;  // the cut lies below the band
  const int64_t bfirst = std::max<int64_t>(bstar - 1, 0);
  acc = acc_prev;
  std::vector<BandItem<float>>& items = ws.band;
  items.clear();
  const uint32_t span = static_cast<uint32_t>(bstar + 1 - bfirst);
  for (int64_t i = 0; i < nb; ++i) {
    // (one unsigned comparison: a bucket below bfirst and one above bstar + 1 are equally
    // likely, and two comparisons would mispredict)
    if (static_cast<uint32_t>(bk[i] - bfirst) > span) continue;
    const float x = static_cast<float>(row[bj[i]]);
    items.push_back({x, nd_of(x, inv_t, m, scale), be[i], bj[i]});
  }
  const int64_t last = walk_crossing_bucket(items, acc, tau, a.sglang, V, w);
  if (last < 0) return false;
  // the masses decide the band's edges: the cut must lie well inside it
  const float nd_cut = items[last].nd;
  if (!(nd_cut > lo + kMassMargin && (hi == 0.f || nd_cut < hi - kMassMargin))) return false;
  MassSums<float> k;
  k.s = static_cast<float>(acc);  // (the walk's: above the band and bfirst, the kept items)
  if (with_e2) {
    double se2 = static_cast<double>(e2_blk) + e2_tail;
    for (int64_t b = 0; b < bfirst; ++b) se2 += he2[b];
    for (int64_t i = 0; i <= last; ++i) se2 += static_cast<double>(items[i].e) * items[i].e;
    k.e2 = static_cast<float>(se2);
  }
  k.xmin = items[last].x;
  w.kept = k;
  return true;
}

// The rare slow path of a row whose scaled logits overflow float32 (x = 3e38 at temperature
// 0.5): every token in the band, in float64 relative to the unscaled max (as row_stats64).
template <typename scalar_t>
bool sampler_row64(const scalar_t* row, int64_t V, const SamplerRowArgs& a, SamplerWorkspace& ws,
                   double& xmax, WalkResult<double>& w, double& full_log_s) {
  xmax = -INFINITY;
  for (int64_t j = 0; j < V; ++j) xmax = std::max(xmax, static_cast<double>(row[j]));
  const double inv_t = a.inv_t;
  ws.band64.resize(V);
  double s = 0;
  for (int64_t j = 0; j < V; ++j) {
    const double nd = (static_cast<double>(row[j]) - xmax) * inv_t;
    const double e = std::exp(nd);
    ws.band64[j] = {static_cast<float>(row[j]), nd, e, static_cast<int32_t>(j)};
    s += e;
  }
  full_log_s = std::log(s);
  ws.ranked64.build(ws.band64);
  const MassSums<double> none;
  SamplerRowArgs a64 = a;
  return walk_band<double>(ws.ranked64, none, none, false, s, V, a64, -INFINITY, w);
}

// One row: its label's log-prob under the sampler's distribution, the entropy, the kept set and
// the statistics asked for. top_ids / top_lp: a.stats_top_k slots (when asked).
template <typename scalar_t>
SamplerRowOut sampler_row(const scalar_t* row, int64_t V, int64_t label, const SamplerRowArgs& a,
                          SamplerWorkspace& ws, int64_t* top_ids, float* top_lp) {
  const bool trunc = top_k_on(a.top_k, V) || top_p_on(a.top_p) || min_p_on(a.min_p);
  const float inv_t = a.inv_t;
  SamplerRowOut o;
  o.cut = -INFINITY;
  o.cut_index = V - 1;
  o.outside = false;
  o.sum_p2 = 0.f;
  // top-p without top-k or the top ids (and min-p only under vLLM's rules): top_p_hist, the
  // statistics pass keeping each token's exp(z - m_b)
  const bool p_hist = trunc && top_p_on(a.top_p) && !top_k_on(a.top_k, V) && a.stats_top_k == 0 &&
                      !(a.sglang && min_p_on(a.min_p));
  if (p_hist) {
    ws.mass.resize(V);
    ws.mass_mb.resize((V + kBlock - 1) / kBlock);
  }
  // The top ids, and a truncation with top-k (k <= kCollectTopK): every token it keeps, and every
  // top id, is among the kc largest. The statistics pass also collects the tokens at or above a
  // sure bound on the kc-th largest logit, so no second pass reads the row.
  const bool k_bounded = top_k_on(a.top_k, V) && a.top_k <= kCollectTopK;
  const bool collect = k_bounded || (!trunc && a.stats_top_k > 0);
  const int64_t kc = k_bounded ? std::max(a.top_k, a.stats_top_k) : a.stats_top_k;
  TopCollector top{ws.band, ws.sample_nd, inv_t, kc,
                   static_cast<size_t>(std::max<int64_t>(64, 4 * kc))};
  if (collect) ws.band.clear();
  PassSample psmp{ws.sample_j, ws.sample_nd, ws.sample_e};
  const RowStatsExt rs = row_stats_ext(
      row, V, inv_t, ws.buf, a.with_sum_p2 && !trunc, p_hist ? ws.mass.data() : nullptr,
      p_hist ? ws.mass_mb.data() : nullptr, collect ? &top : nullptr, p_hist ? &psmp : nullptr);
  const SoftmaxStats& st = rs.st;
  const float xl = static_cast<float>(row[label]);
  o.full_lse = stats_lse(st);
  o.is_argmax =
      a.with_is_argmax && std::isfinite(o.full_lse) && label_is_argmax(row, V, xl, inv_t, st.m);
  if (!std::isfinite(o.full_lse)) {
    const RowStats64 r64 = row_stats64(row, V, static_cast<double>(inv_t));
    if (!(r64.m == r64.m)) {  // NaN / +inf logits, or all -inf: undefined
      o.lp = o.ent = o.lse = o.sum_p2 = o.full_lse = NAN;
      for (int64_t i = 0; i < a.stats_top_k; ++i) top_ids[i] = -1, top_lp[i] = NAN;
      o.is_argmax = false;
      return o;
    }
    double xmax, log_s;
    WalkResult<double> w;
    if (!trunc) {
      w.cut = -INFINITY;
      w.cut_index = V - 1;
    }
    const bool ok = sampler_row64(row, V, a, ws, xmax, w, log_s);
    if (!trunc) {
      // every token kept: the sums of the whole row
      w.kept = MassSums<double>();
      for (int64_t j = 0; j < V; ++j) w.kept.add(ws.band64[j].e, ws.band64[j].nd, 0.f);
    }
    TORCH_CHECK(ok || !trunc, "token_logprobs_sampler: internal error (float64 row)");
    const double lsk = std::log(w.kept.s);
    const bool kept = !trunc || in_kept_set(xl, label, w.cut, w.cut_index);
    o.is_argmax = a.with_is_argmax && static_cast<double>(row[label]) == xmax;
    o.cut = trunc ? w.cut : -INFINITY;
    o.cut_index = trunc ? w.cut_index : V - 1;
    o.outside = !kept;
    o.lp = kept ? static_cast<float>((static_cast<double>(row[label]) - xmax) * inv_t - lsk)
                : -INFINITY;
    o.lse = static_cast<float>(xmax * inv_t + lsk);
    o.ent = static_cast<float>(lsk - w.kept.u / w.kept.s);
    o.sum_p2 = static_cast<float>(w.kept.e2 / (w.kept.s * w.kept.s));
    o.full_lse = static_cast<float>(xmax * inv_t + log_s);
    for (int64_t i = 0; i < a.stats_top_k; ++i) {
      const BandItem<double>& it = ws.ranked64.at(i);
      top_ids[i] = it.j;
      top_lp[i] = !trunc || in_kept_set(it.x, it.j, w.cut, w.cut_index)
                      ? static_cast<float>(it.nd - lsk)
                      : -INFINITY;
    }
    return o;
  }
  const float m = st.m;
  if (!trunc && a.stats_top_k == 0) {  // the plain softmax: the statistics pass holds it all
    const float log_s = std::log(st.s);
    o.lp = (scaled(xl, inv_t) - m) - log_s;
    o.ent = stats_entropy(st);
    o.lse = o.full_lse;
    o.sum_p2 = rs.e2 / (st.s * st.s);
    return o;
  }
  const float minp = min_p_bound(a.min_p);
  WalkResult<float> w;
  bool ok = false;
  if (p_hist) {
    // a sure lower bound on the cut: the tokens below it hold less than (1 - p) of the reference
    // mass (what min-p keeps holds at least the top token's, 1)
    const float ref = min_p_on(a.min_p) ? 1.f : st.s;
    const float lo =
        std::max(minp, std::log(0.99f * (1.f - a.top_p) * ref / static_cast<float>(V)));
    mass_factors(ws, V, m);
    // without the entropy or min-p: from the masses alone, first in a band around the sample's
    // estimate of the cut, then in [lo, 0]
    if (!a.with_entropy && !min_p_on(a.min_p)) {
      const auto [blo, bhi] =
          sampled_cut_bounds(psmp, ws.mass_cb.data(), V, m, lo, (1.f - a.top_p) * ref);
      ok = top_p_masses(row, V, a, m, st.s, blo, bhi, ws, w);
      if (!ok) ok = top_p_masses(row, V, a, m, st.s, lo, 0.f, ws, w);
    }
    // else a higher bound from the sample (the bulk, below the cut, is what a uniform sample
    // estimates well): fewer tokens to bucket, and most vectors skipped on peaked rows
    if (!ok) {
      const float lo_est =
          sampled_mass_bound(psmp, ws.mass_cb.data(), V, m, lo, 0.5f * (1.f - a.top_p) * ref);
      if (lo_est > lo) ok = top_p_hist(row, V, a, m, st.s, lo_est, ws, w);
    }
    if (!ok) ok = top_p_hist(row, V, a, m, st.s, lo, ws, w);
  }
  if (collect) {  // the collected band holds the kc largest (and their ties)
    top.trim();
    const bool scale = inv_t_scales(inv_t);
    float lo = INFINITY;  // the band's lower bound: it holds every token with a larger logit
    for (BandItem<float>& it : ws.band) {
      it.nd = nd_of(it.x, inv_t, m, scale);
      it.e = std::exp(it.nd);
      lo = std::min(lo, it.nd);
    }
    ws.ranked.build(ws.band);
    ok = ws.ranked.size() >= kc;
    w.cut = -INFINITY;
    w.cut_index = V - 1;
    // top-k's k-th token lies in the band, so every boundary does (walk_band checks it)
    if (ok && trunc) ok = walk_band<float>(ws.ranked, {}, {}, false, st.s, V, a, lo, w);
  }
  // else (and where the histogram's bound did not hold): bounds from a sample of the row, tried in
  // turn: the estimates; for top-p without top-k its sure lower bound; then the bounds that always
  // hold
  RowSample smp;
  if (!ok) {
    smp.take(row, V, inv_t, m, ws.sample_nd, ws.sample_e);
    const BandBounds bb = trunc ? band_bounds(smp, a, V, st.s)
                                : BandBounds{smp.kth(a.stats_top_k, true).lo, INFINITY, INFINITY};
    const bool p_only = trunc && top_p_on(a.top_p) && !top_k_on(a.top_k, V) && a.stats_top_k == 0;
    BandBounds tries[3];
    int ntries = 0;
    tries[ntries++] = bb;
    if (p_only && bb.lo_sure < bb.lo) {
      tries[ntries] = bb;
      tries[ntries].lo = bb.lo_sure;
      tries[ntries++].hi = INFINITY;
    }
    tries[ntries++] = {a.stats_top_k > 0 || !trunc ? -INFINITY : minp, INFINITY, INFINITY};
    for (int i = 0; i < ntries && !ok; ++i) {
      const BandBounds& b = tries[i];
      MassSums<float> above, mid;
      band_pass(row, V, inv_t, m, b.lo, b.hi, b.floor, above, mid, ws.band);
      ws.ranked.build(ws.band);
      if (a.stats_top_k > 0 && ws.ranked.size() < a.stats_top_k) continue;
      if (!trunc) {
        w.cut = -INFINITY;
        w.cut_index = V - 1;
        ok = true;
      } else {
        ok = walk_band<float>(ws.ranked, above, mid, b.floor < INFINITY, st.s, V, a, b.lo, w);
      }
    }
  }
  TORCH_CHECK(ok, "token_logprobs_sampler: internal error (no band held the kept set)");
  float log_sk, u_k, e2_k, s_k;
  if (trunc) {
    s_k = w.kept.s;
    u_k = w.kept.u;
    e2_k = w.kept.e2;
  } else {
    s_k = st.s;
    u_k = st.u;
    e2_k = rs.e2;
  }
  log_sk = std::log(s_k);
  const bool kept = !trunc || in_kept_set(xl, label, w.cut, w.cut_index);
  o.cut = trunc ? w.cut : -INFINITY;
  o.cut_index = trunc ? w.cut_index : V - 1;
  o.outside = !kept;
  o.lp = kept ? (scaled(xl, inv_t) - m) - log_sk : -INFINITY;
  o.lse = m + log_sk;
  o.ent = trunc ? log_sk - u_k / s_k : stats_entropy(st);
  o.sum_p2 = trunc ? e2_k / (s_k * s_k) : rs.e2 / (st.s * st.s);
  for (int64_t i = 0; i < a.stats_top_k; ++i) {
    const BandItem<float>& it = ws.ranked.at(i);
    top_ids[i] = it.j;
    top_lp[i] = !trunc || in_kept_set(it.x, it.j, w.cut, w.cut_index) ? it.nd - log_sk : -INFINITY;
  }
  return o;
}

}  // namespace cpu
}  // namespace ppo_kernels
