"""Where a bucket-1 decode step's time goes on a GPU backend: stock mlx-lm's step
against the compiled step, each evaluated before the next (latency, no overlap),
and the attention call alone with and without the boolean mask the static
caches pass, over the live columns and over a capacity.

    python benchmarks/gpu_probe.py MODEL_DIR [--context 128] [--steps 60]

(``benchmarks/gpu_bench.sh`` writes such folders; any mlx-lm folder does.)
"""
import argparse
import statistics
import time

import mlx_tracer  # noqa: F401
import mlx.core as mx


def per_call_ms(fn, n: int, reps: int = 5) -> float:
    """Median over ``reps`` of (one evaluation of ``n`` chained calls) / n."""
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        mx.eval(fn(n))
        out.append(1e3 * (time.perf_counter() - t0) / n)
    return statistics.median(out[1:])


def attention_probe(heads=9, kv_heads=3, dim=64, dtype=mx.bfloat16, layers=30):
    print(f"attention alone, q [1,{heads},1,{dim}], K/V [1,{kv_heads},S,{dim}] {dtype}, {layers} calls chained:")
    for S in (192, 256, 1088, 2048):
        k = mx.random.normal((1, kv_heads, S, dim)).astype(dtype)
        v = mx.random.normal((1, kv_heads, S, dim)).astype(dtype)
        q0 = mx.random.normal((1, heads, 1, dim)).astype(dtype)
        live = S - 64
        mask = (mx.arange(S) < live)[None, None, None, :]
        mx.eval(k, v, q0, mask)

        def chain(n, mask=None, S_used=S):
            q = q0
            kk, vv = k[:, :, :S_used], v[:, :, :S_used]
            for _ in range(n):
                q = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=dim ** -0.5, mask=mask)
            return q

        a = per_call_ms(lambda n: chain(n), layers)
        b = per_call_ms(lambda n: chain(n, mask), layers)
        c = per_call_ms(lambda n: chain(n, None, live), layers)
        print(f"  S={S:5d}: no mask {1e3 * a:7.1f} us, bool mask {1e3 * b:7.1f} us, live columns only ({live}) {1e3 * c:7.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    from mlx_tracer.bench import load_bench_model, synthetic_context
    from mlx_tracer.bench.systems import _stock_steps, _tracer_steps
    from mlx_tracer.runtime.step import CompiledModel

    print("device", mx.default_device(), "mlx", mx.__version__)
    attention_probe()
    model, label = load_bench_model("smollm2", a.model, weights="as-is")
    compiled = CompiledModel(model)
    ctx = synthetic_context(model, compiled.layout, a.context)
    print(f"{label}: context {a.context}")
    systems = {"stock": _stock_steps(model, [ctx]), "tracer": _tracer_steps(compiled, [ctx])}
    for build, evaluate in systems.values():  # traces, kernel builds
        for _ in range(3):
            build()
            evaluate()
    times = {k: [] for k in systems}
    for _ in range(a.steps // 10):
        for name, (build, evaluate) in systems.items():
            for _ in range(10):
                t0 = time.perf_counter()
                build()
                t1 = time.perf_counter()
                evaluate()
                times[name].append((1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0)))
    for name, t in times.items():
        print(f"{name:7s} step: build {statistics.median(x for x, _ in t):.2f} ms, "
              f"build + evaluate {statistics.median(y for _, y in t):.2f} ms (median of {len(t)})")


if __name__ == "__main__":
    main()
