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

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

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

void logprobs_row(const float* x, int V, float* out) {
  using namespace mx::simd;
  Simd<float, 1> vmax(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < V; ++j) {
    vmax = maximum(Simd<float, 1>(x[j]), vmax);
  }
  const float m = vmax.value;
  Simd<float, 1> total(0.0);
  if (tracer_qmm::exp_shifted(x, m, out, V)) {  // out holds the exponentials for now
    for (int j = 0; j < V; ++j) {
      total = total + Simd<float, 1>(out[j]);
    }
  } else {
    for (int j = 0; j < V; ++j) {
      total = total + exp(Simd<float, 1>(x[j]) - m);
    }
  }
  const float lse = std::isinf(m) ? m : std::log(total.value) + m;
  for (int j = 0; j < V; ++j) {
    out[j] = x[j] - lse;
  }
}

class LogProbs : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    const array& x = in[0];
    array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_output_array(out);
    const int V = x.shape(-1), rows = int(x.size() / V);
    enc.dispatch([x = x.data<float>(), o = out.data<float>(), V, rows]() {
      struct Ctx {
        const float* x;
        float* o;
        int V;
      } ctx{x, o, V};
      tracer_qmm::parallel_for(rows, [](const void* c, int r) {
        const Ctx& t = *static_cast<const Ctx*>(c);
        logprobs_row(t.x + size_t(r) * t.V, t.V, t.o + size_t(r) * t.V);
      }, &ctx);
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_tracer logprobs: CPU only");
  }
  const char* name() const override {
    return "TracerLogProbs";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return true;
  }
};

array logprobs(const array& x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) < 1) {
    throw std::invalid_argument("logprobs: x must be float32 [..., V] with V >= 1");
  }
  // rows read in place: a row-major copy of anything else (MLX's logsumexp
  // copies likewise; mx::contiguous hands a row-major input on as it is)
  return array(x.shape(), mx::float32, std::make_shared<LogProbs>(mx::default_stream(mx::Device::cpu)),
               {mx::contiguous(x)});
}

}  // namespace

void register_logprobs(nb::module_& m) {
  m.def("logprobs", &logprobs, nb::arg("x"),
        "x - logsumexp(x, axis=-1, keepdims=True) for float32 x [..., V], with the bits of those MLX ops on the CPU");
}
