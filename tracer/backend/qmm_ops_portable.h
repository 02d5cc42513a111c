// qmm's operations for portable C++ (any CPU): the namespace qmm_isa.h and
// qmm_fast.h are instantiated in, with the vector type, the dequantization
// of a block and the fast contract's integer dot products they need, written
// as loops the compiler vectorizes for the baseline target. Included by
// qmm.cpp inside its anonymous namespace.

namespace isa_portable {
constexpr int L = 8, kTile = 4;
constexpr int kRows(int) { return 1; }
constexpr int kAcc(int) { return 4; }  // at every tile size: the same sums at every M
constexpr Halves halves = halves_portable;
constexpr Steps steps = steps_portable;
constexpr bool kNarrowBits = true;  // 5- and 6-bit blocks (qmm.cpp's layouts)
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

template <int BITS, bool X = false>
inline Group group(float s, float b) {
  return {s, b};
}
inline void order4(const float* from, float* to) { order4_even_odd(from, to); }
template <int BITS, bool X = false>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  float q[kBlock];  // loops the compiler vectorizes
  if constexpr (narrow_bits(BITS)) {  // the natural order, as 8 bits
    for (int k = 0; k < kBlock; ++k) q[k] = qn_at<BITS>(p, k);
  } else {
    for (int i = 0; i < kBlock / 2; ++i) {
      q[i] = BITS == 8 ? p[i] : p[i] & 15;
      q[i + kBlock / 2] = BITS == 8 ? p[i + kBlock / 2] : p[i] >> 4;
    }
  }
  for (int i = 0; i < kBlock; ++i) q[i] = X ? std::fma(q[i], g.s, g.b) : q[i] * g.s + g.b;
  std::memcpy(w, q, sizeof q);
}
// The fast contract's integer dot products and float lanes (loops the compiler vectorizes).
constexpr int kFastTile = 4;
constexpr int kFastQuads(int) { return 1; }
// One x row: a quad's rows one after another at every K (qmm_fast.h's kSideRowBytes), so no prefetches.
constexpr int kSideRowBytes = std::numeric_limits<int>::max();
constexpr bool kPipeQuads = false;  // a quad's rows, then its sums (pipelined_quads: AVX2's)
constexpr Ahead ask_ahead(size_t) { return {1, 0, false}; }
struct WR {
  uint8_t b[2][64];  // halves A, B of the 4 blocks (16 bytes each)
};
template <int BITS>
inline WR unpack4(const uint8_t* p) {
  WR w;
  for (int blk = 0; blk < 4; ++blk) {
    const uint8_t* q = p + blk * kBlock * BITS / 8;
    for (int i = 0; i < 16; ++i) {  // 5 and 6 bits: as 4 (the even-numbered weights, then the odd ones)
      if constexpr (narrow_bits(BITS)) {
        w.b[0][16 * blk + i] = qn_at<BITS>(q, 2 * i), w.b[1][16 * blk + i] = qn_at<BITS>(q, 2 * i + 1);
      } else {
        w.b[0][16 * blk + i] = BITS == 8 ? q[i] : q[i] & 15;
        w.b[1][16 * blk + i] = BITS == 8 ? q[16 + i] : q[i] >> 4;
      }
    }
  }
  return w;
}
template <int BITS>
inline WR unpack4_n(const uint8_t* p, int n) {
  uint8_t tmp[4 * kBlock * BITS / 8] = {};
  std::memcpy(tmp, p, size_t(n) * kBlock * BITS / 8);
  return unpack4<BITS>(tmp);
}
struct P {
  int32_t v[4];  // the 4 blocks' sums
};
template <int BITS>
inline P dot4(const WR& w, const int8_t* x) {
  P r;
  for (int blk = 0; blk < 4; ++blk) {
    int32_t s = 0;
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 16; ++i) s += int32_t(w.b[h][16 * blk + i]) * x[64 * h + 16 * blk + i];
    }
    r.v[blk] = s;
  }
  return r;
}
// The split contract's sums: 128 * (x's int8 part's) + (its remainder's, lo bytes on).
template <int BITS>
inline P dot4_split(const WR& w, const int8_t* x, size_t lo) {
  const P hi = dot4<BITS>(w, x), rest = dot4<BITS>(w, x + lo);
  P r;
  for (int blk = 0; blk < 4; ++blk) r.v[blk] = hi.v[blk] * 128 + rest.v[blk];
  return r;
}
struct QS {
  int32_t v[16];
};
inline QS reduce_quad(const P& p0, const P& p1, const P& p2, const P& p3) {
  const P* p[4] = {&p0, &p1, &p2, &p3};
  QS r;
  for (int l = 0; l < 16; ++l) r.v[l] = p[l % 4]->v[l / 4];
  return r;
}
// N float lanes and their lane-by-lane products (the fast contract's FQ, the factored one's FF).
template <int N>
struct Lanes {
  float v[N];
};
template <int N>
inline Lanes<N> lanes_mul(Lanes<N> a, const Lanes<N>& b) {
  for (int l = 0; l < N; ++l) a.v[l] *= b.v[l];
  return a;
}
template <int N>
inline Lanes<N> lanes_fma(const Lanes<N>& a, const Lanes<N>& b, Lanes<N> c) {
  for (int l = 0; l < N; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return c;
}
using FQ = Lanes<16>;
inline FQ fq_zero() { return FQ{}; }
inline FQ fq_load(const float* p) {
  FQ r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline float as_float(float a) { return a; }
inline float as_float(uint16_t h) { return half_to_float(h); }
template <class T>  // float, or float16 bits (widened exactly)
inline FQ fq_gather4(const T* r0, const T* r1, const T* r2, const T* r3) {
  const T* r[4] = {r0, r1, r2, r3};
  FQ o;
  for (int l = 0; l < 16; ++l) o.v[l] = as_float(r[l % 4][l / 4]);
  return o;
}
template <class T>  // the first n values of each row, zeros after (reads only those)
inline FQ fq_gather4_n(const T* r0, const T* r1, const T* r2, const T* r3, int n) {
  const T* r[4] = {r0, r1, r2, r3};
  FQ o{};
  for (int l = 0; l < 4 * n; ++l) o.v[l] = as_float(r[l % 4][l / 4]);
  return o;
}
inline FQ fq_mul(FQ a, const FQ& b) { return lanes_mul(a, b); }
inline FQ fq_fma(const FQ& a, const FQ& b, FQ c) { return lanes_fma(a, b, c); }
inline FQ fq_fma_sums(const QS& s, const FQ& d, FQ a) {
  for (int l = 0; l < 16; ++l) a.v[l] = std::fma(float(s.v[l]), d.v[l], a.v[l]);
  return a;
}
inline void fq_rows(const FQ& a, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = (a.v[i] + a.v[4 + i]) + (a.v[8 + i] + a.v[12 + i]);
}
#include "qmm_isa.h"
#include "qmm_fast.h"
// The factored contract (qmm_factored.h): AVX2's lanes and operations, one by one.
using FF = Lanes<8>;
inline FF ff_zero() { return FF{}; }
inline FF ff_splat(float a) {
  FF r;
  std::fill(r.v, r.v + 8, a);
  return r;
}
inline FF ff_load(const float* p) {
  FF r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline FF ff_add(FF a, const FF& b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline FF ff_mul(FF a, const FF& b) { return lanes_mul(a, b); }
inline FF ff_fma(const FF& a, const FF& b, FF c) { return lanes_fma(a, b, c); }
inline float ff_hsum(const FF& a) {
  const float* l = a.v;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
template <int BITS>
inline void ff_qvals(const uint8_t* p, FF* w) {
  if constexpr (BITS == 4) {
    for (int l = 0; l < 4; ++l) {
      uint32_t word;
      std::memcpy(&word, p + 4 * l, 4);  // little-endian, as MLX packs it
      const uint32_t odd = word >> 4;
      w[0].v[l] = float(word & 0xf), w[0].v[l + 4] = float(word & 0xf0000);
      w[1].v[l] = float(odd & 0xf), w[1].v[l + 4] = float(odd & 0xf0000);
      w[2].v[l] = float(word & 0xf00), w[2].v[l + 4] = float(word & 0xf000000);
      w[3].v[l] = float(odd & 0xf00), w[3].v[l + 4] = float(odd & 0xf000000);
    }
  } else {  // 5, 6 and 8 bits: the natural order
    for (int i = 0; i < 4; ++i) {
      for (int l = 0; l < 8; ++l) {
        if constexpr (narrow_bits(BITS)) {
          w[i].v[l] = float(qn_at<BITS>(p, 8 * i + l));
        } else {
          w[i].v[l] = float(p[8 * i + l]);
        }
      }
    }
  }
}
#include "qmm_factored.h"
}  // namespace isa_portable
