// qmm.cpp's 5- and 6-bit blocks (a 4-bit block's 16 bytes of nibbles, then
// a plane of high bits) as AVX2 and AVX-512 want them, in 128- and 256-bit
// vectors (and 512-bit ones where QMM_NARROW_512 is defined: AVX-512's
// namespace): included inside each x86 ISA's namespace of qmm_ops_x86.h,
// under its target pragma.

// 5 bits (qmm.cpp's layout): a block's fifth bits, its 32-bit word `h` in
// each 32-bit lane of a 128-bit lane, as the 4-bit halves' bytes want them
// (bit 4 of byte i: weight 2 i's in `a`, 2 i + 1's in `b`): lane l's bytes
// f hold bits 4 + l (even weights) and l (odd ones) of byte f, one shift a
// lane each (bits shifted in from the next or previous byte fall outside bit 4).
inline void fifth_bits(__m128i h, __m128i& a, __m128i& b) {
  const __m128i bit = _mm_set1_epi8(0x10);
  a = _mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(0, 1, 2, 3)), bit);
  b = _mm_and_si128(_mm_sllv_epi32(h, _mm_setr_epi32(4, 3, 2, 1)), bit);
}
inline void fifth_bits(__m256i h, __m256i& a, __m256i& b) {
  const __m256i bit = _mm256_set1_epi8(0x10);
  a = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3)), bit);
  b = _mm256_and_si256(_mm256_sllv_epi32(h, _mm256_setr_epi32(4, 3, 2, 1, 4, 3, 2, 1)), bit);
}
// 6 bits (qmm.cpp's layout): a block's two high bits a weight, its 8 bytes
// `d` in both 64-bit lanes of a 128-bit lane, as the 4-bit halves' bytes
// want them (bits 4-5 of byte i: weight 2 i's in `a`, 2 i + 1's in `b`): the
// low lane shifted left by 4 (bits 0-1 and 2-3 of byte i to 4-5 and 6-7),
// the high one not (bits 4-5 and 6-7 of byte i - 8 in place), then `b`'s
// shifted right by 2 (bits shifted in from a neighbouring byte fall outside
// bits 4-5).
inline void sixth_bits(__m128i d, __m128i& a, __m128i& b) {
  const __m128i m = _mm_set1_epi8(0x30), t = _mm_sllv_epi64(d, _mm_set_epi64x(0, 4));
  a = _mm_and_si128(t, m), b = _mm_and_si128(_mm_srli_epi64(t, 2), m);
}
inline void sixth_bits(__m256i d, __m256i& a, __m256i& b) {
  const __m256i m = _mm256_set1_epi8(0x30), t = _mm256_sllv_epi64(d, _mm256_setr_epi64x(4, 0, 4, 0));
  a = _mm256_and_si256(t, m), b = _mm256_and_si256(_mm256_srli_epi64(t, 2), m);
}
#ifdef QMM_NARROW_512  // AVX-512's namespaces: the same in each 128-bit lane of 4
inline void fifth_bits(__m512i h, __m512i& a, __m512i& b) {
  const __m512i bit = _mm512_set1_epi8(0x10);
  a = _mm512_and_si512(_mm512_srlv_epi32(h, _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)), bit);
  b = _mm512_and_si512(_mm512_sllv_epi32(h, _mm512_setr_epi32(4, 3, 2, 1, 4, 3, 2, 1, 4, 3, 2, 1, 4, 3, 2, 1)), bit);
}
inline void sixth_bits(__m512i d, __m512i& a, __m512i& b) {
  const __m512i m = _mm512_set1_epi8(0x30), t = _mm512_sllv_epi64(d, _mm512_setr_epi64(4, 0, 4, 0, 4, 0, 4, 0));
  a = _mm512_and_si512(t, m), b = _mm512_and_si512(_mm512_srli_epi64(t, 2), m);
}
#endif
inline __m128i word4(const uint8_t* p) {  // the 32-bit word at p in the 4 lanes
  int32_t w;
  std::memcpy(&w, p, sizeof w);
  return _mm_set1_epi32(w);
}
inline __m128i word8(const uint8_t* p) {  // the 64-bit word at p in both lanes
  int64_t w;
  std::memcpy(&w, p, sizeof w);
  return _mm_set1_epi64x(w);
}
// A 5- or 6-bit block's high bits (past its 16 bytes of nibbles) as its 128-bit lane wants them.
template <int BITS>
inline __m128i high_word(const uint8_t* block) {
  return BITS == 5 ? word4(block + 16) : word8(block + 16);
}
template <int BITS, class V>
inline void high_bits(V h, V& a, V& b) {
  if constexpr (BITS == 5) {
    fifth_bits(h, a, b);
  } else {
    sixth_bits(h, a, b);
  }
}
// A 5- or 6-bit block's 32 weights as bytes in the natural order: weights 0-15 in lo, 16-31 in hi.
template <int BITS>
inline void natural(const uint8_t* p, __m128i& lo, __m128i& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0f);
  __m128i a, b;
  high_bits<BITS>(high_word<BITS>(p), a, b);
  a = _mm_or_si128(_mm_and_si128(v, m), a);                        // weights 2 i
  b = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), m), b);     // weights 2 i + 1
  lo = _mm_unpacklo_epi8(a, b), hi = _mm_unpackhi_epi8(a, b);
}
