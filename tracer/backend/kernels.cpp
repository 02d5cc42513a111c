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
//  * or, for a projection given as MLX's packed affine blocks (4 or 8 bits),
//    the qmm call the lean forward's MLX-ops path makes for it (qmm.cpp,
//    its exact or fast contract), the bias added after, as `y + bias`.
// tests/test_kernels.py checks each against the MLX ops, bit for bit.
//
// Built and loaded by mlx_tracer/backend/kernels.py (see there).

#include <algorithm>
#include <atomic>
#include <cstring>
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

// A projection's right operand as a task sees it: a float32 matrix as
// cblas_sgemm takes it, or packed blocks as qmm takes them (packed.w set).
struct WeightView {
  const float* p = nullptr;
  bool trans = false;
  int ld = 0;
  tracer_qmm::Packed packed{};
  bool fast = false;  // qmm's fast contract
};

// --------------------------------------------------------------- row math
// out [M, N] = x [M, K] @ w (+ bias [N]): a float32 w as mx.addmm computes it
// (bias rows first, beta 1); packed blocks as qmm, then out + bias.
void matmul(const float* x, int M, int K, const WeightView& w, int N, const float* bias, float* out) {
  if (w.packed.w != nullptr) {
    tracer_qmm::matmul(x, size_t(K), M, w.packed, out, w.fast);
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

// MLX's CPU softmax of one row in place (float32, precise: max, fast exp, sum, times 1 / sum).
void softmax_row(float* row, int S) {
  using namespace mx::simd;
  Simd<float, 1> vmaximum(-mx::numeric_limits<float>::infinity());
  for (int j = 0; j < S; ++j) {
    Simd<float, 1> vals = load<float, 1>(row + j);
    vmaximum = maximum(vals, vmaximum);
  }
  const float top = max(vmaximum);
  Simd<float, 1> vnormalizer(0.0);
  for (int j = 0; j < S; ++j) {
    Simd<float, 1> vexp = load<float, 1>(row + j);
    vexp = exp(vexp - top);
    store(row + j, vexp);
    vnormalizer = vnormalizer + vexp;
  }
  float normalizer = sum(vnormalizer);
  normalizer = 1 / normalizer;
  for (int j = 0; j < S; ++j) {
    store(row + j, Simd<float, 1>(load<float, 1>(row + j) * normalizer));
  }
}

// Calls fn(b, h) for every (row, key head) pair of an attention, on qmm's
// pool: each pair is computed by one thread with the same calls, so the bits
// do not depend on the thread count. Scratch is per thread.
template <class Fn>
void over_heads(int B, int nk, const Fn& fn) {
  struct Ctx {
    const Fn* fn;
    int nk;
  } ctx{&fn, nk};
  tracer_qmm::parallel_for(
      B * nk,
      [](const void* c, int i) {
        const Ctx& t = *static_cast<const Ctx*>(c);
        (*t.fn)(i / t.nk, i % t.nk);
      },
      &ctx);
}

// Decode attention: q [B, nk, R, D] (scaled), keys/values [B, nk, S, D] blocks,
// bias [B, S] -> o [B, nk * R * D]: mx.addmm(bias, q, k^T), softmax, @ v, as
// MLX runs them (one sgemm per (row, key head)).
void attention_rows(const float* q, const View& k, const View& v, const float* bias, int B, int nk, int R, int D,
                    float* o) {
  const int S = k.dim(2);
  over_heads(B, nk, [&](int b, int h) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(R) * S);
    float* scores = scratch.data();  // [R, S]
    const size_t i = size_t(b) * nk + h;
    for (int r = 0; r < R; ++r) {
      std::memcpy(scores + size_t(r) * S, bias + size_t(b) * S, sizeof(float) * S);
    }
    const float* ki = k.p + b * k.strides[0] + h * k.strides[1];
    const float* vi = v.p + b * v.strides[0] + h * v.strides[1];
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, R, S, D, 1.0f, q + i * R * D, D, ki, D, 1.0f, scores, S);
    for (int r = 0; r < R; ++r) {
      softmax_row(scores + size_t(r) * S, S);
    }
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, R, D, S, 1.0f, scores, S, vi, D, 0.0f, o + i * R * D, D);
  });
}

// Window attention: q [B, nk, R, L, D] (scaled), keys/values [B, nk, S, D]
// blocks, mask [B, L, S] (nonzero: visible) -> o [B, L, nk * R * D]: the lean
// forward's window attention on MLX's ops (scores by one sgemm per (row, key
// head, query head), float32's lowest where masked, softmax, @ v), its
// result transposed to tokens first.
void attention_window(const float* q, const View& k, const View& v, const bool* mask, int B, int nk, int R, int L,
                      int D, float* o) {
  const int S = k.dim(2), nqD = nk * R * D;
  const float low = mx::numeric_limits<float>::lowest();
  over_heads(B, nk, [&](int b, int h) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(L) * (S + D));
    float* scores = scratch.data();             // [L, S]
    float* ov = scores + size_t(L) * S;         // [L, D]
    const bool* mb = mask + size_t(b) * L * S;
    {
      const float* ki = k.p + b * k.strides[0] + h * k.strides[1];
      const float* vi = v.p + b * v.strides[0] + h * v.strides[1];
      for (int r = 0; r < R; ++r) {
        const float* qi = q + ((size_t(b) * nk + h) * R + r) * L * D;
        cblas_sgemm(kRowMajor, kNoTrans, kTrans, L, S, D, 1.0f, qi, D, ki, D, 0.0f, scores, S);
        for (int l = 0; l < L; ++l) {
          float* row = scores + size_t(l) * S;
          for (int j = 0; j < S; ++j) {
            row[j] = mb[size_t(l) * S + j] ? row[j] : low;
          }
          softmax_row(row, S);
        }
        cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, L, D, S, 1.0f, scores, S, vi, D, 0.0f, ov, D);
        for (int l = 0; l < L; ++l) {
          std::memcpy(o + (size_t(b) * L + l) * nqD + (size_t(h) * R + r) * D, ov + size_t(l) * D, sizeof(float) * D);
        }
      }
    }
  });
}

// gu [M, 2F] -> silu(gate) * up [M, F] (gate: the first F columns).
void swiglu_rows(const float* gu, size_t M, int F, float* out) {
  for (size_t m = 0; m < M; ++m) {
    const float* A = gu + m * 2 * F;
    const float* B = A + F;
    float* C = out + m * F;
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
  char kind;  // 'f': float32; 'b': bool; 'w': a weight (float32 or packed); 'q': a packed weight's scales or biases
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
  X(k, 1, 'f')           /* [B, nk, S, D] what the step attends (cache written) */ \
  X(v, 1, 'f')           /* [B, nk, S, D] */                                       \
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
                                      : t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
        need(ok, std::string(kernel) + ": input '" + slots[s].name + "' must be " +
                     (kind == 'f'   ? "float32"
                      : kind == 'b' ? "bool"
                      : kind == 'w' ? "float32 (a matrix) or uint32 (packed blocks)"
                                    : "float32, float16 or bfloat16"));
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

  // The weight in slot `w` of a projection from K inputs: a float32 matrix
  // as MLX's matmul hands it to cblas_sgemm ([K, N] row-major: no
  // transpose; a transposed view of a row-major [N, K], as a Linear's
  // weight.T: transpose; else a row-major copy), or packed blocks with
  // their scales and biases. What it points into are the node's inputs or
  // temporaries of its tasks: alive until the tasks ran.
  WeightView weight(const Inputs& at, const std::vector<array>& in, int w, int scales, int biases, int K, bool fast) {
    WeightView v;
    const array& a = at(in, w);
    if (at.has(scales)) {
      array q = dense(a), sc = dense(at(in, scales)), bi = dense(at(in, biases));
      const auto t = sc.dtype() == mx::float16    ? tracer_qmm::ScaleType::f16
                     : sc.dtype() == mx::bfloat16 ? tracer_qmm::ScaleType::bf16
                                                  : tracer_qmm::ScaleType::f32;
      v.packed = {q.data<uint32_t>(), sc.data<void>(), bi.data<void>(), t, q.shape(0), K, K / sc.shape(1),
                  q.shape(1) * 32 / K};
      v.fast = fast;
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
  LayerIn(mx::Stream s, Inputs at, float eps, int nq, int nk, int D, int L, float qk_eps, bool fast)
      : Kernel(s), at_(std::move(at)), eps_(eps), qk_eps_(qk_eps), nq_(nq), nk_(nk), D_(D), L_(L), fast_(fast) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    namespace s = in_slot;
    array h = dense(at_(in, s::h)), nw = dense(at_(in, s::norm));
    array C = dense(at_(in, s::cos)), S = dense(at_(in, s::sin)), F = dense(at_(in, s::scale));
    std::optional<array> act = dense_if(at_, in, s::act), bd = dense_if(at_, in, s::b_down);
    std::optional<array> bq = dense_if(at_, in, s::b_qkv);
    std::optional<array> qn = dense_if(at_, in, s::q_norm), kn = dense_if(at_, in, s::k_norm);
    const WeightView wd = act ? weight(at_, in, s::w_down, s::w_down_scales, s::w_down_biases, act->shape(1), fast_)
                              : WeightView{};
    const WeightView wq = weight(at_, in, s::w_qkv, s::w_qkv_scales, s::w_qkv_biases, h.shape(1), fast_);
    alloc(outputs);
    const bool carry = act.has_value();
    const size_t o = carry ? 1 : 0;
    const float eps = eps_, qk_eps = qk_eps_;
    const int nq = nq_, nk = nk_, D = D_, L = L_;
    run([h = View(h), act = act ? View(*act) : View(), wd, bd = ptr(bd), nw = View(nw), wq, bq = ptr(bq), C = View(C), S = View(S), F = View(F), qn = ptr(qn), kn = ptr(kn),
         h_new = carry ? outputs[0].data<float>() : nullptr, q = outputs[o].data<float>(),
         k = outputs[o + 1].data<float>(), v = outputs[o + 2].data<float>(), eps, nq, nk, D, L, carry, qk_eps]() {
      const int M = h.dim(0), hid = h.dim(1), N = (nq + 2 * nk) * D;
      std::vector<float> x(size_t(M) * hid), y(size_t(M) * N);
      if (carry) {
        std::vector<float> down(size_t(M) * hid);
        matmul(act.p, M, act.dim(1), wd, hid, bd, down.data());
        norm_rows(h.p, down.data(), nw.p, eps, M, hid, h_new, x.data());
      } else {
        norm_rows(h.p, nullptr, nw.p, eps, M, hid, nullptr, x.data());
      }
      matmul(x.data(), M, hid, wq, N, bq, y.data());
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
  bool fast_;
};

// A decode step's cache write: buf [B, H, S, D] with new [B, H, 1, D] at
// column col [1] int32 (clamped to the buffer), as mx.slice_update writes it.
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
  using Kernel::Kernel;

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    const array& buf = in[0];
    array upd = dense(in[1]);
    const int32_t* col = in[2].data<int32_t>();
    array& out = outputs[0];
    const bool fits = buf.flags().row_contiguous && buf.buffer_size() == out.nbytes();
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
      run([src = src.data<float>(), dst = out.data<float>(), n = out.nbytes()]() { std::memcpy(dst, src, n); });
    }
    run([upd = View(upd), out = View(out), col]() {
      const int rows = out.dim(0) * out.dim(1), S = out.dim(2), D = out.dim(3);
      const int c = std::clamp(col[0], 0, S - 1);
      for (int r = 0; r < rows; ++r) {
        std::memcpy(out.p + (size_t(r) * S + c) * D, upd.p + size_t(r) * D, sizeof(float) * D);
      }
    });
  }
  const char* name() const override {
    return "TracerCacheWrite";
  }
};

// A decoder layer from its attention to the MLP's activation:
//   o = attention(q, k, v, bias), a = o @ w_o (+ b_o)
//   h_mid = h + a, x = rms_norm(h_mid), act = swiglu(x @ w_gu (+ b_gu))
// inputs: TRACER_LAYER_MID; outputs: h_mid [B, hidden], act [B, F]
class LayerMid : public Kernel {
 public:
  LayerMid(mx::Stream s, Inputs at, float eps, bool fast) : Kernel(s), at_(std::move(at)), eps_(eps), fast_(fast) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    namespace s = mid_slot;
    array q = dense(at_(in, s::q)), k = blocks_dense(at_(in, s::k)), v = blocks_dense(at_(in, s::v));
    array h = dense(at_(in, s::h)), nw = dense(at_(in, s::norm));
    std::optional<array> bias = dense_if(at_, in, s::bias), mask = dense_if(at_, in, s::mask);
    std::optional<array> bo = dense_if(at_, in, s::b_o), bg = dense_if(at_, in, s::b_gu);
    const int nqD = q.shape(1) * q.shape(2) * q.shape(q.ndim() - 1);
    const WeightView wo = weight(at_, in, s::w_o, s::w_o_scales, s::w_o_biases, nqD, fast_);
    const WeightView wg = weight(at_, in, s::w_gu, s::w_gu_scales, s::w_gu_biases, h.shape(1), fast_);
    alloc(outputs);
    const float eps = eps_;
    run([q = View(q), k = View(k), v = View(v), bias = ptr(bias), mask = mask ? mask->data<bool>() : nullptr, wo,
         bo = ptr(bo), h = View(h), nw = View(nw), wg, bg = ptr(bg), h_mid = outputs[0].data<float>(),
         act = View(outputs[1]), eps]() {
      const bool window = q.shape.size() == 5;
      const int B = q.dim(0), nk = q.dim(1), R = q.dim(2), L = window ? q.dim(3) : 1, D = q.dim(-1);
      const int M = h.dim(0), hid = h.dim(1), F = act.dim(1), nqD = nk * R * D, S = k.dim(2);
      std::vector<float> o(size_t(M) * nqD), a(size_t(M) * hid), x(size_t(M) * hid), gu(size_t(M) * 2 * F);
      if (window) {
        attention_window(q.p, k, v, mask, B, nk, R, L, D, o.data());
      } else {
        attention_rows(q.p, k, v, bias, B, nk, R, D, o.data());
      }
      matmul(o.data(), M, nqD, wo, hid, bo, a.data());
      norm_rows(h.p, a.data(), nw.p, eps, M, hid, h_mid, x.data());
      matmul(x.data(), M, hid, wg, 2 * F, bg, gu.data());
      swiglu_rows(gu.data(), M, F, act.p);
    });
  }
  const char* name() const override {
    return "TracerLayerMid";
  }

 private:
  Inputs at_;
  float eps_;
  bool fast_;
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
// [N, K bits / 32] uint32 (4 or 8 bits) with scales and biases [N, K / group]
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
  need(a.dtype() == mx::uint32 && (bits == 4 || bits == 8) && a.shape(1) * 32 == bits * K && (N < 0 || a.shape(0) == N),
       what + " with scales must be packed uint32 [N, " + k + " bits / 32] with 4 or 8 bits, got " + shape_of(a));
  const array &sc = at(in, scales), &bi = at(in, biases);
  const int G = sc.ndim() == 2 ? sc.shape(1) : 0;
  need(G > 0 && sc.shape(0) == a.shape(0) && K % G == 0 && (K / G == 32 || K / G == 64 || K / G == 128),
       what + "_scales must be [N, " + k + " / group] with a group of 32, 64 or 128, got " + shape_of(sc));
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
  const bool window = q.ndim() == 5;
  need((q.ndim() == 4 || window) && k.ndim() == 4 && k.shape() == v.shape() && k.shape(0) == q.shape(0) &&
           k.shape(1) == q.shape(1) && k.shape(3) == q.shape(-1),
       "attention needs q [B, nk, R, D] (decode) or [B, nk, R, L, D] (window), keys/values [B, nk, S, D]");
  const int B = q.shape(0), S = k.shape(2);
  if (window) {
    need(at.has(s::mask) && !at.has(s::bias) && at(in, s::mask).shape() == mx::Shape{B, 1, 1, q.shape(3), S},
         "window attention (q [B, nk, R, L, D]) needs mask [B, 1, 1, L, S], no bias");
  } else {
    need(at.has(s::bias) && !at.has(s::mask) && at(in, s::bias).shape() == mx::Shape{B, 1, 1, S},
         "decode attention (q [B, nk, R, D]) needs bias [B, 1, 1, S], no mask");
  }
}

bool fast_contract(const std::string& contract) {
  need(contract == "exact" || contract == "fast", "contract must be 'exact' or 'fast', got '" + contract + "'");
  return contract == "fast";
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
  need_weight(at, in, s::w_qkv, s::w_qkv_scales, s::w_qkv_biases, hid, N, "layer_in: w_qkv");
  need_vector(at, in, s::b_qkv, N, "layer_in: b_qkv");
  const size_t rows = size_t(M) * H;
  need(at(in, s::cos).size() == rows * D && at(in, s::sin).size() == rows * D && at(in, s::scale).size() == rows,
       "layer_in: rotation tables must be cos/sin [B L (nq + 2 nk), D], scale [B L (nq + 2 nk), 1]");
  need(at.has(s::q_norm) == at.has(s::k_norm), "layer_in: q_norm and k_norm go together");
  need_vector(at, in, s::q_norm, D, "layer_in: q_norm");
  need_vector(at, in, s::k_norm, D, "layer_in: k_norm");
  const mx::Shape qs = L == 1 ? mx::Shape{B, nk, nq / nk, D} : mx::Shape{B, nk, nq / nk, L, D};
  shapes.insert(shapes.end(), {qs, {B, nk, L, D}, {B, nk, L, D}});
  return make<LayerIn>(std::move(shapes), std::move(in), at, eps, nq, nk, D, L, qk_eps, fast_contract(contract));
}

array cache_write(const array& buf, const array& upd, const array& col) {
  need(buf.ndim() == 4 && upd.ndim() == 4 && upd.shape(0) == buf.shape(0) && upd.shape(1) == buf.shape(1) &&
           upd.shape(2) == 1 && upd.shape(3) == buf.shape(3),
       "cache_write needs buf [B, H, S, D] and new [B, H, 1, D], got " + shape_of(buf) + " and " + shape_of(upd));
  need(buf.dtype() == mx::float32 && upd.dtype() == mx::float32, "cache_write: buf and new must be float32");
  need(col.dtype() == mx::int32 && col.size() == 1, "cache_write: col must be int32 [1]");
  return make<CacheWrite>({buf.shape()}, {buf, upd, col})[0];
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
  return make<LayerMid>({h.shape(), {M, F2 / 2}}, std::move(in), at, eps, fast_contract(contract));
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
std::pair<uint64_t, uint64_t> cache_writes() {
  return {g_donated.load(), g_copied.load()};
}

}  // namespace

void register_qmm(nb::module_& m);  // qmm.cpp
void register_logprobs(nb::module_& m);  // logprobs.cpp

NB_MODULE(_mlx_tracer_kernels, m) {
  m.def("layer_in", &layer_in, nb::arg("inputs"), nb::arg("eps"), nb::arg("nq"), nb::arg("nk"), nb::arg("D"),
        nb::arg("qk_eps") = 0.0f, nb::arg("contract") = "exact", nb::arg("L") = 1);
  m.def("cache_write", &cache_write, nb::arg("buf"), nb::arg("new"), nb::arg("col"));
  m.def("layer_mid", &layer_mid, nb::arg("inputs"), nb::arg("eps"), nb::arg("contract") = "exact");
  m.def("inputs", &inputs_of, nb::arg("kernel"));
  m.def("cache_writes", &cache_writes);
  register_qmm(m);
  register_logprobs(m);
}
