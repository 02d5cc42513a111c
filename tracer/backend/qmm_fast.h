// qmm's *fast* contract for one instruction set, included by qmm_ops_*.h once per
// ISA after qmm_isa.h (whose tiles it reuses). Weights go 8 blocks of 32 at a
// time (a superblock), as 4 pairs of blocks (i, i + 4), each block in two
// halves (4 bits: its even-numbered weights, then the odd ones; 8 bits: its
// first 16 weights, then the last 16); x is quantized into the same layout
// (qmm.cpp's quantize_x: a pair's 64 bytes are half A of blocks i and i + 4,
// then half B of both). The including namespace adds:
//   WP, unpack_pair<BITS>(p0, p1)  blocks i and i + 4 (packed at p0, p1) as unsigned bytes;
//   I, pair_dot<BITS>(w, x)  8 int32 lanes: 0-3 partial sums of block i . x, 4-7 of
//       block i + 4 (vpdpbusd; maddubs + madd; scalar: exact integers on every ISA);
//   reduce4(v0 .. v3)  lane b = block b's sum, from the 4 pairs' lanes; i_zero();
//   FA, fa_zero, fa_add, fa_mul(a, b) (8 floats each), fa_mul_n (the first n, the rest 0),
//       fa_fma_blocks(sums, d, acc) = acc + float(sums) * d, hsum8.
// Per 32-block of a weight row with scale s and bias b (its group's) and of an
// x row quantized to xq with scale xd:
//   x . w ~= s * xd * sum(xq * q) + b * xd * sum(xq)
// the first term on 8 float lanes (one a block of the superblock), the second
// once per row as the product of the row's biases with x's per-group sums of
// xd * sum(xq), added to the same lanes; both in a fixed order.

constexpr int kSuper = 8;  // blocks a step

// out[m0 .. m0 + MT, n .. n + R) under the fast contract; s [R][B] the
// rows' scales of each block, b [R][G] their biases, as FastTile::params
// lays them out.
template <int R, int MT, int BITS>
inline void fast_tile(const QmmJob& j, int n, int m0, const float* s, const float* b) {
  constexpr int bb = kBlock * BITS / 8;  // bytes a block
  static const uint8_t zeros[kBlock] = {};  // the blocks past the row's end in its last superblock
  const int B = j.K / kBlock, Bp = fast_blocks(j.K), G = j.K / j.group, Gb = fast_groups(G);
  const uint8_t* wr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) wr[r] = packed_row(j, n + r);
  FA acc[R][MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[r][m] = fa_zero();
  }
  for (int b0 = 0; b0 < B; b0 += kSuper) {
    const int nb = std::min(kSuper, B - b0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* at = wr[r] + size_t(b0) * bb;
      const float* sr = s + r * B + b0;
      prefetch(at + kPrefetch * BITS / 8);
      if (nb == kSuper) {
        WP w[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) w[p] = unpack_pair<BITS>(at + p * bb, at + (p + 4) * bb);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = j.xq + size_t(m0 + m) * Bp * kBlock + b0 * kBlock;
          const I sums = reduce4(pair_dot<BITS>(w[0], x), pair_dot<BITS>(w[1], x + 64),
                                 pair_dot<BITS>(w[2], x + 128), pair_dot<BITS>(w[3], x + 192));
          acc[r][m] = fa_fma_blocks(sums, fa_mul(sr, j.xd + size_t(m0 + m) * Bp + b0), acc[r][m]);
        }
      } else {  // the row's last nb < 8 blocks: the pairs that hold one, the rest zeros
        const int pairs = std::min(nb, 4);
        WP w[4];
        for (int p = 0; p < pairs; ++p) w[p] = unpack_pair<BITS>(at + p * bb, p + 4 < nb ? at + (p + 4) * bb : zeros);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = j.xq + size_t(m0 + m) * Bp * kBlock + b0 * kBlock;
          I d[4];
#pragma GCC unroll 8
          for (int p = 0; p < 4; ++p) d[p] = p < pairs ? pair_dot<BITS>(w[p], x + 64 * p) : i_zero();
          acc[r][m] = fa_fma_blocks(reduce4(d[0], d[1], d[2], d[3]),
                                    fa_mul_n(sr, j.xd + size_t(m0 + m) * Bp + b0, nb), acc[r][m]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const float* xg = j.xg + size_t(m0 + m) * Gb;  // [Gb]
      int g = 0;
      for (; g + 8 <= G; g += 8) acc[r][m] = fa_add(acc[r][m], fa_mul(b + r * G + g, xg + g));
      if (g < G) acc[r][m] = fa_add(acc[r][m], fa_mul_n(b + r * G + g, xg + g, G - g));
      j.out[size_t(m0 + m) * j.N + n + r] = hsum8(acc[r][m]);
    }
  }
}

// The fast contract's x (qmm.cpp's quantize_x): plain loops the compiler
// vectorizes for this ISA, of exact operations only (max, a multiply, rounding
// by adding and subtracting 1.5 * 2^23), so every ISA gives the same bytes.
void quantize_x_rows(const QmmJob& j, int8_t* xq, float* xd, float* xg) {
  const int B = j.K / kBlock, Bp = fast_blocks(j.K), Gb = fast_groups(j.K / j.group), per = j.group / kBlock;
  constexpr float kRound = 12582912.0f;
  for (int m = 0; m < j.M; ++m) {
    for (int blk = 0; blk < B; ++blk) {
      const float* x = j.x + size_t(m) * j.ldx + blk * kBlock;
      uint32_t abits = 0;  // max |x| as bits: non-negative floats order as their bits
      for (int i = 0; i < kBlock; ++i) abits = std::max(abits, std::bit_cast<uint32_t>(x[i]) & 0x7fffffffu);
      const float amax = std::bit_cast<float>(abits), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const bool finite = abits < 0x7f800000u;  // else the block's q are 0 and its d NaN: NaN out, as exact gives
      const float d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
      int32_t qi[kBlock];
      int sum = 0;
      for (int i = 0; i < kBlock; ++i) {
        qi[i] = finite ? int32_t((x[i] * inv + kRound) - kRound) : 0;  // |x * inv| <= 127 (and a rounding)
        sum += qi[i];
      }
      // the block's place: its superblock, its pair (i, i + 4), first or second in the pair; then half A or B
      int8_t* q = xq + (size_t(m) * Bp + blk / 8 * 8) * kBlock + blk % 4 * 64 + blk % 8 / 4 * 16;
      for (int i = 0; i < kBlock / 2; ++i) {
        if (j.bits == 4) {
          q[i] = int8_t(qi[2 * i]), q[32 + i] = int8_t(qi[2 * i + 1]);
        } else {
          q[i] = int8_t(qi[i]), q[32 + i] = int8_t(qi[16 + i]);
        }
      }
      xd[size_t(m) * Bp + blk] = d;
      float& g = xg[size_t(m) * Gb + blk / per];
      g = (blk % per == 0 ? 0.0f : g) + d * float(sum);
    }
  }
}

// The fast contract's tiles: each block's scale [rows, B] (at group 32 the
// scales as widened), then the biases [rows, G].
template <int BITS>
struct FastTile {
  const QmmJob& j;
  static constexpr int rows(int mt) { return kFastRows(mt); }
  Params params(int n0, int n1, std::vector<float>& buffer) const {
    const int G = j.K / j.group, per = j.group / kBlock, B = j.K / kBlock;
    const size_t rows = n1 - n0;
    buffer.resize(rows * (2 * G + (per > 1 ? B : 0)));
    float* ws = buffer.data();  // the rows' scales, then biases, as widened
    float* wb = ws + rows * G;
    widen(j.scales, j.scale, size_t(n0) * G, rows * G, ws, halves);
    widen(j.biases, j.scale, size_t(n0) * G, rows * G, wb, halves);
    if (per == 1) return {ws, wb, G, G, n0};
    float* s = wb + rows * G;
    const int shift = per == 2 ? 1 : 2;
    for (size_t r = 0; r < rows; ++r) {
      for (int blk = 0; blk < B; ++blk) s[r * B + blk] = ws[r * G + (blk >> shift)];
    }
    return {s, wb, B, G, n0};
  }
  template <int R, int MT>
  void run(int n, int m0, const Params& p) const {
    fast_tile<R, MT, BITS>(j, n, m0, p.scales(n), p.biases(n));
  }
};

// out[:, n0 .. n1) under the fast contract (x quantized in j.xq, j.xd, j.xg), any M.
void fast_rows(const QmmJob& j, int n0, int n1) {
  j.bits == 4 ? over_tiles(j, n0, n1, FastTile<4>{j}) : over_tiles(j, n0, n1, FastTile<8>{j});
}
