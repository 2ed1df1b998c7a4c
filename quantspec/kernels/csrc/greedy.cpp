// Greedy picks from a head without every logit (quantspec's CPU kernels): an approximation of
// every logit from a smaller copy of the head, and the exact chain of the head's own kernel for
// the outputs whose approximation is within a proven bound of the best.

#include "cpu.h"

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
// behind its stream (a vocabulary head of tens of MB), so they prefetch the block they compute
// next into L2 while computing one; smaller tiles, where it does not pay, never prefetch, nor do
// calls of more than one tile per block. The GEMMs' tiles do not prefetch: whether memory or the
// FMAs bind them moves with the host's load. Results are unchanged (prefetches only move lines);
// the `prefetch` argument turns it off (`bench/spec_cost.py --prefetch-ab` compares the two).
constexpr int kPrefetchRows = 8;

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
                                 const at::Tensor& row_norm, int64_t N, double rel, double abs_err, bool prefetch_next) {
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
  const bool prefetch = prefetch_next && M <= 12;  // one tile per block (see kPrefetchRows)
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
// hold x to 2^-14 of its largest element where bf16 holds 2^-8 of each, and the codes need no
// conversion to a float format before their dot products. Each tile turns its approximations into
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
// converted to int32 lanes at every vpdpwssd go through the stack on every k-pair of the 11-row
// tile (GCC 12: a store and a reload per accumulator and step)
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
// runs out of registers and keeps the accumulators of the larger tiles in memory
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

static qs_bind::Register bind_greedy([](pybind11::module_& m) {
  m.def("screened_argmax", &screened_argmax, py::arg("x"), py::arg("w_bf16"), py::arg("packed"), py::arg("row_norm"),
        py::arg("n"), py::arg("rel"));
  m.def("screened_argmax_pairs", &screened_argmax_pairs, py::arg("x"), py::arg("w_pairs"), py::arg("packed"),
        py::arg("row_norm"), py::arg("n"), py::arg("rel"), py::arg("abs_err"), py::arg("prefetch") = true);
  m.def("screened_argmax_i8", &screened_argmax_i8, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("u"),
        py::arg("t"), py::arg("exact"), py::arg("n"), py::arg("rel"), py::arg("abs_err"));
  m.def("has_bf16_dot", &has_bf16_dot);
  m.def("has_int8_screen", &has_int8_screen);
});
