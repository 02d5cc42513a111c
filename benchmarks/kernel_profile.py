"""Where a compiled decode step's time goes, per native kernel phase.

    MLX_TRACER_KERNEL_PROFILE=1 python benchmarks/kernel_profile.py [B=1] [CTX=128] [WEIGHTS=quantized] [--steps 40] [--kv-dtype float16 | --kv-bits 8] [--window L] [--model PATH]

SmolLM2 (or the GGUF / mlx-lm folder at --model) at bucket B over CTX positions; each step built and evaluated before
the next (no pipelining: the step median includes the host's build). Prints
the step median and, per phase of the layer kernels (``kernels.profile()``)
and for the qmm primitive's tasks (the output head and the last layer's
down projection, ``kernels.qmm_profile()``), ms and calls per step. Without
MLX_TRACER_KERNEL_PROFILE=1 the phases read zero (the timers are off).
With ``--window L``: speculative verify steps of L tokens a row (no draft
accepted: the caches advance one column a step, as a decode step's) taking
turns with decode steps on the same caches; the phases of each kind apart,
and a verify step's median over a decode step's.
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
    ap.add_argument("--kv-bits", type=int, default=None, help="store K/V quantized to 4 or 8 bits (mlx-lm's layout)")
    ap.add_argument("--window", type=int, default=0, help="profile verify windows of this many tokens a row too")
    ap.add_argument("--model", default=None, help="a GGUF file or mlx-lm folder instead of SmolLM2")
    args = ap.parse_args()
    if args.window == 1 or args.window < 0:
        ap.error("--window takes L >= 2 (a row's last token and at least one draft)")
    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    model, label = load_bench_model("smollm2", path=args.model, weights=args.weights)
    compiled = CompiledModel(model, kv=check_kv(kv_bits=args.kv_bits, kv_dtype=args.kv_dtype))
    build, evaluate, verify, _ = _tracer_steps(compiled, [synthetic_context(model, compiled.layout, args.context)]
                                               * args.bucket, windows=True)
    kinds = {"decode": lambda: (build(), evaluate())}
    if args.window:
        kinds["verify"] = lambda: verify(args.window)
    for _ in range(5):  # traces and warm-up
        for run in kinds.values():
            run()
    steps = {kind: [] for kind in kinds}
    phases = {kind: {} for kind in kinds}
    for _ in range(args.steps):
        for kind, run in kinds.items():
            K.profile(True), K.qmm_profile()
            t0 = time.perf_counter()
            run()
            steps[kind].append(time.perf_counter() - t0)
            got = K.profile(True)
            got["qmm_primitive"] = K.qmm_profile()
            for name, (ns, calls) in got.items():
                total = phases[kind].setdefault(name, [0, 0])
                total[0], total[1] = total[0] + ns, total[1] + calls
    kv_label = f"{args.kv_bits}-bit" if args.kv_bits else args.kv_dtype or "model dtype"
    print(f"{label} B{args.bucket} ctx{args.context} K/V {kv_label}, attention "
          f"{K.attention_mode()}, load average {os.getloadavg()[0]:.2f}")
    median = {kind: statistics.median(t) for kind, t in steps.items()}
    for kind in kinds:
        what = "decode step (built and evaluated)" if kind == "decode" else f"verify step, window {args.window}"
        extra = f", {median[kind] / median['decode']:.2f} decode steps" if kind != "decode" else ""
        print(f" {what}: median {1e3 * median[kind]:.2f} ms{extra}")
        for name, (ns, calls) in phases[kind].items():
            print(f"  {name:16s} {ns / 1e6 / args.steps:7.3f} ms/step {calls / args.steps:6.1f} calls/step")
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
