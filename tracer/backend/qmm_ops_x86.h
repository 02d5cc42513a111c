// qmm's operations for x86: AVX2 (+FMA, F16C), AVX-512 (F, BW, VL) and, for
// the fast contract, AVX-512 VNNI; each a namespace compiled under its target
// pragma (the module itself is built without -march) in which qmm_isa.h and
// qmm_fast.h are instantiated. Included by qmm.cpp inside its anonymous
// namespace, on x86-64 only; each ISA's namespaces only in its unit of
// qmm.cpp (QMM_UNIT_AVX2, QMM_UNIT_AVX512).

// The vector type V of an x86 ISA whose intrinsics start with P, its plain
// operations and its float16 conversion.
#define QMM_X86_OPS(V, P)                                              \
  using F = V;                                                         \
  constexpr Halves halves = halves_f16c;                               \
  constexpr Steps steps = steps_avx2;                                  \
  inline F splat(float a) { return P##_set1_ps(a); }                   \
  inline F loadu(const float* p) { return P##_loadu_ps(p); }           \
  inline void storeu(float* p, F a) { P##_storeu_ps(p, a); }           \
  inline F add(F a, F b) { return P##_add_ps(a, b); }                 \
  inline F fmadd(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }

// What this CPU runs (every unit: the paths' checks, and qmm_int8_isa's).
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
// The AVX-512 path's fast and split contracts run VNNI's kernels where it has it, else AVX2's.
bool has_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }

#if QMM_UNIT_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
// kTile 5 (0.5.13; was 4): a bucket-1 verify window of 5 rows is one tile,
// each block dequantized once, not twice (10 accumulators, the block's 4
// vectors and x: 15 of 16 registers). SmolLM2's head at M = 5 / 10 / 20,
// exact, the two builds taking turns twice (benchmarks/qmm.py, load ~1):
// 4.9, 5.7 / 10.2, 9.4 / 19.8, 20.4 ms against 6.8, 6.7 / 11.0, 13.0 /
// 21.7, 21.5; a bucket-1 verify step of 5 against a decode step
// (kernel_profile.py --window 5): 2.55, 2.19 against 2.58, 2.44, within
// this VM's noise. The same bits at every M (the accumulators per row).
constexpr int L = 8, kTile = 5;
constexpr bool kNarrowBits = true;  // 5- and 6-bit blocks (qmm.cpp's layouts)
// x of a 4-bit block in dequant's order (see dequant): to[8 j + l] is x's weight 8 l + j (l < 4), 8 (l - 4) + j + 4.
inline void order4(const float* from, float* to) {
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 4; ++l) to[8 * j + l] = from[8 * l + j], to[8 * j + 4 + l] = from[8 * l + j + 4];
  }
}
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
template <int BITS, bool X = false>
inline Group group(float s, float b) {
  return {splat(s), splat(b)};
}

#include "qmm_narrow_x86.h"
// Blocks at q and q + 4 BITS (bytes): their high words in 128-bit lanes 0 and 1.
template <int BITS>
inline __m256i high_pair(const uint8_t* q) {
  if constexpr (BITS == 6) {  // q + 16 .. q + 47: block 0's plane, block 1's nibbles, its plane
    return _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16)), _MM_SHUFFLE(3, 3, 0, 0));
  } else {
    return _mm256_set_m128i(high_word<BITS>(q + 4 * BITS), high_word<BITS>(q));
  }
}
// ... widened to 4 vectors of 8 int32 lanes (weights 8 i .. 8 i + 7 in vector i).
template <int BITS>
inline void natural_lanes(const uint8_t* p, __m256i* q) {
  __m128i lo, hi;
  natural<BITS>(p, lo, hi);
  q[0] = _mm256_cvtepu8_epi32(lo), q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
  q[2] = _mm256_cvtepu8_epi32(hi), q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

// 4 bits: the block's 16 bytes in both halves of a vector, each 32-bit lane
// shifted by its own count and masked (no byte shuffles: with the widening
// shuffles of even/odd nibbles, the shuffle ports bound the loop on Zen 3);
// vector j holds, in lane l < 4, weight 8 l + j and in lane l + 4 weight
// 8 l + j + 4 (order4 puts x in that order). Bucket-1 matvecs in cache, one
// thread, a scratch benchmark: 8.5-8.9 -> 11.3-11.4 G weights/s.
template <int BITS, bool X = false>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i m = _mm256_set1_epi32(0x0f);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i shift = _mm256_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j, 4 * j + 16, 4 * j + 16, 4 * j + 16, 4 * j + 16);
      w[j] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shift), m));
    }
  } else if constexpr (narrow_bits(BITS)) {  // the natural order, as 8 bits
    __m256i q[4];
    natural_lanes<BITS>(p, q);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtepi32_ps(q[i]);
  } else {
    for (int i = 0; i < 4; ++i) w[i] = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
  }
  for (int v = 0; v < 4; ++v) w[v] = X ? _mm256_fmadd_ps(w[v], g.s, g.b) : _mm256_add_ps(_mm256_mul_ps(w[v], g.s), g.b);
}
// The fast contract: unsigned weight bytes times signed x bytes by maddubs,
// 4 bits as they are (a pair sums to at most 2 * 15 * 127: no saturation),
// 8 bits split into nibbles (each by maddubs, the high ones weighted 16 by madd).
// A quad's 16 lanes in two vectors: blocks 0, 1 (lanes 0-7), blocks 2, 3 (8-15).
// kFastTile 5 (0.5.24; was 4): a bucket-1 verify window of 5 rows is one
// tile, not 4 and a row alone (gate/up at M = 5, split, one thread, in cache:
// 0.278 against 0.340 ms; M = 4 and 8 the same).
constexpr int kFastTile = 5;
constexpr int kFastQuads(int) { return 1; }
// One x row (qmm_fast.h), 0.5.25: a quad's 4 rows side by side (quad_sums,
// below: a pair of blocks at a time, to fit in 16 registers) for rows of at
// least 1 KB, each step asking for its share of the quad 128 KB ahead into
// L2 (none into L1) and the first for that quad's float16 scales and biases;
// shorter rows one after another, as before. Llama-3.2-1B's shape, split, 2
// threads, weights streamed from memory: 0.5.24's build and this one in
// turns, three rounds (ms a call): gate/up 16384 x 2048 0.94-1.67 ->
// 0.85-1.35, down 2048 x 8192 0.61-0.74 -> 0.49-0.52, q/k/v 3072 x 2048
// 0.21-0.27 -> 0.19-0.23; at 8 bits gate/up 1.57-1.83 -> 1.29-1.63, down
// 0.86-0.98 -> 0.64-0.71. Settings interleaved in one process (medians of
// 40 rounds): side by side with VNNI's prefetches (8 quads ahead into L2,
// 2 into L1) about as fast as a row after another (gate/up 1.08 against
// 1.06, down 0.75 against 0.79); side by side without prefetches much
// slower (gate/up 1.65 against 1.28, q/k/v 0.30 against 0.23); 64-96 KB
// ahead slower than 128, 192-256 KB a little slower; asking for the scales
// and biases too: gate/up 0.95 -> 0.91, down 0.59 -> 0.55. SmolLM2's rows
// (K = 576, 1536) side by side, 16-128 KB ahead: gate/up 3072 x 576 slower
// (0.079-0.083 against 0.076), down 576 x 1536 alike; a row after another
// with these prefetches no faster at any shape. 128 KB is two of qmm.cpp's
// 64 KB chunks: with 2 threads claiming chunks in turns, about where the
// thread's own next chunk starts (other thread counts not measured: with
// more, part of what is asked for may be another core's chunk).
constexpr int kSideRowBytes = 1024;
constexpr bool kPipeQuads = true;  // shorter rows' quads pipelined (qmm_fast.h's pipelined_quads)
constexpr Ahead ask_ahead(size_t quad_bytes) { return ahead_128k(quad_bytes); }
inline __m256i load_pair(const uint8_t* p0, const uint8_t* p1) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
}
inline __m256i loadu256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
struct WR {
  __m256i a[2], b[2];  // halves A, B of blocks 0-1 ([0]) and 2-3 ([1]); 8 bits: their low nibbles
  __m256i a_hi[2], b_hi[2];  // 8 bits: the high nibbles
};
// Blocks 2 h and 2 h + 1 of a row's step, unpacked (WR's vectors [h]).
struct WR2 {
  __m256i a, b;        // halves A, B of the two blocks; 8 bits: their low nibbles
  __m256i a_hi, b_hi;  // 8 bits: the high nibbles
};
// Blocks 2 h, 2 h + 1 of the step at p, from q = p + 8 BITS h (its bytes of them).
template <int BITS>
inline WR2 unpack_half(const uint8_t* q) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  if constexpr (BITS == 4) {
    const __m256i v = loadu256(q);
    const __m256i z = _mm256_setzero_si256();  // no high nibbles (never read)
    return {_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m), z, z};
  } else if constexpr (narrow_bits(BITS)) {  // as 4 bits, each byte's high bits or-ed in
    const __m256i v = load_pair(q, q + 4 * BITS), z = _mm256_setzero_si256();
    __m256i a, b;
    high_bits<BITS>(high_pair<BITS>(q), a, b);
    return {_mm256_or_si256(_mm256_and_si256(v, m), a), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m), b),
            z, z};
  } else {
    const __m256i a = load_pair(q, q + 32), b = load_pair(q + 16, q + 48);
    return {_mm256_and_si256(a, m), _mm256_and_si256(b, m), _mm256_and_si256(_mm256_srli_epi16(a, 4), m),
            _mm256_and_si256(_mm256_srli_epi16(b, 4), m)};
  }
}
template <int BITS>
inline WR unpack4(const uint8_t* p) {
  WR w;
  for (int h = 0; h < 2; ++h) {
    const WR2 u = unpack_half<BITS>(p + 8 * BITS * h);
    w.a[h] = u.a, w.b[h] = u.b, w.a_hi[h] = u.a_hi, w.b_hi[h] = u.b_hi;
  }
  return w;
}
// The first n < 4 blocks, zeros for the rest, each 16 bytes loaded only if
// its block is (was a copy into a buffer, which store forwarding could not
// serve to unpack4's 32-byte loads).
// load_pair(p + lo, p + hi) of a row's first `bytes` (a multiple of 16), zeros past them, reading only those.
inline __m256i load_pair_n(const uint8_t* p, int bytes, int lo, int hi) {
  const auto part = [&](int at) {
    return at < bytes ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)) : _mm_setzero_si128();
  };
  return _mm256_inserti128_si256(_mm256_castsi128_si256(part(lo)), part(hi), 1);
}
template <int BITS>
inline WR unpack4_n(const uint8_t* p, int n) {
  const int bytes = n * kBlock * BITS / 8;
  const auto two = [&](int lo, int hi) { return load_pair_n(p, bytes, lo, hi); };
  const __m256i m = _mm256_set1_epi8(0x0f);
  WR w;
  for (int h = 0; h < 2; ++h) {
    if constexpr (BITS == 4) {
      const __m256i v = two(32 * h, 32 * h + 16);
      w.a[h] = _mm256_and_si256(v, m), w.b[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    } else if constexpr (narrow_bits(BITS)) {  // blocks 2 h, 2 h + 1 at 8 BITS h, 8 BITS h + 4 BITS, each read only if it is one of the n
      const auto word = [&](int blk) { return blk < n ? high_word<BITS>(p + 4 * BITS * blk) : _mm_setzero_si128(); };
      const __m256i v = two(8 * BITS * h, 8 * BITS * h + 4 * BITS);
      __m256i a, b;
      high_bits<BITS>(_mm256_set_m128i(word(2 * h + 1), word(2 * h)), a, b);
      w.a[h] = _mm256_or_si256(_mm256_and_si256(v, m), a);
      w.b[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m), b);
      w.a_hi[h] = w.b_hi[h] = _mm256_setzero_si256();
    } else {  // as unpack4's load_pair(q, q + 32) and (q + 16, q + 48)
      const __m256i a = two(64 * h, 64 * h + 32), b = two(64 * h + 16, 64 * h + 48);
      w.a[h] = _mm256_and_si256(a, m), w.b[h] = _mm256_and_si256(b, m);
      w.a_hi[h] = _mm256_and_si256(_mm256_srli_epi16(a, 4), m), w.b_hi[h] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    }
  }
  return w;
}
struct P {
  __m256i v[2];
};
template <int BITS>
inline P dot4(const WR& w, const int8_t* x) {
  P r;
  for (int h = 0; h < 2; ++h) {
    const __m256i xa = loadu256(x + 32 * h), xb = loadu256(x + 64 + 32 * h);
    const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w.a[h], xa), _mm256_maddubs_epi16(w.b[h], xb));
    if constexpr (BITS != 8) {  // 4 and 5 bits: |lo| <= 4 * 31 * 127
      r.v[h] = _mm256_madd_epi16(lo, _mm256_set1_epi16(1));
    } else {
      const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w.a_hi[h], xa), _mm256_maddubs_epi16(w.b_hi[h], xb));
      r.v[h] = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi16(1)), _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
    }
  }
  return r;
}
// The split contract's sums: 128 * (x's int8 part's) + (its remainder's, lo
// bytes on), lane by lane (exact in int32).
// 4 bits (8 bits: dot_s, below): each part's 16-bit pair sums (|.| <= 2 * 2
// * 15 * 127) widened by madd with 128 and with 1, no shift.
inline __m256i split_pairs(__m256i a, __m256i b, const int8_t* x, size_t lo) {
  const auto pairs = [&](const int8_t* q) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(a, loadu256(q)), _mm256_maddubs_epi16(b, loadu256(q + 64)));
  };
  return _mm256_add_epi32(_mm256_madd_epi16(pairs(x), _mm256_set1_epi16(128)),
                          _mm256_madd_epi16(pairs(x + lo), _mm256_set1_epi16(1)));
}
template <int BITS>
inline P dot4_split(const WR& w, const int8_t* x, size_t lo) {
  static_assert(BITS != 8, "the split contract at 8 bits runs dot_s");
  return {split_pairs(w.a[0], w.b[0], x, lo), split_pairs(w.a[1], w.b[1], x + 32, lo)};
}
// In each 128-bit lane, 4 vectors' 4 partial sums a block -> lane i: vector i's sum.
inline __m256i transpose_sum(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
  const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}
struct QS {
  __m256i v[2];
};
inline QS reduce_quad(const P& p0, const P& p1, const P& p2, const P& p3) {
  return {transpose_sum(p0.v[0], p1.v[0], p2.v[0], p3.v[0]), transpose_sum(p0.v[1], p1.v[1], p2.v[1], p3.v[1])};
}
struct FQ {
  __m256 v[2];
};
inline FQ fq_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline FQ fq_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline FQ fq_gather4(const float* r0, const float* r1, const float* r2, const float* r3) {
  __m128 c0 = _mm_loadu_ps(r0), c1 = _mm_loadu_ps(r1), c2 = _mm_loadu_ps(r2), c3 = _mm_loadu_ps(r3);
  _MM_TRANSPOSE4_PS(c0, c1, c2, c3);  // c_j = [r0[j], r1[j], r2[j], r3[j]]
  return {_mm256_set_m128(c1, c0), _mm256_set_m128(c3, c2)};
}
inline FQ fq_gather4_n(const float* r0, const float* r1, const float* r2, const float* r3, int n) {
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3));
  __m128 c0 = _mm_maskload_ps(r0, m), c1 = _mm_maskload_ps(r1, m), c2 = _mm_maskload_ps(r2, m), c3 = _mm_maskload_ps(r3, m);
  _MM_TRANSPOSE4_PS(c0, c1, c2, c3);
  return {_mm256_set_m128(c1, c0), _mm256_set_m128(c3, c2)};
}
inline __m128 halves4(const uint16_t* r) { return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r))); }
inline FQ fq_gather4(const uint16_t* r0, const uint16_t* r1, const uint16_t* r2, const uint16_t* r3) {
  __m128 c0 = halves4(r0), c1 = halves4(r1), c2 = halves4(r2), c3 = halves4(r3);
  _MM_TRANSPOSE4_PS(c0, c1, c2, c3);
  return {_mm256_set_m128(c1, c0), _mm256_set_m128(c3, c2)};
}
// A row's first n < 4 float16 values, zeros after, by scalar loads of only
// those (a copy through memory, which store forwarding could not serve to
// halves4's 8-byte load).
inline __m128 halves_n(const uint16_t* r, int n) {
  int32_t lo = r[0];
  if (n >= 2) std::memcpy(&lo, r, sizeof lo);
  __m128i v = _mm_cvtsi32_si128(lo);
  if (n == 3) v = _mm_insert_epi16(v, r[2], 2);
  return _mm_cvtph_ps(v);
}
inline FQ fq_gather4_n(const uint16_t* r0, const uint16_t* r1, const uint16_t* r2, const uint16_t* r3, int n) {
  __m128 c0 = halves_n(r0, n), c1 = halves_n(r1, n), c2 = halves_n(r2, n), c3 = halves_n(r3, n);
  _MM_TRANSPOSE4_PS(c0, c1, c2, c3);
  return {_mm256_set_m128(c1, c0), _mm256_set_m128(c3, c2)};
}
inline FQ fq_mul(FQ a, const FQ& b) { return {_mm256_mul_ps(a.v[0], b.v[0]), _mm256_mul_ps(a.v[1], b.v[1])}; }
inline FQ fq_fma(const FQ& a, const FQ& b, const FQ& c) {
  return {_mm256_fmadd_ps(a.v[0], b.v[0], c.v[0]), _mm256_fmadd_ps(a.v[1], b.v[1], c.v[1])};
}
inline FQ fq_fma_sums(const QS& s, const FQ& d, const FQ& a) {
  return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(s.v[0]), d.v[0], a.v[0]),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(s.v[1]), d.v[1], a.v[1])};
}
inline void fq_rows(const FQ& a, float* out) {
  const __m128 l01 = _mm_add_ps(_mm256_castps256_ps128(a.v[0]), _mm256_extractf128_ps(a.v[0], 1));
  const __m128 l23 = _mm_add_ps(_mm256_castps256_ps128(a.v[1]), _mm256_extractf128_ps(a.v[1], 1));
  _mm_storeu_ps(out, _mm_add_ps(l01, l23));
}
// A row's last step of at most 2 blocks (qmm_fast.h's fast_half_step): the
// vectors [0] of the above alone (blocks 0 and 1), the accumulators' [1] left
// as they are. Every tile (AVX2 forced, qmm.py in turns: faster at 1 and 5 rows).
#define QMM_HALF_TAIL 1
constexpr bool half_tail(int, int) { return true; }
template <int BITS>
inline WR2 unpack2_n(const uint8_t* p, int n) {  // n <= 2 blocks, reads only those
  const WR w = unpack4_n<BITS>(p, n);              // its vectors [1] are zeros, never read
  return {w.a[0], w.b[0], w.a_hi[0], w.b_hi[0]};
}
template <int BITS, bool SPLIT>
inline __m256i dotx2(const WR2& w, const int8_t* x, size_t lo) {
  const auto dot = [&](const int8_t* q) {
    const __m256i xa = loadu256(q), xb = loadu256(q + 64);
    const __m256i l = _mm256_add_epi16(_mm256_maddubs_epi16(w.a, xa), _mm256_maddubs_epi16(w.b, xb));
    if constexpr (BITS != 8) {
      return _mm256_madd_epi16(l, _mm256_set1_epi16(1));
    } else {
      const __m256i h = _mm256_add_epi16(_mm256_maddubs_epi16(w.a_hi, xa), _mm256_maddubs_epi16(w.b_hi, xb));
      return _mm256_add_epi32(_mm256_madd_epi16(l, _mm256_set1_epi16(1)), _mm256_madd_epi16(h, _mm256_set1_epi16(16)));
    }
  };
  if constexpr (SPLIT) {
    static_assert(BITS != 8, "the split contract at 8 bits runs dot_pair16");
    return split_pairs(w.a, w.b, x, lo);
  } else {
    return dot(x);
  }
}
using QS2 = __m256i;
inline QS2 reduce_quad2(__m256i p0, __m256i p1, __m256i p2, __m256i p3) { return transpose_sum(p0, p1, p2, p3); }
inline P p_from_half(__m256i v) { return {v, _mm256_setzero_si256()}; }  // blocks 2, 3: zero sums
inline FQ fq_fma_sums2(QS2 s, const FQ& d, const FQ& a) {
  return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d.v[0], a.v[0]), a.v[1]};
}
// The split contract with 8-bit weights in 16-bit lanes (qmm_fast.h's
// QMM_SPLIT16): x as one integer a weight, 128 xq + xr (|.| <= 16320), by
// madd (16-bit products, pairs summed in 32 bits: no saturation for weights
// < 256); per 64 weights and x row 4 multiplies, against 12 for maddubs on
// each nibble of the weights, twice. (4 bits stay on maddubs: unpacking
// nibbles to 16-bit lanes costs more than the multiplies it saves, measured;
// at 4-8 x rows too, where the widening of a quad's pair is shared by all
// of them: 0.88-0.95x per call and per bucket-4/8 step, docs/design.md.)
// WS.v[h][c]: blocks 2 h, 2 h + 1 (its 128-bit lanes), lane j weight 8 c + j;
// x (split16_x) in that order: a step's blocks 0, 1 at x (the int8 part's
// place, 128 bytes), blocks 2, 3 at x + lo (the remainder's), vector c of
// each at 32 c bytes.
#define QMM_SPLIT16 1
struct WS {
  __m256i v[2][4];
};
struct WS2 {
  __m256i v[4];
};
// One pair of blocks' 16-bit weights from their first (a) and last (b) 16 bytes each, side by side.
inline void ws_pair(__m256i a, __m256i b, __m256i* o) {
  const __m256i z = _mm256_setzero_si256();
  o[0] = _mm256_unpacklo_epi8(a, z), o[1] = _mm256_unpackhi_epi8(a, z);
  o[2] = _mm256_unpacklo_epi8(b, z), o[3] = _mm256_unpackhi_epi8(b, z);
}
// Blocks 2 h, 2 h + 1 of a step (their 64 bytes at q = p + 64 h) in 16-bit lanes: WS.v[h].
inline void ws_half(const uint8_t* q, __m256i* o) { ws_pair(load_pair(q, q + 32), load_pair(q + 16, q + 48), o); }
inline WS unpack_s(const uint8_t* p) {
  WS w;
  for (int h = 0; h < 2; ++h) ws_half(p + 64 * h, w.v[h]);
  return w;
}
// The first n < 4 blocks, zeros for the rest, reading only those (as unpack4_n).
inline WS unpack_s_n(const uint8_t* p, int n) {
  const auto two = [&](int lo, int hi) { return load_pair_n(p, n * kBlock, lo, hi); };
  WS w;
  for (int h = 0; h < 2; ++h) ws_pair(two(64 * h, 64 * h + 32), two(64 * h + 16, 64 * h + 48), w.v[h]);
  return w;
}
// One pair of blocks' 4 partial sums each (128-bit lanes), x's 4 vectors at q.
inline __m256i dot_pair16(const __m256i* w, const int8_t* q) {
  const auto m = [&](int c) { return _mm256_madd_epi16(w[c], loadu256(q + 32 * c)); };
  return _mm256_add_epi32(_mm256_add_epi32(m(0), m(1)), _mm256_add_epi32(m(2), m(3)));
}
inline P dot_s(const WS& w, const int8_t* x, size_t lo) { return {dot_pair16(w.v[0], x), dot_pair16(w.v[1], x + lo)}; }
inline WS2 unpack_s2_n(const uint8_t* p, int n) {  // n <= 2 blocks
  const WS w = unpack_s_n(p, n);
  return {{w.v[0][0], w.v[0][1], w.v[0][2], w.v[0][3]}};
}
// One x row's full step of a quad (qmm_fast.h's QMM_QUAD_SUMS): its 4 rows
// side by side a pair of blocks at a time, x's vectors of the pair loaded
// once for the 4 rows, a row's unpacked pair (2 registers at 4 bits, 4 at 8)
// used at once, the 4 rows' partial sums transposed together: reduce_quad
// of the 4 rows' dot(full), the same integers, in 16 registers, without
// the partial sums of the rows one after another waiting in memory.
#define QMM_QUAD_SUMS 1
template <int BITS, bool SPLIT>
inline QS quad_sums(const uint8_t* const (&w)[4], size_t at, const int8_t* x, size_t lo) {  // kStep rows
  QS r;
  for (int h = 0; h < 2; ++h) {
    const auto row = [&](int i) {
      const uint8_t* q = w[i] + at + 8 * BITS * h;
      if constexpr (BITS == 8 && SPLIT) {
        __m256i o[4];
        ws_half(q, o);
        return dot_pair16(o, x + h * lo);
      } else {
        return dotx2<BITS, SPLIT>(unpack_half<BITS>(q), x + 32 * h, lo);
      }
    };
    r.v[h] = transpose_sum(row(0), row(1), row(2), row(3));
  }
  return r;
}
// Several x rows' full step of a quad (qmm_fast.h's QMM_QUAD_ROWS), where
// quad_rows_for(BITS, SPLIT, MT); in 0.5.27 the split contract's 8-bit
// weights (the output head of GGUF's Q4_1 files, Q8_0) at 2-4 x rows, since
// 0.5.37 every tile of 2-5 rows but the fast contract's 8 bits. A pair of blocks of
// the 4 rows in 16-bit lanes (ws_half: 4 registers a row) once, then for
// each x row its 4 rows' sums of the pair, transposed and scaled into that
// half of its accumulator (blocks 0-1: v[0], 2-3: v[1]) — fast_step's
// integers and its operations a lane, a pair of blocks at a time, not the
// whole step's 4 rows at once (32 registers, which the compiler spilled).
// 0.5.27, one thread, in L2/L3, built as the module is (-fPIC), the better
// of 3 interleaved runs' medians, us a call: SmolLM2's head 49152 x 576 at
// 4 rows 4413 -> 3688 (another run: 4452 -> 4147; 3072 x 576 at 2 / 3 / 4
// rows: 150 / 192 / 258 -> 141 / 189 / 220). Not at 5 rows (5106 against
// 5221), nor at 4 bits (the same order there, 2-5 rows: -5 % .. +3 %; at
// exactly 4 rows -2 .. -6 % over SmolLM2's shapes, not checked in the
// module), nor in the fast contract, which `auto` does not pick (8 bits:
// 4 rows 7 % slower, 5 rows 17 % faster).
// 0.5.37: every tile of 2-5 x rows of 4-, 5- and 6-bit weights (both
// contracts: a pair of blocks' halves A and B, 2 registers a row, times x's
// int8 bytes) and of 8-bit ones under the split contract (5 rows too), where
// fast_step unpacked the whole step's 4 rows (16 registers at 4 bits, 32 at
// 8) beside up to 10 accumulators and spilled. Both orders in one process,
// in turns (a scratch switch; the same bits), medians of 9 rounds of 8
// calls, SmolLM2's shapes (load 0.8-1.6), old / new time a call: 4 bits,
// split, one thread, M = 2-16: 0.98-1.14x (5 rows: gate/up 1.05, down 1.14,
// q/k/v 1.05), two threads 0.94-1.14x, fast 0.99-1.09x, Llama-3.2-1B's
// gate/up 0.96-1.16x; 8 bits, split, 5 rows: the head (49152 x 576) 1.27x
// on one thread, 1.15x on two, gate/up, down, q/k/v 1.05-1.20x; 5 bits
// 0.96-1.13x (2 rows 1.11-1.13x), 6 bits at 5 rows 0.98-1.08x. (0.5.27's
// figures above were of the code then.)
// 0.5.38: a row's last step of exactly 2 blocks (K = 576: SmolLM2's q/k/v,
// o, gate/up and head) runs as a full step's first pair (quad_pair), whose
// loads read just those blocks, not fast_half_step's (each 16 bytes and
// scale behind a check of its block): the same operations, the same bits.
// A standalone driver of the AVX2 unit (fast_rows on one thread, the two
// ways in alternating rounds, medians, load ~1), old / new us a call:
// 3072 x 576 at 5 rows 366 / 336 and 246 / 239, 8 rows 623 / 566, 13 rows
// 1208 / 1121; 960 x 576 at 5 rows 82 / 74; 576 x 576 at 5 rows 49 / 44;
// the 8-bit head 49152 x 576 at 5 rows 6369 / 5718 and 8350 / 7495; 5 bits
// at 2 rows 95 / 75, 6 bits at 4 rows 149 / 130.
#define QMM_QUAD_ROWS 1
constexpr bool quad_rows_for(int bits, bool split, int) { return bits != 8 || split; }
// Each of MT x rows' sums of one pair of blocks of the 4 rows (dot(i, x
// row's place): row i's), transposed together and scaled into half h of its
// accumulator.
template <int MT, class Dot>
[[gnu::always_inline]] inline void pair_into(int h, const int8_t* x, size_t ldq, const FQ& sq, const float* xd,
                                             size_t ldd, FQ (&acc)[MT], Dot dot) {
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const int8_t* xm = x + m * ldq;
    const __m256i sums = transpose_sum(dot(0, xm), dot(1, xm), dot(2, xm), dot(3, xm));
    const __m256 d = _mm256_mul_ps(sq.v[h], _mm256_loadu_ps(xd + m * ldd + 8 * h));
    acc[m].v[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc[m].v[h]);
  }
}
// Pair h (blocks 2 h, 2 h + 1) of a quad's step at `at` into half h of MT
// x rows' accumulators; its loads read those two blocks' bytes alone.
template <int BITS, bool SPLIT, int MT>
[[gnu::always_inline]] inline void quad_pair(int h, const uint8_t* const (&w)[4], size_t at, const int8_t* x, size_t ldq,
                                             size_t lo, const FQ& sq, const float* xd, size_t ldd, FQ (&acc)[MT]) {
  static_assert(quad_rows_for(BITS, SPLIT, MT));
  if constexpr (BITS != 8) {  // halves A, B of the pair (unpack_half, 4-6 bits) times x's int8 bytes (dotx2)
    WR2 u[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) u[i] = unpack_half<BITS>(w[i] + at + 8 * BITS * h);
    pair_into<MT>(h, x + 32 * h, ldq, sq, xd, ldd, acc,
                  [&](int i, const int8_t* xm) { return dotx2<BITS, SPLIT>(u[i], xm, lo); });
  } else {  // 16-bit lanes (ws_half) times split16_x's integers
    __m256i u[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) ws_half(w[i] + at + 64 * h, u[i]);
    pair_into<MT>(h, x + h * lo, ldq, sq, xd, ldd, acc, [&](int i, const int8_t* xm) { return dot_pair16(u[i], xm); });
  }
}
template <int BITS, bool SPLIT, int MT>
inline void quad_rows(const uint8_t* const (&w)[4], size_t at, const int8_t* x, size_t ldq, size_t lo, const FQ& sq,
                      const float* xd, size_t ldd, FQ (&acc)[MT]) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) quad_pair<BITS, SPLIT, MT>(h, w, at, x, ldq, lo, sq, xd, ldd, acc);
}
// quantize_x_rows' block of 32 on vectors (QMM_X_BLOCK, 0.5.37): the same
// operations a value — the max of |x|'s bits, (x * inv + 1.5 * 2^23) -
// 1.5 * 2^23 unfused, the remainder's one fused multiply-add — so the same
// bytes, sums and scales as the plain loops, which a finite block no longer
// takes (they ran a value at a time: ~1 ms of a bucket-1 verify window of 5,
// on the caller alone while the pool's worker waited). Its int8 part to q,
// the split contract's remainder to r (where not null), each in the place's
// order (even_odd: the even-numbered weights at q[0..15], the odd ones at
// q[64..79]; else weights 0-15, then 16-31); d and sum as the loops leave
// them. A block with an infinity or NaN (the loops' NaN), or whose 127 /
// max |x| overflows (max |x| < 3.7e-37: the loops' conversions of
// infinities), returns false: the loops take it, as before.
#define QMM_X_BLOCK 1
// 8 int32 lanes each of a, b, c, d (within int8) as 32 bytes in that order.
inline __m256i bytes32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i v = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // dwords a0-3 b0-3 c0-3 d0-3 a4-7 ...
}
inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
// 32 integers (4 vectors, weights 8 i .. 8 i + 7 in vector i) into a block's place; their sum.
inline int place32(const __m256i (&v)[4], bool even_odd, int8_t* q) {
  __m256i b = bytes32(v[0], v[1], v[2], v[3]);
  if (even_odd) {  // each 128-bit lane's even bytes, then its odd ones; then the lanes' evens together
    const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, eo), _MM_SHUFFLE(3, 1, 2, 0));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(b));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 64), _mm256_extracti128_si256(b, 1));
  return hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
}
inline bool x_block(const float* x, bool even_odd, int8_t* q, int8_t* r, float& d, int& sum) {
  __m256 v[4];
  __m256i a = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    a = _mm256_max_epu32(a, _mm256_and_si256(_mm256_castps_si256(v[i]), _mm256_set1_epi32(0x7fffffff)));
  }
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
  const uint32_t abits = uint32_t(_mm_cvtsi128_si32(h));
  if (abits >= 0x7f800000u) return false;
  const float amax = std::bit_cast<float>(abits), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  if (!(inv <= std::numeric_limits<float>::max())) return false;  // max |x| < 127 / FLT_MAX: as the loops do
  d = amax / 127.0f;
  const __m256 round = _mm256_set1_ps(12582912.0f);
  const auto rounded = [&](__m256 y, float k) {  // (y * k + round) - round: an integer
    return _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(k)), round), round);
  };
  __m256 qf[4];
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qf[i] = rounded(v[i], inv), qi[i] = _mm256_cvtps_epi32(qf[i]);
  sum = place32(qi, even_odd, q);
  if (r != nullptr) {
    __m256i ri[4];
    for (int i = 0; i < 4; ++i) ri[i] = _mm256_cvtps_epi32(rounded(_mm256_fnmadd_ps(_mm256_set1_ps(d), qf[i], v[i]), inv * 128.0f));
    sum = 128 * sum + place32(ri, even_odd, r);
    d *= 0x1p-7f;
  }
  return true;
}
#include "qmm_isa.h"
#include "qmm_fast.h"
#undef QMM_HALF_TAIL
#undef QMM_SPLIT16
#undef QMM_QUAD_SUMS
#undef QMM_QUAD_ROWS
#undef QMM_X_BLOCK
// The split contract's x (quantize_x_rows' two int8 rows an x row) relaid
// in place for dot_s where the weights have 8 bits (4 bits: read as
// written): each step's 256 bytes (its 128 weights' int8 part and
// remainder) become its 128 integers 128 xq + xr in 16 bits, in WS's order.
void split16_x(const QmmJob& j, int8_t* xq) {
  if (j.bits != 8) return;
  const size_t lo = size_t(fast_blocks(j.K)) * kBlock;
  for (int m = 0; m < j.M; ++m) {
    int8_t* hi = xq + 2 * size_t(m) * lo;
    for (size_t at = 0; at < lo; at += kStep * kBlock) {
      int16_t out[2][4][16];  // [h][c][lane]: block 2 h + lane / 8, weight 8 c + lane % 8
      for (int h = 0; h < 2; ++h) {
        for (int c = 0; c < 4; ++c) {
          for (int l = 0; l < 16; ++l) {
            // quantize_x_rows' layout at 8 bits: weights 0-15 of the 4 blocks (16 bytes each), then 16-31
            const int blk = 2 * h + l / 8, i = 8 * c + l % 8;
            const size_t b = at + 64 * (i / 16) + 16 * blk + i % 16;
            out[h][c][l] = int16_t(128 * hi[b] + hi[lo + b]);
          }
        }
      }
      std::memcpy(hi + at, out[0], sizeof out[0]);
      std::memcpy(hi + lo + at, out[1], sizeof out[1]);
    }
  }
}
// The factored contract (qmm_factored.h), AVX-512 CPUs' too.
using FF = __m256;
inline FF ff_zero() { return _mm256_setzero_ps(); }
inline FF ff_splat(float a) { return _mm256_set1_ps(a); }
inline FF ff_load(const float* p) { return _mm256_loadu_ps(p); }
inline FF ff_add(FF a, FF b) { return _mm256_add_ps(a, b); }
inline FF ff_mul(FF a, FF b) { return _mm256_mul_ps(a, b); }
inline FF ff_fma(FF a, FF b, FF c) { return _mm256_fmadd_ps(a, b, c); }
inline float ff_hsum(FF a) { return hsum(a); }
// 4 bits: each 32-bit lane of the block's 16 bytes (both halves of a vector)
// masked, not shifted, to the nibble's place: lanes 0-3 of vector j hold
// word l's nibble j (j = 2, 3: times 2^8), lanes 4-7 its nibble j + 4 (times
// 2^16, or 2^24) — one shift of the whole block for the odd nibbles, an and
// and a conversion a vector (with shifts, 15.6 against 18.0 G weights/s in a
// scratch benchmark of one thread, a 4-bit matvec in cache).
template <int BITS>
inline void ff_qvals(const uint8_t* p, FF* w) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i v4 = _mm256_srli_epi32(v, 4);
    const __m256i m0 = _mm256_setr_epi32(0xf, 0xf, 0xf, 0xf, 0xf0000, 0xf0000, 0xf0000, 0xf0000);
    const __m256i m8 = _mm256_slli_epi32(m0, 8);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, m0));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v4, m0));
    w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(v, m8));
    w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(v4, m8));
  } else if constexpr (narrow_bits(BITS)) {  // the natural order, as 8 bits
    __m256i q[4];
    natural_lanes<BITS>(p, q);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtepi32_ps(q[i]);
  } else {
    for (int i = 0; i < 4; ++i) w[i] = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
  }
}
#include "qmm_factored.h"
}  // namespace isa_avx2
#pragma GCC pop_options
#endif  // QMM_UNIT_AVX2

#if QMM_UNIT_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace isa_avx512 {
constexpr int L = 16, kTile = 8;
constexpr bool kNarrowBits = true;  // 5- and 6-bit blocks (qmm.cpp's layouts)
inline void order4(const float* from, float* to) { order4_even_odd(from, to); }
// Two accumulators per (row, x row) at every tile size (the same sums at every M):
// tiles of more x rows take fewer weight rows (at most 16 accumulators).
constexpr int kRows(int mt) { return mt <= 2 ? 4 : mt <= 4 ? 2 : 1; }
constexpr int kAcc(int) { return 2; }
QMM_X86_OPS(__m512, _mm512)
inline float hsum(F a) { return _mm512_reduce_add_ps(a); }
#define QMM_NARROW_512 1
#include "qmm_narrow_x86.h"
#undef QMM_NARROW_512
// 4 bits: `a` holds the group's 16 possible weights (scale * q + bias for q = 0..15), looked
// up by each nibble; 8 bits: scale and bias.
struct Group {
  F a, b;
};
template <int BITS, bool X = false>
inline Group group(float s, float b) {
  if constexpr (BITS == 4) {
    const F q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {X ? _mm512_fmadd_ps(q, splat(s), splat(b)) : _mm512_add_ps(_mm512_mul_ps(q, splat(s)), splat(b)),
            splat(0.0f)};
  }
  return {splat(s), splat(b)};
}
template <int BITS, bool X = false>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  if constexpr (BITS == 4) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[0] = _mm512_permutexvar_ps(q, g.a);  // vpermps reads an index's low 4 bits: the low nibble
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), g.a);
  } else if constexpr (narrow_bits(BITS)) {  // the natural order, as 8 bits
    __m128i q[2];
    natural<BITS>(p, q[0], q[1]);
    for (int i = 0; i < 2; ++i) {
      const F v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[i]));
      w[i] = X ? _mm512_fmadd_ps(v, g.a, g.b) : _mm512_add_ps(_mm512_mul_ps(v, g.a), g.b);
    }
  } else {
    for (int i = 0; i < 2; ++i) {
      const F q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
      w[i] = X ? _mm512_fmadd_ps(q, g.a, g.b) : _mm512_add_ps(_mm512_mul_ps(q, g.a), g.b);
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
constexpr int kFastTile = 8;
constexpr int kFastQuads(int) { return 1; }
// One x row: a quad's 4 rows side by side, a step at a time, at every K
// (qmm_fast.h). Quads of rows under 1 KB ask for the quad 8 ahead into L2
// and the one 2 ahead into L1 (0.5.20); longer rows, as AVX2's (0.5.32):
// 128 KB ahead into L2, none into L1, and the far quad's float16 scales and
// biases. Measured on the 2-core Zen 4 (python benchmarks/qmm.py --model
// llama-1b --bits B --contract split --no-reference --m 1 --chain 4, the
// settings switched by environment variables in a scratch build, in turns,
// three rounds, medians, ms a call): 4 bits gate/up 16384 x 2048 1.154 ->
// 0.785, down 2048 x 8192 0.740 -> 0.477, q/k/v 0.219 -> 0.180; 8 bits
// 1.597 -> 1.451, 0.988 -> 0.682; 6 bits (AVX2's settings for every row,
// an earlier round) 1.216 -> 0.961, 0.827 -> 0.605. SmolLM2's rows under
// 1 KB asked 128 KB ahead too were slower (q/k/v 960 x 576 at 4 bits 0.038
// -> 0.067, gate/up 0.068 -> 0.102): that is where the first scheme stays.
constexpr int kSideRowBytes = 0;
constexpr bool kPipeQuads = false;  // (no row read after another)
constexpr Ahead ask_ahead(size_t quad_bytes) {
  return quad_bytes >= 4096 ? ahead_128k(quad_bytes) : Ahead{8, 2, false};
}
struct WR {
  __m512i a, b;  // halves A and B of the 4 blocks
};
// 5 and 6 bits (qmm.cpp's layouts, 4 BITS bytes a block: its 16 bytes of
// nibbles, then its high bits): a step's 4 blocks, v0 their first 64 bytes
// and v1 the rest (16 or 32), as 4 bits' halves with each weight's high
// bits or-ed in. Every block starts on a 32-bit word (5 bits) or a 64-bit
// one (6 bits), so one two-source permute puts block j's nibbles in 128-bit
// lane j and another its high bits where fifth_bits / sixth_bits want them
// (its 32-bit word in the lane's 4 dwords; its 8 bytes in both qwords).
template <int BITS>
inline WR narrow4(__m512i v0, __m512i v1) {
  __m512i nib, high;
  if constexpr (BITS == 5) {  // dwords: block j's nibbles 5 j .. 5 j + 3, its word 5 j + 4 (16 on: v1's)
    nib = _mm512_permutex2var_epi32(v0, _mm512_setr_epi32(0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17, 18), v1);
    high = _mm512_permutex2var_epi32(v0, _mm512_setr_epi32(4, 4, 4, 4, 9, 9, 9, 9, 14, 14, 14, 14, 19, 19, 19, 19), v1);
  } else {  // qwords: block j's nibbles 3 j, 3 j + 1, its plane 3 j + 2 (8 on: v1's)
    nib = _mm512_permutex2var_epi64(v0, _mm512_setr_epi64(0, 1, 3, 4, 6, 7, 9, 10), v1);
    high = _mm512_permutex2var_epi64(v0, _mm512_setr_epi64(2, 2, 5, 5, 8, 8, 11, 11), v1);
  }
  __m512i a, b;
  high_bits<BITS>(high, a, b);
  const __m512i m = _mm512_set1_epi8(0x0f);
  return {_mm512_or_si512(_mm512_and_si512(nib, m), a), _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib, 4), m), b)};
}
template <int BITS>
inline WR unpack4(const uint8_t* p) {
  if constexpr (narrow_bits(BITS)) {
    const __m512i v1 = BITS == 5 ? _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)))
                                 : _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)));
    return narrow4<BITS>(_mm512_loadu_si512(p), v1);
  } else if constexpr (BITS == 4) {
    // two 32-byte loads (one 64-byte load a row and step streamed slower, measured)
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1);
    const __m512i m = _mm512_set1_epi8(0x0f);
    return {_mm512_and_si512(v, m), _mm512_and_si512(_mm512_srli_epi16(v, 4), m)};
  } else {  // blocks 0, 1 then 2, 3: their 16-byte halves A are lanes 0 and 2 of each
    const auto two = [](const uint8_t* q) {
      return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)), 1);
    };
    const __m512i v0 = two(p), v1 = two(p + 64);
    return {_mm512_shuffle_i64x2(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i64x2(v0, v1, _MM_SHUFFLE(3, 1, 3, 1))};
  }
}
template <int BITS>
inline WR unpack4_n(const uint8_t* p, int n) {
  const int bytes = n * kBlock * BITS / 8;  // < 64 at 4 bits, < 128 at 8
  const auto mask = [](int b) { return b >= 64 ? ~__mmask64(0) : b <= 0 ? __mmask64(0) : (__mmask64(1) << b) - 1; };
  if constexpr (narrow_bits(BITS)) {  // < 80 or 96 bytes: the missing blocks' nibbles and high bits zeros
    return narrow4<BITS>(_mm512_maskz_loadu_epi8(mask(bytes), p), _mm512_maskz_loadu_epi8(mask(bytes - 64), p + 64));
  } else if constexpr (BITS == 4) {
    const __m512i v = _mm512_maskz_loadu_epi8(mask(bytes), p), m = _mm512_set1_epi8(0x0f);
    return {_mm512_and_si512(v, m), _mm512_and_si512(_mm512_srli_epi16(v, 4), m)};
  } else {
    const __m512i v0 = _mm512_maskz_loadu_epi8(mask(bytes), p), v1 = _mm512_maskz_loadu_epi8(mask(bytes - 64), p + 64);
    return {_mm512_shuffle_i64x2(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i64x2(v0, v1, _MM_SHUFFLE(3, 1, 3, 1))};
  }
}
using P = __m512i;  // 128-bit lane j: block j's 4 partial sums
template <int BITS>
inline P dot4(const WR& w, const int8_t* x) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.a, _mm512_loadu_si512(x)), w.b,
                             _mm512_loadu_si512(x + 64));
}
// The split contract's sums: the remainder's products accumulated onto 128 *
// the int8 part's (the same integers as a separate sum and an add).
template <int BITS>
inline P dot4_split(const WR& w, const int8_t* x, size_t lo) {
  const P hi = _mm512_slli_epi32(dot4<BITS>(w, x), 7);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hi, w.a, _mm512_loadu_si512(x + lo)), w.b, _mm512_loadu_si512(x + lo + 64));
}
using QS = __m512i;
inline QS reduce_quad(P p0, P p1, P p2, P p3) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}
// A row's last step of at most 2 blocks at half width (qmm_fast.h's
// fast_half_step): 128-bit lane j = block j as above, for j = 0, 1. Not for
// 8 bits at several x rows, where it measured slower (qmm.py in turns).
#define QMM_HALF_TAIL 1
constexpr bool half_tail(int bits, int mt) { return bits == 4 || mt == 1; }
struct WR2 {
  __m256i a, b;
};
template <int BITS>
inline WR2 unpack2_n(const uint8_t* p, int n) {  // n <= 2 blocks, reads only those
  const int bytes = n * kBlock * BITS / 8;  // <= 32 at 4 bits, <= 64 at 8
  if constexpr (narrow_bits(BITS)) {  // <= 40 or 48 bytes: unpack4_n's lanes 0 and 1
    const WR w = unpack4_n<BITS>(p, n);
    return {_mm512_castsi512_si256(w.a), _mm512_castsi512_si256(w.b)};
  } else if constexpr (BITS == 4) {
    const __m256i v = _mm256_maskz_loadu_epi8(bytes >= 32 ? ~__mmask32(0) : (__mmask32(1) << bytes) - 1, p),
                  m = _mm256_set1_epi8(0x0f);
    return {_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m)};
  } else {  // blocks 0, 1 as [0A 0B 1A 1B]: halves A are 128-bit lanes 0 and 2, halves B 1 and 3
    const __m512i v = _mm512_maskz_loadu_epi8(bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1, p);
    const __m512i ab = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));  // [0A 1A 0B 1B]
    return {_mm512_castsi512_si256(ab), _mm512_extracti64x4_epi64(ab, 1)};
  }
}
using P2 = __m256i;
template <int BITS>
inline P2 dot2(const WR2& w, const int8_t* x) {
  const auto ld = [](const int8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); };
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w.a, ld(x)), w.b, ld(x + 64));
}
template <int BITS, bool SPLIT>
inline P2 dotx2(const WR2& w, const int8_t* x, size_t lo) {
  if constexpr (SPLIT) {
    const auto ld = [](const int8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); };
    const P2 hi = _mm256_slli_epi32(dot2<BITS>(w, x), 7);
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(hi, w.a, ld(x + lo)), w.b, ld(x + lo + 64));
  } else {
    return dot2<BITS>(w, x);
  }
}
inline P p_from_half(P2 v) { return _mm512_zextsi256_si512(v); }  // blocks 2, 3: zero sums
using QS2 = __m256i;  // lane 4 j + i: row i's block j, j = 0, 1
inline QS2 reduce_quad2(P2 p0, P2 p1, P2 p2, P2 p3) {
  const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
  const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}
using FQ = __m512;
inline FQ fq_zero() { return _mm512_setzero_ps(); }
inline FQ fq_load(const float* p) { return _mm512_loadu_ps(p); }
inline FQ fq_gather4(const float* r0, const float* r1, const float* r2, const float* r3) {
  __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(r0));  // lane 4 i + j: r_i[j]
  v = _mm512_insertf32x4(v, _mm_loadu_ps(r1), 1);
  v = _mm512_insertf32x4(v, _mm_loadu_ps(r2), 2);
  v = _mm512_insertf32x4(v, _mm_loadu_ps(r3), 3);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}
inline FQ fq_gather4_n(const float* r0, const float* r1, const float* r2, const float* r3, int n) {
  const __mmask8 m = __mmask8((1u << n) - 1);
  __m512 v = _mm512_castps128_ps512(_mm_maskz_loadu_ps(m, r0));
  v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(m, r1), 1);
  v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(m, r2), 2);
  v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(m, r3), 3);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}
// From float16 rows: each row's 4 values loaded into a vector register (GCC
// built _mm256_setr_epi64x of 4 integers in memory, 4 stores then a 32-byte
// load that store forwarding cannot serve: ~9 % of a bucket-1 head's time).
inline FQ fq_halves4(__m128i q0, __m128i q1, __m128i q2, __m128i q3) {
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi64(q0, q1)), _mm_unpacklo_epi64(q2, q3), 1);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                               _mm512_cvtph_ps(h));  // lane 4 i + j: r_i[j], then as above
}
inline FQ fq_gather4(const uint16_t* r0, const uint16_t* r1, const uint16_t* r2, const uint16_t* r3) {
  const auto q = [](const uint16_t* r) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r)); };
  return fq_halves4(q(r0), q(r1), q(r2), q(r3));
}
// ... the first n < 4 values of each (masked loads: reads only those).
inline FQ fq_gather4_n(const uint16_t* r0, const uint16_t* r1, const uint16_t* r2, const uint16_t* r3, int n) {
  const __mmask8 m = __mmask8((1u << n) - 1);
  return fq_halves4(_mm_maskz_loadu_epi16(m, r0), _mm_maskz_loadu_epi16(m, r1), _mm_maskz_loadu_epi16(m, r2),
                    _mm_maskz_loadu_epi16(m, r3));
}
inline FQ fq_mul(FQ a, FQ b) { return _mm512_mul_ps(a, b); }
inline FQ fq_fma(FQ a, FQ b, FQ c) { return _mm512_fmadd_ps(a, b, c); }
inline FQ fq_fma_sums(QS s, FQ d, FQ a) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, a); }
// fq_fma_sums on lanes 0 .. 7 (blocks 0 and 1), the others of a as they are.
inline FQ fq_fma_sums2(QS2 s, FQ d, FQ a) {
  return _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(s)), d, a, __mmask16(0x00ff));
}
inline void fq_rows(FQ a, float* out) {
  const __m128 l0 = _mm512_castps512_ps128(a), l1 = _mm512_extractf32x4_ps(a, 1), l2 = _mm512_extractf32x4_ps(a, 2),
               l3 = _mm512_extractf32x4_ps(a, 3);
  _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(l0, l1), _mm_add_ps(l2, l3)));
}
#include "qmm_fast.h"
#undef QMM_HALF_TAIL
}  // namespace isa_avx512_vnni
#pragma GCC pop_options

void fast_avx512(const QmmJob& j, int n0, int n1) {
  static const bool vnni = has_vnni();
  vnni ? isa_avx512_vnni::fast_rows(j, n0, n1) : tracer_qmm_unit::kPathAvx2.fast(j, n0, n1);  // unit 1's
}
// The factored contract: AVX2's kernels (unit 1), the same bits on every path.
void factored_avx2(const QmmJob& j, int n0, int n1) { tracer_qmm_unit::kPathAvx2.factored(j, n0, n1); }
// The split contract's x relaid for AVX2's kernels where those run it (no VNNI).
void split_x_avx512(const QmmJob& j, int8_t* xq) {
  static const bool vnni = has_vnni();
  if (!vnni) tracer_qmm_unit::kPathAvx2.split_x(j, xq);
}
// x for the fast contract: AVX2's (unit 1), the same bytes on every path.
void quantize_x_avx2(const QmmJob& j, int8_t* xq, float* xd, float* xg) {
  tracer_qmm_unit::kPathAvx2.quantize_x(j, xq, xd, xg);
}
#endif  // QMM_UNIT_AVX512

