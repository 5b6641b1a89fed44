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
//   scores: W keys at a time (W the vector width), each dot product D/W vector
//           multiply-adds over a contiguous key row, and a transpose-reduce turns the W
//           partial vectors into one vector of W scores (no scalar horizontal sums);
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
#include <vector>

#include "vec16.h"

namespace {

using namespace sgl_spec_vec;

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
      for (int64_t j0 = 0; j0 < cp; j0 += W) {  // scores of W keys per head
        for (int h = 0; h < LG; ++h) {
          vf acc[W];
          for (int jj = 0; jj < W; ++jj) {
            const float* kr = k + cols[j0 + jj] * D;
            vf a = qv[h][0] * ld(kr);
            for (int u = 1; u < U; ++u) a += qv[h][u] * ld(kr + u * W);
            acc[jj] = a;
          }
          st(s.data() + h * mp + j0, reduce_lanes(acc));
        }
      }
      float sum[LG], base[LG];
      for (int h = 0; h < LG; ++h) {
        float* sh = s.data() + h * mp;
        for (int64_t i = c; i < cp; ++i) sh[i] = NEG_INF;
        const RowExp e = exp_row(sh, cp);
        sum[h] = e.sum;
        base[h] = e.base;
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
