"""Decode with quantized K/V, the vector attention's two arithmetics on packed
blocks of one group a row taking turns in one process: ``factored`` (the
default) against ``dequantized`` (``kernels.packed_attention``).

    python benchmarks/packed_attention.py [--kv-bits 8] [--context 1024] [--buckets 1 4 8] [--tokens 32] [--reps 5]

SmolLM2 (split weights), the bench's synthetic context and its
``tracer_decode`` (the engine's decode tokens/s); per bucket the medians,
their ratio and each pair's; the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-bits", type=int, default=8, choices=(4, 8))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.reps < 1 or args.tokens < 1 or args.context < 1 or min(args.buckets) < 1:
        ap.error("--reps, --tokens, --context and --buckets take positive numbers")
    import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
    from mlx_tracer.backend import kernels
    from mlx_tracer.bench import load_bench_model, synthetic_context, tracer_decode
    from mlx_tracer.runtime.engine import Engine
    from mlx_tracer.runtime.options import check_kv
    from mlx_tracer.runtime.step import CompiledModel

    K = kernels.load()
    if K is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    model, label = load_bench_model("smollm2", weights="quantized-split")
    compiled = CompiledModel(model, kv=check_kv(kv_bits=args.kv_bits, kv_dtype=None))
    ctx = synthetic_context(model, compiled.layout, args.context)
    before = K.packed_attention()
    print(f"{label}, {args.kv_bits}-bit K/V, {args.context} positions, {args.tokens} tokens a row, {args.reps} reps, "
          f"load average {os.getloadavg()[0]:.2f} before")
    try:
        for B in args.buckets:
            engine = Engine(compiled, buckets=(B,))
            first = [(7 * i + 3) % compiled.vocab_size for i in range(B)]
            tracer_decode(engine, [ctx] * B, first, 4)  # traces and warm-up
            tps = {"factored": [], "dequantized": []}
            for _ in range(args.reps):
                for mode in tps:
                    K.packed_attention(mode)
                    tps[mode].append(tracer_decode(engine, [ctx] * B, first, args.tokens).decode_tps)
            f, d = statistics.median(tps["factored"]), statistics.median(tps["dequantized"])
            pairs = " ".join(f"{a / b:.2f}" for a, b in zip(tps["factored"], tps["dequantized"]))
            print(f"B{B}: factored {f:.1f}, dequantized {d:.1f} tok/s: {f / d:.2f}x (pairs {pairs})", flush=True)
    finally:
        K.packed_attention(before)
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
