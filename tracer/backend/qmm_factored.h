// qmm's factored-contract kernels (qmm.cpp states the contract). Included
// after qmm_isa.h by the portable and AVX2 namespaces, which define:
//   FF               8 float lanes;
//   ff_zero, ff_splat, ff_load, ff_add, ff_mul, ff_fma (a * b + c, fused), ff_hsum
//                    (((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)));
//   ff_qvals<BITS>(p, w)  the 32 integers of the packed block at p as floats
//                    in w[4], in factored_order's lanes (4 bits: some times
//                    2^8, 2^16 or 2^24, x scaled by the inverse to match).
// Both paths do the same float operations in the same order, so the bits
// are the same on each (AVX-512 CPUs run AVX2's: qmm_ops_x86.h).

// out[m0 .. m0 + MT, n .. n + R) for the x rows [m0, m0 + MT) of j.x (in
// factored_order, its group sums in j.xs): per group g and (row, x row), two
// vectors of lanes take the blocks' vectors alternately (q * x: the group's
// first two products rounded, the rest fused multiply-adds); their sum times the scale is added to the pair's accumulator
// (fused); the output is its lanes' sum plus the sum over groups of
// bias * group sum of x (float32, in order, each product rounded). A pair's
// sums are its own at every R and MT: the same bits at every M up to
// kSmallMaxM, as the exact contract.
template <int R, int MT, int BITS, int PER>
inline void factored_tile(const QmmJob& j, int n, int m0, const float* s, const float* b) {
  constexpr int bb = kBlock * BITS / 8;
  const int G = j.K / j.group;
  const size_t row_bytes = size_t(j.K) * BITS / 8;
  const uint8_t* w0 = packed_row(j, n);
  const size_t ahead = kPrefetchTiles * R * row_bytes;
  const float* xr = j.x + size_t(m0) * j.ldx;
  FF acc[R][MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[r][m] = ff_zero();
  }
  const uint8_t* p = w0;
  const float* xk = xr;
  for (int g = 0; g < G; ++g) {
    FF ga[R][MT][2];
    FF sg[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sg[r] = ff_splat(s[r * G + g]);
#pragma GCC unroll 4
    for (int t = 0; t < PER; ++t, p += bb, xk += kBlock) {
      if ((size_t(p - w0) & 63) < bb) {  // once a line: the rows kPrefetchTiles tiles ahead
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) prefetch(p + r * row_bytes + ahead);
      }
      FF w[R][4];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) ff_qvals<BITS>(p + r * row_bytes, w[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const FF xv = ff_load(xk + m * j.ldx + 8 * v);  // once for the R rows
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            ga[r][m][v & 1] = t == 0 && v < 2 ? ff_mul(w[r][v], xv) : ff_fma(w[r][v], xv, ga[r][m][v & 1]);
          }
        }
        if (t == PER - 1) {  // the group's last block: fold its sums into the pair's accumulator
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][m] = ff_fma(sg[r], ff_add(ga[r][m][0], ga[r][m][1]), acc[r][m]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const float* xs = j.xs + size_t(m0 + m) * G;
      float t = 0.0f;
      for (int g = 0; g < G; ++g) t += b[r * G + g] * xs[g];  // not contracted (qmm.cpp)
      j.out[size_t(m0 + m) * j.N + n + r] = ff_hsum(acc[r][m]) + t;
    }
  }
}

// The factored contract's tiles: the exact contract's tiling and its
// float32 scales and biases (ExactTile::params), factored_tile's sums.
template <int BITS, class S>
struct FactoredTile {
  ExactTile<BITS, S> exact;
  static constexpr int rows(int mt) { return kRows(mt); }
  Params params(int n0, int n1) const { return exact.params(n0, n1); }
  template <int R, int MT>
  void run(int n, int m0, const Params& p) const {
    const int per = exact.j.group / kBlock;
    per == 1   ? factored_tile<R, MT, BITS, 1>(exact.j, n, m0, p.scales(n), p.biases(n))
    : per == 2 ? factored_tile<R, MT, BITS, 2>(exact.j, n, m0, p.scales(n), p.biases(n))
               : factored_tile<R, MT, BITS, 4>(exact.j, n, m0, p.scales(n), p.biases(n));
  }
};

template <int BITS>
void factored_rows_bits(const QmmJob& j, int n0, int n1) {
  with_scales<FactoredTile, BITS>(j, [&](const auto& t) { over_tiles(j, n0, n1, t); });
}

// out[:, n0 .. n1) in the factored contract (j.M <= kSmallMaxM).
void factored_rows(const QmmJob& j, int n0, int n1) {
  with_bits(j.bits, [&](auto bits) { factored_rows_bits<decltype(bits)::value>(j, n0, n1); });
}
