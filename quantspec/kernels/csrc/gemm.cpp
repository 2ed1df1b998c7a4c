// GEMMs of quantspec's CPU kernels: y = x @ Wᵀ (+ bias) for rows of x (fp32 or bf16) over fp32 /
// bf16 / int8 / int4 weights, for decode, speculative verification and prefill.
//
// y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n]); w dequantized on the fly:
//   fp32 / bf16: w as stored;  int8: q[n, k] * scale[n];
//   int4: (q[n, k] - zp[n, g]) * scale[n, g], g = k / group (scale / zp fp32; zp optional);
//   fp4: e2m1(q[n, k]) * scale[n, g] (NVFP4 / MXFP4: the group's scale already over the global).
// x is fp32 or bf16 (converted once to fp32); accumulation in fp32; y in x's dtype.
//
// Two layouts. Row-major [N, K] weights (`dense_gemv`) are read one weight row per tile of up to
// 4 rows of x, two accumulators per (m, n) alternating over 16-wide chunks and one fixed
// horizontal reduction. Column-blocked weights (`packed_*`, packed once at load) give every
// output one FMA chain over k in one vector lane. Either way every output element is computed by
// the same sequence of float operations whatever M and whichever rows it is tiled with, so a
// row's result is bitwise the same in a 1-row decode step and in a 1 + k-row verification step.

#include "cpu.h"

namespace {

// the quantized GEMMs' pair path: bf16 x and an even K on a CPU with AVX512-BF16, when asked
inline bool use_pair_path(const at::Tensor& x, int64_t K, bool pairs) {
  return QS_BF16DOT && pairs && x.scalar_type() == at::kBFloat16 && K % 2 == 0;
}

}  // namespace

// y = x @ w^T (+ bias); w [N, K] fp32 or bf16
at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dense_gemv: w must be contiguous [N, K]");
  check_x(x, w.size(1), "dense_gemv");
  const int64_t N = w.size(0), K = w.size(1);
  const float* b = opt_f32(bias, N, "dense_gemv: bias");
#if QS_AVX512
  if (w.scalar_type() == at::kFloat)
    return gemm_out(x, N, [&](const float* xf, auto* y) {
      run(F32Rows{w.data_ptr<float>(), K}, xf, x.size(0), K, N, nullptr, b, y, K * 4);
    });
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "dense_gemv: w must be float32 or bfloat16");
  return gemm_out(x, N, [&](const float* xf, auto* y) {
    run(BF16Rows{w.data_ptr<at::BFloat16>(), K}, xf, x.size(0), K, N, nullptr, b, y, K * 2);
  });
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

// ---- GEMMs over packed weights (any M) ------------------------------------------------------
//
// A weight [N, K] is packed once into column blocks of 32 outputs, [NB, K, 32] (N zero-padded to
// NB * 32): block b holds w[32 b + j, k] at (b, k, j), so one k step of a block is two vectors
// and a block streams from memory sequentially. A tile of RM rows of x times W blocks keeps its
// 2 RM W accumulators in registers: per k, each block's two weight vectors are loaded (and
// dequantized) once and used RM times against a broadcast x[m, k], where the row-major kernels
// above reload x and reduce horizontally. Every output element is one fp32 FMA chain over
// k = 0..K-1 in one vector lane, then (× scale) + bias: the same operations whatever M and
// whichever tile the row is in, so decode and verification rows agree bitwise
// (bench/kernels_cpu.py compares them with torch's ops).

namespace {

#if QS_AVX512

// Quantized blocks, same tiling: int8 [NB, K, 32] codes with one scale per output (applied after
// the chain); int4 [NB, K, 16] bytes (byte j of a k step: column j in the low nibble, column
// j + 16 in the high one, each code + 8) dequantized per group as (q + 8) * s + off with
// off = neg_zs - 8 s (s, off [NB, G, 32]) before the FMAs.

// k-step loaders of one column block (aggregates: default-constructible, copyable)
struct F32BlockLoader {
  const float* w;  // the block [K, 32]
  inline void operator()(int64_t k, __m512& w0, __m512& w1) const {
    w0 = _mm512_loadu_ps(w + k * 32);
    w1 = _mm512_loadu_ps(w + k * 32 + 16);
  }
};

struct I8BlockLoader {
  const int8_t* q;  // the block [K, 32]
  inline void operator()(int64_t k, __m512& w0, __m512& w1) const {
    const int8_t* p = q + k * 32;
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
};

// 16 int8 codes as fp32 (exact)
inline __m512 i8x16_f32(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// lanes (a[j], b[j]) fp32 → bf16 pairs a[j] | b[j] << 16 by truncation: exact for values with at
// most 8 significant bits (every int8 code)
inline __m512 bf16_pairs_of(__m512 a, __m512 b) {
  const __m512i r = _mm512_ternarylogic_epi32(_mm512_castps_si512(b), _mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                              _mm512_set1_epi32(int(0xFFFF0000u)), 0xEC);  // (b & hi) | a >> 16
  return _mm512_castsi512_ps(r);
}
// a block of k-pairs already in bf16, int32 [K/2, 32]
struct PairBlockLoader {
  const int32_t* w;
  inline void operator()(int64_t p, __m512& w0, __m512& w1) const {
    w0 = _mm512_castsi512_ps(_mm512_loadu_si512(w + p * 32));
    w1 = _mm512_castsi512_ps(_mm512_loadu_si512(w + p * 32 + 16));
  }
};
// the same block [K, 32] read a k-pair at a time for the pair path: p → rows 2p, 2p + 1 as bf16 pairs
struct I8PairLoader {
  const int8_t* q;
  inline void operator()(int64_t p, __m512& w0, __m512& w1) const {
    const int8_t* r = q + p * 64;
    w0 = bf16_pairs_of(i8x16_f32(r), i8x16_f32(r + 32));
    w1 = bf16_pairs_of(i8x16_f32(r + 16), i8x16_f32(r + 48));
  }
};

// RM rows of x times W consecutive column blocks (b .. b + W - 1), one loader per block: the
// W blocks' FMA chains are independent, so a 1-row tile keeps 2 W chains in flight instead of
// waiting on one FMA's latency per k (each output's operations are the same whatever W)
// what a tile computes: kChain, one fp32 FMA chain per output over k (x as fp32); kPairs, bf16
// x in k-pairs through vdpbf16ps (below); kInt4Pairs, the same per int4 group, then scaled
constexpr int kChain = 0, kPairs = 1, kInt4Pairs = 2;

//
// Pair path (kPairs, bf16 x on a CPU with AVX512-BF16): x is read as bf16 pairs along k (int32 =
// x[m, 2p] | x[m, 2p + 1] << 16, i.e. the bf16 row itself) and the loader yields each k-pair of
// the block as bf16 pairs, so one vdpbf16ps does the FMAs of two k steps: twice the FMA rate
// where verification rows or a prefill make the step compute-bound. Exact inputs: bf16 x is
// the model's own activation, and the int8 codes are integers bf16 represents exactly, so each
// product is exact in fp32 and only the summation order differs from the fp32 chain (k = 2p + 1
// then 2p into one lane's accumulator); subnormal inputs / sums flush to zero (< 2^-126). Again
// the same operations for an output whatever M, so decode and verification rows agree bitwise.
#if QS_BF16DOT
// the pair path's dot products: acc0 / acc1[j][i] += row i of x (bf16 pairs, KP a row) times block
// j over the k-pairs p0 <= p < p1, one vdpbf16ps per (row, block, half) in ascending p; all of K
// (kPairs) or one int4 group (kInt4Pairs)
template <int RM, int W, class Load>
inline void pair_dots(const Load* loads, const int32_t* xr, int64_t KP, int64_t p0, int64_t p1,
                      __m512 (&acc0)[W][RM], __m512 (&acc1)[W][RM]) {
  for (int64_t p = p0; p < p1; ++p) {
    __m512 w0[W], w1[W];
    for (int j = 0; j < W; ++j) loads[j](p, w0[j], w1[j]);
    for (int i = 0; i < RM; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[i * KP + p]);
      for (int j = 0; j < W; ++j) {
        acc0[j][i] = _mm512_dpbf16_ps(acc0[j][i], (__m512bh)w0[j], xb);
        acc1[j][i] = _mm512_dpbf16_ps(acc1[j][i], (__m512bh)w1[j], xb);
      }
    }
  }
}
#endif

template <int RM, int W, int MODE, class T, class Load>
inline void packed_tile_q(Load* loads, int64_t K, const void* x, const float* col_scale,
                          const float* bias, T* y, int64_t N, int64_t b, int64_t m0) {
  __m512 a0[W][RM], a1[W][RM];
  for (int j = 0; j < W; ++j)
    for (int i = 0; i < RM; ++i) a0[j][i] = a1[j][i] = _mm512_setzero_ps();
  if constexpr (MODE == kPairs) {
#if QS_BF16DOT
    const int64_t KP = K / 2;
    pair_dots<RM, W>(loads, static_cast<const int32_t*>(x) + m0 * KP, KP, 0, KP, a0, a1);
#endif
  } else if constexpr (MODE == kInt4Pairs) {
#if QS_BF16DOT
    // per group g: c = Σ_k x_k q_k over the group's pairs (exact products of bf16 x and the signed
    // codes), then a = fma(c, scale_g, a), a = fma(Σ_k x_k, zero_g, a) with zero_g = offset +
    // 8 scale (= −zp · scale, exactly 0 for symmetric weights): the same operations for an
    // output whatever M
    const int64_t KP = K / 2, GP = loads[0].group / 2, G = K / loads[0].group;
    const int32_t* xr = static_cast<const int32_t*>(x) + m0 * KP;
    const float* xs = loads[0].xsum + m0 * G;  // [M, G] group sums of x
    for (int64_t g = 0; g < G; ++g) {
      __m512 c0[W][RM], c1[W][RM];
      for (int j = 0; j < W; ++j)
        for (int i = 0; i < RM; ++i) c0[j][i] = c1[j][i] = _mm512_setzero_ps();
      pair_dots<RM, W>(loads, xr, KP, g * GP, (g + 1) * GP, c0, c1);
      for (int j = 0; j < W; ++j) {
        __m512 s0, s1, z0, z1;
        loads[j].group_vectors(g, s0, s1, z0, z1);
        for (int i = 0; i < RM; ++i) {
          const __m512 xg = _mm512_set1_ps(xs[i * G + g]);
          a0[j][i] = _mm512_fmadd_ps(xg, z0, _mm512_fmadd_ps(c0[j][i], s0, a0[j][i]));
          a1[j][i] = _mm512_fmadd_ps(xg, z1, _mm512_fmadd_ps(c1[j][i], s1, a1[j][i]));
        }
      }
    }
#endif
  } else {
    const float* xr = static_cast<const float*>(x) + m0 * K;
    for (int64_t k = 0; k < K; ++k) {
      __m512 w0[W], w1[W];
      for (int j = 0; j < W; ++j) loads[j](k, w0[j], w1[j]);
      for (int i = 0; i < RM; ++i) {
        const __m512 xb = _mm512_set1_ps(xr[i * K + k]);
        for (int j = 0; j < W; ++j) {
          a0[j][i] = _mm512_fmadd_ps(xb, w0[j], a0[j][i]);
          a1[j][i] = _mm512_fmadd_ps(xb, w1[j], a1[j][i]);
        }
      }
    }
  }
  for (int j = 0; j < W; ++j) {
    const int64_t n0 = (b + j) * 32;
    const __mmask16 k0 = lane_mask(N - n0), k1 = lane_mask(N - n0 - 16);
    __m512 s0 = _mm512_set1_ps(1.f), s1 = _mm512_set1_ps(1.f), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (col_scale) { s0 = _mm512_maskz_loadu_ps(k0, col_scale + n0); s1 = _mm512_maskz_loadu_ps(k1, col_scale + n0 + 16); }
    if (bias) { b0 = _mm512_maskz_loadu_ps(k0, bias + n0); b1 = _mm512_maskz_loadu_ps(k1, bias + n0 + 16); }
    for (int i = 0; i < RM; ++i) {
      __m512 v0 = a0[j][i], v1 = a1[j][i];
      if (col_scale) { v0 = _mm512_mul_ps(v0, s0); v1 = _mm512_mul_ps(v1, s1); }
      if (bias) { v0 = _mm512_add_ps(v0, b0); v1 = _mm512_add_ps(v1, b1); }
      store32(y + (m0 + i) * N + n0, v0, v1, k0, k1);
    }
  }
}

// rows [m0, m0 + RM) over blocks [b0, b1): W blocks at a time (fewer rows, more blocks: 16-22
// accumulators), then one at a time; a fresh loader per tile, so every tile runs the same
// operations from k = 0
template <int RM, int MODE, class T, class MakeLoader>
inline void packed_rows(const MakeLoader& make, int64_t K, const void* x, const float* col_scale,
                        const float* bias, T* y, int64_t N, int64_t b0, int64_t b1, int64_t m0) {
  constexpr int W = RM <= 2 ? 4 : RM <= 4 ? 2 : 1;
  using Load = decltype(make(int64_t(0)));
  int64_t b = b0;
  for (; b + W <= b1; b += W) {
    Load loads[W] = {};
    for (int j = 0; j < W; ++j) loads[j] = make(b + j);
    packed_tile_q<RM, W, MODE>(loads, K, x, col_scale, bias, y, N, b, m0);
  }
  for (; b < b1; ++b) {
    Load load = make(b);
    packed_tile_q<RM, 1, MODE>(&load, K, x, col_scale, bias, y, N, b, m0);
  }
}

// E2M1's sixteen values in nibble order (bit 3 the sign): the FP4 codebook of the loaders below
inline __m512 e2m1_table_f32() {
  return _mm512_set_ps(-6.f, -4.f, -3.f, -2.f, -1.5f, -1.f, -0.5f, -0.f, 6.f, 4.f, 3.f, 2.f, 1.5f, 1.f, 0.5f, 0.f);
}

// int4 block b: the k-step loader keeps the current group's scale / neg_zs vectors. FP4: the
// nibble is an E2M1 code, looked up in E2M1's values and scaled (no zero point: z unread)
template <bool FP4 = false>
struct I4BlockLoader {
  const uint8_t* q; const float* s; const float* z; int64_t K, G, group, b;
  mutable int64_t g = -1, next = 0;  // the current group; the k where the next one starts
  mutable __m512 s0, s1, z0, z1;
  inline void operator()(int64_t k, __m512& w0, __m512& w1) const {  // k = 0, 1, ... in order
    if (k == next) {
      ++g;
      next += group;
      const float* sp = s + (b * G + g) * 32;
      s0 = _mm512_loadu_ps(sp); s1 = _mm512_loadu_ps(sp + 16);
      if constexpr (!FP4) {
        const float* zp = z + (b * G + g) * 32;
        z0 = _mm512_loadu_ps(zp); z1 = _mm512_loadu_ps(zp + 16);
      }
    }
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (b * K + k) * 16)));
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));  // int4: code + 8; FP4: the E2M1 nibble
    const __m512i hi = _mm512_srli_epi32(v, 4);
    if constexpr (FP4) {
      const __m512 table = e2m1_table_f32();
      w0 = _mm512_mul_ps(_mm512_permutexvar_ps(lo, table), s0);
      w1 = _mm512_mul_ps(_mm512_permutexvar_ps(hi, table), s1);
    } else {
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s0, z0);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s1, z1);
    }
  }
};

#if QS_BF16DOT
// int4 block b for the pair path: k-pair p → its codes as bf16 pairs (a table lookup of the nibble:
// q = nibble − 8, exact in bf16), plus the group's scale and zero vectors; `xsum` [M, G] holds
// each row's group sums of x. FP4: the nibble's E2M1 value (exact in bf16), zero vectors 0
template <bool FP4 = false>
struct I4PairLoader {
  const uint8_t* q; const float* s; const float* z; const float* xsum; int64_t K, G, group, b;
  inline void operator()(int64_t p, __m512& w0, __m512& w1) const {
    const uint8_t* r = q + (b * K + 2 * p) * 16;  // rows 2p, 2p + 1: 16 bytes each
    const __m512i u0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    const __m512i u1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16)));
    const __m512i nib = _mm512_set1_epi32(0x000F000F);
    // word 2j = nibble of row 2p, word 2j + 1 = row 2p + 1: low nibbles (columns 0-15), high (16-31)
    const __m512i lo = _mm512_ternarylogic_epi32(u0, _mm512_slli_epi32(u1, 16), nib, 0xA8);  // (u0 | u1 << 16) & nib
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi32(u0, 4), _mm512_slli_epi32(u1, 12), nib, 0xA8);
    const __m512i table = FP4 ? _mm512_set_epi16(  // bf16(e2m1(n)) at word n (n < 16), zero above
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        int16_t(0xC0C0), int16_t(0xC080), int16_t(0xC040), int16_t(0xC000), int16_t(0xBFC0), int16_t(0xBF80),
        int16_t(0xBF00), int16_t(0x8000), 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000)
      : _mm512_set_epi16(  // bf16(n - 8) at word n (n < 16), zero above
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
        int16_t(0xBF80), int16_t(0xC000), int16_t(0xC040), int16_t(0xC080), int16_t(0xC0A0), int16_t(0xC0C0),
        int16_t(0xC0E0), int16_t(0xC100));
    w0 = _mm512_castsi512_ps(_mm512_permutexvar_epi16(lo, table));
    w1 = _mm512_castsi512_ps(_mm512_permutexvar_epi16(hi, table));
  }
  // scale_g and zero_g = offset_g + 8 scale_g of the block's 32 outputs
  inline void group_vectors(int64_t g, __m512& s0, __m512& s1, __m512& z0, __m512& z1) const {
    const float* sp = s + (b * G + g) * 32;
    s0 = _mm512_loadu_ps(sp); s1 = _mm512_loadu_ps(sp + 16);
    if constexpr (FP4) {
      z0 = z1 = _mm512_setzero_ps();
      return;
    }
    const float* zp = z + (b * G + g) * 32;
    const __m512 eight = _mm512_set1_ps(8.f);
    z0 = _mm512_fmadd_ps(eight, s0, _mm512_loadu_ps(zp)); z1 = _mm512_fmadd_ps(eight, s1, _mm512_loadu_ps(zp + 16));
  }
};
#endif

template <int MODE = kChain, class T, class MakeLoader>
void packed_q_run(const MakeLoader& make, const void* x, int64_t M, int64_t K, int64_t N, int64_t NB,
                  const float* col_scale, const float* bias, T* y, int64_t bytes_per_block) {
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, bytes_per_block));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    // blocks in chunks of 4: the x rows of every tile read while the chunk is in cache. The M
    // rows go in ceil(M / 11) tiles of near-equal size (11 rows: 22 accumulators), so a
    // verification step's 2-11 rows are ONE tile that uses each weight vector as it streams in
    // from memory, where 8 + 2 + 1 tiles would re-read the chunk from L2 for the last 3 rows at a
    // third of the FMA density
    const int64_t tiles = (M + 10) / 11;
    for (int64_t c0 = b0; c0 < b1; c0 += 4) {
      const int64_t c1 = std::min(b1, c0 + 4);
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t rows = (M - m + (tiles - t) - 1) / (tiles - t);  // 1..11
        switch (rows) {
#define QS_TILE(R) case R: packed_rows<R, MODE>(make, K, x, col_scale, bias, y, N, c0, c1, m); break;
          QS_TILE(1) QS_TILE(2) QS_TILE(3) QS_TILE(4) QS_TILE(5) QS_TILE(6)
          QS_TILE(7) QS_TILE(8) QS_TILE(9) QS_TILE(10) QS_TILE(11)
#undef QS_TILE
          default: break;  // unreachable: rows is in 1..11 for every M >= 1 (no throw in a parallel region)
        }
        m += rows;
      }
    }
  });
}

#endif  // QS_AVX512

}  // namespace

// y = x @ (q * scale[:, None])^T (+ bias); q packed [NB, K, 32] int8 (pack_w8), scale [N] fp32
at::Tensor packed_w8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t N,
                          const c10::optional<at::Tensor>& bias, bool pairs) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(2) == 32,
              "packed_w8_gemm: q must be contiguous int8 [NB, K, 32]");
  const int64_t NB = q.size(0), K = q.size(1);
  check_blocks(NB, N, "packed_w8_gemm");
  check_x(x, K, "packed_w8_gemm", 1);
  const float* s = opt_f32(scale, N, "packed_w8_gemm: scale");
  const float* b = opt_f32(bias, N, "packed_w8_gemm: bias");
#if QS_AVX512
  const int8_t* qp = q.data_ptr<int8_t>();
  if (use_pair_path(x, K, pairs)) {
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    auto make = [&](int64_t blk) { return I8PairLoader{qp + blk * K * 32}; };
    packed_q_run<kPairs>(make, x.data_ptr<at::BFloat16>(), x.size(0), K, N, NB, s, b,
                       y.data_ptr<at::BFloat16>(), K * 32);
    return y;
  }
  auto make = [&](int64_t blk) { return I8BlockLoader{qp + blk * K * 32}; };
  return gemm_out(x, N, [&](const float* xf, auto* y) {
    packed_q_run(make, xf, x.size(0), K, N, NB, s, b, y, K * 32);
  });
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

namespace {

// the int4 / FP4 GEMM over nibbles q [NB, K, 16] and group vectors s (and z: int4) [NB, G, 32]
template <bool FP4>
at::Tensor nibble_gemm(const at::Tensor& x, const at::Tensor& q, const float* s, const float* z, int64_t group,
                       int64_t N, const float* b, bool pairs) {
  const int64_t NB = q.size(0), K = q.size(1), G = K / group;
#if QS_AVX512
  const uint8_t* qp = q.data_ptr<uint8_t>();
#if QS_BF16DOT
  if (use_pair_path(x, K, pairs) && group % 2 == 0) {
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    std::vector<float> xsum(M * G);  // each row's group sums: 16 lanes over the group, then reduced (int4's zeros)
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    for (int64_t m = 0; m < M && !FP4; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const at::BFloat16* xg = xp + m * K + g * group;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < group; k += 16) {
          const __mmask16 mk = lane_mask(group - k);
          acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, xg + k)), 16)));
        }
        xsum[m * G + g] = _mm512_reduce_add_ps(acc);
      }
    auto make = [&](int64_t blk) { return I4PairLoader<FP4>{qp, s, z, xsum.data(), K, G, group, blk}; };
    if (M && N) packed_q_run<kInt4Pairs>(make, xp, M, K, N, NB, nullptr, b, y.data_ptr<at::BFloat16>(), K * 16);
    return y;
  }
#endif
  auto make = [&](int64_t blk) { return I4BlockLoader<FP4>{qp, s, z, K, G, group, blk}; };
  return gemm_out(x, N, [&](const float* xf, auto* y) {
    packed_q_run(make, xf, x.size(0), K, N, NB, nullptr, b, y, K * 16);
  });
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

// the checks of a nibble GEMM's operands; G
int64_t check_nibbles(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t group, int64_t N,
                      const char* who) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kByte && q.size(2) == 16,
              who, ": q must be contiguous uint8 [NB, K, 16]");
  const int64_t NB = q.size(0), K = q.size(1);
  check_blocks(NB, N, who);
  TORCH_CHECK(group > 0 && K % group == 0, who, ": group ", group, " must divide K=", K);
  check_x(x, K, who, 1);
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == NB && scale.size(1) == K / group && scale.size(2) == 32,
              who, ": scale must be [NB, G, 32]");
  return K / group;
}

}  // namespace

// y = x @ dequant(q)^T (+ bias); q packed [NB, K, 16] uint8 (pack_w4), scale / offset [NB, G, 32]
// fp32 with w = (code + 8) * scale + offset, groups of `group` consecutive k (K % group == 0)
at::Tensor packed_w4_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const at::Tensor& neg_zs, int64_t group, int64_t N,
                          const c10::optional<at::Tensor>& bias, bool pairs) {
  const int64_t G = check_nibbles(x, q, scale, group, N, "packed_w4_gemm");
  TORCH_CHECK(scale.sizes() == neg_zs.sizes(), "packed_w4_gemm: scale / neg_zs must be [NB, G, 32]");
  const int64_t NB = q.size(0);
  const float* s = opt_f32(scale, NB * G * 32, "packed_w4_gemm: scale");
  const float* z = opt_f32(neg_zs, NB * G * 32, "packed_w4_gemm: neg_zs");
  return nibble_gemm<false>(x, q, s, z, group, N, opt_f32(bias, N, "packed_w4_gemm: bias"), pairs);
}

// y = x @ dequant(q)^T (+ bias); q packed [NB, K, 16] uint8 of E2M1 nibbles (pack_fp4_blocks),
// scale [NB, G, 32] fp32 with w = e2m1(nibble) * scale (NVFP4's local / global, MXFP4's 2^e)
at::Tensor packed_fp4_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t group,
                           int64_t N, const c10::optional<at::Tensor>& bias, bool pairs) {
  const int64_t G = check_nibbles(x, q, scale, group, N, "packed_fp4_gemm");
  const float* s = opt_f32(scale, q.size(0) * G * 32, "packed_fp4_gemm: scale");
  return nibble_gemm<true>(x, q, s, nullptr, group, N, opt_f32(bias, N, "packed_fp4_gemm: bias"), pairs);
}

// y = x @ w^T (+ bias) for bf16 x and a bf16 weight packed in k-pairs, int32 [NB, K/2, 32]
// (`kernels.cpu.pack_pairs`: lane j of pair p = bf16(w[32 b + j, 2p]) | bf16(w[.., 2p + 1]) << 16):
// the quantized GEMMs' pair path with nothing to dequantize; y bf16
at::Tensor packed_pairs_gemm(const at::Tensor& x, const at::Tensor& w_pairs, int64_t N,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w_pairs.dim() == 3 && w_pairs.is_contiguous() && w_pairs.scalar_type() == at::kInt
              && w_pairs.size(2) == 32, "packed_pairs_gemm: w_pairs must be contiguous int32 [NB, K/2, 32]");
  const int64_t NB = w_pairs.size(0), K = 2 * w_pairs.size(1);
  check_blocks(NB, N, "packed_pairs_gemm");
  check_x(x, K, "packed_pairs_gemm", 2);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_pairs_gemm: x must be bfloat16");
  const float* b = opt_f32(bias, N, "packed_pairs_gemm: bias");
#if QS_BF16DOT
  const int32_t* wp = w_pairs.data_ptr<int32_t>();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  auto make = [&](int64_t blk) { return PairBlockLoader{wp + blk * (K / 2) * 32}; };
  if (x.size(0) && N)
    packed_q_run<kPairs>(make, x.data_ptr<at::BFloat16>(), x.size(0), K, N, NB, nullptr, b,
                       y.data_ptr<at::BFloat16>(), K * 64);
  return y;
#else
  TORCH_CHECK(false, "packed_pairs_gemm: quantspec CPU kernels were built without AVX512-BF16");
#endif
}

// y = x @ w^T (+ bias) with w given packed [NB, K, 32] fp32 (quantspec.kernels.cpu.pack_dense);
// x [M, K] fp32 or bf16, any M; y [M, N] in x's dtype
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat
              && packed.size(2) == 32, "packed_gemm: packed must be contiguous float32 [NB, K, 32]");
  const int64_t NB = packed.size(0), K = packed.size(1);
  check_blocks(NB, N, "packed_gemm");
  check_x(x, K, "packed_gemm", 1);
  const float* b = opt_f32(bias, N, "packed_gemm: bias");
#if QS_AVX512
  const float* wp = packed.data_ptr<float>();
  auto make = [&](int64_t blk) { return F32BlockLoader{wp + blk * K * 32}; };
  return gemm_out(x, N, [&](const float* xf, auto* y) {
    packed_q_run(make, xf, x.size(0), K, N, NB, nullptr, b, y, K * 32 * 4);
  });
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

static qs_bind::Register bind_gemm([](pybind11::module_& m) {
  m.def("dense_gemv", &dense_gemv, py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("packed_gemm", &packed_gemm, py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("packed_pairs_gemm", &packed_pairs_gemm, py::arg("x"), py::arg("w_pairs"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("packed_w8_gemm", &packed_w8_gemm, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("pairs") = true);
  m.def("packed_w4_gemm", &packed_w4_gemm, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("neg_zs"),
        py::arg("group"), py::arg("n"), py::arg("bias") = py::none(), py::arg("pairs") = true);
  m.def("packed_fp4_gemm", &packed_fp4_gemm, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("group"),
        py::arg("n"), py::arg("bias") = py::none(), py::arg("pairs") = true);
});
