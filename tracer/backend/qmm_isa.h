// qmm's kernels for one instruction set. qmm.cpp includes this file once per
// ISA, inside a namespace that defines, under that ISA's target pragma:
//   F, L          a vector of L float lanes;
//   kTile         x rows a weight row is multiplied into at once (accumulators in registers);
//   halves        float16 scales to float32;
//   splat, loadu, storeu, add, fmadd (a * b + c), hsum (lanes in a fixed order);
//   Group, group<BITS>(scale, bias)  what dequant needs of a group;
//   dequant<BITS>(p, group, w)  the 32 weights of the packed block at p, each
//       scale * q, rounded, + bias in float32, into w[32 / L] in block order
//       (at 4 bits: the even-numbered weights, then the odd ones; qmm.cpp
//       permutes x to match).
// Everything here is the same for every ISA; only the lane count and the
// accumulation order differ between them.

constexpr int kVecs = kBlock / L;

// out[m0 .. m0 + MT, n] = x[m0 .. m0 + MT] . (weight row n): the row dequantized
// block by block in registers, each block multiplied into MT rows of x.
template <int MT, int BITS>
inline void row_tile(const QmmJob& j, int n, int m0, const float* s, const float* b) {
  constexpr int A = MT <= 2 ? kVecs : 2;  // accumulators a row: enough independent chains
  const uint8_t* wr = packed_row(j, n);
  const int G = j.K / j.group;
  F acc[MT][A];
  for (int m = 0; m < MT; ++m) {
    for (int a = 0; a < A; ++a) acc[m][a] = splat(0.0f);
  }
  for (int g = 0; g < G; ++g) {
    const Group grp = group<BITS>(s[g], b[g]);
    for (int k = g * j.group, end = k + j.group; k < end; k += kBlock) {
      F w[kVecs];
      dequant<BITS>(wr + k * BITS / 8, grp, w);
      for (int m = 0; m < MT; ++m) {
        const float* xr = j.x + size_t(m0 + m) * j.ldx + k;
        for (int v = 0; v < kVecs; ++v) {
          acc[m][v % A] = fmadd(w[v], loadu(xr + v * L), acc[m][v % A]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int a = 1; a < A; ++a) acc[m][0] = add(acc[m][0], acc[m][a]);
    j.out[size_t(m0 + m) * j.N + n] = hsum(acc[m][0]);
  }
}

// row_tile<mt>, for a run-time mt in 1 .. MT.
template <int MT, int BITS>
inline void row_tile_upto(int mt, const QmmJob& j, int n, int m0, const float* s, const float* b) {
  if constexpr (MT > 1) {
    if (mt < MT) {
      return row_tile_upto<MT - 1, BITS>(mt, j, n, m0, s, b);
    }
  }
  row_tile<MT, BITS>(j, n, m0, s, b);
}

template <int BITS>
void rows_small_bits(const QmmJob& j, int n0, int n1) {
  const int G = j.K / j.group;
  std::vector<float> params(2 * size_t(G));  // a row's scales, then biases, in float32
  for (int n = n0; n < n1; ++n) {
    row_params(j, n, params.data(), params.data() + G, halves);
    for (int m0 = 0; m0 < j.M; m0 += kTile) {
      row_tile_upto<kTile, BITS>(std::min(kTile, j.M - m0), j, n, m0, params.data(), params.data() + G);
    }
  }
}

// out[:, n0 .. n1) for few rows of x, straight from the packed weights.
void rows_small(const QmmJob& j, int n0, int n1) {
  j.bits == 4 ? rows_small_bits<4>(j, n0, n1) : rows_small_bits<8>(j, n0, n1);
}

template <int BITS>
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
      dequant<BITS>(wr + k * BITS / 8, group<BITS>(params[g], params[G + g]), w);
      for (int v = 0; v < kVecs; ++v) storeu(row + k + v * L, w[v]);
    }
  }
}

// panel [n1 - n0, K] = weight rows [n0, n1) dequantized, each block in block order.
void dequant_rows(const QmmJob& j, int n0, int n1, float* panel) {
  j.bits == 4 ? dequant_rows_bits<4>(j, n0, n1, panel) : dequant_rows_bits<8>(j, n0, n1, panel);
}
