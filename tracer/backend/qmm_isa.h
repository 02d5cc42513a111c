// qmm's exact-contract kernels for one instruction set. qmm_ops_*.h include
// this file once per ISA, inside a namespace that defines, under that ISA's
// target pragma:
//   F, L          a vector of L float lanes;
//   kTile         x rows a weight row is multiplied into at once (accumulators in registers);
//   kRows(mt), kAcc(mt)  weight rows a tile of mt x rows takes at once, and the
//                 accumulators each (row, x row) pair has (enough independent chains);
//   halves        float16 scales to float32;
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

// A range of weight rows' scales and biases (float32, or float16/bfloat16
// where S is uint16_t), as a tile reads them: row n's at s + (n - n0) * ls and b + (n - n0) * lb.
template <class S = float>
struct Params {
  const S* s;
  const S* b;
  int ls, lb, n0;
  const S* scales(int n) const { return s + size_t(n - n0) * ls; }
  const S* biases(int n) const { return b + size_t(n - n0) * lb; }
};

// Calls Tile::run<R, MT>(n, m0, params) over rows [n0, n1) for the x rows
// [m0, m0 + MT): Tile::rows(MT) weight rows at once, the rest one by one.
template <class Tile, int MT, class P>
inline void over_tiles_mt(int n0, int n1, int m0, const Tile& t, const P& p) {
  constexpr int R = Tile::rows(MT);
  int n = n0;
  for (; n + R <= n1; n += R) t.template run<R, MT>(n, m0, p);
  for (; n < n1; ++n) t.template run<1, MT>(n, m0, p);
}

template <class Tile, int MT, class P>
inline void over_tiles_upto(int mt, int n0, int n1, int m0, const Tile& t, const P& p) {
  if constexpr (MT > 1) {
    if (mt < MT) return over_tiles_upto<Tile, MT - 1>(mt, n0, n1, m0, t, p);
  }
  over_tiles_mt<Tile, MT>(n0, n1, m0, t, p);
}

// Every (weight rows, x rows) tile of out[:, n0 .. n1), x in tiles of kTile rows.
template <class Tile>
void over_tiles(const QmmJob& j, int n0, int n1, const Tile& t) {
  const auto p = t.params(n0, n1);
  for (int m0 = 0; m0 < j.M; m0 += kTile) {
    over_tiles_upto<Tile, kTile>(std::min(kTile, j.M - m0), n0, n1, m0, t, p);
  }
}

// The exact contract's tiles over the rows' scales [rows, G] and biases [rows, G]
// where they lie: float32 ones (S = float) read as they are; float16 or
// bfloat16 ones (S = uint16_t) widened a tile at a time, as the tile starts
// (a pass over a whole chunk's before its tiles waited on memory with
// nothing to overlap: SmolLM2's 120 layer matrices at M = 1, one thread,
// 8.6 -> 7.3 ms, the 8-bit head 3.4 -> 3.1; a decode step at bucket 1
// 11.7 -> 11.0 ms, in-process A/B).
template <int BITS, class S>
struct ExactTile {
  const QmmJob& j;
  static constexpr int rows(int mt) { return kRows(mt); }
  Params<S> params(int n0, int) const {
    const size_t G = j.K / j.group;
    return {static_cast<const S*>(j.scales) + n0 * G, static_cast<const S*>(j.biases) + n0 * G, int(G), int(G), n0};
  }
  template <int R, int MT>
  void run(int n, int m0, const Params<S>& p) const {
    if constexpr (std::is_same_v<S, float>) {
      row_tile<R, MT, BITS, false>(j, n, m0, p.scales(n), p.biases(n));
    } else {
      const int G = j.K / j.group;  // the R rows' scales, then their biases, in float32
      thread_local std::vector<float> tile;
      if (tile.size() < size_t(2 * R * G)) tile.resize(2 * R * G);
      widen(p.scales(n), j.scale, 0, R * G, tile.data(), halves);
      widen(p.biases(n), j.scale, 0, R * G, tile.data() + R * G, halves);
      row_tile<R, MT, BITS, true>(j, n, m0, tile.data(), tile.data() + R * G);
    }
  }
};

template <int BITS>
void rows_small_bits(const QmmJob& j, int n0, int n1) {
  j.scale == Scale::f32 ? over_tiles(j, n0, n1, ExactTile<BITS, float>{j})
                        : over_tiles(j, n0, n1, ExactTile<BITS, uint16_t>{j});
}

// out[:, n0 .. n1) for few rows of x, straight from the packed weights.
void rows_small(const QmmJob& j, int n0, int n1) {
  j.bits == 4 ? rows_small_bits<4>(j, n0, n1) : rows_small_bits<8>(j, n0, n1);
}

template <int BITS, bool X>
void dequant_rows_bits(const QmmJob& j, int n0, int n1, float* panel) {
  const int G = j.K / j.group;
  std::vector<float> params(2 * size_t(G));
  for (int n = n0; n < n1; ++n) {
    row_params(j, n, params.data(), params.data() + G, halves);
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
  const bool x = j.scale != Scale::f32;  // widened halves: exact products (dequant)
  j.bits == 4 ? (x ? dequant_rows_bits<4, true>(j, n0, n1, panel) : dequant_rows_bits<4, false>(j, n0, n1, panel))
              : (x ? dequant_rows_bits<8, true>(j, n0, n1, panel) : dequant_rows_bits<8, false>(j, n0, n1, panel));
}
