// The small per-row ops of quantspec's CPU kernels: RMSNorm, the rotary embedding, silu(gate) * up.

#include "cpu.h"

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

static qs_bind::Register bind_rows([](pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("rope", &rope, py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("silu_mul", &silu_mul, py::arg("x"));
});
