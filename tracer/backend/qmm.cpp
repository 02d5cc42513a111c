// qmm: x @ dequantize(w, scales, biases).T as one MLX primitive on the CPU,
// reading the packed weights (MLX's affine quantization, 4 or 8 bits; 5 and 6
// bits in layouts of its own, qmm_api.h), never
// a float32 copy of the whole matrix. Decode on the CPU is bound by reading
// weights, and a 4-bit matrix is an eighth of its float32 bytes.
//
// The *exact* contract: every weight is dequantized as MLX's dequantize does
// in float32, w = scale * q + bias (the product rounded, then the sum; scale
// and bias converted to float32 first), and the products with x are summed
// in float32 (fused multiply-adds where the ISA has them). The result equals
// `x @ mx.dequantize(w, scales.astype(f32), biases.astype(f32), dtype=f32).T`
// up to the order of summation. mx.dequantize with float16 or bfloat16
// scales computes in that type (the product and the sum each rounded to it,
// also with dtype=float32): qmm does not, and differs from those weights by
// their rounding (up to half a float16 ulp of each product and sum).
//
// The *fast* contract (contract="fast", as llama.cpp computes): each 32-block
// of an x row is quantized to int8 (scale d = max |x| / 127, rounded to
// nearest), the weights' 4- or 8-bit integers are multiplied with it as
// integers (AVX-512 VNNI vpdpbusd, AVX2 maddubs + madd, portable loops; each
// block's integer sum exact), and an output is, in float32 on 4 lanes (lane
// j: blocks j, j + 4, ... then groups j, j + 4, ..., fused multiply-adds),
// the sum over blocks of float(sum(xq * q)) * (s * d) plus the sum over
// groups of b * (sum over its blocks of d * sum(xq)), the lanes added
// pairwise at the end (qmm_fast.h says it exactly). The bits are the same on
// every ISA path, thread count and tiling. Its error against exact is
// measured in tests/test_qmm.py (FAST_BOUND) and as KL of SmolLM2's
// next-token distributions (benchmarks/qmm_kl.py).
//
// The *factored* contract (contract="factored", the arithmetic of MLX's
// Metal qmv kernels): per group of a weight row, scale * sum(q * x) + bias *
// sum(x), in float32: the integers q, as floats, are multiplied into x
// (qmm_factored.h says the order exactly: per block 4 vectors of 8 lanes,
// two accumulators a group, the group's sum times the scale added to the
// (row, x row)'s accumulator, its lanes summed at the end, then the biases
// times the groups' sums of x); 4-bit nibbles are masked in place, not
// shifted, so some lanes hold q * 2^8, 2^16 or 2^24 and x is scaled by the
// inverse power of two (factored_order): the same products. About half the
// float operations a weight of the exact contract (no scale * q + bias a
// weight), the gain at 1-2 x rows on AVX2 (the README's 0.5.14 figures).
// The same bits on every path (AVX-512 CPUs run AVX2's kernels) and at
// every M up to kSmallMaxM; above, the exact contract's panels.
//
// Two ways through, by the number M of x rows (exact and factored; fast always the first):
//  * M <= kSmallMaxM: tiles of a few weight rows by up to kTile x rows, each
//    weight block dequantized once in vector registers and multiplied into
//    every x row of the tile (qmm_isa.h); columns are split into chunks (a
//    function of the shape only) that the caller and a pool of workers pull
//    from one counter (qmm_pool.h; work under kPoolBytes stays on the
//    caller); each output is computed by one thread from start to end, with
//    accumulators of its own (as many at every tile size), so the bits
//    depend neither on the thread count, on M, nor on which rows share its
//    tile: a verify window's rows equal the decode steps' bit for bit.
//    (Before 0.5.3 tiles of 3+ x rows kept one accumulator where 1 and 2
//    rows kept two: windows summed in another order than decode steps.)
//  * more rows: panels of weight rows dequantized (on the pool) to float32
//    scratch sized to stay in L2, each handed to the process's cblas_sgemm
//    (the BLAS shim splits it; its bits do not depend on the thread count).
// A 4-bit block is dequantized in an order of the path's own (portable and
// AVX-512: its even-numbered weights first, then the odd ones; AVX2: lanes
// of interleaved weights, qmm_ops_x86.h), and x is permuted to match
// (Path::order4): the same products, summed in another order. AVX-512 looks 4-bit weights up in
// a 16-entry table per group (scale * q + bias for q = 0..15, computed as
// above), the same values as computing each.
// Weights stream from memory (a decode step reads every matrix once): the
// kernels read them in plain order, with software prefetches a few tiles
// ahead (kPrefetchMinM), and read x from 64-byte aligned
// copies. Kernels exist for AVX-512 (its fast contract with VNNI, else AVX2's), AVX2
// (+FMA, F16C) and portable C++ (qmm_ops_x86.h, qmm_ops_portable.h), compiled
// with target pragmas (the module itself is built without -march), chosen by
// __builtin_cpu_supports; MLX_TRACER_QMM_ISA=avx512|avx2|portable forces one
// for both contracts and for the layer kernels' vector math (vmath_x86.h;
// none on the portable path) (one the CPU lacks falls back to the best it
// has, said on stderr). MLX_TRACER_QMM_THREADS=N pins the thread count (default: the
// cores this process may run on). tests/test_qmm.py checks every path.

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <type_traits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <pthread.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "qmm_api.h"

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc);

// The module is compiled as C++, where GCC contracts a * b + c into a fused
// multiply-add wherever the target has one: the dequantization must round
// the product first, as MLX's does.
#pragma GCC optimize("fp-contract=off")

namespace nb = nanobind;
namespace mx = mlx::core;
using mx::array;

// qmm.cpp is compiled three times (kernels.py): TRACER_QMM_UNIT 0, the
// module's part (the portable path, the ISA table, the pool, the primitive),
// 1 the AVX2 kernels, 2 the AVX-512 ones (the x86 headers keep the ISA
// namespaces of their unit), so the build's two cores share what was one
// 76 s unit (a 2-core Zen 3). Units 1 and 2 hand unit 0 their Path.
#ifndef TRACER_QMM_UNIT
#define TRACER_QMM_UNIT 0
#endif
#define QMM_UNIT_AVX2 (TRACER_QMM_UNIT == 1)
#define QMM_UNIT_AVX512 (TRACER_QMM_UNIT == 2)

// What the units share across their boundary (named: one type in every unit).
namespace tracer_qmm_unit {
// sb: superblock scales (qmm_api.h's ScaleType::sb): a row's G groups as G
// int8 multipliers, then G / kSbGroups float32 steps, in one byte row.
enum class Scale { f32, f16, bf16, sb };
constexpr int kSbGroups = 8;  // groups a superblock step serves (GGUF's k-quants: 256 weights of groups of 32)
// Bytes a row of G scales (or biases) takes in memory.
constexpr size_t scale_row_bytes(Scale t, int G) {
  return t == Scale::f32 ? 4 * size_t(G) : t == Scale::sb ? size_t(G) + 4 * size_t(G / kSbGroups) : 2 * size_t(G);
}
using Contract = tracer_qmm::Contract;  // qmm_api.h

// One qmm call as its task sees it: pointers, no array references.
struct QmmJob {
  const float* x;      // [M, K], rows ldx floats apart
  size_t ldx;
  const uint32_t* w;   // [N, K * bits / 32]
  const void* scales;  // [N, K / group]
  const void* biases;  // [N, K / group]
  Scale scale;
  int M, N, K, group, bits;
  float* out;          // [M, N]
  // The fast contract's x (quantize_x), else null:
  const int8_t* xq = nullptr;  // [M, fast_blocks(K) * 32] int8, in qmm_fast.h's layout
  const float* xd = nullptr;   // [M, fast_blocks(K) * 4] the blocks' scales, each 4 times (qmm_fast.h)
  const float* xg = nullptr;   // [M, fast_groups(K / group) * 4] per group: sum over its blocks of scale * sum(xq), each 4 times
  // The factored contract's (then x in factored_order):
  const float* xs = nullptr;   // [M, K / group] each group's sum of x
  // The split contract (the fast tiles' arithmetic on x in 15 bits): xq holds
  // two int8 rows an x row (its int8 part, then its remainder's), the
  // integer sums joined as 128 * first + second, xd and xg the x row's.
  bool split = false;
};

struct Path {
  const char* name;
  bool (*supported)();
  void (*small)(const QmmJob&, int n0, int n1);
  void (*dequant)(const QmmJob&, int n0, int n1, float* panel);
  void (*fast)(const QmmJob&, int n0, int n1);
  void (*factored)(const QmmJob&, int n0, int n1);  // x rows <= kSmallMaxM
  void (*quantize_x)(const QmmJob&, int8_t* xq, float* xd, float* xg);
  void (*order4)(const float* from, float* to);  // x of a 4-bit block in the order its dequant gives the weights
  // The layer kernels' vector math (vmath_x86.h); null: MLX's one-lane functors serve.
  void (*exp_shifted)(const float* x, float shift, float* out, int n);
  void (*swiglu)(const float* a, const float* b, float* out, int n);
  // The decode attention's products (attend_x86.h); null: kernels.cpp's portable loops serve.
  void (*attend_scores)(const float* q, int R, int D, const void* k, int kind, int S, const float* bias, int per,
                        float* out);
  void (*attend_values)(const float* p, int R, int S, const void* v, int kind, int D, float* out);
  void (*attend_split)(const tracer_qmm::QSplit& q, const tracer_qmm::AttendPacked& k, int bits, int S,
                       const float* bias, int per, float* out);
  // The split contract's x, as quantize_x wrote it, relaid in place for the
  // path's fast kernels (AVX2's 16-bit products, qmm_ops_x86.h); null: read as written.
  void (*split_x)(const QmmJob&, int8_t* xq) = nullptr;
};

#if defined(__x86_64__)
extern const Path kPathAvx2;    // unit 1
extern const Path kPathAvx512;  // unit 2
#endif
}  // namespace tracer_qmm_unit

namespace {
using namespace tracer_qmm_unit;

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// Up to this many x rows, the packed-weight kernels (x in tiles of a few rows
// over a chunk of weights that stays in L1/L2); above, dequantized panels and
// sgemm (single-thread CPU time on SmolLM2's shapes: the tiles were faster at
// 10, 20 and 40 rows, by up to 1.8x, even at 64, the panels faster from 96).
constexpr int kSmallMaxM = 64;
// Packed weights a chunk of the few-row paths takes (exact and fast tiles).
// Each chunk is claimed and counted done with an atomic the two cores share,
// and starts on cold cache lines: at 16 KB (0.5.6) a bucket-1 SmolLM2 step had
// ~5,800 chunks. 64 KB: the step 7-10 % faster at bucket 1, 3-4 % at 2 and 4,
// the same at 8 (in-process A/B on compiled decode steps, both sizes taking
// turns; 48-128 KB alike; sizes that shrank towards a job's end were no
// better than 16 KB).
constexpr size_t kTileChunkBytes = 64 << 10;
constexpr size_t kPanelChunkBytes = 16 << 10;  // ... and of the many-row path's dequantized panels
constexpr size_t kPoolBytes = 64 << 10;      // less work than this (~6 us at M = 1) does not wake the pool
constexpr size_t kPanelBytes = 16 << 20;     // a dequantized panel of the many-row path (see run_large)
constexpr int kBlock = 32;                   // weights a kernel step: 16 bytes at 4 bits, 32 at 8
// Tiles of at least this many x rows ask the caches for the packed bytes of
// the rows kPrefetchTiles tiles ahead as they read theirs (once a cache line).
// One x row too: a decode step reads each matrix once, from memory, and there
// the prefetches paid (single thread, exact contract, CPU ms a matrix over
// 40 distinct 3072x576 4-bit and 2 49152x576 8-bit ones, 3 interleaved
// runs: 4-bit 0.17-0.22 -> 0.15-0.17, 8-bit 6.0-7.0 -> 4.3-5.0; measured
// on a matrix the caches already held, they had made reads slower). The
// fast and split contracts' one-row tiles that read a quad's rows side by
// side (VNNI; AVX2 for rows of >= 1 KB) prefetch whole quads instead
// (qmm_fast.h, each ISA's ask_ahead), the row-after-row ones not at all.
constexpr int kPrefetchMinM = 1;
constexpr int kPrefetchTiles = 2;
// How far ahead the side-by-side one-row tiles ask for a quad of weight
// rows: `far` quads into L2, `near` into L1 (0: none), and whether the far
// quad's float16 scales and biases too (an ISA's ask_ahead(quad's bytes)).
struct Ahead {
  int far, near;
  bool params;
};
// AVX2's setting for rows of at least 1 KB (0.5.25), VNNI's too since 0.5.32:
// the quad 128 KB ahead into L2 (at least the next), none into L1, and its parameters.
constexpr Ahead ahead_128k(size_t quad_bytes) { return {std::max<int>(1, (128 << 10) / quad_bytes), 0, true}; }

// Blocks of 32 an x row of the fast contract takes: K's, rounded up to 4 (qmm_fast.h's steps).
constexpr int fast_blocks(int K) {
  return (K / kBlock + 3) / 4 * 4;
}

// Groups an x row of the fast contract has sums for: G, rounded up to 4 (qmm_fast.h's steps).
constexpr int fast_groups(int G) {
  return (G + 3) / 4 * 4;
}

inline const uint8_t* packed_row(const QmmJob& j, int n) {
  return reinterpret_cast<const uint8_t*>(j.w) + size_t(n) * j.K * j.bits / 8;
}

inline void prefetch(const void* p) {
#if defined(__x86_64__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#endif
}
// ... into L2 only (the one-row fast tiles' far prefetches, qmm_fast.h).
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#endif
}


// Exact: subnormals, infinities and NaNs included (where F16C is missing).
inline float half_to_float(uint16_t h) {
  const uint32_t em = h & 0x7fff, sign = uint32_t(h & 0x8000) << 16;
  const uint32_t finite = std::bit_cast<uint32_t>(std::bit_cast<float>(em << 13) * 0x1p112f);
  return std::bit_cast<float>((em >= 0x7c00 ? 0x7f800000 | em << 13 : finite) | sign);
}

using Halves = void (*)(const uint16_t* h, int G, float* out);  // out [G] = float16 h [G] in float32

void halves_portable(const uint16_t* h, int G, float* out) {
  for (int g = 0; g < G; ++g) out[g] = half_to_float(h[g]);
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx,f16c")
void halves_f16c(const uint16_t* h, int G, float* out) {
  int g = 0;
  for (; g + 8 <= G; g += 8) _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g))));
  for (; g < G; ++g) out[g] = _cvtsh_ss(h[g]);
}
#pragma GCC pop_options
#endif

// out [G] = row's superblock scales (G int8 multipliers, then G / kSbGroups
// float32 steps) in float32: each step * multiplier, rounded once.
using Steps = void (*)(const uint8_t* row, int G, float* out);

void steps_portable(const uint8_t* row, int G, float* out) {
  const int8_t* m = reinterpret_cast<const int8_t*>(row);
  for (int b = 0; b < G / kSbGroups; ++b, m += kSbGroups, out += kSbGroups) {
    float step;
    std::memcpy(&step, row + G + sizeof(float) * b, sizeof(float));
    for (int g = 0; g < kSbGroups; ++g) out[g] = step * float(m[g]);
  }
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2")
void steps_avx2(const uint8_t* row, int G, float* out) {
  static_assert(kSbGroups == 8);
  for (int b = 0; b < G / kSbGroups; ++b) {
    float step;
    std::memcpy(&step, row + G + sizeof(float) * b, sizeof(float));
    const __m128i m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * kSbGroups));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m));
    _mm256_storeu_ps(out + b * kSbGroups, _mm256_mul_ps(_mm256_set1_ps(step), q));
  }
}
#pragma GCC pop_options
#endif

// out [count] = count scales or biases from p + at (at and count in scales;
// rows of G), in float32. Superblock ones: each the product of its step and
// multiplier, rounded once (what the factoring checked reproduces the
// float32 scale it replaced, bit for bit); whole rows only.
void widen(const void* p, Scale t, size_t at, int count, float* out, Halves halves, Steps steps, int G) {
  const uint16_t* h = static_cast<const uint16_t*>(p) + at;
  switch (t) {
    case Scale::f32:
      std::memcpy(out, static_cast<const float*>(p) + at, sizeof(float) * count);
      break;
    case Scale::f16:
      halves(h, count, out);
      break;
    case Scale::bf16:
      for (int g = 0; g < count; ++g) out[g] = std::bit_cast<float>(uint32_t(h[g]) << 16);
      break;
    case Scale::sb: {
      const size_t rb = scale_row_bytes(t, G);
      const uint8_t* row = static_cast<const uint8_t*>(p) + at / G * rb;
      for (int r = 0; r < count / G; ++r) steps(row + r * rb, G, out + size_t(r) * G);
      break;
    }
  }
}

// s, b [K / group] = row n's scales and biases in float32.
void row_params(const QmmJob& j, int n, float* s, float* b, Halves halves, Steps steps) {
  const int G = j.K / j.group;
  widen(j.scales, j.scale, size_t(n) * G, G, s, halves, steps, G);
  widen(j.biases, j.scale, size_t(n) * G, G, b, halves, steps, G);
}

// x of a 4-bit block in the order most paths' dequant gives its weights: the
// even-numbered ones, then the odd ones (32 floats).
inline void order4_even_odd(const float* from, float* to) {
  for (int i = 0; i < kBlock / 2; ++i) to[i] = from[2 * i], to[kBlock / 2 + i] = from[2 * i + 1];
}

// --------------------------------------------------------------- kernels
// MLX packs weight i of a row at bits 4 (i % 8) of little-endian word i / 8
// (8 (i % 4) of i / 4 at 8 bits): byte i of a 4-bit block holds weights 2i
// (low nibble) and 2i + 1.
// 5 bits are qmm's own layout (qmm_api.h's Packed; mx.quantize's 5-bit one
// is not read): a block of 32 weights in 20 bytes, bytes 0-15 their low 4
// bits as a 4-bit block holds them, bytes 16-19 their fifth bits: byte 16 +
// f, bit l weight 8 l + 2 f + 1's, bit 4 + l weight 8 l + 2 f's (f, l < 4).
// The kernels unpack such a block into the 4-bit block's two halves (the
// even-numbered weights, the odd ones), each byte's fifth bit put in place
// by one shift a 32-bit lane of the word (qmm_ops_x86.h's fifth_bits), and
// multiply them as 4-bit ones (integers below 32: maddubs' pairs cannot
// saturate); the exact and factored contracts in the natural order, as 8 bits.
inline int fifth_bit(const uint8_t* block, int k) {
  const int i = k >> 1, l = i >> 2, f = i & 3;
  return (block[16 + f] >> (l + ((k & 1) ? 0 : 4))) & 1;
}
inline int low_nibble(const uint8_t* block, int k) {  // weight k's low 4 bits, as a 4-bit block holds them
  return (k & 1) ? block[k >> 1] >> 4 : block[k >> 1] & 15;
}
inline uint8_t q5_at(const uint8_t* block, int k) {  // weight k (< 32) of a 5-bit block
  return uint8_t(low_nibble(block, k) | fifth_bit(block, k) << 4);
}
// 6 bits, qmm's own layout too (mx.quantize's 6-bit one is not read): a
// block of 32 weights in 24 bytes, bytes 0-15 their low 4 bits as a 4-bit
// block holds them, bytes 16-23 their two high bits: byte 16 + j (j < 8),
// bits 0-1 weight 2 j's, 2-3 weight 2 j + 1's, 4-5 weight 2 j + 16's, 6-7
// weight 2 j + 17's. The 8 bytes in both 64-bit lanes of a 128-bit lane,
// the low lane shifted left by 4, put the high bits of weights 2 i (i < 8)
// at bits 4-5 of byte i, those of 2 i + 1 at bits 6-7, and the high lane
// (bytes 8-15, unshifted) those of weights 2 i (i >= 8) and 2 i + 1 there
// too: one variable shift, then an and for the even weights and a shift
// right by 2 and an and for the odd ones (qmm_ops_x86.h's sixth_bits). The
// integers (below 64) are multiplied as 4-bit ones: maddubs' pairs reach
// 2 * 63 * 127, the two halves' pair sums 4 * 63 * 127 < 2^15.
inline int high_pair(const uint8_t* block, int k) {
  return (block[16 + ((k & 15) >> 1)] >> (2 * (k & 1) + (k >= 16 ? 4 : 0))) & 3;
}
inline uint8_t q6_at(const uint8_t* block, int k) {  // weight k (< 32) of a 6-bit block
  return uint8_t(low_nibble(block, k) | high_pair(block, k) << 4);
}
// The layouts of qmm's own beyond MLX's 4 and 8 bits (5 and 6: a 4-bit block and a plane of high bits).
constexpr bool narrow_bits(int bits) { return bits == 5 || bits == 6; }
template <int BITS>
inline uint8_t qn_at(const uint8_t* block, int k) {  // weight k of a 5- or 6-bit block
  static_assert(narrow_bits(BITS));
  return BITS == 5 ? q5_at(block, k) : q6_at(block, k);
}
#if TRACER_QMM_UNIT == 0
#include "qmm_ops_portable.h"
#endif

#if defined(__x86_64__)
#include "qmm_ops_x86.h"
#include "vmath_x86.h"
#include "attend_x86.h"
#endif

#if TRACER_QMM_UNIT != 0
}  // namespace
#if defined(__x86_64__) && QMM_UNIT_AVX2
const tracer_qmm_unit::Path tracer_qmm_unit::kPathAvx2 = {
    "avx2", has_avx2, isa_avx2::rows_small, isa_avx2::dequant_rows, isa_avx2::fast_rows, isa_avx2::factored_rows,
    isa_avx2::quantize_x_rows,
    isa_avx2::order4, vmath_avx2::exp_shifted, vmath_avx2::swiglu, attend_avx2::scores, attend_avx2::values,
    attend_avx2::split_scores, isa_avx2::split16_x};
#elif defined(__x86_64__) && QMM_UNIT_AVX512
const tracer_qmm_unit::Path tracer_qmm_unit::kPathAvx512 = {
    "avx512", has_avx512, isa_avx512::rows_small, isa_avx512::dequant_rows, fast_avx512, factored_avx2,
    quantize_x_avx2,  // the same bytes on every path
    isa_avx512::order4, vmath_avx512::exp_shifted, vmath_avx512::swiglu, attend_avx512::scores, attend_avx512::values,
    split_scores_avx512, split_x_avx512};
#endif
#else  // unit 0: the rest of the file

// ------------------------------------------------------------ ISA choice
const Path kPathPortable = {"portable", [] { return true; }, isa_portable::rows_small, isa_portable::dequant_rows,
                            isa_portable::fast_rows, isa_portable::factored_rows, isa_portable::quantize_x_rows,
                            isa_portable::order4, nullptr, nullptr, nullptr, nullptr, nullptr};
const Path* const kPaths[] = {  // worst to best
    &kPathPortable,
#if defined(__x86_64__)
    &kPathAvx2, &kPathAvx512,
#endif
};
constexpr int kPathCount = int(sizeof(kPaths) / sizeof(kPaths[0]));

std::atomic<const Path*> g_path{nullptr};

std::string path_names() {
  std::string s;
  for (const Path* p : kPaths) s += (s.empty() ? "" : "|") + std::string(p->name);
  return s;
}

// The path named (nullptr: unknown name).
const Path* find_path(const std::string& name) {
  for (const Path* p : kPaths) {
    if (name == p->name) return p;
  }
  return nullptr;
}

// `want`, or the best path the CPU has where it lacks it (said on stderr).
const Path* best_path() {
  const Path* best = kPaths[0];
  for (const Path* p : kPaths) {
    if (p->supported()) best = p;
  }
  return best;
}

const Path* usable(const Path* want, const std::string& asked) {
  const Path* best = best_path();
  if (want != nullptr && want->supported()) return want;
  std::fprintf(stderr, "mlx_tracer qmm: %s %s; using %s\n", asked.c_str(),
               want ? "is not supported by this CPU" : ("is not one of " + path_names()).c_str(), best->name);
  return best;
}

const Path& path() {
  const Path* p = g_path.load();
  if (p == nullptr) {
    const char* env = std::getenv("MLX_TRACER_QMM_ISA");
    p = env == nullptr || *env == '\0' ? best_path()  // unset: the best path this CPU has, silently
                                        : usable(find_path(env), std::string("MLX_TRACER_QMM_ISA=") + env);
    g_path.store(p);
  }
  return *p;
}

// ------------------------------------------------------------ thread pool
#include "qmm_pool.h"

// ------------------------------------------------------------- the work
// Calls fn(n0, n1) for weight rows [n0, n1) in chunks of about chunk_bytes
// of packed weights (at least `align` rows, a multiple of it), on the pool.
// Work under kPoolBytes (packed bytes times (M + 1) / 2) runs on the calling
// thread alone, in the same chunks (the same bits).
template <class Fn>
void over_rows(const QmmJob& j, int n0, int n1, int align, size_t chunk_bytes, const Fn& fn) {
  const size_t row_bytes = size_t(j.K) * j.bits / 8;
  int rows = int(std::max<size_t>(align, (chunk_bytes + row_bytes - 1) / row_bytes)) / align * align;
  rows = std::max(rows, (n1 - n0 + Pool::kMaxChunks - 1) / Pool::kMaxChunks);
  struct Ctx {
    const Fn* fn;
    int n0, n1, rows;
  } ctx{&fn, n0, n1, rows};
  const bool alone = size_t(n1 - n0) * row_bytes * (j.M + 1) / 2 < kPoolBytes;
  Pool::the().run((n1 - n0 + rows - 1) / rows, [](const void* c, int i) {
    const Ctx& t = *static_cast<const Ctx*>(c);
    (*t.fn)(t.n0 + i * t.rows, std::min(t.n1, t.n0 + (i + 1) * t.rows));
  }, &ctx, alone);
}

// Few x rows: straight from the packed weights.
void run_small(const QmmJob& j, const Path& p) {
  over_rows(j, 0, j.N, 4, kTileChunkBytes, [&](int n0, int n1) { p.small(j, n0, n1); });
}

// Many x rows: panels of weight rows dequantized (on the pool), each one cblas_sgemm.
// Panels of 16 MB (whole matrices of SmolLM2, 2048 rows of Llama-3.2-1B's
// hidden 2048): a 512-token prompt prefilled at 39.9-42.7 -> 54.6-64.0 tok/s
// on Llama-3.2-1B's shape and 390-416 -> 422-462 on SmolLM2 against 512 KB
// panels (separate processes taking turns; 4 and 8 MB between, 32 and 64 MB
// no better): every sgemm call packs all of x again, and the calls' fixed
// costs and the pool's hand-offs came once per 64 rows.
void run_large(const QmmJob& j, const Path& p) {
  const int rows = std::clamp(int(kPanelBytes / (sizeof(float) * j.K)) / 16 * 16, 16, std::max(16, j.N));
  std::vector<float> panel(size_t(std::min(rows, j.N)) * j.K);  // [rows, K]
  for (int n0 = 0; n0 < j.N; n0 += rows) {
    const int nr = std::min(rows, j.N - n0);
    over_rows(j, n0, n0 + nr, 1, kPanelChunkBytes, [&](int a, int b) { p.dequant(j, a, b, panel.data() + size_t(a - n0) * j.K); });
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, j.M, nr, j.K, 1.0f, j.x, int(j.ldx), panel.data(), j.K, 0.0f,
                j.out + n0, j.N);
  }
}

// The fast contract's x: each 32-block of a row scaled by d = max |x| / 127
// and rounded to the nearest integer (ties to even), laid out as qmm_fast.h
// reads it (superblocks of 8 blocks, zeros past K); per group, the sum over
// its blocks of d * sum(xq).
// n T's of a thread's scratch v, 64-byte aligned (a kernel's vector loads of x
// that straddle cache lines cost as much as two), zeros where `zero`.
template <class T>
T* aligned_scratch(std::vector<T>& v, size_t n, bool zero) {
  constexpr size_t extra = 64 / sizeof(T);
  zero ? v.assign(n + extra, T{}) : v.resize(n + extra);
  const size_t off = (64 - reinterpret_cast<uintptr_t>(v.data()) % 64) % 64;
  return v.data() + off / sizeof(T);
}

// The split contract (j.split): two int8 rows an x row in xq.
void quantize_x(QmmJob& j, const Path& p, std::vector<int8_t>& xq, std::vector<float>& xd, std::vector<float>& xg) {
  const int Bp = fast_blocks(j.K);
  int8_t* q = aligned_scratch(xq, size_t(j.M) * (j.split ? 2 : 1) * Bp * kBlock, true);
  float* d = aligned_scratch(xd, size_t(j.M) * Bp * 4, true);
  float* g = aligned_scratch(xg, size_t(j.M) * fast_groups(j.K / j.group) * 4, true);
  p.quantize_x(j, q, d, g);
  if (j.split && p.split_x != nullptr) p.split_x(j, q);
  j.xq = q, j.xd = d, j.xg = g;
}

// x [K] of 4-bit blocks in the factored contract's order and scale (every
// path's ff_qvals): in each block of 32, lanes 0-3 of vector j are x's
// weights 8 l + j (times 2^-8 for j = 2, 3), lanes 4-7 its 8 l + j + 4
// (times 2^-16 for j = 0, 1, 2^-24 for j = 2, 3): q 2^e x 2^-e is q x
// exactly (but where x 2^-e is below float32's normal range, |x| < 2^-102).
void factored_order(const float* from, int K, float* to) {
  constexpr float lo[4] = {1.0f, 1.0f, 0x1p-8f, 0x1p-8f}, hi[4] = {0x1p-16f, 0x1p-16f, 0x1p-24f, 0x1p-24f};
  for (int k = 0; k < K; k += kBlock) {
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 4; ++l) {
        to[k + 8 * j + l] = from[k + 8 * l + j] * lo[j];
        to[k + 8 * j + 4 + l] = from[k + 8 * l + j + 4] * hi[j];
      }
    }
  }
}

// 4-bit blocks come out of dequant in the path's block order (even weights,
// then odd; AVX2: its own, qmm_ops_x86.h): x goes into the same order
// (Path::order4), which changes only the order of summation. The
// few-row kernels read x from an aligned copy.
void run(QmmJob j, Contract contract) {
  const Path& p = path();
  if (contract == Contract::fast || contract == Contract::split) {
    j.split = contract == Contract::split;
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> xd, xg;
    quantize_x(j, p, xq, xd, xg);
    over_rows(j, 0, j.N, 4, kTileChunkBytes, [&](int n0, int n1) { p.fast(j, n0, n1); });
    return;
  }
  const bool small = j.M <= kSmallMaxM;
  thread_local std::vector<float> xp;  // [M, K]
  if (contract == Contract::factored && small) {
    thread_local std::vector<float> xs;
    float* xa = aligned_scratch(xp, size_t(j.M) * j.K, false);
    float* sums = aligned_scratch(xs, size_t(j.M) * (j.K / j.group), false);
    for (int m = 0; m < j.M; ++m) {
      const float* from = j.x + size_t(m) * j.ldx;
      float* to = xa + size_t(m) * j.K;
      j.bits == 4 ? factored_order(from, j.K, to) : void(std::memcpy(to, from, sizeof(float) * j.K));
      for (int g = 0; g < j.K / j.group; ++g) {
        float t = 0.0f;
        for (int k = g * j.group; k < (g + 1) * j.group; ++k) t += from[k];
        sums[size_t(m) * (j.K / j.group) + g] = t;
      }
    }
    j.x = xa, j.ldx = j.K, j.xs = sums;
    over_rows(j, 0, j.N, 4, kTileChunkBytes, [&](int n0, int n1) { p.factored(j, n0, n1); });
    return;
  }
  if (j.bits == 4 || small) {
    float* xa = aligned_scratch(xp, size_t(j.M) * j.K, false);
    for (int m = 0; m < j.M; ++m) {
      const float* from = j.x + size_t(m) * j.ldx;
      float* to = xa + size_t(m) * j.K;
      if (j.bits != 4) {  // 5, 6 and 8 bits: the natural order
        std::memcpy(to, from, sizeof(float) * j.K);
        continue;
      }
      for (int k = 0; k < j.K; k += kBlock) p.order4(from + k, to + k);
    }
    j.x = xa, j.ldx = j.K;
  }
  small ? run_small(j, p) : run_large(j, p);
}

// Time in the qmm primitive's tasks (MLX_TRACER_KERNEL_PROFILE=1), read and reset by qmm_profile().
const bool g_qmm_profile = [] {
  const char* e = std::getenv("MLX_TRACER_KERNEL_PROFILE");
  return e != nullptr && *e != 0 && *e != '0';
}();
std::atomic<uint64_t> g_qmm_ns{0}, g_qmm_calls{0};

// ------------------------------------------------------------ primitive
Scale scale_of(mx::Dtype t) {
  return t == mx::float16 ? Scale::f16 : t == mx::bfloat16 ? Scale::bf16 : t == mx::uint8 ? Scale::sb : Scale::f32;
}

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("mlx_tracer qmm: " + what);
}

std::string describe(const array& a) {
  std::ostringstream s;
  s << a.dtype() << " [";
  for (int i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << "]";
  return s.str();
}

class Qmm : public mx::Primitive {
 public:
  Qmm(mx::Stream s, int group, int bits, Contract contract)
      : mx::Primitive(s), group_(group), bits_(bits), contract_(contract) {}

  // inputs: x [M, K] float32, w [N, K bits / 32] uint32, scales, biases [N, K / group]; output [M, N] float32
  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    const array& x0 = in[0];
    const bool rows_ok = x0.strides()[1] == 1 && (x0.shape(0) == 1 || x0.strides()[0] >= x0.shape(1));
    array x = rows_ok ? x0 : dense(x0), w = dense(in[1]), s = dense(in[2]), b = dense(in[3]);
    array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const Scale scale = scale_of(s.dtype());
    const QmmJob j{x.data<float>(), x.shape(0) == 1 ? size_t(x.shape(1)) : size_t(x.strides()[0]), w.data<uint32_t>(),
                   s.data<void>(), b.data<void>(), scale, x.shape(0), w.shape(0), x.shape(1), group_, bits_,
                   out.data<float>()};
    enc.dispatch([j, c = contract_] {
      const auto t0 = g_qmm_profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
      run(j, c);
      if (g_qmm_profile) {
        g_qmm_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
        ++g_qmm_calls;
      }
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer qmm: CPU only");
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& in) override {
    return {{in[0].shape(0), in[1].shape(0)}};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Qmm&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && contract_ == o.contract_;
  }
  const char* name() const override {
    return contract_ == Contract::fast       ? "TracerQmmFast"
           : contract_ == Contract::factored ? "TracerQmmFactored"
           : contract_ == Contract::split    ? "TracerQmmSplit"
                                             : "TracerQmm";
  }

 private:
  // A 2-D input row-contiguous: itself, or a copy made on the worker (a task holds pointers only).
  array dense(const array& a) {
    if (a.flags().row_contiguous) return a;
    auto& enc = mx::cpu::get_command_encoder(stream());
    array out(a.shape(), a.dtype(), nullptr, {});
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto copy = [&](auto zero) {
      using T = decltype(zero);
      enc.dispatch([src = a.data<T>(), dst = out.data<T>(), R = a.shape(0), C = a.shape(1), s0 = a.strides()[0],
                    s1 = a.strides()[1]] {
        for (int r = 0; r < R; ++r) {
          for (int c = 0; c < C; ++c) dst[size_t(r) * C + c] = src[r * s0 + c * s1];
        }
      });
    };
    a.itemsize() == 1 ? copy(uint8_t{}) : a.itemsize() == 2 ? copy(uint16_t{}) : copy(uint32_t{});
    enc.add_temporary(out);  // alive until the tasks that read it ran
    return out;
  }

  int group_, bits_;
  Contract contract_;
};

array qmm(const array& x, const array& w, const array& scales, const array& biases, int group_size, int bits,
          const std::string& contract) {
  const Contract c = tracer_qmm::contract_named(contract);
  need(bits == 4 || narrow_bits(bits) || bits == 8,
       "bits must be 4, 5 or 6 (qmm's own layouts: qmm_api.h) or 8, got " + std::to_string(bits));
  need(group_size == 32 || group_size == 64 || group_size == 128,
       "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  need(x.dtype() == mx::float32 && x.ndim() == 2 && x.shape(0) >= 1, "x must be float32 [M, K], got " + describe(x));
  const int M = x.shape(0), K = x.shape(1);
  need(K % group_size == 0, "K = " + std::to_string(K) + " is not a multiple of group_size " + std::to_string(group_size));
  need(w.dtype() == mx::uint32 && w.ndim() == 2 && w.shape(1) == K * bits / 32,
       "w must be uint32 [N, K * bits / 32] = [N, " + std::to_string(K * bits / 32) + "] as mx.quantize packs it (5 and 6 bits: as narrow does), got " +
           describe(w));
  const int N = w.shape(0);
  const int G = K / group_size;
  const mx::Dtype t = scales.dtype();
  need(t == mx::float16 || t == mx::bfloat16 || t == mx::float32 || t == mx::uint8,
       "scales must be float16, bfloat16, float32 or uint8 (superblock scales), got " + describe(scales));
  need(biases.dtype() == t, "biases must have the scales' dtype, got " + describe(biases) + " and " + describe(scales));
  need(t != mx::uint8 || G % kSbGroups == 0, "superblock scales need K / group_size a multiple of " +
                                                 std::to_string(kSbGroups) + ", got " + std::to_string(G));
  const int width = t == mx::uint8 ? int(scale_row_bytes(Scale::sb, G)) : G;
  const mx::Shape groups{N, width};
  need(scales.shape() == groups && biases.shape() == groups,
       std::string(t == mx::uint8 ? "superblock " : "") + "scales and biases must be [N, " +
           (t == mx::uint8 ? "K / group_size * 3 / 2" : "K / group_size") + "] = [" + std::to_string(N) + ", " +
           std::to_string(width) + "], got " + describe(scales) + " and " + describe(biases));
  auto prim = std::make_shared<Qmm>(mx::default_stream(mx::Device::cpu), group_size, bits, c);
  return array({M, N}, mx::float32, std::move(prim), {x, w, scales, biases});
}

std::string set_isa(const std::string& name) {
  const Path* want = find_path(name);
  need(want != nullptr, "no ISA path '" + name + "' (" + path_names() + ")");
  g_path.store(usable(want, name));
  return path().name;
}

}  // namespace

tracer_qmm::Contract tracer_qmm::contract_named(const std::string& name) {
  need(name == "exact" || name == "fast" || name == "factored" || name == "split",
       "contract must be 'exact', 'fast', 'factored' or 'split', got '" + name + "'");
  return name == "fast" ? Contract::fast : name == "factored" ? Contract::factored
                                         : name == "split"    ? Contract::split
                                                              : Contract::exact;
}

void tracer_qmm::matmul(const float* x, size_t ldx, int M, const Packed& w, float* out, Contract contract) {
  const Scale scale = w.scale == ScaleType::f16    ? Scale::f16
                      : w.scale == ScaleType::bf16 ? Scale::bf16
                      : w.scale == ScaleType::sb   ? Scale::sb
                                                   : Scale::f32;
  run(QmmJob{x, ldx, w.w, w.scales, w.biases, scale, M, w.N, w.K, w.group, w.bits, out}, contract);
}

bool tracer_qmm::exp_shifted(const float* x, float shift, float* out, int n) {
  const auto f = path().exp_shifted;
  return f != nullptr && (f(x, shift, out, n), true);
}

bool tracer_qmm::swiglu(const float* a, const float* b, float* out, int n) {
  const auto f = path().swiglu;
  return f != nullptr && (f(a, b, out, n), true);
}

bool tracer_qmm::attend_scores(const float* q, int R, int D, const void* k, int kind, int S, const float* bias,
                               int per, float* out) {
  const auto f = path().attend_scores;
  return f != nullptr && (f(q, R, D, k, kind, S, bias, per, out), true);
}

bool tracer_qmm::attend_split_scores(const QSplit& q, const AttendPacked& k, int bits, int S, const float* bias,
                                     int per, float* out) {
  const auto f = path().attend_split;
  return f != nullptr && (f(q, k, bits, S, bias, per, out), true);
}

bool tracer_qmm::attend_vector_path() {
  return path().attend_scores != nullptr;
}

bool tracer_qmm::attend_values(const float* p, int R, int S, const void* v, int kind, int D, float* out) {
  const auto f = path().attend_values;
  return f != nullptr && (f(p, R, S, v, kind, D, out), true);
}

void tracer_qmm::parallel_for(int count, void (*fn)(const void* ctx, int i), const void* ctx) {
  Pool::the().run(count, fn, ctx, count < 2);
}

int tracer_qmm::pool_threads() { return Pool::the().threads(); }

// a [N, G] float32 as superblock scales (qmm_api.h's ScaleType::sb), or
// nothing where some superblock has no step and int8 multipliers whose
// products give back its values bit for bit (adapters/lean/scales.py states
// the search: the largest value over k = 63, 127, 128, then every k, either sign).
std::optional<array> superblocks(const array& given) {
  need(given.dtype() == mx::float32 && given.ndim() == 2, "superblocks: a must be float32 [N, G], got " + describe(given));
  const int N = given.shape(0), G = given.shape(1);
  if (N == 0 || G == 0 || G % kSbGroups != 0) return std::nullopt;
  array a = given;
  a.eval();
  const float* x = a.data<float>();
  const int64_t s0 = a.strides()[0], s1 = a.strides()[1];
  static const std::vector<int> order = [] {
    std::vector<int> o{63, 127, 128};
    for (int k = 128; k >= 1; --k) {
      if (k != 63 && k != 127 && k != 128) o.push_back(k);
    }
    return o;
  }();
  const size_t rb = scale_row_bytes(Scale::sb, G);
  std::vector<uint8_t> out(size_t(N) * rb);
  auto fits = [](const float* v, float d, int8_t* m) {
    for (int i = 0; i < kSbGroups; ++i) {
      const float q = d != 0.0f ? std::nearbyint(v[i] / d) : 0.0f;  // ties to even, as np.rint
      if (!(q >= -128.0f && q <= 127.0f)) return false;
      m[i] = int8_t(q);
      if (std::bit_cast<uint32_t>(d * float(m[i])) != std::bit_cast<uint32_t>(v[i])) return false;
    }
    return true;
  };
  for (int r = 0; r < N; ++r) {
    uint8_t* row = out.data() + size_t(r) * rb;
    for (int b = 0; b < G / kSbGroups; ++b) {
      float v[kSbGroups];
      for (int i = 0; i < kSbGroups; ++i) v[i] = x[r * s0 + (b * kSbGroups + i) * s1];
      float top = v[0];
      for (int i = 1; i < kSbGroups; ++i) top = std::fabs(v[i]) > std::fabs(top) ? v[i] : top;
      int8_t m[kSbGroups];
      bool found = false;
      float step = 0.0f;
      for (size_t c = 0; c < 2 * order.size() && !found; ++c) {
        step = top / float(c % 2 ? -order[c / 2] : order[c / 2]);
        found = fits(v, step, m);
      }
      if (!found) return std::nullopt;
      std::memcpy(row + b * kSbGroups, m, kSbGroups);
      std::memcpy(row + G + sizeof(float) * b, &step, sizeof(float));
    }
  }
  return array(out.begin(), mx::Shape{N, int(rb)}, mx::uint8);
}

// w [N, K / 4] uint32, 8-bit blocks (mx.quantize's layout), as qmm's 5- or
// 6-bit blocks [N, K * bits / 32] (the layouts above, before the kernels), or
// nothing where a weight's integer is 2^bits or more (or K is not a multiple
// of 32).
std::optional<array> narrow(const array& given, int bits) {
  const std::string what = "narrow(w, bits=" + std::to_string(bits) + "): ";
  need(narrow_bits(bits), "narrow: bits must be 5 or 6, got " + std::to_string(bits));
  need(given.dtype() == mx::uint32 && given.ndim() == 2, what + "w must be uint32 [N, K / 4] (8-bit blocks), got " + describe(given));
  const int N = given.shape(0), K = given.shape(1) * 4;
  if (N == 0 || K % kBlock != 0) return std::nullopt;
  array a = given;
  a.eval();
  need(a.strides()[1] == 1, what + "w's rows must be contiguous");
  const int64_t s0 = a.strides()[0];
  const int kBytes = kBlock * bits / 8;
  std::vector<uint32_t> words(size_t(N) * K * bits / 32);
  uint8_t* out = reinterpret_cast<uint8_t*>(words.data());
  for (int r = 0; r < N; ++r) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(a.data<uint32_t>() + r * s0);
    uint8_t any = 0;
    for (int k = 0; k < K; ++k) any |= row[k];
    if (any >> bits) return std::nullopt;
    for (int blk = 0; blk < K / kBlock; ++blk) {
      const uint8_t* q = row + blk * kBlock;
      uint8_t* o = out + (size_t(r) * (K / kBlock) + blk) * kBytes;
      for (int i = 0; i < 16; ++i) o[i] = uint8_t((q[2 * i] & 15) | (q[2 * i + 1] & 15) << 4);
      if (bits == 5) {
        for (int f = 0; f < 4; ++f) {
          int b = 0;
          for (int l = 0; l < 4; ++l) b |= (q[8 * l + 2 * f + 1] >> 4) << l | (q[8 * l + 2 * f] >> 4) << (4 + l);
          o[16 + f] = uint8_t(b);
        }
      } else {
        for (int i = 0; i < 8; ++i) {
          o[16 + i] = uint8_t(q[2 * i] >> 4 | (q[2 * i + 1] >> 4) << 2 | (q[2 * i + 16] >> 4) << 4 | (q[2 * i + 17] >> 4) << 6);
        }
      }
    }
  }
  return array(words.begin(), mx::Shape{N, K * bits / 32}, mx::uint32);
}

void register_qmm(nb::module_& m) {
  m.def("qmm", &qmm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
        nb::arg("bits"), nb::arg("contract") = "exact",
        "x [M, K] float32 @ mx.dequantize(w, scales, biases, group_size, bits).T -> [M, N] float32; contract "
        "'exact' (each weight dequantized in float32, float32 sums), 'factored' (per group, scale * sum(q x) + "
        "bias * sum(x) in float32), 'fast' (x in int8 per 32-block, integer dot products) or 'split' (x as int8 "
        "plus an int8 remainder per 32-block, the fast contract's products of both added)");
  m.def("superblocks", &superblocks, nb::arg("a"),
        "a [N, G] float32 as superblock scales (uint8 [N, G * 3 / 2]: G int8 multipliers, then G / 8 float32 "
        "steps), or None where they do not give back every value bit for bit");
  m.def("narrow", &narrow, nb::arg("w"), nb::arg("bits"),
        "w [N, K / 4] uint32 (8-bit blocks) as qmm's 5- or 6-bit blocks [N, K * bits / 32] (the same integers: "
        "qmm_api.h states the layouts), or None where some integer is 2**bits or more");
  m.def("narrow5", [](const array& w) { return narrow(w, 5); }, nb::arg("w"),
        "narrow(w, 5): w [N, K / 4] uint32 (8-bit blocks) as qmm's 5-bit blocks [N, K * 5 / 32], or None where "
        "some integer is 32 or more");
  m.def("vector_math", [](const std::string& name, std::vector<float> a, std::vector<float> b, float shift) {
        need(name == "exp" || name == "swiglu", "vector_math: name must be 'exp' or 'swiglu'");
        need(name == "exp" || b.size() == a.size(), "vector_math: swiglu takes a and b of one length");
        std::vector<float> out(a.size());
        const bool done = name == "exp" ? tracer_qmm::exp_shifted(a.data(), shift, out.data(), int(a.size()))
                                        : tracer_qmm::swiglu(a.data(), b.data(), out.data(), int(a.size()));
        return done ? std::optional<std::vector<float>>(std::move(out)) : std::nullopt;
      }, nb::arg("name"), nb::arg("a"), nb::arg("b") = std::vector<float>{}, nb::arg("shift") = 0.0f,
      "The layer kernels' vector math on the ISA path in use (tests): 'exp' (exp(a - shift)) or 'swiglu' "
      "(a * sigmoid(a) * b); None where the path has none (MLX's one-lane functors serve)");
  m.def("qmm_profile", [] { return std::make_pair(g_qmm_ns.exchange(0), g_qmm_calls.exchange(0)); },
        "(nanoseconds, calls) in the qmm primitive's tasks since the last call (MLX_TRACER_KERNEL_PROFILE=1)");
  m.def("qmm_isa", [] { return std::string(path().name); }, "qmm's kernels in use: avx512, avx2 or portable");
  m.def("qmm_int8_isa", [] {
    const std::string name = path().name;
#if defined(__x86_64__)
    if (name == "avx512") return std::string(has_vnni() ? "avx512-vnni" : "avx2");  // as fast_avx512 picks
#endif
    return name;
  }, "the kernels of the fast and split contracts' integer products: avx512-vnni, avx2 or portable");
  m.def("qmm_set_isa", &set_isa, nb::arg("name"), "Use that ISA path from now on (the best one the CPU has if it lacks it); returns the one in use");
  m.def("qmm_tile_rows", [] { return kSmallMaxM; },
        "the most x rows the exact and factored contracts multiply in tiles (a row's bits the same at every M up to it; "
        "dequantized panels and sgemm above)");
  m.def("qmm_threads", [] { return Pool::the().threads(); });
  m.def("qmm_set_threads", [](int n) { Pool::the().set_threads(n); }, nb::arg("n"));
}

#endif  // TRACER_QMM_UNIT == 0
