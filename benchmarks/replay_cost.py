"""What one replayed graph node costs the host, measured the way a decode
step pays it: right after a real step's evaluation has streamed the weights
through the CPU's caches.

    python benchmarks/replay_cost.py [--steps 30] [--context 128]

Between real SmolLM2 decode steps (bucket 1, each evaluated), it calls
compiled chains of ``n`` cheap nodes (reshapes, one input) and times each
call until it returns, before evaluation. A least-squares line through the
chain medians gives the host cost per node and per call. The compiled decode
step (``CompiledModel.step``, timed as the bench times it) runs in the same
loop, for comparison with what the line predicts from its node count alone
(a replayed step's graph, compile's fusions applied, counted with
``mx.export_to_dot``; the rest is its inputs, outputs and Python). The
projections subtract the line's cost of the nodes a smaller decode graph
would not have; the last line times the parts of a step (the same loop
through ``CompiledModel``'s internals).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_tracer.bench import load_bench_model, synthetic_context
from mlx_tracer.bench.systems import _tracer_steps
from mlx_tracer.runtime.step import CompiledModel

SIZES = (1, 250, 500, 1000)


def chain(n: int):
    """A compiled function of ``n`` reshape nodes on one small input."""

    def f(x):
        for i in range(n):
            x = x.reshape(-1) if i % 2 == 0 else x.reshape(4, 4)
        return x

    return mx.compile(f)


def graph_nodes(*outputs) -> int:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, *outputs)
        with open(path) as f:
            return len(re.findall(r'label ="[A-Za-z_0-9]+', f.read()))


def parts(compiled, contexts, steps: int):
    """Median ms of the parts of ``CompiledModel.step`` (decode, bucket 1),
    each step evaluated before the next, in the order the step runs them: its
    checks, the family plans, the caches' fit, the weight watch, the compiled
    call and the caches' bookkeeping (the call's arguments dropped before the
    evaluation, as the step drops them, so the buffers are written in place)."""
    from mlx_tracer.bench.models import copy_caches
    from mlx_tracer.caches.batch import StaticKVCache

    layout = compiled.layout
    serial = copy_caches(contexts[0])
    caches = [lay.cache_class.join([serial[i]], width=1, capacities=compiled.capacities) for i, lay in enumerate(layout)]
    y = mx.zeros((1, 1), dtype=mx.int32)
    fn = compiled._compiled("decode", "greedy", False)
    spans = {k: [] for k in ("check", "plan", "fit", "weight watch", "compiled call", "commit", "whole step")}
    for i in range(steps + 1):
        t = [time.perf_counter()]
        tokens = compiled._check(caches, y)
        t.append(time.perf_counter())
        plans = [caches[j].plan(1) for j in layout.representatives]
        t.append(time.perf_counter())
        kv = [caches[j].fit(plans[f]) for j, f in enumerate(layout.family_of)]
        t.append(time.perf_counter())
        if compiled.lean is not None:
            compiled.lean.refresh()
        t.append(time.perf_counter())
        out, new_kv = fn(tokens, plans[0].offsets, [p.arrays for p in plans], kv, {})
        del kv
        t.append(time.perf_counter())
        StaticKVCache.commit_all(caches, [plans[f] for f in layout.family_of], new_kv)
        t.append(time.perf_counter())
        y = out["tokens"][:, None]
        del out, new_kv
        mx.eval(y, [c.state for c in caches])
        if i:  # the first call may trace
            for k, a, b in zip(spans, t, t[1:]):
                spans[k].append(b - a)
            spans["whole step"].append(t[-1] - t[0])
    print("parts of a step: " + ", ".join(f"{k} {1e3 * statistics.median(v):.3f}" for k, v in spans.items()) + " ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed calls per chain size")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--weights", default="float32")
    args = ap.parse_args()
    model, label = load_bench_model("smollm2", weights=args.weights)
    compiled = CompiledModel(model)
    contexts = [synthetic_context(model, compiled.layout, args.context)]
    build, evaluate = _tracer_steps(compiled, contexts)
    print(f"{label}, bucket 1, context {args.context}; load average {os.getloadavg()[0]:.2f} before")

    x = mx.ones((4, 4))
    chains = {n: chain(n) for n in SIZES}
    for c in chains.values():  # trace each once
        mx.eval(c(x))
    build()
    evaluate()
    times = {n: [] for n in SIZES}
    step_times = []
    for i in range(args.steps * len(SIZES)):
        t0 = time.perf_counter()
        build()  # the real step: host time of its whole call, as the bench times it
        step_times.append(time.perf_counter() - t0)
        evaluate()
        n = SIZES[i % len(SIZES)]
        t0 = time.perf_counter()
        out = chains[n](x)
        times[n].append(time.perf_counter() - t0)
        mx.eval(out)

    med = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    xs, ys = list(med), list(med.values())
    xm, ym = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((a - xm) * (b - ym) for a, b in zip(xs, ys)) / sum((a - xm) ** 2 for a in xs)
    base = ym - slope * xm
    for n in SIZES:
        print(f"chain of {n:5d} nodes: {med[n]:.3f} ms per call")
    print(f"fit: {1e3 * slope:.2f} us per node + {base:.3f} ms per call")

    caches = compiled.new_caches(1, rows=1)
    mx.eval(compiled.step(caches, mx.zeros((1, 1), dtype=mx.int32)).arrays(), [c.state for c in caches])
    result = compiled.step(caches, mx.zeros((1, 1), dtype=mx.int32))  # a replay, not evaluated: its graph
    nodes = graph_nodes(*result.arrays(), *[a for c in caches for a in c.state])
    layers = len(compiled.layout)
    step = 1e3 * statistics.median(step_times)
    print(f"compiled decode step ({nodes} nodes, {layers} layers): {step:.3f} ms per step "
          f"(the fit predicts {base + slope * nodes:.3f} ms for its nodes alone)")
    for part in (0.75, 0.5, 1 / 3):
        n = round(nodes * part)
        print(f"  with {n} nodes ({n / layers:.1f} per layer): {step - slope * (nodes - n):.3f} ms projected")
    parts(compiled, contexts, args.steps)
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
