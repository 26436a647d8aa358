// gae: the AVX2 lane code of the CPU kernel (csrc/cpu/gae.cpp). A group of kLanes tasks (rows or
// chunks of rows) runs in the kLanes float lanes of one __m256: lane k belongs to task k, and each
// instruction advances the kLanes independent recursions by one position. Inputs come in as
// kLanes x kLanes tiles of [task, time] transposed into [time, task]; outputs leave transposed
// back. The operations are exactly gae_step's / gae_compose's (no FMA), so every lane gives the
// scalar kernel's bits.
//
// Include only from gae.cpp, after its fp-contract pragma: vector intrinsics are plain float
// arithmetic to the compiler, which would otherwise fuse a multiply and an add.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/gae_combine.h"

namespace ppo_kernels {
namespace gae_avx2 {

constexpr int kLanes = 8;  // float32 lanes of an AVX2 vector

// _mm256_permute2f128 selectors: the low (high) 128-bit halves of a and b, in that order.
constexpr int kLowHalves = 0x20;
constexpr int kHighHalves = 0x31;

// Transposes the 8x8 tile x in place (x[i] lane k <-> x[k] lane i).
inline void transpose8(__m256 (&x)[kLanes]) {
  __m256 t[kLanes], u[kLanes];
  for (int i = 0; i < kLanes; i += 2) {
    t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
  }
  for (int i = 0; i < kLanes; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < kLanes / 2; ++i) {
    x[i] = _mm256_permute2f128_ps(u[i], u[i + 4], kLowHalves);
    x[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], kHighHalves);
  }
}

// 8 consecutive elements as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const double* p) {  // rounded to float32 like static_cast<float>
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)),
                         _mm256_cvtpd_ps(_mm256_loadu_pd(p)));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the high half of a float32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// 8 flags as all-ones (nonzero, NaN included, like `x != 0`) or all-zeros lanes.
inline __m256 flags8(const uint8_t* p) {
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(
      _mm256_xor_si256(_mm256_cmpeq_epi32(w, _mm256_setzero_si256()), _mm256_set1_epi32(-1)));
}
inline __m256 flags8(const float* p) {
  return _mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_NEQ_UQ);
}

// The 8 bool flags at p + base[k] of each task k as bytes 0/1 (any nonzero byte counts as 1):
// byte j of lane k of lo is flag j of task k, hi holds flags 4..7. Cheaper than a transpose.
inline void flag_tile(const uint8_t* p, const int64_t* base, __m256i& lo, __m256i& hi) {
  int64_t w[kLanes];
  for (int k = 0; k < kLanes; ++k) std::memcpy(&w[k], p + base[k], kLanes);
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // low dwords, then high
  const __m256i a = _mm256_permutevar8x32_epi32(_mm256_setr_epi64x(w[0], w[1], w[2], w[3]), split);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_setr_epi64x(w[4], w[5], w[6], w[7]), split);
  const __m256i one = _mm256_set1_epi8(1);
  lo = _mm256_min_epu8(_mm256_permute2x128_si256(a, b, kLowHalves), one);
  hi = _mm256_min_epu8(_mm256_permute2x128_si256(a, b, kHighHalves), one);
}
// Flag j of a flag_tile in the sign bit of each lane (all blendv reads): the 0/1 of byte j & 3
// of the dword shifted from its bit 8 * (j & 3) up to bit 31.
inline __m256 flag_at(const __m256i& lo, const __m256i& hi, int j) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(j < 4 ? lo : hi, 31 - 8 * (j & 3)));
}

// Loads an 8x8 tile: x[j] lane k = p[base[k] + j].
template <typename T, typename L>
inline void tile_in(const T* p, const int64_t* base, __m256 (&x)[kLanes], L load) {
  for (int k = 0; k < kLanes; ++k) x[k] = load(p + base[k]);
  transpose8(x);
}

// The vector form of GaeMap (gae_combine.h), one map per lane.
struct GaeMap8 {
  __m256 p, q, m, cv, ca;
};

// The lane code of gae.cpp's Kernel<scalar_t, mask_t, kMask, kDones, kTokenGL> (K below): it reads
// K's inputs (r, v, mk, dn, gt, lt, gamma, lam, gl) and finishes each task's left end, shorter
// than a tile, with K's scalar step() / element(). Tasks k are positions [lo[k], hi[k]).
template <typename scalar_t, typename mask_t, bool kMask, bool kDones, bool kTokenGL>
struct Lanes {
  static constexpr bool kFloatMask = std::is_same_v<mask_t, float>;

  // One 8x8 tile of every input: lane k of x[j] is position base[k] + j of task k.
  // Masks and dones are sign-bit lane masks: action(x, j), done(x, j).
  struct Tile {
    __m256 r[kLanes], v[kLanes], m[kLanes], g[kLanes], l[kLanes];
    __m256i mlo, mhi, dlo, dhi;
  };

  template <typename K>
  static void load_tile(const K& k, const int64_t* base, Tile& x) {
    tile_in(k.r, base, x.r, [](const scalar_t* p) { return load8(p); });
    tile_in(k.v, base, x.v, [](const scalar_t* p) { return load8(p); });
    if constexpr (kMask && kFloatMask)
      tile_in(k.mk, base, x.m, [](const float* p) { return flags8(p); });
    if constexpr (kMask && !kFloatMask) flag_tile(k.mk, base, x.mlo, x.mhi);
    if (kDones) flag_tile(k.dn, base, x.dlo, x.dhi);
    if (kTokenGL) {
      tile_in(k.gt, base, x.g, [](const float* p) { return load8(p); });
      tile_in(k.lt, base, x.l, [](const float* p) { return load8(p); });
    }
  }
  static __m256 action(const Tile& x, int j) {
    if constexpr (kFloatMask)
      return x.m[j];
    else
      return flag_at(x.mlo, x.mhi, j);
  }
  static __m256 done(const Tile& x, int j) { return flag_at(x.dlo, x.dhi, j); }

  // The shortest task's length in whole tiles: the positions every lane runs vectorised.
  static int64_t whole_tiles(const int64_t* lo, const int64_t* hi) {
    int64_t len = hi[0] - lo[0];
    for (int k = 1; k < kLanes; ++k) len = std::min(len, hi[k] - lo[k]);
    return len / kLanes;
  }

  // K::run over the kLanes tasks from their carries s[k]: the rightmost kLanes * whole_tiles
  // positions of each task run vectorised, the rest of each task (its left end) with the scalar
  // step. Writes adv and ret; leaves in s[k] the state at each task's left edge. Lanes k >= n are
  // padding (copies of real tasks: they store the same bytes to the same places).
  template <typename K>
  static void run(const K& k, const int64_t* lo, const int64_t* hi, int n, GaeState* s, float* adv,
                  float* ret) {
    const int64_t nblk = whole_tiles(lo, hi);
    alignas(32) float nv0[kLanes], a0[kLanes];
    for (int i = 0; i < kLanes; ++i) nv0[i] = s[i].nv, a0[i] = s[i].adv;
    __m256 NV = _mm256_load_ps(nv0), A = _mm256_load_ps(a0);
    const __m256 G = _mm256_set1_ps(k.gamma), GL = _mm256_set1_ps(k.gl);
    int64_t base[kLanes];
    Tile x;
    for (int64_t b = 1; b <= nblk; ++b) {
      for (int i = 0; i < kLanes; ++i) base[i] = hi[i] - kLanes * b;
      load_tile(k, base, x);
      __m256 oa[kLanes], orr[kLanes];
      for (int j = kLanes - 1; j >= 0; --j) {
        if (kDones) {
          const __m256 d = done(x, j);
          NV = _mm256_blendv_ps(NV, _mm256_setzero_ps(), d);
          A = _mm256_blendv_ps(A, _mm256_setzero_ps(), d);
        }
        const __m256 g = kTokenGL ? x.g[j] : G;
        const __m256 glj = kTokenGL ? _mm256_mul_ps(x.g[j], x.l[j]) : GL;
        const __m256 delta = _mm256_sub_ps(_mm256_add_ps(x.r[j], _mm256_mul_ps(g, NV)), x.v[j]);
        const __m256 an = _mm256_add_ps(delta, _mm256_mul_ps(glj, A));
        if (kMask) {
          const __m256 act = action(x, j);
          NV = _mm256_blendv_ps(NV, x.v[j], act);
          A = _mm256_blendv_ps(A, an, act);
        } else {
          NV = x.v[j];
          A = an;
        }
        oa[j] = A;
        orr[j] = _mm256_add_ps(A, x.v[j]);
      }
      transpose8(oa);
      transpose8(orr);
      for (int i = 0; i < kLanes; ++i) {
        _mm256_storeu_ps(adv + base[i], oa[i]);
        _mm256_storeu_ps(ret + base[i], orr[i]);
      }
    }
    _mm256_store_ps(nv0, NV);
    _mm256_store_ps(a0, A);
    for (int i = 0; i < n; ++i) {
      GaeState st{nv0[i], a0[i]};
      for (int64_t t = hi[i] - kLanes * nblk - 1; t >= lo[i]; --t) st = k.step(t, st, adv, ret);
      s[i] = st;
    }
  }

  // K::compose over the kLanes tasks (each task's composed map into f[k]): gae_element and
  // gae_compose with their operations; the left ends with the scalar element().
  template <typename K>
  static void compose(const K& k, const int64_t* lo, const int64_t* hi, int n, GaeMap* f) {
    const int64_t nblk = whole_tiles(lo, hi);
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    const __m256 G = _mm256_set1_ps(k.gamma), L = _mm256_set1_ps(k.lam);
    GaeMap8 acc{one, zero, one, zero, zero};  // gae_identity()
    int64_t base[kLanes];
    Tile x;
    for (int64_t b = 1; b <= nblk; ++b) {
      for (int i = 0; i < kLanes; ++i) base[i] = hi[i] - kLanes * b;
      load_tile(k, base, x);
      for (int j = kLanes - 1; j >= 0; --j) {
        const __m256 kk = kDones ? _mm256_blendv_ps(one, zero, done(x, j)) : one;
        const __m256 g = kTokenGL ? x.g[j] : G;
        const __m256 l = kTokenGL ? x.l[j] : L;
        GaeMap8 e{zero, _mm256_mul_ps(g, kk), _mm256_mul_ps(_mm256_mul_ps(g, l), kk), x.v[j],
                  _mm256_sub_ps(x.r[j], x.v[j])};
        if (kMask) {
          const __m256 act = action(x, j);
          e.p = _mm256_blendv_ps(kk, zero, act);
          e.q = _mm256_blendv_ps(zero, e.q, act);
          e.m = _mm256_blendv_ps(kk, e.m, act);
          e.cv = _mm256_blendv_ps(zero, e.cv, act);
          e.ca = _mm256_blendv_ps(zero, e.ca, act);
        }
        acc = {_mm256_mul_ps(e.p, acc.p),
               _mm256_add_ps(_mm256_mul_ps(e.q, acc.p), _mm256_mul_ps(e.m, acc.q)),
               _mm256_mul_ps(e.m, acc.m), _mm256_add_ps(_mm256_mul_ps(e.p, acc.cv), e.cv),
               _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(e.q, acc.cv), _mm256_mul_ps(e.m, acc.ca)),
                             e.ca)};
      }
    }
    alignas(32) float p[kLanes], q[kLanes], m[kLanes], cv[kLanes], ca[kLanes];
    _mm256_store_ps(p, acc.p);
    _mm256_store_ps(q, acc.q);
    _mm256_store_ps(m, acc.m);
    _mm256_store_ps(cv, acc.cv);
    _mm256_store_ps(ca, acc.ca);
    for (int i = 0; i < n; ++i) {
      GaeMap fi{p[i], q[i], m[i], cv[i], ca[i]};
      for (int64_t t = hi[i] - kLanes * nblk - 1; t >= lo[i]; --t)
        fi = gae_compose(fi, k.element(t));
      f[i] = fi;
    }
  }
};

}  // namespace gae_avx2
}  // namespace ppo_kernels
