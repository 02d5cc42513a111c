"""Where a compiled decode step's time goes, per native kernel phase.

    MLX_TRACER_KERNEL_PROFILE=1 python benchmarks/kernel_profile.py [B=1] [CTX=128] [WEIGHTS=quantized] [--steps 40] [--kv-dtype float16]

SmolLM2 at bucket B over CTX positions; each step built and evaluated before
the next (no pipelining: the step median includes the host's build). Prints
the step median and, per phase of the layer kernels (``kernels.profile()``)
and for the qmm primitive's tasks (the output head and the last layer's
down projection, ``kernels.qmm_profile()``), ms and calls per step. Without
MLX_TRACER_KERNEL_PROFILE=1 the phases read zero (the timers are off).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
from mlx_tracer.backend import kernels
from mlx_tracer.bench import load_bench_model, synthetic_context
from mlx_tracer.bench.systems import _tracer_steps
from mlx_tracer.runtime.options import check_kv
from mlx_tracer.runtime.step import CompiledModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bucket", type=int, nargs="?", default=1)
    ap.add_argument("context", type=int, nargs="?", default=128)
    ap.add_argument("weights", nargs="?", default="quantized")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kv-dtype", default=None, help="store K/V as float16/bfloat16 (default: the model's dtype)")
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    model, label = load_bench_model("smollm2", weights=args.weights)
    compiled = CompiledModel(model, kv=check_kv(kv_dtype=args.kv_dtype))
    build, evaluate = _tracer_steps(compiled, [synthetic_context(model, compiled.layout, args.context)] * args.bucket)
    for _ in range(5):  # traces and warm-up
        build()
        evaluate()
    K.profile(True), K.qmm_profile()
    steps, builds = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        build()
        t1 = time.perf_counter()
        evaluate()
        steps.append(time.perf_counter() - t0)
        builds.append(t1 - t0)
    phases = K.profile(True)
    phases["qmm_primitive"] = K.qmm_profile()
    print(f"{label} B{args.bucket} ctx{args.context} K/V {args.kv_dtype or 'model dtype'}, attention "
          f"{K.attention_mode()}, load average {os.getloadavg()[0]:.2f}: step median "
          f"{1e3 * statistics.median(steps):.2f} ms, build {1e3 * statistics.median(builds):.2f} ms")
    for name, (ns, calls) in phases.items():
        print(f"  {name:16s} {ns / 1e6 / args.steps:7.3f} ms/step {calls / args.steps:6.1f} calls/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
