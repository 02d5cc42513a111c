// qmm's entry for the other kernels of the module (kernels.cpp's layer
// kernels): the same matmul the qmm primitive runs, on raw pointers, called
// from inside a kernel's task. See qmm.cpp for the contracts and the paths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace tracer_qmm {

// sb: superblock scales: each row's G = K / group scales (or biases) as G
// int8 multipliers m, then G / 8 float32 steps d (bytes, little-endian), one
// uint8 row of G * 3 / 2 bytes; scale g = d[g / 8] * m[g] in float32, what
// adapters/lean/scales.py factored out of float32 scales, bit for bit (GGUF's
// k-quants: an fp16 step a superblock of 256 weights, 6-/8-bit integers a
// group of 32). 0.75 bits a weight at group 32, against float32's 2.
enum class ScaleType { f32, f16, bf16, sb };

// A matrix [N, K] in MLX's affine quantization, as mx.quantize packs it:
// w [N, K * bits / 32] uint32, scales and biases [N, K / group] of `scale`
// (sb: [N, K / group * 3 / 2] bytes). bits 4 or 8; or 5, qmm's own layout
// (not mx.quantize's): each block of 32 weights in 20 bytes, bytes 0-15
// their low 4 bits as a 4-bit block (byte i: weight 2 i in bits 0-3, 2 i + 1
// in bits 4-7), bytes 16-19 their fifth bits (byte 16 + f, bit l: weight
// 8 l + 2 f + 1's; bit 4 + l: weight 8 l + 2 f's; f, l < 4). GGUF's Q5_K,
// Q5_0 and Q5_1 integers (below 32), which load as 8-bit blocks, take 5
// bits a weight there instead of 8 (qmm.cpp's narrow). Or 6, qmm's own
// layout too: each block of 32 weights in 24 bytes, bytes 0-15 their low 4
// bits as a 4-bit block, bytes 16-23 their two high bits (byte 16 + j, j <
// 8: bits 0-1 weight 2 j's, 2-3 weight 2 j + 1's, 4-5 weight 2 j + 16's,
// 6-7 weight 2 j + 17's); MLX's 6-bit models (and 5-bit ones, in the 5-bit
// layout) are repacked into them when the lean forward binds.
struct Packed {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  ScaleType scale;
  int N, K, group, bits;
};

// qmm's contracts (qmm.cpp states each), and the one named "exact", "fast",
// "factored" or "split" (std::invalid_argument, saying which names there are, else).
enum class Contract { exact, fast, factored, split };
Contract contract_named(const std::string& name);

// out [M, N] = x [M, K] (rows ldx floats apart) @ dequantize(w).T, in qmm's
// contract `contract`. Bits equal to the qmm primitive's for the same operands.
void matmul(const float* x, size_t ldx, int M, const Packed& w, float* out, Contract contract);

// MLX's exp(x[j] - shift) and (a[j] * sigmoid(a[j])) * b[j] for j < n, its
// bits, vectorized on the ISA path in use (vmath_x86.h); false, doing
// nothing, where the path has none (the caller runs MLX's functors).
bool exp_shifted(const float* x, float shift, float* out, int n);
bool swiglu(const float* a, const float* b, float* out, int n);

// The decode attention's products for one (row, key head) block on the ISA
// path in use (attend_x86.h, where the arithmetic is stated): scores [R, S] =
// bias [R / per, S] (row r: bias row r / per) + q [R, D] . k [S, D], and
// out [R, D] = p [R, S] @ v [S, D], keys
// and values stored as `kind` (0 float32, 1 float16, 2 bfloat16; 3 and 4:
// mx.quantize's 8- and 4-bit blocks, 5 and 6 their integers alone (values
// only: kernels.cpp's factored arithmetic), `k` / `v` then an AttendPacked), D a
// multiple of 16 up to 256. False, doing nothing, where the path has none
// (the caller runs the same arithmetic in plain loops).
// A key the decode bias masks (float32's lowest or -inf): its score is the
// bias itself (what bias + dot rounds to for any |dot| < 2^103), not computed.
// One (row, key head) block of packed keys or values (mx.quantize's layout
// along D, mlx-lm's QuantizedKVCache): S rows of row_bytes, float32 scales
// and biases [S, groups], groups of 1 << group_shift values (32, 64, 128).
// Each value is read as MLX dequantizes it: scale * q + bias, both rounded.
struct AttendPacked {
  const uint8_t* data;
  const float* scales;
  const float* biases;
  int row_bytes, groups, group_shift;
};
inline bool masked_key(float bias) {
  return bias == -std::numeric_limits<float>::max() || bias == -std::numeric_limits<float>::infinity();
}
bool attend_scores(const float* q, int R, int D, const void* k, int kind, int S, const float* bias, int per,
                   float* out);
// The factored scores over packed keys of one group a row (kernels.cpp's
// attention_vector): each query row q_r split into three int8 parts,
// q_r ~ d0 (q0 + q1 / 254 + q2 / 254^2) (|q_p| <= 127, d1 = d0 / 254,
// d2 = d1 / 254: kernels.cpp's split_rows), the keys' stored integers k_s
// multiplied with the parts exactly in int32: a01 = k_s . (254 q0 + q1)
// (= 254 (k_s . q0) + k_s . q1) and a2 = k_s . q2; then per key,
// elementwise (split_score):
//   t = float(a01) * d1 + float(a2) * d2,
//   score(r, s) = bias + (ks(s) * t + kb(s) * qsum(r))  (the bias itself where it masks the key),
// qsum(r) the same sum over the parts' own integer sums. The integer products
// are exact, so every ISA path gives the same bits whatever its order (VNNI:
// the three parts' products, joined; AVX2: 254 q0 + q1 as one 16-bit part).
constexpr int kQParts = 3;
struct QSplit {
  int R, D;
  const int8_t* parts;  // [R, kQParts, D]: row r's part p at (r kQParts + p) D, the values in order
  const float* scale;   // [R, kQParts]: d0, d1, d2
  const float* qsum;    // [R]
};
inline int32_t join01(int32_t a0, int32_t a1) { return a0 * 254 + a1; }  // |.| < 2^31 for D <= 128
__attribute__((optimize("fp-contract=off"))) inline float split_score(int32_t a01, int32_t a2, const float* d,
                                                                       float ks, float kb, float qsum, float bias) {
  const float t = float(a01) * d[1] + float(a2) * d[2];
  return masked_key(bias) ? bias : bias + (ks * t + kb * qsum);
}
// scores [R, S] of q's rows against packed keys `k` of `bits` (one group a
// row: k.groups == 1), bias [R / per, S] as attend_scores takes it. False,
// doing nothing, where the path has none (kernels.cpp's loops serve).
bool attend_split_scores(const QSplit& q, const AttendPacked& k, int bits, int S, const float* bias, int per,
                         float* out);
bool attend_values(const float* p, int R, int S, const void* v, int kind, int D, float* out);
// Whether the ISA path in use has vector attention (attend_scores / attend_values
// above do something): false on the portable path, forced or not.
bool attend_vector_path();

// fn(ctx, i) for i in [0, count) on qmm's thread pool (the caller and its
// workers pull the indices from one counter; each i runs on one thread, so
// work that is a function of i alone gives the same bits on any thread).
void parallel_for(int count, void (*fn)(const void* ctx, int i), const void* ctx);
// The threads parallel_for runs on (the caller's included).
int pool_threads();

}  // namespace tracer_qmm
