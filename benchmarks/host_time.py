"""Host ms per decode step, stock mlx-lm's graph build against the compiled
step, in a fresh process that does nothing else first (the bench measures the
same thing after its decode runs, in a process that has done much more).

    python benchmarks/host_time.py [--bucket 1] [--context 128] [--steps 40] [--reps 3]

Each rep is :func:`mlx_tracer.bench.host_ms`: one loop alternating a stock and
a tracer step, each evaluated before the next is timed; medians per rep.
"""

from __future__ import annotations

import argparse
import os
import statistics

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
from mlx_tracer.bench import host_ms, load_bench_model, synthetic_context
from mlx_tracer.runtime.step import CompiledModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--weights", default="float32")
    args = ap.parse_args()
    model, label = load_bench_model("smollm2", weights=args.weights)
    compiled = CompiledModel(model)
    contexts = [synthetic_context(model, compiled.layouts, args.context)] * args.bucket
    print(f"{label}, bucket {args.bucket}, context {args.context}; load average {os.getloadavg()[0]:.2f} before")
    ratios = []
    for rep in range(args.reps):
        stock, tracer = host_ms(model, compiled, contexts, steps=args.steps)
        ratios.append(tracer / stock)
        print(f"rep {rep + 1}: stock {stock:.2f} ms, tracer {tracer:.2f} ms, tracer/stock {tracer / stock:.2f}")
    print(f"median tracer/stock {statistics.median(ratios):.2f}; load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
