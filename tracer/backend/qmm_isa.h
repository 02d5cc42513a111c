// qmm's exact-contract kernels for one instruction set. qmm_ops_*.h include
// this file once per ISA, inside a namespace that defines, under that ISA's
// target pragma:
//   F, L          a vector of L float lanes;
//   kTile         x rows a weight row is multiplied into at once (accumulators in registers);
//   kRows(mt), kAcc(mt)  weight rows a tile of mt x rows takes at once, and the
//                 accumulators each (row, x row) pair has (enough independent chains);
//   halves        float16 scales to float32;
//   steps         a row of superblock scales to float32 (qmm.cpp's widen);
//   splat, loadu, storeu, add, fmadd (a * b + c), hsum (lanes in a fixed order);
//   Group, group<BITS, X>(scale, bias)  what dequant needs of a group;
//   dequant<BITS, X>(p, group, w)  the 32 weights of the packed block at p, each
//       scale * q, rounded, + bias in float32, into w[32 / L] in block order
//       (at 4 bits: the even-numbered weights, then the odd ones; qmm.cpp
//       permutes x to match). X (kExactProducts): the scales are widened
//       float16/bfloat16, so scale * q is exact in float32 (at most 11 + 8
//       significant bits), its rounding a no-op, and one fused multiply-add
//       gives the same bits as the product rounded, then the bias added.
// (qmm_fast.h tiles the fast contract its own way, in quads of weight rows.)
// Everything here is the same for every ISA; only the lane count and the
// accumulation order differ between them.

constexpr int kVecs = kBlock / L;

// fn(std::integral_constant<int, BITS>{}) for a job's bits: 4, 8, and 5 and
// 6 where the ISA's kernels take qmm.cpp's 5- and 6-bit blocks (kNarrowBits).
template <class Fn>
inline void with_bits(int bits, Fn fn) {
  if constexpr (kNarrowBits) {
    if (bits == 5) return fn(std::integral_constant<int, 5>{});
    if (bits == 6) return fn(std::integral_constant<int, 6>{});
  }
  bits == 4 ? fn(std::integral_constant<int, 4>{}) : fn(std::integral_constant<int, 8>{});
}

// out[m0 .. m0 + MT, n .. n + R) = x[m0 .. m0 + MT] . (weight rows n .. n + R): each
// block of each row dequantized once in registers and multiplied into MT rows
// of x. s, b [R][G]: the rows' scales and biases in float32. A row's
// accumulators are its own (A of them for each x row, one constant of the ISA,
// whatever MT): its sums depend neither on R, on MT, nor on which rows share
// its tile, so an output has the same bits at every M up to kSmallMaxM (a
// verify window's rows are its decode steps' rows, bit for bit).
template <int R, int MT, int BITS, bool X>
inline void row_tile(const QmmJob& j, int n, int m0, const float* s, const float* b) {
  constexpr int A = kAcc(MT), bb = kBlock * BITS / 8;
  const int G = j.K / j.group, per = j.group / kBlock;
  const size_t row_bytes = size_t(j.K) * BITS / 8;
  const uint8_t* w0 = packed_row(j, n);
  const size_t ahead = kPrefetchTiles * R * row_bytes;
  const float* xr = j.x + size_t(m0) * j.ldx;
  F acc[R][MT][A];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a) acc[r][m][a] = splat(0.0f);
    }
  }
  const uint8_t* p = w0;
  const float* xk = xr;
  for (int g = 0; g < G; ++g) {
    Group grp[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) grp[r] = group<BITS, X>(s[r * G + g], b[r * G + g]);
    for (int t = 0; t < per; ++t, p += bb, xk += kBlock) {
      if (MT >= kPrefetchMinM && (size_t(p - w0) & 63) < bb) {  // once a line: the rows kPrefetchTiles tiles ahead
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) prefetch(p + r * row_bytes + ahead);
      }
      F w[R][kVecs];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) dequant<BITS, X>(p + r * row_bytes, grp[r], w[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) {
          const F xv = loadu(xk + m * j.ldx + v * L);  // once for the R rows
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][m][v % A] = fmadd(w[r][v], xv, acc[r][m][v % A]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 8
      for (int a = 1; a < A; ++a) acc[r][m][0] = add(acc[r][m][0], acc[r][m][a]);
      j.out[size_t(m0 + m) * j.N + n + r] = hsum(acc[r][m][0]);
    }
  }
}

// A range of weight rows' scales and biases in float32, as a tile reads them:
// row n's at s + (n - n0) * ls and b + (n - n0) * lb.
struct Params {
  const float* s;
  const float* b;
  int ls, lb, n0;
  const float* scales(int n) const { return s + size_t(n - n0) * ls; }
  const float* biases(int n) const { return b + size_t(n - n0) * lb; }
};

// Calls Tile::run<R, MT>(n, m0, params) over rows [n0, n1) for the x rows
// [m0, m0 + MT): Tile::rows(MT) weight rows at once, the rest one by one.
template <class Tile, int MT>
inline void over_tiles_mt(int n0, int n1, int m0, const Tile& t, const Params& p) {
  constexpr int R = Tile::rows(MT);
  int n = n0;
  for (; n + R <= n1; n += R) t.template run<R, MT>(n, m0, p);
  for (; n < n1; ++n) t.template run<1, MT>(n, m0, p);
}

template <class Tile, int MT>
inline void over_tiles_upto(int mt, int n0, int n1, int m0, const Tile& t, const Params& p) {
  if constexpr (MT > 1) {
    if (mt < MT) return over_tiles_upto<Tile, MT - 1>(mt, n0, n1, m0, t, p);
  }
  over_tiles_mt<Tile, MT>(n0, n1, m0, t, p);
}

// Every (weight rows, x rows) tile of out[:, n0 .. n1), x in tiles of kTile
// rows, kParamRows weight rows at a time (their parameters made ready once:
// Tile::params).
constexpr int kParamRows = 16;
template <class Tile>
void over_tiles(const QmmJob& j, int n0, int n1, const Tile& t) {
  for (int a = n0; a < n1; a += kParamRows) {
    const int b = std::min(n1, a + kParamRows);
    const Params p = t.params(a, b);
    for (int m0 = 0; m0 < j.M; m0 += kTile) {
      over_tiles_upto<Tile, kTile>(std::min(kTile, j.M - m0), a, b, m0, t, p);
    }
  }
}

// The exact contract's tiles over the rows' scales [rows, G] and biases [rows, G]:
// float32 ones (S = float) read where they lie; float16 or bfloat16 ones
// (S = uint16_t) widened kParamRows rows at a time, just before their tiles,
// and dequantized with one fused multiply-add (dequant's X: exact products);
// superblock ones (S = int8_t) widened alike, then dequantized as float32
// ones (their products need up to 18 bits: not exact with q's); the next
// kParamRows rows' parameters are prefetched then (0.5.7: a pipelined
// bucket-1 SmolLM2 decode 9.59 -> 9.28 and 9.73 -> 9.57 ms a token, the two
// codes taking turns every 0.25 s in one process).
// 0.5.5 widened a whole chunk's in a pass before its tiles (SmolLM2's 120
// layer matrices at M = 1, one thread, in-process A/B: 9.7 -> 8.9 ms);
// widening each tile's own (R rows) was 5 % slower at 8 x rows, where a tile
// takes one row (Llama-3.2-1B's shape, bucket 8).
template <int BITS, class S>
struct ExactTile {
  const QmmJob& j;
  static constexpr int rows(int mt) { return kRows(mt); }
  Params params(int n0, int n1) const {
    const size_t G = j.K / j.group;
    if constexpr (std::is_same_v<S, float>) {
      const float* s = static_cast<const float*>(j.scales) + n0 * G;
      return {s, static_cast<const float*>(j.biases) + n0 * G, int(G), int(G), n0};
    } else {
      const size_t n = (n1 - n0) * G;  // the rows' scales, then their biases, in float32
      thread_local std::vector<float> rows;
      if (rows.size() < 2 * n) rows.resize(2 * n);
      widen(j.scales, j.scale, n0 * G, int(n), rows.data(), halves, steps, int(G));
      widen(j.biases, j.scale, n0 * G, int(n), rows.data() + n, halves, steps, int(G));
      // the next rows' parameters, which the hardware prefetchers do not fetch in
      // time (perf: half of widen's samples on its loads' first use)
      const size_t rb = scale_row_bytes(j.scale, int(G));
      const size_t end = std::min<size_t>(j.N, n1 + kParamRows) * rb;
      for (size_t at = n1 * rb; at < end; at += 64) {
        prefetch(static_cast<const char*>(j.scales) + at), prefetch(static_cast<const char*>(j.biases) + at);
      }
      return {rows.data(), rows.data() + n, int(G), int(G), n0};
    }
  }
  template <int R, int MT>
  void run(int n, int m0, const Params& p) const {
    row_tile<R, MT, BITS, std::is_same_v<S, uint16_t>>(j, n, m0, p.scales(n), p.biases(n));
  }
};

// fn(tile type) for the job's scales: in place (float32), widened halves, widened superblock ones.
template <template <int, class> class Tile, int BITS, class Fn>
inline void with_scales(const QmmJob& j, Fn fn) {
  j.scale == Scale::f32  ? fn(Tile<BITS, float>{j})
  : j.scale == Scale::sb ? fn(Tile<BITS, int8_t>{j})
                         : fn(Tile<BITS, uint16_t>{j});
}

template <int BITS>
void rows_small_bits(const QmmJob& j, int n0, int n1) {
  with_scales<ExactTile, BITS>(j, [&](const auto& t) { over_tiles(j, n0, n1, t); });
}

// out[:, n0 .. n1) for few rows of x, straight from the packed weights.
void rows_small(const QmmJob& j, int n0, int n1) {
  with_bits(j.bits, [&](auto bits) { rows_small_bits<decltype(bits)::value>(j, n0, n1); });
}

template <int BITS, bool X>
void dequant_rows_bits(const QmmJob& j, int n0, int n1, float* panel) {
  const int G = j.K / j.group;
  std::vector<float> params(2 * size_t(G));
  for (int n = n0; n < n1; ++n) {
    row_params(j, n, params.data(), params.data() + G, halves, steps);
    const uint8_t* wr = packed_row(j, n);
    float* row = panel + size_t(n - n0) * j.K;
    for (int k = 0; k < j.K; k += kBlock) {
      const int g = k / j.group;
      F w[kVecs];
      dequant<BITS, X>(wr + k * BITS / 8, group<BITS, X>(params[g], params[G + g]), w);
      for (int v = 0; v < kVecs; ++v) storeu(row + k + v * L, w[v]);
    }
  }
}

// panel [n1 - n0, K] = weight rows [n0, n1) dequantized, each block in block order.
void dequant_rows(const QmmJob& j, int n0, int n1, float* panel) {
  const bool x = j.scale == Scale::f16 || j.scale == Scale::bf16;  // widened halves: exact products (dequant)
  with_bits(j.bits, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    x ? dequant_rows_bits<B, true>(j, n0, n1, panel) : dequant_rows_bits<B, false>(j, n0, n1, panel);
  });
}
