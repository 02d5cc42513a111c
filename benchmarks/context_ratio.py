"""Decode at a long context over decode at a short one, per bucket, the two
taking turns in one process (the K/V issue's goal: the 1024-position rows at
least 0.8x the 128-position rows).

    python benchmarks/context_ratio.py [--kv-dtype float16 | --kv-bits 8] [--buckets 1 4 8]
                                       [--contexts 128 1024] [--tokens 32] [--reps 5] [--weights quantized-split]

The bench (``mlx-tracer bench``) runs every bucket of one context before
the next context, minutes apart; this machine's speed drifts 1.2-1.4x within
minutes, which moves a ratio of two of its rows by as much. Here each rep
decodes ``--tokens`` tokens a row at the short context and then at the long
one on the same engine (the bench's synthetic contexts and its
``tracer_decode``: the engine's decode tokens/s, admission excluded), and a
bucket's ratio is the median short and long tokens/s's; the pairs' ratios
are printed too. SmolLM2, the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", default=None, help="store K/V as float16/bfloat16 (default: the model's dtype)")
    ap.add_argument("--kv-bits", type=int, default=None, help="store K/V quantized to 4 or 8 bits (mlx-lm's layout)")
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--contexts", type=int, nargs=2, default=[128, 1024], metavar=("SHORT", "LONG"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--weights", default="quantized-split", help="weight format (as `mlx-tracer generate --weights`)")
    args = ap.parse_args()
    if args.reps < 1 or args.tokens < 1 or min(args.buckets) < 1:
        ap.error("--reps, --tokens and --buckets take positive numbers")
    import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
    from mlx_tracer.bench import load_bench_model, synthetic_context, tracer_decode
    from mlx_tracer.runtime.engine import Engine
    from mlx_tracer.runtime.options import check_kv
    from mlx_tracer.runtime.step import CompiledModel

    kv = check_kv(kv_bits=args.kv_bits, kv_dtype=args.kv_dtype)
    model, label = load_bench_model("smollm2", weights=args.weights)
    compiled = CompiledModel(model, kv=kv)
    short, long_ = args.contexts
    contexts = {C: synthetic_context(model, compiled.layout, C) for C in (short, long_)}
    kv_name = f"{args.kv_bits}-bit" if args.kv_bits else (args.kv_dtype or "the model's dtype")
    print(f"{label}, K/V {kv_name}, {args.tokens} tokens a row, {args.reps} reps, "
          f"load average {os.getloadavg()[0]:.2f} before")
    print(f"{'B':>3} {short:>8} {long_:>8}  ratio  pairs (tok/s, {long_} over {short})")
    for B in args.buckets:
        engine = Engine(compiled, buckets=(B,))
        first = [(7 * i + 3) % compiled.vocab_size for i in range(B)]
        for C in (short, long_):  # traces and warm-up
            tracer_decode(engine, [contexts[C]] * B, first, 4)
        tps = {short: [], long_: []}
        for _ in range(args.reps):
            for C in (short, long_):
                tps[C].append(tracer_decode(engine, [contexts[C]] * B, first, args.tokens).decode_tps)
        s, l = statistics.median(tps[short]), statistics.median(tps[long_])
        pairs = " ".join(f"{b / a:.2f}" for a, b in zip(tps[short], tps[long_]))
        print(f"{B:>3} {s:8.1f} {l:8.1f}  {l / s:5.2f}  {pairs}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
