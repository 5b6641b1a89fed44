// Decode attention over a KV subset, read straight from the paged KV pool (CPU).
//
// The subset contract is kernels/sparse_decode/common.py's: for request b and KV head
// h the attended positions are the virtual list
//     sink [0, S_b) | selection sel_idx[b, h, :sel_len[b, h]] | recent [R_b, seq_len_b)
// with S_b = min(sink, seq_len_b) and R_b = max(recent_start_b, S_b); a dense row is
// sink 0, no selection, recent_start 0. Position p of request b lives in pool slot
// req_to_token[rows[b], p]; its key is k_buf[slot, h, :].
//
// Work items are (b, h, chunk of CHUNK list entries), so one long request still keeps
// every thread busy (split-K). An item maps its entries to pool rows, computes the
// scores of its G query heads (W keys at a time, W the vector width: D/W multiply-adds
// per key row, converted from bf16/fp16 once for the G heads, then a transpose-reduce
// into W scores), an exact softmax over the chunk, and P.V one head at a time (its
// accumulators in registers); it keeps its max, sum and unnormalised output. A second
// pass merges the chunks of each (b, h) by their maxima. No K/V is gathered or copied.
// The torch reference is reference.sparse_decode_reference; the tests compare the two.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace {

using namespace sgl_spec_vec;

constexpr int64_t CHUNK = 256;  // list entries per work item (a multiple of W)

enum Kind { F32 = 0, BF16 = 1, F16 = 2 };

template <int KIND>
inline vf ld_kv(const void* p, int64_t off) {
  if constexpr (KIND == F32) return ld(static_cast<const float*>(p) + off);
  else if constexpr (KIND == BF16) return ld_bf16(static_cast<const uint16_t*>(p) + off);
  else return ld_f16(static_cast<const uint16_t*>(p) + off);
}

struct Subsets {
  const int32_t* r2t;
  int64_t r2t_stride;
  const int64_t* rows;          // [B]
  const int64_t* seq_lens;      // [B]
  const int64_t* sel;           // [B, Hkv, S]
  int64_t sel_sb, sel_sh;       // its strides
  const int64_t* sel_len;       // [B, Hkv]
  const int64_t* recent_start;  // [B]
  int64_t sink, hkv;

  // Entries of (b, h)'s list, and where its three parts start.
  inline int64_t length(int64_t b, int64_t h, int64_t* s_end, int64_t* recent) const {
    const int64_t n = seq_lens[b];
    *s_end = std::min(sink, n);
    *recent = std::max(recent_start[b], *s_end);
    return *s_end + sel_len[b * hkv + h] + (n - *recent);
  }
};

struct Pools {
  const void* k;
  const void* v;
  int64_t ks0, ks1, vs0, vs1;  // element strides of [slots, Hkv, D]
};

// Prefetch a K/V row (D elements of KV's width) into the caches.
template <int D, int KIND>
inline void prefetch_row(const void* base, int64_t off) {
  constexpr int BYTES = D * (KIND == F32 ? 4 : 2);
  const char* p = static_cast<const char*>(base) + off * (KIND == F32 ? 4 : 2);
  for (int b = 0; b < BYTES; b += 64) __builtin_prefetch(p + b);
}

// Scores of the W keys at element offsets krow[0..W) for the G query heads qv:
// s[g * stride + jj] = q_g . k_jj. Prefetches the next W rows (krow[W..2W) must exist).
template <int D, int G, int KIND>
inline void score_block(const vf (&qv)[G][D / W], const void* k, const int64_t* krow, float* s,
                        int64_t stride) {
  constexpr int U = D / W;
  vf acc[G][W];
  for (int jj = 0; jj < W; ++jj) prefetch_row<D, KIND>(k, krow[W + jj]);
  for (int jj = 0; jj < W; ++jj) {
    vf kr[U];
    for (int u = 0; u < U; ++u) kr[u] = ld_kv<KIND>(k, krow[jj] + u * W);
    for (int g = 0; g < G; ++g) {
      vf a = qv[g][0] * kr[0];
      for (int u = 1; u < U; ++u) a += qv[g][u] * kr[u];
      acc[g][jj] = a;
    }
  }
  for (int g = 0; g < G; ++g) st(s + g * stride, reduce_lanes(acc[g]));
}

template <int D, int G, int KIND>
void run(const float* q, const Pools& kv, const Subsets& ix, int64_t B, int64_t nc, float* out) {
  constexpr int U = D / W;
  const int64_t hkv = ix.hkv;
  const int64_t items = B * hkv * nc;  // item (b, h, c) at (b * hkv + h) * nc + c
  std::vector<float> pm(items * G, NEG_INF), pl(items * G, 0.f), po(items * G * D);
  // The non-empty items, chunk-major, dealt round-robin to the threads: a long
  // request's chunks spread over all of them, whatever the mix of lengths.
  std::vector<int64_t> work;
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t bh = 0; bh < B * hkv; ++bh) {
      int64_t s_end, recent;
      if (c * CHUNK < ix.length(bh / hkv, bh % hkv, &s_end, &recent)) work.push_back(bh * nc + c);
    }
  const int64_t nw = static_cast<int64_t>(work.size());
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), nw);
  at::parallel_for(0, nt, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int64_t> krow(CHUNK + W), vrow(CHUNK);
    std::vector<float> s(G * CHUNK);
    for (int64_t w = w0; w < w1; ++w)
    for (int64_t wi = w; wi < nw; wi += nt) {
      const int64_t it = work[wi];
      const int64_t c = it % nc, bh = it / nc, h = bh % hkv, b = bh / hkv;
      int64_t s_end, recent;
      const int64_t n = ix.length(b, h, &s_end, &recent);
      const int64_t j0 = c * CHUNK, m = std::min(n, j0 + CHUNK) - j0;
      float* im = pm.data() + it * G;
      float* il = pl.data() + it * G;
      const int64_t sel_end = s_end + ix.sel_len[b * hkv + h];
      const int32_t* r2t = ix.r2t + ix.rows[b] * ix.r2t_stride;
      const int64_t* sel = ix.sel + b * ix.sel_sb + h * ix.sel_sh;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t e = j0 + j;
        const int64_t pos = e < s_end ? e : (e < sel_end ? sel[e - s_end] : recent + (e - sel_end));
        const int64_t slot = r2t[pos];
        krow[j] = slot * kv.ks0 + h * kv.ks1;
        vrow[j] = slot * kv.vs0 + h * kv.vs1;
      }
      const int64_t mp = (m + W - 1) / W * W;
      for (int64_t j = m; j < mp + W; ++j) krow[j] = krow[m - 1];  // pad: repeat, masked below
      vf qv[G][U];
      const float* qb = q + (b * hkv + h) * G * D;
      for (int g = 0; g < G; ++g)
        for (int u = 0; u < U; ++u) qv[g][u] = ld(qb + g * D + u * W);
      for (int64_t t0 = 0; t0 < mp; t0 += W)  // scores of W keys for the G heads
        score_block<D, G, KIND>(qv, kv.k, krow.data() + t0, s.data() + t0, CHUNK);
      for (int g = 0; g < G; ++g) {
        float* sg = s.data() + g * CHUNK;
        for (int64_t j = m; j < mp; ++j) sg[j] = NEG_INF;
        const RowExp e = exp_row(sg, mp);
        im[g] = e.base;
        il[g] = e.sum;
      }
      // P.V one query head at a time: its U accumulators stay in registers (all G
      // heads' at once spill on AVX2's 16 registers, ~3x slower); the chunk's value
      // rows (<= CHUNK x D) are re-read from L1/L2 by the later heads.
      float* io = po.data() + it * G * D;
      for (int64_t j = 0; j < std::min<int64_t>(m, W); ++j) prefetch_row<D, KIND>(kv.v, vrow[j]);
      for (int g = 0; g < G; ++g) {
        vf o[U];
        for (int u = 0; u < U; ++u) o[u] = splat(0.f);
        const float* sg = s.data() + g * CHUNK;
        for (int64_t j = 0; j < m; ++j) {
          if (g == 0 && j + W < m) prefetch_row<D, KIND>(kv.v, vrow[j + W]);
          const vf w = splat(sg[j]);
          for (int u = 0; u < U; ++u) o[u] += w * ld_kv<KIND>(kv.v, vrow[j] + u * W);
        }
        for (int u = 0; u < U; ++u) st(io + g * D + u * W, o[u]);
      }
    }
  });
  // Merge the chunks of each (b, h, g) by their maxima.
  at::parallel_for(0, B * hkv, 16, [&](int64_t a, int64_t z) {
    for (int64_t bh = a; bh < z; ++bh) {
      for (int g = 0; g < G; ++g) {
        float mx = NEG_INF;
        for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, pm[(bh * nc + c) * G + g]);
        float total = 0.f;
        vf acc[U];
        for (int u = 0; u < U; ++u) acc[u] = splat(0.f);
        for (int64_t c = 0; c < nc; ++c) {
          const int64_t it = bh * nc + c;
          if (pl[it * G + g] == 0.f) continue;
          const float w = std::exp(pm[it * G + g] - mx);
          total += w * pl[it * G + g];
          for (int u = 0; u < U; ++u) acc[u] += w * ld(po.data() + (it * G + g) * D + u * W);
        }
        const float inv = 1.f / total;
        for (int u = 0; u < U; ++u) st(out + (bh * G + g) * D + u * W, acc[u] * inv);
      }
    }
  });
}

using RunFn = void (*)(const float*, const Pools&, const Subsets&, int64_t, int64_t, float*);

// The retrieval head's logits (SpeContext): for row r, KV head h and query head g of its
// group, out[r, h, g, j] = q[r, h * G + g] . keys[slot(r, j), h] for positions j < n_r,
// -inf for n_r <= j < N. Work items are (r, h, chunk of CHUNK positions).
// Attention mass of each history position (LoopServe's Eq. 7, SnapKV's window score;
// reference: sgl_spec.sparse.scoring.score_history's torch path). For row r and KV head
// h, query slot i of q[r, h] (an observation query and query head of h's group) sees the
// keys j < lim[r, i]; out[r, h, j] = sum_i softmax_i(j), the softmax over what i sees.
// Work items are (r, h, chunk of CHUNK keys): the chunk's logits for every query slot
// (QG at a time), their exponentials against the chunk's own max, kept with that max and
// their sum; then per (r, h) the chunks' maxima and sums give each (chunk, slot) its
// weight, and each item sums its kept exponentials by those weights. The keys are read
// once, in place (bf16/fp16 converted in registers); no logits matrix is written out.
constexpr int QG = 8;  // query slots scored per pass over a chunk's keys

template <int D, int KIND>
void mass(const float* q, int64_t nq, const void* keys, int64_t ks0, int64_t ks1, int64_t ks2,
          const int64_t* lim, int64_t R, int64_t hkv, int64_t N, float* out) {
  const int64_t nc = (N + CHUNK - 1) / CHUNK, items = R * hkv * nc;
  std::vector<float> pm(items * nq, NEG_INF), pl(items * nq, 0.f), e(items * nq * CHUNK);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> krow(CHUNK + 2 * W);
    std::vector<float> s(QG * (CHUNK + W));
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t c = it % nc, rh = it / nc, h = rh % hkv, r = rh / hkv;
      const int64_t j0 = c * CHUNK, m = std::min(N, j0 + CHUNK) - j0;
      const int64_t* lr = lim + r * nq;
      int64_t seen = 0;  // keys of the chunk some slot sees
      for (int64_t i = 0; i < nq; ++i) seen = std::max(seen, std::min(m, lr[i] - j0));
      if (seen <= 0) continue;
      for (int64_t j = 0; j < seen; ++j) krow[j] = r * ks0 + (j0 + j) * ks1 + h * ks2;
      const int64_t mp = (seen + W - 1) / W * W;
      for (int64_t j = seen; j < mp + W; ++j) krow[j] = krow[seen - 1];
      for (int64_t g0 = 0; g0 < nq; g0 += QG) {
        vf qv[QG][D / W];
        const float* qb = q + (rh * nq + g0) * D;
        for (int g = 0; g < QG; ++g)
          for (int u = 0; u < D / W; ++u) qv[g][u] = ld(qb + g * D + u * W);
        for (int64_t t0 = 0; t0 < mp; t0 += W)
          score_block<D, QG, KIND>(qv, keys, krow.data() + t0, s.data() + t0, CHUNK + W);
        for (int g = 0; g < QG; ++g) {
          const int64_t i = g0 + g, see = std::min(mp, lr[i] - j0);
          if (see <= 0) continue;
          float* sg = s.data() + g * (CHUNK + W);
          for (int64_t j = see; j < mp; ++j) sg[j] = NEG_INF;
          const RowExp x = exp_row(sg, mp);
          pm[it * nq + i] = x.base;
          pl[it * nq + i] = x.sum;
          float* ei = e.data() + (it * nq + i) * CHUNK;
          std::memcpy(ei, sg, std::min(m, mp) * sizeof(float));
          std::fill(ei + std::min(m, mp), ei + m, 0.f);  // keys past what any slot sees
        }
      }
    }
  });
  // Each (chunk, slot)'s weight: exp(chunk max - slot max) / the slot's whole sum.
  std::vector<float> w(items * nq, 0.f);
  for (int64_t rh = 0; rh < R * hkv; ++rh)
    for (int64_t i = 0; i < nq; ++i) {
      float mx = NEG_INF, total = 0.f;
      for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, pm[(rh * nc + c) * nq + i]);
      if (mx == NEG_INF) continue;
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t k = (rh * nc + c) * nq + i;
        if (pl[k] > 0.f) total += pl[k] * std::exp(pm[k] - mx);
      }
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t k = (rh * nc + c) * nq + i;
        if (pl[k] > 0.f) w[k] = std::exp(pm[k] - mx) / total;
      }
    }
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t c = it % nc, rh = it / nc, j0 = c * CHUNK;
      const int64_t m = std::min(N, j0 + CHUNK) - j0, mp = m / W * W;
      float* o = out + rh * N + j0;
      std::fill(o, o + m, 0.f);
      for (int64_t i = 0; i < nq; ++i) {
        const float wi = w[it * nq + i];
        if (wi == 0.f) continue;
        const float* ei = e.data() + (it * nq + i) * CHUNK;
        const vf wv = splat(wi);
        for (int64_t j = 0; j < mp; j += W) st(o + j, ld(o + j) + wv * ld(ei + j));
        for (int64_t j = mp; j < m; ++j) o[j] += wi * ei[j];
      }
    }
  });
}

using MassFn = void (*)(const float*, int64_t, const void*, int64_t, int64_t, int64_t,
                        const int64_t*, int64_t, int64_t, int64_t, float*);

template <int KIND>
MassFn pick_mass_d(int64_t d) {
  switch (d) {
    case 32: return mass<32, KIND>;
    case 64: return mass<64, KIND>;
    case 128: return mass<128, KIND>;
  }
  return nullptr;
}

MassFn pick_mass(at::ScalarType t, int64_t d) {
  switch (t) {
    case at::kFloat: return pick_mass_d<F32>(d);
    case at::kBFloat16: return pick_mass_d<BF16>(d);
    case at::kHalf: return pick_mass_d<F16>(d);
    default: return nullptr;
  }
}

template <int D, int G, int KIND>
void scores(const float* q, const void* keys, int64_t ks0, int64_t ks1, const int32_t* r2t,
            int64_t r2t_stride, const int64_t* rows, const int64_t* n_keys, int64_t R,
            int64_t hkv, int64_t N, float* out) {
  const int64_t nc = (N + CHUNK - 1) / CHUNK, items = R * hkv * nc;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> krow(CHUNK + 2 * W);
    std::vector<float> s(G * (CHUNK + W));
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t c = it % nc, rh = it / nc, h = rh % hkv, r = rh / hkv;
      const int64_t j0 = c * CHUNK, n = n_keys[r];
      const int64_t m = std::max<int64_t>(0, std::min(n, j0 + CHUNK) - j0);
      const int64_t width = std::min(N, j0 + CHUNK) - j0;
      float* o = out + (rh * G) * N + j0;  // out[r, h, 0, j0]
      for (int g = 0; g < G; ++g)
        for (int64_t j = m; j < width; ++j) o[g * N + j] = NEG_INF;
      if (m == 0) continue;
      const int32_t* map = r2t + rows[r] * r2t_stride;
      for (int64_t j = 0; j < m; ++j) krow[j] = map[j0 + j] * ks0 + h * ks1;
      const int64_t mp = (m + W - 1) / W * W;
      for (int64_t j = m; j < mp + W; ++j) krow[j] = krow[m - 1];
      vf qv[G][D / W];
      const float* qb = q + rh * G * D;
      for (int g = 0; g < G; ++g)
        for (int u = 0; u < D / W; ++u) qv[g][u] = ld(qb + g * D + u * W);
      for (int64_t t0 = 0; t0 < mp; t0 += W)
        score_block<D, G, KIND>(qv, keys, krow.data() + t0, s.data() + t0, CHUNK + W);
      for (int g = 0; g < G; ++g)
        std::memcpy(o + g * N, s.data() + g * (CHUNK + W), m * sizeof(float));
    }
  });
}

using ScoresFn = void (*)(const float*, const void*, int64_t, int64_t, const int32_t*, int64_t,
                          const int64_t*, const int64_t*, int64_t, int64_t, int64_t, float*);

template <int D, int KIND>
ScoresFn pick_scores_g(int64_t g) {
  switch (g) {
#define SGL_SPEC_G(N) case N: return scores<D, N, KIND>;
    SGL_SPEC_G(1) SGL_SPEC_G(2) SGL_SPEC_G(3) SGL_SPEC_G(4)
    SGL_SPEC_G(5) SGL_SPEC_G(6) SGL_SPEC_G(7) SGL_SPEC_G(8)
#undef SGL_SPEC_G
  }
  return nullptr;
}

template <int KIND>
ScoresFn pick_scores_d(int64_t d, int64_t g) {
  switch (d) {
    case 32: return pick_scores_g<32, KIND>(g);
    case 64: return pick_scores_g<64, KIND>(g);
    case 128: return pick_scores_g<128, KIND>(g);
  }
  return nullptr;
}

ScoresFn pick_scores(at::ScalarType t, int64_t d, int64_t g) {
  switch (t) {
    case at::kFloat: return pick_scores_d<F32>(d, g);
    case at::kBFloat16: return pick_scores_d<BF16>(d, g);
    case at::kHalf: return pick_scores_d<F16>(d, g);
    default: return nullptr;
  }
}

template <int D, int KIND>
RunFn pick_g(int64_t g) {
  switch (g) {
#define SGL_SPEC_G(N) case N: return run<D, N, KIND>;
    SGL_SPEC_G(1) SGL_SPEC_G(2) SGL_SPEC_G(3) SGL_SPEC_G(4)
    SGL_SPEC_G(5) SGL_SPEC_G(6) SGL_SPEC_G(7) SGL_SPEC_G(8)
#undef SGL_SPEC_G
  }
  return nullptr;
}

template <int KIND>
RunFn pick_d(int64_t d, int64_t g) {
  switch (d) {
    case 32: return pick_g<32, KIND>(g);
    case 64: return pick_g<64, KIND>(g);
    case 128: return pick_g<128, KIND>(g);
  }
  return nullptr;
}

RunFn pick(at::ScalarType t, int64_t d, int64_t g) {
  switch (t) {
    case at::kFloat: return pick_d<F32>(d, g);
    case at::kBFloat16: return pick_d<BF16>(d, g);
    case at::kHalf: return pick_d<F16>(d, g);
    default: return nullptr;
  }
}

}  // namespace

bool supported(at::ScalarType kv_dtype, int64_t head_dim, int64_t group) {
  return pick(kv_dtype, head_dim, group) != nullptr;
}

// q [B, Hq, D] fp32 (scaled, contiguous); k_buf, v_buf [slots, Hkv, D] (fp32, bf16 or
// fp16, last dim contiguous); req_to_token [max_reqs, max_context] int32; rows,
// seq_lens, recent_start [B] int64; sel_idx [B, Hkv, S] int64; sel_len [B, Hkv] int64.
// Returns out [B, Hq, D] fp32.
at::Tensor decode(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor req_to_token,
                  at::Tensor rows, at::Tensor seq_lens, at::Tensor sel_idx, at::Tensor sel_len,
                  at::Tensor recent_start, int64_t sink) {
  for (const auto& t : {q, k_buf, v_buf, req_to_token, rows, seq_lens, sel_idx, sel_len,
                        recent_start})
    TORCH_CHECK(t.device().is_cpu(), "decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat,
              "decode: q must be a contiguous fp32 [B, Hq, D]");
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.dim() == 3 && k_buf.scalar_type() == v_buf.scalar_type(),
              "decode: k_buf, v_buf must be [slots, Hkv, D] of one dtype");
  TORCH_CHECK(k_buf.stride(2) == 1 && v_buf.stride(2) == 1, "decode: K/V rows must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1,
              "decode: req_to_token must be int32 with contiguous rows");
  for (const auto& t : {rows, seq_lens, sel_idx, sel_len, recent_start})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(),
                "decode: index tensors must be contiguous int64");
  const int64_t B = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_buf.size(1);
  TORCH_CHECK(hq % hkv == 0 && k_buf.size(2) == D && v_buf.size(2) == D && v_buf.size(1) == hkv,
              "decode: q [B, Hq, D] does not fit k_buf/v_buf [slots, Hkv, D]");
  TORCH_CHECK(sel_idx.dim() == 3 && sel_idx.size(0) == B && sel_idx.size(1) == hkv,
              "decode: sel_idx must be [B, Hkv, S]");
  RunFn fn = pick(k_buf.scalar_type(), D, hq / hkv);
  TORCH_CHECK(fn != nullptr, "decode: head_dim in {32, 64, 128}, 1..8 query heads per KV head and "
              "fp32/bf16/fp16 K/V, got head_dim ", D, ", group ", hq / hkv, ", ",
              k_buf.scalar_type());
  Subsets ix{req_to_token.data_ptr<int32_t>(), req_to_token.stride(0), rows.data_ptr<int64_t>(),
             seq_lens.data_ptr<int64_t>(), sel_idx.data_ptr<int64_t>(),
             sel_idx.size(1) * sel_idx.size(2), sel_idx.size(2), sel_len.data_ptr<int64_t>(),
             recent_start.data_ptr<int64_t>(), sink, hkv};
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(seq_lens.data_ptr<int64_t>()[b] >= 1 &&
                    recent_start.data_ptr<int64_t>()[b] < seq_lens.data_ptr<int64_t>()[b],
                "decode: need 0 <= recent_start < seq_len for every row");
    for (int64_t h = 0; h < hkv; ++h) {
      int64_t s_end, recent;
      longest = std::max(longest, ix.length(b, h, &s_end, &recent));
    }
  }
  Pools kv{k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0), k_buf.stride(1),
           v_buf.stride(0), v_buf.stride(1)};
  auto out = at::empty({B, hq, D}, q.options());
  fn(q.data_ptr<float>(), kv, ix, B, (longest + CHUNK - 1) / CHUNK, out.data_ptr<float>());
  return out;
}

// The retrieval head's logits over each row's history (see `scores` above). q [R, Hq, D]
// fp32 (scaled, contiguous); keys [slots, Hkv, D] (fp32, bf16 or fp16, rows contiguous);
// req_to_token [max_reqs, max_context] int32; rows, n_keys [R] int64 (n_keys <= N).
// Returns [R, Hkv, G, N] fp32, -inf past each row's n_keys. Reference: the head's
// torch path (sgl_spec.head.model.RetrievalHead.logits).
at::Tensor head_scores(at::Tensor q, at::Tensor keys, at::Tensor req_to_token, at::Tensor rows,
                       at::Tensor n_keys, int64_t N) {
  for (const auto& t : {q, keys, req_to_token, rows, n_keys})
    TORCH_CHECK(t.device().is_cpu(), "head_scores: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat,
              "head_scores: q must be a contiguous fp32 [R, Hq, D]");
  TORCH_CHECK(keys.dim() == 3 && keys.stride(2) == 1, "head_scores: keys must be [slots, Hkv, D]"
              " with contiguous rows");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1,
              "head_scores: req_to_token must be int32 with contiguous rows");
  for (const auto& t : {rows, n_keys})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 &&
                    t.size(0) == q.size(0),
                "head_scores: rows and n_keys must be contiguous int64 [R]");
  const int64_t R = q.size(0), hq = q.size(1), D = q.size(2), hkv = keys.size(1);
  TORCH_CHECK(hq % hkv == 0 && keys.size(2) == D, "head_scores: q [R, Hq, D] does not fit keys");
  const int64_t* nk = n_keys.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(nk[r] >= 0 && nk[r] <= N && nk[r] <= req_to_token.size(1) && rw[r] >= 0 &&
                    rw[r] < req_to_token.size(0),
                "head_scores: need 0 <= n_keys <= N and rows within req_to_token");
  ScoresFn fn = pick_scores(keys.scalar_type(), D, hq / hkv);
  TORCH_CHECK(fn != nullptr, "head_scores: head_dim in {32, 64, 128}, 1..8 query heads per KV "
              "head and fp32/bf16/fp16 keys, got head_dim ", D, ", group ", hq / hkv, ", ",
              keys.scalar_type());
  auto out = at::empty({R, hkv, hq / hkv, N}, q.options());
  if (N > 0)
    fn(q.data_ptr<float>(), keys.data_ptr(), keys.stride(0), keys.stride(1),
       req_to_token.data_ptr<int32_t>(), req_to_token.stride(0), rw, nk, R, hkv, N,
       out.data_ptr<float>());
  return out;
}

// The attention mass of each history position (`mass` above). q [R, Hkv, NQ, D] fp32
// (scaled, contiguous; NQ a multiple of 8, padding slots seeing nothing); keys [R, N', Hkv,
// D] (fp32, bf16 or fp16, rows contiguous, N' >= N); lim [R, NQ] int64: the keys each slot
// sees (0 <= lim <= N). Returns [R, Hkv, N] fp32.
at::Tensor history_mass(at::Tensor q, at::Tensor keys, at::Tensor lim, int64_t N) {
  for (const auto& t : {q, keys, lim})
    TORCH_CHECK(t.device().is_cpu(), "history_mass: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == at::kFloat &&
                  q.size(2) % QG == 0,
              "history_mass: q must be a contiguous fp32 [R, Hkv, NQ, D], NQ a multiple of ", QG);
  TORCH_CHECK(keys.dim() == 4 && keys.stride(3) == 1 && keys.size(0) == q.size(0) &&
                  keys.size(2) == q.size(1) && keys.size(3) == q.size(3) && keys.size(1) >= N,
              "history_mass: keys must be [R, >= N, Hkv, D] with contiguous rows");
  TORCH_CHECK(lim.scalar_type() == at::kLong && lim.is_contiguous() && lim.dim() == 2 &&
                  lim.size(0) == q.size(0) && lim.size(1) == q.size(2),
              "history_mass: lim must be contiguous int64 [R, NQ]");
  const int64_t R = q.size(0), hkv = q.size(1), nq = q.size(2), D = q.size(3);
  const int64_t* lp = lim.data_ptr<int64_t>();
  for (int64_t i = 0; i < R * nq; ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] <= N, "history_mass: need 0 <= lim <= N, got ", lp[i]);
  MassFn fn = pick_mass(keys.scalar_type(), D);
  TORCH_CHECK(fn != nullptr, "history_mass: head_dim in {32, 64, 128} and fp32/bf16/fp16 keys, "
              "got head_dim ", D, ", ", keys.scalar_type());
  auto out = at::zeros({R, hkv, N}, q.options());
  if (N > 0 && nq > 0)
    fn(q.data_ptr<float>(), nq, keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
       lp, R, hkv, N, out.data_ptr<float>());
  return out;
}

// The top `budget` positions of [lo_r, hi_r) per row and KV head, ascending, by
// scores[r, h, j] + (width > 0: the largest score among j - width .. j, the sink's
// (j < lo_r) counted as 0); among equal scores the earlier positions win. Reference:
// sgl_spec.sparse.scoring.look_ahead then select_topk(first_of_ties=True).
at::Tensor select_top(at::Tensor scores, at::Tensor lo, at::Tensor hi, int64_t budget,
                      int64_t width) {
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 3 && scores.is_contiguous() &&
                  scores.scalar_type() == at::kFloat,
              "select_top: scores must be a contiguous fp32 CPU [R, Hkv, N]");
  for (const auto& t : {lo, hi})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() &&
                    t.dim() == 1 && t.size(0) == scores.size(0),
                "select_top: lo and hi must be contiguous int64 [R]");
  const int64_t R = scores.size(0), hkv = scores.size(1), N = scores.size(2);
  const int64_t* lp = lo.data_ptr<int64_t>();
  const int64_t* hp = hi.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(0 <= lp[r] && lp[r] <= hp[r] && hp[r] <= N && hp[r] - lp[r] >= budget &&
                    budget >= 0,
                "select_top: every row needs 0 <= lo <= hi <= N and >= ", budget,
                " candidates, got [", lp[r], ", ", hp[r], ")");
  auto out = at::empty({R, hkv, budget}, lo.options());
  const float* sp = scores.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R * hkv, 1, [&](int64_t a, int64_t z) {
    std::vector<float> x, tmp;
    for (int64_t rh = a; rh < z; ++rh) {
      const int64_t r = rh / hkv, l = lp[r], n = hp[r] - l;
      const float* row = sp + rh * N;
      x.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = l + j;
        float best = 0.f;
        for (int64_t t = std::max<int64_t>(l, p - width); t <= p && width > 0; ++t)
          best = std::max(best, row[t]);
        x[j] = width > 0 ? row[p] + best : row[p];
      }
      int64_t* o = op + rh * budget;
      if (budget == 0) continue;
      tmp.assign(x.begin(), x.end());
      std::nth_element(tmp.begin(), tmp.begin() + (budget - 1), tmp.end(), std::greater<float>());
      const float thr = tmp[budget - 1];
      int64_t above = 0;
      for (int64_t j = 0; j < n; ++j) above += x[j] > thr;
      int64_t ties = budget - above, k = 0;
      for (int64_t j = 0; j < n && k < budget; ++j)
        if (x[j] > thr || (x[j] == thr && ties-- > 0)) o[k++] = l + j;
    }
  });
  return out;
}

// SpeContext's elastic loads of one layer (sgl_spec.sparse.elastic): for i < M,
// stage_k.row(dst[i]) = pool_k.row(src[i]) and the same for V, a row being the last dim
// (flat rows: slot * Hkv + h). One call replaces four torch ops (an index_select and an
// index_copy_ for K and for V), whose dispatch cost more than the ~100 KB they move.
// Reference: reference.copy_rows_reference.
void copy_rows(at::Tensor stage_k, at::Tensor stage_v, at::Tensor pool_k, at::Tensor pool_v,
               at::Tensor dst, at::Tensor src) {
  for (const auto& t : {stage_k, stage_v, pool_k, pool_v, dst, src})
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
                "copy_rows: contiguous CPU tensors only");
  const auto dt = stage_k.scalar_type();
  const int64_t d = stage_k.size(-1);
  for (const auto& t : {stage_v, pool_k, pool_v})
    TORCH_CHECK(t.scalar_type() == dt && t.size(-1) == d,
                "copy_rows: stage and pool buffers must share dtype and row size");
  TORCH_CHECK(dst.scalar_type() == at::kLong && src.scalar_type() == at::kLong &&
                  dst.dim() == 1 && dst.sizes() == src.sizes(),
              "copy_rows: dst and src must be int64 vectors of one length");
  const int64_t m = dst.size(0), bytes = d * stage_k.element_size();
  const int64_t n_stage = stage_k.numel() / d, n_pool = pool_k.numel() / d;
  TORCH_CHECK(stage_v.numel() / d == n_stage && pool_v.numel() / d == n_pool,
              "copy_rows: K and V buffers must have the same rows");
  const int64_t* di = dst.data_ptr<int64_t>();
  const int64_t* si = src.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(di[i] >= 0 && di[i] < n_stage && si[i] >= 0 && si[i] < n_pool,
                "copy_rows: row index out of range (dst ", di[i], " of ", n_stage, ", src ",
                si[i], " of ", n_pool, ")");
  auto* sk = static_cast<char*>(stage_k.data_ptr());
  auto* sv = static_cast<char*>(stage_v.data_ptr());
  const auto* pk = static_cast<const char*>(pool_k.data_ptr());
  const auto* pv = static_cast<const char*>(pool_v.data_ptr());
  at::parallel_for(0, m, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      std::memcpy(sk + di[i] * bytes, pk + si[i] * bytes, bytes);
      std::memcpy(sv + di[i] * bytes, pv + si[i] * bytes, bytes);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "decode attention over KV subsets of a paged pool",
        py::call_guard<py::gil_scoped_release>());
  m.def("head_scores", &head_scores, "the retrieval head's logits over paged keys",
        py::call_guard<py::gil_scoped_release>());
  m.def("history_mass", &history_mass, "attention mass of each history position",
        py::call_guard<py::gil_scoped_release>());
  m.def("select_top", &select_top, "top-budget positions by score and look-ahead",
        py::call_guard<py::gil_scoped_release>());
  m.def("copy_rows", &copy_rows, "elastic loads: stage rows <- pool rows, K and V",
        py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported, "whether (kv dtype, head_dim, group) is instantiated");
}
