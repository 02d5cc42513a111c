"""Plain compiled decode against batched speculative decoding (prompt lookup)
on SmolLM2, greedy: tokens/s of the same requests, interleaved runs.

    python benchmarks/speculative.py [--k 4] [--tokens 64] [--reps 3] [--weights quantized] [--buckets 1 4]

Two workloads: text that quotes its prompt (where prompt lookup finds
drafts) and free text (where it mostly does not). Checks that both systems
emit the same tokens, and prints the acceptance, tokens per verify step (all
rows together), the verify steps of the last rep, the cost of a verify step
of each window length the policy tried against a decode step of the same
bucket (the speculator's own smoothed timings; plain steps pipelined as it
runs them) and the load average. The measuring is
``mlx_tracer.bench.speculative`` (also ``mlx-tracer bench --spec``).
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--weights", default="quantized", help="weight format (as `mlx-tracer generate --weights`)")
    ap.add_argument("--policy", default="auto", help="spec_policy (auto or always)")
    args = ap.parse_args()
    import mlx_tracer  # noqa: F401  (the fast BLAS binds before mlx)
    from mlx_tracer import Generator
    from mlx_tracer.bench import SPEC_HEADER, format_spec_row, spec_rows

    plain = Generator.load(weights=args.weights)
    load0 = os.getloadavg()[0]
    print(f"weights {args.weights}, policy {args.policy}")
    print(SPEC_HEADER)
    spec_rows(plain, args.buckets, args.k, args.tokens, args.reps, args.policy,
              on_row=lambda r: print(format_spec_row(r), flush=True))
    print(f"load average (1 min): {load0:.2f} before, {os.getloadavg()[0]:.2f} after; k = {args.k}, {args.tokens} tokens")
    return 0


if __name__ == "__main__":
    from mlx_tracer.backend.malloc import reexec

    reexec()  # measure under the malloc the mlx-tracer command runs with (MLX_TRACER_MALLOC=system: glibc)
    sys.exit(main())
