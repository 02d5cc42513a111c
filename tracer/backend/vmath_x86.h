// The layer kernels' element-wise exponentials, vectorized with MLX's bits.
//
// MLX's CPU exp (mlx/backend/cpu/simd/math.h) on this build runs one lane at
// a time (no -march: Simd<float, 1>), with std::fma calls into libm for its
// polynomial: in a prefill window, softmax and SwiGLU spent a quarter of the
// CPU there. These are the same operations on 8 or 16 lanes, so every lane
// gets MLX's bits:
//   x = in * log2(e); ipart = floor(double(x) + 0.5); fpart = x - ipart;
//   p = the same degree-6 polynomial in fpart by fused multiply-adds (an fma
//       is exactly rounded, as std::fma is);
//   result = float bits ((int(ipart) + 127) << 23) * p, then NaN -> in,
//       in > 88 -> inf, in < -88 -> 0 (in that order).
// floor(double(x) + 0.5) is computed in float without rounding: r = floor(x),
// f = x - r (exact: below 1 and a multiple of x's ulp, or 1 + x for x in
// (-1, 0) with |x| >= 1/2 an exact multiple of 2^-24, and >= 1/2 otherwise),
// ipart = r + (f >= 0.5). Sigmoid is MLX's: y = 1 / (1 + exp(|a|)), then y
// where a < 0, else 1 - y (IEEE division and subtraction on every lane).
// tests/test_kernels.py checks both against mx.exp / mx.sigmoid on every path.
// Included by qmm.cpp inside its anonymous namespace, on x86-64 only.

#define VMATH_POLY(F, FMA, SPLAT, fp)                       \
  F p = SPLAT(1.535336188319500e-4f);                       \
  p = FMA(p, fp, SPLAT(1.339887440266574e-3f));             \
  p = FMA(p, fp, SPLAT(9.618437357674640e-3f));             \
  p = FMA(p, fp, SPLAT(5.550332471162809e-2f));             \
  p = FMA(p, fp, SPLAT(2.402264791363012e-1f));             \
  p = FMA(p, fp, SPLAT(6.931472028550421e-1f));             \
  p = FMA(p, fp, SPLAT(1.000000000000000f));

#if QMM_UNIT_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace vmath_avx2 {
inline __m256 exp8(__m256 in) {
  const __m256 x = _mm256_mul_ps(in, _mm256_set1_ps(1.442695f));
  const __m256 r = _mm256_floor_ps(x);
  const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(x, r), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 ipart = _mm256_add_ps(r, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
  const __m256 fp = _mm256_sub_ps(x, ipart);
  VMATH_POLY(__m256, _mm256_fmadd_ps, _mm256_set1_ps, fp)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 res = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
  res = _mm256_blendv_ps(res, in, _mm256_cmp_ps(in, in, _CMP_UNORD_Q));
  res = _mm256_blendv_ps(res, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(in, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(in, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}
inline __m256 sigmoid8(__m256 a) {
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a), one = _mm256_set1_ps(1.0f);
  const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(abs)));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ));
}
// out[j] = exp(x[j] - shift), j < n.
void exp_shifted(const float* x, float shift, float* out, int n) {
  const __m256 s = _mm256_set1_ps(shift);
  int j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), s)));
  if (j < n) {
    alignas(32) float t[8] = {};
    std::memcpy(t, x + j, sizeof(float) * (n - j));
    _mm256_store_ps(t, exp8(_mm256_sub_ps(_mm256_load_ps(t), s)));
    std::memcpy(out + j, t, sizeof(float) * (n - j));
  }
}
// out[j] = (a[j] * sigmoid(a[j])) * b[j], j < n.
void swiglu(const float* a, const float* b, float* out, int n) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 av = _mm256_loadu_ps(a + j);
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(av, sigmoid8(av)), _mm256_loadu_ps(b + j)));
  }
  if (j < n) {
    alignas(32) float ta[8] = {}, tb[8] = {};
    std::memcpy(ta, a + j, sizeof(float) * (n - j));
    std::memcpy(tb, b + j, sizeof(float) * (n - j));
    const __m256 av = _mm256_load_ps(ta);
    _mm256_store_ps(ta, _mm256_mul_ps(_mm256_mul_ps(av, sigmoid8(av)), _mm256_load_ps(tb)));
    std::memcpy(out + j, ta, sizeof(float) * (n - j));
  }
}
}  // namespace vmath_avx2
#pragma GCC pop_options
#endif  // QMM_UNIT_AVX2

#if QMM_UNIT_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
namespace vmath_avx512 {
inline __m512 exp16(__m512 in) {
  const __m512 x = _mm512_mul_ps(in, _mm512_set1_ps(1.442695f));
  const __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(x, r), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __m512 ipart = _mm512_mask_add_ps(r, up, r, _mm512_set1_ps(1.0f));
  const __m512 fp = _mm512_sub_ps(x, ipart);
  VMATH_POLY(__m512, _mm512_fmadd_ps, _mm512_set1_ps, fp)
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(ipart), _mm512_set1_epi32(127)), 23);
  __m512 res = _mm512_mul_ps(_mm512_castsi512_ps(e), p);
  res = _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(in, in, _CMP_UNORD_Q), in);
  res = _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(in, _mm512_set1_ps(88.0f), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(in, _mm512_set1_ps(-88.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}
inline __m512 sigmoid16(__m512 a) {
  const __m512 abs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 y = _mm512_div_ps(one, _mm512_add_ps(one, exp16(abs)));
  return _mm512_mask_mov_ps(_mm512_sub_ps(one, y), _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ), y);
}
void exp_shifted(const float* x, float shift, float* out, int n) {
  const __m512 s = _mm512_set1_ps(shift);
  for (int j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(out + j, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), s)));
  }
}
void swiglu(const float* a, const float* b, float* out, int n) {
  for (int j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512 av = _mm512_maskz_loadu_ps(m, a + j);
    _mm512_mask_storeu_ps(out + j, m, _mm512_mul_ps(_mm512_mul_ps(av, sigmoid16(av)), _mm512_maskz_loadu_ps(m, b + j)));
  }
}
}  // namespace vmath_avx512
#pragma GCC pop_options
#endif  // QMM_UNIT_AVX512
#undef VMATH_POLY
