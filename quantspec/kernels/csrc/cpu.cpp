// quantspec CPU kernels: GEMMs over fp32 / bf16 / int8 / int4 weights for decode, speculative
// verification and prefill on x86 CPUs with AVX-512, plus paged attention, RMSNorm and rotary.
//
// y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n]); w dequantized on the fly:
//   fp32 / bf16: w as stored;  int8: q[n, k] * scale[n];
//   int4: (q[n, k] - zp[n, g]) * scale[n, g], g = k / group (scale / zp fp32; zp optional).
// x is fp32 or bf16 (converted once to fp32); accumulation in fp32; y in x's dtype.
//
// Two layouts. Row-major [N, K] weights (`dense_gemv`: bf16 heads) are read one weight row per
// tile of up to 4 rows of x, two accumulators per (m, n) alternating over 16-wide chunks and one
// fixed horizontal reduction. Column-blocked weights (`packed_*`, packed once at load) give
// every output one FMA chain over k in one vector lane. Either way every output element is
// computed by the same sequence of float operations whatever M and whichever rows it is tiled
// with, so a row's result is bitwise the same in a 1-row decode step and in a 1 + k-row
// verification step.
//
// Built at run time by quantspec/kernels/cpu.py (torch.utils.cpp_extension, -march=native);
// without AVX-512 the module reports has_avx512() == false and quantspec keeps torch's ops.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <array>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define QS_AVX512 1
#else
#define QS_AVX512 0
#endif
#if QS_AVX512 && defined(__AVX512BF16__)
#define QS_BF16DOT 1
#else
#define QS_BF16DOT 0
#endif
// the int8 greedy-head screen: AVX512-VNNI for its integer dot products, AVX512-BF16 for a bf16
// head's exact chain
#if QS_BF16DOT && defined(__AVX512VNNI__)
#define QS_I8SCREEN 1
#else
#define QS_I8SCREEN 0
#endif

namespace {

bool has_avx512() { return QS_AVX512 != 0; }

#if QS_AVX512

// 16 consecutive fp32 / bf16 values as fp32
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const at::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// ---- weight loaders: 16 consecutive weights of row n, starting at k (k % 16 == 0), as fp32 ----

struct F32Rows {
  const float* w; int64_t K;
  inline __m512 load16(int64_t n, int64_t k) const { return _mm512_loadu_ps(w + n * K + k); }
};

struct BF16Rows {
  const at::BFloat16* w; int64_t K;
  inline __m512 load16(int64_t n, int64_t k) const { return load16f(w + n * K + k); }
};

// One tile: RM rows of x (fp32, stride K) · weight row n → out[RM].
template <int RM, class W>
inline void tile(const W& w, int64_t n, const float* x, int64_t K, float out[RM]) {
  __m512 acc[RM][2];
  for (int i = 0; i < RM; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = w.load16(n, k), w1 = w.load16(n, k + 16);
    for (int i = 0; i < RM; ++i) {
      acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * K + k), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * K + k + 16), acc[i][1]);
    }
  }
  if (k < K) {  // K % 32 == 16
    const __m512 w0 = w.load16(n, k);
    for (int i = 0; i < RM; ++i) acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * K + k), acc[i][0]);
  }
  for (int i = 0; i < RM; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
}

template <class T>
inline void store(T* y, float v) { *y = static_cast<T>(v); }

// rows [m0, m0 + RM) × weight rows [n0, n1), one weight row at a time (several rows streamed
// at once measured 1.4-1.9x slower on Zen 4)
template <int RM, class W, class T>
inline void rows_block(const W& w, const float* x, int64_t K, int64_t N, int64_t m0, int64_t n0,
                       int64_t n1, const float* col_scale, const float* bias, T* y) {
  float out[RM];
  for (int64_t n = n0; n < n1; ++n) {
    tile<RM>(w, n, x + m0 * K, K, out);
    for (int i = 0; i < RM; ++i) {
      float v = out[i];
      if (col_scale) v *= col_scale[n];
      if (bias) v += bias[n];
      store(y + (m0 + i) * N + n, v);
    }
  }
}

template <class W, class T>
void run(const W& w, const float* x, int64_t M, int64_t K, int64_t N, const float* col_scale,
         const float* bias, T* y, int64_t bytes_per_row) {
  // enough weight bytes per task that the thread fork pays off (~64 KiB)
  const int64_t grain = std::max<int64_t>(16, (64 * 1024) / std::max<int64_t>(1, bytes_per_row));
  // weight rows in chunks of ~16 KiB: every tile of x rows reads a chunk while it is in cache, so
  // the weights stream from memory once whatever M
  const int64_t chunk = std::max<int64_t>(1, (16 * 1024) / std::max<int64_t>(1, bytes_per_row));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
      const int64_t c1 = std::min(n1, c0 + chunk);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows_block<4>(w, x, K, N, m, c0, c1, col_scale, bias, y);
      for (; m + 2 <= M; m += 2) rows_block<2>(w, x, K, N, m, c0, c1, col_scale, bias, y);
      for (; m < M; ++m) rows_block<1>(w, x, K, N, m, c0, c1, col_scale, bias, y);
    }
  });
}

#endif  // QS_AVX512

// x as fp32: its own data when it is fp32, else converted into `buf`
const float* x_as_fp32(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  const int64_t n = x.numel();
  buf.resize(n);
  const at::BFloat16* p = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return buf.data();
}

// x [M, K] for a GEMM: contiguous 2-D fp32 / bf16 on CPU, K matching the weight (and a multiple
// of `k_multiple`: 16 for the row-major kernels, any K for the packed ones)
void check_x(const at::Tensor& x, int64_t K, const char* op, int64_t k_multiple = 16) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(K % k_multiple == 0, op, ": K must be a multiple of ", k_multiple, ", got ", K);
}

// NB column blocks of 32 hold N outputs (the last one padded)
void check_blocks(int64_t NB, int64_t N, const char* op) {
  TORCH_CHECK(N > (NB - 1) * 32 && N <= NB * 32, op, ": N=", N, " does not fit ", NB, " blocks of 32");
}

const float* opt_f32(const c10::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, what,
              " must be a contiguous float32 tensor of ", n, " values");
  return t->data_ptr<float>();
}

// the quantized GEMMs' pair path (bf16 x, even K, AVX512-BF16); on unless a bench turns it off
// (`set_pair_path`) to compare
bool g_pair_path = true;
bool use_pair_path(const at::Tensor& x, int64_t K) {
  return QS_BF16DOT && g_pair_path && x.scalar_type() == at::kBFloat16 && K % 2 == 0;
}

#if QS_AVX512
// y [M, N] in x's dtype from x as fp32: run(xf, y_ptr) is called with a float* or a BFloat16*
template <class Run>
at::Tensor gemm_out(const at::Tensor& x, int64_t N, const Run& run) {
  std::vector<float> buf;
  const float* xf = x_as_fp32(x, buf);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  if (x.scalar_type() == at::kFloat)
    run(xf, y.data_ptr<float>());
  else
    run(xf, y.data_ptr<at::BFloat16>());
  return y;
}
#endif

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
// whichever tile the row is in, so decode and verification rows agree bitwise. On the default
// model's layers (2 cores): fp32 at 8 rows 2.5-3.0x torch, prefill 1.5-1.7x torch's sgemm
// (bench/kernels_cpu.py).

namespace {

#if QS_AVX512

// the first `valid` lanes of 16 (all when valid >= 16, none when valid <= 0)
inline __mmask16 lane_mask(int64_t valid) {
  return valid >= 16 ? __mmask16(0xFFFF) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}
// 32 outputs of a column block (masked to the valid ones); bf16 rounded to nearest even in
// vector registers (what c10::BFloat16's conversion does)
inline void store32(float* row, __m512 v0, __m512 v1, __mmask16 k0, __mmask16 k1) {
  _mm512_mask_storeu_ps(row, k0, v0);
  _mm512_mask_storeu_ps(row + 16, k1, v1);
}
// the lanes of v rounded to bf16 (nearest even; a NaN becomes 0x7FC0, as c10::BFloat16 makes it:
// rounding its bits could carry a payload of all ones into the sign and give -0), as fp32
inline __m512 round_bf16_ps(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(int(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}
// ... as the 16 bf16 codes themselves
inline __m256i to_bf16_rne(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16));
}
// 16 values stored as fp32, or rounded to bf16 (nearest even)
inline void store16_rne(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16_rne(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_rne(v));
}
inline void store32(at::BFloat16* row, __m512 v0, __m512 v1, __mmask16 k0, __mmask16 k1) {
  _mm256_mask_storeu_epi16(row, k0, to_bf16_rne(v0));
  _mm256_mask_storeu_epi16(row + 16, k1, to_bf16_rne(v1));
}

#endif  // QS_AVX512

}  // namespace

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

// int4 block b: the k-step loader keeps the current group's scale / neg_zs vectors
struct I4BlockLoader {
  const uint8_t* q; const float* s; const float* z; int64_t K, G, group, b;
  mutable int64_t g = -1, next = 0;  // the current group; the k where the next one starts
  mutable __m512 s0, s1, z0, z1;
  inline void operator()(int64_t k, __m512& w0, __m512& w1) const {  // k = 0, 1, ... in order
    if (k == next) {
      ++g;
      next += group;
      const float* sp = s + (b * G + g) * 32;
      const float* zp = z + (b * G + g) * 32;
      s0 = _mm512_loadu_ps(sp); s1 = _mm512_loadu_ps(sp + 16);
      z0 = _mm512_loadu_ps(zp); z1 = _mm512_loadu_ps(zp + 16);
    }
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (b * K + k) * 16)));
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));  // code + 8
    const __m512i hi = _mm512_srli_epi32(v, 4);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s0, z0);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s1, z1);
  }
};

#if QS_BF16DOT
// int4 block b for the pair path: k-pair p → its codes as bf16 pairs (a table lookup of the nibble:
// q = nibble − 8, exact in bf16), plus the group's scale and zero vectors; `xsum` [M, G] holds
// each row's group sums of x
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
    const __m512i table = _mm512_set_epi16(  // bf16(n - 8) at word n (n < 16), zero above
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
    const float* zp = z + (b * G + g) * 32;
    const __m512 eight = _mm512_set1_ps(8.f);
    s0 = _mm512_loadu_ps(sp); s1 = _mm512_loadu_ps(sp + 16);
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
    // from memory; 8 + 2 + 1 tiles re-read the chunk from L2 for the last 3 rows at a third of
    // the FMA density (11 rows on a 226 MB weight, 2 threads: 0.74-0.89x the time over runs)
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
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(2) == 32,
              "packed_w8_gemm: q must be contiguous int8 [NB, K, 32]");
  const int64_t NB = q.size(0), K = q.size(1);
  check_blocks(NB, N, "packed_w8_gemm");
  check_x(x, K, "packed_w8_gemm", 1);
  const float* s = opt_f32(scale, N, "packed_w8_gemm: scale");
  const float* b = opt_f32(bias, N, "packed_w8_gemm: bias");
#if QS_AVX512
  const int8_t* qp = q.data_ptr<int8_t>();
  if (use_pair_path(x, K)) {
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

// y = x @ dequant(q)^T (+ bias); q packed [NB, K, 16] uint8 (pack_w4), scale / offset [NB, G, 32]
// fp32 with w = (code + 8) * scale + offset, groups of `group` consecutive k (K % group == 0)
at::Tensor packed_w4_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const at::Tensor& neg_zs, int64_t group, int64_t N,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kByte && q.size(2) == 16,
              "packed_w4_gemm: q must be contiguous uint8 [NB, K, 16]");
  const int64_t NB = q.size(0), K = q.size(1);
  check_blocks(NB, N, "packed_w4_gemm");
  TORCH_CHECK(group > 0 && K % group == 0, "packed_w4_gemm: group ", group, " must divide K=", K);
  const int64_t G = K / group;
  check_x(x, K, "packed_w4_gemm", 1);
  TORCH_CHECK(scale.sizes() == neg_zs.sizes() && scale.dim() == 3 && scale.size(0) == NB
              && scale.size(1) == G && scale.size(2) == 32, "packed_w4_gemm: scale / neg_zs must be [NB, G, 32]");
  const float* s = opt_f32(scale, NB * G * 32, "packed_w4_gemm: scale");
  const float* z = opt_f32(neg_zs, NB * G * 32, "packed_w4_gemm: neg_zs");
  const float* b = opt_f32(bias, N, "packed_w4_gemm: bias");
#if QS_AVX512
  const uint8_t* qp = q.data_ptr<uint8_t>();
#if QS_BF16DOT
  if (use_pair_path(x, K) && group % 2 == 0) {
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    std::vector<float> xsum(M * G);  // each row's group sums: 16 lanes over the group, then reduced
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    for (int64_t m = 0; m < M; ++m)
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
    auto make = [&](int64_t blk) { return I4PairLoader{qp, s, z, xsum.data(), K, G, group, blk}; };
    if (M && N) packed_q_run<kInt4Pairs>(make, xp, M, K, N, NB, nullptr, b, y.data_ptr<at::BFloat16>(), K * 16);
    return y;
  }
#endif
  auto make = [&](int64_t blk) { return I4BlockLoader{qp, s, z, K, G, group, blk}; };
  return gemm_out(x, N, [&](const float* xf, auto* y) {
    packed_q_run(make, xf, x.size(0), K, N, NB, nullptr, b, y, K * 16);
  });
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
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

inline __m512 exp512(__m512 x) {  // Cephes expf on [-87.3, 0], ~1 ulp
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

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
// The same for bf16 q / caches on a CPU with AVX512-BF16 (the pair path, honouring
// set_pair_path): the products of the scores and of the weighted values go through vdpbf16ps,
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
// instructions: a layer's attention of a 1024-token prompt 7.0 vs 12.7 ms, 130 tokens 0.17 vs
// 0.22 ms (`bench/kernels_cpu.py`'s attention table, 2 threads).
constexpr int64_t kPrefillRows = 16;     // query rows per work item (blocks of one KV head)
constexpr int64_t kPrefillMinRows = 16;  // shorter fresh prompts take the per-row kernel
bool g_prefill_blocks = true;  // off: fresh prompts take the per-row kernel too (benches compare)

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
// after the bf16 rounding of the weights and the output the two rarely differ (1 element in
// ~60,000 on random data). A layer's attention of a 1024-token prompt 5.5 vs 7.4 ms per-row,
// 2000 tokens 21.9 vs 29.7 (2 threads).
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
                          at::Tensor& out) {
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
  const bool pairs = std::is_same<T, at::BFloat16>::value && QS_BF16DOT && g_pair_path;
  // fresh prompts of kPrefillMinRows or more, fp32 or bf16 on the pair path: blocks of rows
  // (`prefill_block`, `prefill_block_pairs`)
  std::vector<char> blocked(B, 0);
  if (std::is_same<T, float>::value || pairs) {
    std::vector<std::array<int64_t, 3>> work;  // (sequence, KV head, first row of the block)
    for (int64_t b = 0; b < B && g_prefill_blocks; ++b) {
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
                           const std::vector<int64_t>& seq_lens, int64_t block_size, double scale) {
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
    if (hd == 64) paged_attention_impl<4, float>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, out);
    else paged_attention_impl<8, float>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16 only");
    if (hd == 64) paged_attention_impl<4, at::BFloat16>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, out);
    else paged_attention_impl<8, at::BFloat16>(q, k_cache, v_cache, block_tables, q_lens, seq_lens, block_size, scale, out);
  }
  return out;
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}


// ---- small per-row ops of a decode step (one call instead of 5-8 torch ops each) -------------
//
// Each reproduces the torch expression the model runs, rounding where torch rounds (bf16:
// after each op), so results differ from torch's only by float evaluation order.

namespace {

constexpr int64_t kRowGrain = 4;  // rows per thread below which a per-row op stays on one thread

inline float round_as(float v, bool bf16) { return bf16 ? static_cast<float>(static_cast<at::BFloat16>(v)) : v; }

template <class T>
inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a float32 or bfloat16 CPU tensor");
}

}  // namespace

// weight * rms_norm(x.float(), eps).to(x.dtype)  (HF's LlamaRMSNorm); x [M, D] contiguous
namespace {
// rms_norm's y = w * round(x * inv) over the row's first multiple of 16 elements, 16 lanes at a
// time (the same two products per element as its scalar loop) → how many it did (0: other
// dtypes, no AVX-512)
template <class T>
inline int64_t scale_row16(const T*, const T*, T*, int64_t, float, bool) { return 0; }
#if QS_AVX512
template <class T>
inline int64_t scale_row16_impl(const T* r, const T* w, T* y, int64_t D, float inv, bool bf16) {
  const __m512 vinv = _mm512_set1_ps(inv);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m512 v = _mm512_mul_ps(load16f(r + d), vinv);
    if (bf16) v = round_bf16_ps(v);
    store16_rne(y + d, _mm512_mul_ps(load16f(w + d), v));
  }
  return d;
}
inline int64_t scale_row16(const float* r, const float* w, float* y, int64_t D, float inv, bool bf16) {
  return scale_row16_impl(r, w, y, D, inv, bf16);
}
inline int64_t scale_row16(const at::BFloat16* r, const at::BFloat16* w, at::BFloat16* y, int64_t D, float inv,
                           bool bf16) {
  return scale_row16_impl(r, w, y, D, inv, bf16);
}
#endif
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.scalar_type() == x.scalar_type()
              && weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: x [M, D], weight [D] of x's dtype");
  const int64_t M = x.size(0), D = x.size(1);
  at::Tensor y = at::empty_like(x);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const scalar_t* r = xp + m * D;
      float ss = 0.f;
      int64_t d0 = 0;
#if QS_AVX512
      if constexpr (std::is_same_v<scalar_t, float>) {  // fp32: 16 partial sums, then one
        __m512 acc = _mm512_setzero_ps();                // (bf16 keeps torch's rounding: scalar)
        for (; d0 + 16 <= D; d0 += 16) {
          const __m512 v = _mm512_loadu_ps(r + d0);
          acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        ss = _mm512_reduce_add_ps(acc);
      }
#endif
      for (int64_t d = d0; d < D; ++d) { const float v = ld(r, d); ss += v * v; }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t d = scale_row16(r, wp, yp + m * D, D, inv, bf16); d < D; ++d)
        yp[m * D + d] = static_cast<scalar_t>(ld(wp, d) * round_as(ld(r, d) * inv, bf16));
    }
    });
  });
  return y;
}

// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); x [T, nh, hd] (last dim
// contiguous, any other strides), cos / sin [T, hd] of x's dtype → contiguous [T, nh, hd]
namespace {
// one (row, head) of `rope` 16 lanes at a time (head_dim / 2 a multiple of 16), the same operations
// per element as its scalar loop; false (not done) for other dtypes or without AVX-512
template <class T>
inline bool rope_row16(const T*, const T*, const T*, T*, int64_t, bool) { return false; }
#if QS_AVX512
template <class T>
inline bool rope_row16_impl(const T* r, const T* c, const T* sn, T* o, int64_t hd, bool bf16) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; d += 16) {
    const __m512 rot = d < half ? _mm512_xor_ps(load16f(r + d + half), _mm512_set1_ps(-0.0f))  // −x
                                : load16f(r + d - half);
    __m512 a = _mm512_mul_ps(load16f(r + d), load16f(c + d)), b = _mm512_mul_ps(rot, load16f(sn + d));
    if (bf16) { a = round_bf16_ps(a); b = round_bf16_ps(b); }
    store16_rne(o + d, _mm512_add_ps(a, b));
  }
  return true;
}
inline bool rope_row16(const float* r, const float* c, const float* sn, float* o, int64_t hd, bool bf16) {
  return rope_row16_impl(r, c, sn, o, hd, bf16);
}
inline bool rope_row16(const at::BFloat16* r, const at::BFloat16* c, const at::BFloat16* sn, at::BFloat16* o,
                       int64_t hd, bool bf16) {
  return rope_row16_impl(r, c, sn, o, hd, bf16);
}
#endif
}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rope");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous()
              && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type()
              && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes()
              && x.size(2) % 2 == 0, "rope: x [T, heads, hd], cos / sin [T, hd] of x's dtype");
  const int64_t T = x.size(0), nh = x.size(1), hd = x.size(2), half = hd / 2;
  at::Tensor y = at::empty({T, nh, hd}, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < nh; ++h) {
        const scalar_t* r = xp + t * x.stride(0) + h * x.stride(1);
        scalar_t* o = yp + (t * nh + h) * hd;
        if (half % 16 == 0 && rope_row16(r, cp + t * hd, sp + t * hd, o, hd, bf16)) continue;
        for (int64_t d = 0; d < hd; ++d) {
          const float rot = d < half ? -ld(r, d + half) : ld(r, d - half);
          const float a = round_as(ld(r, d) * ld(cp, t * hd + d), bf16);
          const float b = round_as(rot * ld(sp, t * hd + d), bf16);
          o[d] = static_cast<scalar_t>(a + b);
        }
      }
    });
  });
  return y;
}

// silu(gate) * up for x = [gate | up] [M, 2 I] → [M, I] (the fused gate/up projection's output),
// rounding where torch rounds (bf16: after the silu and after the product); silu(g) = g *
// sigmoid(g) with sigmoid from exp(-|g|) (no overflow either side)
namespace {

template <class T>
void silu_mul_rows(const T* xp, T* yp, int64_t M, int64_t I) {
  constexpr bool bf16 = std::is_same_v<T, at::BFloat16>;
  // rows are independent: split them over the threads from a few rows on (a verification
  // step's 11 rows, a prefill); each element's arithmetic is the same whatever the split
  at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* g = xp + m * 2 * I;
    const T* u = g + I;
    T* o = yp + m * I;
    int64_t i = 0;
#if QS_AVX512
    for (; i + 16 <= I; i += 16) {
      const __m512 gv = load16f(g + i);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));  // exp(-|g|)
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
      const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
      __m512 sig = _mm512_mask_mul_ps(inv, neg, e, inv);  // g < 0: e / (1 + e)
      // below exp512's range (it clamps at -87.3) the sigmoid is 0 to fp32 precision
      sig = _mm512_mask_mov_ps(sig, _mm512_cmp_ps_mask(gv, _mm512_set1_ps(-87.3f), _CMP_LT_OQ),
                               _mm512_setzero_ps());
      // the same two IEEE products as below, kept in registers (bf16: the first rounded as torch does)
      __m512 a = _mm512_mul_ps(gv, sig);
      if constexpr (bf16) a = round_bf16_ps(a);
      store16_rne(o + i, _mm512_mul_ps(a, load16f(u + i)));
    }
#endif
    for (; i < I; ++i) {
      const float gv = ld(g, i), e = std::exp(-std::fabs(gv)), inv = 1.f / (1.f + e);
      const float sig = gv < 0 ? e * inv : inv;
      o[i] = static_cast<T>(round_as(gv * sig, bf16) * ld(u, i));
    }
  }
  });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x, "silu_mul");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_mul: x [M, 2 I] contiguous");
  const int64_t M = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({M, I}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows(x.data_ptr<float>(), y.data_ptr<float>(), M, I);
  else
    silu_mul_rows(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), M, I);
  return y;
}

namespace {

#if QS_AVX512
// output c of `packed_gemm` for one fp32 row x: its FMA chain over k (column c of the packed
// head [NB, K, 32])
inline float packed_chain(const float* wp, const float* x, int64_t K, int64_t c) {
  const float* col = wp + (c / 32) * K * 32 + (c % 32);
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc = std::fma(x[k], col[k * 32], acc);
  return acc;
}

// the candidates' exact pass of `screened_argmax*`: approx [M, N] → ids [M] (−1: non-finite)
void pick_exact(const float* xp, int64_t M, int64_t K, const float* ap, int64_t N, const float* wp,
                const float* rn, double rel, double abs_err, int64_t* out) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * K;
      const float* a = ap + m * N;
      double xn = 0;
      for (int64_t k = 0; k < K; ++k) xn += static_cast<double>(xr[k]) * xr[k];
      xn = std::sqrt(xn);
      if (!std::isfinite(xn)) continue;
      const double scale = rel * xn;
      // lower: the best logit is at least this; then every n whose upper bound reaches it is a
      // candidate, computed exactly in ascending n (8 outputs a vector, in double like the bound)
      const __m512d vscale = _mm512_set1_pd(scale), vabs = _mm512_set1_pd(abs_err);
      __m512d vlow = _mm512_set1_pd(-INFINITY), nan_probe = _mm512_setzero_pd();
      for (int64_t n = 0; n < N; n += 8) {
        const __mmask8 k = static_cast<__mmask8>(lane_mask(N - n));  // the first min(8, N - n) lanes
        const __m512d av = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(k, a + n));
        const __m512d rv = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(k, rn + n));
        nan_probe = _mm512_add_pd(nan_probe, _mm512_mul_pd(av, _mm512_setzero_pd()));  // inf / nan → nan
        vlow = _mm512_mask_max_pd(vlow, k, vlow, _mm512_sub_pd(_mm512_fnmadd_pd(vscale, rv, av), vabs));
      }
      if (std::isnan(_mm512_reduce_add_pd(nan_probe))) continue;
      const __m512d lower = _mm512_set1_pd(_mm512_reduce_max_pd(vlow));
      float best = 0.f;
      int64_t best_n = -1;
      for (int64_t n = 0; n < N; n += 8) {
        const __mmask8 k = static_cast<__mmask8>(lane_mask(N - n));  // the first min(8, N - n) lanes
        const __m512d av = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(k, a + n));
        const __m512d rv = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(k, rn + n));
        const __m512d hi = _mm512_add_pd(_mm512_fmadd_pd(vscale, rv, av), vabs);
        unsigned cand = _mm512_mask_cmp_pd_mask(k, hi, lower, _CMP_NLT_UQ);  // may be the maximum
        while (cand) {
          const int64_t c = n + __builtin_ctz(cand);
          cand &= cand - 1;
          const float acc = packed_chain(wp, xr, K, c);
          if (!std::isfinite(acc)) { best_n = -2; break; }
          if (best_n < 0 || acc > best) { best = acc; best_n = c; }
        }
        if (best_n == -2) break;
      }
      if (best_n == -2) best_n = -1;
      out[m] = best_n;
    }
  });
}
#endif

// The pair screen's tiles of kPrefetchRows rows or more (7-11 drafts + 1: a greedy verification
// step) do so many dot products per line of the bf16 copy that the hardware prefetcher falls
// behind its 56 MB stream (SmolLM2's head), so they prefetch the block they compute next into L2
// while computing one. Default model, 2 threads, the same calls back to back with it on and off:
// 11 rows 3.5 -> 2.5 ms, 9 rows 2.9 -> 2.1, 8 rows 2.5 -> 2.0 (medians, 40 pairs); at 2-6 rows it
// cost up to 10%, so smaller tiles never prefetch, nor do calls of more than one tile per block.
// In the engine (`bench/spec_cost.py --prefetch-ab`, paired steps) a 10-draft step of the fp32 model
// gained 0.5-1.3 ms. The same prefetch in the GEMMs' tiles gained up to 4 ms a 10-draft step in
// some runs and lost up to 1.7 ms an 8-draft step in others (whether memory or the FMAs bind moves
// with the shared host's load), so they do not prefetch. Results are unchanged (prefetches only move
// lines); on unless a bench turns it off (`set_prefetch`) to compare.
constexpr int kPrefetchRows = 8;
bool g_prefetch = true;

#if QS_AVX512 && defined(__AVX512BF16__)
constexpr bool kHasBF16Dot = true;

// RM rows of bf16 pairs x [M, KP] (int32 = x[2p] | x[2p+1] << 16) times block b of pair-packed
// weights [NB, KP, 32] → approx rows, one vdpbf16ps chain per output
// (`next`: the block computed after this one, prefetched into L2 when `prefetch` and RM >= kPrefetchRows)
template <int RM>
inline void dot_pairs_tile(const int32_t* xp, int64_t KP, const int32_t* blk, const int32_t* next, bool prefetch,
                           int64_t N, int64_t b, int64_t m0, float* y) {
  __m512 acc[RM][2];
  for (int i = 0; i < RM; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const bool touch = RM >= kPrefetchRows && prefetch;
  for (int64_t p = 0; p < KP; ++p) {
    if (touch) {
      __builtin_prefetch(next + p * 32, 0, 2);  // prefetcht1: into L2
      __builtin_prefetch(next + p * 32 + 16, 0, 2);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(blk + p * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(blk + p * 32 + 16);
    for (int i = 0; i < RM; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[(m0 + i) * KP + p]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
    }
  }
  const int64_t n0 = b * 32;
  const __mmask16 k0 = lane_mask(N - n0), k1 = lane_mask(N - n0 - 16);
  for (int i = 0; i < RM; ++i) {
    _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, k0, acc[i][0]);
    _mm512_mask_storeu_ps(y + (m0 + i) * N + n0 + 16, k1, acc[i][1]);
  }
}
#else
constexpr bool kHasBF16Dot = false;
#endif

}  // namespace

bool has_bf16_dot() { return kHasBF16Dot; }
bool has_int8_screen() { return QS_I8SCREEN != 0; }

namespace {

// the arguments both screens share: fp32 x [M, K], the packed fp32 head [NB, K, 32] of N outputs,
// its rows' norms [N]
void check_screen(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& row_norm, int64_t N,
                  const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat
              && packed.size(2) == 32 && packed.size(1) == x.size(1), op, ": packed must be float32 [NB, K, 32]");
  check_blocks(packed.size(0), N, op);
  TORCH_CHECK(row_norm.scalar_type() == at::kFloat && row_norm.is_contiguous() && row_norm.numel() == N,
              op, ": row_norm must be float32 [N]");
}

}  // namespace

// ---- greedy picks from the fp32 head without computing every fp32 logit ---------------------
//
// argmax_n (x · w_n) for each row x of a packed fp32 head, exactly as `packed_gemm`'s logits
// would give it (the same FMA chain per output; the lowest index among equal maxima): every
// logit is first approximated from a bf16 copy of the head (half the bytes to stream), and only
// the outputs whose approximation could still be the maximum are computed exactly. Proven
// bound: |exact_n − approx_n| ≤ rel · ‖x‖₂ · ‖w_n‖₂ + abs_err, the caller passing rel for the
// roundings of the path (bf16 w: 2^-8; bf16 x too for the pair-dot path; both accumulations)
// and row norms rounded up. A row with a non-finite value gets −1 (the caller computes its logits).
//
// `screened_argmax`: the approximation from a row-major bf16 copy [N, K] (x stays fp32);
// `screened_argmax_pairs`: from a pair-packed copy [NB, K/2, 32] (int32 = two bf16 along k) with
// x rounded to bf16, by AVX512-BF16's dot product (twice the FMA rate: for verification rows).
at::Tensor screened_argmax(const at::Tensor& x, const at::Tensor& w_bf16, const at::Tensor& packed,
                           const at::Tensor& row_norm, int64_t N, double rel) {
  check_x(x, w_bf16.size(1), "screened_argmax");
  TORCH_CHECK(w_bf16.dim() == 2 && w_bf16.is_contiguous() && w_bf16.scalar_type() == at::kBFloat16
              && w_bf16.size(0) == N, "screened_argmax: w_bf16 must be contiguous bf16 [N, K]");
  check_screen(x, packed, row_norm, N, "screened_argmax");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor ids = at::full({M}, -1, x.options().dtype(at::kLong));
#if QS_AVX512
  at::Tensor approx = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  run(BF16Rows{w_bf16.data_ptr<at::BFloat16>(), K}, xp, M, K, N, nullptr, nullptr, approx.data_ptr<float>(), K * 2);
  pick_exact(xp, M, K, approx.data_ptr<float>(), N, packed.data_ptr<float>(), row_norm.data_ptr<float>(), rel, 0.0,
             ids.data_ptr<int64_t>());
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
  return ids;
}

at::Tensor screened_argmax_pairs(const at::Tensor& x, const at::Tensor& w_pairs, const at::Tensor& packed,
                                 const at::Tensor& row_norm, int64_t N, double rel, double abs_err) {
  TORCH_CHECK(kHasBF16Dot, "screened_argmax_pairs: built without AVX512-BF16");
  check_x(x, 2 * w_pairs.size(1), "screened_argmax_pairs", 2);
  TORCH_CHECK(w_pairs.dim() == 3 && w_pairs.is_contiguous() && w_pairs.scalar_type() == at::kInt
              && w_pairs.size(2) == 32 && w_pairs.size(0) == packed.size(0),
              "screened_argmax_pairs: w_pairs must be contiguous int32 [NB, K/2, 32]");
  check_screen(x, packed, row_norm, N, "screened_argmax_pairs");
  const int64_t M = x.size(0), K = x.size(1), KP = K / 2, NB = packed.size(0);
  at::Tensor ids = at::full({M}, -1, x.options().dtype(at::kLong));
#if QS_AVX512 && defined(__AVX512BF16__)
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();  // round to nearest even
  const int32_t* xq = reinterpret_cast<const int32_t*>(xb.data_ptr<at::BFloat16>());
  at::Tensor approx = at::empty({M, N}, x.options());
  float* ap = approx.data_ptr<float>();
  const int32_t* wq = w_pairs.data_ptr<int32_t>();
  const bool prefetch = g_prefetch && M <= 12;  // one tile per block (see kPrefetchRows)
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int32_t* blk = wq + b * KP * 32;
      const int32_t* next = wq + std::min(b + 1, b1 - 1) * KP * 32;  // within this thread's range
      for (int64_t m = 0; m < M;) {
        const int64_t rows = std::min<int64_t>(12, M - m);  // 24 accumulators + 2 weights + x
        switch (rows) {
#define QS_DOT(R) case R: dot_pairs_tile<R>(xq, KP, blk, next, prefetch, N, b, m, ap); break;
          QS_DOT(1) QS_DOT(2) QS_DOT(3) QS_DOT(4) QS_DOT(5) QS_DOT(6) QS_DOT(7) QS_DOT(8) QS_DOT(9) QS_DOT(10)
          QS_DOT(11) QS_DOT(12)
#undef QS_DOT
          default: break;
        }
        m += rows;
      }
    }
  });
  pick_exact(x.data_ptr<float>(), M, K, ap, N, packed.data_ptr<float>(), row_norm.data_ptr<float>(), rel, abs_err,
             ids.data_ptr<int64_t>());
#endif
  return ids;
}

// `screened_argmax_i8`: the approximation from an int8 copy of the head (a quarter of an fp32
// head's bytes, half of a bf16 one's): codes q [NB, K/2, 64] (`pack_w8_pairs`: per block of 32
// outputs and k-pair p, output j's codes of k = 2p, 2p + 1 at bytes 2j, 2j + 1) with one fp32
// scale s_n per output, against each row x quantized to integers: xs = σ · xq, xq = round(x / σ),
// σ = max|x| / X (fp32), X = min(16383, ⌊(2^31 − 1) / (127 K)⌋) so that no partial sum leaves
// int32. D_n = Σ_k xq_k q_nk is exact (AVX512-VNNI vpdpwssd: int16 pairs × sign-extended int8
// pairs into int32, no conversion but one vpmovsxbw per 16 outputs' k-pair) and
// approx_n = fl(fl(fl(D_n) · σ) · s_n), three roundings. The bound, per output from two
// precomputed vectors (rounded up by the caller):
//
//   |exact_n − approx_n| ≤ ‖x‖·u_n + (‖x − xs‖ + rel·‖xs‖)·t_n + abs_err,
//   u_n = ‖w_n − s_n q_n‖ + γ_K ‖w_n‖,   t_n = ‖s_n q_n‖,   rel ≥ (1 + 2^-24)^3 − 1
//
// (x·w_n − xs·s_n q_n = x·(w_n − s_n q_n) + (x − xs)·s_n q_n; the exact pass's fp32 chain errs by
// γ_K Σ|x_k w_nk| ≤ γ_K ‖x‖ ‖w_n‖, γ_K ≥ K 2^-24 / (1 − K 2^-24); the approximation's three
// roundings by rel · |σ s_n D_n| ≤ rel · ‖xs‖ t_n; abs_err covers subnormals: AVX512-BF16
// flushing in a bf16 head's chain, an fp32 product underflowing). With X = 16383 the integers
// hold x to 2^-14 of its largest element where bf16 holds 2^-8 of each (the bf16-x copy this
// replaced needed an int8 → bf16 conversion per weight: ~10 instructions per 64 codes, the
// cost of its 8-11-row calls). Each tile turns its approximations into
// hi_n = approx_n + bound_n and lo_n = approx_n − bound_n as it finishes them (the bound's
// products and sums rounded up, hi rounded up, lo down: true bounds of the exact value) and keeps
// only hi and the row's largest lo. The exact pass is the head's own kernel chain for each
// candidate: fp32 x and a packed fp32 head [NB, K, 32] → `packed_gemm`'s FMA chain; bf16 x and
// a pair-packed bf16 head [NB, K/2, 32] → `packed_pairs_gemm`'s vdpbf16ps chain, its fp32 sum
// rounded to bf16 as that kernel stores it. Rounding to bf16 is monotone, so with
// lower = max_n lo_n an output can only reach the largest bf16 logit when
// bf16(hi_n) ≥ bf16(lower): those are the candidates, compared on their rounded values with the
// lowest index among equals (torch.argmax over the bf16 logits).
namespace {
#if QS_I8SCREEN
// per row of a tile: ‖x‖ and the coefficient of t_n (bound above), broadcast
struct ScreenRow { __m512 c1, c2; };

// int32 lanes as GCC's own vector type: accumulators kept as __m512i (64-bit lanes to GCC) and
// converted to int32 lanes at every vpdpwssd were moved through the stack on every k-pair of the
// 11-row tile (GCC 12: a store and a reload per accumulator and step, 1.5-2x slower)
typedef int v16si_t __attribute__((vector_size(64)));
inline v16si_t dpwssd(v16si_t acc, __m512i a, __m512i b) {
#if defined(__clang__)
  return (v16si_t)_mm512_dpwssd_epi32((__m512i)acc, a, b);
#else
  return __builtin_ia32_vpdpwssd_v16si(acc, (v16si_t)a, (v16si_t)b);
#endif
}

// W blocks at a time for few rows (2 W independent accumulator chains per row: vpdpwssd's
// latency), one for more; approx = fl(fl(fl(D) · σ_i) · s_n) stored into hi
template <int RM, int W>
inline void i8_approx_tile(const int8_t* q, int64_t KP, const int32_t* xq, const float* sigma, const float* scale,
                           float* hi, int64_t N, int64_t b, int64_t m0) {
  v16si_t a0[W][RM], a1[W][RM];
  for (int j = 0; j < W; ++j)
    for (int i = 0; i < RM; ++i) a0[j][i] = a1[j][i] = (v16si_t)_mm512_setzero_si512();
  const int32_t* xr = xq + m0 * KP;
  for (int64_t p = 0; p < KP; ++p) {
    __m512i w0[W], w1[W];
    for (int j = 0; j < W; ++j) {
      const __m512i v = _mm512_loadu_si512(q + ((b + j) * KP + p) * 64);
      w0[j] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v));  // outputs 0-15: (k = 2p, 2p + 1) pairs
      w1[j] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1));  // outputs 16-31
    }
    for (int i = 0; i < RM; ++i) {
      const __m512i xb = _mm512_set1_epi32(xr[i * KP + p]);
      for (int j = 0; j < W; ++j) {
        a0[j][i] = dpwssd(a0[j][i], w0[j], xb);
        a1[j][i] = dpwssd(a1[j][i], w1[j], xb);
      }
    }
  }
  for (int j = 0; j < W; ++j) {
    const int64_t n0 = (b + j) * 32;
    const __mmask16 k0 = lane_mask(N - n0), k1 = lane_mask(N - n0 - 16);
    const __m512 s0 = _mm512_maskz_loadu_ps(k0, scale + n0), s1 = _mm512_maskz_loadu_ps(k1, scale + n0 + 16);
    for (int i = 0; i < RM; ++i) {
      const __m512 sg = _mm512_set1_ps(sigma[m0 + i]);
      const __m512 v0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)a0[j][i]), sg), s0);
      const __m512 v1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)a1[j][i]), sg), s1);
      store32(hi + (m0 + i) * N + n0, v0, v1, k0, k1);
    }
  }
}

// rows [m0, m0 + RM) over blocks [b0, b1), kept out of line: inlined into the screen's loop, GCC
// ran out of registers and kept the accumulators of the larger tiles in memory (2-3x slower at
// 8-11 rows)
template <int RM>
__attribute__((noinline)) void i8_approx_rows(const int8_t* q, int64_t KP, const int32_t* xq, const float* sigma,
                                              const float* scale, float* hi, int64_t N, int64_t b0, int64_t b1,
                                              int64_t m0) {
  constexpr int W = RM <= 2 ? 4 : RM <= 4 ? 2 : 1;
  int64_t b = b0;
  for (; b + W <= b1; b += W) i8_approx_tile<RM, W>(q, KP, xq, sigma, scale, hi, N, b, m0);
  for (; b < b1; ++b) i8_approx_tile<RM, 1>(q, KP, xq, sigma, scale, hi, N, b, m0);
}

// rows [m0, m0 + RM) over blocks [b0, b1): i8_approx_rows writes approx_n into hi, then those
// outputs, still in cache, become hi_n = approx_n + bound_n (rounded up) and fold
// lo_n = approx_n − bound_n (rounded down) into the row's lo_max; `probe` turns NaN where an
// approximation is not finite
template <int RM>
inline void i8_screen_rows(const int8_t* q, int64_t KP, const int32_t* xq, const float* sigma, int64_t b0, int64_t b1,
                           const float* scale, const float* u, const float* t, __m512 abs_err,
                           const ScreenRow* rows, int64_t N, float* hi, int64_t m0, __m512* lo_max, __m512* probe) {
  constexpr int up = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC, down = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
  i8_approx_rows<RM>(q, KP, xq, sigma, scale, hi, N, b0, b1, m0);
  for (int64_t n = b0 * 32; n < std::min(N, b1 * 32); n += 16) {
    const __mmask16 k = lane_mask(N - n);
    const __m512 uv = _mm512_maskz_loadu_ps(k, u + n), tv = _mm512_maskz_loadu_ps(k, t + n);
    for (int i = 0; i < RM; ++i) {
      float* h = hi + (m0 + i) * N + n;
      const __m512 a = _mm512_maskz_loadu_ps(k, h);
      const __m512 bound = _mm512_fmadd_round_ps(rows[m0 + i].c1, uv,
                                                 _mm512_fmadd_round_ps(rows[m0 + i].c2, tv, abs_err, up), up);
      _mm512_mask_storeu_ps(h, k, _mm512_add_round_ps(a, bound, up));
      lo_max[m0 + i] = _mm512_mask_max_ps(lo_max[m0 + i], k, lo_max[m0 + i], _mm512_sub_round_ps(a, bound, down));
      probe[m0 + i] = _mm512_add_ps(probe[m0 + i], _mm512_maskz_mul_ps(k, a, _mm512_setzero_ps()));  // inf / nan → nan
    }
  }
}
#endif
}  // namespace

at::Tensor screened_argmax_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                              const at::Tensor& u, const at::Tensor& t, const at::Tensor& exact, int64_t N,
                              double rel, double abs_err) {
  TORCH_CHECK(QS_I8SCREEN, "screened_argmax_i8: built without AVX512-BF16 and AVX512-VNNI");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(2) == 64,
              "screened_argmax_i8: q must be contiguous int8 [NB, K/2, 64] (pack_w8_pairs)");
  const int64_t NB = q.size(0), KP = q.size(1), K = 2 * KP;
  check_blocks(NB, N, "screened_argmax_i8");
  check_x(x, K, "screened_argmax_i8", 2);
  TORCH_CHECK(K > 0 && K <= (int64_t(1) << 20), "screened_argmax_i8: K must be in 2..2^20");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (bf16) {
    TORCH_CHECK(exact.dim() == 3 && exact.is_contiguous() && exact.scalar_type() == at::kInt && exact.size(0) == NB
                && exact.size(1) == KP && exact.size(2) == 32,
                "screened_argmax_i8: for bf16 x, exact must be the pair-packed bf16 head, int32 [NB, K/2, 32]");
  } else {
    TORCH_CHECK(exact.dim() == 3 && exact.is_contiguous() && exact.scalar_type() == at::kFloat && exact.size(0) == NB
                && exact.size(1) == K && exact.size(2) == 32,
                "screened_argmax_i8: for float32 x, exact must be the packed fp32 head [NB, K, 32]");
  }
  const float* sp = opt_f32(scale, N, "screened_argmax_i8: scale");
  const float* up = opt_f32(u, N, "screened_argmax_i8: u");
  const float* tp = opt_f32(t, N, "screened_argmax_i8: t");
  TORCH_CHECK(rel >= 0 && abs_err >= 0, "screened_argmax_i8: rel and abs_err must be >= 0");
  const int64_t M = x.size(0);
  at::Tensor ids = at::full({M}, -1, x.options().dtype(at::kLong));
#if QS_I8SCREEN
  if (M == 0 || N == 0) return ids;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const at::BFloat16* xbp = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;  // the exact pass's pairs
  // per row: σ, the integers xq (int16 pairs, KP int32 a row), ‖x‖ and ‖x − xs‖ + rel ‖xs‖ in
  // double (σ · xq is exact in double: 24 × 15 bits), rounded up to fp32; a non-finite row → −1
  const int64_t X = std::min<int64_t>(16383, ((int64_t(1) << 31) - 1) / (127 * K));
  std::vector<int16_t> xq16(M * K);
  std::vector<float> sigma(M);
  std::vector<ScreenRow> rows(M);
  std::vector<char> finite(M, 1);
  for (int64_t m = 0; m < M; ++m) {
    auto xv = [&](int64_t k) { return bf16 ? static_cast<float>(xbp[m * K + k]) : xf[m * K + k]; };
    float amax = 0.f;
    bool ok = true;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xv(k);
      ok = ok && std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    float sg = amax / static_cast<float>(X);
    if (!(sg > 0.f) || !std::isfinite(sg)) sg = 1.f;  // x = 0 (or a subnormal-only row): xq = 0, xs = 0
    sigma[m] = sg;
    double xn = 0, dn = 0, sn = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = xv(k);
      double r = ok ? std::nearbyint(v / sg) : 0.0;
      r = std::min<double>(X, std::max<double>(-X, r));
      xq16[m * K + k] = static_cast<int16_t>(r);
      const double xs = r * sg;
      xn += v * v; dn += (v - xs) * (v - xs); sn += xs * xs;
    }
    const double c1 = std::sqrt(xn) * (1 + 1e-12), c2 = (std::sqrt(dn) + rel * std::sqrt(sn)) * (1 + 1e-12);
    finite[m] = ok && std::isfinite(c1) && std::isfinite(c2) && c1 < 1e38 && c2 < 1e38;
    const float f1 = static_cast<float>(c1), f2 = static_cast<float>(c2);
    rows[m].c1 = _mm512_set1_ps(f1 < c1 ? std::nextafter(f1, INFINITY) : f1);
    rows[m].c2 = _mm512_set1_ps(f2 < c2 ? std::nextafter(f2, INFINITY) : f2);
  }
  // hi [M, N]: kept between calls (a fresh 0.2-2 MB buffer a call is a page-fault storm)
  static thread_local std::vector<float> hi_buf;
  if (hi_buf.size() < static_cast<size_t>(M * N)) hi_buf.resize(static_cast<size_t>(M * N));
  float* hi = hi_buf.data();
  const int8_t* qp = q.data_ptr<int8_t>();
  const int32_t* xi = reinterpret_cast<const int32_t*>(xq16.data());  // [M, KP] int16 pairs
  const float ae = static_cast<float>(abs_err);
  const __m512 vabs = _mm512_set1_ps(ae < abs_err ? std::nextafter(ae, INFINITY) : ae);
  // each chunk of blocks keeps its rows' largest lo and probe: [chunk start][M]
  std::vector<float> lo_all(NB * M, -INFINITY), probe_all(NB * M, 0.f);
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    std::vector<__m512> lo_max(M, _mm512_set1_ps(-INFINITY)), probe(M, _mm512_setzero_ps());
    for (int64_t c0 = b0; c0 < b1; c0 += 4) {  // chunks of 4 blocks, every row tile over them (cache)
      const int64_t c1 = std::min(b1, c0 + 4);
      for (int64_t m = 0; m < M;) {
        const int64_t r = std::min<int64_t>(11, M - m);  // 22 accumulators
        switch (r) {
#define QS_SCR(R) case R: i8_screen_rows<R>(qp, KP, xi, sigma.data(), c0, c1, sp, up, tp, vabs, rows.data(), N, hi, m, \
                                            lo_max.data(), probe.data()); break;
          QS_SCR(1) QS_SCR(2) QS_SCR(3) QS_SCR(4) QS_SCR(5) QS_SCR(6) QS_SCR(7) QS_SCR(8) QS_SCR(9) QS_SCR(10)
          QS_SCR(11)
#undef QS_SCR
          default: break;
        }
        m += r;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      lo_all[b0 * M + m] = _mm512_reduce_max_ps(lo_max[m]);
      probe_all[b0 * M + m] = _mm512_reduce_add_ps(probe[m]);
    }
  });
  const float* wf = bf16 ? nullptr : exact.data_ptr<float>();
  const int32_t* xb32 = reinterpret_cast<const int32_t*>(xbp);  // bf16 x as k-pairs
  const int32_t* wq = bf16 ? exact.data_ptr<int32_t>() : nullptr;
  int64_t* out = ids.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (!finite[m]) continue;
      float lower = -INFINITY, probe = 0.f;
      for (int64_t b = 0; b < NB; ++b) {
        lower = std::max(lower, lo_all[b * M + m]);
        probe += probe_all[b * M + m];
      }
      if (std::isnan(probe) || !std::isfinite(lower)) continue;
      const __m512 low = bf16 ? round_bf16_ps(_mm512_set1_ps(lower)) : _mm512_set1_ps(lower);
      const float* h = hi + m * N;
      float best = 0.f;
      int64_t best_n = -1;
      for (int64_t n = 0; n < N && best_n != -2; n += 16) {
        const __mmask16 k = lane_mask(N - n);
        __m512 hv = _mm512_maskz_loadu_ps(k, h + n);
        if (bf16) hv = round_bf16_ps(hv);
        unsigned cand = _mm512_mask_cmp_ps_mask(k, hv, low, _CMP_NLT_UQ);  // may reach the maximum
        while (cand) {
          const int64_t c = n + __builtin_ctz(cand);
          cand &= cand - 1;
          float v;
          if (bf16) {  // packed_pairs_gemm's chain for output c: its lane of the half block
            const int32_t* blk = wq + (c / 32) * KP * 32 + (c % 32) / 16 * 16;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t p = 0; p < KP; ++p)
              acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(blk + p * 32),
                                     (__m512bh)_mm512_set1_epi32(xb32[m * KP + p]));
            alignas(64) float lanes[16];
            _mm512_store_ps(lanes, acc);
            v = static_cast<float>(static_cast<at::BFloat16>(lanes[c % 16]));  // stored rounded to nearest even
          } else {
            v = packed_chain(wf, xf + m * K, K, c);
          }
          if (!std::isfinite(v)) { best_n = -2; break; }
          if (best_n < 0 || v > best) { best = v; best_n = c; }
        }
      }
      out[m] = best_n == -2 ? -1 : best_n;
    }
  });
#endif
  return ids;
}

// ---- a whole decoder stack in one call (decode / verification / short-prefill steps) --------
//
// A decode step of a small model on CPU spends a sixth of its time in Python between kernels
// (~11 module calls and ~20 tensor ops per layer, ~150 µs a layer on the default model). The
// plan holds each layer's norm weights, its four fused linears (packed fp32, int8 or int4) and
// its KV cache tensors, and runs the very calls the modules make, in their order: rms_norm,
// qkv linear, rope over q and k, paged attention (writing k / v), o linear, residual add,
// rms_norm, gate/up linear, silu * up, down linear, residual add. Same kernels, same operands:
// bitwise the module path's result.

namespace {

// kind 0: packed fp32 (a); 1: int8 (a = q, b = scale); 2: int4 (a = q, b = scale, c = neg_zs);
// 3: torch's packed int4 op for bf16 / fp16 x (a = int4pack, b = scales_zeros, bias in x's dtype
// added after it, as QuantLinear does)
struct LinearSpec {
  int64_t kind = 0, N = 0, group = 0;
  at::Tensor a, b, c;
  c10::optional<at::Tensor> bias;
};

at::Tensor run_linear(const LinearSpec& s, const at::Tensor& x) {
  switch (s.kind) {
    case 0: return packed_gemm(x, s.a, s.N, s.bias);
    case 1: return packed_w8_gemm(x, s.a, s.b, s.N, s.bias);
    case 2: return packed_w4_gemm(x, s.a, s.b, s.c, s.group, s.N, s.bias);
    default: {
      at::Tensor xa = x.contiguous();  // the op needs an allocator-aligned x (QuantLinear's _aligned)
      if (reinterpret_cast<uintptr_t>(xa.data_ptr()) % 64 != 0) xa = xa.clone();
      at::Tensor y = at::_weight_int4pack_mm_for_cpu(xa, s.a, s.group, s.b);
      return s.bias.has_value() ? at::add(y, *s.bias) : y;
    }
  }
}

// one decoder layer's tensors: 18 tensors (norm_in, norm_post, then (a, b, c, bias) for qkv, o,
// gate_up, down; an empty tensor where a linear has no b / c / bias) and 12 ints ((kind, N,
// group) per linear)
struct LayerWeights {
  at::Tensor norm_in, norm_post;
  LinearSpec qkv, o, gate_up, down;
};

LinearSpec make_linear(const at::Tensor* t, const int64_t* n, const char* who) {
  TORCH_CHECK(n[0] >= 0 && n[0] <= 3, who, ": linear kind must be 0, 1, 2 or 3");
  LinearSpec s;
  s.kind = n[0]; s.N = n[1]; s.group = n[2];
  s.a = t[0]; s.b = t[1]; s.c = t[2];
  if (t[3].numel()) s.bias = t[3];
  return s;
}

LayerWeights make_layer(const at::Tensor* t, const int64_t* n, int64_t H, int64_t KV, int64_t hd, const char* who) {
  LayerWeights w;
  w.norm_in = t[0];
  w.norm_post = t[1];
  w.qkv = make_linear(t + 2, n, who);
  w.o = make_linear(t + 6, n + 3, who);
  w.gate_up = make_linear(t + 10, n + 6, who);
  w.down = make_linear(t + 14, n + 9, who);
  TORCH_CHECK(w.qkv.N == (H + 2 * KV) * hd && w.gate_up.N % 2 == 0,
              who, ": qkv must give (H + 2 KV) * head_dim outputs, gate_up an even number");
  return w;
}

// the MLP half of a layer: x + down(silu(gate) * up)(rms_norm(x))
at::Tensor mlp_residual(const LayerWeights& w, const at::Tensor& x, double eps) {
  const at::Tensor h = rms_norm(x, w.norm_post, eps);
  const at::Tensor act = silu_mul(run_linear(w.gate_up, h).contiguous());
  return at::add(x, run_linear(w.down, act));
}

}  // namespace

class DecoderPlan {
 public:
  // per layer: the 18 tensors and 12 ints of `make_layer`
  DecoderPlan(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints,
              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, int64_t heads,
              int64_t kv_heads, int64_t head_dim, int64_t block_size, double eps, double scale)
      : k_caches_(std::move(k_caches)), v_caches_(std::move(v_caches)), H_(heads), KV_(kv_heads),
        hd_(head_dim), block_size_(block_size), eps_(eps), scale_(scale) {
    const size_t L = k_caches_.size();
    TORCH_CHECK(L > 0 && v_caches_.size() == L && tensors.size() == L * 18 && ints.size() == L * 12,
                "DecoderPlan: 18 tensors, 12 ints and a k / v cache per layer");
    for (size_t l = 0; l < L; ++l)
      layers_.push_back(make_layer(tensors.data() + l * 18, ints.data() + l * 12, H_, KV_, hd_, "DecoderPlan"));
  }

  int64_t num_layers() const { return static_cast<int64_t>(k_caches_.size()); }

  // x [T, D] (the embeddings), cos / sin [T, hd] of x's dtype → the hidden states after the last
  // layer; the attention arguments as `paged_attention` takes them. out_rows [N] (int64 row
  // indices): return only those rows, [N, D]; the last layer then runs its o projection and MLP
  // on them alone (every row still writes its keys / values). The kernels compute each row by
  // the same operations whatever the other rows, so those rows are bitwise the full result's.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const std::vector<int64_t>& q_lens, const std::vector<int64_t>& seq_lens,
                     const c10::optional<at::Tensor>& out_rows) const {
    TORCH_CHECK(x.dim() == 2, "DecoderPlan.forward: x must be [T, D]");
    const int64_t T = x.size(0);
    if (out_rows.has_value())
      TORCH_CHECK(out_rows->dim() == 1 && out_rows->scalar_type() == at::kLong,
                  "DecoderPlan.forward: out_rows must be a 1-D int64 tensor of row indices");
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      const at::Tensor h = rms_norm(x.contiguous(), w.norm_in, eps_);
      const at::Tensor qkv = run_linear(w.qkv, h).view({T, H_ + 2 * KV_, hd_});
      const at::Tensor qk = rope(qkv.narrow(1, 0, H_ + KV_), cos, sin);
      at::Tensor a = paged_attention(qk.narrow(1, 0, H_), qk.narrow(1, H_, KV_), qkv.narrow(1, H_ + KV_, KV_),
                                     k_caches_[l], v_caches_[l], slot_mapping, block_tables, q_lens,
                                     seq_lens, block_size_, scale_).reshape({T, H_ * hd_});
      if (out_rows.has_value() && l + 1 == layers_.size()) {
        x = x.index_select(0, *out_rows);
        a = a.index_select(0, *out_rows);
      }
      x = at::add(x, run_linear(w.o, a));
      x = mlp_residual(w, x, eps_);
    }
    return x;
  }

 private:
  std::vector<LayerWeights> layers_;
  std::vector<at::Tensor> k_caches_, v_caches_;
  int64_t H_, KV_, hd_, block_size_;
  double eps_, scale_;
};

// ---- an MTP draft step in one call ------------------------------------------------------------
//
// `model_zoo/mtp.py`'s MTPModule.forward + draft_logits, the calls its modules make in order:
// x = eh_proj(cat(rms_norm(emb, enorm), rms_norm(h, hnorm))); one decoder layer whose window-1
// attention returns each token's own value vector repeated over its KV group's query heads (q, k
// and their rotation do not reach the output, so they are not rotated); rms_norm(x, norm); the
// draft-vocabulary head. Same kernels, same operands: bitwise the modules' result. In the engine
// (weights cold after the base's forward) the default model's int8 MTP drafted in 1.21-1.28 ms a
// step through the modules, 0.62-0.82 ms through this plan with the int8 draft head.
class MTPPlan {
 public:
  // tensors: enorm, hnorm, eh_proj (a, b, c, bias), the layer's 18, norm, head (a, b, c, bias)
  // (29); ints: eh_proj's (kind, N, group), the layer's 12, the head's 3 (18)
  MTPPlan(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints, int64_t heads,
          int64_t kv_heads, int64_t head_dim, double eps)
      : H_(heads), KV_(kv_heads), hd_(head_dim), eps_(eps) {
    TORCH_CHECK(tensors.size() == 29 && ints.size() == 18, "MTPPlan: 29 tensors and 18 ints");
    TORCH_CHECK(KV_ > 0 && H_ % KV_ == 0, "MTPPlan: heads must be a multiple of kv_heads");
    enorm_ = tensors[0];
    hnorm_ = tensors[1];
    eh_ = make_linear(tensors.data() + 2, ints.data(), "MTPPlan");
    layer_ = make_layer(tensors.data() + 6, ints.data() + 3, H_, KV_, hd_, "MTPPlan");
    norm_ = tensors[24];
    head_ = make_linear(tensors.data() + 25, ints.data() + 15, "MTPPlan");
  }

  // h [A, D] (the base's or the previous depth's pre-norm hidden), emb [A, D] (the embeddings of
  // the tokens those hidden states produced) → (the MTP's pre-norm hidden [A, D], draft logits [A, Vd])
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& h, const at::Tensor& emb) const {
    TORCH_CHECK(h.dim() == 2 && emb.sizes() == h.sizes() && emb.scalar_type() == h.scalar_type(),
                "MTPPlan.forward: h and emb must be [A, D] of one dtype");
    const int64_t T = h.size(0);
    at::Tensor x = run_linear(eh_, at::cat({rms_norm(emb.contiguous(), enorm_, eps_),
                                            rms_norm(h.contiguous(), hnorm_, eps_)}, -1));
    const at::Tensor n = rms_norm(x.contiguous(), layer_.norm_in, eps_);
    const at::Tensor qkv = run_linear(layer_.qkv, n).view({T, H_ + 2 * KV_, hd_});
    const at::Tensor a = qkv.narrow(1, H_ + KV_, KV_).repeat_interleave(H_ / KV_, 1);
    x = at::add(x, run_linear(layer_.o, a.reshape({T, H_ * hd_})));
    x = mlp_residual(layer_, x, eps_);
    at::Tensor logits = run_linear(head_, rms_norm(x.contiguous(), norm_, eps_));
    return {x, logits};
  }

 private:
  at::Tensor enorm_, hnorm_, norm_;
  LinearSpec eh_, head_;
  LayerWeights layer_;
  int64_t H_, KV_, hd_;
  double eps_;
};

// ---- n-gram drafting (spec/ngram.py's matchers, scalar) ---------------------------------------
//
// `propose_ngram_match` and `realigned_match` of infer/spec/ngram.py (their docstrings define
// them; the numpy versions are the reference and the fallback), as one scalar pass each. In the
// engine the drafter runs right after a forward that streamed the weights through every cache:
// its ~25 numpy calls took ~250 µs there against ~60 µs warm, where one call here touches the
// token array and a few lines of code.

namespace {

// how many j = 0, 1, ... (< cap) have t[at - j] == t[src - j] consecutively (src < at; 0 if src < 0)
inline int64_t agreeing_run(const int64_t* t, int64_t at, int64_t src, int64_t cap) {
  int64_t j = 0;
  while (j < cap && src - j >= 0 && t[at - j] == t[src - j]) ++j;
  return j;
}

// ngram.py's `_continuation`: the up to cap tokens after position end, cycled through the last p
// tokens where the sequence already repeats them
std::vector<int64_t> continuation(const int64_t* t, int64_t L, int64_t end, int64_t cap) {
  const int64_t p = L - 1 - end, q = std::max<int64_t>(p, 2);
  const int64_t n = std::min(cap, p);
  std::vector<int64_t> out(t + end + 1, t + end + 1 + n);
  if (n < cap && p > 0 && p + q <= L && std::equal(t + L - q, t + L, t + L - q - p))
    for (int64_t i = n; i < cap; ++i) out.push_back(t[end + 1 + i % p]);
  return out;
}

// the sequence: the first L elements of `tokens` (a buffer the proposer grows)
const int64_t* token_ptr(const at::Tensor& tokens, int64_t L, const char* op) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
              tokens.device().is_cpu(), op, ": tokens must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(L >= 0 && L <= tokens.size(0), op, ": length must be in [0, tokens.numel()]");
  return tokens.data_ptr<int64_t>();
}

}  // namespace

// → (draft, agreement) for the sequence tokens[:L]; the caller checks the sizes (ngram.py's _check_sizes).
// An occurrence followed by one of `stop` (end-of-sequence ids) is no candidate.
std::tuple<std::vector<int64_t>, int64_t> ngram_match(const at::Tensor& tokens, int64_t L, int64_t max_ngram,
                                                      int64_t cap, int64_t min_ngram, int64_t tie_context,
                                                      int64_t agreement_cap, const std::vector<int64_t>& stop) {
  const int64_t* t = token_ptr(tokens, L, "ngram_match");
  const int64_t max_n = std::min(max_ngram, L - 1);
  if (cap == 0 || max_n < min_ngram) return {std::vector<int64_t>(), 0};
  // each occurrence e of the last token: its agreement m(e) with the suffix, counted up to jmax
  // (the tie-break's reach); the chosen one has the largest m, ties → the latest e. That is the
  // longest-first search (the latest of the longest matches up to max_n tokens) and, where
  // several reach max_n, its tie-break over the context before them, in one pass
  const int64_t jmax = std::min(max_n + tie_context, L - 1);
  int64_t best_m = 0, best_end = -1;
  for (int64_t e = 0; e < L - 1; ++e) {
    if (t[e] != t[L - 1] || std::find(stop.begin(), stop.end(), t[e + 1]) != stop.end()) continue;
    const int64_t m = agreeing_run(t, L - 1, e, jmax);
    if (m >= best_m) best_m = m, best_end = e;
  }
  const int64_t best_n = std::min(best_m, max_n);
  if (best_n < min_ngram || best_end < 0) return {std::vector<int64_t>(), 0};
  int64_t agreement = best_n;
  while (agreement < agreement_cap && agreement <= best_end && t[best_end - agreement] == t[L - 1 - agreement])
    ++agreement;
  return {continuation(t, L, best_end, cap), agreement};
}

// → (draft, matched): `realigned_match` of tokens[:L], with its constants
std::tuple<std::vector<int64_t>, int64_t> realigned_match(const at::Tensor& tokens, int64_t L, int64_t cap,
                                                          int64_t max_gap, int64_t context, double gap_penalty,
                                                          int64_t candidates) {
  const int64_t* t = token_ptr(tokens, L, "realigned_match");
  if (cap == 0 || L < 2) return {std::vector<int64_t>(), 0};
  std::vector<int64_t> ends;  // the latest `candidates` occurrences of the last token, ascending
  for (int64_t e = L - 2; e >= 0 && static_cast<int64_t>(ends.size()) < candidates; --e)
    if (t[e] == t[L - 1]) ends.push_back(e);
  if (ends.empty()) return {std::vector<int64_t>(), 0};
  std::reverse(ends.begin(), ends.end());
  double best_score = -1.0;
  int64_t best_e = -1, best_matched = 0;
  for (const int64_t e : ends) {
    const int64_t a = agreeing_run(t, L - 1, e, context);
    double gain = 0.0;
    int64_t b_used = 0;
    for (int64_t go = 0; go <= max_gap; ++go)
      for (int64_t gs = 0; gs <= max_gap; ++gs) {
        if (go == 0 && gs == 0) continue;
        const int64_t at = L - 1 - a - go, src = e - a - gs;
        const int64_t b = src < at ? agreeing_run(t, at, src, context) : 0;
        const double g = static_cast<double>(b) - gap_penalty * static_cast<double>(go + gs);
        if (g > gain) gain = g, b_used = b;  // the first gap of the largest gain
      }
    const double score = static_cast<double>(a) + gain;
    if (score >= best_score) best_score = score, best_e = e, best_matched = a + b_used;  // ties → the latest
  }
  return {continuation(t, L, best_e, cap), best_matched};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512", &has_avx512);
  m.def("dense_gemv", &dense_gemv, py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("packed_gemm", &packed_gemm, py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("packed_pairs_gemm", &packed_pairs_gemm, py::arg("x"), py::arg("w_pairs"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("packed_w8_gemm", &packed_w8_gemm, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("packed_w4_gemm", &packed_w4_gemm, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("neg_zs"),
        py::arg("group"), py::arg("n"), py::arg("bias") = py::none());
  m.def("paged_attention", &paged_attention);
  m.def("rms_norm", &rms_norm);
  m.def("rope", &rope);
  m.def("silu_mul", &silu_mul);
  m.def("screened_argmax", &screened_argmax);
  m.def("screened_argmax_pairs", &screened_argmax_pairs);
  m.def("screened_argmax_i8", &screened_argmax_i8);
  m.def("has_bf16_dot", &has_bf16_dot);
  m.def("has_int8_screen", &has_int8_screen);
  m.def("ngram_match", &ngram_match, py::arg("tokens"), py::arg("L"), py::arg("max_ngram"), py::arg("cap"),
        py::arg("min_ngram"), py::arg("tie_context"), py::arg("agreement_cap"),
        py::arg("stop") = std::vector<int64_t>(), py::call_guard<py::gil_scoped_release>());
  m.def("realigned_match", &realigned_match, py::call_guard<py::gil_scoped_release>());
  m.def("set_pair_path", [](bool on) { const bool was = g_pair_path; g_pair_path = on; return was; },
        "turn the quantized GEMMs' bf16 pair path on / off (benches); returns the previous setting");
  m.def("set_prefill_blocks", [](bool on) { const bool was = g_prefill_blocks; g_prefill_blocks = on; return was; },
        "turn paged_attention's blocked kernel for fp32 fresh prompts on / off (benches); returns the previous setting");
  m.def("set_prefetch", [](bool on) { const bool was = g_prefetch; g_prefetch = on; return was; },
        "turn the greedy head screen's L2 prefetch of the next block on / off (benches); returns the "
        "previous setting");
  py::class_<DecoderPlan>(m, "DecoderPlan")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("num_layers", &DecoderPlan::num_layers)
      .def("forward", &DecoderPlan::forward, py::call_guard<py::gil_scoped_release>());
  py::class_<MTPPlan>(m, "MTPPlan")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t, int64_t, double>())
      .def("forward", &MTPPlan::forward, py::call_guard<py::gil_scoped_release>());
}
