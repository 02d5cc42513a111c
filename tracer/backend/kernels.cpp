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
//    bias copied into the output first, as mx.addmm does).
// tests/test_kernels.py checks each against the MLX ops, bit for bit.
//
// Built and loaded by mlx_tracer/backend/kernels.py (see there).

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
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

// Cache buffers layer_in wrote in place / into a copy (cache_writes()).
std::atomic<uint64_t> g_donated{0}, g_copied{0};

// ------------------------------------------------------------ array helpers
void alloc(std::vector<array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
}

// The right operand of `x @ w` as MLX's CPU matmul hands it to cblas_sgemm:
// [K, N] row-major (no transpose, ld N), a transposed view of a row-major
// [N, K] (transpose, ld K: a Linear's weight.T), else a row-major copy.
struct Operand {
  array a;
  bool trans;
  int ld;
};

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

// A matmul's right operand as a task sees it.
struct OperandView {
  const float* p;
  bool trans;
  int ld;
};

OperandView view(const Operand& w) {
  return {w.a.data<float>(), w.trans, w.ld};
}

// --------------------------------------------------------------- row math
// out [M, N] = x [M, K] @ w (+ bias [N], as mx.addmm: bias rows first, beta 1).
void gemm(const float* x, int M, int K, const float* w, bool trans, int ldw, int N, const float* bias, float* out) {
  if (bias != nullptr) {
    for (int m = 0; m < M; ++m) {
      std::memcpy(out + size_t(m) * N, bias, sizeof(float) * N);
    }
  }
  cblas_sgemm(kRowMajor, kNoTrans, trans ? kTrans : kNoTrans, M, N, K, 1.0f, x, K, w, ldw, bias ? 1.0f : 0.0f, out, N);
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

// y [M, H * D] rotated head by head as ((x * C) + (x_swapped * S)) * F (x_swapped:
// the head's halves exchanged; C/S [M * H, D], F [M * H, 1]: the lean
// forward's tables, values with C = 1, S = 0, F = 1), written out as q
// [M, nq, D] (= [M, nk, R, D]), k [M, nk, D], v [M, nk, D].
// `kv_stride`/`kv_cols`: the keys/values land in column `col` of buffers
// [M, nk, kv_cols, D] instead (a decode step's cache write; 1 and 0: [M, nk, 1, D]).
void rope_rows(const float* y, const float* C, const float* S, const float* F, size_t M, int nq, int nk, int D,
               float* q, float* k, float* v, int kv_cols = 1, int col = 0) {
  const int H = nq + 2 * nk, half = D / 2;
  for (size_t m = 0; m < M; ++m) {
    for (int h = 0; h < H; ++h) {
      const size_t row = m * H + h;
      const float* x = y + row * D;
      const float* c = C + row * D;
      const float* s = S + row * D;
      const float f = F[row];
      const size_t kv = ((m * nk + (h < nq + nk ? h - nq : h - nq - nk)) * kv_cols + col) * D;
      float* o = h < nq ? q + (m * nq + h) * D : (h < nq + nk ? k + kv : v + kv);
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

// Decode attention: q [B, nk, R, D] (scaled), keys/values [B, nk, S, D] blocks,
// bias [B, S] -> o [B, nk * R * D]: mx.addmm(bias, q, k^T), softmax, @ v, as
// MLX runs them (one sgemm per (row, key head)). `scores`: [R, S] scratch.
void attention_rows(const float* q, const View& k, const View& v, const float* bias, int B, int nk, int R, int D,
                    float* scores, float* o) {
  const int S = k.dim(2);
  const float* kp = k.p;
  const float* vp = v.p;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < nk; ++h) {
      const size_t i = size_t(b) * nk + h;
      for (int r = 0; r < R; ++r) {
        std::memcpy(scores + size_t(r) * S, bias + size_t(b) * S, sizeof(float) * S);
      }
      const float* ki = kp + b * k.strides[0] + h * k.strides[1];
      const float* vi = vp + b * v.strides[0] + h * v.strides[1];
      cblas_sgemm(kRowMajor, kNoTrans, kTrans, R, S, D, 1.0f, q + i * R * D, D, ki, D, 1.0f, scores, S);
      for (int r = 0; r < R; ++r) {
        softmax_row(scores + size_t(r) * S, S);
      }
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, R, D, S, 1.0f, scores, S, vi, D, 0.0f, o + i * R * D, D);
    }
  }
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
    run([a = View(a), dst = out.data<float>()]() {
      const int nd = int(a.shape.size());
      std::vector<int> idx(nd, 0);
      for (size_t i = 0; i < a.size; ++i) {
        int64_t off = 0;
        for (int d = 0; d < nd; ++d) {
          off += int64_t(idx[d]) * a.strides[d];
        }
        dst[i] = a.p[off];
        for (int d = nd - 1; d >= 0; --d) {
          if (++idx[d] < a.shape[d]) {
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

  Operand operand(const array& w) {
    const int64_t stx = w.strides()[0], sty = w.strides()[1];
    if (stx == w.shape(1) && sty == 1) {
      return {w, false, int(stx)};
    }
    if (stx == 1 && sty == w.shape(0)) {
      return {w, true, int(sty)};
    }
    array c = dense(w);
    return {c, false, c.shape(1)};
  }
};

// rms_norm / add_rms_norm: outputs (x + r,) norm.
class RMSNormResidual : public Kernel {
 public:
  RMSNormResidual(mx::Stream s, float eps, bool residual) : Kernel(s), eps_(eps), residual_(residual) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array x = dense(inputs[0]);
    array r = residual_ ? dense(inputs[1]) : x;
    array w = dense(inputs.back());
    alloc(outputs);
    array s = residual_ ? outputs[0] : x, y = outputs.back();
    const float eps = eps_;
    const bool residual = residual_;
    run([x = View(x), r = View(r), w = View(w), s = View(s), y = View(y), eps, residual]() {
      const int n = x.dim(-1);
      norm_rows(x.p, residual ? r.p : nullptr, w.p, eps, x.size / n, n, residual ? s.p : nullptr, y.p);
    });
  }
  const char* name() const override {
    return residual_ ? "TracerAddRMSNorm" : "TracerRMSNorm";
  }

 private:
  float eps_;
  bool residual_;
};

// y, C, S, F -> q [B, nk, R, D], k, v [B, nk, 1, D].
class RopeSplit : public Kernel {
 public:
  RopeSplit(mx::Stream s, int nq, int nk, int D, bool qk, float qk_eps)
      : Kernel(s), nq_(nq), nk_(nk), D_(D), qk_(qk), qk_eps_(qk_eps) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array y = dense(inputs[0]), C = dense(inputs[1]), S = dense(inputs[2]), F = dense(inputs[3]);
    std::optional<array> qn, kn;
    if (qk_) {
      qn = dense(inputs[4]);
      kn = dense(inputs[5]);
    }
    alloc(outputs);
    array q = outputs[0], k = outputs[1], v = outputs[2];
    const int nq = nq_, nk = nk_, D = D_;
    const float qk_eps = qk_eps_;
    run([y = View(y), C = View(C), S = View(S), F = View(F), q = View(q), k = View(k), v = View(v), nq, nk, D,
         qn = qn ? qn->data<float>() : nullptr, kn = kn ? kn->data<float>() : nullptr, qk_eps]() {
      const float* src = y.p;
      std::vector<float> normed;
      if (qn != nullptr) {
        normed.assign(y.p, y.p + y.size);
        qk_norm_rows(normed.data(), qn, kn, qk_eps, q.dim(0), nq, nk, D);
        src = normed.data();
      }
      rope_rows(src, C.p, S.p, F.p, q.dim(0), nq, nk, D, q.p, k.p, v.p);
    });
  }
  const char* name() const override {
    return "TracerRopeSplit";
  }

 private:
  int nq_, nk_, D_;
  bool qk_;
  float qk_eps_;
};

// gu [M, 2F] -> [M, F].
class SwiGLU : public Kernel {
 public:
  using Kernel::Kernel;

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array gu = dense(inputs[0]);
    alloc(outputs);
    array out = outputs[0];
    run([gu = View(gu), out = View(out)]() {
      const int F = out.dim(-1);
      swiglu_rows(gu.p, out.size / F, F, out.p);
    });
  }
  const char* name() const override {
    return "TracerSwiGLU";
  }
};

// q [B, nk, R, D], keys, values [B, nk, S, D], bias [B, 1, 1, S] -> o [B, nk * R * D].
class DecodeAttention : public Kernel {
 public:
  using Kernel::Kernel;

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array q = dense(inputs[0]), bias = dense(inputs[3]);
    array k = blocks_dense(inputs[1]), v = blocks_dense(inputs[2]);
    alloc(outputs);
    array o = outputs[0];
    run([q = View(q), k = View(k), v = View(v), bias = View(bias), o = View(o)]() {
      const int R = q.dim(2);
      std::vector<float> scores(size_t(R) * k.dim(2));
      attention_rows(q.p, k, v, bias.p, q.dim(0), q.dim(1), R, q.dim(3), scores.data(), o.p);
    });
  }
  const char* name() const override {
    return "TracerDecodeAttention";
  }
};

// A decoder layer up to its attention, for one decode token per row:
//   [h_new = h + act @ w_down (+ b_down)]        (the previous layer's MLP output)
//   x = rms_norm(h_new or h), y = x @ w_qkv (+ b_qkv), q, k, v = rope_split(y)
//   keys/values written at column `col` of the cache buffers (in place when
//   MLX may donate them, as its slice_update does; `col` clamped to the buffer)
// inputs: h, [act, w_down, (b_down)], norm_w, w_qkv, (b_qkv), C, S, F, kbuf, vbuf, col
// outputs: [h_new], q [B, nk, R, D], kbuf', vbuf' [B, nk, S, D]
class LayerIn : public Kernel {
 public:
  LayerIn(mx::Stream s, float eps, bool carry, bool b_down, bool b_qkv, int nq, int nk, int D, bool qk, float qk_eps)
      : Kernel(s), eps_(eps), qk_eps_(qk_eps), carry_(carry), b_down_(b_down), b_qkv_(b_qkv), qk_(qk), nq_(nq), nk_(nk),
        D_(D) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    size_t i = 0;
    array h = dense(in[i++]);
    std::optional<array> act, bd, bq;
    std::optional<Operand> wd;
    if (carry_) {
      act = dense(in[i++]);
      wd = operand(in[i++]);
      if (b_down_) bd = dense(in[i++]);
    }
    array nw = dense(in[i++]);
    Operand wq = operand(in[i++]);
    if (b_qkv_) bq = dense(in[i++]);
    array C = dense(in[i++]), S = dense(in[i++]), F = dense(in[i++]);
    std::optional<array> qn, kn;
    if (qk_) {
      qn = dense(in[i++]);
      kn = dense(in[i++]);
    }
    // the buffers: checked for donation where the graph holds them (a copy
    // of the array would count as one more reference)
    const size_t o = carry_ ? 1 : 0;
    for (size_t j = 0; j < o + 1; ++j) {
      outputs[j].set_data(mx::allocator::malloc(outputs[j].nbytes()));
    }
    take_buffer(in[i], outputs[o + 1], outputs.size());
    take_buffer(in[i + 1], outputs[o + 2], outputs.size());
    const int32_t* col = in[i + 2].data<int32_t>();
    const array& kout = outputs[o + 1];
    const array& vout = outputs[o + 2];
    const float eps = eps_, qk_eps = qk_eps_;
    const int nq = nq_, nk = nk_, D = D_;
    const bool carry = carry_;
    run([h = View(h), act = act ? View(*act) : View(), wd = wd ? view(*wd) : OperandView{}, bd = bd ? bd->data<float>() : nullptr,
         nw = View(nw), wq = view(wq), bq = bq ? bq->data<float>() : nullptr, C = View(C), S = View(S), F = View(F),
         col, h_new = carry ? outputs[0].data<float>() : nullptr, q = outputs[o].data<float>(),
         kout = View(kout), vout = outputs[o + 2].data<float>(), eps, nq, nk, D, carry,
         qn = qn ? qn->data<float>() : nullptr, kn = kn ? kn->data<float>() : nullptr, qk_eps]() {
      const int B = h.dim(0), hid = h.dim(1), N = (nq + 2 * nk) * D, cols = kout.dim(2);
      const int c = std::clamp(col[0], 0, cols - 1);
      std::vector<float> x(size_t(B) * hid), y(size_t(B) * N);
      if (carry) {
        std::vector<float> down(size_t(B) * hid);
        gemm(act.p, B, act.dim(1), wd.p, wd.trans, wd.ld, hid, bd, down.data());
        norm_rows(h.p, down.data(), nw.p, eps, B, hid, h_new, x.data());
      } else {
        norm_rows(h.p, nullptr, nw.p, eps, B, hid, nullptr, x.data());
      }
      gemm(x.data(), B, hid, wq.p, wq.trans, wq.ld, N, bq, y.data());
      if (qn != nullptr) {
        qk_norm_rows(y.data(), qn, kn, qk_eps, B, nq, nk, D);
      }
      rope_rows(y.data(), C.p, S.p, F.p, B, nq, nk, D, q, kout.p, vout, cols, c);
    });
  }
  const char* name() const override {
    return "TracerLayerIn";
  }

 private:
  // `out` takes `buf`'s memory when MLX may donate it, else a row-major copy
  // made on the worker. The test is array::is_donatable() allowing the
  // references this node's own outputs hold: MLX gives each output of a
  // multi-output node its own copy of the inputs, so a buffer nobody else
  // holds is referenced once per output here (and once in all for MLX's
  // single-output slice_update).
  //
  // While earlier steps still run (a pipelined decode loop evaluates step
  // t+1 while the worker computes step t), the buffer's memory is also held
  // by MLX's keep-alive task of step t's attention, which reads it: then
  // this waits for queued tasks to finish (as MLX's eval does when too many
  // are queued) until only this node holds it. A buffer another array holds
  // (a view the caller kept) is copied without waiting.
  void take_buffer(const array& buf, array& out, size_t outputs) {
    static_assert(sizeof(array) == sizeof(std::shared_ptr<void>), "mlx::core::array is one shared_ptr");
    const long holders = reinterpret_cast<const std::shared_ptr<void>*>(&buf)->use_count();
    const auto& data = buf.data_shared_ptr();
    bool ok = holders <= long(outputs) && data->is_owned() && buf.flags().row_contiguous &&
        buf.buffer_size() == out.nbytes();
    while (ok && data.use_count() > 1 && mx::scheduler::n_active_tasks() > 0) {
      mx::scheduler::wait_for_one();
    }
    if (ok && data.use_count() == 1) {
      out.copy_shared_buffer(buf);
      ++g_donated;
      return;
    }
    ++g_copied;
    array src = dense(buf);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    run([src = src.data<float>(), dst = out.data<float>(), n = out.nbytes()]() { std::memcpy(dst, src, n); });
  }

  float eps_, qk_eps_;
  bool carry_, b_down_, b_qkv_, qk_;
  int nq_, nk_, D_;
};

// A decoder layer from its attention to the MLP's activation:
//   o = attention(q, keys, values, bias), a = o @ w_o (+ b_o)
//   h_mid = h + a, x = rms_norm(h_mid), act = swiglu(x @ w_gu (+ b_gu))
// inputs: q, keys, values, bias, w_o, (b_o), h, norm_w, w_gu, (b_gu)
// outputs: h_mid [B, hidden], act [B, F]
class LayerMid : public Kernel {
 public:
  LayerMid(mx::Stream s, float eps, bool b_o, bool b_gu) : Kernel(s), eps_(eps), b_o_(b_o), b_gu_(b_gu) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    size_t i = 0;
    array q = dense(in[i++]), k = blocks_dense(in[i++]), v = blocks_dense(in[i++]);
    array bias = dense(in[i++]);
    Operand wo = operand(in[i++]);
    std::optional<array> bo, bg;
    if (b_o_) bo = dense(in[i++]);
    array h = dense(in[i++]), nw = dense(in[i++]);
    Operand wg = operand(in[i++]);
    if (b_gu_) bg = dense(in[i++]);
    alloc(outputs);
    array h_mid = outputs[0], act = outputs[1];
    const float eps = eps_;
    run([q = View(q), k = View(k), v = View(v), bias = View(bias), wo = view(wo), bo = bo ? bo->data<float>() : nullptr,
         h = View(h), nw = View(nw), wg = view(wg), bg = bg ? bg->data<float>() : nullptr, h_mid = h_mid.data<float>(),
         act = View(act), eps]() {
      const int B = q.dim(0), nk = q.dim(1), R = q.dim(2), D = q.dim(3), hid = h.dim(1), F = act.dim(1);
      const int nqD = nk * R * D;
      std::vector<float> scores(size_t(R) * k.dim(2)), o(size_t(B) * nqD), a(size_t(B) * hid), x(size_t(B) * hid),
          gu(size_t(B) * 2 * F);
      attention_rows(q.p, k, v, bias.p, B, nk, R, D, scores.data(), o.data());
      gemm(o.data(), B, nqD, wo.p, wo.trans, wo.ld, hid, bo, a.data());
      norm_rows(h.p, a.data(), nw.p, eps, B, hid, h_mid, x.data());
      gemm(x.data(), B, hid, wg.p, wg.trans, wg.ld, 2 * F, bg, gu.data());
      swiglu_rows(gu.data(), B, F, act.p);
    });
  }
  const char* name() const override {
    return "TracerLayerMid";
  }

 private:
  float eps_;
  bool b_o_, b_gu_;
};

// -------------------------------------------------------------- bindings
void need(bool ok, const char* what) {
  if (!ok) {
    throw std::invalid_argument(std::string("mlx_tracer kernels: ") + what);
  }
}

mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device::cpu);
}

template <class P, class... A>
std::vector<array> make(std::vector<mx::Shape> shapes, std::vector<array> inputs, A... args) {
  for (auto& a : inputs) {
    need(a.dtype() == mx::float32 || (a.dtype() == mx::int32 && a.size() == 1), "inputs must be float32");
  }
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return array::make_arrays(std::move(shapes), dtypes, std::make_shared<P>(cpu_stream(), args...), inputs);
}

// w: a weight operand [K, N] of `x @ w`
void need_weight(const array& w, int K, const char* what) {
  need(w.ndim() == 2 && w.shape(0) == K, what);
}

std::vector<array> rms_norm(const array& x, const array& w, float eps) {
  need(w.ndim() == 1 && w.shape(0) == x.shape(-1), "rms_norm weight must be [x.shape[-1]]");
  return make<RMSNormResidual>({x.shape()}, {x, w}, eps, false);
}

std::vector<array> add_rms_norm(const array& x, const array& r, const array& w, float eps) {
  need(x.shape() == r.shape() && w.ndim() == 1 && w.shape(0) == x.shape(-1),
       "add_rms_norm needs x and r of one shape, weight [x.shape[-1]]");
  return make<RMSNormResidual>({x.shape(), x.shape()}, {x, r, w}, eps, true);
}

void need_rope(size_t y_size, const array& C, const array& S, const array& F, int B, int nq, int nk, int D) {
  const size_t H = nq + 2 * nk;
  need(nk > 0 && nq % nk == 0 && D % 2 == 0 && y_size == B * H * D && C.size() == y_size && S.size() == y_size &&
           F.size() == B * H,
       "rope shapes do not match (y [B, (nq + 2 nk) D], C/S [B (nq + 2 nk), D], F [B (nq + 2 nk), 1])");
}

// q_norm / k_norm: both or neither, each [D] (qwen3's per-head norms, applied before the rotation).
bool need_qk_norm(const std::optional<array>& qn, const std::optional<array>& kn, int D) {
  need(qn.has_value() == kn.has_value(), "q_norm and k_norm go together");
  if (qn) {
    need(qn->ndim() == 1 && qn->shape(0) == D && kn->ndim() == 1 && kn->shape(0) == D, "q_norm and k_norm must be [D]");
  }
  return qn.has_value();
}

std::vector<array> rope_split(const array& y, const array& C, const array& S, const array& F, int B, int nq, int nk, int D,
                              std::optional<array> q_norm, std::optional<array> k_norm, float qk_eps) {
  need_rope(y.size(), C, S, F, B, nq, nk, D);
  const bool qk = need_qk_norm(q_norm, k_norm, D);
  std::vector<array> inputs{y, C, S, F};
  if (qk) inputs.insert(inputs.end(), {*q_norm, *k_norm});
  return make<RopeSplit>({{B, nk, nq / nk, D}, {B, nk, 1, D}, {B, nk, 1, D}}, std::move(inputs), nq, nk, D, qk, qk_eps);
}

array swiglu(const array& gu) {
  need(gu.ndim() == 2 && gu.shape(1) % 2 == 0, "swiglu needs [M, 2F]");
  return make<SwiGLU>({{gu.shape(0), gu.shape(1) / 2}}, {gu})[0];
}

void need_attention(const array& q, const array& k, const array& v, const array& bias) {
  need(q.ndim() == 4 && k.ndim() == 4 && k.shape() == v.shape() && k.shape(0) == q.shape(0) &&
           k.shape(1) == q.shape(1) && k.shape(3) == q.shape(3) && bias.shape() == mx::Shape{q.shape(0), 1, 1, k.shape(2)},
       "decode attention needs q [B, nk, R, D], keys/values [B, nk, S, D], bias [B, 1, 1, S]");
}

array decode_attention(const array& q, const array& k, const array& v, const array& bias) {
  need_attention(q, k, v, bias);
  return make<DecodeAttention>({{q.shape(0), q.shape(1) * q.shape(2) * q.shape(3)}}, {q, k, v, bias})[0];
}

std::vector<array> layer_in(const array& h, std::optional<array> act, std::optional<array> w_down,
                            std::optional<array> b_down, const array& norm_w, float eps, const array& w_qkv,
                            std::optional<array> b_qkv, const array& C, const array& S, const array& F, int nq, int nk,
                            int D, const array& kbuf, const array& vbuf, const array& col, std::optional<array> q_norm,
                            std::optional<array> k_norm, float qk_eps) {
  need(h.ndim() == 2 && norm_w.ndim() == 1 && norm_w.shape(0) == h.shape(1), "layer_in needs h [B, hidden], norm [hidden]");
  const int B = h.shape(0), hid = h.shape(1), N = (nq + 2 * nk) * D;
  need(act.has_value() == w_down.has_value() && (!b_down || act), "layer_in: act and w_down go together");
  std::vector<array> inputs{h};
  std::vector<mx::Shape> shapes;
  if (act) {
    need(act->ndim() == 2 && act->shape(0) == B, "layer_in: act must be [B, F]");
    need_weight(*w_down, act->shape(1), "layer_in: w_down must be [F, hidden]");
    need(w_down->shape(1) == hid && (!b_down || b_down->size() == size_t(hid)), "layer_in: w_down/b_down width");
    inputs.insert(inputs.end(), {*act, *w_down});
    if (b_down) inputs.push_back(*b_down);
    shapes.push_back(h.shape());
  }
  need_weight(w_qkv, hid, "layer_in: w_qkv must be [hidden, (nq + 2 nk) D]");
  need(w_qkv.shape(1) == N && (!b_qkv || b_qkv->size() == size_t(N)), "layer_in: w_qkv/b_qkv width");
  need_rope(size_t(B) * N, C, S, F, B, nq, nk, D);
  need(kbuf.ndim() == 4 && kbuf.shape() == vbuf.shape() && kbuf.shape(0) == B && kbuf.shape(1) == nk &&
           kbuf.shape(3) == D,
       "layer_in: cache buffers must be [B, nk, S, D]");
  need(col.dtype() == mx::int32 && col.size() == 1, "layer_in: col must be int32 [1]");
  inputs.insert(inputs.end(), {norm_w, w_qkv});
  if (b_qkv) inputs.push_back(*b_qkv);
  inputs.insert(inputs.end(), {C, S, F});
  const bool qk = need_qk_norm(q_norm, k_norm, D);
  if (qk) inputs.insert(inputs.end(), {*q_norm, *k_norm});
  inputs.insert(inputs.end(), {kbuf, vbuf, col});
  shapes.insert(shapes.end(), {{B, nk, nq / nk, D}, kbuf.shape(), vbuf.shape()});
  return make<LayerIn>(std::move(shapes), std::move(inputs), eps, bool(act), bool(b_down), bool(b_qkv), nq, nk, D, qk,
                       qk_eps);
}

std::vector<array> layer_mid(const array& q, const array& k, const array& v, const array& bias, const array& w_o,
                             std::optional<array> b_o, const array& h, const array& norm_w, float eps,
                             const array& w_gu, std::optional<array> b_gu) {
  need_attention(q, k, v, bias);
  const int B = q.shape(0), nqD = q.shape(1) * q.shape(2) * q.shape(3);
  need(h.ndim() == 2 && h.shape(0) == B && norm_w.ndim() == 1 && norm_w.shape(0) == h.shape(1),
       "layer_mid needs h [B, hidden], norm [hidden]");
  const int hid = h.shape(1);
  need_weight(w_o, nqD, "layer_mid: w_o must be [nq D, hidden]");
  need(w_o.shape(1) == hid && (!b_o || b_o->size() == size_t(hid)), "layer_mid: w_o/b_o width");
  need_weight(w_gu, hid, "layer_mid: w_gu must be [hidden, 2F]");
  need(w_gu.shape(1) % 2 == 0 && (!b_gu || b_gu->size() == size_t(w_gu.shape(1))), "layer_mid: w_gu/b_gu width");
  std::vector<array> inputs{q, k, v, bias, w_o};
  if (b_o) inputs.push_back(*b_o);
  inputs.insert(inputs.end(), {h, norm_w, w_gu});
  if (b_gu) inputs.push_back(*b_gu);
  return make<LayerMid>({h.shape(), {B, w_gu.shape(1) / 2}}, std::move(inputs), eps, bool(b_o), bool(b_gu));
}

// (in place, copied): how often layer_in wrote a cache buffer in place and into a copy.
std::pair<uint64_t, uint64_t> cache_writes() {
  return {g_donated.load(), g_copied.load()};
}

}  // namespace

NB_MODULE(_mlx_tracer_kernels, m) {
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, nb::arg("x"), nb::arg("r"), nb::arg("weight"), nb::arg("eps"));
  m.def("rope_split", &rope_split, nb::arg("y"), nb::arg("C"), nb::arg("S"), nb::arg("F"), nb::arg("B"), nb::arg("nq"),
        nb::arg("nk"), nb::arg("D"), nb::arg("q_norm").none() = nb::none(), nb::arg("k_norm").none() = nb::none(),
        nb::arg("qk_eps") = 0.0f);
  m.def("swiglu", &swiglu, nb::arg("gu"));
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"));
  m.def("layer_in", &layer_in, nb::arg("h"), nb::arg("act").none(), nb::arg("w_down").none(), nb::arg("b_down").none(),
        nb::arg("norm_w"), nb::arg("eps"), nb::arg("w_qkv"), nb::arg("b_qkv").none(), nb::arg("C"), nb::arg("S"),
        nb::arg("F"), nb::arg("nq"), nb::arg("nk"), nb::arg("D"), nb::arg("kbuf"), nb::arg("vbuf"), nb::arg("col"), nb::arg("q_norm").none() = nb::none(), nb::arg("k_norm").none() = nb::none(), nb::arg("qk_eps") = 0.0f);
  m.def("cache_writes", &cache_writes);
  m.def("layer_mid", &layer_mid, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"), nb::arg("w_o"),
        nb::arg("b_o").none(), nb::arg("h"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("w_gu"), nb::arg("b_gu").none());
}
