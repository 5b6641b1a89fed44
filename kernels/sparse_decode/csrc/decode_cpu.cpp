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
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
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

// A buffer of the calling thread that keeps the largest size asked of it: a fresh
// multi-MB allocation per call is fresh pages, and faulting them in costs more than the
// arithmetic (sgl_spec.sparse.scoring.Scratch, the torch path's equivalent).
inline float* kept_buffer(size_t n) {
  static thread_local std::unique_ptr<float[]> buf;
  static thread_local size_t cap = 0;
  if (n > cap) {
    buf.reset(new float[n]);
    cap = n;
  }
  return buf.get();
}

constexpr int KB = W == 16 ? 8 : 4;  // keys per register block of the logits
constexpr int QV = 3;                // query-row vectors per register block

// Logits of KB keys (fp32 rows kf[kk * D ..]) for nv <= QV vectors of W query rows
// (transposed: qt[dd * nqp + v * W + lane]): e[kk * nqp + v * W + lane] = q . k_kk. The
// queries' lanes against one broadcast key element: no horizontal sums.
template <int D, int NV>
inline void logits_block(const float* qt, int64_t nqp, const float* kf, float* e) {
  vf acc[KB][NV];
  for (int kk = 0; kk < KB; ++kk)
    for (int v = 0; v < NV; ++v) acc[kk][v] = splat(0.f);
  for (int dd = 0; dd < D; ++dd) {
    vf qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = ld(qt + dd * nqp + v * W);
    for (int kk = 0; kk < KB; ++kk) {
      const vf kb = splat(kf[kk * D + dd]);
      for (int v = 0; v < NV; ++v) acc[kk][v] += qv[v] * kb;
    }
  }
  for (int kk = 0; kk < KB; ++kk)
    for (int v = 0; v < NV; ++v) st(e + kk * nqp + v * W, acc[kk][v]);
}

// LoopServe's reselection score (sgl_spec.sparse.scoring.score_history, Eq. 7): for row r
// and KV head h, with nq query rows (the ring's queries times the heads of h's group) at
// positions q_pos[r, i] (-1: unused),
//     out[r, h, j] = sum_i softmax over j' <= q_pos[r, i], j' < n_r of (q_i . k_j') at j,
// and 0 for j >= n_r; keys read in place through slots[r, j]. qt [R, Hkv, D, nqp] holds
// the query rows transposed, padded to nqp (a multiple of W) with rows at position -1.
// Three passes: per (r, h, chunk) the chunk's logits position-major (all query rows of
// a position in nqp / W vectors), each row's max over the chunk and the sum of its
// exponentials (kept in place of the logits); per (r, h) each row's chunk maxima merged
// into a weight per chunk; per (r, h, chunk) each position's weighted sum over the rows.
template <int D, int KIND>
void mass(const float* qt, int64_t nqp, const void* keys, int64_t ks0, int64_t ks1,
          const int32_t* slots, int64_t slot_stride, const int64_t* n_keys, const int64_t* q_pos,
          int64_t R, int64_t hkv, int64_t N, float* out) {
  const int64_t nc = (N + CHUNK - 1) / CHUNK, items = R * hkv * nc, nv = nqp / W;
  float* e = kept_buffer(static_cast<size_t>(items * (CHUNK * nqp + 3 * nqp)));
  float* cm = e + items * CHUNK * nqp;  // [items, nqp]: each row's max over the chunk
  float* cl = cm + items * nqp;         // the sum of its exponentials
  float* cw = cl + items * nqp;         // the chunk's weight in the row's softmax
  at::parallel_for(0, items, items, [&](int64_t i0, int64_t i1) {
    std::vector<float> kf(CHUNK * D);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t c = it % nc, rh = it / nc, h = rh % hkv, r = rh / hkv;
      const int64_t j0 = c * CHUNK;
      const int64_t m = std::max<int64_t>(0, std::min(n_keys[r], j0 + CHUNK) - j0);
      float* eb = e + it * CHUNK * nqp;  // eb[j * nqp + i]: position j0 + j, query row i
      float* im = cm + it * nqp;
      float* il = cl + it * nqp;
      if (m == 0) {
        for (int64_t i = 0; i < nqp; ++i) im[i] = NEG_INF, il[i] = 0.f;
        continue;
      }
      const int32_t* map = slots + r * slot_stride;
      const int64_t mp = (m + KB - 1) / KB * KB;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t off = map[j0 + j] * ks0 + h * ks1;
        if (j + 4 < m) prefetch_row<D, KIND>(keys, map[j0 + j + 4] * ks0 + h * ks1);
        for (int u = 0; u < D / W; ++u)
          st(kf.data() + j * D + u * W, ld_kv<KIND>(keys, off + u * W));
      }
      std::fill(kf.begin() + m * D, kf.begin() + mp * D, 0.f);
      const float* qb = qt + rh * D * nqp;
      for (int64_t j = 0; j < mp; j += KB)
        for (int64_t v = 0; v < nv; v += QV) {
          float* dst = eb + j * nqp + v * W;
          const float* q = qb + v * W;
          if (nv - v >= 3) logits_block<D, 3>(q, nqp, kf.data() + j * D, dst);
          else if (nv - v == 2) logits_block<D, 2>(q, nqp, kf.data() + j * D, dst);
          else logits_block<D, 1>(q, nqp, kf.data() + j * D, dst);
        }
      const int64_t* qp = q_pos + r * nqp;
      for (int64_t i = 0; i < nqp; ++i)  // a row's positions after its query: -inf
        for (int64_t j = std::max<int64_t>(0, qp[i] + 1 - j0); j < m; ++j)
          eb[j * nqp + i] = NEG_INF;
      for (int64_t v = 0; v < nv; ++v) {
        vf mx = splat(NEG_INF);
        for (int64_t j = 0; j < m; ++j) {
          const vf x = ld(eb + j * nqp + v * W);
          mx = x > mx ? x : mx;
        }
        const vf base = mx == NEG_INF ? splat(0.f) : mx;  // a row that sees none: all 0
        vf sum = splat(0.f);
        for (int64_t j = 0; j < m; ++j) {
          const vf x = exp_nonpos(ld(eb + j * nqp + v * W) - base);
          st(eb + j * nqp + v * W, x);
          sum += x;
        }
        st(im + v * W, mx);
        st(il + v * W, sum);
      }
    }
  });
  for (int64_t ri = 0; ri < R * hkv; ++ri)
    for (int64_t i = 0; i < nqp; ++i) {
      float mx = NEG_INF, total = 0.f;
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t x = (ri * nc + c) * nqp + i;
        mx = cl[x] > 0.f ? std::max(mx, cm[x]) : mx;
      }
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t x = (ri * nc + c) * nqp + i;
        total += cl[x] > 0.f ? cl[x] * std::exp(cm[x] - mx) : 0.f;
      }
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t x = (ri * nc + c) * nqp + i;
        cw[x] = cl[x] > 0.f ? std::exp(cm[x] - mx) / total : 0.f;
      }
    }
  at::parallel_for(0, items, items, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t c = it % nc, rh = it / nc, r = rh / hkv;
      const int64_t j0 = c * CHUNK, width = std::min(N, j0 + CHUNK) - j0;
      const int64_t m = std::max<int64_t>(0, std::min(n_keys[r], j0 + CHUNK) - j0);
      const float* eb = e + it * CHUNK * nqp;
      const float* w = cw + it * nqp;
      float* o = out + rh * N + j0;
      for (int64_t j = m; j < width; ++j) o[j] = 0.f;
      for (int64_t t = 0; t < m; t += W) {  // W positions: each a dot of its rows with w
        vf acc[W];
        for (int jj = 0; jj < W; ++jj) {
          vf a = splat(0.f);
          if (t + jj < m)
            for (int64_t v = 0; v < nv; ++v) a += ld(eb + (t + jj) * nqp + v * W) * ld(w + v * W);
          acc[jj] = a;
        }
        const vf res = reduce_lanes(acc);
        for (int jj = 0; jj < W && t + jj < m; ++jj) o[t + jj] = res[jj];
      }
    }
  });
}

// LoopServe's selection from a history's mass (sgl_spec.sparse.scoring.look_ahead, then
// select_topk with first_of_ties): per row r and KV head h, each candidate j in
// [lo_r, hi_r) scores y_j = s_j + max(s'_{j - width} .. s'_j), s' being s with the sink
// (positions < lo_r) and the positions before 0 at 0 (width 0: y = s); the budget
// highest are kept, equal scores to the earlier position, listed ascending.
void select_top_rows(const float* s, int64_t N, const int64_t* lo, const int64_t* hi,
                     int64_t R, int64_t hkv, int64_t width, int64_t budget, int64_t* out) {
  at::parallel_for(0, R * hkv, R * hkv, [&](int64_t a, int64_t z) {
    std::vector<float> y, tmp;
    for (int64_t rh = a; rh < z; ++rh) {
      const int64_t r = rh / hkv, l = lo[r], n = hi[r] - l;
      const float* x = s + rh * N;
      y.resize(n);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t j = l + t;
        float mx = 0.f;
        if (width > 0)
          for (int64_t i = std::max<int64_t>(l, j - width); i <= j; ++i) mx = std::max(mx, x[i]);
        y[t] = x[j] + mx;
      }
      tmp.assign(y.begin(), y.end());
      std::nth_element(tmp.begin(), tmp.begin() + (budget - 1), tmp.end(), std::greater<float>());
      const float thr = tmp[budget - 1];
      int64_t above = 0;
      for (int64_t t = 0; t < n; ++t) above += y[t] > thr;
      int64_t ties = budget - above, k = 0;
      int64_t* o = out + rh * budget;
      for (int64_t t = 0; t < n && k < budget; ++t)
        if (y[t] > thr || (y[t] == thr && ties-- > 0)) o[k++] = l + t;
    }
  });
}

using MassFn = void (*)(const float*, int64_t, const void*, int64_t, int64_t, const int32_t*,
                        int64_t, const int64_t*, const int64_t*, int64_t, int64_t, int64_t,
                        float*);

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

// LoopServe's reselection score over each row's history (see `mass` above). q [R, Hkv, nq,
// D] fp32 (scaled: the ring's queries by KV head); keys [slots, Hkv, D] (fp32, bf16 or
// fp16, rows contiguous); slots [R, >= N] int32 (contiguous rows); n_keys [R] and q_pos
// [R, nq] int64 (q_pos < n_keys, -1 unused). Returns [R, Hkv, N] fp32.
at::Tensor history_mass(at::Tensor q, at::Tensor keys, at::Tensor slots, at::Tensor n_keys,
                        at::Tensor q_pos, int64_t N) {
  for (const auto& t : {q, keys, slots, n_keys, q_pos})
    TORCH_CHECK(t.device().is_cpu(), "history_mass: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat,
              "history_mass: q must be fp32 [R, Hkv, nq, D]");
  const int64_t R = q.size(0), hkv = q.size(1), nq = q.size(2), D = q.size(3);
  TORCH_CHECK(keys.dim() == 3 && keys.stride(2) == 1 && keys.size(1) == hkv && keys.size(2) == D,
              "history_mass: keys must be [slots, Hkv, D] with contiguous rows, fitting q");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kInt && slots.stride(1) == 1 &&
                  slots.size(0) == R && slots.size(1) >= N,
              "history_mass: slots must be int32 [R, >= N] with contiguous rows");
  TORCH_CHECK(n_keys.scalar_type() == at::kLong && n_keys.is_contiguous() && n_keys.dim() == 1 &&
                  n_keys.size(0) == R,
              "history_mass: n_keys must be contiguous int64 [R]");
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && q_pos.dim() == 2 && q_pos.size(0) == R &&
                  q_pos.size(1) == nq,
              "history_mass: q_pos must be int64 [R, nq]");
  // The query rows transposed ([R, Hkv, D, nqp]) and padded to whole vectors with unused
  // rows (position -1).
  const int64_t nqp = (nq + W - 1) / W * W;
  auto pos = at::full({R, nqp}, -1, q_pos.options());
  pos.narrow(1, 0, nq).copy_(q_pos);
  const int64_t* qp = pos.data_ptr<int64_t>();
  const int64_t* nk = n_keys.data_ptr<int64_t>();
  const int32_t* sl = slots.data_ptr<int32_t>();
  const int64_t n_slots = keys.size(0);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(nk[r] >= 0 && nk[r] <= N, "history_mass: need 0 <= n_keys <= N");
    for (int64_t i = 0; i < nq; ++i)
      TORCH_CHECK(qp[r * nqp + i] < nk[r], "history_mass: a query's position must be < n_keys");
    for (int64_t j = 0; j < nk[r]; ++j)
      TORCH_CHECK(sl[r * slots.stride(0) + j] >= 0 && sl[r * slots.stride(0) + j] < n_slots,
                  "history_mass: slot out of range");
  }
  MassFn fn = pick_mass(keys.scalar_type(), D);
  TORCH_CHECK(fn != nullptr, "history_mass: head_dim in {32, 64, 128} and fp32/bf16/fp16 keys, "
              "got head_dim ", D, ", ", keys.scalar_type());
  auto qt = at::zeros({R, hkv, D, nqp}, q.options());
  qt.narrow(3, 0, nq).copy_(q.transpose(2, 3));
  auto out = at::empty({R, hkv, N}, q.options());
  if (N > 0)
    fn(qt.data_ptr<float>(), nqp, keys.data_ptr(), keys.stride(0), keys.stride(1), sl,
       slots.stride(0), nk, qp, R, hkv, N, out.data_ptr<float>());
  return out;
}

// LoopServe's selection (see `select_top_rows` above). scores [R, Hkv, N] fp32 (contiguous);
// lo, hi [R] int64 with 0 <= lo, hi <= N and hi - lo >= budget >= 1; width >= 0. Returns
// [R, Hkv, budget] int64, ascending.
at::Tensor select_top(at::Tensor scores, at::Tensor lo, at::Tensor hi, int64_t width,
                      int64_t budget) {
  for (const auto& t : {scores, lo, hi})
    TORCH_CHECK(t.device().is_cpu(), "select_top: CPU tensors only");
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous() && scores.scalar_type() == at::kFloat,
              "select_top: scores must be a contiguous fp32 [R, Hkv, N]");
  const int64_t R = scores.size(0), hkv = scores.size(1), N = scores.size(2);
  for (const auto& t : {lo, hi})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 &&
                    t.size(0) == R,
                "select_top: lo and hi must be contiguous int64 [R]");
  TORCH_CHECK(width >= 0 && budget >= 1, "select_top: need width >= 0 and budget >= 1");
  const int64_t* l = lo.data_ptr<int64_t>();
  const int64_t* h = hi.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(l[r] >= 0 && h[r] <= N && h[r] - l[r] >= budget,
                "select_top: every row needs 0 <= lo, hi <= N and >= ", budget,
                " candidates, got [", l[r], ", ", h[r], ")");
  auto out = at::empty({R, hkv, budget}, lo.options());
  select_top_rows(scores.data_ptr<float>(), N, l, h, R, hkv, width, budget,
                  out.data_ptr<int64_t>());
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
  m.def("history_mass", &history_mass, "LoopServe's attention mass over paged keys",
        py::call_guard<py::gil_scoped_release>());
  m.def("select_top", &select_top, "LoopServe's top positions of a history's mass",
        py::call_guard<py::gil_scoped_release>());
  m.def("copy_rows", &copy_rows, "elastic loads: stage rows <- pool rows, K and V",
        py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported, "whether (kv dtype, head_dim, group) is instantiated");
}
