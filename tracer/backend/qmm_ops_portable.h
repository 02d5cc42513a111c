// qmm's operations for portable C++ (any CPU): the namespace qmm_isa.h and
// qmm_fast.h are instantiated in, with the vector type, the dequantization
// of a block and the fast contract's integer dot products they need, written
// as loops the compiler vectorizes for the baseline target. Included by
// qmm.cpp inside its anonymous namespace.

namespace isa_portable {
constexpr int L = 8, kTile = 4;
constexpr int kRows(int) { return 1; }
constexpr int kAcc(int mt) { return mt <= 2 ? 4 : 2; }
constexpr Halves halves = halves_portable;
struct F {
  float v[L];
};
inline F splat(float a) {
  F r;
  std::fill(r.v, r.v + L, a);
  return r;
}
inline F loadu(const float* p) {
  F r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void storeu(float* p, F a) {
  std::memcpy(p, a.v, sizeof a.v);
}
inline F add(F a, F b) {
  for (int i = 0; i < L; ++i) a.v[i] += b.v[i];
  return a;
}
inline F fmadd(F a, F b, F c) {
  for (int i = 0; i < L; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline float hsum(F a) {
  float s = 0.0f;
  for (int i = 0; i < L; ++i) s += a.v[i];
  return s;
}
struct Group {
  float s, b;
};
template <int BITS>
inline Group group(float s, float b) {
  return {s, b};
}
template <int BITS>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  float q[kBlock];  // loops the compiler vectorizes
  for (int i = 0; i < kBlock / 2; ++i) {
    q[i] = BITS == 8 ? p[i] : p[i] & 15;
    q[i + kBlock / 2] = BITS == 8 ? p[i + kBlock / 2] : p[i] >> 4;
  }
  for (int i = 0; i < kBlock; ++i) q[i] = q[i] * g.s + g.b;
  std::memcpy(w, q, sizeof q);
}
// The fast contract's integer dot products (loops the compiler vectorizes).
constexpr int kFastRows(int) { return 1; }
struct WP {
  uint8_t b[2 * kBlock];  // half A of blocks i, i + 4, then half B of both
};
template <int BITS>
inline WP unpack_pair(const uint8_t* p0, const uint8_t* p1) {
  WP w;
  for (int h = 0; h < 2; ++h) {
    const uint8_t* p = h ? p1 : p0;
    for (int i = 0; i < 16; ++i) {
      w.b[16 * h + i] = BITS == 8 ? p[i] : p[i] & 15;
      w.b[32 + 16 * h + i] = BITS == 8 ? p[16 + i] : p[i] >> 4;
    }
  }
  return w;
}
struct I {
  int32_t v[8];
};
template <int BITS>
inline I pair_dot(const WP& w, const int8_t* x) {
  int16_t a[2 * kBlock], c[2 * kBlock];  // widened first: loops the compiler maps onto 16-bit multiplies
  for (int i = 0; i < 2 * kBlock; ++i) a[i] = w.b[i], c[i] = x[i];
  int32_t p[kBlock];  // p[i] = a[2i] c[2i] + a[2i + 1] c[2i + 1] (pmaddwd's shape)
  for (int i = 0; i < kBlock; ++i) p[i] = int32_t(a[2 * i]) * c[2 * i] + int32_t(a[2 * i + 1]) * c[2 * i + 1];
  I r;
  for (int l = 0; l < 8; ++l) r.v[l] = p[2 * l] + p[2 * l + 1] + p[16 + 2 * l] + p[16 + 2 * l + 1];
  return r;
}
inline I i_zero() { return I{}; }
inline I reduce4(const I& v0, const I& v1, const I& v2, const I& v3) {
  const I* v[4] = {&v0, &v1, &v2, &v3};
  I r;
  for (int b = 0; b < 8; ++b) {
    const I& p = *v[b % 4];
    r.v[b] = p.v[4 * (b / 4)] + p.v[4 * (b / 4) + 1] + p.v[4 * (b / 4) + 2] + p.v[4 * (b / 4) + 3];
  }
  return r;
}
using FA = F;
inline FA fa_zero() { return splat(0.0f); }
inline FA fa_mul(const float* a, const float* b) {
  FA r;
  for (int i = 0; i < 8; ++i) r.v[i] = a[i] * b[i];
  return r;
}
inline FA fa_add(FA a, FA b) { return add(a, b); }
inline FA fa_mul_n(const float* a, const float* b, int n) {
  FA r = splat(0.0f);
  for (int i = 0; i < n; ++i) r.v[i] = a[i] * b[i];
  return r;
}
inline FA fa_fma_blocks(const I& s, FA d, FA a) {
  for (int i = 0; i < 8; ++i) a.v[i] += float(s.v[i]) * d.v[i];
  return a;
}
inline float hsum8(FA a) { return hsum(a); }
#include "qmm_isa.h"
#include "qmm_fast.h"
}  // namespace isa_portable
