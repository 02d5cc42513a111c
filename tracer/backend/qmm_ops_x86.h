// qmm's operations for x86: AVX2 (+FMA, F16C), AVX-512 (F, BW, VL) and, for
// the fast contract, AVX-512 VNNI; each a namespace compiled under its target
// pragma (the module itself is built without -march) in which qmm_isa.h and
// qmm_fast.h are instantiated. Included by qmm.cpp inside its anonymous
// namespace, on x86-64 only.

// The vector type V of an x86 ISA whose intrinsics start with P, its plain
// operations and its float16 conversion.
#define QMM_X86_OPS(V, P)                                              \
  using F = V;                                                         \
  constexpr Halves halves = halves_f16c;                               \
  inline F splat(float a) { return P##_set1_ps(a); }                   \
  inline F loadu(const float* p) { return P##_loadu_ps(p); }           \
  inline void storeu(float* p, F a) { P##_storeu_ps(p, a); }           \
  inline F add(F a, F b) { return P##_add_ps(a, b); }                 \
  inline F fmadd(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
constexpr int L = 8, kTile = 4;
constexpr int kRows(int mt) { return mt == 1 ? 2 : 1; }
constexpr int kAcc(int) { return 2; }
QMM_X86_OPS(__m256, _mm256)
inline float hsum(F a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline F widen8(__m128i bytes) {  // the low 8 bytes
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}
struct Group {
  F s, b;
};
template <int BITS>
inline Group group(float s, float b) {
  return {splat(s), splat(b)};
}
template <int BITS>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0f);
    const __m128i even = _mm_and_si128(v, m), odd = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    w[0] = widen8(even), w[1] = widen8(_mm_srli_si128(even, 8)), w[2] = widen8(odd), w[3] = widen8(_mm_srli_si128(odd, 8));
  } else {
    for (int i = 0; i < 4; ++i) w[i] = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
  }
  for (int v = 0; v < 4; ++v) w[v] = _mm256_add_ps(_mm256_mul_ps(w[v], g.s), g.b);
}
// The fast contract: unsigned weight bytes times signed x bytes by maddubs,
// 4 bits as they are (a pair sums to at most 2 * 15 * 127: no saturation),
// 8 bits split into nibbles (each by maddubs, the high ones weighted 16 by madd).
constexpr int kFastRows(int mt) { return mt == 1 ? 2 : 1; }
struct WP {
  __m256i a, b, a_hi, b_hi;  // halves A and B of blocks i | i + 4 (8 bits: their low nibbles; a_hi, b_hi the high)
};
inline __m256i load_pair(const uint8_t* p0, const uint8_t* p1) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
}
template <int BITS>
inline WP unpack_pair(const uint8_t* p0, const uint8_t* p1) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  if constexpr (BITS == 4) {
    const __m256i v = load_pair(p0, p1);
    return {_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m), v, v};
  } else {
    const __m256i a = load_pair(p0, p1), b = load_pair(p0 + 16, p1 + 16);
    return {_mm256_and_si256(a, m), _mm256_and_si256(b, m), _mm256_and_si256(_mm256_srli_epi16(a, 4), m),
            _mm256_and_si256(_mm256_srli_epi16(b, 4), m)};
  }
}
template <int BITS>
inline __m256i pair_dot(const WP& w, const int8_t* x) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
  const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w.a, xa), _mm256_maddubs_epi16(w.b, xb));
  if constexpr (BITS == 4) {
    return _mm256_madd_epi16(lo, _mm256_set1_epi16(1));
  } else {
    const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w.a_hi, xa), _mm256_maddubs_epi16(w.b_hi, xb));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi16(1)), _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
  }
}
// Lane b = block b's sum, from 4 pair sums (lanes 0-3: block i, 4-7: block i + 4).
inline __m256i reduce4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
}
using I = __m256i;
inline I i_zero() { return _mm256_setzero_si256(); }
using FA = __m256;
inline FA fa_zero() { return _mm256_setzero_ps(); }
inline FA fa_mul(const float* a, const float* b) { return _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)); }
inline FA fa_add(FA a, FA b) { return _mm256_add_ps(a, b); }
inline FA fa_mul_n(const float* a, const float* b, int n) {  // reads only the first n of each
  const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_mul_ps(_mm256_maskload_ps(a, m), _mm256_maskload_ps(b, m));
}
inline FA fa_fma_blocks(I s, FA d, FA a) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, a); }
inline float hsum8(FA a) { return hsum(a); }
#include "qmm_isa.h"
#include "qmm_fast.h"
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace isa_avx512 {
constexpr int L = 16, kTile = 8;
constexpr int kRows(int mt) { return mt == 1 ? 4 : 2; }
constexpr int kAcc(int mt) { return mt <= 2 ? 2 : 1; }
QMM_X86_OPS(__m512, _mm512)
inline float hsum(F a) { return _mm512_reduce_add_ps(a); }
// 4 bits: `a` holds the group's 16 possible weights (scale * q + bias for q = 0..15), looked
// up by each nibble; 8 bits: scale and bias.
struct Group {
  F a, b;
};
template <int BITS>
inline Group group(float s, float b) {
  if constexpr (BITS == 4) {
    const F q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {_mm512_add_ps(_mm512_mul_ps(q, splat(s)), splat(b)), splat(0.0f)};
  }
  return {splat(s), splat(b)};
}
template <int BITS>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  if constexpr (BITS == 4) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[0] = _mm512_permutexvar_ps(q, g.a);  // vpermps reads an index's low 4 bits: the low nibble
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), g.a);
  } else {
    for (int i = 0; i < 2; ++i) {
      const F q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
      w[i] = _mm512_add_ps(_mm512_mul_ps(q, g.a), g.b);
    }
  }
}
#include "qmm_isa.h"
}  // namespace isa_avx512
#pragma GCC pop_options

// The fast contract on AVX-512 with VNNI (vpdpbusd: unsigned weight bytes times
// signed x bytes, 4 products a lane, no saturation); the avx512 path without
// VNNI runs avx2's.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
namespace isa_avx512_vnni {
using namespace isa_avx512;
constexpr int kFastRows(int mt) { return mt == 1 ? 4 : mt == 2 ? 2 : 1; }
using isa_avx2::FA, isa_avx2::I, isa_avx2::i_zero, isa_avx2::reduce4, isa_avx2::load_pair;
using isa_avx2::fa_zero, isa_avx2::fa_mul, isa_avx2::fa_mul_n, isa_avx2::fa_add, isa_avx2::fa_fma_blocks;
struct WP {
  __m256i a, b;
};
template <int BITS>
inline WP unpack_pair(const uint8_t* p0, const uint8_t* p1) {
  if constexpr (BITS == 4) {
    const __m256i v = load_pair(p0, p1), m = _mm256_set1_epi8(0x0f);
    return {_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m)};
  } else {
    return {load_pair(p0, p1), load_pair(p0 + 16, p1 + 16)};
  }
}
template <int BITS>
inline I pair_dot(const WP& w, const int8_t* x) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w.a, xa), w.b, xb);
}
inline float hsum8(FA a) { return isa_avx2::hsum(a); }
#include "qmm_fast.h"
}  // namespace isa_avx512_vnni
#pragma GCC pop_options

void fast_avx512(const QmmJob& j, int n0, int n1) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  vnni ? isa_avx512_vnni::fast_rows(j, n0, n1) : isa_avx2::fast_rows(j, n0, n1);
}

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
