// The decode attention's two products on vector lanes, for keys and values
// read as stored (float32, float16 widened by F16C, bfloat16 by a shift,
// 8- and 4-bit packed blocks dequantized 16 values at a time as MLX
// dequantizes them, scale * q + bias with both operations rounded, or read
// as their integers alone for kernels.cpp's factored arithmetic): no
// widened copy of the block, one pass over its keys, one over its values. One (row, key head) block a call, R query rows against S keys of D
// (a multiple of 16, at most 256) values each, rows D apart.
//
// The arithmetic (every path, kernels.cpp's portable one too, the same bits):
//   score(r, s) = bias[r / per][s] + dot(q_r, k_s) (bias: one row of S for
//     each `per` query rows: a decode step's R rows share one, a window's
//     positions have one each), the dot in 16 lanes, lane l the
//     fused multiply-adds of d = l, l + 16, ... in order from 0, the lanes
//     summed as ((l + l+8) + (l+4 ...)) : s8[i] = l[i] + l[i+8], s4[i] =
//     s8[i] + s8[i+4], s2[i] = s4[i] + s4[i+2], s2[0] + s2[1];
//     a key whose bias is float32's lowest or -inf gets the bias itself (what
//     bias + dot rounds to for any |dot| < 2^103; four such keys in a row,
//     masked for every row, are not read);
//   out(r, d) = the fused multiply-adds p(r, s) * v(s, d) in key order from
//     0, a key skipped where p(r, s) == 0 for every row r of the block (a
//     masked key: its values not read).
// MLX's decode attention computes the same sums (mx.addmm, then the matmul
// with the probabilities) in the BLAS's order: these are equal up to
// summation order, as qmm's exact contract is (see kernels.cpp).
// Included by qmm.cpp inside its anonymous namespace, on x86-64 only.

namespace attend {
// q8i / q4i: packed blocks read as their integers (float(q), no scale or
// bias: the factored arithmetic's values, kernels.cpp's attention_vector
// applies the rows' scales and biases around the lanes; its keys take
// split_scores below, integer products).
enum Kind { f32 = 0, f16 = 1, bf16 = 2, q8 = 3, q4 = 4, q8i = 5, q4i = 6 };
constexpr bool packed(int K) { return K == q8 || K == q4 || K == q8i || K == q4i; }
constexpr bool integers(int K) { return K == q8i || K == q4i; }
using tracer_qmm::AttendPacked;
using tracer_qmm::masked_key;
// Keys/values rows [s, s + n), kAheadBytes on, into the caches ahead of
// their use (a block is a short stream; a prefetch past it cannot fault).
constexpr int kAheadBytes = 4096;  // 0, 2, 4, 8 KB measured alike within the noise (benchmarks/attention.py)
template <int K>
inline void prefetch_rows(const void* base, int s, int n, int D) {
  if constexpr (packed(K)) {  // the rows' bytes, scales and biases
    const AttendPacked& p = *static_cast<const AttendPacked*>(base);
    const int at = s + kAheadBytes / p.row_bytes;
    const char* d = reinterpret_cast<const char*>(p.data) + size_t(at) * p.row_bytes;
    for (size_t off = 0; off < size_t(n) * p.row_bytes; off += 64) _mm_prefetch(d + off, _MM_HINT_T0);
    if constexpr (integers(K)) return;  // no scales or biases read
    const size_t g0 = size_t(at) * p.groups, bytes = size_t(n) * p.groups * sizeof(float);
    for (size_t off = 0; off < bytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p.scales + g0) + off, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.biases + g0) + off, _MM_HINT_T0);
    }
    return;
  }
  const size_t item = K == f32 ? 4 : 2;
  const int ahead = kAheadBytes / (D * int(item));
  s += ahead;
  const char* p = static_cast<const char*>(base) + size_t(s) * D * item;
  for (size_t off = 0; off < size_t(n) * D * item; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}
// Values d .. d + 16 of packed row s as 16 bytes, one value each (4 bits:
// byte i's low nibble is value 2 i, its high nibble value 2 i + 1), and
// the group's scale and bias.
template <int K>
inline __m128i packed16(const void* block, int s, int d, float& scale, float& bias) {
  const AttendPacked& p = *static_cast<const AttendPacked*>(block);
  const uint8_t* row = p.data + size_t(s) * p.row_bytes;
  if constexpr (!integers(K)) {  // (the integers alone read no scale or bias)
    const size_t g = size_t(s) * p.groups + (d >> p.group_shift);
    scale = p.scales[g], bias = p.biases[g];
  }
  if constexpr (K == q8 || K == q8i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
  } else {
    const __m128i x8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 2)), low4 = _mm_set1_epi8(0x0F);
    return _mm_unpacklo_epi8(_mm_and_si128(x8, low4), _mm_and_si128(_mm_srli_epi16(x8, 4), low4));
  }
}
// Per key of p [R, S]: whether some row gives it a nonzero share (else its
// values are not read), found once for the block into a thread's buffer;
// keys from `from` on here (the ISA paths fill the ones before on lanes).
inline uint8_t* keys_read_from(const float* p, int R, int S, int from) {
  thread_local std::vector<uint8_t> read;
  read.resize(S);
  for (int s = from; s < S; ++s) {
    uint8_t any = 0;
    for (int r = 0; r < R; ++r) any |= p[size_t(r) * S + s] != 0.0f;
    read[s] = any;
  }
  return read.data();
}
// Calls f(std::integral_constant<int, g>) for a run-time g in [1, G]: a
// loop over g rows with the count fixed at compile time (no test a key).
template <int G, class F>
inline void with_rows(int g, F&& f) {
  if constexpr (G > 1) {
    if (g < G) return with_rows<G - 1>(g, f);
  }
  f(std::integral_constant<int, G>{});
}
}  // namespace attend

#if QMM_UNIT_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace attend_avx2 {
// Lanes 0..7 and 8..15 of values d .. d + 16 of stored row s (D values a row).
template <int K>
inline void load16(const void* block, int D, int s, int d, __m256& lo, __m256& hi) {
  if constexpr (attend::integers(K)) {
    float unused_scale, unused_bias;
    const __m128i q = attend::packed16<K>(block, s, d, unused_scale, unused_bias);
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
    return;
  } else if constexpr (attend::packed(K)) {
    float scale, bias;
    const __m128i q = attend::packed16<K>(block, s, d, scale, bias);
    const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(bias);
    lo = _mm256_add_ps(_mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q))), vb);
    hi = _mm256_add_ps(_mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))), vb);
    return;
  }
  const size_t i = size_t(s) * D + d;
  if constexpr (K == attend::f32) {
    const float* p = static_cast<const float*>(block) + i;
    lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(block) + i));
    const __m128i a = _mm256_castsi256_si128(h), b = _mm256_extracti128_si256(h, 1);
    if constexpr (K == attend::f16) {
      lo = _mm256_cvtph_ps(a), hi = _mm256_cvtph_ps(b);
    } else {
      lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
      hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    }
  }
}
// Two keys' s8 (8 lanes each) -> their sums (s4, s2, s1 as attend states) in lanes 0 and 4.
inline __m256 reduce2(__m256 s8a, __m256 s8b) {
  const __m256 s4 = _mm256_add_ps(_mm256_permute2f128_ps(s8a, s8b, 0x20), _mm256_permute2f128_ps(s8a, s8b, 0x31));
  const __m256 s2 = _mm256_add_ps(s4, _mm256_permute_ps(s4, 0x4E));
  return _mm256_add_ps(s2, _mm256_permute_ps(s2, 0xB1));
}
// Query row qr's s8 (lanes l + l + 8 of its 16) with each of a quad's widened keys.
template <int CK>
inline void quad_s8(const float* qr, const __m256 (&klo)[4][CK], const __m256 (&khi)[4][CK], int C, __m256 (&s8)[4]) {
  __m256 lo[4], hi[4];
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int c = 0; c < C; ++c) {
    const __m256 ql = _mm256_loadu_ps(qr + 16 * c), qh = _mm256_loadu_ps(qr + 16 * c + 8);
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm256_fmadd_ps(ql, klo[j][c], lo[j]);
      hi[j] = _mm256_fmadd_ps(qh, khi[j][c], hi[j]);
    }
  }
  for (int j = 0; j < 4; ++j) s8[j] = _mm256_add_ps(lo[j], hi[j]);
}
// scores for keys [s, s + 4) of all R rows; CC: D / 16 where fixed, else 0 (D / 16 at run time).
template <int K, int CC>
inline void scores4(const float* q, int R, int D, const void* k, int S, int s, const float* b, int per, float* out) {
  const int C = CC > 0 ? CC : D / 16;
  constexpr int CK = CC > 0 ? CC : 16;
  __m256 klo[4][CK], khi[4][CK];  // the four keys, widened once for the R rows
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < C; ++c) load16<K>(k, D, s + j, 16 * c, klo[j][c], khi[j][c]);
  for (int r = 0, bias_row = 0, in_row = 0; r < R; ++r) {
    __m256 s8[4];
    quad_s8(q + size_t(r) * D, klo, khi, C, s8);
    alignas(32) float t[16];
    _mm256_store_ps(t, reduce2(s8[0], s8[1]));
    _mm256_store_ps(t + 8, reduce2(s8[2], s8[3]));
    float* o = out + size_t(r) * S + s;
    const float* br = b + size_t(bias_row) * S;  // row r's bias
    for (int j = 0; j < 4; ++j) o[j] = attend::masked_key(br[j]) ? br[j] : br[j] + t[4 * j];
    if (++in_row == per) in_row = 0, ++bias_row;
  }
}
// A quad's 4 keys' s8 (8 lanes each) -> for each key its s2 pair, the lanes
// [k0.s2_0, k0.s2_1, k2.s2_0, k2.s2_1 | k1 .., k3 ..] (s4[i] = s8[i] + s8[i + 4],
// s2[i] = s4[i] + s4[i + 2]: reduce2's sums).
inline __m256 reduce_quad_s2(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 x01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 x23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  const __m256d d01 = _mm256_castps_pd(x01), d23 = _mm256_castps_pd(x23);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(d01, d23)), _mm256_castpd_ps(_mm256_unpackhi_pd(d01, d23)));
}
// Query row qr's s2 pairs (reduce_quad_s2) with a quad's widened keys.
template <int CK>
inline __m256 quad_s2(const float* qr, const __m256 (&klo)[4][CK], const __m256 (&khi)[4][CK], int C) {
  __m256 s8[4];
  quad_s8(qr, klo, khi, C, s8);
  return reduce_quad_s2(s8[0], s8[1], s8[2], s8[3]);
}
// The keys a group scores (attend_common.h): 8, two quads of scores4's sums
// (the same operations: each key's 16 lanes, s8, s4, s2 and s1 as reduce2
// adds them), the two quads' s2 pairs finished together (s1 of the 8 keys
// on one vector) and each row's 8 scores on one vector: bias + sum, or the
// bias itself where it masks the key (scores4's scalar finish did it a key
// at a time). The two quads' keys are widened once for all R rows; a quad
// whose bit in `live` is clear (masked for every row) is not read.
constexpr int kGroupKeys = 8;
template <int K, int CC>
inline void scores_group(const float* q, int R, int D, const void* k, int S, int s, const float* b, int per,
                         unsigned live, float* out) {
  const int C = CC > 0 ? CC : D / 16;
  constexpr int CK = CC > 0 ? CC : 16;
  __m256 klo[2][4][CK], khi[2][4][CK];
  for (int g = 0; g < 2; ++g) {
    if (!(live >> g & 1u)) continue;
    for (int j = 0; j < 4; ++j)
      for (int c = 0; c < C; ++c) load16<K>(k, D, s + 4 * g + j, 16 * c, klo[g][j][c], khi[g][j][c]);
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // [k0 k2 k4 k6 | k1 k3 k5 k7] -> k0 .. k7
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::max());
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0, bias_row = 0, in_row = 0; r < R; ++r) {
    const float* qr = q + size_t(r) * D;
    const __m256 y0 = live & 1u ? quad_s2(qr, klo[0], khi[0], C) : _mm256_setzero_ps();
    const __m256 y1 = live & 2u ? quad_s2(qr, klo[1], khi[1], C) : _mm256_setzero_ps();
    // s1 = s2_0 + s2_1 of keys [0 2 4 6 | 1 3 5 7]
    const __m256 s1 = _mm256_add_ps(_mm256_shuffle_ps(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256 dot = _mm256_permutevar8x32_ps(s1, order);
    const __m256 bv = _mm256_loadu_ps(b + size_t(bias_row) * S);
    const __m256 masked = _mm256_or_ps(_mm256_cmp_ps(bv, lowest, _CMP_EQ_OQ), _mm256_cmp_ps(bv, minus_inf, _CMP_EQ_OQ));
    _mm256_storeu_ps(out + size_t(r) * S + s, _mm256_blendv_ps(_mm256_add_ps(bv, dot), bv, masked));
    if (++in_row == per) in_row = 0, ++bias_row;
  }
}
inline const uint8_t* keys_read(const float* p, int R, int S) {
  const int whole = S / 8 * 8;
  uint8_t* read = attend::keys_read_from(p, R, S, whole);
  const __m256 zero = _mm256_setzero_ps();
  for (int s = 0; s < whole; s += 8) {
    __m256 any = zero;
    for (int r = 0; r < R; ++r) any = _mm256_or_ps(any, _mm256_cmp_ps(_mm256_loadu_ps(p + size_t(r) * S + s), zero, _CMP_NEQ_UQ));
    const int m = _mm256_movemask_ps(any);
    for (int i = 0; i < 8; ++i) read[s + i] = m >> i & 1;
  }
  return read;
}
// out [G, D] (rows D apart) = p [G, S] @ v [S, D] for the C slices from d0, in registers.
template <int K, int C, int G>
inline void values_rows(const float* p, int S, const void* v, int D, int d0, const uint8_t* read, bool prefetch,
                        float* out) {
  __m256 acc[G][C][2];
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < C; ++c) acc[i][c][0] = acc[i][c][1] = _mm256_setzero_ps();
  for (int s = 0; s < S; ++s) {
    if (!read[s]) continue;  // a key every row gives 0 (a masked one): skipped
    if (prefetch) attend::prefetch_rows<K>(v, s, 1, D);
    __m256 vlo[C], vhi[C];
    for (int c = 0; c < C; ++c) load16<K>(v, D, s, d0 + 16 * c, vlo[c], vhi[c]);
    for (int i = 0; i < G; ++i) {
      const __m256 pv = _mm256_set1_ps(p[size_t(i) * S + s]);
      for (int c = 0; c < C; ++c) {
        acc[i][c][0] = _mm256_fmadd_ps(pv, vlo[c], acc[i][c][0]);
        acc[i][c][1] = _mm256_fmadd_ps(pv, vhi[c], acc[i][c][1]);
      }
    }
  }
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < C; ++c) {
      float* o = out + size_t(i) * D + d0 + 16 * c;
      _mm256_storeu_ps(o, acc[i][c][0]);
      _mm256_storeu_ps(o + 8, acc[i][c][1]);
    }
}
// out [R, D] = p [R, S] @ v [S, D]; G rows at a time in registers. Many
// rows (a verify or prefill window's) take one 16-column slice of 4 rows a
// pass: 8 accumulators in registers, where a whole row of 64 or 128 columns
// for 2 rows or 1 (what a decode step's few rows take, reading the values
// once or twice) held more accumulators than AVX2's 16 registers, spilled each
// key. Each output's multiply-adds are the same, in key order: the same bits.
constexpr int kManyRows = 8;
template <int K, int CC>
void values_k(const float* p, int R, int S, const void* v, int D, float* out) {
  const uint8_t* read = keys_read(p, R, S);
  if (CC > 0 && R >= kManyRows) {
    for (int sl = 0; sl < D / 16; ++sl) {
      for (int r0 = 0; r0 < R; r0 += 4) {
        attend::with_rows<4>(std::min(4, R - r0), [&](auto g) {
          values_rows<K, 1, decltype(g)::value>(p + size_t(r0) * S, S, v, D, 16 * sl, read, sl == 0 && r0 == 0,
                                                out + size_t(r0) * D);
        });
      }
    }
    return;
  }
  constexpr int C = CC > 0 ? CC : 1;  // with CC = 0: one 16-column slice at a time
  constexpr int G = CC > 0 ? (CC <= 2 ? 4 : CC <= 4 ? 2 : 1) : 4;
  const int slices = CC > 0 ? 1 : D / 16;
  for (int sl = 0; sl < slices; ++sl) {
    for (int r0 = 0; r0 < R; r0 += G) {
      attend::with_rows<G>(std::min(G, R - r0), [&](auto g) {
        values_rows<K, C, decltype(g)::value>(p + size_t(r0) * S, S, v, D, 16 * sl, read, sl == 0 && r0 == 0,
                                              out + size_t(r0) * D);
      });
    }
  }
}
// The split scores (qmm_api.h's QSplit, kernels.cpp's attention_vector)
// 8 keys at a time, lane i key s0 + i: each row's parts as two 16-bit ones,
// 254 q0 + q1 and q2, taken in pairs of values (once a call); the keys' rows
// transposed as 8 x 8 dwords, each column's bytes (4-bit: nibbles) split into
// pairs of 16-bit values, and each pair column multiplied with a broadcast
// pair of a row's part by vpmaddwd (exact), summed in int32 (a01, a2); then
// split_score's operations on the 8 lanes (the same operations in the same
// order: the same bits).
inline void transpose8(__m256i (&r)[8]) {  // r[j] lane i <- r[i] lane j
  __m256i t[8], u[8];
  for (int m = 0; m < 4; ++m) {
    t[2 * m] = _mm256_unpacklo_epi32(r[2 * m], r[2 * m + 1]);
    t[2 * m + 1] = _mm256_unpackhi_epi32(r[2 * m], r[2 * m + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4 h + c], block L: rows 4h .. 4h + 3 at column 4L + c
    u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}
// The two values pair column c of a key row holds (8 bits: a column's bytes 0, 2 then 1, 3;
// 4 bits: its low nibbles' bytes 0, 2 then 1, 3, then its high nibbles' likewise).
inline void pair_values(int bits, int c, int& da, int& db) {
  if (bits == 8) {
    da = 4 * (c / 2) + (c & 1);
  } else {
    constexpr int base[4] = {0, 2, 1, 3};
    da = 8 * (c / 4) + base[c % 4];
  }
  db = da + (bits == 8 ? 2 : 4);
}
template <int BITS>
void split_scores_k(const tracer_qmm::QSplit& q, const attend::AttendPacked& k, int S, const float* bias, int per,
                    float* out) {
  constexpr int P = tracer_qmm::kQParts;
  const int R = q.R, D = q.D, PC = D / 2, W = D * BITS / 32, nb = (R + per - 1) / per;  // PC: pair columns
  thread_local std::vector<int32_t> qp;  // [R, 2, PC]: row r's pairs of 254 q0 + q1, then of q2
  qp.resize(size_t(R) * 2 * PC);
  for (int r = 0; r < R; ++r) {
    const int8_t* p0 = q.parts + size_t(r) * P * D;
    for (int c = 0; c < PC; ++c) {
      int da, db;
      pair_values(BITS, c, da, db);
      const auto pair = [](int a, int b) { return int32_t(uint32_t(uint16_t(int16_t(a))) | uint32_t(uint16_t(int16_t(b))) << 16); };
      qp[size_t(2 * r) * PC + c] = pair(254 * p0[da] + p0[D + da], 254 * p0[db] + p0[D + db]);  // |.| <= 32385
      qp[size_t(2 * r + 1) * PC + c] = pair(p0[2 * D + da], p0[2 * D + db]);
    }
  }
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::max());
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i low16 = _mm256_set1_epi32(0x00FF00FF), nibble = _mm256_set1_epi8(0x0F);
  __m256i pc[128];  // PC <= 128 (D <= 256)
  for (int s0 = 0; s0 < S; s0 += 8) {
    const int n = std::min(8, S - s0);
    bool live = false;  // some key some bias row shows
    for (int i = 0; i < nb && !live; ++i)
      for (int j = 0; j < n; ++j) live = live || !attend::masked_key(bias[size_t(i) * S + s0 + j]);
    if (!live) {  // masked for every row: not read
      for (int r = 0; r < R; ++r)
        std::memcpy(out + size_t(r) * S + s0, bias + size_t(r / per) * S + s0, n * sizeof(float));
      continue;
    }
    if (s0 % 16 == 0) attend::prefetch_rows<attend::q8i>(&k, s0, 16, D);
    const uint8_t* rows = k.data + size_t(s0) * k.row_bytes;
    for (int t = 0; 8 * t < W; ++t) {  // 8 dwords of each key at a time
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const uint8_t* row = rows + size_t(i) * k.row_bytes + 32 * t;
        r[i] = i >= n ? _mm256_setzero_si256()
               : W >= 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))
                        : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      }
      transpose8(r);
      const int w = std::min(8, W - 8 * t);
      for (int j = 0; j < w; ++j) {
        if constexpr (BITS == 8) {
          __m256i* c = pc + 2 * (8 * t + j);
          c[0] = _mm256_and_si256(r[j], low16), c[1] = _mm256_and_si256(_mm256_srli_epi32(r[j], 8), low16);
        } else {
          __m256i* c = pc + 4 * (8 * t + j);
          const __m256i lo = _mm256_and_si256(r[j], nibble), hi = _mm256_and_si256(_mm256_srli_epi32(r[j], 4), nibble);
          c[0] = _mm256_and_si256(lo, low16), c[1] = _mm256_and_si256(_mm256_srli_epi32(lo, 8), low16);
          c[2] = _mm256_and_si256(hi, low16), c[3] = _mm256_and_si256(_mm256_srli_epi32(hi, 8), low16);
        }
      }
    }
    alignas(32) float ksv[8] = {}, kbv[8] = {};
    std::memcpy(ksv, k.scales + s0, n * sizeof(float)), std::memcpy(kbv, k.biases + s0, n * sizeof(float));
    const __m256 ks = _mm256_load_ps(ksv), kb = _mm256_load_ps(kbv);
    for (int r = 0; r < R; ++r) {
      const int32_t* q01 = qp.data() + size_t(2 * r) * PC;
      const int32_t* q2 = q01 + PC;
      __m256i a01 = _mm256_setzero_si256(), a2 = _mm256_setzero_si256();
      for (int c = 0; c < PC; ++c) {
        a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(pc[c], _mm256_set1_epi32(q01[c])));
        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(pc[c], _mm256_set1_epi32(q2[c])));
      }
      const float* d = q.scale + size_t(r) * P;
      const __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a01), _mm256_set1_ps(d[1])),
                                     _mm256_mul_ps(_mm256_cvtepi32_ps(a2), _mm256_set1_ps(d[2])));
      alignas(32) float bb[8] = {};
      std::memcpy(bb, bias + size_t(r / per) * S + s0, n * sizeof(float));
      const __m256 bv = _mm256_load_ps(bb);
      const __m256 sc = _mm256_add_ps(bv, _mm256_add_ps(_mm256_mul_ps(ks, t), _mm256_mul_ps(kb, _mm256_set1_ps(q.qsum[r]))));
      const __m256 masked = _mm256_or_ps(_mm256_cmp_ps(bv, lowest, _CMP_EQ_OQ), _mm256_cmp_ps(bv, minus_inf, _CMP_EQ_OQ));
      if (n == 8) {
        _mm256_storeu_ps(out + size_t(r) * S + s0, _mm256_blendv_ps(sc, bv, masked));
      } else {
        alignas(32) float o[8];
        _mm256_store_ps(o, _mm256_blendv_ps(sc, bv, masked));
        std::memcpy(out + size_t(r) * S + s0, o, n * sizeof(float));
      }
    }
  }
}
void split_scores(const tracer_qmm::QSplit& q, const attend::AttendPacked& k, int bits, int S, const float* bias,
                  int per, float* out) {
  bits == 8 ? split_scores_k<8>(q, k, S, bias, per, out) : split_scores_k<4>(q, k, S, bias, per, out);
}
#include "attend_common.h"
}  // namespace attend_avx2
#pragma GCC pop_options
#endif  // QMM_UNIT_AVX2

#if QMM_UNIT_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace attend_avx512 {
// Values d .. d + 16 of stored row s (D values a row).
template <int K>
inline __m512 load16(const void* block, int D, int s, int d) {
  if constexpr (K == attend::q4i) {  // 8 bytes, each twice, widened, shifted by 0 or 4 per value: its nibbles
    const attend::AttendPacked& p = *static_cast<const attend::AttendPacked*>(block);
    const __m128i x8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.data + size_t(s) * p.row_bytes + d / 2));
    const __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x8, x8));
    const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shift), _mm512_set1_epi32(0x0F)));
  } else if constexpr (attend::integers(K)) {
    float unused_scale, unused_bias;
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(attend::packed16<K>(block, s, d, unused_scale, unused_bias)));
  } else if constexpr (attend::packed(K)) {
    float scale, bias;
    const __m128i q = attend::packed16<K>(block, s, d, scale, bias);
    return _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))),
                         _mm512_set1_ps(bias));
  }
  const size_t i = size_t(s) * D + d;
  if constexpr (K == attend::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(block) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(block) + i));
    if constexpr (K == attend::f16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}
// Four keys' 16 lanes -> their sums (attend's tree) in lanes 0, 4, 8, 12.
inline __m512 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // s8: [a.lo256 + a.hi256] for a pair of keys in one vector
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // s4: each key's lanes 0-3 + 4-7; keys in 128-bit blocks 0..3
  const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  const __m512 s2 = _mm512_add_ps(s4, _mm512_permute_ps(s4, 0x4E));
  return _mm512_add_ps(s2, _mm512_permute_ps(s2, 0xB1));
}
// Keys s .. s + 4 (C slices of 16 values each), widened once for every query row.
template <int K, int CK>
inline void load_quad(const void* k, int D, int s, int C, __m512 (&kc)[4][CK]) {
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < C; ++c) kc[j][c] = load16<K>(k, D, s + j, 16 * c);
}
// Query row qr's dot products with a quad's keys, in lanes 0, 4, 8, 12 (attend's tree).
template <int CK>
inline __m512 quad_sums(const float* qr, const __m512 (&kc)[4][CK], int C) {
  __m512 a[4];
  for (int j = 0; j < 4; ++j) a[j] = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) {
    const __m512 qc = _mm512_loadu_ps(qr + 16 * c);
    for (int j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(qc, kc[j][c], a[j]);
  }
  return reduce4(a[0], a[1], a[2], a[3]);
}
template <int K, int CC>
inline void scores4(const float* q, int R, int D, const void* k, int S, int s, const float* b, int per, float* out) {
  const int C = CC > 0 ? CC : D / 16;
  constexpr int CK = CC > 0 ? CC : 16;
  __m512 kc[4][CK];
  load_quad<K>(k, D, s, C, kc);
  for (int r = 0, bias_row = 0, in_row = 0; r < R; ++r) {
    alignas(64) float t[16];
    _mm512_store_ps(t, quad_sums(q + size_t(r) * D, kc, C));
    float* o = out + size_t(r) * S + s;
    const float* br = b + size_t(bias_row) * S;  // row r's bias
    for (int j = 0; j < 4; ++j) o[j] = attend::masked_key(br[j]) ? br[j] : br[j] + t[4 * j];
    if (++in_row == per) in_row = 0, ++bias_row;
  }
}
// The keys a group scores (attend_common.h): 16, four quads of scores4's
// sums (the same operations), each row's 16 scores then finished on one
// vector: bias + sum, or the bias itself where it masks the key. A quad
// whose bit in `live` is clear (masked for every row) is not read.
constexpr int kGroupKeys = 16;
template <int K, int CC>
inline void scores_group(const float* q, int R, int D, const void* k, int S, int s, const float* b, int per,
                         unsigned live, float* out) {
  const int C = CC > 0 ? CC : D / 16;
  constexpr int CK = CC > 0 ? CC : 16;
  constexpr int kRows = 8;  // rows whose quads' sums wait in `sums` for the finish
  alignas(64) float sums[kRows][4][16];
  const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::max());
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r0 = 0, bias_row = 0, in_row = 0; r0 < R; r0 += kRows) {
    const int n = std::min(kRows, R - r0);
    for (int g = 0; g < 4; ++g) {
      if (!(live >> g & 1u)) {
        for (int i = 0; i < n; ++i) _mm512_store_ps(sums[i][g], _mm512_setzero_ps());
        continue;
      }
      __m512 kc[4][CK];
      load_quad<K>(k, D, s + 4 * g, C, kc);
      for (int i = 0; i < n; ++i) _mm512_store_ps(sums[i][g], quad_sums(q + size_t(r0 + i) * D, kc, C));
    }
    for (int i = 0; i < n; ++i) {
      // lane 4 g + j: quad g's key j (its sum sits in lane 4 j of sums[i][g])
      const __m512 lo = _mm512_permutex2var_ps(_mm512_load_ps(sums[i][0]), pick, _mm512_load_ps(sums[i][1]));
      const __m512 hi = _mm512_permutex2var_ps(_mm512_load_ps(sums[i][2]), pick, _mm512_load_ps(sums[i][3]));
      const __m512 dot = _mm512_shuffle_f32x4(lo, hi, 0x44);
      const __m512 bv = _mm512_loadu_ps(b + size_t(bias_row) * S);
      const __mmask16 masked = _mm512_cmp_ps_mask(bv, lowest, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(bv, minus_inf, _CMP_EQ_OQ);
      _mm512_storeu_ps(out + size_t(r0 + i) * S + s, _mm512_mask_mov_ps(_mm512_add_ps(bv, dot), masked, bv));
      if (++in_row == per) in_row = 0, ++bias_row;
    }
  }
}
inline const uint8_t* keys_read(const float* p, int R, int S) {
  const int whole = S / 16 * 16;
  uint8_t* read = attend::keys_read_from(p, R, S, whole);
  const __m512 zero = _mm512_setzero_ps();
  const __m128i one = _mm_set1_epi8(1);
  for (int s = 0; s < whole; s += 16) {
    __mmask16 any = 0;
    for (int r = 0; r < R; ++r) any |= _mm512_cmp_ps_mask(_mm512_loadu_ps(p + size_t(r) * S + s), zero, _CMP_NEQ_UQ);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(read + s), _mm_maskz_mov_epi8(any, one));
  }
  return read;
}
// out [G, D] (rows D apart) = p [G, S] @ v [S, D] for the C slices from d0, in registers.
// 4-bit integers (q4i, C even): each 32 values' 16 bytes split into their low
// nibbles (the even-numbered values) and high ones (the odd), each 16 widened
// once; the accumulators hold the even and the odd values, interleaved back
// as stored (each output's multiply-adds the same, in key order: the same bits).
template <int K, int C, int G>
inline void values_rows(const float* p, int S, const void* v, int D, int d0, const uint8_t* read, bool prefetch,
                        float* out) {
  constexpr bool halves = K == attend::q4i && C % 2 == 0;
  __m512 acc[G][C];
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int s = 0; s < S; ++s) {
    if (!read[s]) continue;  // a key every row gives 0 (a masked one): skipped
    if (prefetch) attend::prefetch_rows<K>(v, s, 1, D);
    __m512 vc[C];
    if constexpr (halves) {  // vc[2 m]: values d0 + 32 m + 2 j, vc[2 m + 1]: d0 + 32 m + 2 j + 1 (lane j)
      const attend::AttendPacked& pk = *static_cast<const attend::AttendPacked*>(v);
      const uint8_t* row = pk.data + size_t(s) * pk.row_bytes + d0 / 2;
      const __m128i low4 = _mm_set1_epi8(0x0F);
      for (int m = 0; m < C / 2; ++m) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * m));
        vc[2 * m] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(x, low4)));
        vc[2 * m + 1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(x, 4), low4)));
      }
    } else {
      for (int c = 0; c < C; ++c) vc[c] = load16<K>(v, D, s, d0 + 16 * c);
    }
    for (int i = 0; i < G; ++i) {
      const __m512 pv = _mm512_set1_ps(p[size_t(i) * S + s]);
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(pv, vc[c], acc[i][c]);
    }
  }
  if constexpr (halves) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int i = 0; i < G; ++i)
      for (int m = 0; m < C / 2; ++m) {
        float* o = out + size_t(i) * D + d0 + 32 * m;
        _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[i][2 * m], first, acc[i][2 * m + 1]));
        _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(acc[i][2 * m], second, acc[i][2 * m + 1]));
      }
  } else {
    for (int i = 0; i < G; ++i)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + size_t(i) * D + d0 + 16 * c, acc[i][c]);
  }
}
template <int K, int CC>
void values_k(const float* p, int R, int S, const void* v, int D, float* out) {
  const uint8_t* read = keys_read(p, R, S);
  constexpr int C = CC > 0 ? CC : 1;
  constexpr int G = CC > 0 ? (CC <= 2 ? 8 : CC <= 4 ? 6 : 3) : 8;
  const int slices = CC > 0 ? 1 : D / 16;
  for (int sl = 0; sl < slices; ++sl) {
    for (int r0 = 0; r0 < R; r0 += G) {
      attend::with_rows<G>(std::min(G, R - r0), [&](auto g) {
        values_rows<K, C, decltype(g)::value>(p + size_t(r0) * S, S, v, D, 16 * sl, read, sl == 0 && r0 == 0,
                                              out + size_t(r0) * D);
      });
    }
  }
}
#include "attend_common.h"
}  // namespace attend_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
namespace attend_vnni {
// The split scores (qmm_api.h's QSplit) 16 keys at a time, lane i key s0 + i:
// the 16 keys' rows transposed as 16 x 16 dwords (column j: the j-th 4 bytes
// of every key), 4-bit columns split into their low and high nibbles, and
// each column multiplied with a broadcast dword of 4 int8 query values by
// VNNI's vpdpbusd (keys unsigned, queries signed, 4 products summed into
// each int32 lane: exact). Then split_score's operations on 16 lanes (the
// same operations, in the same order, as the scalar function).
inline void transpose16(__m512i (&r)[16]) {  // r[j] lane i <- r[i] lane j
  __m512i a[16], v[16];
  for (int m = 0; m < 8; ++m) {  // per 128-bit block L: rows 2m, 2m + 1 at columns 4L, 4L + 1 / 4L + 2, 4L + 3
    a[2 * m] = _mm512_unpacklo_epi32(r[2 * m], r[2 * m + 1]);
    a[2 * m + 1] = _mm512_unpackhi_epi32(r[2 * m], r[2 * m + 1]);
  }
  for (int m = 0; m < 4; ++m) {  // v[4 m + c] block L: rows 4m .. 4m + 3 at column 4L + c
    v[4 * m] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
    v[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
    v[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
    v[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: block L of v[c], v[4 + c], v[8 + c], v[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(v[c], v[4 + c], 0x44), y0 = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(v[c], v[4 + c], 0xEE), y1 = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}
// G rows' finished scores for the 16 keys whose columns are `cols` (C of
// them), `qc` the rows' parts as columns (column j: the dwords of rows
// r0 .. r0 + G, parts 0 .. kQParts each, at qc + j * stride).
template <int C, int G>
inline void rows_scores(const __m512i* cols, const int32_t* qc, int stride, const float* scale, const float* qsum,
                        __m512 ks, __m512 kb, const float* bias, int S, int per, int r0, __mmask16 lanes,
                        float* out) {
  constexpr int P = tracer_qmm::kQParts;
  __m512i acc[G * P];
  for (int i = 0; i < G * P; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 32
  for (int j = 0; j < C; ++j) {
    const __m512i t = _mm512_load_si512(cols + j);
    const int32_t* qj = qc + size_t(j) * stride;
    for (int i = 0; i < G * P; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], t, _mm512_set1_epi32(qj[i]));
  }
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::max());
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < G; ++i) {
    const int r = r0 + i;
    const float* d = scale + size_t(r) * P;
    const __m512i a01 = _mm512_add_epi32(_mm512_mullo_epi32(acc[i * P], _mm512_set1_epi32(254)), acc[i * P + 1]);
    const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a01), _mm512_set1_ps(d[1])),
                                   _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i * P + 2]), _mm512_set1_ps(d[2])));
    const __m512 bv = _mm512_maskz_loadu_ps(lanes, bias + size_t(r / per) * S);
    const __mmask16 masked = _mm512_cmp_ps_mask(bv, lowest, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(bv, minus_inf, _CMP_EQ_OQ);
    const __m512 sc = _mm512_add_ps(bv, _mm512_add_ps(_mm512_mul_ps(ks, t), _mm512_mul_ps(kb, _mm512_set1_ps(qsum[r]))));
    _mm512_mask_storeu_ps(out + size_t(r) * S, lanes, _mm512_mask_mov_ps(sc, masked, bv));
  }
}
// Key i's dwords [16 t, 16 t + w) of a row of W (w = min(16, W - 16 t)), the rest of the vector 0.
template <int W>
inline __m512i key_dwords(const uint8_t* row, int t) {
  if constexpr (W == 4) {
    return _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  } else if constexpr (W == 8) {
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  } else {
    return _mm512_loadu_si512(row + 64 * t);
  }
}
template <int BITS, int D>
void split_scores_d(const tracer_qmm::QSplit& q, const attend::AttendPacked& k, int S, const float* bias, int per,
                    float* out) {
  constexpr int P = tracer_qmm::kQParts, C = D / 4, W = D * BITS / 32, T = (W + 15) / 16;
  const int R = q.R, nb = (R + per - 1) / per, stride = R * P;
  // the rows' parts as columns of 4 values, column-major (column j: every row's parts at j * stride):
  // 8 bits, values 4j .. 4j + 3; 4 bits, per 8 values (columns 2 e and 2 e + 1), the even ones
  // (the bytes' low nibbles), then the odd ones
  thread_local std::vector<int32_t> qc;
  qc.resize(size_t(C) * stride);
  for (int rp = 0; rp < stride; ++rp) {
    const int8_t* src = q.parts + size_t(rp) * D;
    for (int j = 0; j < C; ++j) {
      int8_t b4[4];
      for (int b = 0; b < 4; ++b) b4[b] = BITS == 8 ? src[4 * j + b] : src[8 * (j / 2) + 2 * b + (j & 1)];
      std::memcpy(&qc[size_t(j) * stride + rp], b4, 4);
    }
  }
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::max());
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  alignas(64) __m512i cols[C];
  for (int s0 = 0; s0 < S; s0 += 16) {
    const int n = std::min(16, S - s0);
    const __mmask16 lanes = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    __mmask16 live = 0;  // keys some bias row shows
    for (int i = 0; i < nb; ++i) {
      const __m512 bv = _mm512_maskz_loadu_ps(lanes, bias + size_t(i) * S + s0);
      live |= ~(_mm512_cmp_ps_mask(bv, lowest, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(bv, minus_inf, _CMP_EQ_OQ)) & lanes;
    }
    if (live == 0) {  // masked for every row: not read
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(out + size_t(r) * S + s0, lanes, _mm512_maskz_loadu_ps(lanes, bias + size_t(r / per) * S + s0));
      continue;
    }
    attend::prefetch_rows<attend::q8i>(&k, s0, 16, D);
    const uint8_t* rows = k.data + size_t(s0) * k.row_bytes;
    for (int t = 0; t < T; ++t) {  // 16 dwords of each key at a time
      __m512i r[16];
      if (n == 16) {
        for (int i = 0; i < 16; ++i) r[i] = key_dwords<W>(rows + size_t(i) * k.row_bytes, t);
      } else {  // the last keys: rows past S not read
        for (int i = 0; i < 16; ++i) r[i] = i < n ? key_dwords<W>(rows + size_t(i) * k.row_bytes, t) : _mm512_setzero_si512();
      }
      transpose16(r);
      constexpr int w = W < 16 ? W : 16;
      for (int j = 0; j < w; ++j) {
        if constexpr (BITS == 8) {
          cols[16 * t + j] = r[j];
        } else {
          cols[2 * j] = _mm512_and_si512(r[j], nibble);
          cols[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(r[j], 4), nibble);
        }
      }
    }
    const __m512 ks = _mm512_maskz_loadu_ps(lanes, k.scales + s0), kb = _mm512_maskz_loadu_ps(lanes, k.biases + s0);
    int r0 = 0;
    for (; r0 + 3 <= R; r0 += 3)
      rows_scores<C, 3>(cols, qc.data() + r0 * P, stride, q.scale, q.qsum, ks, kb, bias + s0, S, per, r0, lanes, out + s0);
    if (R - r0 == 2)
      rows_scores<C, 2>(cols, qc.data() + r0 * P, stride, q.scale, q.qsum, ks, kb, bias + s0, S, per, r0, lanes, out + s0);
    else if (R - r0 == 1)
      rows_scores<C, 1>(cols, qc.data() + r0 * P, stride, q.scale, q.qsum, ks, kb, bias + s0, S, per, r0, lanes, out + s0);
  }
}
// false where the head size has no kernel here (the caller runs AVX2's)
bool split_scores(const tracer_qmm::QSplit& q, const attend::AttendPacked& k, int bits, int S, const float* bias,
                  int per, float* out) {
  const int D = q.D;
  if (bits == 8) {
    D == 64 ? split_scores_d<8, 64>(q, k, S, bias, per, out)
    : D == 128 ? split_scores_d<8, 128>(q, k, S, bias, per, out)
    : D == 32 ? split_scores_d<8, 32>(q, k, S, bias, per, out) : void();
  } else {
    D == 64 ? split_scores_d<4, 64>(q, k, S, bias, per, out)
    : D == 128 ? split_scores_d<4, 128>(q, k, S, bias, per, out)
    : D == 32 ? split_scores_d<4, 32>(q, k, S, bias, per, out) : void();
  }
  return D == 32 || D == 64 || D == 128;
}
}  // namespace attend_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
// The AVX-512 path's split scores: VNNI's where the CPU has it (head sizes 32, 64, 128: the
// factored attention's, a group a row), else AVX2's (unit 1's; the same bits).
void split_scores_avx512(const tracer_qmm::QSplit& q, const attend::AttendPacked& k, int bits, int S,
                         const float* bias, int per, float* out) {
  static const bool vnni = has_vnni();
  if (!(vnni && attend_vnni::split_scores(q, k, bits, S, bias, per, out))) {
    tracer_qmm_unit::kPathAvx2.attend_split(q, k, bits, S, bias, per, out);
  }
}
#pragma GCC pop_options
#endif  // QMM_UNIT_AVX512
