// CPU kernels for the lean decode forward, as MLX primitives.
//
// Each kernel is one node of a compiled step's graph where MLX's CPU backend
// needs several (its mx.fast ops run their multi-node fallbacks on the CPU,
// and every op is a node the compiled step replays on the host each call).
// Every kernel computes *the same bits* as the MLX ops it replaces:
//  * element-wise math with MLX's own functors (the headers its CPU compiler
//    JIT-builds fused kernels from), in the same order, compiled as MLX 0.32
//    compiles them (-O3, no -march: no contraction into fused multiply-adds);
//  * reductions (a norm's sum of squares, softmax's max and sum) one element
//    at a time from the start, as MLX's CPU kernels run on x86 (one SIMD lane);
//  * matrix products with the cblas_sgemm call MLX's CPU matmul makes for the
//    same operands (same transposes, leading dimensions, alpha and beta; a
//    bias copied into the output first, as mx.addmm does);
//  * or, for a projection given as MLX's packed affine blocks (4 or 8 bits;
//    5 and 6 in qmm's own layouts),
//    the qmm call the lean forward's MLX-ops path makes for it (qmm.cpp,
//    its exact or fast contract), the bias added after, as `y + bias`;
//  * cached K/V as stored: float16/bfloat16 widened (exactly) a block at a
//    time and multiplied with the sgemm MLX's matmul makes after its
//    promotion to float32; packed 4-/8-bit K/V with the arithmetic of MLX's
//    CPU quantized_matmul (_qmm_t / _qmm: scalar on x86, every product and
//    sum rounded in order; here scalar or AVX2 lanes, the same bits).
// tests/test_kernels.py checks each against the MLX ops, bit for bit.
// One exception, by choice: beside packed projections (whose qmm already
// sums in its own order), a decode step's attention runs on vector lanes by
// default, MLX's sums up to their order (attend_x86.h; over packed K/V of
// one group a row, factored: attention_vector; MLX_TRACER_ATTENTION=blas
// keeps MLX's bits there too; tests/test_attention.py).
//
// Built and loaded by mlx_tracer/backend/kernels.py (see there).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/compiled_preamble.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/scheduler.h"
#include "mlx/stream.h"
#include "mlx/types/limits.h"
#include "qmm_api.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The BLAS MLX's matmuls call (the process's global cblas_sgemm: the fast
// BLAS shim when active, else the one libmlx links).
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc);

namespace nb = nanobind;
namespace mx = mlx::core;
using mx::array;
using mx::detail::Add;
using mx::detail::Multiply;
using mx::detail::Rsqrt;
using mx::detail::Sigmoid;
using mx::detail::Square;

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// Cache buffers cache_write wrote in place / into a copy (cache_writes()).
std::atomic<uint64_t> g_donated{0}, g_copied{0};
// Buffers realign moved in place / into a copy (realigns()).
std::atomic<uint64_t> g_realigned_in_place{0}, g_realigned_copied{0};

// Where a layer's time goes (MLX_TRACER_KERNEL_PROFILE=1; off: one branch a
// phase): nanoseconds and calls per phase, read and reset by profile().
enum Phase : int { kDown, kNorm, kQkv, kRope, kWrite, kAttn, kO, kGu, kSwiglu, kTaskIn, kTaskMid, kPhases };
const char* const kPhaseNames[kPhases] = {"down", "norm", "qkv", "rope", "cache_write", "attention",
                                          "o", "gu", "swiglu", "layer_in_task", "layer_mid_task"};
std::atomic<uint64_t> g_phase_ns[kPhases], g_phase_calls[kPhases];
const bool g_profile = [] {
  const char* e = std::getenv("MLX_TRACER_KERNEL_PROFILE");
  return e != nullptr && *e != 0 && *e != '0';
}();

struct Timed {
  Phase phase;
  std::chrono::steady_clock::time_point t0;
  explicit Timed(Phase p) : phase(p) {
    if (g_profile) t0 = std::chrono::steady_clock::now();
  }
  ~Timed() {
    if (g_profile) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
      g_phase_ns[phase] += uint64_t(ns.count());
      ++g_phase_calls[phase];
    }
  }
};

// ------------------------------------------------------------ array helpers
void alloc(std::vector<array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
}

// What a kernel's task reads of an array: its data pointer, shape and
// strides, and no reference. A task must not hold arrays: MLX keeps a node's
// input buffers alive until its tasks ran (as its own kernels rely on), and a
// reference held by a task still queued would keep the next step from
// writing a cache buffer in place.
struct View {
  float* p;
  std::vector<int> shape;
  std::vector<int64_t> strides;
  size_t size;

  View() : p(nullptr), size(0) {}
  explicit View(const array& a)
      : p(const_cast<float*>(a.data<float>())),
        shape(a.shape().begin(), a.shape().end()),
        strides(a.strides().begin(), a.strides().end()),
        size(a.size()) {}
  int dim(int i) const {
    return shape[i < 0 ? i + int(shape.size()) : i];
  }
};

// Cached keys or values as attention reads them, [B, nk, S, D]: each (row,
// key head) block row-major (any strides between blocks), stored as float32,
// float16 or bfloat16, or as MLX's packed affine blocks (mx.quantize's layout
// along D, mlx-lm's QuantizedKVCache: uint32 [B, nk, S, D bits / 32] with
// float32 scales and biases [B, nk, S, D / group]).
struct KV {
  enum Kind { f32, f16, bf16, packed };
  static Kind float_kind(mx::Dtype t) {
    return t == mx::float16 ? f16 : t == mx::bfloat16 ? bf16 : f32;
  }
  struct Blocks {  // one array's blocks: data and the strides between blocks, in elements
    const char* p = nullptr;
    int64_t sb = 0, sh = 0;
    size_t item = 0;
    template <class T>
    const T* at(int b, int h) const {
      return reinterpret_cast<const T*>(p + (b * sb + h * sh) * int64_t(item));
    }
  };
  Kind kind = f32;
  Blocks data, scales, biases;  // scales and biases: packed only
  int S = 0, D = 0, bits = 0, group = 0;
};

// A projection's right operand as a task sees it: a float32 matrix as
// cblas_sgemm takes it, or packed blocks as qmm takes them (packed.w set).
struct WeightView {
  const float* p = nullptr;
  bool trans = false;
  int ld = 0;
  tracer_qmm::Packed packed{};
  tracer_qmm::Contract contract = tracer_qmm::Contract::exact;  // qmm's, for packed blocks
};

// --------------------------------------------------------------- row math
// out [M, N] = x [M, K] @ w (+ bias [N]): a float32 w as mx.addmm computes it
// (bias rows first, beta 1); packed blocks as qmm, then out + bias.
void matmul(const float* x, int M, int K, const WeightView& w, int N, const float* bias, float* out) {
  if (w.packed.w != nullptr) {
    tracer_qmm::matmul(x, size_t(K), M, w.packed, out, w.contract);
    if (bias != nullptr) {
      for (size_t m = 0; m < size_t(M); ++m) {
        float* o = out + m * N;
        for (int n = 0; n < N; ++n) {
          o[n] = Add()(o[n], bias[n]);
        }
      }
    }
    return;
  }
  if (bias != nullptr) {
    for (int m = 0; m < M; ++m) {
      std::memcpy(out + size_t(m) * N, bias, sizeof(float) * N);
    }
  }
  cblas_sgemm(kRowMajor, kNoTrans, w.trans ? kTrans : kNoTrans, M, N, K, 1.0f, x, K, w.p, w.ld, bias ? 1.0f : 0.0f,
              out, N);
}

// out [M, N] = x @ [w1 | w2] (+ bias [N]): columns [0, n1) from w1, the
// rest from w2 (two formats: no w2, n1 = N: matmul). Each column is computed
// as its part alone computes it (the same bits as MLX's ops, which run the
// parts' matmuls and concatenate them).
void matmul_parts(const float* x, int M, int K, const WeightView& w1, int n1, const WeightView& w2, int N,
                  const float* bias, float* out) {
  if (n1 == N) {
    return matmul(x, M, K, w1, N, bias, out);
  }
  const int n2 = N - n1;
  if (M == 1) {  // one row: each part's columns are a run of out
    matmul(x, 1, K, w1, n1, bias, out);
    return matmul(x, 1, K, w2, n2, bias ? bias + n1 : nullptr, out + n1);
  }
  std::vector<float> a(size_t(M) * n1), b(size_t(M) * n2);
  matmul(x, M, K, w1, n1, bias, a.data());
  matmul(x, M, K, w2, n2, bias ? bias + n1 : nullptr, b.data());
  for (size_t m = 0; m < size_t(M); ++m) {
    std::memcpy(out + m * N, a.data() + m * n1, sizeof(float) * n1);
    std::memcpy(out + m * N + n1, b.data() + m * n2, sizeof(float) * n2);
  }
}

// Sum of squares of a row, in order from zero: MLX's Square kernel writes
// t * t rounded, its Sum adds them one by one. No contraction into a fused
// multiply-add here (that would skip the square's rounding).
__attribute__((optimize("fp-contract=off"))) float sum_of_squares(const float* t, int n) {
  float acc = 0.0f;
  for (int j = 0; j < n; ++j) {
    float sq = Square()(t[j]);
    acc = Add()(acc, sq);
  }
  return Add()(0.0f, acc);
}

// rows x [M, n] (+ r, the sum written to s) -> y = t * rsqrt(mean(t^2) + eps) * w
// with t = x (+ r): mx.fast.rms_norm's CPU fallback (and the lean forward's
// residual norm), kernel by kernel.
void norm_rows(const float* x, const float* r, const float* w, float eps, size_t M, int n, float* s, float* y) {
  const float inv = static_cast<float>(1.0 / n);
  for (size_t i = 0; i < M; ++i) {
    const float* xi = x + i * n;
    const float* t = xi;
    if (r != nullptr) {
      const float* ri = r + i * n;
      float* si = s + i * n;
      for (int j = 0; j < n; ++j) {
        si[j] = Add()(xi[j], ri[j]);
      }
      t = si;
    }
    const float ms = sum_of_squares(t, n);
    float* yi = y + i * n;
    for (int j = 0; j < n; ++j) {
      float tmp_L = Multiply()(ms, inv);
      float tmp_N = Add()(tmp_L, eps);
      float tmp_O = Rsqrt()(tmp_N);
      float tmp_Q = Multiply()(t[j], tmp_O);
      yi[j] = Multiply()(tmp_Q, w[j]);
    }
  }
}

// qwen3's per-head norms before the rotation: the nq query heads and the nk
// key heads of each row of y [M, (nq + 2 nk) D] normalized in place (over D,
// weights qw / kw), as norm_rows does for a whole row.
void qk_norm_rows(float* y, const float* qw, const float* kw, float eps, size_t M, int nq, int nk, int D) {
  const size_t N = size_t(nq + 2 * nk) * D;
  for (size_t m = 0; m < M; ++m) {
    float* r = y + m * N;
    norm_rows(r, nullptr, qw, eps, nq, D, nullptr, r);
    norm_rows(r + size_t(nq) * D, nullptr, kw, eps, nk, D, nullptr, r + size_t(nq) * D);
  }
}

// y [M, H * D] (M = B L: L tokens a row) rotated head by head as
// ((x * C) + (x_swapped * S)) * F (x_swapped: the head's halves exchanged;
// C/S [M * H, D], F [M * H, 1]: the lean forward's tables, values with C = 1,
// S = 0, F = 1), written out heads first: q [B, nq, L, D] (= [B, nk, R, L, D]),
// k [B, nk, L, D], v [B, nk, L, D].
void rope_rows(const float* y, const float* C, const float* S, const float* F, size_t M, int L, int nq, int nk, int D,
               float* q, float* k, float* v) {
  const int H = nq + 2 * nk, half = D / 2;
  for (size_t m = 0; m < M; ++m) {
    const size_t b = m / L, l = m % L;
    for (int h = 0; h < H; ++h) {
      const size_t row = m * H + h;
      const float* x = y + row * D;
      const float* c = C + row * D;
      const float* s = S + row * D;
      const float f = F[row];
      const size_t kv = ((b * nk + (h < nq + nk ? h - nq : h - nq - nk)) * L + l) * D;
      float* o = h < nq ? q + ((b * nq + h) * L + l) * D : (h < nq + nk ? k + kv : v + kv);
      for (int j = 0; j < D; ++j) {
        float tmp_F = Multiply()(x[j], c[j]);
        float tmp_G = Multiply()(x[j < half ? j + half : j - half], s[j]);
        float tmp_H = Add()(tmp_F, tmp_G);
        o[j] = Multiply()(tmp_H, f);
      }
    }
  }
}

// The sums over j < S of rows row[0 .. N), each in order from 0, side by side.
template <int N>
void sums_side_by_side(float* const* row, int S, float* norm) {
  for (int i = 0; i < N; ++i) norm[i] = 0.0f;
  for (int j = 0; j < S; ++j) {
    for (int i = 0; i < N; ++i) norm[i] += row[i][j];
  }
}

// The max of row[0 .. S) as MLX's softmax takes it (NaN if any is NaN), in 16 lanes.
float row_max(const float* row, int S) {
  float lane[16];
  int bad[16] = {};
  std::fill(lane, lane + 16, -mx::numeric_limits<float>::infinity());
  int j = 0;
  for (; j + 16 <= S; j += 16) {
    for (int l = 0; l < 16; ++l) {
      const float x = row[j + l];
      lane[l] = x > lane[l] ? x : lane[l];
      bad[l] |= x != x;
    }
  }
  for (; j < S; ++j) {
    lane[0] = row[j] > lane[0] ? row[j] : lane[0];
    bad[0] |= row[j] != row[j];
  }
  float top = lane[0];
  int nan = bad[0];
  for (int l = 1; l < 16; ++l) top = lane[l] > top ? lane[l] : top, nan |= bad[l];
  return nan ? std::numeric_limits<float>::quiet_NaN() : top;
}

// row[j] = MLX's exp(row[j] - top) for j < S (its bits: the ISA path's vector math, else its functor).
void exp_shifted_row(float* row, int S, float top) {
  if (!tracer_qmm::exp_shifted(row, top, row, S)) {
    using namespace mx::simd;
    for (int j = 0; j < S; ++j) {
      store(row + j, exp(load<float, 1>(row + j) - top));
    }
  }
}

// MLX's CPU softmax of R rows [R, S] in place (float32, precise: max, fast
// exp, sum, times 1 / sum), each row's bits as MLX's softmax gives them: its
// exps summed one after the other from key 0 (MLX's order; several rows' sums
// run side by side so that their additions overlap), its max taken in 16
// lanes (the same value: a max does not depend on its order, NaN wins either
// way; a zero's sign, which could, does not change any exp(x - max)).
void softmax_rows(float* rows, int R, int S) {
  constexpr int kSide = 4;  // rows summed side by side
  for (int r0 = 0; r0 < R; r0 += kSide) {
    const int n = std::min(kSide, R - r0);
    float* row[kSide];
    float norm[kSide];
    for (int i = 0; i < n; ++i) {
      row[i] = rows + size_t(r0 + i) * S;
      exp_shifted_row(row[i], S, row_max(row[i], S));
    }
    n == 4 ? sums_side_by_side<4>(row, S, norm)
    : n == 3 ? sums_side_by_side<3>(row, S, norm)
    : n == 2 ? sums_side_by_side<2>(row, S, norm)
             : sums_side_by_side<1>(row, S, norm);
    for (int i = 0; i < n; ++i) {
      const float inv = 1 / norm[i];
      for (int j = 0; j < S; ++j) row[i][j] = row[i][j] * inv;
    }
  }
}

// A run-time choice among three named ones: the index of `name`, else
// invalid_argument saying what takes which names.
template <int N>
int choice_named(const char* const (&names)[N], const std::string& name, const char* what) {
  std::string all;
  for (int i = 0; i < N; ++i) {
    if (name == names[i]) return i;
    all += std::string(i == 0 ? "" : i + 1 == N ? " or " : ", ") + names[i];
  }
  throw std::invalid_argument(std::string("mlx_tracer kernels: ") + what + " takes " + all + ", got '" + name + "'");
}
// The choice environment variable `var` names, or `fallback` where it is unset
// or names none (then said on stderr).
template <int N>
int choice_from_env(const char* const (&names)[N], const char* var, const char* what, int fallback) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == 0) return fallback;
  try {
    return choice_named(names, env, what);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s; using %s\n", e.what(), names[fallback]);
    return fallback;
  }
}

// ------------------------------------------------- cached K/V as stored
// float16/bfloat16 to float32: exact (every half is a float32), so any
// correct widening gives MLX's astype bits; F16C where the CPU has it.
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void widen_f16_f16c(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) {
    dst[i] = _cvtsh_ss(src[i]);
  }
}
const bool g_f16c = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}();
// The vector paths of the K/V reads: F16C widening and AVX2 packed reads
// where the CPU has AVX2 (level 1), AVX-512 packed reads where it has
// AVX-512 F/BW/VL (level 2); kv_set_isa or MLX_TRACER_KV_ISA (portable,
// avx2, avx512) forces a lower one (tests). Every level gives the same bits.
enum KvIsa { kKvPortable = 0, kKvAvx2 = 1, kKvAvx512 = 2 };
constexpr const char* kKvIsas[] = {"portable", "avx2", "avx512"};
int kv_isa_supported() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2")) return kKvPortable;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  return avx512 ? kKvAvx512 : kKvAvx2;
}
constexpr const char* kKvIsaWhat = "kv_set_isa / MLX_TRACER_KV_ISA";
int kv_isa_named(const std::string& name) {
  return choice_named(kKvIsas, name, kKvIsaWhat);
}
std::atomic<int> g_kv_isa{[] {
  const int best = kv_isa_supported();
  return std::min(choice_from_env(kKvIsas, "MLX_TRACER_KV_ISA", kKvIsaWhat, best), best);
}()};
inline int kv_level() {
  return g_kv_isa.load(std::memory_order_relaxed);
}
#endif

void widen(const KV& kv, const void* src, float* dst, size_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (kv.kind == KV::bf16) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t u = uint32_t(s[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    return;
  }
#if defined(__x86_64__)
  if (g_f16c && kv_level() >= kKvAvx2) {
    widen_f16_f16c(s, dst, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i) {
    mx::float16_t h;
    h.bits_ = s[i];
    dst[i] = static_cast<float>(h);
  }
}

// Block (b, h) of float keys/values as float32 [S, D]: the cache's own
// memory for float32, else widened into `scratch` (one block, per thread:
// what MLX's matmul reads after its astype to float32, never a copy of the cache).
const float* float_block(const KV& kv, int b, int h, std::vector<float>& scratch) {
  if (kv.kind == KV::f32) {
    return kv.data.at<float>(b, h);
  }
  const size_t n = size_t(kv.S) * kv.D;
  scratch.resize(n);
  widen(kv, kv.data.at<char>(b, h), scratch.data(), n);
  return scratch.data();
}

// Element d of a packed row (mx.quantize: element d at bits (d % per word)
// * bits of word d / per word, per word = 32 / bits; 4 or 8 bits).
inline float packed_at(const uint8_t* row, int d, int bits) {
  return bits == 8 ? float(row[d]) : float((row[d >> 1] >> ((d & 1) * 4)) & 15);
}

// scores [M, S] = x [M, D] @ dequantize(block (b, h) of k).T, each as MLX's
// CPU quantized_matmul (transpose = true, float32: its scalar _qmm_t on this
// CPU) computes it: from 0, along D in order, sum + x_d * (scale * q_d + bias),
// every product and sum rounded (no fused multiply-add). Tiles of keys are
// dequantized once (the same scale * q + bias) for all M rows.
__attribute__((optimize("fp-contract=off"))) void packed_scores(const float* x, int M, const KV& k, int b, int h,
                                                                float* scores) {
  constexpr int T = 16;  // keys a tile
  const int S = k.S, D = k.D, G = D / k.group, row_bytes = D * k.bits / 8;
  const uint8_t* w = k.data.at<uint8_t>(b, h);
  const float* sc = k.scales.at<float>(b, h);
  const float* bi = k.biases.at<float>(b, h);
  thread_local std::vector<float> tile;
  tile.assign(size_t(D) * T, 0.0f);  // [D, T]
  float* deq = tile.data();
  for (int s0 = 0; s0 < S; s0 += T) {
    const int n = std::min(T, S - s0);
    for (int j = 0; j < n; ++j) {
      const int s = s0 + j;
      const uint8_t* row = w + size_t(s) * row_bytes;
      for (int d = 0; d < D; ++d) {
        const int g = s * G + d / k.group;
        deq[d * T + j] = Add()(Multiply()(sc[g], packed_at(row, d, k.bits)), bi[g]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const float* xm = x + size_t(m) * D;
      float acc[T] = {};
      for (int d = 0; d < D; ++d) {
        const float xd = xm[d];
        const float* dd = deq + d * T;
        for (int j = 0; j < T; ++j) {
          acc[j] = Add()(acc[j], Multiply()(xd, dd[j]));
        }
      }
      std::memcpy(scores + size_t(m) * S + s0, acc, sizeof(float) * n);
    }
  }
}

// out [M, D] (rows ldo floats apart) = p [M, S] @ dequantize(block (b, h) of
// v), each as MLX's CPU quantized_matmul (transpose = false: its scalar _qmm)
// computes it: from 0, along S in order, out + p_s * (scale * q_s + bias).
__attribute__((optimize("fp-contract=off"))) void packed_values(const float* p, int M, const KV& v, int b, int h,
                                                                float* out, size_t ldo) {
  const int S = v.S, D = v.D, G = D / v.group, row_bytes = D * v.bits / 8;
  const uint8_t* w = v.data.at<uint8_t>(b, h);
  const float* sc = v.scales.at<float>(b, h);
  const float* bi = v.biases.at<float>(b, h);
  thread_local std::vector<float> rowbuf;
  rowbuf.resize(D);
  float* deq = rowbuf.data();
  for (int m = 0; m < M; ++m) {
    std::fill(out + m * ldo, out + m * ldo + D, 0.0f);
  }
  for (int s = 0; s < S; ++s) {
    const uint8_t* row = w + size_t(s) * row_bytes;
    for (int d = 0; d < D; ++d) {
      const int g = s * G + d / v.group;
      deq[d] = Add()(Multiply()(sc[g], packed_at(row, d, v.bits)), bi[g]);
    }
    for (int m = 0; m < M; ++m) {
      const float pm = p[size_t(m) * S + s];
      float* o = out + m * ldo;
      for (int d = 0; d < D; ++d) {
        o[d] = Add()(o[d], Multiply()(pm, deq[d]));
      }
    }
  }
}

// The same two on AVX2, 8 keys (scores) or 8 values (p @ v) a vector: each
// lane does the scalar code's operations in its order (mul, then add: AVX2
// without FMA, nothing contracted), so the bits are the scalar code's.
#if defined(__x86_64__)
// 8 rows of 8 bytes -> the 8 columns: column i in the low 8 bytes of c[i / 2]
// (i even) or its high 8 bytes (i odd).
__attribute__((target("avx2"))) inline void transpose8x8(const __m128i r[8], __m128i c[4]) {
  const __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpacklo_epi8(r[2], r[3]);
  const __m128i a2 = _mm_unpacklo_epi8(r[4], r[5]), a3 = _mm_unpacklo_epi8(r[6], r[7]);
  const __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  const __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  c[0] = _mm_unpacklo_epi32(b0, b2), c[1] = _mm_unpackhi_epi32(b0, b2);
  c[2] = _mm_unpacklo_epi32(b1, b3), c[3] = _mm_unpackhi_epi32(b1, b3);
}

__attribute__((target("avx2"), optimize("fp-contract=off"))) inline __m256 dequant8(__m128i q8, __m256 scale,
                                                                                  __m256 bias) {
  return _mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8))), bias);
}

__attribute__((target("avx2"), optimize("fp-contract=off"))) void packed_scores_avx2(const float* x, int M, const KV& k,
                                                                                   int b, int h, float* scores) {
  constexpr int T = 16;  // keys a tile: two vectors of 8
  const int S = k.S, D = k.D, group = k.group, G = D / group, bits = k.bits, row_bytes = D * bits / 8;
  const int group_bytes = group * bits / 8;
  const uint8_t* w = k.data.at<uint8_t>(b, h);
  const float* sc = k.scales.at<float>(b, h);
  const float* bi = k.biases.at<float>(b, h);
  thread_local std::vector<float> tile;
  tile.resize(size_t(D) * T);
  float* deq = tile.data();  // [D, T]: the tile's keys side by side
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int s0 = 0; s0 < S; s0 += T) {
    const int n = std::min(T, S - s0);
    for (int half = 0; half < T; half += 8) {
      int key[8];
      for (int j = 0; j < 8; ++j) {
        key[j] = s0 + std::min(half + j, n - 1);  // past the end: the last key again (not stored)
      }
      for (int g = 0; g < G; ++g) {
        const __m256 vs = _mm256_setr_ps(sc[key[0] * G + g], sc[key[1] * G + g], sc[key[2] * G + g],
                                         sc[key[3] * G + g], sc[key[4] * G + g], sc[key[5] * G + g],
                                         sc[key[6] * G + g], sc[key[7] * G + g]);
        const __m256 vb = _mm256_setr_ps(bi[key[0] * G + g], bi[key[1] * G + g], bi[key[2] * G + g],
                                         bi[key[3] * G + g], bi[key[4] * G + g], bi[key[5] * G + g],
                                         bi[key[6] * G + g], bi[key[7] * G + g]);
        for (int o = g * group_bytes; o < (g + 1) * group_bytes; o += 8) {
          __m128i r[8], c[4];
          for (int j = 0; j < 8; ++j) {
            r[j] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + size_t(key[j]) * row_bytes + o));
          }
          transpose8x8(r, c);
          for (int i = 0; i < 8; ++i) {
            const __m128i col = (i & 1) ? _mm_unpackhi_epi64(c[i / 2], c[i / 2]) : c[i / 2];
            if (bits == 8) {
              _mm256_storeu_ps(deq + (o + i) * T + half, dequant8(col, vs, vb));
            } else {
              const __m128i lo = _mm_and_si128(col, low4), hi = _mm_and_si128(_mm_srli_epi16(col, 4), low4);
              _mm256_storeu_ps(deq + 2 * (o + i) * T + half, dequant8(lo, vs, vb));
              _mm256_storeu_ps(deq + (2 * (o + i) + 1) * T + half, dequant8(hi, vs, vb));
            }
          }
        }
      }
    }
    // two rows at a time: four independent sums along D, each in order
    int m = 0;
    for (; m + 2 <= M; m += 2) {
      const float *x0 = x + size_t(m) * D, *x1 = x0 + D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
      for (int d = 0; d < D; ++d) {
        const __m256 lo = _mm256_loadu_ps(deq + d * T), hi = _mm256_loadu_ps(deq + d * T + 8);
        const __m256 v0 = _mm256_set1_ps(x0[d]), v1 = _mm256_set1_ps(x1[d]);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, lo));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(v0, hi));
        b0 = _mm256_add_ps(b0, _mm256_mul_ps(v1, lo));
        b1 = _mm256_add_ps(b1, _mm256_mul_ps(v1, hi));
      }
      float out[2][T];
      _mm256_storeu_ps(out[0], a0), _mm256_storeu_ps(out[0] + 8, a1);
      _mm256_storeu_ps(out[1], b0), _mm256_storeu_ps(out[1] + 8, b1);
      std::memcpy(scores + size_t(m) * S + s0, out[0], sizeof(float) * n);
      std::memcpy(scores + size_t(m + 1) * S + s0, out[1], sizeof(float) * n);
    }
    for (; m < M; ++m) {
      const float* x0 = x + size_t(m) * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0;
      for (int d = 0; d < D; ++d) {
        const __m256 v0 = _mm256_set1_ps(x0[d]);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, _mm256_loadu_ps(deq + d * T)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(v0, _mm256_loadu_ps(deq + d * T + 8)));
      }
      float out[T];
      _mm256_storeu_ps(out, a0), _mm256_storeu_ps(out + 8, a1);
      std::memcpy(scores + size_t(m) * S + s0, out, sizeof(float) * n);
    }
  }
}

__attribute__((target("avx2"), optimize("fp-contract=off"))) void packed_values_avx2(const float* p, int M, const KV& v,
                                                                                   int b, int h, float* out,
                                                                                   size_t ldo) {
  constexpr int T = 32;  // values a tile, dequantized together [T, D]
  const int S = v.S, D = v.D, group = v.group, G = D / group, bits = v.bits, row_bytes = D * bits / 8;
  const uint8_t* w = v.data.at<uint8_t>(b, h);
  const float* sc = v.scales.at<float>(b, h);
  const float* bi = v.biases.at<float>(b, h);
  thread_local std::vector<float> tile;
  tile.resize(size_t(T) * D);
  float* deq = tile.data();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int m = 0; m < M; ++m) {
    std::fill(out + m * ldo, out + m * ldo + D, 0.0f);
  }
  for (int s0 = 0; s0 < S; s0 += T) {
    const int n = std::min(T, S - s0);
    for (int j = 0; j < n; ++j) {
      const int s = s0 + j;
      const uint8_t* row = w + size_t(s) * row_bytes;
      for (int g = 0; g < G; ++g) {
        const __m256 vs = _mm256_set1_ps(sc[s * G + g]), vb = _mm256_set1_ps(bi[s * G + g]);
        for (int d = g * group; d < (g + 1) * group; d += 8) {
          __m128i q;
          if (bits == 8) {
            q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
          } else {
            int32_t four;
            std::memcpy(&four, row + d / 2, 4);
            const __m128i x4 = _mm_cvtsi32_si128(four);
            q = _mm_unpacklo_epi8(_mm_and_si128(x4, low4), _mm_and_si128(_mm_srli_epi16(x4, 4), low4));
          }
          _mm256_storeu_ps(deq + j * D + d, dequant8(q, vs, vb));
        }
      }
    }
    // each output row, 32 values at a time in registers, along the tile's values in order
    for (int m = 0; m < M; ++m) {
      const float* pm = p + size_t(m) * S + s0;
      float* o = out + m * ldo;
      for (int d = 0; d < D; d += 32) {  // D: whole groups, a multiple of 32
        __m256 c0 = _mm256_loadu_ps(o + d), c1 = _mm256_loadu_ps(o + d + 8), c2 = _mm256_loadu_ps(o + d + 16),
               c3 = _mm256_loadu_ps(o + d + 24);
        for (int j = 0; j < n; ++j) {
          const __m256 pj = _mm256_set1_ps(pm[j]);
          const float* dj = deq + j * D + d;
          c0 = _mm256_add_ps(c0, _mm256_mul_ps(pj, _mm256_loadu_ps(dj)));
          c1 = _mm256_add_ps(c1, _mm256_mul_ps(pj, _mm256_loadu_ps(dj + 8)));
          c2 = _mm256_add_ps(c2, _mm256_mul_ps(pj, _mm256_loadu_ps(dj + 16)));
          c3 = _mm256_add_ps(c3, _mm256_mul_ps(pj, _mm256_loadu_ps(dj + 24)));
        }
        _mm256_storeu_ps(o + d, c0), _mm256_storeu_ps(o + d + 8, c1);
        _mm256_storeu_ps(o + d + 16, c2), _mm256_storeu_ps(o + d + 24, c3);
      }
    }
  }
}
#endif

#if defined(__x86_64__)
// The same two on AVX-512, 16 keys (scores) or 16 values (p @ v) a vector,
// each lane the scalar code's operations in its order (mul, then add, nothing
// contracted): the scalar code's bits, with half the instructions of AVX2's.

// 16 bytes (keys 0..15's byte at one offset) -> their float32 dequantization.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2"), optimize("fp-contract=off"))) inline __m512 dequant16(
    __m128i q, __m512 scale, __m512 bias) {
  return _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))), bias);
}

// scores of RB rows (x, D apart) against a dequantized tile [D, 16] -> out rows (S apart), the lanes in keep.
template <int RB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2"), optimize("fp-contract=off"))) inline void packed_rows_avx512(
    const float* x, int D, const float* deq, float* out, int S, __mmask16 keep) {
  __m512 a[RB];
  for (int r = 0; r < RB; ++r) a[r] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 v = _mm512_loadu_ps(deq + d * 16);
    for (int r = 0; r < RB; ++r) a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(_mm512_set1_ps(x[size_t(r) * D + d]), v));
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(out + size_t(r) * S, keep, a[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2"), optimize("fp-contract=off"))) void packed_scores_avx512(
    const float* x, int M, const KV& k, int b, int h, float* scores) {
  constexpr int T = 16;  // keys a tile: one vector
  const int S = k.S, D = k.D, group = k.group, G = D / group, bits = k.bits, row_bytes = D * bits / 8;
  const int group_bytes = group * bits / 8;
  const uint8_t* w = k.data.at<uint8_t>(b, h);
  const float* sc = k.scales.at<float>(b, h);
  const float* bi = k.biases.at<float>(b, h);
  thread_local std::vector<float> tile;
  tile.resize(size_t(D) * T);
  float* deq = tile.data();  // [D, T]: the tile's keys side by side
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int s0 = 0; s0 < S; s0 += T) {
    const int n = std::min(T, S - s0);
    alignas(64) int key[T];
    for (int j = 0; j < T; ++j) {
      key[j] = s0 + std::min(j, n - 1);  // past the end: the last key again (not stored)
    }
    const __m512i at = _mm512_mullo_epi32(_mm512_load_si512(key), _mm512_set1_epi32(G));  // the keys' first group
    for (int g = 0; g < G; ++g) {
      const __m512i ag = _mm512_add_epi32(at, _mm512_set1_epi32(g));
      const __m512 vs = _mm512_i32gather_ps(ag, sc, 4), vb = _mm512_i32gather_ps(ag, bi, 4);
      for (int o = g * group_bytes; o < (g + 1) * group_bytes; o += 8) {
        __m128i r0[8], r1[8], c0[4], c1[4];
        for (int j = 0; j < 8; ++j) {
          r0[j] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + size_t(key[j]) * row_bytes + o));
          r1[j] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + size_t(key[8 + j]) * row_bytes + o));
        }
        transpose8x8(r0, c0);
        transpose8x8(r1, c1);
        for (int i = 0; i < 8; ++i) {  // byte o + i of the 16 keys
          const __m128i col = (i & 1) ? _mm_unpackhi_epi64(c0[i / 2], c1[i / 2]) : _mm_unpacklo_epi64(c0[i / 2], c1[i / 2]);
          if (bits == 8) {
            _mm512_storeu_ps(deq + (o + i) * T, dequant16(col, vs, vb));
          } else {
            const __m128i lo = _mm_and_si128(col, low4), hi = _mm_and_si128(_mm_srli_epi16(col, 4), low4);
            _mm512_storeu_ps(deq + 2 * (o + i) * T, dequant16(lo, vs, vb));
            _mm512_storeu_ps(deq + (2 * (o + i) + 1) * T, dequant16(hi, vs, vb));
          }
        }
      }
    }
    // up to four rows at a time: independent sums along D, each in order
    const __mmask16 keep = __mmask16((1u << n) - 1);
    for (int m = 0; m < M; m += 4) {
      float* to = scores + size_t(m) * S + s0;
      const float* xm = x + size_t(m) * D;
      switch (std::min(4, M - m)) {
        case 4: packed_rows_avx512<4>(xm, D, deq, to, S, keep); break;
        case 3: packed_rows_avx512<3>(xm, D, deq, to, S, keep); break;
        case 2: packed_rows_avx512<2>(xm, D, deq, to, S, keep); break;
        default: packed_rows_avx512<1>(xm, D, deq, to, S, keep); break;
      }
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2"), optimize("fp-contract=off"))) void packed_values_avx512(
    const float* p, int M, const KV& v, int b, int h, float* out, size_t ldo) {
  constexpr int T = 32;  // values a tile, dequantized together [T, D]
  const int S = v.S, D = v.D, group = v.group, G = D / group, bits = v.bits, row_bytes = D * bits / 8;
  const uint8_t* w = v.data.at<uint8_t>(b, h);
  const float* sc = v.scales.at<float>(b, h);
  const float* bi = v.biases.at<float>(b, h);
  thread_local std::vector<float> tile;
  tile.resize(size_t(T) * D);
  float* deq = tile.data();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int m = 0; m < M; ++m) {
    std::fill(out + m * ldo, out + m * ldo + D, 0.0f);
  }
  for (int s0 = 0; s0 < S; s0 += T) {
    const int n = std::min(T, S - s0);
    for (int j = 0; j < n; ++j) {
      const int s = s0 + j;
      const uint8_t* row = w + size_t(s) * row_bytes;
      for (int g = 0; g < G; ++g) {
        const __m512 vs = _mm512_set1_ps(sc[s * G + g]), vb = _mm512_set1_ps(bi[s * G + g]);
        for (int d = g * group; d < (g + 1) * group; d += 16) {
          __m128i q;
          if (bits == 8) {
            q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
          } else {  // 8 bytes: values d, d + 1 in each byte's low and high nibble
            const __m128i x8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 2));
            q = _mm_unpacklo_epi8(_mm_and_si128(x8, low4), _mm_and_si128(_mm_srli_epi16(x8, 4), low4));
          }
          _mm512_storeu_ps(deq + j * D + d, dequant16(q, vs, vb));
        }
      }
    }
    // each output row, 64 values at a time in registers, along the tile's values in order
    for (int m = 0; m < M; ++m) {
      const float* pm = p + size_t(m) * S + s0;
      float* o = out + m * ldo;
      int d = 0;
      for (; d + 64 <= D; d += 64) {
        __m512 c0 = _mm512_loadu_ps(o + d), c1 = _mm512_loadu_ps(o + d + 16), c2 = _mm512_loadu_ps(o + d + 32),
               c3 = _mm512_loadu_ps(o + d + 48);
        for (int j = 0; j < n; ++j) {
          const __m512 pj = _mm512_set1_ps(pm[j]);
          const float* dj = deq + j * D + d;
          c0 = _mm512_add_ps(c0, _mm512_mul_ps(pj, _mm512_loadu_ps(dj)));
          c1 = _mm512_add_ps(c1, _mm512_mul_ps(pj, _mm512_loadu_ps(dj + 16)));
          c2 = _mm512_add_ps(c2, _mm512_mul_ps(pj, _mm512_loadu_ps(dj + 32)));
          c3 = _mm512_add_ps(c3, _mm512_mul_ps(pj, _mm512_loadu_ps(dj + 48)));
        }
        _mm512_storeu_ps(o + d, c0), _mm512_storeu_ps(o + d + 16, c1);
        _mm512_storeu_ps(o + d + 32, c2), _mm512_storeu_ps(o + d + 48, c3);
      }
      for (; d < D; d += 32) {  // D: whole groups, a multiple of 32
        __m512 c0 = _mm512_loadu_ps(o + d), c1 = _mm512_loadu_ps(o + d + 16);
        for (int j = 0; j < n; ++j) {
          const __m512 pj = _mm512_set1_ps(pm[j]);
          const float* dj = deq + j * D + d;
          c0 = _mm512_add_ps(c0, _mm512_mul_ps(pj, _mm512_loadu_ps(dj)));
          c1 = _mm512_add_ps(c1, _mm512_mul_ps(pj, _mm512_loadu_ps(dj + 16)));
        }
        _mm512_storeu_ps(o + d, c0), _mm512_storeu_ps(o + d + 16, c1);
      }
    }
  }
}
#endif

// The packed scores / values on the path in use (kv_isa(); the bits do not depend on it).
void packed_scores_any(const float* x, int M, const KV& k, int b, int h, float* scores) {
#if defined(__x86_64__)
  switch (kv_level()) {
    case kKvAvx512:
      return packed_scores_avx512(x, M, k, b, h, scores);
    case kKvAvx2:
      return packed_scores_avx2(x, M, k, b, h, scores);
  }
#endif
  packed_scores(x, M, k, b, h, scores);
}

void packed_values_any(const float* p, int M, const KV& v, int b, int h, float* out, size_t ldo) {
#if defined(__x86_64__)
  switch (kv_level()) {
    case kKvAvx512:
      return packed_values_avx512(p, M, v, b, h, out, ldo);
    case kKvAvx2:
      return packed_values_avx2(p, M, v, b, h, out, ldo);
  }
#endif
  packed_values(p, M, v, b, h, out, ldo);
}

// "avx512", "avx2" or "portable": the path of the K/V reads; kv_set_isa forces
// one ("portable" always exists; the others where the CPU has them, else the
// best below). For tests.
std::string kv_isa() {
#if defined(__x86_64__)
  return kKvIsas[kv_level()];
#else
  return "portable";
#endif
}

std::string kv_set_isa(const std::string& name) {
#if defined(__x86_64__)
  g_kv_isa.store(std::min(kv_isa_named(name), kv_isa_supported()));
#else
  if (name != "portable" && name != "avx2" && name != "avx512") {
    throw std::invalid_argument("mlx_tracer kernels: kv_set_isa takes portable, avx2 or avx512, got '" + name + "'");
  }
#endif
  return kv_isa();
}

// Calls fn(i) for every i in [0, count) on qmm's pool, and over_heads fn(b,
// h) for every (row, key head) pair of an attention: each item is computed
// by one thread with the same calls, so the bits do not depend on the
// thread count. Scratch is per thread.
template <class Fn>
void over_items(int count, const Fn& fn) {
  tracer_qmm::parallel_for(
      count, [](const void* c, int i) { (*static_cast<const Fn*>(c))(i); }, &fn);
}
template <class Fn>
void over_heads(int B, int nk, const Fn& fn) {
  over_items(B * nk, [&](int i) { fn(i / nk, i % nk); });
}

// -------------------------------------- decode attention on vector lanes
// attention_rows' other arithmetic (attend_x86.h states it): for float K/V
// read as stored, the dot products in 16 fused lanes and the values as fused
// multiply-adds in key order, MLX's sums up to their order (not its bits).
// Used where the layer's projections are packed blocks (qmm's contracts,
// which already sum in their own order) unless MLX_TRACER_ATTENTION says
// otherwise: "blas" (MLX's bits everywhere), "vector" (everywhere it can),
// "auto" (default). The vector ISA path is qmm's (qmm_set_isa); where it has
// none, these loops give the same bits.
enum AttentionMode { kAttnAuto = 0, kAttnBlas = 1, kAttnVector = 2 };
const char* const kAttentionModes[] = {"auto", "blas", "vector"};

constexpr const char* kAttentionWhat = "MLX_TRACER_ATTENTION / attention_mode";
int attention_mode_named(const std::string& name) {
  return choice_named(kAttentionModes, name, kAttentionWhat);
}

std::atomic<int> g_attention{choice_from_env(kAttentionModes, "MLX_TRACER_ATTENTION", kAttentionWhat, kAttnAuto)};

std::string attention_mode(std::optional<std::string> name) {
  if (name) g_attention.store(attention_mode_named(*name));
  return kAttentionModes[g_attention.load()];
}

// Whether a decode attention over k, v with packed (or float32) projections runs on vector lanes.
bool vector_attention(const KV& k, const KV& v, bool packed_weights) {
  const int mode = g_attention.load(std::memory_order_relaxed);
  return (mode == kAttnVector || (mode == kAttnAuto && packed_weights)) && k.D % 16 == 0 && k.D <= 256;
}

// Block (b, h) of kv as the vector attention takes it (tracer_qmm::attend_*):
// its memory, or for packed blocks `p` filled in and its address.
const void* attend_block(const KV& kv, int b, int h, tracer_qmm::AttendPacked& p) {
  if (kv.kind != KV::packed) return kv.data.at<char>(b, h);
  p = {kv.data.at<uint8_t>(b, h), kv.scales.at<float>(b, h), kv.biases.at<float>(b, h), kv.D * kv.bits / 8,
       kv.D / kv.group, std::countr_zero(unsigned(kv.group))};
  return &p;
}
// Its storage as tracer_qmm::attend_* names it; packed blocks as their
// integers alone (no scale or bias) where `integers` (attend::q8i / q4i, two
// past q8 / q4).
int attend_kind(const KV& kv, bool integers = false) {
  return kv.kind == KV::packed ? (kv.bits == 8 ? 3 : 4) + (integers ? 2 : 0) : int(kv.kind);
}
// Whether a packed block's vector attention runs factored (attention_vector):
// one group a row, so that a key's (or value row's) scale and bias apply to
// its whole dot product, unless MLX_TRACER_PACKED_ATTENTION=dequantized (or
// packed_attention("dequantized")) keeps MLX's dequantized values in the lanes.
const char* const kPackedAttention[] = {"factored", "dequantized"};
constexpr const char* kPackedWhat = "MLX_TRACER_PACKED_ATTENTION / packed_attention";
std::atomic<int> g_packed_attention{choice_from_env(kPackedAttention, "MLX_TRACER_PACKED_ATTENTION", kPackedWhat, 0)};
std::string packed_attention(std::optional<std::string> name) {
  if (name) g_packed_attention.store(choice_named(kPackedAttention, *name, kPackedWhat));
  return kPackedAttention[g_packed_attention.load()];
}
bool factored_kv(const KV& kv) {
  return kv.kind == KV::packed && kv.group == kv.D && g_packed_attention.load(std::memory_order_relaxed) == 0;
}

// Row s of a block as float32: a float32 block's own memory, else widened
// or (packed: `block` an AttendPacked) dequantized as MLX does into `buf`
// (where `integers`: its integers alone, as floats).
__attribute__((optimize("fp-contract=off"))) const float* stored_row(const KV& kv, const void* block, int s,
                                                                     float* buf, bool integers = false) {
  if (kv.kind == KV::packed) {
    const auto& p = *static_cast<const tracer_qmm::AttendPacked*>(block);
    const uint8_t* row = p.data + size_t(s) * p.row_bytes;
    if (integers) {
      for (int d = 0; d < kv.D; ++d) buf[d] = packed_at(row, d, kv.bits);
      return buf;
    }
    for (int d = 0; d < kv.D; ++d) {
      const size_t g = size_t(s) * p.groups + (d >> p.group_shift);
      buf[d] = Add()(Multiply()(p.scales[g], packed_at(row, d, kv.bits)), p.biases[g]);
    }
    return buf;
  }
  const size_t at = size_t(s) * kv.D;
  if (kv.kind == KV::f32) return static_cast<const float*>(block) + at;
  widen(kv, static_cast<const uint16_t*>(block) + at, buf, kv.D);
  return buf;
}

void attend_scores_loops(const float* q, int R, int D, const KV& k, const void* block, int S, const float* bias,
                         int per, float* out) {
  float buf[256];
  const int nb = (R + per - 1) / per;
  for (int s = 0; s < S; ++s) {
    bool all = true;  // masked for every bias row: the key is not read
    for (int i = 0; i < nb; ++i) all = all && tracer_qmm::masked_key(bias[size_t(i) * S + s]);
    const float* kr = all ? nullptr : stored_row(k, block, s, buf);
    for (int r = 0; r < R; ++r) {
      const float b = bias[size_t(r / per) * S + s];
      if (tracer_qmm::masked_key(b)) {
        out[size_t(r) * S + s] = b;
        continue;
      }
      const float* qr = q + size_t(r) * D;
      float l[16] = {};
      for (int d = 0; d < D; ++d) l[d % 16] = std::fma(qr[d], kr[d], l[d % 16]);
      for (int i = 0; i < 8; ++i) l[i] = l[i] + l[i + 8];
      for (int i = 0; i < 4; ++i) l[i] = l[i] + l[i + 4];
      for (int i = 0; i < 2; ++i) l[i] = l[i] + l[i + 2];
      out[size_t(r) * S + s] = b + (l[0] + l[1]);
    }
  }
}

void attend_values_loops(const float* p, int R, int S, const KV& v, const void* block, int D, float* out,
                         bool integers) {
  std::fill(out, out + size_t(R) * D, 0.0f);
  float buf[256];
  for (int s = 0; s < S; ++s) {
    bool any = false;
    for (int r = 0; r < R; ++r) any |= p[size_t(r) * S + s] != 0.0f;
    if (!any) continue;
    const float* vr = stored_row(v, block, s, buf, integers);
    for (int r = 0; r < R; ++r) {
      const float pr = p[size_t(r) * S + s];
      float* o = out + size_t(r) * D;
      for (int d = 0; d < D; ++d) o[d] = std::fma(pr, vr[d], o[d]);
    }
  }
}

// A block's query rows [R, D] split for the factored scores over packed keys
// (qmm_api.h's QSplit): per row, d0 = max |q| / 127 and, for each value,
// a = q / d0, q0 = round(a), q1 = round((a - q0) * 254), q2 = round(((a - q0)
// * 254 - q1) * 254) (to nearest, ties to even; |q_p| <= 127), d1 = d0 / 254,
// d2 = d1 / 254; qsum = float(254 sum q0 + sum q1) * d1 + float(sum q2) * d2.
// The parts hold q to about 2^-24 of the row's largest |q| (each value within
// ~1e-7 of it, the rounding of q / d0 included). A row of zeros:
// parts and scales 0; a row with a NaN or an infinity: scales and qsum NaN
// (its scores NaN where the keys are visible, as float arithmetic gives).
__attribute__((optimize("fp-contract=off"))) void split_rows(const float* q, int R, int D, int8_t* parts,
                                                             float* scale, float* qsum) {
  constexpr int P = tracer_qmm::kQParts;
  for (int r = 0; r < R; ++r) {
    const float* x = q + size_t(r) * D;
    int8_t* p0 = parts + size_t(r) * P * D;
    float* d = scale + size_t(r) * P;
    float top = 0.0f;
    bool finite = true;
    for (int j = 0; j < D; ++j) finite = finite && std::isfinite(x[j]), top = std::max(top, std::fabs(x[j]));
    const float d0 = top / 127.0f;
    if (!finite || d0 == 0.0f) {
      std::memset(p0, 0, size_t(P) * D);
      const float fill = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      d[0] = d[1] = d[2] = qsum[r] = fill;
      continue;
    }
    int32_t sums[P] = {};
    for (int j = 0; j < D; ++j) {
      const float a = x[j] / d0, i0 = std::nearbyint(a);
      const float e1 = (a - i0) * 254.0f, i1 = std::nearbyint(e1);
      const float i2 = std::nearbyint((e1 - i1) * 254.0f);
      p0[j] = int8_t(i0), p0[D + j] = int8_t(i1), p0[2 * D + j] = int8_t(i2);
      sums[0] += int32_t(i0), sums[1] += int32_t(i1), sums[2] += int32_t(i2);
    }
    d[0] = d0, d[1] = d0 / 254.0f, d[2] = d[1] / 254.0f;
    qsum[r] = float(tracer_qmm::join01(sums[0], sums[1])) * d[1] + float(sums[2]) * d[2];
  }
}

// The split scores in plain loops (the portable path): each key's integers
// times each part, summed in int32 (exact), finished by split_score.
void split_scores_loops(const tracer_qmm::QSplit& q, const tracer_qmm::AttendPacked& k, int bits, int S,
                        const float* bias, int per, float* out) {
  constexpr int P = tracer_qmm::kQParts;
  const int R = q.R, D = q.D, nb = (R + per - 1) / per;
  int32_t ints[256];
  for (int s = 0; s < S; ++s) {
    bool all = true;  // masked for every bias row: the key is not read
    for (int i = 0; i < nb; ++i) all = all && tracer_qmm::masked_key(bias[size_t(i) * S + s]);
    if (all) {
      for (int r = 0; r < R; ++r) out[size_t(r) * S + s] = bias[size_t(r / per) * S + s];
      continue;
    }
    const uint8_t* row = k.data + size_t(s) * k.row_bytes;
    for (int j = 0; j < D; ++j) ints[j] = int32_t(packed_at(row, j, bits));
    for (int r = 0; r < R; ++r) {
      int32_t a[P] = {};
      for (int p = 0; p < P; ++p) {
        const int8_t* qp = q.parts + (size_t(r) * P + p) * D;
        for (int j = 0; j < D; ++j) a[p] += ints[j] * int32_t(qp[j]);
      }
      out[size_t(r) * S + s] = tracer_qmm::split_score(tracer_qmm::join01(a[0], a[1]), a[2], q.scale + size_t(r) * P,
                                                       k.scales[s], k.biases[s], q.qsum[r], bias[size_t(r / per) * S + s]);
    }
  }
}

// attention_vector's passes beside the lanes (its softmax; the factored
// arithmetic's value terms), the same operations on every ISA path: each
// element's products and sums in the order written, none fused; vectors of
// 8 (GCC's vector extension: AVX2 beside the AVX2 and AVX-512 lanes, SSE2
// beside the portable loops, forced or not; the same bits), a sum over keys
// in 8 lanes (key i into lane i % 8 in order, then ((0 + 4) + (2 + 6)) +
// ((1 + 5) + (3 + 7))).
namespace factored {
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
inline v8 load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 select(v8i m, v8 a, v8 b) {  // m ? a : b, lanewise
  return reinterpret_cast<v8>((m & reinterpret_cast<v8i>(a)) | (~m & reinterpret_cast<v8i>(b)));
}
inline float tree(v8 l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#define FACTORED_PASSES                                                                                        \
  /* out = p * vs where p != 0 (else 0); returns the 8-lane sum of p * vb where p != 0 */                    \
  float scale_probs(const float* p, const float* vs, const float* vb, int S, float* out) {                    \
    v8 acc{};                                                                                                  \
    int j = 0;                                                                                                 \
    for (; j + 8 <= S; j += 8) {                                                                               \
      const v8 pv = load(p + j);                                                                               \
      const v8i live = pv != v8{};                                                                             \
      store(out + j, select(live, pv * load(vs + j), v8{}));                                                   \
      acc = acc + select(live, pv * load(vb + j), v8{});                                                       \
    }                                                                                                          \
    for (int l = 0; j < S; ++j, ++l) {                                                                         \
      out[j] = p[j] != 0.0f ? p[j] * vs[j] : 0.0f;                                                             \
      acc[l] = acc[l] + (p[j] != 0.0f ? p[j] * vb[j] : 0.0f);                                                  \
    }                                                                                                          \
    return tree(acc);                                                                                          \
  }                                                                                                            \
  void add_to(float* x, int n, float c) {                                                                      \
    for (int i = 0; i < n; ++i) x[i] = x[i] + c;                                                               \
  }                                                                                                            \
  /* the vector path's softmax of a row in place: max (NaN if any), MLX's exp(x - max), the 8-lane sum, */   \
  /* each times 1 / sum */                                                                                     \
  void softmax_row(float* x, int n) {                                                                          \
    v8 top = v8{} - std::numeric_limits<float>::infinity();                                                  \
    v8i bad{};                                                                                                 \
    int j = 0;                                                                                                 \
    for (; j + 8 <= n; j += 8) {                                                                               \
      const v8 v = load(x + j);                                                                                \
      top = select(v > top, v, top), bad = bad | (v != v);                                                     \
    }                                                                                                          \
    float m = -std::numeric_limits<float>::infinity();                                                       \
    bool nan = false;                                                                                          \
    for (int l = 0; l < 8; ++l) m = top[l] > m ? top[l] : m, nan = nan || bad[l] != 0;                         \
    for (; j < n; ++j) m = x[j] > m ? x[j] : m, nan = nan || x[j] != x[j];                                     \
    if (nan) m = std::numeric_limits<float>::quiet_NaN();                                                    \
    exp_shifted_row(x, n, m);                                                                                  \
    v8 acc{};                                                                                                  \
    j = 0;                                                                                                     \
    for (; j + 8 <= n; j += 8) acc = acc + load(x + j);                                                        \
    for (int l = 0; j < n; ++j, ++l) acc[l] = acc[l] + x[j];                                                   \
    const v8 inv = v8{} + 1 / tree(acc);                                                                       \
    j = 0;                                                                                                     \
    for (; j + 8 <= n; j += 8) store(x + j, load(x + j) * inv);                                                \
    for (; j < n; ++j) x[j] = x[j] * inv[0];                                                                   \
  }

namespace base {
FACTORED_PASSES
}
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
FACTORED_PASSES
}
#pragma GCC pop_options
#endif
#undef FACTORED_PASSES

struct Passes {
  float (*scale_probs)(const float*, const float*, const float*, int, float*);
  void (*add_to)(float*, int, float);
  void (*softmax_row)(float*, int);
};
const Passes& passes() {
  static const Passes portable{base::scale_probs, base::add_to, base::softmax_row};
#if defined(__x86_64__)
  // the vector lanes run on AVX2 or AVX-512 CPUs only (attend_x86.h)
  static const Passes wide{avx2::scale_probs, avx2::add_to, avx2::softmax_row};
  if (tracer_qmm::attend_vector_path()) return wide;
#endif
  return portable;
}
}  // namespace factored

// One (row, key head) block of a decode attention on vector lanes: scores,
// softmax (factored::softmax_row: MLX's max and exponentials, their sum in 8
// lanes, not MLX's one after the other), values. q [R, D] scaled, bias [R / per, S] (query
// row r's: row r / per), o [R, D].
// Packed keys (or values) of one group a row run *factored*: each key's
// (value row's) scale and bias apply once around the stored integers, as
// MLX's Metal kernels for quantized matmuls factor them:
//   score(r, s) = bias(r, s) + (ks(s) * t(r, s) + kb(s) * qsum(r)): the split
//     scores (qmm_api.h's QSplit): q_r in three int8 parts (split_rows), t
//     and qsum their exact integer products with the key's integers (and
//     their own sums) scaled back; a masked key gets its bias;
//   out(r, d) = sum over s of p'(r, s) * vq(s, d) (the float lanes over the
//     integers, q8i / q4i: float(q), exact) + the 8-lane sum over s of
//     p(r, s) * vb(s), p' = p * vs(s) (factored::; both terms 0 where p is 0:
//     a masked key's parameters never count).
// Against MLX's dequantize-then-multiply (every other path) this skips a
// multiply and an add a value, reads a key's scale and bias once, and takes
// the keys' products in integers: its values equal MLX's up to rounding, not
// to the bit (against the float64 attention over the unrounded values: 0.5-7.5
// float32 eps of the largest output measured on tests/test_attention.py's
// cases, MLX's own quantized_matmul arithmetic 4-8; the tests bound it at 16).
// The same bits on every ISA path.
__attribute__((optimize("fp-contract=off"))) void attention_vector(const float* q, const KV& k, const KV& v,
                                                                   const float* bias, int per, int b, int h, int R,
                                                                   int D, float* scores, float* o) {
  const int S = k.S;
  tracer_qmm::AttendPacked kp, vp;
  const void* kb = attend_block(k, b, h, kp);
  const void* vb = attend_block(v, b, h, vp);
  const bool fk = factored_kv(k), fv = factored_kv(v);
  const factored::Passes& f = factored::passes();
  thread_local std::vector<float> extra;
  if (fk) {  // the split scores: q in three int8 parts, integer products with the stored keys
    thread_local std::vector<int8_t> parts;
    thread_local std::vector<float> split;
    parts.resize(size_t(R) * tracer_qmm::kQParts * D);
    split.resize(size_t(R) * (tracer_qmm::kQParts + 1));
    float* qsum = split.data() + size_t(R) * tracer_qmm::kQParts;
    split_rows(q, R, D, parts.data(), split.data(), qsum);
    const tracer_qmm::QSplit qs{R, D, parts.data(), split.data(), qsum};
    if (!tracer_qmm::attend_split_scores(qs, kp, k.bits, S, bias, per, scores)) {
      split_scores_loops(qs, kp, k.bits, S, bias, per, scores);
    }
  } else if (!tracer_qmm::attend_scores(q, R, D, kb, attend_kind(k), S, bias, per, scores)) {
    attend_scores_loops(q, R, D, k, kb, S, bias, per, scores);
  }
  for (int r = 0; r < R; ++r) f.softmax_row(scores + size_t(r) * S, S);
  const float* p = scores;
  thread_local std::vector<float> pb;
  if (fv) {  // p' = p * the value rows' scales, and each row's sum of p * their biases
    extra.resize(size_t(R) * S);
    pb.resize(R);
    for (int r = 0; r < R; ++r) {
      pb[r] = f.scale_probs(scores + size_t(r) * S, vp.scales, vp.biases, S, extra.data() + size_t(r) * S);
    }
    p = extra.data();
  }
  if (!tracer_qmm::attend_values(p, R, S, vb, attend_kind(v, fv), D, o)) {
    attend_values_loops(p, R, S, v, vb, D, o, fv);
  }
  if (fv) {
    for (int r = 0; r < R; ++r) f.add_to(o + size_t(r) * D, D, pb[r]);
  }
}

// Decode attention: q [B, nk, R, D] (scaled), keys/values [B, nk, S, D] blocks,
// bias [B, S] -> o [B, nk * R * D]: mx.addmm(bias, q, k^T), softmax, @ v, as
// MLX runs them (one sgemm per (row, key head)); float16/bfloat16 blocks
// widened first, as MLX's matmul promotes them (astype: the same sgemm on the
// same values). Packed keys/values: mx.quantized_matmul(q, k) + bias,
// softmax, mx.quantized_matmul(p, v), as the lean ops run them. Where
// `vector` (float K/V only: vector_attention), attention_vector's arithmetic.
void attention_rows(const float* q, const KV& k, const KV& v, const float* bias, int B, int nk, int R, int D,
                    float* o, bool vector) {
  const int S = k.S;
  over_heads(B, nk, [&](int b, int h) {
    thread_local std::vector<float> scratch, wide;
    scratch.resize(size_t(R) * S);
    float* scores = scratch.data();  // [R, S]
    const size_t i = size_t(b) * nk + h;
    const float* bb = bias + size_t(b) * S;
    if (vector) {
      return attention_vector(q + i * R * D, k, v, bb, R, b, h, R, D, scores, o + i * R * D);
    }
    if (k.kind == KV::packed) {
      packed_scores_any(q + i * R * D, R, k, b, h, scores);
      for (int r = 0; r < R; ++r) {
        float* row = scores + size_t(r) * S;
        for (int j = 0; j < S; ++j) {
          row[j] = Add()(row[j], bb[j]);
        }
      }
    } else {
      for (int r = 0; r < R; ++r) {
        std::memcpy(scores + size_t(r) * S, bb, sizeof(float) * S);
      }
      cblas_sgemm(kRowMajor, kNoTrans, kTrans, R, S, D, 1.0f, q + i * R * D, D, float_block(k, b, h, wide), D, 1.0f,
                  scores, S);
    }
    softmax_rows(scores, R, S);
    if (v.kind == KV::packed) {
      packed_values_any(scores, R, v, b, h, o + i * R * D, D);
    } else {
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, R, D, S, 1.0f, scores, S, float_block(v, b, h, wide), D, 0.0f,
                  o + i * R * D, D);
    }
  });
}

// Window attention: q [B, nk, R, L, D] (scaled), keys/values [B, nk, S, D]
// blocks, mask [B, L, S] (nonzero: visible) -> o [B, L, nk * R * D]: the lean
// forward's window attention on MLX's ops (scores by one sgemm per (row, key
// head, query head), float32's lowest where masked, softmax, @ v; float16/
// bfloat16 widened first; packed: mx.quantized_matmul's, for all R L query
// rows of a key head at once), its result transposed to tokens first. Where
// `vector` (vector_attention, the rule decode steps follow), each query
// position runs attention_vector with the bias a decode step there has (0
// where visible, lowest where masked): the bits of that decode step, so that
// a verify window judges drafts on exactly the plain decode's logits.
void attention_window(const float* q, const KV& k, const KV& v, const bool* mask, int B, int nk, int R, int L,
                      int D, float* o, bool vector) {
  const int S = k.S, nqD = nk * R * D;
  const float low = mx::numeric_limits<float>::lowest();
  if (vector) {  // every position's R query heads, each with its decode step's bias: its bits
    // A (row, key head) block's positions split into `parts` runs: enough
    // items for every thread to stay busy where the blocks are few (bucket
    // 1: SmolLM2's 3 key heads on 2 threads left one idle a third of the
    // time), and runs of at most ~64 query rows in a prefill window, whose
    // causal mask then hides more of the keys a run does not read. Each
    // query row's scores, softmax and values are its own, so the bits do
    // not depend on the split.
    const int blocks = B * nk, items = (4 * tracer_qmm::pool_threads() + blocks - 1) / blocks;
    const int parts = std::max(1, std::min(L, std::max(items, (R * L + 63) / 64)));
    over_items(B * nk * parts, [&](int i) {
      const int b = i / (nk * parts), h = i / parts % nk, part = i % parts;
      const int l0 = int(int64_t(L) * part / parts), l1 = int(int64_t(L) * (part + 1) / parts), n = l1 - l0;  // >= 1: parts <= L
      const bool* mb = mask + size_t(b) * L * S;
      const float* qh = q + (size_t(b) * nk + h) * R * L * D;  // [R L, D]
      const size_t RN = size_t(R) * n;
      thread_local std::vector<float> scratch;
      scratch.resize(RN * (S + 2 * D) + size_t(n) * S);
      float* scores = scratch.data();  // [n R, S]
      float* ql = scores + RN * S;     // [n R, D]: position-major
      float* ol = ql + RN * D;         // [n R, D]
      float* bias = ol + RN * D;       // [n, S]: each position's additive mask
      for (int l = l0; l < l1; ++l) {
        const bool* ml = mb + size_t(l) * S;
        float* bl = bias + size_t(l - l0) * S;
        for (int j = 0; j < S; ++j) bl[j] = ml[j] ? 0.0f : low;
        for (int r = 0; r < R; ++r) {
          std::memcpy(ql + (size_t(l - l0) * R + r) * D, qh + (size_t(r) * L + l) * D, sizeof(float) * D);
        }
      }
      attention_vector(ql, k, v, bias, R, b, h, int(RN), D, scores, ol);
      for (int l = l0; l < l1; ++l) {
        std::memcpy(o + (size_t(b) * L + l) * nqD + size_t(h) * R * D, ol + size_t(l - l0) * R * D,
                    sizeof(float) * R * D);
      }
    });
    return;
  }
  over_heads(B, nk, [&](int b, int h) {
    const bool* mb = mask + size_t(b) * L * S;
    auto masked_softmax = [&](float* scores, int rows) {  // rows of [rows, S], row m: token m % L
      for (int m = 0; m < rows; ++m) {
        float* row = scores + size_t(m) * S;
        const bool* ml = mb + size_t(m % L) * S;
        for (int j = 0; j < S; ++j) {
          row[j] = ml[j] ? row[j] : low;
        }
      }
      softmax_rows(scores, rows, S);
    };
    auto put = [&](const float* ov, int r) {  // ov [L, D]: query head r's outputs
      for (int l = 0; l < L; ++l) {
        std::memcpy(o + (size_t(b) * L + l) * nqD + (size_t(h) * R + r) * D, ov + size_t(l) * D, sizeof(float) * D);
      }
    };
    thread_local std::vector<float> scratch, wide_k, wide_v;
    const float* qh = q + (size_t(b) * nk + h) * R * L * D;  // [R L, D]
    if (k.kind == KV::packed) {
      scratch.resize(size_t(R) * L * (S + D));
      float* scores = scratch.data();               // [R L, S]
      float* ov = scores + size_t(R) * L * S;       // [R L, D]
      packed_scores_any(qh, R * L, k, b, h, scores);
      masked_softmax(scores, R * L);
      packed_values_any(scores, R * L, v, b, h, ov, D);
      for (int r = 0; r < R; ++r) {
        put(ov + size_t(r) * L * D, r);
      }
      return;
    }
    scratch.resize(size_t(L) * (S + D));
    float* scores = scratch.data();             // [L, S]
    float* ov = scores + size_t(L) * S;         // [L, D]
    const float* ki = float_block(k, b, h, wide_k);
    const float* vi = float_block(v, b, h, wide_v);
    for (int r = 0; r < R; ++r) {
      cblas_sgemm(kRowMajor, kNoTrans, kTrans, L, S, D, 1.0f, qh + size_t(r) * L * D, D, ki, D, 0.0f, scores, S);
      masked_softmax(scores, L);
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, L, D, S, 1.0f, scores, S, vi, D, 0.0f, ov, D);
      put(ov, r);
    }
  });
}

// gu [M, 2F] -> silu(gate) * up [M, F] (gate: the first F columns).
void swiglu_rows(const float* gu, size_t M, int F, float* out) {
  for (size_t m = 0; m < M; ++m) {
    const float* A = gu + m * 2 * F;
    const float* B = A + F;
    float* C = out + m * F;
    if (tracer_qmm::swiglu(A, B, C, F)) {  // the same functors on vector lanes
      continue;
    }
    for (int i = 0; i < F; ++i) {
      float tmp_D = Sigmoid()(A[i]);
      float tmp_E = Multiply()(A[i], tmp_D);
      C[i] = Multiply()(tmp_E, B[i]);
    }
  }
}

// ---------------------------------------------------------- kernel inputs
// A kernel's inputs are described once, in one X-macro list per kernel: it
// gives the slots (an enum), the names the binding takes them by and which
// are optional. The binding lays out the arrays it was given in list order,
// skipping absent optional ones (Inputs), and the primitive keeps that
// layout: eval_cpu finds each input by its slot, never by counting.
// A weight slot `w_X` (float32 [K, N], the right operand of x @ w) may be
// given as MLX's packed blocks instead: `w_X` the packed [N, K bits / 32]
// uint32 (mx.quantize's layout, rows = output columns) with `w_X_scales`
// and `w_X_biases` [N, K / group] (float32, float16 or bfloat16); bits and
// group follow from the shapes.
struct Slot {
  const char* name;
  bool required;
  char kind;  // 'f': float32; 'b': bool; 'w': a weight (float32 or packed); 'q': a packed weight's scales or biases (superblock ones too);
              // 'k': cached keys or values (float32, float16, bfloat16, or packed with float32 scales and biases)
};

#define TRACER_SLOT_ENUM(name, required, kind) name,
#define TRACER_SLOT_TABLE(name, required, kind) {#name, bool(required), kind},

// layer_in: a layer up to attention, for L tokens a row (M = B L rows; a
// decode step: L = 1).
#define TRACER_LAYER_IN(X)                                                            \
  X(h, 1, 'f')             /* [M, hidden] the residual stream */                      \
  X(act, 0, 'f')           /* [M, F] the previous MLP's activation (not in layer 0) */ \
  X(w_down, 0, 'w')        /* [F, hidden] its down projection (x @ w), with act */    \
  X(w_down_scales, 0, 'q') /* packed w_down only */                                   \
  X(w_down_biases, 0, 'q')                                                            \
  X(b_down, 0, 'f')        /* [hidden] */                                             \
  X(norm, 1, 'f')          /* [hidden] the input norm's weight */                     \
  X(w_qkv, 1, 'w')         /* [hidden, (nq + 2 nk) D] */                              \
  X(w_qkv_scales, 0, 'q')                                                             \
  X(w_qkv_biases, 0, 'q')                                                             \
  X(w_qkv2, 0, 'w')        /* the last columns of w_qkv in another format (w_qkv: the */ \
  X(w_qkv2_scales, 0, 'q') /* first ones; a k-quant file's q/k beside a Q6_K v) */    \
  X(w_qkv2_biases, 0, 'q')                                                            \
  X(b_qkv, 0, 'f')         /* [(nq + 2 nk) D] */                                      \
  X(cos, 1, 'f')           /* C [M (nq + 2 nk), D] (the lean forward's tables) */     \
  X(sin, 1, 'f')           /* S [M (nq + 2 nk), D] */                                 \
  X(scale, 1, 'f')         /* F [M (nq + 2 nk), 1] */                                 \
  X(q_norm, 0, 'f')        /* [D] qwen3's per-head norms, both or neither */          \
  X(k_norm, 0, 'f')        /* [D] */

// layer_mid: attention to the MLP's activation; a decode step (q [B, nk, R,
// D], with bias) or a window of L tokens a row (q [B, nk, R, L, D], with mask).
#define TRACER_LAYER_MID(X)                                                        \
  X(q, 1, 'f')           /* scaled queries */                                      \
  X(k, 1, 'k')           /* [B, nk, S, D] what the step attends (cache written) */ \
  X(k_scales, 0, 'f')    /* packed k only: [B, nk, S, D / group] */                \
  X(k_biases, 0, 'f')                                                              \
  X(v, 1, 'k')           /* [B, nk, S, D] */                                       \
  X(v_scales, 0, 'f')    /* packed v only */                                       \
  X(v_biases, 0, 'f')                                                              \
  X(bias, 0, 'f')        /* decode: [B, 1, 1, S] 0 where visible, float32's lowest else */ \
  X(mask, 0, 'b')        /* window: [B, 1, 1, L, S] true where visible */          \
  X(w_o, 1, 'w')         /* [nq D, hidden] */                                      \
  X(w_o_scales, 0, 'q')                                                            \
  X(w_o_biases, 0, 'q')                                                            \
  X(b_o, 0, 'f')         /* [hidden] */                                            \
  X(h, 1, 'f')           /* [B L, hidden] the residual stream */                   \
  X(norm, 1, 'f')        /* [hidden] the post-attention norm's weight */           \
  X(w_gu, 1, 'w')        /* [hidden, 2F] gate and up, side by side */              \
  X(w_gu_scales, 0, 'q')                                                           \
  X(w_gu_biases, 0, 'q')                                                           \
  X(b_gu, 0, 'f')        /* [2F] */

namespace in_slot {
enum LayerIn : int { TRACER_LAYER_IN(TRACER_SLOT_ENUM) kLayerInCount };
}
namespace mid_slot {
enum LayerMid : int { TRACER_LAYER_MID(TRACER_SLOT_ENUM) kLayerMidCount };
}
const std::vector<Slot> kLayerInSlots = {TRACER_LAYER_IN(TRACER_SLOT_TABLE)};
const std::vector<Slot> kLayerMidSlots = {TRACER_LAYER_MID(TRACER_SLOT_TABLE)};

using Named = std::map<std::string, std::optional<array>>;

void need(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("mlx_tracer kernels: " + what);
  }
}

// Where each slot's array sits in a node's input list (-1: not given).
class Inputs {
 public:
  Inputs() = default;
  // Lays `given` out in slot order into `out`; refuses unknown names and missing required slots.
  Inputs(const std::vector<Slot>& slots, const Named& given, const char* kernel, std::vector<array>& out)
      : at_(slots.size(), -1) {
    for (const auto& [name, value] : given) {
      auto it = std::find_if(slots.begin(), slots.end(), [&](const Slot& s) { return name == s.name; });
      need(it != slots.end(), std::string(kernel) + " has no input '" + name + "' (see inputs('" + kernel + "'))");
    }
    for (size_t s = 0; s < slots.size(); ++s) {
      auto it = given.find(slots[s].name);
      const bool present = it != given.end() && it->second.has_value();
      need(present || !slots[s].required, std::string(kernel) + " needs input '" + slots[s].name + "'");
      if (present) {
        const mx::Dtype t = it->second->dtype();
        const char kind = slots[s].kind;
        const bool ok = kind == 'f'   ? t == mx::float32
                        : kind == 'b' ? t == mx::bool_
                        : kind == 'w' ? t == mx::float32 || t == mx::uint32
                        : kind == 'k' ? t == mx::float32 || t == mx::float16 || t == mx::bfloat16 || t == mx::uint32
                                      : t == mx::float32 || t == mx::float16 || t == mx::bfloat16 || t == mx::uint8;
        need(ok, std::string(kernel) + ": input '" + slots[s].name + "' must be " +
                     (kind == 'f'   ? "float32"
                      : kind == 'b' ? "bool"
                      : kind == 'w' ? "float32 (a matrix) or uint32 (packed blocks)"
                      : kind == 'k' ? "float32, float16, bfloat16 or uint32 (packed blocks)"
                                    : "float32, float16, bfloat16 or uint8 (superblock scales)"));
        at_[s] = int(out.size());
        out.push_back(*it->second);
      }
    }
  }
  bool has(int slot) const {
    return at_[slot] >= 0;
  }
  const array& operator()(const std::vector<array>& in, int slot) const {
    return in[at_[slot]];
  }

 private:
  std::vector<int> at_;
};

// The groups a row of scales [N, ...] holds: its columns, or for superblock
// scales (uint8: G int8 multipliers, then G / 8 float32 steps) two thirds of its bytes.
int groups_of(const array& scales) {
  return scales.dtype() == mx::uint8 ? scales.shape(1) * 2 / 3 : scales.shape(1);
}

// The output columns of weight slot w: packed blocks' rows (with scales), or a float32 [K, N]'s N.
int columns(const Inputs& at, const std::vector<array>& in, int w, int scales) {
  const array& a = at(in, w);
  return at.has(scales) ? a.shape(0) : a.shape(1);
}

// ------------------------------------------------------------- primitives
class Kernel : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer kernels: CPU only");
  }

 protected:
  // Runs `f` on the stream's CPU worker, in order after the tasks that
  // compute its inputs (eval_cpu only allocates; data is ready in `f`).
  template <class F>
  void run(F&& f) {
    mx::cpu::get_command_encoder(stream()).dispatch(std::forward<F>(f));
  }

  // `a` row-contiguous: itself, or a copy made on the worker (strided views).
  array dense(const array& a) {
    if (a.flags().row_contiguous) {
      return a;
    }
    array out(a.shape(), a.dtype(), nullptr, {});
    out.set_data(mx::allocator::malloc(out.nbytes()));
    run([src = a.data<char>(), shape = std::vector<int>(a.shape().begin(), a.shape().end()),
         strides = std::vector<int64_t>(a.strides().begin(), a.strides().end()), size = a.size(),
         item = a.itemsize(), dst = out.data<char>()]() {
      const int nd = int(shape.size());
      std::vector<int> idx(nd, 0);
      for (size_t i = 0; i < size; ++i) {
        int64_t off = 0;
        for (int d = 0; d < nd; ++d) {
          off += int64_t(idx[d]) * strides[d];
        }
        std::memcpy(dst + i * item, src + off * item, item);
        for (int d = nd - 1; d >= 0; --d) {
          if (++idx[d] < shape[d]) {
            break;
          }
          idx[d] = 0;
        }
      }
    });
    mx::cpu::get_command_encoder(stream()).add_temporary(out);  // alive until the tasks that read it ran
    return out;
  }

  // Keys/values [B, nk, S, D]: each [S, D] block row-major (any strides between blocks).
  array blocks_dense(const array& a) {
    return a.strides()[3] == 1 && a.strides()[2] == a.shape(3) ? a : dense(a);
  }

  std::optional<array> dense_if(const Inputs& at, const std::vector<array>& in, int slot) {
    return at.has(slot) ? std::optional<array>(dense(at(in, slot))) : std::nullopt;
  }

  // Keys or values in slot `slot` (packed: with `scales`, `biases`) of head
  // dimension D as attention reads them (KV; the shapes checked by the binding).
  KV kv(const Inputs& at, const std::vector<array>& in, int slot, int scales, int biases, int D) {
    KV out;
    auto blocks = [&](const array& given) {
      const array a = blocks_dense(given);
      return KV::Blocks{a.data<char>(), a.strides()[0], a.strides()[1], a.itemsize()};
    };
    const array& a = at(in, slot);
    out.data = blocks(a);
    out.S = a.shape(2), out.D = D;
    if (a.dtype() == mx::uint32) {
      const array& sc = at(in, scales);
      out.kind = KV::packed;
      out.scales = blocks(sc), out.biases = blocks(at(in, biases));
      out.bits = a.shape(3) * 32 / D, out.group = D / sc.shape(3);
    } else {
      out.kind = KV::float_kind(a.dtype());
    }
    return out;
  }

  // The weight in slot `w` of a projection from K inputs: a float32 matrix
  // as MLX's matmul hands it to cblas_sgemm ([K, N] row-major: no
  // transpose; a transposed view of a row-major [N, K], as a Linear's
  // weight.T: transpose; else a row-major copy), or packed blocks with
  // their scales and biases. What it points into are the node's inputs or
  // temporaries of its tasks: alive until the tasks ran.
  WeightView weight(const Inputs& at, const std::vector<array>& in, int w, int scales, int biases, int K,
                    tracer_qmm::Contract contract) {
    WeightView v;
    const array& a = at(in, w);
    if (at.has(scales)) {
      array q = dense(a), sc = dense(at(in, scales)), bi = dense(at(in, biases));
      const auto t = sc.dtype() == mx::float16    ? tracer_qmm::ScaleType::f16
                     : sc.dtype() == mx::bfloat16 ? tracer_qmm::ScaleType::bf16
                     : sc.dtype() == mx::uint8    ? tracer_qmm::ScaleType::sb
                                                  : tracer_qmm::ScaleType::f32;
      v.packed = {q.data<uint32_t>(), sc.data<void>(), bi.data<void>(), t, q.shape(0), K, K / groups_of(sc),
                  q.shape(1) * 32 / K};
      v.contract = contract;
      return v;
    }
    const int64_t stx = a.strides()[0], sty = a.strides()[1];
    if (stx == a.shape(1) && sty == 1) {
      v.p = a.data<float>(), v.ld = int(stx);
    } else if (stx == 1 && sty == a.shape(0)) {
      v.p = a.data<float>(), v.trans = true, v.ld = int(sty);
    } else {
      array c = dense(a);
      v.p = c.data<float>(), v.ld = c.shape(1);
    }
    return v;
  }
};

const float* ptr(const std::optional<array>& a) {
  return a ? a->data<float>() : nullptr;
}

// A decoder layer up to its attention, for one decode token per row:
//   [h_new = h + act @ w_down (+ b_down)]        (the previous layer's MLP output)
//   x = rms_norm(h_new or h), y = x @ w_qkv (+ b_qkv), [q/k per-head norms], rotation
// inputs: TRACER_LAYER_IN; outputs: [h_new], q [B, nk, R, D], k, v [B, nk, 1, D]
class LayerIn : public Kernel {
 public:
  LayerIn(mx::Stream s, Inputs at, float eps, int nq, int nk, int D, int L, float qk_eps, tracer_qmm::Contract contract)
      : Kernel(s), at_(std::move(at)), eps_(eps), qk_eps_(qk_eps), nq_(nq), nk_(nk), D_(D), L_(L), contract_(contract) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    namespace s = in_slot;
    array h = dense(at_(in, s::h)), nw = dense(at_(in, s::norm));
    array C = dense(at_(in, s::cos)), S = dense(at_(in, s::sin)), F = dense(at_(in, s::scale));
    std::optional<array> act = dense_if(at_, in, s::act), bd = dense_if(at_, in, s::b_down);
    std::optional<array> bq = dense_if(at_, in, s::b_qkv);
    std::optional<array> qn = dense_if(at_, in, s::q_norm), kn = dense_if(at_, in, s::k_norm);
    const WeightView wd = act ? weight(at_, in, s::w_down, s::w_down_scales, s::w_down_biases, act->shape(1), contract_)
                              : WeightView{};
    const WeightView wq = weight(at_, in, s::w_qkv, s::w_qkv_scales, s::w_qkv_biases, h.shape(1), contract_);
    const WeightView wq2 = at_.has(s::w_qkv2)
                               ? weight(at_, in, s::w_qkv2, s::w_qkv2_scales, s::w_qkv2_biases, h.shape(1), contract_)
                               : WeightView{};
    const int n1 = at_.has(s::w_qkv2) ? columns(at_, in, s::w_qkv, s::w_qkv_scales) : (nq_ + 2 * nk_) * D_;
    alloc(outputs);
    const bool carry = act.has_value();
    const size_t o = carry ? 1 : 0;
    const float eps = eps_, qk_eps = qk_eps_;
    const int nq = nq_, nk = nk_, D = D_, L = L_;
    run([h = View(h), act = act ? View(*act) : View(), wd, bd = ptr(bd), nw = View(nw), wq, wq2, n1, bq = ptr(bq), C = View(C), S = View(S), F = View(F), qn = ptr(qn), kn = ptr(kn),
         h_new = carry ? outputs[0].data<float>() : nullptr, q = outputs[o].data<float>(),
         k = outputs[o + 1].data<float>(), v = outputs[o + 2].data<float>(), eps, nq, nk, D, L, carry, qk_eps]() {
      Timed task(kTaskIn);
      const int M = h.dim(0), hid = h.dim(1), N = (nq + 2 * nk) * D;
      std::vector<float> x(size_t(M) * hid), y(size_t(M) * N);
      if (carry) {
        std::vector<float> down(size_t(M) * hid);
        {
          Timed t(kDown);
          matmul(act.p, M, act.dim(1), wd, hid, bd, down.data());
        }
        Timed t(kNorm);
        norm_rows(h.p, down.data(), nw.p, eps, M, hid, h_new, x.data());
      } else {
        Timed t(kNorm);
        norm_rows(h.p, nullptr, nw.p, eps, M, hid, nullptr, x.data());
      }
      {
        Timed t(kQkv);
        matmul_parts(x.data(), M, hid, wq, n1, wq2, N, bq, y.data());
      }
      Timed t(kRope);
      if (qn != nullptr) {
        qk_norm_rows(y.data(), qn, kn, qk_eps, M, nq, nk, D);
      }
      rope_rows(y.data(), C.p, S.p, F.p, M, L, nq, nk, D, q, k, v);
    });
  }
  const char* name() const override {
    return "TracerLayerIn";
  }

 private:
  Inputs at_;
  float eps_, qk_eps_;
  int nq_, nk_, D_, L_;
  tracer_qmm::Contract contract_;
};

// One group of `group` floats as MLX's CPU mx.quantize packs it (affine, 4 or
// 8 bits: its quantize<float, uint32_t>, operation for operation): the
// group's min and max, the scale and bias from the edge of larger magnitude,
// each value rint((w - bias) / scale) clipped to [0, 2^bits - 1], packed low
// bits first (words null: the scale and bias alone); scale and bias as float32.
void quantize_group(const float* w, int group, int bits, uint32_t* words, float* scale_out, float* bias_out) {
  const float n_bins = float((1 << bits) - 1);
  const float eps = 1e-7f;
  float w_min = std::numeric_limits<float>::infinity();
  float w_max = -w_min;
  for (int j = 0; j < group; ++j) {
    w_max = std::max(w_max, w[j]);
    w_min = std::min(w_min, w[j]);
  }
  const bool mask = std::abs(w_min) > std::abs(w_max);
  float scale = std::max((w_max - w_min) / n_bins, eps);
  scale = mask ? scale : -scale;
  const float edge = mask ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  float bias = 0;
  if (q0 != 0) {
    scale = edge / q0;
    bias = edge;
  }
  const int per_word = 32 / bits;
  for (int j = 0; words != nullptr && j < group / per_word; ++j) {  // (the words: not where only the scale and bias are wanted)
    uint64_t word = 0;
    for (int k = 0; k < per_word; ++k) {
      float v = w[j * per_word + k];
      v = std::rint((v - bias) / scale);
      v = std::min(std::max(v, 0.0f), n_bins);
      word |= static_cast<uint64_t>(v) << (k * bits);
    }
    words[j] = uint32_t(word);
  }
  *scale_out = scale;
  *bias_out = bias;
}

// Whether buf's memory can hold out (buf's shape and dtype) as it is, once
// MLX may donate it: row-major elements, each once. A buffer of a batch that
// moved to a narrower bucket is a view of the first rows of a wider one
// (StaticKVCache.narrow): row-major, at offset 0, with a tail no row uses;
// it is written where it lies as a whole buffer is.
bool reusable(const array& buf, const array& out) {
  return buf.flags().row_contiguous && buf.nbytes() == out.nbytes() && buf.data_size() == buf.size() &&
         buf.buffer_size() >= out.nbytes();
}

// A decode step's cache write: buf [B, H, S, D] with new [B, H, 1, D] at
// column col [1] int32 (clamped to the buffer), as mx.slice_update writes it.
// buf float32, float16 or bfloat16, new float32 (stored as new.astype(buf's
// dtype) stores it: MLX's own conversion).
//
// In place when MLX may donate the buffer (array::is_donatable(): this node
// holds the only reference to the array and its memory), as MLX's own
// slice_update does; else into a row-major copy made on the worker. One
// output, so that the public test applies (MLX gives every output of a node a
// reference to each input).
//
// A pipelined decode loop builds step t+1 while the worker still runs step
// t, whose attention holds the buffer's memory until its task ran. Then the
// buffer is not donatable *yet*: this waits for queued tasks to finish, with
// the scheduler calls MLX's eval loop makes when too many are queued
// (mlx/scheduler.h), until it is or nothing is left to wait for (then another
// array holds it, and it is copied).
class CacheWrite : public Kernel {
 public:
  // part < 0: a float buffer; else the packed words (0), scales (1) or
  // biases (2) of a quantized one (bits, group): new quantized as mx.quantize does.
  explicit CacheWrite(mx::Stream s, int part = -1, int bits = 0, int group = 0)
      : Kernel(s), part_(part), bits_(bits), group_(group) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    const array& buf = in[0];
    array upd = dense(in[1]);
    const int32_t* col = in[2].data<int32_t>();
    array& out = outputs[0];
    const bool fits = reusable(buf, out);
    while (fits && !buf.is_donatable() && mx::scheduler::n_active_tasks() > 0) {
      mx::scheduler::wait_for_one();
    }
    if (fits && buf.is_donatable()) {
      out.copy_shared_buffer(buf);
      ++g_donated;
    } else {
      ++g_copied;
      array src = dense(buf);
      out.set_data(mx::allocator::malloc(out.nbytes()));
      run([src = src.data<char>(), dst = out.data<char>(), n = out.nbytes()]() { std::memcpy(dst, src, n); });
    }
    if (part_ >= 0) {
      run([upd = View(upd), out = View(out), col, part = part_, bits = bits_, group = group_]() {
        Timed t(kWrite);
        const int rows = out.dim(0) * out.dim(1), S = out.dim(2), W = out.dim(3), D = upd.dim(3);
        const int c = std::clamp(col[0], 0, S - 1), G = D / group, words = group * bits / 32;
        std::vector<uint32_t> packed(words);
        for (int r = 0; r < rows; ++r) {
          for (int g = 0; g < G; ++g) {
            float scale, bias;
            quantize_group(upd.p + size_t(r) * D + size_t(g) * group, group, bits, part == 0 ? packed.data() : nullptr,
                           &scale, &bias);
            char* at = reinterpret_cast<char*>(out.p) + ((size_t(r) * S + c) * W) * 4;  // 4-byte elements
            if (part == 0) {
              std::memcpy(at + size_t(g) * words * 4, packed.data(), size_t(words) * 4);
            } else {
              std::memcpy(at + size_t(g) * 4, part == 1 ? &scale : &bias, 4);
            }
          }
        }
      });
      return;
    }
    const mx::Dtype t = out.dtype();
    run([upd = View(upd), out = View(out), col, kind = t == mx::float16 ? 1 : t == mx::bfloat16 ? 2 : 0]() {
      Timed t(kWrite);
      const int rows = out.dim(0) * out.dim(1), S = out.dim(2), D = out.dim(3);
      const int c = std::clamp(col[0], 0, S - 1);
      for (int r = 0; r < rows; ++r) {
        const float* u = upd.p + size_t(r) * D;
        const size_t at = (size_t(r) * S + c) * D;
        if (kind == 0) {
          std::memcpy(out.p + at, u, sizeof(float) * D);
        } else if (kind == 1) {  // astype(float16): MLX's own conversion
          mx::float16_t* o = reinterpret_cast<mx::float16_t*>(out.p) + at;
          for (int j = 0; j < D; ++j) {
            o[j] = static_cast<mx::float16_t>(u[j]);
          }
        } else {
          mx::bfloat16_t* o = reinterpret_cast<mx::bfloat16_t*>(out.p) + at;
          for (int j = 0; j < D; ++j) {
            o[j] = static_cast<mx::bfloat16_t>(u[j]);
          }
        }
      }
    });
  }
  const char* name() const override {
    return "TracerCacheWrite";
  }

 private:
  int part_, bits_, group_;
};

// The realignment after a verify window (caches/writes.py realign_rows):
// buf [B, H, C, W] (any dtype) with row b's columns moved right by delta[b]
// (left when negative; what falls off one end comes back at the other):
// out[b, h, c] = buf[b, h, (c - delta[b]) mod C], the gather mx.take_along_axis
// makes, bit for bit. In place where MLX may donate the buffer (as
// CacheWrite), and then a row whose delta is 0 mod C is not touched: after a
// verify step where every row kept as many tokens, nothing moves. Else into a
// fresh buffer, two copies a block. (MLX's CPU gather moved one element at a
// time: 16 % of a bucket-4 verify step on SmolLM2.)
class Realign : public Kernel {
 public:
  using Kernel::Kernel;
  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    const array& buf = in[0];
    const array delta = dense(in[1]);
    array& out = outputs[0];
    const bool fits = reusable(buf, out);
    while (fits && !buf.is_donatable() && mx::scheduler::n_active_tasks() > 0) {
      mx::scheduler::wait_for_one();
    }
    const bool in_place = fits && buf.is_donatable();
    ++(in_place ? g_realigned_in_place : g_realigned_copied);
    const array src = in_place ? buf : dense(buf);
    if (in_place) {
      out.copy_shared_buffer(buf);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    run([src = src.data<char>(), dst = out.data<char>(), d = delta.data<int32_t>(), B = out.shape(0),
         H = out.shape(1), C = out.shape(2), row = size_t(out.shape(3)) * out.itemsize(), in_place]() {
      const size_t block = size_t(C) * row;
      thread_local std::vector<char> tmp;
      for (int b = 0; b < B; ++b) {
        const int shift = ((d[b] % C) + C) % C;  // out column c holds column c - shift
        for (int h = 0; h < H; ++h) {
          const size_t at = (size_t(b) * H + h) * block;
          if (shift == 0) {
            if (!in_place) std::memcpy(dst + at, src + at, block);
            continue;
          }
          const char* from = src + at;
          if (in_place) {
            tmp.assign(from, from + block);
            from = tmp.data();
          }
          std::memcpy(dst + at + size_t(shift) * row, from, size_t(C - shift) * row);
          std::memcpy(dst + at, from + size_t(C - shift) * row, size_t(shift) * row);
        }
      }
    });
  }
  const char* name() const override {
    return "TracerRealign";
  }
};

// A decoder layer from its attention to the MLP's activation:
//   o = attention(q, k, v, bias), a = o @ w_o (+ b_o)
//   h_mid = h + a, x = rms_norm(h_mid), act = swiglu(x @ w_gu (+ b_gu))
// inputs: TRACER_LAYER_MID; outputs: h_mid [B, hidden], act [B, F]
class LayerMid : public Kernel {
 public:
  LayerMid(mx::Stream s, Inputs at, float eps, tracer_qmm::Contract contract)
      : Kernel(s), at_(std::move(at)), eps_(eps), contract_(contract) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    namespace s = mid_slot;
    array q = dense(at_(in, s::q)), h = dense(at_(in, s::h)), nw = dense(at_(in, s::norm));
    const KV k = kv(at_, in, s::k, s::k_scales, s::k_biases, q.shape(-1));
    const KV v = kv(at_, in, s::v, s::v_scales, s::v_biases, q.shape(-1));
    std::optional<array> bias = dense_if(at_, in, s::bias), mask = dense_if(at_, in, s::mask);
    std::optional<array> bo = dense_if(at_, in, s::b_o), bg = dense_if(at_, in, s::b_gu);
    const int nqD = q.shape(1) * q.shape(2) * q.shape(q.ndim() - 1);
    const WeightView wo = weight(at_, in, s::w_o, s::w_o_scales, s::w_o_biases, nqD, contract_);
    const WeightView wg = weight(at_, in, s::w_gu, s::w_gu_scales, s::w_gu_biases, h.shape(1), contract_);
    alloc(outputs);
    const float eps = eps_;
    run([q = View(q), k, v, bias = ptr(bias), mask = mask ? mask->data<bool>() : nullptr, wo,
         bo = ptr(bo), h = View(h), nw = View(nw), wg, bg = ptr(bg), h_mid = outputs[0].data<float>(),
         act = View(outputs[1]), eps]() {
      const bool window = q.shape.size() == 5;
      const int B = q.dim(0), nk = q.dim(1), R = q.dim(2), L = window ? q.dim(3) : 1, D = q.dim(-1);
      const int M = h.dim(0), hid = h.dim(1), F = act.dim(1), nqD = nk * R * D;
      Timed task(kTaskMid);
      std::vector<float> o(size_t(M) * nqD), a(size_t(M) * hid), x(size_t(M) * hid), gu(size_t(M) * 2 * F);
      {
        Timed t(kAttn);
        if (window) {
          attention_window(q.p, k, v, mask, B, nk, R, L, D, o.data(), vector_attention(k, v, wo.packed.w != nullptr));
        } else {
          attention_rows(q.p, k, v, bias, B, nk, R, D, o.data(), vector_attention(k, v, wo.packed.w != nullptr));
        }
      }
      {
        Timed t(kO);
        matmul(o.data(), M, nqD, wo, hid, bo, a.data());
      }
      {
        Timed t(kNorm);
        norm_rows(h.p, a.data(), nw.p, eps, M, hid, h_mid, x.data());
      }
      {
        Timed t(kGu);
        matmul(x.data(), M, hid, wg, 2 * F, bg, gu.data());
      }
      Timed t(kSwiglu);
      swiglu_rows(gu.data(), M, F, act.p);
    });
  }
  const char* name() const override {
    return "TracerLayerMid";
  }

 private:
  Inputs at_;
  float eps_;
  tracer_qmm::Contract contract_;
};

// -------------------------------------------------------------- bindings
mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device::cpu);
}

// Inputs' dtypes are checked by the caller (Inputs: by each slot's kind).
template <class P, class... A>
std::vector<array> make(std::vector<mx::Shape> shapes, std::vector<array> inputs, A... args) {
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return array::make_arrays(std::move(shapes), dtypes, std::make_shared<P>(cpu_stream(), args...), inputs);
}

std::string shape_of(const array& a) {
  std::string s = "[";
  for (int i = 0; i < a.ndim(); ++i) {
    s += (i ? ", " : "") + std::to_string(a.shape(i));
  }
  return s + "]";
}

// The weight in slot w of a projection from K inputs to N outputs (N < 0:
// any): float32 [K, N] (the right operand of x @ w), or packed blocks
// [N, K bits / 32] uint32 (4 or 8 bits; 5, 6: qmm's layouts) with scales and biases [N, K / group]
// of one dtype (group 32, 64 or 128). Returns N.
int need_weight(const Inputs& at, const std::vector<array>& in, int w, int scales, int biases, int K, int N,
                const std::string& what) {
  const array& a = at(in, w);
  const std::string k = std::to_string(K);
  if (!at.has(scales) && !at.has(biases)) {
    need(a.dtype() == mx::float32 && a.ndim() == 2 && a.shape(0) == K && (N < 0 || a.shape(1) == N),
         what + " must be float32 [" + k + ", " + (N < 0 ? "N" : std::to_string(N)) + "], got " + shape_of(a) +
             " (or packed blocks with _scales and _biases)");
    return a.shape(1);
  }
  need(at.has(scales) && at.has(biases), what + ": packed blocks need both _scales and _biases");
  const int bits = a.ndim() == 2 ? a.shape(1) * 32 / K : 0;
  need(a.dtype() == mx::uint32 && (bits == 4 || bits == 5 || bits == 6 || bits == 8) && a.shape(1) * 32 == bits * K &&
           (N < 0 || a.shape(0) == N),
       what + " with scales must be packed uint32 [N, " + k + " bits / 32] with 4, 5, 6 (qmm's layouts) or 8 bits, got " +
           shape_of(a));
  const array &sc = at(in, scales), &bi = at(in, biases);
  const int G = sc.ndim() == 2 ? groups_of(sc) : 0;
  need(G > 0 && sc.shape(0) == a.shape(0) && K % G == 0 && (K / G == 32 || K / G == 64 || K / G == 128) &&
           (sc.dtype() != mx::uint8 || (G % 8 == 0 && sc.shape(1) == G * 3 / 2)),
       what + "_scales must be [N, " + k + " / group] with a group of 32, 64 or 128 (superblock scales: uint8 [N, " +
           k + " / group * 3 / 2], " + k + " / group a multiple of 8), got " + shape_of(sc));
  need(bi.shape() == sc.shape() && bi.dtype() == sc.dtype(), what + "_biases must match " + what + "_scales");
  return a.shape(0);
}

void need_vector(const Inputs& at, const std::vector<array>& in, int slot, size_t n, const std::string& what) {
  if (at.has(slot)) {
    need(at(in, slot).size() == n, what + " must hold " + std::to_string(n) + " values");
  }
}

// A decode step's (q [B, nk, R, D], bias) or a window's (q [B, nk, R, L, D], mask) attention inputs.
void need_attention(const Inputs& at, const std::vector<array>& in) {
  namespace s = mid_slot;
  const array &q = at(in, s::q), &k = at(in, s::k), &v = at(in, s::v);
  const bool window = q.ndim() == 5, packed = k.dtype() == mx::uint32;
  const int D = q.shape(-1);
  need(k.dtype() == v.dtype(), "keys and values must be stored alike (one dtype)");
  need((q.ndim() == 4 || window) && k.ndim() == 4 && k.shape() == v.shape() && k.shape(0) == q.shape(0) &&
           k.shape(1) == q.shape(1) && (packed || k.shape(3) == D),
       "attention needs q [B, nk, R, D] (decode) or [B, nk, R, L, D] (window), keys/values [B, nk, S, D]");
  need(packed == (at.has(s::k_scales) && at.has(s::k_biases) && at.has(s::v_scales) && at.has(s::v_biases)) &&
           (packed || !(at.has(s::k_scales) || at.has(s::k_biases) || at.has(s::v_scales) || at.has(s::v_biases))),
       "packed (uint32) keys/values need k_scales, k_biases, v_scales and v_biases; float ones none");
  if (packed) {
    const int bits = k.shape(3) * 32 / D;
    need((bits == 4 || bits == 8) && k.shape(3) * 32 == bits * D,
         "packed keys/values must be uint32 [B, nk, S, D bits / 32] with 4 or 8 bits, got " + shape_of(k) +
             " for D = " + std::to_string(D));
    for (int slot : {int(s::k_scales), int(s::k_biases), int(s::v_scales), int(s::v_biases)}) {
      const array& g = at(in, slot);
      const int G = g.ndim() == 4 ? g.shape(3) : 0;
      need(G > 0 && D % G == 0 && (D / G == 32 || D / G == 64 || D / G == 128) && g.shape(0) == k.shape(0) &&
               g.shape(1) == k.shape(1) && g.shape(2) == k.shape(2) && g.shape() == at(in, s::k_scales).shape(),
           "the scales and biases of packed keys/values must be float32 [B, nk, S, D / group] (group 32, 64 or "
           "128), all four alike, got " + shape_of(g));
    }
  }
  const int B = q.shape(0), S = k.shape(2);
  if (window) {
    need(at.has(s::mask) && !at.has(s::bias) && at(in, s::mask).shape() == mx::Shape{B, 1, 1, q.shape(3), S},
         "window attention (q [B, nk, R, L, D]) needs mask [B, 1, 1, L, S], no bias");
  } else {
    need(at.has(s::bias) && !at.has(s::mask) && at(in, s::bias).shape() == mx::Shape{B, 1, 1, S},
         "decode attention (q [B, nk, R, D]) needs bias [B, 1, 1, S], no mask");
  }
}

std::vector<array> layer_in(const Named& given, float eps, int nq, int nk, int D, float qk_eps,
                            const std::string& contract, int L) {
  namespace s = in_slot;
  std::vector<array> in;
  Inputs at(kLayerInSlots, given, "layer_in", in);
  const array& h = at(in, s::h);
  need(h.ndim() == 2 && at(in, s::norm).ndim() == 1 && at(in, s::norm).shape(0) == h.shape(1),
       "layer_in needs h [B, hidden], norm [hidden]");
  need(nk > 0 && nq % nk == 0 && D % 2 == 0, "layer_in needs nq a multiple of nk > 0 and an even D");
  need(L >= 1 && h.shape(0) % L == 0, "layer_in: h must be [B L, hidden] (L tokens a row), got " + shape_of(h) +
                                          " with L = " + std::to_string(L));
  const int M = h.shape(0), B = M / L, hid = h.shape(1), H = nq + 2 * nk, N = H * D;
  need(at.has(s::act) == at.has(s::w_down) && (!at.has(s::b_down) || at.has(s::act)),
       "layer_in: act and w_down go together (b_down only with them)");
  std::vector<mx::Shape> shapes;
  if (at.has(s::act)) {
    const array& act = at(in, s::act);
    need(act.ndim() == 2 && act.shape(0) == M, "layer_in: act must be [B L, F]");
    need_weight(at, in, s::w_down, s::w_down_scales, s::w_down_biases, act.shape(1), hid, "layer_in: w_down");
    need_vector(at, in, s::b_down, hid, "layer_in: b_down");
    shapes.push_back(h.shape());
  }
  if (at.has(s::w_qkv2)) {  // two formats: w_qkv's columns first, then w_qkv2's
    const int n1 = need_weight(at, in, s::w_qkv, s::w_qkv_scales, s::w_qkv_biases, hid, -1, "layer_in: w_qkv");
    need(n1 > 0 && n1 < N, "layer_in: w_qkv with w_qkv2 must hold fewer than (nq + 2 nk) D = " + std::to_string(N) +
                               " columns, got " + std::to_string(n1));
    need_weight(at, in, s::w_qkv2, s::w_qkv2_scales, s::w_qkv2_biases, hid, N - n1, "layer_in: w_qkv2");
  } else {
    need(!at.has(s::w_qkv2_scales) && !at.has(s::w_qkv2_biases), "layer_in: w_qkv2_scales and _biases need w_qkv2");
    need_weight(at, in, s::w_qkv, s::w_qkv_scales, s::w_qkv_biases, hid, N, "layer_in: w_qkv");
  }
  need_vector(at, in, s::b_qkv, N, "layer_in: b_qkv");
  const size_t rows = size_t(M) * H;
  need(at(in, s::cos).size() == rows * D && at(in, s::sin).size() == rows * D && at(in, s::scale).size() == rows,
       "layer_in: rotation tables must be cos/sin [B L (nq + 2 nk), D], scale [B L (nq + 2 nk), 1]");
  need(at.has(s::q_norm) == at.has(s::k_norm), "layer_in: q_norm and k_norm go together");
  need_vector(at, in, s::q_norm, D, "layer_in: q_norm");
  need_vector(at, in, s::k_norm, D, "layer_in: k_norm");
  const mx::Shape qs = L == 1 ? mx::Shape{B, nk, nq / nk, D} : mx::Shape{B, nk, nq / nk, L, D};
  shapes.insert(shapes.end(), {qs, {B, nk, L, D}, {B, nk, L, D}});
  return make<LayerIn>(std::move(shapes), std::move(in), at, eps, nq, nk, D, L, qk_eps, tracer_qmm::contract_named(contract));
}

array cache_write(const array& buf, const array& upd, const array& col) {
  need(buf.ndim() == 4 && upd.ndim() == 4 && upd.shape(0) == buf.shape(0) && upd.shape(1) == buf.shape(1) &&
           upd.shape(2) == 1 && upd.shape(3) == buf.shape(3),
       "cache_write needs buf [B, H, S, D] and new [B, H, 1, D], got " + shape_of(buf) + " and " + shape_of(upd));
  need((buf.dtype() == mx::float32 || buf.dtype() == mx::float16 || buf.dtype() == mx::bfloat16) &&
           upd.dtype() == mx::float32,
       "cache_write: buf must be float32, float16 or bfloat16 and new float32");
  need(col.dtype() == mx::int32 && col.size() == 1, "cache_write: col must be int32 [1]");
  return array::make_arrays({buf.shape()}, {buf.dtype()}, std::make_shared<CacheWrite>(cpu_stream()), {buf, upd, col})[0];
}

// caches/writes.py realign_rows on the kernels: buf [B, H, C, W] with row b's
// columns moved right by delta[b] (int32 [B]); Realign says how.
array realign(const array& buf, const array& delta) {
  need(buf.ndim() == 4, "realign needs buf [B, H, C, W], got " + shape_of(buf));
  need(delta.dtype() == mx::int32 && delta.ndim() == 1 && delta.shape(0) == buf.shape(0),
       "realign: delta must be int32 [B] for buf " + shape_of(buf) + ", got " + shape_of(delta));
  return array::make_arrays({buf.shape()}, {buf.dtype()}, std::make_shared<Realign>(cpu_stream()), {buf, delta})[0];
}

// One array of a quantized buffer (part "packed": uint32 [B, H, S, D bits /
// 32]; "scales" / "biases": float32 [B, H, S, D / group]) with new [B, H, 1, D]
// float32 quantized into column col, as mx.quantize and mx.slice_update write it.
array cache_write_quantized(const array& buf, const array& upd, const array& col, const std::string& part, int bits,
                            int group_size) {
  const int p = part == "packed" ? 0 : part == "scales" ? 1 : part == "biases" ? 2 : -1;
  need(p >= 0, "cache_write_quantized: part must be 'packed', 'scales' or 'biases', got '" + part + "'");
  need((bits == 4 || bits == 8) && (group_size == 32 || group_size == 64 || group_size == 128),
       "cache_write_quantized: bits 4 or 8, group_size 32, 64 or 128");
  need(upd.ndim() == 4 && upd.shape(2) == 1 && upd.dtype() == mx::float32 && upd.shape(3) % group_size == 0,
       "cache_write_quantized: new must be float32 [B, H, 1, D] with D a multiple of group_size, got " +
           shape_of(upd));
  const int D = upd.shape(3), W = p == 0 ? D * bits / 32 : D / group_size;
  need(buf.ndim() == 4 && buf.shape(0) == upd.shape(0) && buf.shape(1) == upd.shape(1) && buf.shape(3) == W &&
           buf.dtype() == (p == 0 ? mx::uint32 : mx::float32),
       "cache_write_quantized: buf (" + part + ") must be " + (p == 0 ? "uint32" : "float32") + " [B, H, S, " +
           std::to_string(W) + "], got " + shape_of(buf));
  need(col.dtype() == mx::int32 && col.size() == 1, "cache_write_quantized: col must be int32 [1]");
  return array::make_arrays({buf.shape()}, {buf.dtype()},
                            std::make_shared<CacheWrite>(cpu_stream(), p, bits, group_size), {buf, upd, col})[0];
}

std::vector<array> layer_mid(const Named& given, float eps, const std::string& contract) {
  namespace s = mid_slot;
  std::vector<array> in;
  Inputs at(kLayerMidSlots, given, "layer_mid", in);
  const array& q = at(in, s::q);
  need_attention(at, in);
  const array& h = at(in, s::h);
  const int M = q.shape(0) * (q.ndim() == 5 ? q.shape(3) : 1), nqD = q.shape(1) * q.shape(2) * q.shape(-1);
  need(h.ndim() == 2 && h.shape(0) == M && at(in, s::norm).ndim() == 1 && at(in, s::norm).shape(0) == h.shape(1),
       "layer_mid needs h [B L, hidden], norm [hidden]");
  const int hid = h.shape(1);
  need_weight(at, in, s::w_o, s::w_o_scales, s::w_o_biases, nqD, hid, "layer_mid: w_o");
  const int F2 = need_weight(at, in, s::w_gu, s::w_gu_scales, s::w_gu_biases, hid, -1, "layer_mid: w_gu");
  need(F2 % 2 == 0, "layer_mid: w_gu must have 2F outputs (gate and up side by side)");
  need_vector(at, in, s::b_o, hid, "layer_mid: b_o");
  need_vector(at, in, s::b_gu, F2, "layer_mid: b_gu");
  return make<LayerMid>({h.shape(), {M, F2 / 2}}, std::move(in), at, eps, tracer_qmm::contract_named(contract));
}

// A kernel's inputs as (name, required), in slot order: what its binding takes.
std::vector<std::pair<std::string, bool>> inputs_of(const std::string& kernel) {
  const std::vector<Slot>* slots = kernel == "layer_in" ? &kLayerInSlots : kernel == "layer_mid" ? &kLayerMidSlots : nullptr;
  need(slots != nullptr, "no kernel '" + kernel + "' (layer_in, layer_mid)");
  std::vector<std::pair<std::string, bool>> out;
  for (const auto& s : *slots) {
    out.emplace_back(s.name, s.required);
  }
  return out;
}

// (in place, copied): how often cache_write wrote a buffer in place and into a copy.
std::pair<uint64_t, uint64_t> realigns() {
  return {g_realigned_in_place.load(), g_realigned_copied.load()};
}

std::pair<uint64_t, uint64_t> cache_writes() {
  return {g_donated.load(), g_copied.load()};
}

// {phase: (nanoseconds, calls)} since the last reset (all zero unless
// MLX_TRACER_KERNEL_PROFILE is set when the module loads).
std::map<std::string, std::pair<uint64_t, uint64_t>> profile(bool reset) {
  std::map<std::string, std::pair<uint64_t, uint64_t>> out;
  for (int i = 0; i < kPhases; ++i) {
    out[kPhaseNames[i]] = {reset ? g_phase_ns[i].exchange(0) : g_phase_ns[i].load(),
                           reset ? g_phase_calls[i].exchange(0) : g_phase_calls[i].load()};
  }
  return out;
}

}  // namespace

void register_qmm(nb::module_& m);  // qmm.cpp
void register_logprobs(nb::module_& m);  // logprobs.cpp

// layer_mid's decode attention alone (tests and benchmarks/attention.py):
// q [B, nk, R, D] float32 (scaled), keys/values [B, nk, S, D] float32,
// float16 or bfloat16, or packed (mx.quantize's uint32 [B, nk, S, D bits /
// 32] with float32 scales and biases [B, nk, S, D / group] in `packed`:
// keys' scales, keys' biases, values' scales, values' biases), bias [B, S]
// float32, all evaluated and row-contiguous; `vector` picks the arithmetic.
// Runs it `repeat` times; returns the output [B * nk * R * D] and the
// median nanoseconds of a run.
std::pair<std::vector<float>, int64_t> decode_attention(const array& q, const array& k, const array& v,
                                                        const array& bias, bool vector, int repeat,
                                                        const std::vector<array>& packed) {
  for (const array* a : {&q, &k, &v, &bias}) {
    need(a->flags().row_contiguous && a->data_shared_ptr() != nullptr,
         "decode_attention: evaluate its inputs (row-contiguous) first");
  }
  const bool quantized = k.dtype() == mx::uint32;
  need(q.ndim() == 4 && k.ndim() == 4 && v.shape() == k.shape() && q.dtype() == mx::float32 &&
           q.shape(0) == k.shape(0) && q.shape(1) == k.shape(1) && (quantized || q.shape(3) == k.shape(3)) &&
           bias.shape() == mx::Shape{k.shape(0), k.shape(2)} && bias.dtype() == mx::float32 && k.dtype() == v.dtype(),
       "decode_attention: q [B, nk, R, D] float32, keys/values [B, nk, S, D] (packed: [B, nk, S, D bits / 32]), "
       "bias [B, S] float32");
  need(k.dtype() == mx::float32 || k.dtype() == mx::float16 || k.dtype() == mx::bfloat16 || quantized,
       "decode_attention: keys/values float32, float16, bfloat16 or packed uint32");
  const int D = q.shape(3);
  need(!vector || D % 16 == 0 && D <= 256, "decode_attention: vector needs D a multiple of 16 up to 256");
  need(quantized == (packed.size() == 4), "decode_attention: packed keys/values need their scales and biases (4 arrays)");
  for (const array& a : packed) {
    need(a.flags().row_contiguous && a.data_shared_ptr() != nullptr && a.dtype() == mx::float32 && a.ndim() == 4 &&
             a.shape(2) == k.shape(2) && D % a.shape(3) == 0 && (D / a.shape(3)) % 16 == 0,
         "decode_attention: scales/biases [B, nk, S, D / group] float32, evaluated (group a multiple of 16)");
  }
  auto blocks = [](const array& a) { return KV::Blocks{a.data<char>(), a.strides()[0], a.strides()[1], a.itemsize()}; };
  auto kv_of = [&](const array& a, int part) {
    KV out;
    out.data = blocks(a);
    out.S = a.shape(2), out.D = D;
    if (quantized) {
      out.kind = KV::packed;
      out.scales = blocks(packed[2 * part]), out.biases = blocks(packed[2 * part + 1]);
      out.bits = a.shape(3) * 32 / D, out.group = D / packed[2 * part].shape(3);
      need(out.bits == 4 || out.bits == 8, "decode_attention: packed keys/values of 4 or 8 bits");
    } else {
      out.kind = KV::float_kind(a.dtype());
    }
    return out;
  };
  const KV kk = kv_of(k, 0), vv = kv_of(v, 1);
  std::vector<float> o(q.size());
  std::vector<int64_t> ns;
  for (int i = 0; i < std::max(1, repeat); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    attention_rows(q.data<float>(), kk, vv, bias.data<float>(), q.shape(0), q.shape(1), q.shape(2), q.shape(3),
                   o.data(), vector);
    ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ns.begin(), ns.begin() + ns.size() / 2, ns.end());
  return {std::move(o), ns[ns.size() / 2]};
}

NB_MODULE(_mlx_tracer_kernels, m) {
  m.def("layer_in", &layer_in, nb::arg("inputs"), nb::arg("eps"), nb::arg("nq"), nb::arg("nk"), nb::arg("D"),
        nb::arg("qk_eps") = 0.0f, nb::arg("contract") = "exact", nb::arg("L") = 1);
  m.def("cache_write", &cache_write, nb::arg("buf"), nb::arg("new"), nb::arg("col"));
  m.def("cache_write_quantized", &cache_write_quantized, nb::arg("buf"), nb::arg("new"), nb::arg("col"),
        nb::arg("part"), nb::arg("bits"), nb::arg("group_size"));
  m.def("layer_mid", &layer_mid, nb::arg("inputs"), nb::arg("eps"), nb::arg("contract") = "exact");
  m.def("inputs", &inputs_of, nb::arg("kernel"));
  m.def("realign", &realign, nb::arg("buf"), nb::arg("delta"));
  m.def("realigns", &realigns, "(in place, copied): buffers realign has moved so far");
  m.def("cache_writes", &cache_writes);
  m.def("kv_isa", &kv_isa, "the path layer_mid reads packed K/V on: avx512, avx2 or portable (the same bits)");
  m.def("kv_set_isa", &kv_set_isa, nb::arg("name"), "use that path from now on (portable where the CPU lacks it); returns the one in use");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"),
        nb::arg("vector"), nb::arg("repeat") = 1, nb::arg("packed") = std::vector<array>{},
        "layer_mid's decode attention alone (tests, benchmarks): (output [B nk R D] as a list, median ns a run)");
  m.def("attention_mode", &attention_mode, nb::arg("name") = nb::none(),
        "the decode attention's arithmetic: 'auto' (vector lanes where the layer's projections are packed, MLX's "
        "bits otherwise), 'blas' (MLX's bits: its sgemm calls) or 'vector'; sets it where a name is given (tests; "
        "MLX_TRACER_ATTENTION at load); returns the one in use");
  m.def("packed_attention", &packed_attention, nb::arg("name") = nb::none(),
        "the vector attention's arithmetic on packed K/V of one group a row: 'factored' (the stored integers in "
        "the lanes, each key's scale and bias once around them: the default) or 'dequantized' (MLX's dequantized "
        "values in the lanes); sets it where a name is given (MLX_TRACER_PACKED_ATTENTION at load); returns the "
        "one in use");
  m.def("profile", &profile, nb::arg("reset") = true);
  register_qmm(m);
  register_logprobs(m);
}
