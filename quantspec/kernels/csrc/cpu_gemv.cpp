// quantspec CPU kernels: skinny GEMMs (few rows of x, "GEMV") over fp32 / bf16 / int8 / int4
// weights, for decode and speculative-verification steps on x86 CPUs with AVX-512.
//
// y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n]); w dequantized on the fly:
//   fp32 / bf16: w as stored;  int8: q[n, k] * scale[n];
//   int4: (q[n, k] - zp[n, g]) * scale[n, g], g = k / group (scale / zp fp32; zp optional).
// x is fp32 or bf16 (converted once to fp32); accumulation in fp32; y in x's dtype.
//
// M-invariance: every output element is computed by the same sequence of float operations
// whatever M and whichever rows it is tiled with (two accumulators per (m, n) alternating over
// 16-wide chunks, one fixed horizontal reduction), so a row's result is bitwise the same in a
// 1-row decode step and in a 1 + k-row verification step.
//
// Each weight row is read once per tile of up to 4 rows of x.
// Built at run time by quantspec/kernels/cpu_gemv.py (torch.utils.cpp_extension, -march=native);
// without AVX-512 the module reports has_avx512() == false and quantspec keeps torch's ops.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QS_AVX512 1
#else
#define QS_AVX512 0
#endif

namespace {

bool has_avx512() { return QS_AVX512 != 0; }

#if QS_AVX512

// ---- weight loaders: 16 consecutive weights of row n, starting at k (k % 16 == 0), as fp32 ----

struct F32Rows {
  const float* w; int64_t K;
  inline __m512 load16(int64_t n, int64_t k) const { return _mm512_loadu_ps(w + n * K + k); }
};

struct BF16Rows {
  const uint16_t* w; int64_t K;
  inline __m512 load16(int64_t n, int64_t k) const {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
};

struct I8Rows {  // per-channel scale applied after the reduction
  const int8_t* q; int64_t K;
  inline __m512 load16(int64_t n, int64_t k) const {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * K + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
  }
};

// int4 rows packed by pack_int4_cpu: for each 32-wide block of k, byte j (0..15) holds
// (q[j] + 8) in its low nibble and (q[j + 16] + 8) in its high nibble. Dequantized here:
// w = q * s + b with b = -zp * s of the weight's group.
struct I4Rows {
  const uint8_t* p; int64_t K; const float* s; const float* b; int64_t G; int64_t group;
  inline __m512 load16(int64_t n, int64_t k) const {
    const int64_t blk = k & ~int64_t(31);
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + n * (K / 2) + blk / 2));
    __m128i nib = (k & 16) ? _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F))
                           : _mm_and_si128(v, _mm_set1_epi8(0x0F));
    __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(nib), _mm512_set1_epi32(8));
    const int64_t g = n * G + k / group;
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s[g]), _mm512_set1_ps(b[g]));
  }
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
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows_block<4>(w, x, K, N, m, n0, n1, col_scale, bias, y);
    for (; m + 2 <= M; m += 2) rows_block<2>(w, x, K, N, m, n0, n1, col_scale, bias, y);
    for (; m < M; ++m) rows_block<1>(w, x, K, N, m, n0, n1, col_scale, bias, y);
  });
}

#endif  // QS_AVX512

std::vector<float> x_as_fp32(const at::Tensor& x) {
  const int64_t n = x.numel();
  std::vector<float> xf(n);
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(xf.data(), x.data_ptr<float>(), n * sizeof(float));
  } else {
    const at::BFloat16* p = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) xf[i] = static_cast<float>(p[i]);
  }
  return xf;
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(K % 16 == 0, op, ": K must be a multiple of 16, got ", K);
}

const float* opt_f32(const c10::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, what,
              " must be a contiguous float32 tensor of ", n, " values");
  return t->data_ptr<float>();
}

template <class W>
at::Tensor dispatch_out(const W& w, const at::Tensor& x, int64_t N, const float* col_scale,
                        const float* bias, int64_t bytes_per_row) {
#if QS_AVX512
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> xf = x_as_fp32(x);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (x.scalar_type() == at::kFloat)
    run(w, xf.data(), M, K, N, col_scale, bias, y.data_ptr<float>(), bytes_per_row);
  else
    run(w, xf.data(), M, K, N, col_scale, bias, y.data_ptr<at::BFloat16>(), bytes_per_row);
  return y;
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
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
    return dispatch_out(F32Rows{w.data_ptr<float>(), K}, x, N, nullptr, b, K * 4);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "dense_gemv: w must be float32 or bfloat16");
  return dispatch_out(BF16Rows{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K},
                      x, N, nullptr, b, K * 2);
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

// y = x @ (q * scale[:, None])^T (+ bias); q [N, K] int8, scale [N] fp32
at::Tensor w8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "w8_gemv: q must be contiguous int8 [N, K]");
  check_x(x, q.size(1), "w8_gemv");
  const int64_t N = q.size(0), K = q.size(1);
  const float* s = opt_f32(scale, N, "w8_gemv: scale");
  const float* b = opt_f32(bias, N, "w8_gemv: bias");
#if QS_AVX512
  return dispatch_out(I8Rows{q.data_ptr<int8_t>(), K}, x, N, s, b, K);
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

// y = x @ dequant(packed)^T (+ bias); packed [N, K/2] uint8 (pack_int4_cpu), scale/neg_zs [N, K/group]
at::Tensor w4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                   const at::Tensor& bias_zs, int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "w4_gemv: packed must be contiguous uint8 [N, K/2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  check_x(x, K, "w4_gemv");
  TORCH_CHECK(group % 32 == 0 && K % group == 0 || group == K && K % 32 == 0,
              "w4_gemv: group must be a multiple of 32 dividing K (or K), got ", group);
  TORCH_CHECK(K % 32 == 0, "w4_gemv: K must be a multiple of 32, got ", K);
  const int64_t G = K / group;
  const float* s = opt_f32(scale, N * G, "w4_gemv: scale");
  const float* zs = opt_f32(bias_zs, N * G, "w4_gemv: neg_zs");
  const float* b = opt_f32(bias, N, "w4_gemv: bias");
#if QS_AVX512
  return dispatch_out(I4Rows{packed.data_ptr<uint8_t>(), K, s, zs, G, group}, x, N, nullptr, b,
                      K / 2);
#else
  TORCH_CHECK(false, "quantspec CPU kernels were built without AVX-512");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512", &has_avx512);
  m.def("dense_gemv", &dense_gemv, py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("w8_gemv", &w8_gemv, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("w4_gemv", &w4_gemv, py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("neg_zs"),
        py::arg("group"), py::arg("bias") = py::none());
}
