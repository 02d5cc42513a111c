// logprobs: x - logsumexp(x, axis=-1) over float32 rows, as one MLX primitive
// with the bits of `x - mx.logsumexp(x, axis=-1, keepdims=True)` on the CPU.
//
// Every decode step turns the head's logits into log-probabilities (mlx-lm
// samples from them, and the loop reports each token's). MLX's CPU
// logsumexp runs its exponentials one lane at a time on this build (no
// -march), about 1 ms of CPU a row of SmolLM2's 49,152 logits, a fifteenth of
// a one-row decode step. Here, per row, as MLX's LogSumExp computes it
// (mlx/backend/cpu/logsumexp.cpp with Simd<float, 1>):
//   m = the running maximum from -inf, NaN-sticky (simd::maximum), in order;
//   n = the sum from 0 of exp(x - m) in order, the exponentials on vector
//       lanes with MLX's bits (vmath_x86.h; MLX's own where the path has none);
//   lse = m where m is infinite, else log(n) + m (std::log, as MLX calls it);
// then each x - lse. Rows run on qmm's pool, one row a task (the same bits on
// any thread). tests/test_logprobs.py checks it against the MLX ops.
//
// greedy_logprobs: a greedy row needs only its pick and that pick's
// log-probability (a decode step's token, a verify window's picks): the same
// lse, then mx.argmax's rule (the first NaN, else the first largest) over
// x - lse, each value computed as logprobs computes it, no row written.

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm_api.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using mx::array;

namespace {

// logsumexp(x) of one row as MLX computes it (see the top); `scratch` [V]
// takes the exponentials on the way.
float row_lse(const float* x, int V, float* scratch) {
  using namespace mx::simd;
  Simd<float, 1> vmax(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < V; ++j) {
    vmax = maximum(Simd<float, 1>(x[j]), vmax);
  }
  const float m = vmax.value;
  Simd<float, 1> total(0.0);
  if (tracer_qmm::exp_shifted(x, m, scratch, V)) {
    for (int j = 0; j < V; ++j) {
      total = total + Simd<float, 1>(scratch[j]);
    }
  } else {
    for (int j = 0; j < V; ++j) {
      total = total + exp(Simd<float, 1>(x[j]) - m);
    }
  }
  return std::isinf(m) ? m : std::log(total.value) + m;
}

void logprobs_row(const float* x, int V, float* out) {
  const float lse = row_lse(x, V, out);  // out holds the exponentials for now
  for (int j = 0; j < V; ++j) {
    out[j] = x[j] - lse;
  }
}

// mx.argmax over the row's log-probabilities x - lse (the first NaN, else the
// first largest: MLX's rule) and that log-probability, without writing the row.
void greedy_row(const float* x, int V, float* scratch, int32_t* token, float* logprob) {
  const float lse = row_lse(x, V, scratch);
  int best = 0;
  float top = x[0] - lse;
  for (int j = 1; j < V && !std::isnan(top); ++j) {
    const float v = x[j] - lse;
    if (v > top || std::isnan(v)) {
      top = v, best = j;
    }
  }
  *token = best;
  *logprob = top;
}

// x's rows [rows, V] on qmm's pool, one row a task (the same bits on any
// thread): the log-softmax (one output like x) or, `greedy`, each row's pick
// and its log-probability (int32 and float32, x's shape without V).
class RowsKernel : public mx::Primitive {
 public:
  RowsKernel(mx::Stream s, bool greedy) : mx::Primitive(s), greedy_(greedy) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    const array& x = in[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      enc.set_output_array(o);
    }
    struct Ctx {
      const float* x;
      char* a;   // the log-probabilities (float) or the picks (int32)
      float* b;  // greedy: the picks' log-probabilities
      int V;
      bool greedy;
    };
    const int V = x.shape(-1), rows = int(x.size() / V);
    const Ctx ctx{x.data<float>(), outputs[0].data<char>(), greedy_ ? outputs[1].data<float>() : nullptr, V, greedy_};
    enc.dispatch([ctx, rows]() {
      tracer_qmm::parallel_for(rows, [](const void* c, int r) {
        const Ctx& t = *static_cast<const Ctx*>(c);
        const float* row = t.x + size_t(r) * t.V;
        if (!t.greedy) {
          logprobs_row(row, t.V, reinterpret_cast<float*>(t.a) + size_t(r) * t.V);
          return;
        }
        thread_local std::vector<float> scratch;
        scratch.resize(size_t(t.V));
        greedy_row(row, t.V, scratch.data(), reinterpret_cast<int32_t*>(t.a) + r, t.b + r);
      }, &ctx);
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer logprobs: CPU only");
  }
  const char* name() const override {
    return greedy_ ? "TracerGreedyLogProbs" : "TracerLogProbs";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const RowsKernel*>(&other);
    return o != nullptr && o->greedy_ == greedy_;
  }

 private:
  bool greedy_;
};

std::vector<array> greedy_logprobs(const array& x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) < 1) {
    throw std::invalid_argument("greedy_logprobs: x must be float32 [..., V] with V >= 1");
  }
  mx::Shape rows(x.shape().begin(), x.shape().end() - 1);
  return array::make_arrays({rows, rows}, {mx::int32, mx::float32},
                            std::make_shared<RowsKernel>(mx::default_stream(mx::Device::cpu), true), {mx::contiguous(x)});
}

array logprobs(const array& x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) < 1) {
    throw std::invalid_argument("logprobs: x must be float32 [..., V] with V >= 1");
  }
  // rows read in place: a row-major copy of anything else (MLX's logsumexp
  // copies likewise; mx::contiguous hands a row-major input on as it is)
  return array(x.shape(), mx::float32, std::make_shared<RowsKernel>(mx::default_stream(mx::Device::cpu), false),
               {mx::contiguous(x)});
}

}  // namespace

void register_logprobs(nb::module_& m) {
  m.def("logprobs", &logprobs, nb::arg("x"),
        "x - logsumexp(x, axis=-1, keepdims=True) for float32 x [..., V], with the bits of those MLX ops on the CPU");
  m.def("greedy_logprobs", &greedy_logprobs, nb::arg("x"),
        "(argmax, log-probability) of each row of float32 x [..., V]: mx.argmax(logprobs(x), -1) as int32 and "
        "logprobs(x) there, the same bits, in one pass that writes no row of log-probabilities");
}
