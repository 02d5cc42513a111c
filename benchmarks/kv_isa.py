"""Decode step time per packed-K/V path (``kv_set_isa``), the paths taking
turns in one process (the same bits on every path; only the time differs).

    python benchmarks/kv_isa.py [--bucket 8] [--context 1024] [--bits 8] [--paths avx2,avx512] [--rounds 12] [--steps 4]

SmolLM2 (the ``quantized`` format) at ``--bucket`` rows over ``--context``
positions of random K/V stored with ``--bits`` (mlx-lm's QuantizedKVCache
layout); each round runs ``--steps`` steps (built and evaluated one by one)
on each path after one untimed step; prints the median ms per path and the
load average. A path the CPU lacks runs the best one below it (said).
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
from mlx_tracer.caches.storage import KVFormat
from mlx_tracer.runtime.step import CompiledModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=8, choices=(4, 8))
    ap.add_argument("--paths", default="avx2,avx512")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    before = K.kv_isa()
    paths = args.paths.split(",")
    for p in paths:
        if K.kv_set_isa(p) != p:
            print(f"this CPU has no {p}: it runs {K.kv_isa()}")
    K.kv_set_isa(before)
    model, label = load_bench_model("smollm2", weights="quantized")
    cm = CompiledModel(model, fuse=True, kv=KVFormat(bits=args.bits))
    build, evaluate = _tracer_steps(cm, [synthetic_context(model, cm.layout, args.context, seed=i)
                                         for i in range(args.bucket)])
    for _ in range(4):  # traces and warm-up
        build()
        evaluate()
    load0 = os.getloadavg()[0]
    times = {p: [] for p in paths}
    try:
        for _ in range(args.rounds):
            for p in paths:
                K.kv_set_isa(p)
                build()
                evaluate()  # the switch's step, untimed
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    build()
                    evaluate()
                    times[p].append(time.perf_counter() - t0)
    finally:
        K.kv_set_isa(before)
    print(f"{label}, {args.bits}-bit K/V, bucket {args.bucket}, {args.context} positions, load average "
          f"{load0:.2f} -> {os.getloadavg()[0]:.2f}: " +
          "  ".join(f"{p} {1e3 * statistics.median(t):.2f} ms" for p, t in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
