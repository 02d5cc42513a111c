// qmm: x @ dequantize(w, scales, biases).T as one MLX primitive on the CPU,
// reading the packed weights (MLX's affine quantization, 4 or 8 bits), never
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
// Two ways through, by the number M of x rows:
//  * M <= kSmallMaxM: each weight row is read once, dequantized 32 weights
//    at a time in vector registers and multiplied into every row of x (in
//    tiles of kTile rows); columns are split into chunks (a function of the
//    shape only) that the caller and a pool of workers pull from one counter;
//    each output is computed by one thread from start to end, so the bits do
//    not depend on the thread count.
//  * more rows: panels of weight rows dequantized (on the pool) to float32
//    scratch sized to stay in L2, each handed to the process's cblas_sgemm
//    (the BLAS shim splits it; its bits do not depend on the thread count).
// A 4-bit block is dequantized with its even-numbered weights first, then
// the odd ones (no interleaving shuffle), and x is permuted to match: the
// same products, summed in another order. AVX-512 looks 4-bit weights up in
// a 16-entry table per group (scale * q + bias for q = 0..15, computed as
// above), the same values as computing each.
// Kernels exist for AVX-512, AVX2 (+FMA, F16C) and portable C++, compiled
// with target pragmas (the module itself is built without -march), chosen by
// __builtin_cpu_supports; MLX_TRACER_QMM_ISA=avx512|avx2|portable forces one
// (one the CPU lacks falls back to the best it has, said on stderr).
// MLX_TRACER_QMM_THREADS=N pins the thread count (default: the cores this
// process may run on). tests/test_qmm.py checks every path.

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
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
#include <nanobind/stl/string.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc);

// The module is compiled as C++, where GCC contracts a * b + c into a fused
// multiply-add wherever the target has one: the dequantization must round
// the product first, as MLX's does.
#pragma GCC optimize("fp-contract=off")

namespace nb = nanobind;
namespace mx = mlx::core;
using mx::array;

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// Up to this many x rows, the packed-weight kernels; above, dequantized panels
// and sgemm (benchmarks/qmm.py: at 16 rows the panels were faster for three of
// SmolLM2's four projection shapes, at 8 slower for all four).
constexpr int kSmallMaxM = 8;
constexpr size_t kChunkBytes = 16 << 10;     // packed weights a chunk of the few-row path
constexpr size_t kPanelBytes = 512 << 10;    // a dequantized panel of the many-row path
constexpr int kBlock = 32;                   // weights a kernel step: 16 bytes at 4 bits, 32 at 8

enum class Scale { f32, f16, bf16 };

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
};

inline const uint8_t* packed_row(const QmmJob& j, int n) {
  return reinterpret_cast<const uint8_t*>(j.w) + size_t(n) * j.K * j.bits / 8;
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

// out [G] = G scales or biases from p + at, in float32.
void widen(const void* p, Scale t, size_t at, int G, float* out, Halves halves) {
  const uint16_t* h = static_cast<const uint16_t*>(p) + at;
  switch (t) {
    case Scale::f32:
      std::memcpy(out, static_cast<const float*>(p) + at, sizeof(float) * G);
      break;
    case Scale::f16:
      halves(h, G, out);
      break;
    case Scale::bf16:
      for (int g = 0; g < G; ++g) out[g] = std::bit_cast<float>(uint32_t(h[g]) << 16);
      break;
  }
}

// s, b [K / group] = row n's scales and biases in float32.
void row_params(const QmmJob& j, int n, float* s, float* b, Halves halves) {
  const int G = j.K / j.group;
  widen(j.scales, j.scale, size_t(n) * G, G, s, halves);
  widen(j.biases, j.scale, size_t(n) * G, G, b, halves);
}

// --------------------------------------------------------------- kernels
// MLX packs weight i of a row at bits 4 (i % 8) of little-endian word i / 8
// (8 (i % 4) of i / 4 at 8 bits): byte i of a 4-bit block holds weights 2i
// (low nibble) and 2i + 1.
namespace isa_portable {
constexpr int L = 8, kTile = 4;
constexpr Halves halves = halves_portable;
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
template <int BITS>
inline Group group(float s, float b) {
  return {s, b};
}
template <int BITS>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  float q[kBlock];  // loops the compiler vectorizes
  for (int i = 0; i < kBlock / 2; ++i) {
    q[i] = BITS == 8 ? p[i] : p[i] & 15;
    q[i + kBlock / 2] = BITS == 8 ? p[i + kBlock / 2] : p[i] >> 4;
  }
  for (int i = 0; i < kBlock; ++i) q[i] = q[i] * g.s + g.b;
  std::memcpy(w, q, sizeof q);
}
#include "qmm_isa.h"
}  // namespace isa_portable

#if defined(__x86_64__)
// The vector type V of an x86 ISA whose intrinsics start with P, its plain
// operations and its float16 conversion.
#define QMM_X86_OPS(V, P)                                              \
  using F = V;                                                         \
  constexpr Halves halves = halves_f16c;                               \
  inline F splat(float a) { return P##_set1_ps(a); }                   \
  inline F loadu(const float* p) { return P##_loadu_ps(p); }           \
  inline void storeu(float* p, F a) { P##_storeu_ps(p, a); }           \
  inline F add(F a, F b) { return P##_add_ps(a, b); }                 \
  inline F fmadd(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
constexpr int L = 8, kTile = 4;
QMM_X86_OPS(__m256, _mm256)
inline float hsum(F a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline F widen8(__m128i bytes) {  // the low 8 bytes
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}
struct Group {
  F s, b;
};
template <int BITS>
inline Group group(float s, float b) {
  return {splat(s), splat(b)};
}
template <int BITS>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0f);
    const __m128i even = _mm_and_si128(v, m), odd = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    w[0] = widen8(even), w[1] = widen8(_mm_srli_si128(even, 8)), w[2] = widen8(odd), w[3] = widen8(_mm_srli_si128(odd, 8));
  } else {
    for (int i = 0; i < 4; ++i) w[i] = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
  }
  for (int v = 0; v < 4; ++v) w[v] = _mm256_add_ps(_mm256_mul_ps(w[v], g.s), g.b);
}
#include "qmm_isa.h"
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace isa_avx512 {
constexpr int L = 16, kTile = 8;
QMM_X86_OPS(__m512, _mm512)
inline float hsum(F a) { return _mm512_reduce_add_ps(a); }
// 4 bits: `a` holds the group's 16 possible weights (scale * q + bias for q = 0..15), looked
// up by each nibble; 8 bits: scale and bias.
struct Group {
  F a, b;
};
template <int BITS>
inline Group group(float s, float b) {
  if constexpr (BITS == 4) {
    const F q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {_mm512_add_ps(_mm512_mul_ps(q, splat(s)), splat(b)), splat(0.0f)};
  }
  return {splat(s), splat(b)};
}
template <int BITS>
inline void dequant(const uint8_t* p, const Group& g, F* w) {
  if constexpr (BITS == 4) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[0] = _mm512_permutexvar_ps(q, g.a);  // vpermps reads an index's low 4 bits: the low nibble
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), g.a);
  } else {
    for (int i = 0; i < 2; ++i) {
      const F q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
      w[i] = _mm512_add_ps(_mm512_mul_ps(q, g.a), g.b);
    }
  }
}
#include "qmm_isa.h"
}  // namespace isa_avx512
#pragma GCC pop_options

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
#endif

// ------------------------------------------------------------ ISA choice
struct Path {
  const char* name;
  bool (*supported)();
  void (*small)(const QmmJob&, int n0, int n1);
  void (*dequant)(const QmmJob&, int n0, int n1, float* panel);
};

const Path kPaths[] = {  // worst to best
    {"portable", [] { return true; }, isa_portable::rows_small, isa_portable::dequant_rows},
#if defined(__x86_64__)
    {"avx2", has_avx2, isa_avx2::rows_small, isa_avx2::dequant_rows},
    {"avx512", has_avx512, isa_avx512::rows_small, isa_avx512::dequant_rows},
#endif
};
constexpr int kPathCount = int(sizeof(kPaths) / sizeof(kPaths[0]));

std::atomic<const Path*> g_path{nullptr};

std::string path_names() {
  std::string s;
  for (const Path& p : kPaths) s += (s.empty() ? "" : "|") + std::string(p.name);
  return s;
}

// The path named (nullptr: unknown name).
const Path* find_path(const std::string& name) {
  for (const Path& p : kPaths) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

// `want`, or the best path the CPU has where it lacks it (said on stderr).
const Path* usable(const Path* want, const std::string& asked) {
  const Path* best = &kPaths[0];
  for (const Path& p : kPaths) {
    if (p.supported()) best = &p;
  }
  if (want != nullptr && want->supported()) return want;
  std::fprintf(stderr, "mlx_tracer qmm: %s %s; using %s\n", asked.c_str(),
               want ? "is not supported by this CPU" : ("is not one of " + path_names()).c_str(), best->name);
  return best;
}

const Path& path() {
  const Path* p = g_path.load();
  if (p == nullptr) {
    const char* env = std::getenv("MLX_TRACER_QMM_ISA");
    const Path* want = env && *env ? find_path(env) : &kPaths[kPathCount - 1];
    p = usable(want, std::string("MLX_TRACER_QMM_ISA=") + (env ? env : ""));
    g_path.store(p);
  }
  return *p;
}

// ------------------------------------------------------------ thread pool
#include "qmm_pool.h"

// ------------------------------------------------------------- the work
// Calls fn(n0, n1) for weight rows [n0, n1) in chunks of about kChunkBytes
// of packed weights (at least `align` rows, a multiple of it), on the pool.
template <class Fn>
void over_rows(const QmmJob& j, int n0, int n1, int align, const Fn& fn) {
  const size_t row_bytes = size_t(j.K) * j.bits / 8;
  int rows = int(std::max<size_t>(align, (kChunkBytes + row_bytes - 1) / row_bytes)) / align * align;
  rows = std::max(rows, (n1 - n0 + Pool::kMaxChunks - 1) / Pool::kMaxChunks);
  struct Ctx {
    const Fn* fn;
    int n0, n1, rows;
  } ctx{&fn, n0, n1, rows};
  Pool::the().run((n1 - n0 + rows - 1) / rows, [](const void* c, int i) {
    const Ctx& t = *static_cast<const Ctx*>(c);
    (*t.fn)(t.n0 + i * t.rows, std::min(t.n1, t.n0 + (i + 1) * t.rows));
  }, &ctx);
}

// Few x rows: straight from the packed weights.
void run_small(const QmmJob& j, const Path& p) {
  over_rows(j, 0, j.N, 4, [&](int n0, int n1) { p.small(j, n0, n1); });
}

// Many x rows: panels of weight rows dequantized (on the pool), each one cblas_sgemm.
void run_large(const QmmJob& j, const Path& p) {
  const int rows = std::clamp(int(kPanelBytes / (sizeof(float) * j.K)) / 16 * 16, 16, std::max(16, j.N));
  std::vector<float> panel(size_t(std::min(rows, j.N)) * j.K);  // [rows, K]
  for (int n0 = 0; n0 < j.N; n0 += rows) {
    const int nr = std::min(rows, j.N - n0);
    over_rows(j, n0, n0 + nr, 1, [&](int a, int b) { p.dequant(j, a, b, panel.data() + size_t(a - n0) * j.K); });
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, j.M, nr, j.K, 1.0f, j.x, int(j.ldx), panel.data(), j.K, 0.0f,
                j.out + n0, j.N);
  }
}

// 4-bit blocks come out of dequant in block order (even weights, then odd):
// x goes into the same order, which changes only the order of summation.
void run(QmmJob j) {
  std::vector<float> xp;  // [M, K]
  if (j.bits == 4) {
    xp.resize(size_t(j.M) * j.K);
    for (int m = 0; m < j.M; ++m) {
      const float* from = j.x + size_t(m) * j.ldx;
      float* to = xp.data() + size_t(m) * j.K;
      for (int k = 0; k < j.K; k += kBlock) {
        for (int i = 0; i < kBlock / 2; ++i) to[k + i] = from[k + 2 * i], to[k + kBlock / 2 + i] = from[k + 2 * i + 1];
      }
    }
    j.x = xp.data(), j.ldx = j.K;
  }
  j.M <= kSmallMaxM ? run_small(j, path()) : run_large(j, path());
}

// ------------------------------------------------------------ primitive
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
  Qmm(mx::Stream s, int group, int bits) : mx::Primitive(s), group_(group), bits_(bits) {}

  // inputs: x [M, K] float32, w [N, K bits / 32] uint32, scales, biases [N, K / group]; output [M, N] float32
  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    const array& x0 = in[0];
    const bool rows_ok = x0.strides()[1] == 1 && (x0.shape(0) == 1 || x0.strides()[0] >= x0.shape(1));
    array x = rows_ok ? x0 : dense(x0), w = dense(in[1]), s = dense(in[2]), b = dense(in[3]);
    array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const Scale scale = s.dtype() == mx::float16 ? Scale::f16 : s.dtype() == mx::bfloat16 ? Scale::bf16 : Scale::f32;
    const QmmJob j{x.data<float>(), x.shape(0) == 1 ? size_t(x.shape(1)) : size_t(x.strides()[0]), w.data<uint32_t>(),
                   s.data<void>(), b.data<void>(), scale, x.shape(0), w.shape(0), x.shape(1), group_, bits_,
                   out.data<float>()};
    enc.dispatch([j] { run(j); });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer qmm: CPU only");
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& in) override {
    return {{in[0].shape(0), in[1].shape(0)}};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Qmm&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }
  const char* name() const override {
    return "TracerQmm";
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
    a.itemsize() == 2 ? copy(uint16_t{}) : copy(uint32_t{});
    enc.add_temporary(out);  // alive until the tasks that read it ran
    return out;
  }

  int group_, bits_;
};

array qmm(const array& x, const array& w, const array& scales, const array& biases, int group_size, int bits) {
  need(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits));
  need(group_size == 32 || group_size == 64 || group_size == 128,
       "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  need(x.dtype() == mx::float32 && x.ndim() == 2 && x.shape(0) >= 1, "x must be float32 [M, K], got " + describe(x));
  const int M = x.shape(0), K = x.shape(1);
  need(K % group_size == 0, "K = " + std::to_string(K) + " is not a multiple of group_size " + std::to_string(group_size));
  need(w.dtype() == mx::uint32 && w.ndim() == 2 && w.shape(1) == K * bits / 32,
       "w must be uint32 [N, K * bits / 32] = [N, " + std::to_string(K * bits / 32) + "] as mx.quantize packs it, got " +
           describe(w));
  const int N = w.shape(0);
  const mx::Shape groups{N, K / group_size};
  const mx::Dtype t = scales.dtype();
  need(t == mx::float16 || t == mx::bfloat16 || t == mx::float32,
       "scales must be float16, bfloat16 or float32, got " + describe(scales));
  need(biases.dtype() == t, "biases must have the scales' dtype, got " + describe(biases) + " and " + describe(scales));
  need(scales.shape() == groups && biases.shape() == groups, "scales and biases must be [N, K / group_size] = [" +
                                                                 std::to_string(N) + ", " + std::to_string(K / group_size) +
                                                                 "], got " + describe(scales) + " and " + describe(biases));
  auto prim = std::make_shared<Qmm>(mx::default_stream(mx::Device::cpu), group_size, bits);
  return array({M, N}, mx::float32, std::move(prim), {x, w, scales, biases});
}

std::string set_isa(const std::string& name) {
  const Path* want = find_path(name);
  need(want != nullptr, "no ISA path '" + name + "' (" + path_names() + ")");
  g_path.store(usable(want, name));
  return path().name;
}

}  // namespace

void register_qmm(nb::module_& m) {
  m.def("qmm", &qmm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
        nb::arg("bits"), "x [M, K] float32 @ mx.dequantize(w, scales, biases, group_size, bits).T -> [M, N] float32");
  m.def("qmm_isa", [] { return std::string(path().name); }, "qmm's kernels in use: avx512, avx2 or portable");
  m.def("qmm_set_isa", &set_isa, nb::arg("name"), "Use that ISA path from now on (the best one the CPU has if it lacks it); returns the one in use");
  m.def("qmm_threads", [] { return Pool::the().threads(); });
  m.def("qmm_set_threads", [](int n) { Pool::the().set_threads(n); }, nb::arg("n"));
}
