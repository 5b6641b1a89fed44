// Slash-line attention on the CPU: the slash part of vertical/slash prefill attention.
//
// For query row r (position p = p0 + r) the cells are (p, p - d_j) for the selected
// slash offsets d_j <= p, except on columns owned by another part (the selected
// verticals), plus (p, c) for the "tail" columns c <= p: the verticals inside the row
// block, which the caller's unmasked vertical call (columns <= p0) cannot take. Per
// row: the softmax over these cells of q.k, times V, and the row's log-sum-exp, so
// the caller merges the parts exactly.
//
// One row at a time (rows split over threads): the row's keys are gathered as a list
// (owned columns dropped, so no work is spent on them), then
//   scores: 16 keys at a time, each dot product is D/16 vector multiply-adds over a
//           contiguous key row, and a transpose-reduce tree turns the 16 partial
//           vectors into one vector of 16 scores (no scalar horizontal sums);
//   softmax: exact and two-pass over the row's scores, its exp a polynomial the
//           compiler vectorises;
//   P.V:    each value row is loaded once for the lg query heads of its KV head and
//           accumulated in registers.
// K and V stay in their natural [K, D] layout, fp32 (the wrapper converts one KV head
// per call; converting bf16 rows in the loop measured 2x slower): every access is a
// contiguous row. Portable C++ (GCC/Clang vector extensions) built by
// torch.utils.cpp_extension on first use with -O3 -march=native; the torch reference
// is vslash_attention_ref (reference.py), the tests compare the two.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int W = 16;  // fp32 lanes per vector
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf splat(float x) { return vf{} + x; }
inline vf ld(const float* p) { vf r; std::memcpy(&r, p, sizeof(r)); return r; }
inline void st(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

// e^x lane-wise for x <= 0 (scores minus their row max): 2^(x log2 e), a degree-6
// polynomial on the fraction (relative error < 3e-7); exactly 0 below -87.
inline vf exp_nonpos(vf x) {
  const vi zero = !(x >= -87.0f);
  x = zero ? splat(0.f) : x;
  const vf t = x * 1.44269504088896341f;
  vf fi;
  for (int l = 0; l < W; ++l) fi[l] = __builtin_floorf(t[l]);
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

// Sums of 16 vectors, one per lane: a four-level fold, each level halving every
// vector's live lanes and merging two vectors into one; lanes come out bit-reversed.
inline vf fold(vf x, vf y, vi lo, vi hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}
inline vf reduce16(const vf* a) {
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

// q [LG, R, D] fp32 scaled; k, v [K, D] (row stride D); owned [K] (1: skip the
// column); slash [m] sorted ascending; tail [nt] sorted columns. out [LG, R, D],
// lse [LG, R].
template <int D, int LG>
void run(const float* q, const float* k, const float* v, const uint8_t* owned,
         const int64_t* slash, int64_t m, const int64_t* tail, int64_t nt, int64_t R,
         int64_t p0, float* out, float* lse) {
  constexpr int U = D / W;  // vectors per row
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    const int64_t mp = (m + nt + W - 1) / W * W;
    std::vector<int64_t> cols(mp);
    std::vector<float> s(static_cast<size_t>(LG) * mp);
    int64_t reach = 0, seen = 0;  // slashes with d <= p, tail columns <= p
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t p = p0 + r;
      while (reach < m && slash[reach] <= p) ++reach;
      while (seen < nt && tail[seen] <= p) ++seen;
      int64_t c = 0;
      for (int64_t j = 0; j < reach; ++j) {
        const int64_t col = p - slash[j];
        cols[c] = col;
        c += owned[col] == 0;
      }
      for (int64_t j = 0; j < seen; ++j) cols[c++] = tail[j];
      if (c == 0) {
        for (int h = 0; h < LG; ++h) {
          std::memset(out + (h * R + r) * D, 0, sizeof(float) * D);
          lse[h * R + r] = NEG_INF;
        }
        continue;
      }
      const int64_t cp = (c + W - 1) / W * W;
      for (int64_t i = c; i < cp; ++i) cols[i] = cols[c - 1];  // pad: repeat, masked below
      vf qv[LG][U];
      for (int h = 0; h < LG; ++h)
        for (int u = 0; u < U; ++u) qv[h][u] = ld(q + (h * R + r) * D + u * W);
      for (int64_t j0 = 0; j0 < cp; j0 += W) {  // scores of 16 keys per head
        for (int h = 0; h < LG; ++h) {
          vf acc[W];
          for (int jj = 0; jj < W; ++jj) {
            const float* kr = k + cols[j0 + jj] * D;
            vf a = qv[h][0] * ld(kr);
            for (int u = 1; u < U; ++u) a += qv[h][u] * ld(kr + u * W);
            acc[jj] = a;
          }
          st(s.data() + h * mp + j0, reduce16(acc));
        }
      }
      float sum[LG], base[LG];
      for (int h = 0; h < LG; ++h) {
        float* sh = s.data() + h * mp;
        for (int64_t i = c; i < cp; ++i) sh[i] = NEG_INF;
        vf mx = splat(NEG_INF);
        for (int64_t j0 = 0; j0 < cp; j0 += W) {
          const vf x = ld(sh + j0);
          mx = x > mx ? x : mx;
        }
        float b = mx[0];
        for (int l = 1; l < W; ++l) b = mx[l] > b ? mx[l] : b;
        vf acc = splat(0.f);
        for (int64_t j0 = 0; j0 < cp; j0 += W) {
          const vf e = exp_nonpos(ld(sh + j0) - b);
          st(sh + j0, e);
          acc += e;
        }
        float t = 0.f;
        for (int l = 0; l < W; ++l) t += acc[l];
        sum[h] = t;
        base[h] = b;
      }
      vf o[LG][U];
      for (int h = 0; h < LG; ++h)
        for (int u = 0; u < U; ++u) o[h][u] = splat(0.f);
      for (int64_t j = 0; j < c; ++j) {  // each value row once for the LG heads
        const float* vr = v + cols[j] * D;
        vf vv[U];
        for (int u = 0; u < U; ++u) vv[u] = ld(vr + u * W);
        for (int h = 0; h < LG; ++h) {
          const float w = s[h * mp + j];
          for (int u = 0; u < U; ++u) o[h][u] += w * vv[u];
        }
      }
      for (int h = 0; h < LG; ++h) {
        const float inv = 1.f / sum[h];
        for (int u = 0; u < U; ++u) st(out + (h * R + r) * D + u * W, o[h][u] * inv);
        lse[h * R + r] = base[h] + std::log(sum[h]);
      }
    }
  });
}

template <int D>
bool dispatch(int64_t lg, const float* q, const float* k, const float* v, const uint8_t* owned,
              const int64_t* slash, int64_t m, const int64_t* tail, int64_t nt, int64_t R,
              int64_t p0, float* out, float* lse) {
  switch (lg) {
#define SGL_SPEC_LG(N) \
  case N: run<D, N>(q, k, v, owned, slash, m, tail, nt, R, p0, out, lse); return true;
    SGL_SPEC_LG(1) SGL_SPEC_LG(2) SGL_SPEC_LG(3) SGL_SPEC_LG(4)
    SGL_SPEC_LG(5) SGL_SPEC_LG(6) SGL_SPEC_LG(7) SGL_SPEC_LG(8)
#undef SGL_SPEC_LG
    default: return false;
  }
}

bool dispatch_d(int64_t D, int64_t lg, const float* q, const float* k, const float* v,
                const uint8_t* owned, const int64_t* slash, int64_t m, const int64_t* tail,
                int64_t nt, int64_t R, int64_t p0, float* out, float* lse) {
  switch (D) {
    case 16: return dispatch<16>(lg, q, k, v, owned, slash, m, tail, nt, R, p0, out, lse);
    case 32: return dispatch<32>(lg, q, k, v, owned, slash, m, tail, nt, R, p0, out, lse);
    case 64: return dispatch<64>(lg, q, k, v, owned, slash, m, tail, nt, R, p0, out, lse);
    case 128: return dispatch<128>(lg, q, k, v, owned, slash, m, tail, nt, R, p0, out, lse);
  }
  return false;
}

}  // namespace

// q [lg, R, D] fp32 (scaled), k/v [K, D] fp32,
// owned [K] uint8, slash [m] int64 sorted offsets, tail [nt] int64 sorted columns
// (disjoint from the slash cells: owned), p0 the first row's position.
// Returns (out [lg, R, D], lse [lg, R]), fp32; rows with no cell: 0 and -inf.
std::vector<at::Tensor> slash_attention(at::Tensor q, at::Tensor k, at::Tensor v,
                                        at::Tensor owned, at::Tensor slash, at::Tensor tail,
                                        int64_t p0) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 2 && v.dim() == 2 && owned.dim() == 1,
              "slash_attention: q [lg, R, D], k/v [K, D], owned [K]");
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == at::kFloat, "q: contiguous fp32");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k, v: fp32");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k, v: contiguous");
  TORCH_CHECK(owned.scalar_type() == at::kByte && owned.is_contiguous(), "owned: uint8");
  TORCH_CHECK(slash.scalar_type() == at::kLong && slash.is_contiguous(), "slash: int64");
  TORCH_CHECK(tail.scalar_type() == at::kLong && tail.is_contiguous(), "tail: int64");
  for (const auto& t : {q, k, v, owned, slash, tail}) TORCH_CHECK(t.device().is_cpu(), "CPU tensors");
  const int64_t lg = q.size(0), R = q.size(1), D = q.size(2), K = k.size(0), m = slash.numel(),
                nt = tail.numel();
  TORCH_CHECK(k.size(1) == D && v.size(0) == K && v.size(1) == D && owned.size(0) == K,
              "slash_attention: q, k, v, owned disagree");
  TORCH_CHECK(p0 >= 0 && p0 + R <= K, "slash_attention: rows past the last key");
  if (m) {
    const int64_t* sl = slash.data_ptr<int64_t>();
    TORCH_CHECK(sl[0] >= 0, "slash_attention: negative offset");
  }
  if (nt) {
    const int64_t* tl = tail.data_ptr<int64_t>();
    TORCH_CHECK(tl[0] >= 0 && tl[nt - 1] < K, "slash_attention: tail column out of range");
  }
  auto out = at::empty({lg, R, D}, q.options());
  auto lse = at::empty({lg, R}, q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* op = owned.data_ptr<uint8_t>();
  const int64_t *sp = slash.data_ptr<int64_t>(), *tp = tail.data_ptr<int64_t>();
  float *o = out.data_ptr<float>(), *l = lse.data_ptr<float>();
  const bool ok = dispatch_d(D, lg, qp, k.data_ptr<float>(), v.data_ptr<float>(), op,
                                    sp, m, tp, nt, R, p0, o, l);
  TORCH_CHECK(ok, "slash_attention: head_dim in {16, 32, 64, 128} and 1..8 query heads per line "
              "head, got head_dim ", D, ", ", lg);
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("slash_attention", &slash_attention, "slash-line attention (out, lse)");
}
