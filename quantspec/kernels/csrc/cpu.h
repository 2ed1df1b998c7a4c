// quantspec's CPU kernels: what every family of ops shares (`gemm.cpp`, `attention.cpp`,
// `rows.cpp`, `greedy.cpp`, and the model-shaped plans and matchers of the rooms that own them):
// the build's feature macros, small AVX-512 helpers, the row-major GEMM tile, argument checks,
// the public ops' declarations, and the registry through which each source file binds its ops
// into the one extension module (`module.cpp`).
//
// Built at run time by quantspec/kernels/cpu/build.py (torch.utils.cpp_extension, -march=native,
// -ffp-contract=off); without AVX-512 the module reports has_avx512() == false and quantspec keeps
// torch's ops.

#pragma once

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

// rows [m0, m0 + RM) × weight rows [n0, n1), one weight row at a time (streaming several rows at
// once is slower on Zen 4)
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

// exp of each lane
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

#endif  // QS_AVX512

// x as fp32: its own data when it is fp32, else converted into `buf`
inline const float* x_as_fp32(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  const int64_t n = x.numel();
  buf.resize(n);
  const at::BFloat16* p = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return buf.data();
}

// x [M, K] for a GEMM: contiguous 2-D fp32 / bf16 on CPU, K matching the weight (and a multiple
// of `k_multiple`: 16 for the row-major kernels, any K for the packed ones)
inline void check_x(const at::Tensor& x, int64_t K, const char* op, int64_t k_multiple = 16) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(K % k_multiple == 0, op, ": K must be a multiple of ", k_multiple, ", got ", K);
}

// NB column blocks of 32 hold N outputs (the last one padded)
inline void check_blocks(int64_t NB, int64_t N, const char* op) {
  TORCH_CHECK(N > (NB - 1) * 32 && N <= NB * 32, op, ": N=", N, " does not fit ", NB, " blocks of 32");
}

inline const float* opt_f32(const c10::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, what,
              " must be a contiguous float32 tensor of ", n, " values");
  return t->data_ptr<float>();
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

// ---- the public ops (each defined in its family's source, bound there) ------------------------

bool has_avx512();
bool has_bf16_dot();
bool has_int8_screen();
at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias);
at::Tensor packed_pairs_gemm(const at::Tensor& x, const at::Tensor& w_pairs, int64_t N,
                             const c10::optional<at::Tensor>& bias);
at::Tensor packed_w8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t N,
                          const c10::optional<at::Tensor>& bias, bool pairs);
at::Tensor packed_w4_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const at::Tensor& neg_zs, int64_t group, int64_t N,
                          const c10::optional<at::Tensor>& bias, bool pairs);
at::Tensor packed_fp4_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t group,
                           int64_t N, const c10::optional<at::Tensor>& bias, bool pairs);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const std::vector<int64_t>& q_lens,
                           const std::vector<int64_t>& seq_lens, int64_t block_size, double scale, bool pairs,
                           bool prefill_blocks);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& x);

// ---- bindings: each source file registers a function that binds its ops ----------------------

namespace qs_bind {
using Binder = void (*)(pybind11::module_&);
std::vector<Binder>& binders();  // module.cpp
struct Register {
  explicit Register(Binder b) { binders().push_back(b); }
};
}  // namespace qs_bind
