// qmm's *fast* contract for one instruction set, included by qmm_ops_*.h once per
// ISA after qmm_isa.h. A kernel step takes a quad: 4 weight rows times 4
// blocks of 32 (a step), each block in two halves (4, 5 and 6 bits: its even-numbered
// weights, then the odd ones; 8 bits: its first 16 weights, then the last 16);
// x is quantized into the same layout (qmm.cpp's quantize_x: a step's 128
// bytes are half A of its 4 blocks, 16 bytes each, then half B of them). The
// including namespace adds:
//   WR, unpack4<BITS>(p)  one row's 4 blocks (packed at p) as unsigned bytes, halves A and B;
//       unpack4_n<BITS>(p, n) its first n < 4 blocks, zeros for the rest (reads only those);
//   P, dot4<BITS>(w, x)   partial integer dot products of those blocks with a step of x
//       (vpdpbusd; maddubs + madd; scalar loops); dot4_split<BITS>(w, x, lo) = 128 * dot4(w, x)
//       + dot4(w, x + lo) (the split contract: x's int8 part, its remainder lo bytes on);
//       optionally (QMM_SPLIT16, below) the split contract's own unpacked form and products;
//   QS, reduce_quad(p0 .. p3)  the 16 blocks' exact int32 sums of the rows p0 .. p3, lane
//       4 j + i: row i's block j (the same integers on every ISA);
//   FQ (16 float lanes in that order): fq_zero, fq_load (16 floats), fq_gather4(r0 .. r3)
//       (lane 4 j + i = r_i[j], from float rows or float16 ones widened in registers;
//       fq_gather4_n, either: r_i[j] for j < n, else 0, reading only those), fq_mul, fq_fma
//       (fused), fq_fma_sums(sums, sd, acc) = fma(float(sums), sd, acc), fq_rows(acc, out)
//       out[i] = (acc[i] + acc[4 + i]) + (acc[8 + i] + acc[12 + i]).
// No horizontal sum per block: a quad's 16 block sums come out of one transpose
// (reduce_quad), are converted and scaled together, and each output's 4 lanes
// are added once at the end.
// The arithmetic, per weight row (scale s and bias b of each group) and x row
// (each 32-block quantized to xq with scale d; per group xg = the sum over its
// blocks, in order, of d * float(sum(xq))), is the same on every ISA path:
//   x . w ~= sum over blocks of s * d * sum(xq * q) + sum over groups of b * xg
// on 4 float lanes j = 0..3: lane j takes the blocks j, j + 4, j + 8, ... in
// order, each acc = fma(float(block's integer sum), s * d (rounded), acc),
// then the groups j, j + 4, ..., each acc = fma(b, xg, acc) (the last step's
// blocks and groups past the row's end are zeros); the result (lane 0 + lane 1) + (lane 2
// + lane 3). Each output's lanes are its own: the bits depend neither on the
// ISA, the thread count, nor on which rows or x rows share a tile.

constexpr int kStep = 4;  // blocks a step (and weight rows a quad)

// A row's 4 blocks unpacked as a contract's tiles take them (U::full(p),
// U::tail(p, n): the first n < 4 blocks, zeros for the rest) times a step
// of an x row (U::dot(w, x, lo)): its int8 sums, or under the split contract
// (x's int8 part at x, its remainder's `lo` bytes on) 128 * the first's +
// the second's. An ISA that defines QMM_SPLIT16 (AVX2) multiplies the split
// contract's x with 8-bit weights as one 16-bit integer a weight instead
// (128 xq + xr, exactly: |.| <= 16320), the weights unpacked to 16-bit lanes
// (WS, unpack_s, unpack_s_n, dot_s; the half-width tail's WS2, unpack_s2_n,
// dot_pair16) and x relaid for it once per call (Path::split_x): the same
// integers, so the same bits, in fewer multiplies a weight.
template <int BITS, bool SPLIT>
struct Unpacked {
  using T = WR;
  static T full(const uint8_t* p) { return unpack4<BITS>(p); }
  static T tail(const uint8_t* p, int n) { return unpack4_n<BITS>(p, n); }
  static P dot(const T& w, const int8_t* x, size_t lo) {
    if constexpr (SPLIT) {
      return dot4_split<BITS>(w, x, lo);
    } else {
      return dot4<BITS>(w, x);
    }
  }
};
#ifdef QMM_SPLIT16
template <>
struct Unpacked<8, true> {
  using T = WS;
  static T full(const uint8_t* p) { return unpack_s(p); }
  static T tail(const uint8_t* p, int n) { return unpack_s_n(p, n); }
  static P dot(const T& w, const int8_t* x, size_t lo) { return dot_s(w, x, lo); }
};
#endif

// An ISA may also run several x rows' full steps its own way (QMM_QUAD_ROWS:
// quad_rows_for(bits, split, mt), quad_rows<BITS, SPLIT, MT>(rows, at, x, ldq,
// lo, quad's scales, xd, ldd, acc[MT]): fast_step's MT > 1 branch, the same
// integers and the same float operations into each accumulator lane; and a
// row's last step of exactly 2 blocks as its first pair, quad_pair<BITS,
// SPLIT, MT>(0, ...), where fast_half_step's loads and gathers checked
// each block).
#ifndef QMM_QUAD_SUMS
// One x row's full step of a quad's 4 rows (packed at w[i] + at): their 16
// blocks' sums (reduce_quad's order). An ISA may define its own (QMM_QUAD_SUMS).
template <int BITS, bool SPLIT>
inline QS quad_sums(const uint8_t* const (&w)[kStep], size_t at, const int8_t* x, size_t lo) {
  using U = Unpacked<BITS, SPLIT>;
  return reduce_quad(U::dot(U::full(w[0] + at), x, lo), U::dot(U::full(w[1] + at), x, lo),
                     U::dot(U::full(w[2] + at), x, lo), U::dot(U::full(w[3] + at), x, lo));
}
#endif

// A range of weight rows' parameters as the fast tiles read them: per row,
// its blocks' scales [K / 32] and its groups' biases [G], in float32 (T =
// float) or, for float16 parameters of group 32 (GGUF's blocks), as stored
// (T = uint16_t: widened in registers as they are gathered, exactly).
template <class T>
struct FastParamsT {
  const T* s;
  const T* b;
  int ls, lb, n0;
  const T* scales(int n) const { return s + size_t(n - n0) * ls; }
  const T* biases(int n) const { return b + size_t(n - n0) * lb; }
};
using FastParams = FastParamsT<float>;

// Four rows' parameters at `at` (r[i] + at .. + 4) in FQ's order; where n <
// 4, the first n of each and zeros after (reading only those).
template <class T>
inline FQ quad_params(const T* const (&r)[kStep], int at, int n) {
  return n >= kStep ? fq_gather4(r[0] + at, r[1] + at, r[2] + at, r[3] + at)
                    : fq_gather4_n(r[0] + at, r[1] + at, r[2] + at, r[3] + at, n);
}

#ifdef QMM_HALF_TAIL
// Unpacked's half-width form (blocks 0 and 1): U::tail(p, n <= 2), U::dot.
template <int BITS, bool SPLIT>
struct Unpacked2 {
  using T = WR2;
  static T tail(const uint8_t* p, int n) { return unpack2_n<BITS>(p, n); }
  static auto dot(const T& w, const int8_t* x, size_t lo) { return dotx2<BITS, SPLIT>(w, x, lo); }
};
#ifdef QMM_SPLIT16
template <>
struct Unpacked2<8, true> {
  using T = WS2;
  static T tail(const uint8_t* p, int n) { return unpack_s2_n(p, n); }
  static auto dot(const T& w, const int8_t* x, size_t) { return dot_pair16(w.v, x); }
};
#endif

// A row's last step of nb <= 2 blocks at half the vector width (the ISA's
// WR2, unpack2_n, dotx2, reduce_quad2, fq_fma_sums2: the lanes of blocks 0
// and 1 only), so that it costs half a step, not a whole one (SmolLM2's K =
// 576 is 4 steps and 2 blocks). The same integers and the same fused
// multiply-adds into those lanes; the lanes of blocks 2 and 3, which the
// whole-width step adds zeros to (acc is never -0: it starts at +0), are
// left as they are.
template <int Q, int MT, int BITS, bool SPLIT, class T>
inline void fast_half_step(const uint8_t* const (&w)[Q][kStep], const T* const (&s)[Q][kStep], int k, int nb,
                           const int8_t* xq, size_t ldq, size_t lo, const float* xd, size_t ldd, FQ (&acc)[Q][MT]) {
  constexpr int bb = kBlock * BITS / 8;
  const size_t at = size_t(k) * kStep * bb;
  const int kt = kStep * k;
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    typename Unpacked2<BITS, SPLIT>::T wr[kStep];
#pragma GCC unroll 4
    for (int i = 0; i < kStep; ++i) wr[i] = Unpacked2<BITS, SPLIT>::tail(w[q][i] + at, nb);
    const FQ sq = fq_gather4_n(s[q][0] + kt, s[q][1] + kt, s[q][2] + kt, s[q][3] + kt, nb);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const int8_t* x = xq + m * ldq + kt * kBlock;
      using U = Unpacked2<BITS, SPLIT>;
      const QS2 sums = reduce_quad2(U::dot(wr[0], x, lo), U::dot(wr[1], x, lo), U::dot(wr[2], x, lo), U::dot(wr[3], x, lo));
      acc[q][m] = fq_fma_sums2(sums, fq_mul(sq, fq_load(xd + m * ldd + kt * kStep)), acc[q][m]);
    }
  }
}
#endif

// One step (blocks 4 k .. 4 k + 4, the row's last nb < 4 blocks where kTail) of
// quads [Q] of weight rows (packed at w[q][i], their block scales at s[q][i])
// into the accumulators of MT x rows.
template <int Q, int MT, int BITS, bool kTail, bool SPLIT, class T>
inline void fast_step(const uint8_t* const (&w)[Q][kStep], const T* const (&s)[Q][kStep], int k, int nb,
                      const int8_t* xq, size_t ldq, size_t lo, const float* xd, size_t ldd, FQ (&acc)[Q][MT],
                      size_t pf_ahead) {
  constexpr int bb = kBlock * BITS / 8;  // bytes a block
  const size_t at = size_t(k) * kStep * bb;
  const int kt = kStep * k;
#ifdef QMM_QUAD_ROWS
  if constexpr (kTail && MT > 1 && quad_rows_for(BITS, SPLIT, MT)) {
    if (nb == kStep / 2) {  // blocks 0 and 1 alone: the ISA's first pair of a full step, the same operations
#pragma GCC unroll 4
      for (int q = 0; q < Q; ++q) {
        quad_pair<BITS, SPLIT, MT>(0, w[q], at, xq + kt * kBlock, ldq, lo, quad_params(s[q], kt, nb), xd + kt * kStep,
                                   ldd, acc[q]);
      }
      return;
    }
  }
#endif
#ifdef QMM_HALF_TAIL
  if constexpr (kTail && half_tail(BITS, MT)) {
    if (nb <= kStep / 2) return fast_half_step<Q, MT, BITS, SPLIT, T>(w, s, k, nb, xq, ldq, lo, xd, ldd, acc);
  }
#endif
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    if (MT >= kPrefetchMinM && MT > 1) {  // the same bytes of the rows kPrefetchTiles tiles ahead (one row: fast_tile's)
      const size_t ahead = pf_ahead;
#pragma GCC unroll 4
      for (int i = 0; i < kStep; ++i) {
#pragma GCC unroll 2
        for (int l = 0; l < kStep * bb; l += 64) prefetch(w[q][i] + at + ahead + l);
      }
    }
    const FQ sq = quad_params(s[q], kt, kTail ? nb : kStep);
    if constexpr (MT == 1 && !kTail) {
      acc[q][0] = fq_fma_sums(quad_sums<BITS, SPLIT>(w[q], at, xq + kt * kBlock, lo), fq_mul(sq, fq_load(xd + kt * kStep)),
                              acc[q][0]);
      continue;
    }
#ifdef QMM_QUAD_ROWS
    if constexpr (MT > 1 && !kTail && quad_rows_for(BITS, SPLIT, MT)) {  // the ISA's own order (the same operations a lane)
      quad_rows<BITS, SPLIT, MT>(w[q], at, xq + kt * kBlock, ldq, lo, sq, xd + kt * kStep, ldd, acc[q]);
      continue;
    }
#endif
    using U = Unpacked<BITS, SPLIT>;
    typename U::T wr[kStep];
#pragma GCC unroll 4
    for (int i = 0; i < kStep; ++i) wr[i] = kTail ? U::tail(w[q][i] + at, nb) : U::full(w[q][i] + at);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const int8_t* x = xq + m * ldq + kt * kBlock;
      const QS sums = reduce_quad(U::dot(wr[0], x, lo), U::dot(wr[1], x, lo), U::dot(wr[2], x, lo), U::dot(wr[3], x, lo));
      acc[q][m] = fq_fma_sums(sums, fq_mul(sq, fq_load(xd + m * ldd + kt * kStep)), acc[q][m]);
    }
  }
}

// One x row: the partial sums of a weight row (packed at `row`) over steps
// [k0, k1) into part[k - k0]: its whole steps (below `full`), then its last
// step of nb < 4 blocks (at half width where nb <= 2: fast_half_step's
// sums, blocks 2 and 3 zero sums as they were).
template <int BITS, bool SPLIT>
inline void row_partials(const uint8_t* row, int k0, int k1, int full, int nb, const int8_t* xq, size_t lo, P* part) {
  constexpr int bb = kBlock * BITS / 8;
  using U = Unpacked<BITS, SPLIT>;
  const int kf = std::min(k1, full);
  for (int k = k0; k < kf; ++k) part[k - k0] = U::dot(U::full(row + size_t(k) * kStep * bb), xq + k * kStep * kBlock, lo);
  if (kf == k1) return;
  const uint8_t* at = row + size_t(kf) * kStep * bb;
  const int8_t* x = xq + kf * kStep * kBlock;
#ifdef QMM_HALF_TAIL
  if (nb <= kStep / 2) {
    using U2 = Unpacked2<BITS, SPLIT>;
    part[kf - k0] = p_from_half(U2::dot(U2::tail(at, nb), x, lo));
    return;
  }
#endif
  part[kf - k0] = U::dot(U::tail(at, nb), x, lo);
}

// A quad's steps [k0, k1) (its rows' partial sums part[i][k - k0], their
// block scales at s[i]) scaled by x's and added to acc, a step after another.
template <int S, class T>
inline FQ scaled_steps(const P (&part)[kStep][S], const T* const (&s)[kStep], int k0, int k1, int full, int nb,
                       const float* xd, FQ acc) {
  for (int k = k0; k < k1; ++k) {
    const int kt = kStep * k, c = k - k0;
    acc = fq_fma_sums(reduce_quad(part[0][c], part[1][c], part[2][c], part[3][c]),
                      fq_mul(quad_params(s, kt, k < full ? kStep : nb), fq_load(xd + kt * kStep)), acc);
  }
  return acc;
}

// out[m0 .. m0 + MT, n .. min(n + 4 Q, n1)) under the fast contract; rows past
// n1 compute row n1 - 1 again, unstored.
template <int Q, int MT, int BITS, bool SPLIT, class T>
[[gnu::always_inline]] inline void fast_tile_body(const QmmJob& j, int n, int n1, int m0, const FastParamsT<T>& p) {
  const int B = j.K / kBlock, G = j.K / j.group, Bp = fast_blocks(j.K), Gp = fast_groups(G), full = B / kStep;
  const size_t lo = size_t(Bp) * kBlock, ldq = lo * (SPLIT ? 2 : 1), ldd = size_t(Bp) * kStep, ldg = size_t(Gp) * kStep;
  const int8_t* xq = j.xq + m0 * ldq;
  const float* xd = j.xd + m0 * ldd;
  const float* xg = j.xg + m0 * ldg;
  const uint8_t* w[Q][kStep];
  const T* s[Q][kStep];
  const T* b[Q][kStep];
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
#pragma GCC unroll 4
    for (int i = 0; i < kStep; ++i) {
      const int r = std::min(n + kStep * q + i, n1 - 1);
      w[q][i] = packed_row(j, r), s[q][i] = p.scales(r), b[q][i] = p.biases(r);
    }
  }
  FQ acc[Q][MT];
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[q][m] = fq_zero();
  }
  if (MT == 1 && Q == 1 && j.K * BITS / 8 < kSideRowBytes) {
    // One x row with rows shorter than the ISA reads side by side (its
    // kSideRowBytes): a row after the other (in segments of kSeg steps), the
    // partial sums waiting in L1 for the quad's 4 rows. kSeg 64 (0.5.24;
    // was 16): rows of up to K = 8192 read in one run each, not 4 strided
    // runs of 1 KB (Llama-3.2-1B's down projection, 2048 x 8192, split,
    // 2 threads on AVX2, configurations interleaved in one process: 0.644
    // against 0.680 ms a call, 128 no better; K <= 2048 unchanged). Where
    // the ISA pipelines such rows (kPipeQuads), only a range's last quad,
    // cut short by its end, comes here; the others run pipelined_quads.
    constexpr int kSeg = 64;
    const int steps = full + (full * kStep < B), nb = B - full * kStep;
    P part[kStep][kSeg];
    for (int k0 = 0; k0 < steps; k0 += kSeg) {
      const int k1 = std::min(steps, k0 + kSeg);
#pragma GCC unroll 4
      for (int i = 0; i < kStep; ++i) row_partials<BITS, SPLIT>(w[0][i], k0, k1, full, nb, xq, lo, part[i]);
      acc[0][0] = scaled_steps(part, s[0], k0, k1, full, nb, xd, acc[0][0]);
    }
  } else {
    const size_t ahead = size_t(kPrefetchTiles) * kStep * Q * j.K * BITS / 8;  // bytes
    // One x row (decode: weights from memory), its rows of at least
    // kSideRowBytes: the steps read a quad's 4 rows side by side (x's step
    // loaded once for the 4, their sums transposed at once, none waiting in
    // memory), which the hardware's prefetchers do not follow as they follow
    // one row after another (the order above, 0.5.20's on every ISA): each
    // step asks for its share of the lines of the quad ask_ahead(quad's
    // bytes).far ahead (into L2) and .near ahead (into L1; 0: none), the
    // quad's rows being one run of bytes, and where .params, at its first
    // step, for the far quad's scales and biases (float16 ones read in
    // place: GGUF's blocks); none for a quad that starts past the matrix's
    // last row.
    const auto ask = [&](int k) {
      if constexpr (MT == 1 && Q == 1) {
        const size_t quad_bytes = size_t(kStep) * j.K * BITS / 8;
        const Ahead a = ask_ahead(quad_bytes);
        const int steps = full + (full * kStep < B), fq = a.far;
        const size_t per_step = (quad_bytes / 64 + steps - 1) / steps * 64;  // >= quad_bytes / steps, whole lines
        const char* quad = reinterpret_cast<const char*>(w[0][0]);
        const bool far = n + kStep * fq < j.N, near = a.near > 0 && n + kStep * a.near < j.N;
        for (size_t l = k * per_step, e = std::min(quad_bytes, l + per_step); l < e; l += 64) {
          if (far) prefetch_l2(quad + fq * quad_bytes + l);
          if (near) prefetch(quad + a.near * quad_bytes + l);
        }
        if constexpr (std::is_same_v<T, uint16_t>) {
          if (a.params && far && k == 0) {
            const auto lines = [&](const T* row0, int ld) {
              const char* at = reinterpret_cast<const char*>(row0 + size_t(fq) * kStep * ld);
              for (size_t l = 0; l < size_t(kStep) * ld * sizeof(T); l += 64) prefetch_l2(at + l);
            };
            lines(s[0][0], p.ls), lines(b[0][0], p.lb);
          }
        }
      }
    };
    for (int k = 0; k < full; ++k) {
      ask(k);
      fast_step<Q, MT, BITS, false, SPLIT, T>(w, s, k, kStep, xq, ldq, lo, xd, ldd, acc, ahead);
    }
    if (full * kStep < B) {
      ask(full);
      fast_step<Q, MT, BITS, true, SPLIT, T>(w, s, full, B - full * kStep, xq, ldq, lo, xd, ldd, acc, ahead);
    }
  }
  for (int g = 0; g < G; g += kStep) {
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) {
      const FQ bq = quad_params(b[q], g, G - g);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) acc[q][m] = fq_fma(bq, fq_load(xg + m * ldg + g * kStep), acc[q][m]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    const int valid = std::min(kStep, n1 - n - kStep * q);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      float o[kStep];
      fq_rows(acc[q][m], o);
      float* to = j.out + size_t(m0 + m) * j.N + n + kStep * q;
      if (valid == kStep) {
        std::memcpy(to, o, sizeof o);
      } else {
        for (int i = 0; i < valid; ++i) to[i] = o[i];
      }
    }
  }
}

template <int Q, int MT, int BITS, bool SPLIT, class T>
[[gnu::noinline]] void fast_tile(const QmmJob& j, int n, int n1, int m0, const FastParamsT<T>& p) {
  fast_tile_body<Q, MT, BITS, SPLIT>(j, n, n1, m0, p);
}

// One x row over the whole quads [n, e) of rows read one after another (an
// ISA's kPipeQuads, rows of fewer than kSideRowBytes and at most kPipeSteps
// steps): each quad's rows are read into its partial sums while the quad
// before has its sums scaled and added up, a chain of fused multiply-adds
// (its steps', then its groups', into one accumulator) that fast_tile_body
// runs with nothing else to do. The same operations in the same order a
// quad (the first branch of fast_tile_body, its groups and its output), so
// the same bits. 0.5.26, AVX2, SmolLM2's shapes, split contract, one
// thread (us a call; weights in L2/L3, then streamed from memory): gate/up
// 3072 x 576 78.2 -> 68.4 and 87.8 -> 80.0; the head's 49152 x 576 at 8
// bits 2242 -> 2088 from memory. Two quads' partial sums in L1 (8 KB).
constexpr int kPipeSteps = 16;
template <int BITS, bool SPLIT, class T>
[[gnu::noinline]] void pipelined_quads(const QmmJob& j, int n, int e, const FastParamsT<T>& p) {
  const int B = j.K / kBlock, G = j.K / j.group, full = B / kStep;
  const int steps = full + (full * kStep < B), nb = B - full * kStep;
  const size_t lo = size_t(fast_blocks(j.K)) * kBlock;
  using Part = P[kStep][kPipeSteps];
  Part part[2];
  const auto sums = [&](int q0, Part& pt) {  // the quad at row q0: its rows' partial sums
#pragma GCC unroll 4
    for (int i = 0; i < kStep; ++i) row_partials<BITS, SPLIT>(packed_row(j, q0 + i), 0, steps, full, nb, j.xq, lo, pt[i]);
  };
  const auto finish = [&](int q0, const Part& pt) {  // ... scaled, added up and stored
    const T* s[kStep];
    const T* b[kStep];
    for (int i = 0; i < kStep; ++i) s[i] = p.scales(q0 + i), b[i] = p.biases(q0 + i);
    FQ acc = scaled_steps(pt, s, 0, steps, full, nb, j.xd, fq_zero());
    for (int g = 0; g < G; g += kStep) acc = fq_fma(quad_params(b, g, G - g), fq_load(j.xg + g * kStep), acc);
    float o[kStep];
    fq_rows(acc, o);
    std::memcpy(j.out + q0, o, sizeof o);
  };
  sums(n, part[0]);
  int c = 0;
  for (int q = n + kStep; q < e; q += kStep, c ^= 1) {
    sums(q, part[c ^ 1]);
    finish(q - kStep, part[c]);
  }
  finish(e - kStep, part[c]);
}

// Whether one x row over rows of K (bits each) runs pipelined_quads.
inline bool pipelines(int K, int bits) {
  return kPipeQuads && K * bits / 8 < kSideRowBytes && (K / kBlock + kStep - 1) / kStep <= kPipeSteps;
}

// The fast contract's x (qmm.cpp's quantize_x): plain loops the compiler
// vectorizes for this ISA, of exact operations only (max, a multiply, rounding
// by adding and subtracting 1.5 * 2^23; the split contract's remainder one
// fused multiply-add), so every ISA gives the same bytes; an ISA that
// defines QMM_X_BLOCK (AVX2) takes a block with the same operations on its
// vectors (x_block(x, even_odd, q, r, d, sum); false: the loops take it).
// xq [M, Bp * 32]: per step of 4 blocks, half A of each block, then half B;
// xd [M, Bp * 4]: block b's d at 16 (b / 4) + 4 (b % 4) + 0..3 (the lanes of
// FQ's block b % 4); xg [M, Gp * 4] likewise per group: the sum over its
// blocks, in order, of d * float(the block's sum of xq).
// Split (j.split): xq [2 M, Bp * 32], x row m's int8 part xq (as above, with
// d = max |x| / 127) at row 2 m and at row 2 m + 1 its remainder r = fma(-d,
// xq, x) (|r| <= d / 2) quantized with d / 128: xr = round(r * 128 / d), in
// [-64, 64]. So x ~= d / 128 * (128 xq + xr), a 15-bit integer a weight; the
// block's scale in xd is d / 128 and its sum in xg's that of 128 xq + xr.
void quantize_x_rows(const QmmJob& j, int8_t* xq, float* xd, float* xg) {
  const int B = j.K / kBlock, Bp = fast_blocks(j.K), Gp = fast_groups(j.K / j.group), per = j.group / kBlock;
  const size_t ldq = size_t(Bp) * kBlock;
  constexpr float kRound = 12582912.0f;
  // A block's integers qi into its place q in an xq row.
  const auto put = [&](int8_t* q, const int32_t* qi) {
    for (int i = 0; i < kBlock / 2; ++i) {
      if (j.bits != 8) {  // 4, 5 and 6 bits: the even-numbered weights, then the odd ones
        q[i] = int8_t(qi[2 * i]), q[64 + i] = int8_t(qi[2 * i + 1]);
      } else {
        q[i] = int8_t(qi[i]), q[64 + i] = int8_t(qi[16 + i]);
      }
    }
  };
  for (int m = 0; m < j.M; ++m) {
    float* xgm = xg + size_t(m) * Gp * kStep;
    for (int blk = 0; blk < B; ++blk) {
      const float* x = j.x + size_t(m) * j.ldx + blk * kBlock;
      const auto place = [&](size_t row) { return xq + row * ldq + blk / kStep * (kStep * kBlock) + blk % kStep * 16; };
      // the block's d and sum (xd's and xg's), from the ISA's vector code where it has one
      const auto scaled = [&](float d, int sum) {
        float* dm = xd + size_t(m) * Bp * kStep + blk / kStep * 16 + blk % kStep * kStep;
        for (int i = 0; i < kStep; ++i) dm[i] = d;
        const int g = blk / per;
        float* gm = xgm + g / kStep * 16 + g % kStep * kStep;
        const float v = (blk % per == 0 ? 0.0f : gm[0]) + d * float(sum);
        for (int i = 0; i < kStep; ++i) gm[i] = v;
      };
#ifdef QMM_X_BLOCK
      {
        float d;
        int sum;
        if (x_block(x, j.bits != 8, place(j.split ? 2 * size_t(m) : size_t(m)),
                    j.split ? place(2 * size_t(m) + 1) : nullptr, d, sum)) {
          scaled(d, sum);
          continue;
        }
      }
#endif
      uint32_t abits = 0;  // max |x| as bits: non-negative floats order as their bits
      for (int i = 0; i < kBlock; ++i) abits = std::max(abits, std::bit_cast<uint32_t>(x[i]) & 0x7fffffffu);
      const float amax = std::bit_cast<float>(abits), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const bool finite = abits < 0x7f800000u;  // else the block's q are 0 and its d NaN: NaN out, as exact gives
      float d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
      int32_t qi[kBlock];
      int sum = 0;
      for (int i = 0; i < kBlock; ++i) {
        qi[i] = finite ? int32_t((x[i] * inv + kRound) - kRound) : 0;  // |x * inv| <= 127 (and a rounding)
        sum += qi[i];
      }
      put(place(j.split ? 2 * size_t(m) : size_t(m)), qi);
      if (j.split) {
        const float inv2 = inv * 128.0f;  // exact: a power of two
        int32_t ri[kBlock];
        int sum2 = 0;
        for (int i = 0; i < kBlock; ++i) {
          const float r = std::fma(-d, float(qi[i]), x[i]);
          ri[i] = finite ? int32_t((r * inv2 + kRound) - kRound) : 0;  // |r * inv2| <= 64 (and roundings)
          sum2 += ri[i];
        }
        put(place(2 * size_t(m) + 1), ri);
        d *= 0x1p-7f, sum = 128 * sum + sum2;
      }
      scaled(d, sum);
    }
  }
}

// The fast contract's tiles: the rows' scales and biases widened [rows, G]
// each (past group 32, each block's scale [rows, K / 32] after them) into
// the thread's buffer, kParamRows rows at a time just before their quads, as
// the exact contract's tiles widen theirs; float32 and float16 ones of group
// 32 are read in place (float16, GGUF's blocks: widened in registers as the
// tiles gather them, no pass storing them widened first; the Llama-3.2-1B
// shape's bucket-1 step 43.0 -> 38.5 ms, README Performance 0.5.16).
// out[i PER + k] = in[i] (i < n, k < PER): blocks' scales from their groups', a loop the compiler
// vectorizes for the ISA. Before 0.5.31 a loop over rows and blocks with a run-time shift: SmolLM2
// as MLX's 4-bit blocks (group 64, bfloat16 scales), a bucket-1 step 12.39, 12.17 -> 10.70, 10.05 ms,
// the head 1.82, 1.77 -> 1.32, 1.30 ms (kernel_profile.py, the two builds in turns, load ~1.2).
template <int PER>
inline void repeat_each(const float* in, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    for (int k = 0; k < PER; ++k) out[i * PER + k] = in[i];
  }
}

template <int BITS, bool SPLIT>
struct FastTile {
  static constexpr int kBits = BITS;
  static constexpr bool kSplit = SPLIT;
  const QmmJob& j;
  // Rows [n0, n1)'s parameters as fast_tile reads them.
  FastParams params(int n0, int n1, std::vector<float>& buffer) const {
    const int G = j.K / j.group, per = j.group / kBlock, B = j.K / kBlock;
    const size_t rows = n1 - n0;
    if (j.scale == Scale::f32 && per == 1) {  // read in place (Q4_K.s exact blocks): no copy to make
      return {static_cast<const float*>(j.scales) + size_t(n0) * G, static_cast<const float*>(j.biases) + size_t(n0) * G,
              G, G, n0};
    }
    buffer.resize(rows * (2 * G + (per > 1 ? B : 0)));
    float* ws = buffer.data();  // the rows' scales, then biases, as widened
    float* wb = ws + rows * G;
    widen(j.scales, j.scale, size_t(n0) * G, rows * G, ws, halves, steps, G);
    widen(j.biases, j.scale, size_t(n0) * G, rows * G, wb, halves, steps, G);
    if (per == 1) return {ws, wb, G, G, n0};
    float* s = wb + rows * G;  // block blk of row r: s[r B + blk] = ws[r G + blk / per], i.e. each scale per times
    per == 2 ? repeat_each<2>(ws, rows * G, s) : repeat_each<4>(ws, rows * G, s);
    return {s, wb, B, G, n0};
  }
  // The float16 parameters of group 32 from row n0 on, in place (the rows a tile reads of them).
  FastParamsT<uint16_t> halves_in_place(int n0) const {
    const int G = j.K / j.group;
    return {static_cast<const uint16_t*>(j.scales) + size_t(n0) * G, static_cast<const uint16_t*>(j.biases) + size_t(n0) * G,
            G, G, n0};
  }
  template <int Q, int MT, class Params>
  void run(int n, int n1, int m0, const Params& p) const {
    if constexpr (MT == 1 && kSideRowBytes == 0) {  // inlined into the loop over quads (fast_quads_mt)
      fast_tile_body<Q, MT, BITS, SPLIT>(j, n, n1, m0, p);
    } else {
      fast_tile<Q, MT, BITS, SPLIT>(j, n, n1, m0, p);
    }
  }
};

template <class Tile, int MT, class Params>
inline void fast_quads_mt(int n0, int n1, int m0, const Tile& t, const Params& p) {
  constexpr int Q = kFastQuads(MT);
  int n = n0;
  if constexpr (MT == 1 && kPipeQuads) {  // the whole quads (of kParamRows rows: widened parameters)
    if (m0 == 0 && pipelines(t.j.K, t.j.bits) && n1 - n0 >= kStep) {
      n = n0 + (n1 - n0) / kStep * kStep;
      pipelined_quads<Tile::kBits, Tile::kSplit>(t.j, n0, n, p);
    }
  }
  for (; n + kStep * Q <= n1; n += kStep * Q) t.template run<Q, MT>(n, n1, m0, p);
  for (; n < n1; n += kStep) t.template run<1, MT>(n, n1, m0, p);
}

template <class Tile, int MT, class Params>
inline void fast_quads_upto(int mt, int n0, int n1, int m0, const Tile& t, const Params& p) {
  if constexpr (MT > 1) {
    if (mt < MT) return fast_quads_upto<Tile, MT - 1>(mt, n0, n1, m0, t, p);
  }
  fast_quads_mt<Tile, MT>(n0, n1, m0, t, p);
}

// Rows [n0, n1) in blocks of kParamRows (whole quads), every x tile over
// each: the fewest tiles of at most kFastTile x rows, as even as they go (8
// rows in tiles of 5: 4 and 4, not 5 and 3; 6: 3 and 3, not 5 and a row
// alone, whose tile costs most of a wide one's time).
template <int BITS, bool SPLIT>
void fast_rows_bits(const QmmJob& j, int n0, int n1) {
  static_assert(kParamRows % kStep == 0);
  thread_local std::vector<float> buffer;
  const FastTile<BITS, SPLIT> t{j};
  const bool halves = j.scale == Scale::f16 && j.group == kBlock;
  if (j.M == 1 && halves && pipelines(j.K, BITS)) {  // parameters read in place: the range's whole quads at once
    const int e = n0 + (n1 - n0) / kStep * kStep;
    if (e > n0) pipelined_quads<BITS, SPLIT>(j, n0, e, t.halves_in_place(n0));
    if (e < n1) fast_quads_mt<FastTile<BITS, SPLIT>, 1>(e, n1, 0, t, t.halves_in_place(e));
    return;
  }
  for (int a = n0; a < n1; a += kParamRows) {
    const int b = std::min(n1, a + kParamRows);
    const auto tiles = [&](const auto& p) {
      const int count = (j.M + kFastTile - 1) / kFastTile;
      for (int i = 0, m0 = 0; i < count; ++i) {
        const int mt = (j.M - m0 + (count - i) - 1) / (count - i);
        fast_quads_upto<FastTile<BITS, SPLIT>, kFastTile>(mt, a, b, m0, t, p);
        m0 += mt;
      }
    };
    halves ? tiles(t.halves_in_place(a)) : tiles(t.params(a, b, buffer));
  }
}

// out[:, n0 .. n1) under the fast or split contract (x quantized in j.xq, j.xd, j.xg), any M.
void fast_rows(const QmmJob& j, int n0, int n1) {
  with_bits(j.bits, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    j.split ? fast_rows_bits<B, true>(j, n0, n1) : fast_rows_bits<B, false>(j, n0, n1);
  });
}
