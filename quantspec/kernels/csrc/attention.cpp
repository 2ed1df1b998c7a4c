// Paged attention of quantspec's CPU kernels: a step's new query rows over their sequences' cached
// keys, read through block tables.

#include "cpu.h"

namespace {

// ---- paged attention for decode / verification rows ------------------------------------------
//
// Writes this step's k/v rows into their cache slots, then for each new query row i of each
// sequence b (position p = seq_len - q_len + i) attends over that sequence's cached keys 0..p:
// the rows of one KV head's G = H / KV query heads are computed together (each key read once per
// chunk of up to 4 heads). fp32 accumulation, softmax with a vectorised exp; bf16 q / caches on a
// CPU with AVX512-BF16 take the pair path (`attend_heads_pairs`). One query's numbers depend only
// on its own q and keys, never on the other rows of the step (decode and verification agree
// bitwise).

#if QS_AVX512

inline void store16f(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16f(at::BFloat16* p, __m512 v) {
  float tmp[16];
  _mm512_storeu_ps(tmp, v);
  for (int j = 0; j < 16; ++j) p[j] = static_cast<at::BFloat16>(tmp[j]);
}

// the cache slot of the sequence's position t through its block table; block_size =
// 1 << block_shift: a shift and a mask, not a 64-bit division per key
inline int64_t slot_of(const int64_t* table, int block_shift, int64_t t) {
  return (table[t >> block_shift] << block_shift) + (t & ((int64_t(1) << block_shift) - 1));
}

// software prefetch (into L2) of the key and value rows of positions [t0, t1): a decode step
// reads every layer's cache after the weights streamed through, so the first row of a (sequence,
// KV head) finds its keys and values in memory; the hardware prefetcher does not follow the block
// table. `bytes` per row (one KV head's head_dim elements)
inline void prefetch_rows(const char* kc, const char* vc, const int64_t* table, int block_shift,
                          int64_t slot_bytes, int64_t t0, int64_t t1, int64_t bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t off = slot_of(table, block_shift, t) * slot_bytes;
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(kc + off + b, _MM_HINT_T1);
      _mm_prefetch(vc + off + b, _MM_HINT_T1);
    }
  }
}

// one KV head's row (head_dim = 16 C) of the sequence's key / value at position t, as fp32
template <int C, class T>
inline void load_key_row(const T* cache, const int64_t* table, int block_shift, int64_t slot_stride,
                         int64_t t, __m512 out[C]) {
  const T* p = cache + slot_of(table, block_shift, t) * slot_stride;
  for (int c = 0; c < C; ++c) out[c] = load16f(p + 16 * c);
}

// r[j] = the sum of v[j]'s 16 lanes, j = 0..15: a transposing reduction (unpack / shuffle + add
// in four levels, 45 instructions) instead of 16 horizontal reductions. Lane j always sums v[j]
// in the same order, so a key's score does not depend on the other keys of its block.
inline __m512 hsum16(const __m512 v[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = v[2i], y = v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the partial sums of v[4i .. 4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// softmax of each of GC heads' L scores (rows of sc, stride L): e_t = exp(s_t − max), stored in
// place (fp32), or with kBf16Weights rounded to bf16 into eb (rows of stride LP, a last odd key's
// pair padded with 0) and summed as rounded; returns 1 / Σ e_t per head
template <int GC, bool kBf16Weights = false>
inline void softmax_rows(float* sc, int64_t L, float inv_sum[GC], uint16_t* eb = nullptr, int64_t LP = 0) {
  for (int g = 0; g < GC; ++g) {
    float* s = sc + g * L;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < L; t += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, lane_mask(L - t), s + t));
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {  // a last partial block is masked
      const __mmask16 m = lane_mask(L - t);
      __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), vmax));
      if constexpr (kBf16Weights) {
#if QS_BF16DOT
        const __m256i r = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_mask_storeu_epi16(eb + g * LP + t, m, r);
        e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
#endif
      } else {
        _mm512_mask_storeu_ps(s + t, m, e);
      }
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    if constexpr (kBf16Weights)
      if (L < LP) eb[g * LP + L] = 0;
    inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
}

// one (query row, KV head) for GC of its query heads (a compile-time count, so the heads' query
// vectors and value accumulators live in registers: with a run-time count the compiler kept the
// accumulators on the stack, a store and a reload around every FMA); C 16-wide chunks of head dim
template <int C, int GC, class T>
void attend_heads(const T* q, int64_t q_head_stride, const T* kc, const T* vc, int64_t slot_stride,
                  const int64_t* table, int block_shift, int64_t L, float scale, T* out,
                  int64_t out_head_stride, std::vector<float>& sc) {
  sc.resize(static_cast<size_t>(GC) * L);
  __m512 qv[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c)
      qv[g][c] = _mm512_mul_ps(load16f(q + g * q_head_stride + 16 * c), _mm512_set1_ps(scale));
  // scores, 16 keys at a time: per query head, 16 accumulators (one per key, C FMAs each), then
  // one transposing reduction gives the 16 scores as a vector; a last partial block zero-fills
  // its missing keys. Keys are read from L1 once per head; the keys and values of the block two
  // ahead are prefetched (the values are read after the softmax, from L2)
  constexpr int64_t kRowBytes = 16 * C * static_cast<int64_t>(sizeof(T));
  const int64_t slot_bytes = slot_stride * static_cast<int64_t>(sizeof(T));
  const char *kb = reinterpret_cast<const char*>(kc), *vb = reinterpret_cast<const char*>(vc);
  prefetch_rows(kb, vb, table, block_shift, slot_bytes, 0, std::min<int64_t>(L, 32), kRowBytes);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
    const T* kp[16];
    for (int t = 0; t < n; ++t) kp[t] = kc + slot_of(table, block_shift, t0 + t) * slot_stride;
    prefetch_rows(kb, vb, table, block_shift, slot_bytes, std::min(L, t0 + 32), std::min(L, t0 + 48), kRowBytes);
    for (int g = 0; g < GC; ++g) {
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        if (t < n) {
          acc[t] = _mm512_mul_ps(qv[g][0], load16f(kp[t]));
          for (int c = 1; c < C; ++c) acc[t] = _mm512_fmadd_ps(qv[g][c], load16f(kp[t] + 16 * c), acc[t]);
        } else {
          acc[t] = _mm512_setzero_ps();
        }
      }
      _mm512_mask_storeu_ps(sc.data() + g * L + t0, lane_mask(n), hsum16(acc));
    }
  }
  float inv_sum[GC];
  softmax_rows<GC>(sc.data(), L, inv_sum);
  __m512 o[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m512 vv[C];
    load_key_row<C>(vc, table, block_shift, slot_stride, t, vv);
    for (int g = 0; g < GC; ++g) {
      const __m512 pt = _mm512_set1_ps(sc[g * L + t]);
      for (int c = 0; c < C; ++c) o[g][c] = _mm512_fmadd_ps(pt, vv[c], o[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c)
      store16f(out + g * out_head_stride + 16 * c, _mm512_mul_ps(o[g][c], _mm512_set1_ps(inv_sum[g])));
}

#if QS_BF16DOT
// The same for bf16 q / caches on a CPU with AVX512-BF16 (the pair path, when the call asks for
// it: `pairs`): the products of the scores and of the weighted values go through vdpbf16ps,
// two per lane an instruction, reading q, keys and values as stored (no conversion, where the
// fp32 chain converts each key once per query head). Scores: per key, vdpbf16ps over the head
// dim's bf16 pairs (exact products, fp32 sums), the same transposing reduction, then × scale.
// Softmax in fp32; the weights e_t are rounded to bf16 (as a bf16 model's eager attention rounds
// its probabilities before the value product) and normalised by the sum of the rounded weights.
// Values: keys t, t + 1 interleaved per head-dim element (vpunpckl/hwd) against the weight pair
// (e_t, e_t+1), so lane 4l + i of the low / high accumulators holds element 8l + i / 8l + 4 + i
// of the 32; one permute per 16 outputs restores the order. Still one fixed sequence of
// operations per (query row, head): decode and verification rows agree bitwise.
template <int C, int GC>
void attend_heads_pairs(const at::BFloat16* q, int64_t q_head_stride, const at::BFloat16* kc,
                        const at::BFloat16* vc, int64_t slot_stride, const int64_t* table, int block_shift,
                        int64_t L, float scale, at::BFloat16* out, int64_t out_head_stride,
                        std::vector<float>& sc, std::vector<uint16_t>& eb) {
  constexpr int P = C / 2;  // 32 bf16 of the head dim per vector
  const int64_t LP = (L + 1) & ~int64_t(1);  // weights per head, padded to whole pairs
  sc.resize(static_cast<size_t>(GC) * L);
  eb.resize(static_cast<size_t>(GC) * LP);
  __m512i qv[GC][P];
  for (int g = 0; g < GC; ++g)
    for (int p = 0; p < P; ++p) qv[g][p] = _mm512_loadu_si512(q + g * q_head_stride + 32 * p);
  const __m512 vscale = _mm512_set1_ps(scale);
  constexpr int64_t kRowBytes = 32 * P * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t slot_bytes = slot_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  const char *kb = reinterpret_cast<const char*>(kc), *vb = reinterpret_cast<const char*>(vc);
  prefetch_rows(kb, vb, table, block_shift, slot_bytes, 0, std::min<int64_t>(L, 32), kRowBytes);  // as attend_heads
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
    const at::BFloat16* kp[16];
    for (int t = 0; t < n; ++t) kp[t] = kc + slot_of(table, block_shift, t0 + t) * slot_stride;
    prefetch_rows(kb, vb, table, block_shift, slot_bytes, std::min(L, t0 + 32), std::min(L, t0 + 48), kRowBytes);
    for (int g = 0; g < GC; ++g) {
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        acc[t] = _mm512_setzero_ps();
        if (t < n)
          for (int p = 0; p < P; ++p)
            acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)qv[g][p], (__m512bh)_mm512_loadu_si512(kp[t] + 32 * p));
      }
      _mm512_mask_storeu_ps(sc.data() + g * L + t0, lane_mask(n), _mm512_mul_ps(hsum16(acc), vscale));
    }
  }
  float inv_sum[GC];
  softmax_rows<GC, true>(sc.data(), L, inv_sum, eb.data(), LP);
  __m512 lo[GC][P], hi[GC][P];
  for (int g = 0; g < GC; ++g)
    for (int p = 0; p < P; ++p) lo[g][p] = hi[g][p] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 2) {
    const at::BFloat16* v0 = vc + slot_of(table, block_shift, t) * slot_stride;
    const at::BFloat16* v1 = t + 1 < L ? vc + slot_of(table, block_shift, t + 1) * slot_stride : nullptr;
    __m512i ul[P], uh[P];
    for (int p = 0; p < P; ++p) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * p);
      const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * p) : _mm512_setzero_si512();
      ul[p] = _mm512_unpacklo_epi16(a, b);
      uh[p] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < GC; ++g) {
      int32_t w2;
      std::memcpy(&w2, eb.data() + g * LP + t, sizeof(w2));  // (e_t, e_t+1)
      const __m512bh w = (__m512bh)_mm512_set1_epi32(w2);
      for (int p = 0; p < P; ++p) {
        lo[g][p] = _mm512_dpbf16_ps(lo[g][p], (__m512bh)ul[p], w);
        hi[g][p] = _mm512_dpbf16_ps(hi[g][p], (__m512bh)uh[p], w);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int g = 0; g < GC; ++g) {
    const __m512 is = _mm512_set1_ps(inv_sum[g]);
    for (int p = 0; p < P; ++p) {
      at::BFloat16* o = out + g * out_head_stride + 32 * p;
      store16f(o, _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][p], first, hi[g][p]), is));
      store16f(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][p], second, hi[g][p]), is));
    }
  }
}
#endif

// f(std::integral_constant<int, gc>()) for a run-time gc in 1..N: the compile-time head count
template <int N, class F>
inline void with_head_count(int gc, const F& f) {
  if constexpr (N >= 1) {
    if (gc == N) return f(std::integral_constant<int, N>());
    with_head_count<N - 1>(gc, f);
  }
}

// one (query row, KV head): its G query heads in chunks of up to GM (4 at head_dim 64, 2 at 128:
// what the registers hold), each chunk reading the keys and values again from L1 / L2; a head's
// numbers do not depend on the chunk it is in
template <int C, class T>
void attend_one(const T* q, int64_t q_head_stride, const T* kc, const T* vc, int64_t slot_stride,
                const int64_t* table, int block_shift, int64_t L, int G, float scale, T* out,
                int64_t out_head_stride, bool pairs, std::vector<float>& sc, std::vector<uint16_t>& eb) {
  constexpr int GM = C <= 4 ? 4 : 2;
  for (int g0 = 0; g0 < G; g0 += GM) {
    const T* qg = q + g0 * q_head_stride;
    T* og = out + g0 * out_head_stride;
#if QS_BF16DOT
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      if (pairs) {
        with_head_count<GM>(std::min(GM, G - g0), [&](auto gc) {
          attend_heads_pairs<C, decltype(gc)::value>(qg, q_head_stride, kc, vc, slot_stride, table, block_shift, L,
                                                     scale, og, out_head_stride, sc, eb);
        });
        continue;
      }
    }
#endif
    (void)pairs;
    (void)eb;
    with_head_count<GM>(std::min(GM, G - g0), [&](auto gc) {
      attend_heads<C, decltype(gc)::value, T>(qg, q_head_stride, kc, vc, slot_stride, table, block_shift, L, scale,
                                              og, out_head_stride, sc);
    });
  }
}

// ---- fresh prompts (fp32; bf16 below): blocks of query rows, queries on the vector lanes -----
//
// A fresh prompt's rows attend over keys 0..own position only, so R consecutive rows and the G
// query heads of one KV head (NQ = R * G query vectors) share every key up to the last row. The
// block's queries are transposed once (qt[d] = element d of 16 queries), and a key's 16 scores
// are one FMA chain over the head dim d = 0, 1, ... against that key's element d: 8 keys and up
// to 48 queries at a time (24 accumulators), each key row read once for NQ queries, no
// horizontal reduction. The softmax runs across the lanes too (per query over its keys
// 0..position, masked past it); then the values, per query one FMA chain over its keys, 6
// queries (2 at head_dim 128) sharing each value row. A query's numbers depend only on its own
// q and keys, never on R, the block it falls in or the other sequences of the step. The score
// sums run in another order than `attend_heads`' (a decode step's: 16 lanes of partial chains
// through `hsum16`), so prefill and decode rows are not bitwise alike; nothing needs them to be
// (a prompt is prefilled once, then decoded). Both paths run at about the cores' FMA rate per
// instruction, but this one needs ~8 FMAs per (query, key) where the per-row one spends ~20
// instructions (`bench/kernels_cpu.py`'s attention table compares them).
constexpr int64_t kPrefillRows = 16;     // query rows per work item (blocks of one KV head)
constexpr int64_t kPrefillMinRows = 16;  // shorter fresh prompts take the per-row kernel

struct PrefillScratch {
  std::vector<float> qt, st, inv;  // qt [D][NQp], scores / weights [L][NQp], 1 / sums [NQp]
  std::vector<int32_t> qt_pairs;   // bf16: qt as the head dim's pairs [D/2][NQp]
};

// scores of KK keys (rows kp[0..KK)) for GG lane groups of queries starting at qt + j: st[t][j..]
template <int D, int KK, int GG>
inline void prefill_scores(const float* qt, int64_t NQp, const float* const* kp, float* st) {
  __m512 acc[KK][GG];
  for (int k = 0; k < KK; ++k)
    for (int g = 0; g < GG; ++g) acc[k][g] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 qv[GG];
    for (int g = 0; g < GG; ++g) {
      qv[g] = _mm512_loadu_ps(qt + d * NQp + 16 * g);
      asm("" : "+v"(qv[g]));  // in a register: GCC otherwise re-reads it as a memory operand of every FMA
    }
    for (int k = 0; k < KK; ++k) {
      const __m512 kb = _mm512_set1_ps(kp[k][d]);
      for (int g = 0; g < GG; ++g) acc[k][g] = _mm512_fmadd_ps(qv[g], kb, acc[k][g]);
    }
  }
  for (int k = 0; k < KK; ++k)
    for (int g = 0; g < GG; ++g) _mm512_storeu_ps(st + k * NQp + 16 * g, acc[k][g]);
}

// the block's score tiles over keys 0..L−1: 8 keys at a time (then 1), 3 lane groups of queries
// at a time (then 2 or 1): tile(KK, GG, kp = the KK keys' rows, first key t, first lane group g),
// KK and GG as std::integral_constant
template <class T, class Tile>
inline void prefill_score_tiles(const T* kc, int64_t slot_stride, const int64_t* table, int block_shift, int64_t L,
                                int64_t NQp, const Tile& tile) {
  const int64_t groups = NQp / 16;
  const auto lanes = [&](auto kk, const T* const* kp, int64_t t) {
    int64_t g = 0;
    for (; g + 3 <= groups; g += 3) tile(kk, std::integral_constant<int, 3>(), kp, t, g);
    with_head_count<2>(static_cast<int>(groups - g), [&](auto gg) { tile(kk, gg, kp, t, g); });
  };
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) {
    const T* kp[8];
    for (int k = 0; k < 8; ++k) kp[k] = kc + slot_of(table, block_shift, t + k) * slot_stride;
    lanes(std::integral_constant<int, 8>(), kp, t);
  }
  for (; t < L; ++t) {
    const T* kp[1] = {kc + slot_of(table, block_shift, t) * slot_stride};
    lanes(std::integral_constant<int, 1>(), kp, t);
  }
}

// the block's softmaxes, one query per lane (j = row * G + head at position r0 + row): over its
// keys 0..position, e_t = exp(s_t − max) in place in st [L][NQp] (0 past the position; with
// kBf16Weights rounded to bf16, as the pair path weighs the values), the sum of the stored e_t a
// chain over t; inv[j] = 1 / sum (padding lanes: inf, never read)
template <bool kBf16Weights>
void prefill_softmax(float* st, int64_t NQp, int64_t NQ, int64_t r0, int G, int64_t L, float* inv) {
  for (int64_t j0 = 0; j0 < NQp; j0 += 16) {
    alignas(64) int32_t posv[16];
    for (int i = 0; i < 16; ++i) posv[i] = j0 + i < NQ ? static_cast<int32_t>(r0 + (j0 + i) / G) : -1;
    const __m512i pos = _mm512_load_si512(posv);
    const int64_t last = std::min<int64_t>(L - 1, r0 + (std::min(NQ, j0 + 16) - 1) / G);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t u = 0; u <= last; ++u) {
      const __mmask16 m = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(u)), pos);
      mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(st + u * NQp + j0));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t u = 0; u <= last; ++u) {
      const __mmask16 m = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(u)), pos);
      __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(st + u * NQp + j0), mx));
      if constexpr (kBf16Weights) {
#if QS_BF16DOT
        const __m256i r = (__m256i)_mm512_cvtneps_pbh(e);
        e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
#endif
      }
      e = _mm512_maskz_mov_ps(m, e);
      _mm512_storeu_ps(st + u * NQp + j0, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    _mm512_storeu_ps(inv + j0, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
  }
}

template <int C>
void prefill_block(const float* q, int64_t q_row_stride, int64_t q_head_stride, const float* kc, const float* vc,
                   int64_t slot_stride, const int64_t* table, int block_shift, int64_t r0, int64_t R, int G,
                   float scale, float* out, int64_t out_row_stride, int64_t out_head_stride, PrefillScratch& s) {
  constexpr int D = 16 * C;
  // query j = (row r0 + j / G, head j % G) at position r0 + j / G; NQp: NQ padded to lanes
  const int64_t NQ = R * G, NQp = (NQ + 15) / 16 * 16, L = r0 + R;
  s.qt.assign(static_cast<size_t>(D) * NQp, 0.f);
  s.st.resize(static_cast<size_t>(L) * NQp);
  s.inv.resize(static_cast<size_t>(NQp));
  float* qt = s.qt.data();
  float* st = s.st.data();
  for (int64_t j = 0; j < NQ; ++j) {
    const float* qp = q + (j / G) * q_row_stride + (j % G) * q_head_stride;
    for (int d = 0; d < D; ++d) qt[d * NQp + j] = qp[d] * scale;  // as attend_heads scales q
  }
  prefill_score_tiles(kc, slot_stride, table, block_shift, L, NQp,
                      [&](auto kk, auto gg, const float* const* kp, int64_t t, int64_t g) {
                        prefill_scores<D, decltype(kk)::value, decltype(gg)::value>(qt + 16 * g, NQp, kp,
                                                                                     st + t * NQp + 16 * g);
                      });
  prefill_softmax<false>(st, NQp, NQ, r0, G, L, s.inv.data());
  // values: queries in groups of QG (their accumulators in registers), each an FMA chain over its
  // own keys; the group's common keys first, then each query's last few alone
  constexpr int QG = C <= 4 ? 6 : 2;
  for (int64_t j0 = 0; j0 < NQ; j0 += QG) {
    const int g = static_cast<int>(std::min<int64_t>(QG, NQ - j0));
    const int64_t common = r0 + j0 / G + 1;  // the group's first query sees the fewest keys
    alignas(64) float part[QG][C][16];  // the group's sums over its common keys
    if (g == QG) {
      __m512 o[QG][C];  // compile-time indices only: kept in registers
      for (int i = 0; i < QG; ++i)
        for (int c = 0; c < C; ++c) o[i][c] = _mm512_setzero_ps();
      for (int64_t u = 0; u < common; ++u) {
        const float* vp = vc + slot_of(table, block_shift, u) * slot_stride;
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vp + 16 * c);
        for (int i = 0; i < QG; ++i) {
          const __m512 p = _mm512_set1_ps(st[u * NQp + j0 + i]);
          for (int c = 0; c < C; ++c) o[i][c] = _mm512_fmadd_ps(p, vv[c], o[i][c]);
        }
      }
      for (int i = 0; i < QG; ++i)
        for (int c = 0; c < C; ++c) _mm512_store_ps(part[i][c], o[i][c]);
    }
    for (int i = 0; i < g; ++i) {
      const int64_t jj = j0 + i, len = r0 + jj / G + 1;
      __m512 acc[C];
      for (int c = 0; c < C; ++c) acc[c] = g == QG ? _mm512_load_ps(part[i][c]) : _mm512_setzero_ps();
      for (int64_t u = g == QG ? common : 0; u < len; ++u) {
        const float* vp = vc + slot_of(table, block_shift, u) * slot_stride;
        const __m512 p = _mm512_set1_ps(st[u * NQp + jj]);
        for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vp + 16 * c), acc[c]);
      }
      float* op = out + (jj / G) * out_row_stride + (jj % G) * out_head_stride;
      const __m512 is = _mm512_set1_ps(s.inv[jj]);
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(op + 16 * c, _mm512_mul_ps(acc[c], is));
    }
  }
}

#if QS_BF16DOT
// The same blocked prefill for bf16 q / caches on the AVX512-BF16 pair path, with the per-row
// pair path's arithmetic (`attend_heads_pairs`): scores from vdpbf16ps over the head dim's bf16
// pairs (exact products, fp32 sums: lane j holds query j's pair (q[2p], q[2p + 1]), the key's
// pair is broadcast), times scale; the weights e_t rounded to bf16 and normalised by the sum of
// the rounded weights; the values by vdpbf16ps over key pairs (t, t + 1) (a last odd key paired
// with zeros), one permute per 16 outputs, rounded to bf16. One fixed sequence of operations
// per query, in another order than the per-row path's (which reduces 16 lanes through hsum16);
// after the bf16 rounding of the weights and the output the two rarely differ.
template <int P, int KK, int GG>
inline void prefill_scores_pairs(const int32_t* qt, int64_t NQp, const at::BFloat16* const* kp, float scale,
                                 float* st) {
  __m512 acc[KK][GG];
  for (int k = 0; k < KK; ++k)
    for (int g = 0; g < GG; ++g) acc[k][g] = _mm512_setzero_ps();
  for (int p = 0; p < 16 * P; ++p) {  // the head dim's pairs
    __m512i qv[GG];
    for (int g = 0; g < GG; ++g) {
      qv[g] = _mm512_loadu_si512(qt + p * NQp + 16 * g);
      asm("" : "+v"(qv[g]));  // in a register (as prefill_scores)
    }
    for (int k = 0; k < KK; ++k) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(kp[k])[p]);
      for (int g = 0; g < GG; ++g) acc[k][g] = _mm512_dpbf16_ps(acc[k][g], (__m512bh)qv[g], kb);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int k = 0; k < KK; ++k)
    for (int g = 0; g < GG; ++g) _mm512_storeu_ps(st + k * NQp + 16 * g, _mm512_mul_ps(acc[k][g], vscale));
}

// the bf16 pair (e_t, e_t+1) of query j's rounded weights (stored as fp32 in st), e_t+1 = 0 past its keys
inline int32_t weight_pair(const float* st, int64_t NQp, int64_t j, int64_t t, int64_t len) {
  uint32_t a, b = 0;
  std::memcpy(&a, st + t * NQp + j, 4);
  if (t + 1 < len) std::memcpy(&b, st + (t + 1) * NQp + j, 4);
  return static_cast<int32_t>((a >> 16) | (b & 0xFFFF0000u));
}

template <int C>
void prefill_block_pairs(const at::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, const at::BFloat16* kc,
                         const at::BFloat16* vc, int64_t slot_stride, const int64_t* table, int block_shift,
                         int64_t r0, int64_t R, int G, float scale, at::BFloat16* out, int64_t out_row_stride,
                         int64_t out_head_stride, PrefillScratch& s) {
  constexpr int P = C / 2, DP = 16 * P;  // 32 bf16 of the head dim per vector; DP pairs
  const int64_t NQ = R * G, NQp = (NQ + 15) / 16 * 16, L = r0 + R;
  s.qt_pairs.assign(static_cast<size_t>(DP) * NQp, 0);
  s.st.resize(static_cast<size_t>(L) * NQp);
  s.inv.resize(static_cast<size_t>(NQp));
  int32_t* qt = s.qt_pairs.data();
  float* st = s.st.data();
  for (int64_t j = 0; j < NQ; ++j) {  // query j's pairs (q[2p], q[2p + 1]) as stored
    const at::BFloat16* qp = q + (j / G) * q_row_stride + (j % G) * q_head_stride;
    for (int p = 0; p < DP; ++p) std::memcpy(qt + p * NQp + j, qp + 2 * p, 4);
  }
  prefill_score_tiles(kc, slot_stride, table, block_shift, L, NQp,
                      [&](auto kk, auto gg, const at::BFloat16* const* kp, int64_t t, int64_t g) {
                        prefill_scores_pairs<P, decltype(kk)::value, decltype(gg)::value>(
                            qt + 16 * g, NQp, kp, scale, st + t * NQp + 16 * g);
                      });
  prefill_softmax<true>(st, NQp, NQ, r0, G, L, s.inv.data());  // weights rounded to bf16
  // values: per key pair (t, t + 1) the two rows interleaved per head-dim element (as
  // attend_heads_pairs), QG queries at a time over the pairs all of them have, then each alone
  constexpr int QG = C <= 4 ? 6 : 2;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  auto interleave = [&](int64_t u, int64_t len, __m512i (&ul)[P], __m512i (&uh)[P]) {
    const at::BFloat16* v0 = vc + slot_of(table, block_shift, u) * slot_stride;
    const at::BFloat16* v1 = u + 1 < len ? vc + slot_of(table, block_shift, u + 1) * slot_stride : nullptr;
    for (int p = 0; p < P; ++p) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * p);
      const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * p) : _mm512_setzero_si512();
      ul[p] = _mm512_unpacklo_epi16(a, b);
      uh[p] = _mm512_unpackhi_epi16(a, b);
    }
  };
  for (int64_t j0 = 0; j0 < NQ; j0 += QG) {
    const int g = static_cast<int>(std::min<int64_t>(QG, NQ - j0));
    const int64_t common = (r0 + j0 / G + 1) & ~int64_t(1);  // key pairs every query of the group has whole
    alignas(64) float part[QG][2 * P][16];
    if (g == QG) {
      __m512 lo[QG][P], hi[QG][P];
      for (int i = 0; i < QG; ++i)
        for (int p = 0; p < P; ++p) lo[i][p] = hi[i][p] = _mm512_setzero_ps();
      for (int64_t u = 0; u < common; u += 2) {
        __m512i ul[P], uh[P];
        interleave(u, common, ul, uh);
        for (int i = 0; i < QG; ++i) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(weight_pair(st, NQp, j0 + i, u, common));
          for (int p = 0; p < P; ++p) {
            lo[i][p] = _mm512_dpbf16_ps(lo[i][p], (__m512bh)ul[p], w);
            hi[i][p] = _mm512_dpbf16_ps(hi[i][p], (__m512bh)uh[p], w);
          }
        }
      }
      for (int i = 0; i < QG; ++i)
        for (int p = 0; p < P; ++p) {
          _mm512_store_ps(part[i][2 * p], lo[i][p]);
          _mm512_store_ps(part[i][2 * p + 1], hi[i][p]);
        }
    }
    for (int i = 0; i < g; ++i) {
      const int64_t jj = j0 + i, len = r0 + jj / G + 1;
      __m512 lo[P], hi[P];
      for (int p = 0; p < P; ++p) {
        lo[p] = g == QG ? _mm512_load_ps(part[i][2 * p]) : _mm512_setzero_ps();
        hi[p] = g == QG ? _mm512_load_ps(part[i][2 * p + 1]) : _mm512_setzero_ps();
      }
      for (int64_t u = g == QG ? common : 0; u < len; u += 2) {
        __m512i ul[P], uh[P];
        interleave(u, len, ul, uh);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(weight_pair(st, NQp, jj, u, len));
        for (int p = 0; p < P; ++p) {
          lo[p] = _mm512_dpbf16_ps(lo[p], (__m512bh)ul[p], w);
          hi[p] = _mm512_dpbf16_ps(hi[p], (__m512bh)uh[p], w);
        }
      }
      at::BFloat16* op = out + (jj / G) * out_row_stride + (jj % G) * out_head_stride;
      const __m512 is = _mm512_set1_ps(s.inv[jj]);
      for (int p = 0; p < P; ++p) {
        store16f(op + 32 * p, _mm512_mul_ps(_mm512_permutex2var_ps(lo[p], first, hi[p]), is));
        store16f(op + 32 * p + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo[p], second, hi[p]), is));
      }
    }
  }
}
#endif

template <int C, class T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const std::vector<int64_t>& q_lens,
                          const std::vector<int64_t>& seq_lens, int64_t block_size, double scale,
                          bool pair_path, bool prefill_blocks, at::Tensor& out) {
  const int64_t H = q.size(1), KV = k_cache.size(1), B = static_cast<int64_t>(q_lens.size());
  const int G = static_cast<int>(H / KV);
  const int block_shift = __builtin_ctzll(static_cast<unsigned long long>(block_size));  // a power of two
  std::vector<int64_t> row0(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) row0[b + 1] = row0[b] + q_lens[b];
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t nb = block_tables.size(1);
  const bool pairs = std::is_same<T, at::BFloat16>::value && QS_BF16DOT && pair_path;
  // fresh prompts of kPrefillMinRows or more, fp32 or bf16 on the pair path: blocks of rows
  // (`prefill_block`, `prefill_block_pairs`)
  std::vector<char> blocked(B, 0);
  if (std::is_same<T, float>::value || pairs) {
    std::vector<std::array<int64_t, 3>> work;  // (sequence, KV head, first row of the block)
    for (int64_t b = 0; b < B && prefill_blocks; ++b) {
      if (q_lens[b] != seq_lens[b] || q_lens[b] < kPrefillMinRows) continue;
      blocked[b] = 1;
      // blocks from both ends in turn (a block's keys grow with its position): the threads'
      // contiguous ranges of items then hold about the same work
      const int64_t nblk = (q_lens[b] + kPrefillRows - 1) / kPrefillRows;
      for (int64_t i = 0, lo = 0, hi = nblk - 1; i < nblk; ++i) {
        const int64_t blk = i % 2 == 0 ? hi-- : lo++;
        for (int64_t h = 0; h < KV; ++h) work.push_back({b, h, blk * kPrefillRows});
      }
    }
    if (!work.empty()) {
      at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t w0, int64_t w1) {
        PrefillScratch scratch;
        for (int64_t w = w0; w < w1; ++w) {
          const int64_t b = work[w][0], h = work[w][1], r0 = work[w][2];
          const int64_t R = std::min(kPrefillRows, q_lens[b] - r0);
          const int64_t row = row0[b] + r0;
          const T* qb = qp + row * q.stride(0) + h * G * q.stride(1);
          T* ob = op + row * out.stride(0) + h * G * out.stride(1);
          if constexpr (std::is_same<T, float>::value) {
            prefill_block<C>(qb, q.stride(0), q.stride(1), kc + h * k_cache.stride(1), vc + h * v_cache.stride(1),
                             k_cache.stride(0), tables + b * nb, block_shift, r0, R, G, static_cast<float>(scale),
                             ob, out.stride(0), out.stride(1), scratch);
          } else {
#if QS_BF16DOT
            prefill_block_pairs<C>(qb, q.stride(0), q.stride(1), kc + h * k_cache.stride(1),
                                   vc + h * v_cache.stride(1), k_cache.stride(0), tables + b * nb, block_shift, r0,
                                   R, G, static_cast<float>(scale), ob, out.stride(0), out.stride(1), scratch);
#endif
          }
        }
      });
    }
  }
  // the other rows, one work item per (row, KV head), in (sequence, KV head, row) order: a
  // thread's contiguous range holds as few KV heads of a sequence as it can, so of a
  // verification step's rows it reads each head's keys and values from memory once and from its
  // own L2 for the next rows (in (row, head) order each thread read every head from memory: 11
  // rows over 2 threads, 3 heads each instead of 2)
  std::vector<int64_t> item_row, item_head, row_seq(row0[B]);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = row0[b]; r < row0[b + 1]; ++r) row_seq[r] = b;
    if (blocked[b]) continue;
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t r = row0[b]; r < row0[b + 1]; ++r) {
        item_row.push_back(r);
        item_head.push_back(h);
      }
  }
  const int64_t items = static_cast<int64_t>(item_row.size());
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc;
    std::vector<uint16_t> eb;
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t r = item_row[it], h = item_head[it], b = row_seq[r];
      const int64_t L = seq_lens[b] - q_lens[b] + (r - row0[b]) + 1;  // keys 0..position
      attend_one<C, T>(qp + r * q.stride(0) + h * G * q.stride(1), q.stride(1), kc + h * k_cache.stride(1),
                       vc + h * v_cache.stride(1), k_cache.stride(0), tables + b * nb, block_shift, L, G,
                       static_cast<float>(scale), op + r * out.stride(0) + h * G * out.stride(1),
                       out.stride(1), pairs, sc, eb);
    }
  });
}

#endif  // QS_AVX512

}  // namespace

// q [T, H, hd] (rows grouped by sequence, q_lens[b] rows each; last dim contiguous);
// k_new, v_new [T, KV, hd] written to k_cache / v_cache [slots, KV, hd] at slot_mapping [T];
// block_tables [B, nb] int64; returns out [T, H, hd] (contiguous, q's dtype).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const std::vector<int64_t>& q_lens,
                           const std::vector<int64_t>& seq_lens, int64_t block_size, double scale, bool pairs,
                           bool prefill_blocks) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && k_cache.dim() == 3, "paged_attention: q, k [T, heads, hd]");
  const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), KV = k_cache.size(1);
  TORCH_CHECK(q.stride(2) == 1 && k_new.stride(2) == 1 && v_new.stride(2) == 1 && k_cache.is_contiguous()
              && v_cache.is_contiguous(), "paged_attention: the head dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_new.scalar_type() == k_cache.scalar_type()
              && v_new.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: one dtype for q, k, v and the cache");
  TORCH_CHECK(KV > 0 && H % KV == 0, "paged_attention: the query heads (", H, ") must be a multiple of the KV heads (",
              KV, ")");  // any number per KV head: they are computed in chunks of up to 4
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0, "paged_attention: block_size must be a power of two, got ",
              block_size);
  TORCH_CHECK(hd == 64 || hd == 128, "paged_attention: head_dim must be 64 or 128, got ", hd);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T && block_tables.scalar_type() == at::kLong
              && block_tables.is_contiguous(), "paged_attention: int64 slot_mapping [T] and block_tables [B, nb]");
  TORCH_CHECK(q_lens.size() == seq_lens.size() && block_tables.size(0) == static_cast<int64_t>(q_lens.size()),
              "paged_attention: one q_len, seq_len and block-table row per sequence");
  int64_t total = 0;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    TORCH_CHECK(q_lens[b] >= 1 && q_lens[b] <= seq_lens[b], "paged_attention: bad q_len / seq_len");
    TORCH_CHECK((seq_lens[b] + block_size - 1) / block_size <= block_tables.size(1), "paged_attention: block table too short");
    total += q_lens[b];
  }
  TORCH_CHECK(total == T, "paged_attention: q_lens sum to ", total, ", q has ", T, " rows");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == hd && k_new.size(0) == T
              && v_new.size(0) == T && k_new.size(1) == KV && v_new.size(1) == KV,
              "paged_attention: k / v / cache shapes disagree");
  const int64_t num_slots = k_cache.size(0), num_blocks = num_slots / block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "paged_attention: slot ", slots[t], " out of range");
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  for (size_t b = 0; b < q_lens.size(); ++b)
    for (int64_t j = 0; j < (seq_lens[b] + block_size - 1) / block_size; ++j) {
      const int64_t id = bt[b * block_tables.size(1) + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: block id ", id, " out of range");
    }
  // write this step's keys / values (row copies)
  const int64_t esz = k_cache.element_size(), row_bytes = KV * hd * esz;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < KV; ++h) {
      std::memcpy(kc + slots[t] * row_bytes + h * hd * esz,
                  static_cast<const char*>(k_new.data_ptr()) + (t * k_new.stride(0) + h * k_new.stride(1)) * esz, hd * esz);
      std::memcpy(vc + slots[t] * row_bytes + h * hd * esz,
                  static_cast<const char*>(v_new.data_ptr()) + (t * v_new.stride(0) + h * v_new.stride(1)) * esz, hd * esz);
    }
  }
  at::Tensor out = at::empty({T, H, hd}, q.options());
#if QS_AVX512
  if (q.scalar_type() == at::kFloat) {
    if (hd == 64) paged_attention_impl<4, float>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, pairs, prefill_blocks, out);
    else paged_attention_impl<8, float>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, pairs, prefill_blocks, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16 only");
    if (hd == 64) paged_attention_impl<4, at::BFloat16>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, pairs, prefill_blocks, out);
    else paged_attention_impl<8, at::BFloat16>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, pairs, prefill_blocks, out);
  }
  return out;
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

static qs_bind::Register bind_attention([](pybind11::module_& m) {
  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("q_lens"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("pairs") = true, py::arg("prefill_blocks") = true);
});
