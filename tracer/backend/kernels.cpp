// CPU kernels for the lean decode forward, as MLX primitives.
//
// Each kernel is one node of a compiled step's graph where MLX's CPU backend
// needs several (its mx.fast ops run their multi-node fallbacks on the CPU).
// Every kernel computes *the same bits* as the nodes it replaces: the same
// functors (MLX's own headers, the ones its CPU compiler JIT-builds fused
// kernels from), in the same order, compiled with the same flags
// (-std=c++17 -O3, and -mavx2 -mfma -mf16c where the CPU has them), and a row
// sum added in order from zero as MLX's reduction does on x86 (one lane).
// tests/test_kernels.py checks each against the MLX ops, bit for bit.
//
// Built and loaded by mlx_tracer/backend/kernels.py (see there).

#include <cstring>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/compiled_preamble.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using mx::array;
using mx::detail::Add;
using mx::detail::Multiply;
using mx::detail::Rsqrt;
using mx::detail::Sigmoid;
using mx::detail::Square;

namespace {

// A row-contiguous copy of `a` when it is not one already (strided views).
array dense(const array& a, std::vector<array>& temps) {
  if (a.flags().row_contiguous) {
    return a;
  }
  array out(a.shape(), a.dtype(), nullptr, {});
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const float* src = a.data<float>();
  float* dst = out.data<float>();
  const int nd = a.ndim();
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) {
      off += int64_t(idx[d]) * a.strides()[d];
    }
    dst[i] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) {
        break;
      }
      idx[d] = 0;
    }
  }
  temps.push_back(out);
  return out;
}

void alloc(std::vector<array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
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

// ------------------------------------------------------------------ RMSNorm
// (x [+ r]) * rsqrt(mean((x [+ r])^2) + eps) * w over the last axis, as
// mx.fast.rms_norm's CPU fallback computes it (and the lean forward's
// residual norm): outputs the sum x + r (when r is given) and the norm.
class RMSNormResidual : public mx::Primitive {
 public:
  RMSNormResidual(mx::Stream s, float eps, bool residual) : mx::Primitive(s), eps_(eps), residual_(residual) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    std::vector<array> temps;
    array x = dense(inputs[0], temps);
    array r = residual_ ? dense(inputs[1], temps) : x;
    array w = dense(inputs[residual_ ? 2 : 1], temps);
    alloc(outputs);
    array s = residual_ ? outputs[0] : x;
    array y = outputs[residual_ ? 1 : 0];
    const int n = x.shape(-1);
    const size_t rows = x.size() / n;
    const float inv = static_cast<float>(1.0 / n);
    const float eps = eps_;
    const bool residual = residual_;
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.add_temporaries(std::move(temps));
    enc.dispatch([x, r, w, s, y, n, rows, inv, eps, residual]() mutable {
      const float* xp = x.data<float>();
      const float* rp = r.data<float>();
      const float* wp = w.data<float>();
      float* sp = s.data<float>();
      float* yp = y.data<float>();
      for (size_t i = 0; i < rows; ++i) {
        const float* xi = xp + i * n;
        float* si = sp + i * n;
        if (residual) {
          const float* ri = rp + i * n;
          for (int j = 0; j < n; ++j) {
            si[j] = Add()(xi[j], ri[j]);
          }
        }
        const float* t = residual ? si : xi;
        float ms = sum_of_squares(t, n);
        float* yi = yp + i * n;
        for (int j = 0; j < n; ++j) {
          float tmp_L = Multiply()(ms, inv);
          float tmp_N = Add()(tmp_L, eps);
          float tmp_O = Rsqrt()(tmp_N);
          float tmp_Q = Multiply()(t[j], tmp_O);
          yi[j] = Multiply()(tmp_Q, wp[j]);
        }
      }
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer kernels: CPU only");
  }
  const char* name() const override {
    return residual_ ? "TracerAddRMSNorm" : "TracerRMSNorm";
  }

 private:
  float eps_;
  bool residual_;
};

// -------------------------------------------------------------------- RoPE
// y [M, H * D] (the q/k/v projection of M = B rows, one token each) rotated
// head by head as ((x * C) + (x_swapped * S)) * F, x_swapped the two halves
// of the head exchanged, C/S [M * H, D] and F [M * H, 1] the tables of the
// lean forward (values carry C = 1, S = 0, F = 1): written out as q
// [B, nk, R, D], k [B, nk, 1, D], v [B, nk, 1, D].
class RopeSplit : public mx::Primitive {
 public:
  RopeSplit(mx::Stream s, int nq, int nk, int D) : mx::Primitive(s), nq_(nq), nk_(nk), D_(D) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    std::vector<array> temps;
    array y = dense(inputs[0], temps), C = dense(inputs[1], temps), S = dense(inputs[2], temps), F = dense(inputs[3], temps);
    alloc(outputs);
    array q = outputs[0], k = outputs[1], v = outputs[2];
    const int nq = nq_, nk = nk_, D = D_, H = nq + 2 * nk, half = D / 2;
    const size_t M = y.size() / (size_t(H) * D);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.add_temporaries(std::move(temps));
    enc.dispatch([y, C, S, F, q, k, v, nq, nk, D, H, half, M]() mutable {
      const float* yp = y.data<float>();
      const float* cp = C.data<float>();
      const float* sp = S.data<float>();
      const float* fp = F.data<float>();
      float* outs[3] = {q.data<float>(), k.data<float>(), v.data<float>()};
      for (size_t m = 0; m < M; ++m) {
        for (int h = 0; h < H; ++h) {
          const float* x = yp + (m * H + h) * D;
          const size_t row = m * H + h;
          const float* c = cp + row * D;
          const float* s = sp + row * D;
          const float f = fp[row];
          float* o;
          if (h < nq) {
            o = outs[0] + (m * nq + h) * D;
          } else if (h < nq + nk) {
            o = outs[1] + (m * nk + (h - nq)) * D;
          } else {
            o = outs[2] + (m * nk + (h - nq - nk)) * D;
          }
          for (int j = 0; j < D; ++j) {
            float tmp_A = x[j];
            float tmp_B = c[j];
            float tmp_C = x[j < half ? j + half : j - half];
            float tmp_D = s[j];
            float tmp_F = Multiply()(tmp_A, tmp_B);
            float tmp_G = Multiply()(tmp_C, tmp_D);
            float tmp_H = Add()(tmp_F, tmp_G);
            o[j] = Multiply()(tmp_H, f);
          }
        }
      }
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer kernels: CPU only");
  }
  const char* name() const override {
    return "TracerRopeSplit";
  }

 private:
  int nq_, nk_, D_;
};

// ------------------------------------------------------------------ SwiGLU
// gu [M, 2F] -> silu(gate) * up [M, F], gate = gu[:, :F], up = gu[:, F:].
class SwiGLU : public mx::Primitive {
 public:
  explicit SwiGLU(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    std::vector<array> temps;
    array gu = dense(inputs[0], temps);
    alloc(outputs);
    array out = outputs[0];
    const int F = out.shape(-1);
    const size_t M = out.size() / F;
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.add_temporaries(std::move(temps));
    enc.dispatch([gu, out, F, M]() mutable {
      const float* g = gu.data<float>();
      float* o = out.data<float>();
      for (size_t m = 0; m < M; ++m) {
        const float* A = g + m * 2 * F;
        const float* B = A + F;
        float* C = o + m * F;
        for (int i = 0; i < F; ++i) {
          float tmp_A = A[i];
          float tmp_B = B[i];
          float tmp_D = Sigmoid()(tmp_A);
          float tmp_E = Multiply()(tmp_A, tmp_D);
          C[i] = Multiply()(tmp_E, tmp_B);
        }
      }
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer kernels: CPU only");
  }
  const char* name() const override {
    return "TracerSwiGLU";
  }
};

void need_f32(const array& a, const char* what) {
  if (a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("mlx_tracer kernels: ") + what + " must be float32");
  }
}

mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device::cpu);
}

std::vector<array> rms_norm(const array& x, const array& w, float eps) {
  need_f32(x, "x");
  need_f32(w, "weight");
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("mlx_tracer kernels: rms_norm weight must be [x.shape[-1]]");
  }
  return array::make_arrays({x.shape()}, {mx::float32}, std::make_shared<RMSNormResidual>(cpu_stream(), eps, false), {x, w});
}

std::vector<array> add_rms_norm(const array& x, const array& r, const array& w, float eps) {
  need_f32(x, "x");
  need_f32(r, "residual");
  need_f32(w, "weight");
  if (x.shape() != r.shape() || w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("mlx_tracer kernels: add_rms_norm needs x and r of one shape, weight [x.shape[-1]]");
  }
  return array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                            std::make_shared<RMSNormResidual>(cpu_stream(), eps, true), {x, r, w});
}

std::vector<array> rope_split(const array& y, const array& C, const array& S, const array& F, int B, int nq, int nk, int D) {
  for (auto* a : {&y, &C, &S, &F}) {
    need_f32(*a, "rope input");
  }
  const int H = nq + 2 * nk;
  if (nq % nk || D % 2 || y.size() != size_t(B) * H * D || C.size() != y.size() || S.size() != y.size() ||
      F.size() != size_t(B) * H) {
    throw std::invalid_argument("mlx_tracer kernels: rope_split shapes do not match");
  }
  const int R = nq / nk;
  return array::make_arrays({{B, nk, R, D}, {B, nk, 1, D}, {B, nk, 1, D}}, {mx::float32, mx::float32, mx::float32},
                            std::make_shared<RopeSplit>(cpu_stream(), nq, nk, D), {y, C, S, F});
}

array swiglu(const array& gu) {
  need_f32(gu, "gate/up");
  if (gu.ndim() != 2 || gu.shape(1) % 2) {
    throw std::invalid_argument("mlx_tracer kernels: swiglu needs [M, 2F]");
  }
  return array::make_arrays({{gu.shape(0), gu.shape(1) / 2}}, {mx::float32}, std::make_shared<SwiGLU>(cpu_stream()), {gu})[0];
}

}  // namespace

NB_MODULE(_mlx_tracer_kernels, m) {
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, nb::arg("x"), nb::arg("r"), nb::arg("weight"), nb::arg("eps"));
  m.def("rope_split", &rope_split, nb::arg("y"), nb::arg("C"), nb::arg("S"), nb::arg("F"), nb::arg("B"), nb::arg("nq"),
        nb::arg("nk"), nb::arg("D"));
  m.def("swiglu", &swiglu, nb::arg("gu"));
}
