// fp32 vector helpers shared by sgl_spec's CPU kernels (GCC/Clang vector extensions;
// built with -O3 -march=native). W is the machine's vector width: 16 lanes with
// AVX-512, 8 with AVX2 (GCC lowers a 16-lane generic vector on AVX2 badly: splats and
// accumulators go through the stack lane by lane; the decode kernel ran ~3x slower).
// Kernels are written for any W. Header-only: each kernel source includes it.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define SGL_SPEC_W 8
#else
#define SGL_SPEC_W 16
#endif

namespace sgl_spec_vec {

constexpr int W = SGL_SPEC_W;  // fp32 lanes per vector
typedef float vf __attribute__((vector_size(4 * SGL_SPEC_W)));
typedef int32_t vi __attribute__((vector_size(4 * SGL_SPEC_W)));
typedef uint16_t vh __attribute__((vector_size(2 * SGL_SPEC_W)));
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf splat(float x) { return vf{} + x; }
inline vf ld(const float* p) { vf r; std::memcpy(&r, p, sizeof(r)); return r; }
inline void st(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

// W bf16 values (raw 16-bit patterns) widened to fp32: the bits shifted up by 16.
inline vf ld_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vi bits = __builtin_convertvector(h, vi) << 16;
  vf r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

// W IEEE half values widened to fp32 (F16C / AVX-512 conversions).
inline vf ld_f16(const uint16_t* p) {
  typedef _Float16 vhf __attribute__((vector_size(2 * SGL_SPEC_W)));
  vhf h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vf);
}

inline float hmax(vf x) {
  float b = x[0];
  for (int l = 1; l < W; ++l) b = x[l] > b ? x[l] : b;
  return b;
}

inline float hsum(vf x) {
  float t = 0.f;
  for (int l = 0; l < W; ++l) t += x[l];
  return t;
}

// e^x lane-wise for x <= 0 (scores minus their row max): 2^(x log2 e), a degree-6
// polynomial on the fraction (relative error < 3e-7); exactly 0 below -87.
inline vf exp_nonpos(vf x) {
  const vi zero = !(x >= -87.0f);
  x = zero ? splat(0.f) : x;
  const vf t = x * 1.44269504088896341f;
  // floor(t), vectorised: truncate toward zero, then step down where that rounded up.
  const vf tr = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  const vf fi = tr > t ? tr - 1.0f : tr;
  const vf f = t - fi;
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(fi, vi) + 127) << 23;
  vf s;
  std::memcpy(&s, &bits, sizeof(s));
  return zero ? splat(0.f) : p * s;
}

// In place over a row of scores (padded to a multiple of W, padding -inf): the row's
// max, then e^(s - max) for every entry; returns {max, sum of the exponentials}.
struct RowExp {
  float base, sum;
};
inline RowExp exp_row(float* s, int64_t padded) {
  vf mx = splat(NEG_INF);
  for (int64_t j = 0; j < padded; j += W) {
    const vf x = ld(s + j);
    mx = x > mx ? x : mx;
  }
  const float base = hmax(mx);
  vf acc = splat(0.f);
  for (int64_t j = 0; j < padded; j += W) {
    const vf e = exp_nonpos(ld(s + j) - base);
    st(s + j, e);
    acc += e;
  }
  return {base, hsum(acc)};
}

// reduce_lanes(a): lane j holds the sum of a[j]'s lanes, for W vectors a[0..W).
#if SGL_SPEC_W == 8
// Three levels of hadd and a lane swap: [a0..a3 sums | a4..a7 sums] in order.
inline vf reduce_lanes(const vf* a) {
  __m256 v[8];
  std::memcpy(v, a, sizeof(v));
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                 _mm256_permute2f128_ps(u0, u1, 0x31));
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}
#else
// A four-level fold, each level halving every vector's live lanes and merging two
// vectors into one; lanes come out bit-reversed, and a last shuffle orders them.
inline vf fold(vf x, vf y, vi lo, vi hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}
inline vf reduce_lanes(const vf* a) {
  const vi l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi h1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi l2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi h2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const vi l3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi h3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi l4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi h4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const vi rev = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], l1, h1);
  for (int i = 0; i < 4; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], l2, h2);
  for (int i = 0; i < 2; ++i) d[i] = fold(c[2 * i], c[2 * i + 1], l3, h3);
  return __builtin_shuffle(fold(d[0], d[1], l4, h4), rev);
}
#endif

}  // namespace sgl_spec_vec
