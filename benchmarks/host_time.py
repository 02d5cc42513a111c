"""Host ms per decode step, stock mlx-lm's graph build against the compiled
step, in a fresh process that does nothing else first (the bench measures the
same thing after its decode runs, in a process that has done much more).

    python benchmarks/host_time.py [--bucket 1] [--context 128] [--steps 40] [--reps 3] [--stock-runs 0] [--clear-cache]

Each rep is :func:`mlx_tracer.bench.host_ms`: one loop in which the systems
take turns every 8 steps (the step after a switch untimed), each step
evaluated before the next is timed; medians per rep. ``--stock-runs N`` first
decodes 32 tokens N times with stock mlx-lm (its ``generate_step``, as the
bench does before its host column), then measures again, and also the
tracer's step timed alone. ``--clear-cache`` calls ``mx.clear_cache()`` (as
mlx-lm's ``generate_step`` does) and measures again, in turns and the
tracer's step alone. With single-step turns (0.3.1's bench) the tracer's
step cost about 1.5x after it; alone it did not (see ``docs/design.md``,
"Host time per step").
"""

from __future__ import annotations

import argparse
import os
import statistics

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_tracer.bench import host_ms, load_bench_model, synthetic_context, stock_decode, tracer_host_ms
from mlx_tracer.runtime.step import CompiledModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--weights", default="float32")
    ap.add_argument("--stock-runs", type=int, default=0)
    ap.add_argument("--clear-cache", action="store_true", help="then measure again after mx.clear_cache()")
    args = ap.parse_args()
    model, label = load_bench_model("smollm2", weights=args.weights)
    compiled = CompiledModel(model)
    contexts = [synthetic_context(model, compiled.layout, args.context)] * args.bucket
    print(f"{label}, bucket {args.bucket}, context {args.context}; load average {os.getloadavg()[0]:.2f} before")

    def measure(label):
        ratios = []
        for rep in range(args.reps):
            stock, tracer = host_ms(model, compiled, contexts, steps=args.steps)
            ratios.append(tracer / stock)
            print(f"{label} rep {rep + 1}: stock {stock:.2f} ms, tracer {tracer:.2f} ms, tracer/stock {tracer / stock:.2f}")
        print(f"{label} median tracer/stock {statistics.median(ratios):.2f}")

    measure("fresh")
    if args.clear_cache:
        mx.clear_cache()
        measure("after mx.clear_cache()")
        alone = [tracer_host_ms(compiled, contexts, steps=args.steps) for _ in range(args.reps)]
        print("after mx.clear_cache(), tracer alone: " + ", ".join(f"{t:.2f} ms" for t in alone))
    if args.stock_runs:
        for _ in range(args.stock_runs):
            stock_decode(model, contexts, [3] * args.bucket, 32)
        measure("after stock decode")
        alone = [tracer_host_ms(compiled, contexts, steps=args.steps) for _ in range(args.reps)]
        print("after stock decode, tracer alone: " + ", ".join(f"{t:.2f} ms" for t in alone))
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
