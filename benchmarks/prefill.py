"""Prefill speed of one prompt of N tokens, one row, as `mlx-tracer generate` runs it.

    python benchmarks/prefill.py [--model FILE] [--tokens 512] [--runs 3] [--weights quantized] [--kv-dtype float16]

The prompt is N token ids (no chat template); each run prefills it and
decodes one token, after a first run that traces the windows and builds the
kernels. Prints the engine's prefill tokens/s per run and their median, and
the load average. The peer figure on the same file and threads:
``../shared/peers/llamacpp_bench_native.py --model FILE --threads 2 --buckets 1
--contexts 128 --tokens 4 --runs 3 --prefill-tokens 512`` (run them in turns).
"""

from __future__ import annotations

import argparse
import os
import statistics

import mlx_tracer  # noqa: F401  (first: it binds the fast BLAS before mlx loads)
from mlx_tracer import Generator


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file or mlx-lm folder (default: SmolLM2)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--weights", default="quantized")
    ap.add_argument("--kv-dtype", default="float16")
    args = ap.parse_args()
    gen = Generator.load(args.model, weights=args.weights, kv_dtype=args.kv_dtype, progress=False)
    vocab = gen.engine.compiled.vocab_size
    ids = [(i * 7919) % (vocab - 200) + 100 for i in range(args.tokens)]
    load = os.getloadavg()[0]
    gen.generate(ids, max_tokens=1, chat=False)
    rates = []
    for _ in range(args.runs):
        gen.engine.reset_stats()
        gen.generate(ids, max_tokens=1, chat=False)
        rates.append(gen.stats.prefill_tps)
        print(f"prefill {gen.stats.prefill_tokens} tokens: {rates[-1]:.1f} tok/s", flush=True)
    print(f"median {statistics.median(rates):.1f} tok/s ({args.weights}, K/V {args.kv_dtype}); "
          f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    raise SystemExit(main())
